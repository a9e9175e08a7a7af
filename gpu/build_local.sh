#!/usr/bin/env bash
# gpu/build_local.sh: build test-backend-ops with CUDA (sm_90) on this CPU machine, for the GPU
# machine to run with no build there (`bash gpu/run.sh prebuilt DIR`).
#
#   bash gpu/build_local.sh NAME [PATCH...]
#
# Why: a fresh GPU machine spends 290-380 s building, a large share of a call's time; a carried binary
# runs the FLASH_ATTN_EXT cases and the perf cases in about 35 s a call. The binary is static
# (one file, about 72 MB, 41 MB as .xz: one per call fits the 64 MiB a call carries).
#
# The first build takes about 40 minutes on 2 cores (145 CUDA files); a later one with only
# ggml-oscar changed, about a minute. It needs nvcc (13 here) and cuBLAS: when the toolkit has
# no libcublas, install the PyPI wheel `nvidia-cublas` into it first (headers into its include/,
# libcublas*.so.13 into its lib/, plus the .so links). There is no libcuda on a machine without a
# GPU, so the build has GGML_CUDA_NO_VMM=ON (upstream's legacy memory pool; the kernels are the
# same). The PATCHes (gpu/candidates/*.patch) are applied to the build's copy of ggml-oscar only.
# Output: .devbin-NAME/test-backend-ops.xz (git ignores .devbin-*/ through .git/info/exclude);
# carry it: run(command="bash gpu/run.sh prebuilt .devbin-NAME", carry=[".devbin-NAME"]).
# LOCAL_TARGET=llama-batched-bench (or llama-bench, llama-server) builds that tool instead (the build
# gains llama.cpp's tools):
# run(command="bash gpu/run.sh prebuilt .devbin-NAME trace_batched 8",
#     carry=[".devbin-NAME", ".device/wheels", ".device/upstream.tar.xz"]).
set -euo pipefail
NAME=${1:?usage: gpu/build_local.sh NAME [PATCH...]}
shift
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PY:-$ROOT/.venv/bin/python}
WORK=${OSCAR_LOCAL_CUDA:-/tmp/oscar-local-cuda}
TREE=$WORK/tree
BUILD=$WORK/build
OUTDIR=$ROOT/.devbin-$NAME

command -v nvcc > /dev/null || [ -x /usr/local/cuda/bin/nvcc ] || { echo "build_local: no nvcc" >&2; exit 2; }
NVCC=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)

# the patched upstream tree (fetch.py: pinned sdist + llama.cpp/patches + ggml-oscar), copied once
SRC=$("$PY" -c "
import sys; sys.path.insert(0, '$ROOT/llama.cpp')
import fetch
print(fetch.prepare(fetch.default_cache(), None, fetch.HERE / 'patches', None))" | tail -1)
[ -d "$SRC/vendor/llama.cpp" ] && SRC=$SRC/vendor/llama.cpp
[ -f "$SRC/CMakeLists.txt" ] || { echo "build_local: no patched tree at $SRC" >&2; exit 2; }
# sync_changed FROM TO: copy the files of FROM that differ in TO (unchanged files keep their
# mtimes, so ninja rebuilds only what changed); *.orig (left by patch) stays behind
sync_changed() {
    (cd "$1" && find . -type f ! -name "*.orig") | while read -r f; do
        cmp -s "$1/$f" "$2/$f" || { mkdir -p "$(dirname "$2/$f")" && cp "$1/$f" "$2/$f"; }
    done
}

if [ ! -d "$TREE" ]; then
    mkdir -p "$WORK" && cp -r "$SRC" "$TREE"
fi
# the tree follows the patch series: after a patch changed, what differs is copied over and the
# stamp renewed
WANT=$(cat "$ROOT"/llama.cpp/patches/*.patch | sha256sum | cut -d' ' -f1)
if [ "$(cat "$TREE/oscar-patches.sha256" 2>/dev/null)" != "$WANT" ]; then
    sync_changed "$SRC" "$TREE"
    echo "$WANT" > "$TREE/oscar-patches.sha256"
fi
# ggml-oscar as it is in the repo now plus the patches, staged, then synced into the tree
STAGE=$WORK/stage
rm -rf "$STAGE" && mkdir -p "$STAGE" && cp -r "$ROOT/ggml-oscar" "$STAGE/"
for p in "$@"; do
    patch -p1 -s -d "$STAGE" < "$p" || { echo "build_local: $p does not apply" >&2; exit 2; }
done
sync_changed "$STAGE/ggml-oscar" "$TREE/ggml/src/ggml-oscar"
# and what ggml-oscar no longer has goes (the CUDA build compiles every ggml-oscar/cuda/*.cu)
(cd "$TREE/ggml/src/ggml-oscar" && find . -type f) | while read -r f; do
    [ -f "$STAGE/ggml-oscar/$f" ] || rm -f "$TREE/ggml/src/ggml-oscar/$f"
done

if [ ! -f "$BUILD/build.ninja" ]; then
    cmake -S "$TREE" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
        -DCMAKE_CUDA_COMPILER="$NVCC" -DGGML_CUDA_NO_VMM=ON -DGGML_NATIVE=OFF -DBUILD_SHARED_LIBS=OFF \
        -DLLAMA_BUILD_TESTS=ON -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TOOLS=OFF \
        -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF -DGGML_RPC=OFF > "$WORK/cmake.log" 2>&1 \
        || { echo "build_local: cmake failed (is cuBLAS in the toolkit?), see $WORK/cmake.log" >&2; exit 2; }
fi
# LOCAL_TARGET: the tool to build (one a call: each is about 40 MB as .xz, most of it ggml-cuda)
TARGET=${LOCAL_TARGET:-test-backend-ops}
# the options the target needs, off in the first configure (test-backend-ops needs none of them):
# llama.cpp's tools, and for llama-server its own switch
NEED=""
[ "$TARGET" = test-backend-ops ] || NEED="LLAMA_BUILD_TOOLS LLAMA_BUILD_COMMON"
[ "$TARGET" != llama-server ] || NEED="$NEED LLAMA_BUILD_SERVER"
ON=""
for o in $NEED; do
    grep -q "^$o:BOOL=ON" "$BUILD/CMakeCache.txt" || ON="$ON -D$o=ON"
done
if [ -n "$ON" ]; then
    cmake "$BUILD" $ON >> "$WORK/cmake.log" 2>&1 || { echo "build_local: cmake ($ON) failed, see $WORK/cmake.log" >&2; exit 2; }
fi
ninja -C "$BUILD" -j"$(nproc)" "$TARGET"
mkdir -p "$OUTDIR"
xz -T0 -6 -c "$BUILD/bin/$TARGET" > "$OUTDIR/$TARGET.xz"
grep -qx "/.devbin-\*/" "$ROOT/.git/info/exclude" 2> /dev/null || { mkdir -p "$ROOT/.git/info" && echo "/.devbin-*/" >> "$ROOT/.git/info/exclude"; }
echo "build_local: $OUTDIR/$TARGET.xz ($(du -h "$OUTDIR/$TARGET.xz" | cut -f1)); on the GPU machine:"
echo "  bash gpu/run.sh prebuilt .devbin-$NAME [FUNCTION ARGS]   (carry .devbin-$NAME; with llama-batched-bench also .device/wheels and .device/upstream.tar.xz)"
