#!/usr/bin/env bash
# gpu/run.sh: build, check and time oscar2 on the GPU machine (library entry `device`).
#
#   bash gpu/run.sh build         unpack .device/upstream.tar.xz, CUDA build for sm_90 (ninja, incremental)
#   bash gpu/run.sh test          test-backend-ops (CUDA vs CPU), bit-exact/float64 checks, CPU-vs-CUDA greedy
#   bash gpu/run.sh bench [DEPTHS] llama-bench on an 8B-shaped random-weight model, f16/q8_0/q4_0/oscar2
#                                 (SHAPE, TYPES, REPS; DEEP=131072 adds tg32 there, DEPTHS "-" runs DEEP alone)
#   bash gpu/run.sh all           build + test + bench
#   bash gpu/run.sh assemble      append the carried parts of a full calibrated model (see assemble)
#   bash gpu/run.sh multi         CPU vs CUDA with layers split over all GPUs (-sm layer), and a bench
#   bash gpu/run.sh batched [NPP] many sequences decoding together, unified cache and one stream per
#                                 sequence, f16 vs oscar2 (llama-batched-bench; BATCH_UNIFIED, BATCH_SPLIT)
#   bash gpu/run.sh trace_batched [B]  kernel time by name of B sequences' decode steps, f16 vs oscar2
#   bash gpu/run.sh equal [GIB]   equal-memory throughput: oscar bench --equal-memory on the 8B shape
#   bash gpu/run.sh serve         llama-server under 4, 16, 64 concurrent clients: oscar bench --serve
#   bash gpu/run.sh quick         FLASH_ATTN_EXT CUDA vs CPU, and f16 vs oscar2 at the speed targets' depths, in one call
#   bash gpu/run.sh clocks [D]    tg32/tg128 at depth D (131072) with the SM clock and power logged beside it
#   bash gpu/run.sh profile [D]   where decode time goes: ncu kernel times at depth 0 (f16 vs oscar2),
#                                 and oscar2 with the window or the rotations turned off at depth D
#                                 (PROFILE_TYPES="f16 oscar2 oscar2:nowin", NCU_DEPTHS, ABLATE=0, DETAIL=1)
#   bash gpu/run.sh perf          test-backend-ops perf: one 8B attention layer, oscar2 against f16, decode at
#                                 0, 32k and 131k, prefill at 16k; PERF_PATCHES="a.patch b.patch a.patch+b.patch"
#                                 then checks and times each entry after an incremental rebuild
#   bash gpu/run.sh trace         the real timeline (CUPTI) of the last decode calls, oscar2 against f16:
#                                 wall, GPU busy and idle time, kernel time by name (TRACE_RUNS, TRACE_TYPES)
#   bash gpu/run.sh timeline      per-block timeline of the decode kernels, cold (llama-bench) and warm
#                                 (perf), with gpu/trace/decode-timeline.patch built in (TL_RUNS, TL_EVERY)
#   bash gpu/run.sh ab REF        the working tree's kernels against REF/ggml-oscar (a carried directory), or
#                                 against themselves with the patch REF (gpu/ab/*.patch), end to end, alternating
#                                 in one call (AB_RUNS, AB_ROUNDS, AB_REPS; AB_TOOL=batched: llama-batched-bench)
#   bash gpu/run.sh prebuilt DIR [FUNCTION ARGS]  no build: the tools in DIR from gpu/build_local.sh (carry
#                                 DIR): test-backend-ops runs the FLASH_ATTN_EXT cases and the perf cases;
#                                 with llama-batched-bench, FUNCTION runs on it (batched 16384, trace_batched 8)
#
# Needs what gpu/pack.py puts into .device/ (carry it). Logs and results go to $OUT.
set -uo pipefail
ROOT=$(pwd)
# many sequences at once: batched, trace_batched, equal, serve
source "$(dirname "${BASH_SOURCE[0]}")/serving.sh"
OUT=${OUT:-/tmp/oscar-out}
mkdir -p "$OUT"
export OSCAR_CACHE_DIR=/tmp/oscar-cache
TREE=$OSCAR_CACHE_DIR/src/llama-cpp-python-0.3.36
B=/tmp/oscar-build
ARCH=${CUDA_ARCH:-90}
log() { echo "[$(date +%H:%M:%S)] $*" | tee -a "$OUT/summary.txt"; }

# sync_oscar DIR: the tree's ggml-oscar made equal to DIR: only the files that differ are copied
# (a fresh copy's mtimes would make ninja rebuild them all), and files DIR lacks are removed
# (the CUDA build compiles every ggml-oscar/cuda/*.cu it finds, patch 0004)
sync_oscar() {
    local f src=$1 dst=$TREE/vendor/llama.cpp/ggml/src/ggml-oscar
    (cd "$src" && find . -type f) | while read -r f; do
        cmp -s "$src/$f" "$dst/$f" || { mkdir -p "$(dirname "$dst/$f")" && cp "$src/$f" "$dst/$f"; }
    done
    (cd "$dst" && find . -type f) | while read -r f; do
        [ -f "$src/$f" ] || rm -f "$dst/$f"
    done
}

build() {
    # the carried tree must come from the patches in this checkout (gpu/pack.py stamps it): a
    # patch changed since the packing would be missing from the build with no sign of it. A new
    # tarball replaces the unpacked tree, its files dated now (x -m) so that ninja rebuilds them.
    local want=$(cat llama.cpp/patches/*.patch | sha256sum | cut -d' ' -f1)
    if [ "$(cat "$TREE/oscar-patches.sha256" 2>/dev/null)" != "$want" ]; then
        rm -rf "$TREE" && mkdir -p "$OSCAR_CACHE_DIR/src"
        tar -xmf .device/upstream.tar.xz -C "$OSCAR_CACHE_DIR/src"
        if [ "$(cat "$TREE/oscar-patches.sha256" 2>/dev/null)" != "$want" ]; then
            log "build: .device/upstream.tar.xz was packed from other patches than llama.cpp/patches: run python gpu/pack.py"
            return 1
        fi
    fi
    # our sources as they are now (the tarball may be older than the last edit)
    sync_oscar ggml-oscar
    if [ ! -f "$B/build.ninja" ]; then
        cmake -S "$TREE/vendor/llama.cpp" -B "$B" -G Ninja -DCMAKE_BUILD_TYPE=Release \
            -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=$ARCH -DBUILD_SHARED_LIBS=ON \
            -DLLAMA_BUILD_TESTS=ON -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_APP=OFF \
            -DLLAMA_OPENSSL=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF -DGGML_RPC=OFF \
            > "$OUT/cmake.log" 2>&1 || { log "cmake failed"; tail -30 "$OUT/cmake.log"; return 1; }
    fi
    local t0=$(date +%s)
    ninja -C "$B" -k 0 -j"$(nproc)" ${TARGETS:-test-backend-ops llama-bench llama-batched-bench llama-cli llama-perplexity llama-server} > "$OUT/build.log" 2>&1 \
        || { log "build failed"; grep -E "error|Error" "$OUT/build.log" | head -40; return 1; }
    log "build ok in $(( $(date +%s) - t0 )) s"
}

pyenv() {
    if [ ! -d /tmp/site/gguf ]; then
        python3 -m pip install -q --no-index --no-deps --target /tmp/site .device/wheels/*.whl
    fi
    export PYTHONPATH="$ROOT:/tmp/site"
    export LLAMA_CPP_LIB_PATH="$B/bin"
}

# backend_ops OPS LOG: test-backend-ops, CUDA0 against CPU, for the oscar cases of OPS (comma-separated);
# logs the counts and the failing cases
backend_ops() {
    "$B/bin/test-backend-ops" test -b CUDA0 -o "$1" -p 'oscar' > "$OUT/$2" 2>&1
    # (the cases' lines only: the closing "Backend CUDA0: OK" is no case)
    local plain=$(sed 's/\x1b\[[0-9;]*m//g' "$OUT/$2" | grep -v '^ *Backend ')
    log "test-backend-ops $1 (oscar) CUDA0 vs CPU: $(grep -cE ': OK$' <<< "$plain") OK, $(grep -cE ': FAIL$' <<< "$plain") FAIL, $(grep -c 'not supported' <<< "$plain") not supported; $(tail -2 "$OUT/$2" | tr '\n' ' ')"
    grep -E ": FAIL$" <<< "$plain" | head -20 | tee -a "$OUT/summary.txt"
    # status: 0 when no case failed (the grep's own status was 1 then, under pipefail, and perf
    # took that for a failure and timed nothing)
    ! grep -qE ": FAIL$" <<< "$plain"
}

test_gpu() {
    local t0=$(date +%s)
    backend_ops SET_ROWS,GET_ROWS,CPY,FLASH_ATTN_EXT,MUL_MAT,OSCAR_ROTATE_STORE test-backend-ops.log

    pyenv
    python3 -m pytest -q -p no:cacheprovider tests/test_oscar2_ops.py tests/test_oscar2_format.py tests/test_cuda_kernels.py > "$OUT/pytest.log" 2>&1
    log "pytest (CPU + CUDA0 cases): $(tail -1 "$OUT/pytest.log")"
    grep -E "^(FAILED|ERROR) " "$OUT/pytest.log" | head -20 | tee -a "$OUT/summary.txt"

    # CPU vs CUDA end to end on the cut model (always carried), and on a full calibrated model
    # when one was assembled on the machine (GPU_MODEL, see `assemble`)
    e2e .device/smollm2-L*.gguf cut 16 32 ""
    # the same with a precision plan: layers 1 and 5 keep f16 keys beside oscar2 values
    plan_model .device/smollm2-L*.gguf /tmp/cut-plan.gguf 1,5 && e2e /tmp/cut-plan.gguf cut-plan 16 32 ""
    [ -f "$GPU_MODEL" ] && e2e "$GPU_MODEL" full 4 16 ""
    no_realloc .device/smollm2-L*.gguf
    log "tests done in $(( $(date +%s) - t0 )) s"
}

# plan_model SRC DST LAYERS: SRC's rotations and clips with oscar.f16_k_layers = LAYERS (a,b,...)
plan_model() {
    local M=$(ls $1 | head -1)
    [ -f "$2" ] && return 0
    python3 - "$M" "$2" "$3" <<'PY'
import sys
from oscar_gguf.convert import convert
from oscar_gguf.format import gguf_keys as K, oscar2
from oscar_gguf.format.gguf_read import read_model_info
from oscar_gguf.format.rotations import Rotations
src, dst, layers = sys.argv[1], sys.argv[2], tuple(int(i) for i in sys.argv[3].split(","))
info = read_model_info(src)
rot = Rotations(dict(info.k_rot), dict(info.v_rot), list(info.oscar[K.KEY_CLIP_K]), list(info.oscar[K.KEY_CLIP_V]),
                info.arch, info.n_layer, info.head_dim_k, oscar2.group_size(info.head_dim_k), {}, f16_k_layers=layers)
convert(src, dst, rot, replace=True)
PY
}

# no_realloc MODEL: a prefill past the window, then decode, must fit the buffers reserved when
# the context was made (GGML_SCHED_DEBUG_REALLOC=2 makes upstream's scheduler abort on any
# reallocation; with two buffer types, CUDA and pinned host, it cannot grow them silently)
no_realloc() {
    local M=$(ls $1 | head -1) kv
    for kv in oscar2 f16; do
        if GGML_SCHED_DEBUG_REALLOC=2 "$B/bin/llama-bench" -m "$M" -ngl 99 -fa 1 -ctk $kv -ctv $kv -d 1536 -p 512 -n 16 -r 2 \
                > "$OUT/no_realloc_$kv.txt" 2>&1; then
            log "no reallocation after the reserve, $kv KV (prefill 1536 + 512, decode 16): ok"
        else
            log "no reallocation after the reserve, $kv KV: FAILED ($(grep -m1 -E 'unexpected|abort|error' "$OUT/no_realloc_$kv.txt"))"
        fi
    done
}

# e2e MODEL TAG SINK RECENT "EXTRA GPU ARGS": CPU vs CUDA end to end with rotations and oscar2
#  1. teacher-forced: llama-perplexity KLD of the CUDA run against the CPU run on held-out text,
#     with ubatches of 512 (the prefill path) and of 1 token (the decode kernels), and an f16
#     cache as the control: how far CPU and CUDA differ anyway (the weights' matmuls). INT2
#     codes amplify those differences (a value near a code threshold flips), so oscar2's KLD is
#     larger than f16's even when the attention kernels agree to 1e-5.
#  2. greedy decoding, compared word by word (the user-visible check), oscar2 and f16. A small
#     window (SINK + RECENT) puts most of the 48 tokens into INT2 rows.
e2e() {
    local M=$(ls $1 | head -1) tag=$2 extra=($5)
    local W=(-ctk oscar2 -ctv oscar2 -fa on --oscar-sink $3 --oscar-recent $4)
    local T=oscar_gguf/data/eval/botchan.txt
    local kv ub KV
    kv_args() { if [ $1 = f16 ]; then KV=(-fa on); else KV=("${W[@]}"); fi; }
    for kv in oscar2 f16; do
        kv_args $kv
        for ub in 512 1; do
            local n=8
            [ $ub = 1 ] && n=2
            local base=/tmp/kld_cpu_${tag}_${kv}_$ub.bin
            [ -f $base ] || "$B/bin/llama-perplexity" -m "$M" -f $T -c 512 --chunks $n -b 512 -ub $ub "${KV[@]}" -ngl 0 -t 8 \
                --kl-divergence-base $base > "$OUT/kld_cpu_${tag}_${kv}_$ub.txt" 2>&1
            "$B/bin/llama-perplexity" -m "$M" -c 512 --chunks $n -b 512 -ub $ub "${KV[@]}" -ngl 99 "${extra[@]}" -t 8 \
                --kl-divergence-base $base --kl-divergence > "$OUT/kld_cuda_${tag}_${kv}_$ub.txt" 2>&1
            log "[$tag] CUDA vs CPU, $kv KV, ubatch $ub, teacher-forced ($n x 512 tokens of $T): $(grep -E '^Mean +KLD|^Maximum KLD|^Same top p' "$OUT/kld_cuda_${tag}_${kv}_$ub.txt" | tr -s ' ' | tr '\n' ';')"
        done
    done
    local P="The capital of France is Paris. The capital of Germany is"
    for kv in oscar2 f16; do
        kv_args $kv
        local args=(-m "$M" -p "$P" -n 48 -c 1024 "${KV[@]}" -st --temp 0 -lv 1)
        "$B/bin/llama-cli" "${args[@]}" -ngl 0  -t 8 < /dev/null > "$OUT/greedy_cpu_${tag}_$kv.txt" 2>&1
        "$B/bin/llama-cli" "${args[@]}" -ngl 99 "${extra[@]}" -t 8 < /dev/null > "$OUT/greedy_cuda_${tag}_$kv.txt" 2>&1
        echo -n "[$tag, $kv KV] " | tee -a "$OUT/summary.txt"
        python3 - "$OUT/greedy_cpu_${tag}_$kv.txt" "$OUT/greedy_cuda_${tag}_$kv.txt" <<'EOF' | tee -a "$OUT/summary.txt"
import sys
def gen(p):
    # the generated text: the lines after the echoed prompt ("> ..."), up to the timing line
    lines = open(p, errors="replace").read().splitlines()
    start = next((i for i, ln in enumerate(lines) if ln.startswith("> ")), None)
    if start is None:
        return "(no generation found)"
    out = []
    for ln in lines[start + 1:]:
        if ln.startswith("[ Prompt"):
            break
        out.append(ln)
    return "\n".join(out).strip()
a, b = gen(sys.argv[1]), gen(sys.argv[2])
wa, wb = a.split(), b.split()
same = 0
for x, y in zip(wa, wb):
    if x != y:
        break
    same += 1
print(f"greedy CPU vs CUDA: {same} identical leading words of {len(wa)} / {len(wb)}; identical text: {a == b}")
print("CPU :", a[:200].replace("\n", " "))
print("CUDA:", b[:200].replace("\n", " "))
EOF
    done
}

# A full calibrated model is larger than one call may carry (64 MiB): gpu/pack.py --full MODEL
# splits it into .device/full.gguf.part-NN plus .device/full.gguf.sha256; each call carries some
# parts and `assemble` appends them, in order, to /tmp/oscar-full.gguf on the warm machine.
assemble() {
    local dst=/tmp/oscar-full.gguf part
    [ -f .device/full.gguf.sha256 ] || return 0
    for part in .device/full.gguf.part-*; do
        [ -f "$part" ] || continue
        grep -qx "$(basename $part)" $dst.parts 2>/dev/null && continue
        cat "$part" >> $dst.partial && basename "$part" >> $dst.parts
    done
    if [ -f $dst.partial ] && [ "$(sha256sum < $dst.partial | cut -d' ' -f1)" = "$(cat .device/full.gguf.sha256)" ]; then
        mv $dst.partial $dst && log "assembled $dst ($(stat -c %s $dst) bytes, sha256 ok)"
    else
        log "assemble: have $(cat $dst.parts 2>/dev/null | tr '\n' ' ')"
    fi
}

# layers split over all GPUs of the machine (llama.cpp's default -sm layer): CPU vs multi-GPU
# end to end, and a short llama-bench
multi() {
    local n=$(nvidia-smi -L | wc -l)
    [ "$n" -ge 2 ] || { log "multi: needs 2 GPUs, found $n"; return 1; }
    log "multi: $n GPUs, -sm layer"
    e2e .device/smollm2-L*.gguf cut-sm-layer 16 32 "-sm layer"
    [ -f "$GPU_MODEL" ] && e2e "$GPU_MODEL" full-sm-layer 4 16 "-sm layer"
    log "multi: CUDA1 in use: $(grep -h -c 'CUDA1' "$OUT"/kld_cuda_cut-sm-layer_oscar2_1.txt) log lines, e.g. $(grep -h 'CUDA1' "$OUT"/kld_cuda_cut-sm-layer_oscar2_1.txt | head -2 | tr -s ' ' | tr '\n' '|')"
    SPLIT="-sm layer" TYPES="f16 oscar2" REPS=1 TG=32 bench 0,16384
}

# environment: SHAPE (llama3-8b, qwen3-8b, ...), TYPES, TG (tokens per tg test), REPS

# synth_model: the random-weight Q4_0 model of SHAPE with random rotations, made once per machine;
# prints its path
synth_model() {
    local shape=${SHAPE:-llama3-8b}
    local M=/tmp/$shape-q4_0.gguf
    if [ ! -f $M ]; then
        python3 -c "from oscar_gguf.measure.synth import write_synthetic; write_synthetic('$shape', 'q4_0', '$M', rotations=True)" \
            > "$OUT/synth.log" 2>&1 || { log "synth failed"; tail "$OUT/synth.log" >&2; return 1; }
    fi
    echo $M
}

# profile [DEPTH]: where decode time goes.
#  (1) ncu GPU time per kernel of 8 decoded tokens, f16 against oscar2, at depth 0 and at DEPTH
#      (default 16384; NCU_DEPTHS overrides both), per token and summed by kernel name: only the
#      launches after the depth's prefill count (those after the last prefill attention kernel)
#  (2) with DETAIL=1: ncu's detailed sections (throughput, stalls, occupancy) of the decode
#      attention kernels at DEPTH
#  (3) unless ABLATE=0: llama-bench at DEPTH for oscar2 with the window and/or the calibrated rotations turned off,
#      beside f16 and plain oscar2
profile() {
    local depth=${1:-16384} M
    pyenv
    M=$(synth_model) || return 1
    local NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
    if [ -n "$NCU" ]; then
        local T d
        # at a depth only the attention kernels (the prefill's tell where the decode starts) and the
        # rotations are timed: timing every launch of a long prefill takes minutes (depth 0 has all)
        local filter='regex:flash_attn|k_fa_|k_rotate'
        local types=${PROFILE_TYPES:-f16 oscar2}
        for d in ${NCU_DEPTHS:-0 $depth}; do
            for T in $types; do
                # (file names without ':', which the device's file transfer refuses)
                "$NCU" --clock-control none --metrics gpu__time_duration.sum --csv $([ $d = 0 ] || echo "-k $filter") \
                    "$B/bin/llama-bench" -m $M -ngl 99 -fa 1 $(variant_args $T) -d $d -p 0 -n 8 -r 1 > "$OUT/ncu_${T//:/_}_d$d.csv" 2> "$OUT/ncu_${T//:/_}_d$d.err" \
                    || log "ncu $T d$d failed: $(tail -3 "$OUT/ncu_${T//:/_}_d$d.err")"
            done
        done
        PROFILE_TYPES=$types python3 - "$OUT" ${NCU_DEPTHS:-0 $depth} <<'EOF' | tee -a "$OUT/summary.txt"
import csv, os, sys, pathlib, collections, re
out = pathlib.Path(sys.argv[1])
def load(T, d):
    rows = []
    lines = (out / f"ncu_{T.replace(':', '_')}_d{d}.csv").read_text(errors="replace").splitlines()
    start = next((i for i, l in enumerate(lines) if l.startswith('"ID"')), None)
    for r in csv.DictReader(lines[start:] if start is not None else []):
        if r.get("Metric Name") != "gpu__time_duration.sum":
            continue
        v = float(r["Metric Value"].replace(",", ""))
        rows.append((re.sub(r"^void ", "", re.sub(r"[<(].*", "", r["Kernel Name"]).strip())[:60],
                     v/1000.0 if r.get("Metric Unit") in ("ns", "nsecond") else v))
    # decode only: after the last launch of a prefill attention kernel (upstream's f16 mma/tile)
    last = max((i for i, (n, _) in enumerate(rows) if n.startswith(("flash_attn_ext_f16", "flash_attn_tile"))), default=-1)
    return rows[last + 1:]
for d in sys.argv[2:]:
    for T in os.environ["PROFILE_TYPES"].split():
        rows = load(T, d)
        t = collections.defaultdict(float); n = collections.Counter()
        for name, v in rows:
            t[name] += v; n[name] += 1
        tokens = 9  # llama-bench: a warm-up token + 8
        print(f"ncu depth {d}, {T}: {len(rows)} decode kernels{' (attention and decode rotations only)' if d != '0' else ''}, {sum(t.values())/tokens:.0f} us GPU time per token; by name (us per token, per call):")
        for k, v in sorted(t.items(), key=lambda kv: -kv[1])[:16]:
            print(f"  {v/tokens:8.1f} us/token {n[k]//tokens:4d} x {v/n[k]:7.2f} us  {k}")
EOF
        if [ "${DETAIL:-0}" = 1 ]; then
            for T in ${DETAIL_TYPES:-f16 oscar2}; do
                "$NCU" --clock-control none --set detailed --section WarpStateStats --section SchedulerStats -k regex:'k_fa_int2_mma|flash_attn_ext_vec|k_fa_combine|flash_attn_combine' \
                    --launch-skip 64 --launch-count 4 \
                    "$B/bin/llama-bench" -m $M -ngl 99 -fa 1 -ctk $T -ctv $T -d $depth -p 0 -n 4 -r 1 > "$OUT/ncu_detail_${T}_d$depth.txt" 2>&1 \
                    || log "ncu detail $T failed: $(tail -3 "$OUT/ncu_detail_${T}_d$depth.txt")"
            done
        fi
    else
        log "profile: no ncu on this machine"
    fi
    [ "${ABLATE:-1}" = 1 ] || return 0
    log "profile at depth $depth: f16, oscar2, oscar2 without window, without rotations, without both"
    local name args
    for name in f16 oscar2 nowin norot nowin_norot; do
        # nowin_norot -> oscar2:nowin:norot (variant_args)
        case $name in
            f16|oscar2) args=($(variant_args $name)) ;;
            *)          args=($(variant_args oscar2:${name//_/:})) ;;
        esac
        "$B/bin/llama-bench" -m $M -ngl 99 -fa 1 "${args[@]}" -d 0,$depth -p 512 -n 32 -r 2 -o json > "$OUT/prof_$name.json" 2> "$OUT/prof_$name.err" \
            || log "bench $name failed: $(tail -3 "$OUT/prof_$name.err")"
    done
    python3 - "$OUT" <<'EOF' | tee -a "$OUT/summary.txt"
import json, sys, pathlib
out = pathlib.Path(sys.argv[1]); res = {}
for name in ("f16", "oscar2", "nowin", "norot", "nowin_norot"):
    try:
        for r in json.loads((out / f"prof_{name}.json").read_text()):
            res[(name, "pp" if r["n_prompt"] else "tg", r["n_depth"])] = r["avg_ts"]
    except Exception as e:
        print(name, "no result", e)
for kind in ("tg", "pp"):
    for d in sorted({k[2] for k in res}):
        base = res.get(("f16", kind, d))
        cells = [f"{n} {res[(n, kind, d)]:8.1f} ({res[(n, kind, d)]/base:4.2f}x)" for n in ("f16", "oscar2", "nowin", "norot", "nowin_norot")
                 if (n, kind, d) in res and base]
        print(f"{kind} d={d:6d}  " + "  ".join(cells))
EOF
}

bench() {
    local depths=${1:-0,4096,16384,32768}
    local shape=${SHAPE:-llama3-8b} types=${TYPES:-f16 q8_0 q4_0 oscar2} M
    pyenv
    M=$(synth_model) || return 1
    python3 - <<'EOF' | tee -a "$OUT/summary.txt"
import torch, time
x = torch.empty(2**30, dtype=torch.uint8, device="cuda"); y = torch.empty_like(x)
for _ in range(3): y.copy_(x)
torch.cuda.synchronize(); t = time.perf_counter(); n = 20
for _ in range(n): y.copy_(x)
torch.cuda.synchronize(); dt = (time.perf_counter() - t)/n
print(f"device copy bandwidth: {2*x.numel()/dt/1e9:.0f} GB/s (read + write of 1 GiB)")
EOF
    log "bench $shape, depths $depths${DEEP:+ and $DEEP}, types $types"
    # ("-": no depths but DEEP's, so that a long DEEP run can take a call of its own)
    [ "$depths" = - ] || for T in $types; do
        "$B/bin/llama-bench" -m $M -ngl 99 ${SPLIT:-} -fa 1 -ctk $T -ctv $T -d "$depths" -p 512 -n ${TG:-64} -r ${REPS:-2} -o json \
            > "$OUT/bench_$T.json" 2> "$OUT/bench_$T.err" || log "bench $T failed: $(tail -3 "$OUT/bench_$T.err")"
        log "bench $T done"
    done
    # DEEP=131072: one more tg32 at that depth, 1 repetition (a prefill of DEEP tokens per test),
    # into deep_T.json and dDEEP.json (d131072.json is what gpu/plot_tg.py reads)
    if [ -n "${DEEP:-}" ]; then
        for T in $types; do
            "$B/bin/llama-bench" -m $M -ngl 99 ${SPLIT:-} -fa 1 -ctk $T -ctv $T -d $DEEP -p 0 -n 32 -r 1 -o json \
                > "$OUT/deep_$T.json" 2> "$OUT/deep_$T.err" || log "bench $T d$DEEP failed: $(tail -3 "$OUT/deep_$T.err")"
            log "bench $T d$DEEP done"
        done
    fi
    python3 - "$OUT" "$shape" "${DEEP:-}" <<'EOF' | tee -a "$OUT/summary.txt"
import json, sys, pathlib
out = pathlib.Path(sys.argv[1]); rows = {}; deep = {}
for T in ("f16", "q8_0", "q4_0", "oscar2"):
    for name in (f"bench_{T}.json", f"deep_{T}.json"):
        if not (out / name).exists():
            continue
        try:
            for r in json.loads((out / name).read_text()):
                kind = "pp" if r["n_prompt"] else "tg"
                rows[(T, kind, r["n_depth"])] = r["avg_ts"]
                if name.startswith("deep") and kind == "tg":
                    deep[T] = r["avg_ts"]
        except Exception as e:
            print(T, name, "no result", e)
if deep:
    (out / f"d{sys.argv[3]}.json").write_text(json.dumps({
        "command": f"llama-bench -m {sys.argv[2]}-q4_0.gguf -ngl 99 -fa 1 -ctk T -ctv T -d {sys.argv[3]} -p 0 -n 32 -r 1",
        f"tg32_d{sys.argv[3]}_tokens_per_s": deep}, indent=1) + "\n")
depths = sorted({d for (_, _, d) in rows})
for kind in ("tg", "pp"):
    print(f"{kind} tokens/s (ratio to f16)")
    for d in depths:
        base = rows.get(("f16", kind, d))
        if not any((T, kind, d) in rows for T in ("f16", "q8_0", "q4_0", "oscar2")):
            continue
        cells = []
        for T in ("f16", "q8_0", "q4_0", "oscar2"):
            v = rows.get((T, kind, d))
            cells.append(f"{T} {v:8.1f} ({v/base:4.2f}x)" if v and base else f"{T} -")
        print(f"  d={d:6d}  " + "  ".join(cells))
EOF
}

# clocks [DEPTH]: decode right after a long prefill, with the SM clock and power logged beside it
# (nvidia-smi every 250 ms into clocks-smi.csv): tg32 and tg128 at DEPTH (default 131072), one
# repetition per type of CLOCK_TYPES (default "oscar2 f16 oscar2"). Why: at 131k oscar2's decode
# varies by up to 16% between machines and runs where f16's varies by 3%; this tells whether the
# prefill's power cap carries into the decode (on the H100 it does not: the SM clock is back at
# 1980 MHz before the decode, gpu/results/h100-speed/).
clocks() {
    local depth=${1:-131072} M T
    pyenv
    M=$(synth_model) || return 1
    nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active \
        --format=csv -lms 250 > "$OUT/clocks-smi.csv" &
    local smi=$!
    for T in ${CLOCK_TYPES:-oscar2 f16 oscar2}; do
        log "clocks: $T at $depth, start"
        "$B/bin/llama-bench" -m $M -ngl 99 -fa 1 -ctk $T -ctv $T -d $depth -p 0 -n 32,128 -r 1 -o csv 2> "$OUT/clocks.err" \
            | log_bench "clocks $T"
    done
    kill $smi
}

# variant_args NAME: llama-bench arguments of a KV type, or of oscar2 with parts turned off:
# oscar2:nowin (no window), oscar2:norot (no rotations), oscar2:nowin:norot (neither). (Parts of
# the CUDA code are turned off by a patch and a build of their own: ab, gpu/ab/.)
variant_args() {
    local t=${1%%:*}
    echo "-ctk $t -ctv $t"
    [[ $1 == *:nowin* ]] && echo "--oscar-sink 0 --oscar-recent 0"
    [[ $1 == *:norot* ]] && echo "--oscar-rot none"
    return 0
}

# quick: one call's worth of checking after a kernel change, for a tight device budget
# (QUICK_TYPES="oscar2 oscar2:nowin f16" adds variants, QUICK_RUNS="-d 0 -n 64;-d 16384 -p 512 -n 0"
# replaces the runs, QUICK_REPS the repetitions):
# FLASH_ATTN_EXT CUDA vs CPU (the oscar cases of test-backend-ops), then f16 against oscar2:
# tg64 at depths 0 and 32768, pp512 at 16384, and tg32 at 131072 last (the longest: a 131k prefill
# per type), each line logged as soon as it is measured
# log_bench PREFIX: llama-bench's CSV on stdin, one logged line a test: "PREFIX tg64 d32768: N tok/s"
log_bench() {
    python3 -c "
import csv, sys
for r in csv.DictReader(sys.stdin):
    kind = 'pp' if int(r['n_prompt']) else 'tg'
    print(f\"{sys.argv[1]} {kind}{int(r['n_prompt']) or int(r['n_gen'])} d{r['n_depth']}: {float(r['avg_ts']):.2f} tok/s\")
" "$1" | while read -r line; do log "$line"; done
}

quick() {
    local M
    pyenv
    M=$(synth_model) || return 1
    backend_ops FLASH_ATTN_EXT test-backend-ops-fa.log
    local T args
    local runs=("-d 0,32768 -p 0 -n 64" "-d 16384 -p 512 -n 0" "-d 131072 -p 0 -n 32")
    [ -n "${QUICK_RUNS:-}" ] && IFS=';' read -ra runs <<< "$QUICK_RUNS"
    for args in "${runs[@]}"; do
        for T in ${QUICK_TYPES:-oscar2 f16}; do
            "$B/bin/llama-bench" -m $M -ngl 99 -fa 1 $(variant_args $T) $args -r ${QUICK_REPS:-1} -o csv 2> "$OUT/quick.err" \
                | log_bench "quick $T"
        done
    done
}

# ab REF: the working tree's kernels against those of REF/ggml-oscar (e.g. a commit's
# ggml-oscar from `git archive`, carried), or against the working tree's with the patch REF
# applied (gpu/ab/*.patch: a design choice turned off), end to end on one machine in one call,
# because runs on different machines or hours differ by 3-5%. Builds the tool, keeps its
# libggml-cuda, rebuilds that library from the reference sources, then runs AB_RUNS (";"-separated
# arguments of the tool, oscar2 KV) AB_ROUNDS times, alternating which build goes first, by
# swapping the library in place. The tree is left with the working tree's sources.
# AB_TOOL=batched: llama-batched-bench instead of llama-bench, AB_RUNS e.g. "-kvu -npp 4096
# -ntg 32 -npl 4,16,32" (a context of AB_CTX cells, default 32 x 4160); S_TG per row.
ab() {
    local ref=${1:?ab: the carried directory holding the reference ggml-oscar, or a patch}
    local M lib
    if [[ $ref == *.patch ]]; then
        local patch=$(readlink -f "$ref")
        ref=/tmp/ab-ref
        rm -rf $ref && mkdir -p $ref && cp -r ggml-oscar $ref/
        (cd $ref && apply_patch "$patch") || { log "ab: $patch does not apply"; return 1; }
    fi
    [ -d "$ref/ggml-oscar" ] || { log "ab: no $ref/ggml-oscar"; return 1; }
    local tool=llama-bench
    [ "${AB_TOOL:-}" = batched ] && tool=llama-batched-bench
    TARGETS=$tool build || return 1
    pyenv
    M=$(synth_model) || return 1
    lib=$(cd "$B/bin" && ls libggml-cuda.so.*.* | head -1)
    mkdir -p /tmp/ab && cp "$B/bin/$lib" /tmp/ab/new.so
    sync_oscar "$ref/ggml-oscar"
    # (ninja itself: build() would copy the working tree's sources back first)
    ninja -C "$B" $tool > "$OUT/build-ref.log" 2>&1 || { log "ab: the reference build failed"; tail -20 "$OUT/build-ref.log"; return 1; }
    cp "$B/bin/$lib" /tmp/ab/ref.so
    sync_oscar ggml-oscar
    local runs r args which order
    IFS=';' read -ra runs <<< "${AB_RUNS:--d 0,32768 -p 0 -n 64}"
    for r in $(seq 1 "${AB_ROUNDS:-3}"); do
        order="new ref"; [ $((r % 2)) = 0 ] && order="ref new"
        for args in "${runs[@]}"; do
            for which in $order; do
                cp /tmp/ab/$which.so "$B/bin/$lib"
                if [ $tool = llama-batched-bench ]; then
                    "$B/bin/llama-batched-bench" -m $M -ngl 99 -fa on -c ${AB_CTX:-133120} -ctk oscar2 -ctv oscar2 $args 2> "$OUT/ab.err" \
                        | awk -v tag="ab round $r $which ($args)" -F'|' 'NF == 12 && $2 ~ /[0-9]/ {
                              printf "%s B=%d S_TG %.1f\n", tag, $4, $9 }' | while read -r line; do log "$line"; done
                else
                    "$B/bin/llama-bench" -m $M -ngl 99 -fa 1 -ctk oscar2 -ctv oscar2 $args -r ${AB_REPS:-2} -o csv 2> "$OUT/ab.err" \
                        | log_bench "ab round $r $which"
                fi
            done
        done
    done
    cp /tmp/ab/new.so "$B/bin/$lib"
}

# trace: the real timeline of the last decode calls (gpu/trace/kernel_trace.cpp, CUPTI; the
# device has no nsys): wall, GPU busy and idle time per call, and kernel time by name, the first
# of TRACE_TYPES against the last. TRACE_RUNS="ARGS|N;..." (N: the last N calls are summed):
# default the timed pp512 ubatch at 16384 and the last 16 tokens of tg32 at 32768
# cupti_injection: gpu/trace/kernel_trace.cpp built against the toolkit's CUPTI into
# /tmp/kernel_trace.so (CUDA_INJECTION64_PATH loads it into a tool; OSCAR_TRACE_OUT names its trace)
cupti_injection() {
    [ -f /tmp/kernel_trace.so ] && return 0
    local C=$(dirname "$(dirname "$(readlink -f "$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)")")")
    local lib=$(ls "$C"/lib64/libcupti.so "$C"/targets/x86_64-linux/lib/libcupti.so "$C"/extras/CUPTI/lib64/libcupti.so 2>/dev/null | head -1)
    local inc=$(dirname "$(ls "$C"/include/cupti.h "$C"/targets/x86_64-linux/include/cupti.h "$C"/extras/CUPTI/include/cupti.h 2>/dev/null | head -1)")
    [ -n "$lib" ] || { log "trace: no libcupti under $C"; return 1; }
    g++ -O2 -shared -fPIC -I"$inc" -I"$C/include" gpu/trace/kernel_trace.cpp -o /tmp/kernel_trace.so -L"$(dirname "$lib")" -lcupti \
        -Wl,-rpath,"$(dirname "$lib")" || { log "trace: the injection library did not build"; return 1; }
}

trace() {
    local M
    pyenv
    M=$(synth_model) || return 1
    cupti_injection || return 1
    local run args n T first last i=0
    IFS=';' read -ra runs <<< "${TRACE_RUNS:--d 16384 -p 512 -n 0|1;-d 32768 -p 0 -n 32|16}"
    for run in "${runs[@]}"; do
        args=${run%|*}; n=${run##*|}; i=$((i + 1)); first=; last=
        for T in ${TRACE_TYPES:-oscar2 f16}; do
            local f="$OUT/trace${i}_${T//:/_}.tsv"
            OSCAR_TRACE_OUT="$f" CUDA_INJECTION64_PATH=/tmp/kernel_trace.so \
                "$B/bin/llama-bench" -m $M -ngl 99 -fa 1 $(variant_args $T) $args -r 1 -o csv 2> "$OUT/trace.err" \
                | python3 -c "
import csv, sys
for r in csv.DictReader(sys.stdin):
    print(f\"trace $T ($args) under tracing: {float(r['avg_ts']):.2f} tok/s\")
" | while read -r line; do log "$line"; done
            [ -z "$first" ] && first=$f
            last=$f
        done
        python3 gpu/trace_summary.py "$n" "$first" "$last" 2>&1 | tee -a "$OUT/summary.txt"
        # decode runs: a layer's chain from k's RoPE to the combine (prefill runs have no combine)
        python3 gpu/trace_layers.py "$OUT"/trace${i}_*.tsv 2> /dev/null | tee -a "$OUT/summary.txt" || true
        xz -T0 "$OUT"/trace${i}_*.tsv
    done
}

# perf: the attention alone, no model and no prefill of the depth, so a kernel change is timed in
# seconds; the cases are oscar2_add_backend_ops_perf (ggml-oscar/tests/oscar2-backend-ops.inc)
# (an entry a.patch+b.patch applies both)
perf() {
    perf_once committed
    local P part name applied ok
    for P in ${PERF_PATCHES:-}; do
        name=$(tr '+' '\n' <<< "$P" | xargs -n1 basename | sed 's/\.patch$//' | paste -sd+)
        applied=()
        ok=1
        for part in ${P//+/ }; do
            apply_patch "$part" && applied=("$part" "${applied[@]}") || { log "perf: $part does not apply"; ok=0; break; }
        done
        if [ $ok = 1 ]; then
            TARGETS=test-backend-ops build && backend_ops FLASH_ATTN_EXT "test-backend-ops-fa-$name.log" && perf_once "$name"
        fi
        for part in ${applied[@]+"${applied[@]}"}; do
            apply_patch "$part" -R
        done
    done
}

# prebuilt DIR [FUNCTION ARGS...]: tools built on the CPU machine (gpu/build_local.sh: static,
# sm_90), in seconds instead of a 290-380 s build. With test-backend-ops: the FLASH_ATTN_EXT
# checks and the perf cases; with llama-batched-bench: FUNCTION (batched, trace_batched) on it
prebuilt() {
    local dir=${1:?prebuilt: the carried directory} f
    shift
    B=/tmp/oscar-prebuilt
    mkdir -p "$B/bin"
    for f in "$dir"/*.xz; do
        xz -dc "$f" > "$B/bin/$(basename "$f" .xz)" && chmod +x "$B/bin/$(basename "$f" .xz)" || return 1
    done
    # cuBLAS of the machine's toolkit (the binaries link libcublas.so.13 dynamically)
    export LD_LIBRARY_PATH=/usr/local/cuda/targets/x86_64-linux/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
    if [ -f "$dir/test-backend-ops.xz" ]; then
        backend_ops FLASH_ATTN_EXT "test-backend-ops-fa-$(basename "$dir").log"
        perf_once "$(basename "$dir")"
    fi
    if [ $# -gt 0 ]; then
        # the pinned tree (its vocab files, for synth_model): carry .device/upstream.tar.xz
        if [ ! -d "$TREE" ]; then
            mkdir -p "$OSCAR_CACHE_DIR/src" && tar -xmf .device/upstream.tar.xz -C "$OSCAR_CACHE_DIR/src" || return 1
        fi
        [ "$1" != trace_batched ] || cupti_injection || return 1
        "$@"
    fi
}

# apply_patch FILE [-R]: patch(1), or git apply where the machine has no patch
apply_patch() {
    if command -v patch > /dev/null; then
        patch -p1 -s ${2:-} < "$1"
    else
        git apply ${2:-} "$1"
    fi
}

perf_once() {
    "$B/bin/test-backend-ops" perf -b CUDA0 -o FLASH_ATTN_EXT -p 'oscar_f16_baseline|live=' > "$OUT/perf_$1.log" 2>&1
    sed 's/\x1b\[[0-9;]*m//g' "$OUT/perf_$1.log" | grep -E "^ *FLASH_ATTN_EXT" | sed 's/^ *//' | while read -r line; do log "perf $1: $line"; done
}

# timeline: the per-block timeline of the decode kernels (rotate-store, attention, combine): each
# block's start and end, and its time between marks in the code (gpu/trace/decode-timeline.patch,
# applied for the build and reverted after). Cold in llama-bench (graphs off, so that the host can
# sync every TL_EVERY attention calls and print the last launch of each kernel; TL_RUNS=";"-separated
# llama-bench arguments, oscar2 KV; the third print of each run also as one CSV line a block,
# tl-blocks-N.csv), and warm in test-backend-ops perf. The marks, attention: 1 the grid wait, 2 the
# window chunk, 3 the query's quantization (ptxas may hoist the first row loads above the mark),
# 4 the cache rows, 5 the partial's store; combine: 1 U's loads, 2 the wait, 3 the weights, 4 the
# sums, 5 the un-rotation; rotate-store: 1 A's loads, 2 the wait, 3 x, 4 the product, 5 the stores.
timeline() {
    local M args i=0 raw=/tmp/oscar-timeline
    pyenv
    M=$(synth_model) || return 1
    # (llama-bench's and test-backend-ops' own output stays in $raw: a call brings back 8 files)
    mkdir -p $raw
    IFS=';' read -ra runs <<< "${TL_RUNS:--d 0 -p 0 -n 64;-d 32768 -p 0 -n 64}"
    for args in "${runs[@]}"; do
        i=$((i + 1))
        GGML_CUDA_DISABLE_GRAPHS=1 OSCAR_EXP_TIMELINE=${TL_EVERY:-301} OSCAR_EXP_TIMELINE_CSV=$OUT/tl-blocks-$i.csv \
            "$B/bin/llama-bench" -m $M -ngl 99 -fa 1 -ctk oscar2 -ctv oscar2 \
            $args -r 1 -o csv > "$raw/tl-bench-$i.csv" 2> "$raw/tl-bench-$i.err"
        log "timeline llama-bench $args:"
        grep -A3 "oscar timeline" "$raw/tl-bench-$i.err" | tee -a "$OUT/summary.txt"
    done
    local pat
    for pat in 'kv=256,n_hp=256,.*live=' 'kv=32768,.*live=' 'kv=131072,.*live='; do
        i=$((i + 1))
        GGML_CUDA_DISABLE_GRAPHS=1 OSCAR_EXP_TIMELINE=${TL_EVERY:-301} "$B/bin/test-backend-ops" perf -b CUDA0 -o FLASH_ATTN_EXT -p "$pat" \
            > "$raw/tl-perf-$i.txt" 2>&1
        log "timeline test-backend-ops perf (warm) $pat:"
        grep -E "oscar timeline|^  (attention|combine)|us/run" "$raw/tl-perf-$i.txt" | sed 's/\x1b\[[0-9;]*m//g' | tail -7 | tee -a "$OUT/summary.txt"
    done
}

GPU_MODEL=${GPU_MODEL:-/tmp/oscar-full.gguf}
case "${1:-all}" in
    timeline) apply_patch gpu/trace/decode-timeline.patch && { TARGETS="llama-bench test-backend-ops" build && timeline;
              apply_patch gpu/trace/decode-timeline.patch -R; } ;;
    build) build ;;
    assemble) assemble ;;
    multi) build && assemble && multi ;;
    test)  build && assemble && test_gpu ;;
    bench) build && bench "${2:-}" ;;
    profile) build && profile "${2:-}" ;;
    quick) build && quick ;;
    batched) build && batched "${2:-}" ;;
    trace_batched) build && cupti_injection && trace_batched "${2:-}" ;;
    equal) build && equal "${2:-}" ;;
    serve) build && serve ;;
    clocks) build && clocks "${2:-}" ;;
    perf)  build && perf ;;
    trace) build && trace ;;
    ab)    ab "${2:-}" ;;
    prebuilt) shift; prebuilt "$@" ;;
    all)   build && assemble && test_gpu && bench "${2:-}" ;;
esac
cat "$OUT/summary.txt" 2>/dev/null | tail -40
