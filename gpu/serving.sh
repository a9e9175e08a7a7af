# gpu/serving.sh: many sequences at once on the GPU machine; sourced by gpu/run.sh, whose
# build, synth_model, pyenv, cupti_injection and log it uses.
#
#   batched [NPP]      llama-batched-bench, unified cache and one stream per sequence, f16 vs oscar2
#   trace_batched [B]  kernel time by name of B sequences' decode steps (CUPTI), f16 vs oscar2
#   equal [GIB]        oscar bench --equal-memory: the most sequences each type fits in GIB, decoded
#   serve              oscar bench --serve: llama-server under concurrent streaming clients

# batched [NPP]: many sequences decoding together (llama-batched-bench, prompts of NPP tokens,
# default 4096, then 32 decode steps), f16 against oscar2 in one call: a unified cache (-kvu,
# llama-server's default) at BATCH_UNIFIED sequences, and one stream per sequence at BATCH_SPLIT
# (defaults below); prints S_TG (decode tokens/s over all sequences) per row with oscar2/f16.
# BATCH_OSCAR_ARGS go to the oscar2 runs only (e.g. "--oscar-sink 0 --oscar-recent 0": no window).
# BATCH_ROUNDS (default 1) repeats each layout's runs with the types' order reversed every other
# round (f16 oscar2, oscar2 f16, ...): a run right after another one's prefill finds the GPU
# warmer, and runs of one binary in a row differ by up to 10% from that alone. The ratio is of the
# rounds' means. Raw tables: $OUT/batched.txt, one block a run.
batched() {
    local npp=${1:-4096} M T kvu npl maxb tag r types
    pyenv
    M=$(synth_model) || return 1
    : > "$OUT/batched.txt"
    for kvu in -kvu ""; do
        if [ -n "$kvu" ]; then npl=${BATCH_UNIFIED:-1,4,16,32}; tag=unified; else npl=${BATCH_SPLIT:-1,8,32,64}; tag=split; fi
        maxb=$(tr ',' '\n' <<< "$npl" | sort -n | tail -1)
        for r in $(seq 1 "${BATCH_ROUNDS:-1}"); do
            types=${BATCH_TYPES:-f16 oscar2}
            [ $((r % 2)) = 1 ] || types=$(tr ' ' '\n' <<< "$types" | tac | tr '\n' ' ')
            for T in $types; do
                echo "## $tag $T round $r" >> "$OUT/batched.txt"
                "$B/bin/llama-batched-bench" -m $M -ngl 99 -fa on $kvu -c $((maxb*(npp + 64))) -npp $npp -ntg 32 -npl $npl \
                    -ctk $T -ctv $T $([ $T != oscar2 ] || echo ${BATCH_OSCAR_ARGS:-}) 2> "$OUT/batched.err" | grep -E '^\|' >> "$OUT/batched.txt" \
                    || log "batched $tag $T failed: $(tail -2 "$OUT/batched.err" | tr '\n' ' ')"
            done
        done
    done
    python3 - "$OUT/batched.txt" ${BATCH_TYPES:-f16 oscar2} <<'PY' | tee -a "$OUT/summary.txt"
import collections, sys
path, types = sys.argv[1], sys.argv[2:]
tg = collections.defaultdict(list)  # (layout, type, B) -> S_TG of each round
for line in open(path):
    if line.startswith("## "):
        layout, t = line.split()[1:3]
        continue
    cells = [c.strip() for c in line.strip().strip("|").split("|")]
    if len(cells) == 10 and cells[0].isdigit():
        tg[(layout, t, int(cells[2]))].append(float(cells[7]))
mean = lambda v: sum(v)/len(v)
for layout in ("unified", "split"):
    for b in sorted({b for (l, _, b) in tg if l == layout}):
        row = "  ".join(f"{t} " + (" / ".join(f"{x:.1f}" for x in tg[(layout, t, b)]) or "-") for t in types)
        ok = all(tg[(layout, t, b)] for t in types)
        ratio = f"  {types[-1]}/{types[0]} {mean(tg[(layout, types[-1], b)])/mean(tg[(layout, types[0], b)]):.2f}x" if ok else ""
        print(f"batched {layout:7s} B={b:<4d} S_TG  {row}{ratio}")
PY
}

# trace_batched [B]: where the time of B sequences' decode steps goes: llama-batched-bench
# (unified cache unless TRACE_KVU is empty, prompts of TRACE_NPP tokens, 16 decode steps) under
# the CUPTI injection library, f16 and oscar2 (TRACE_TYPES: oscar2 alone where f16's cache does
# not fit); gpu/trace_summary.py over the last 8 steps (wall, GPU busy, kernel time by name,
# oscar2 against f16)
trace_batched() {
    local b=${1:-16} npp=${TRACE_NPP:-4096} kvu=${TRACE_KVU--kvu} M T
    pyenv
    M=$(synth_model) || return 1
    for T in ${TRACE_TYPES:-oscar2 f16}; do
        OSCAR_TRACE_OUT="$OUT/trace_b${b}_$T.tsv" CUDA_INJECTION64_PATH=/tmp/kernel_trace.so \
            "$B/bin/llama-batched-bench" -m $M -ngl 99 -fa on $kvu -c $((b*(npp + 64))) -npp $npp -ntg 16 -npl $b \
            -ctk $T -ctv $T > "$OUT/trace_b${b}_$T.txt" 2> "$OUT/trace_b${b}_$T.err" \
            || log "trace_batched $T failed: $(tail -2 "$OUT/trace_b${b}_$T.err" | tr '\n' ' ')"
        log "trace_batched B=$b ${kvu:-per-sequence} npp $npp $T under tracing: $(grep -E '^\|' "$OUT/trace_b${b}_$T.txt" | tail -1)"
    done
    python3 gpu/trace_summary.py 8 $(for T in ${TRACE_TYPES:-oscar2 f16}; do echo "$OUT/trace_b${b}_$T.tsv"; done) 2>&1 | tee -a "$OUT/summary.txt"
    xz -T0 "$OUT"/trace_b${b}_*.tsv
}

# bench_tools: oscar's measuring tools on this machine: the build's llama.cpp tools first in PATH
# (tool_path finds them there)
bench_tools() {
    pyenv
    export PATH="$B/bin:$PATH"
}

# equal [GIB]: equal-memory throughput on the SHAPE model: per KV type (EQ_TYPES) and layout, the
# most sequences of EQ_CTX tokens whose KV cache fits GIB GiB (default 16), filled and decoded
# together (oscar bench --equal-memory); its tables into $OUT/equal, its tool logs as one tarball
equal() {
    local M
    bench_tools
    M=$(synth_model) || return 1
    log "equal memory: ${1:-16} GiB, sequences of ${EQ_CTX:-16384} tokens, types ${EQ_TYPES:-f16,oscar2}"
    python3 -m oscar_gguf.cli bench $M --equal-memory ${1:-16} --seq-ctx ${EQ_CTX:-16384} --types ${EQ_TYPES:-f16,oscar2} \
        ${EQ_LAYOUTS:+--layouts $EQ_LAYOUTS} -o "$OUT/equal" > "$OUT/equal.log" 2>&1 || log "equal failed: $(tail -3 "$OUT/equal.log")"
    cat "$OUT/equal/equal_memory.txt" 2>/dev/null | tee -a "$OUT/summary.txt"
    tar -C "$OUT/equal" -cJf "$OUT/equal-logs.tar.xz" logs && rm -rf "$OUT/equal/logs"
}

# serve: llama-server on the SHAPE model under SERVE_CLIENTS (4,16,64) concurrent streaming
# clients, with -np N and with the default slots, SERVE_TYPES side by side, prompts of
# SERVE_PROMPT tokens (oscar bench --serve); its tables into $OUT/serve, the server logs as one tarball
serve() {
    local M
    bench_tools
    M=$(synth_model) || return 1
    log "serve: clients ${SERVE_CLIENTS:-4,16,64}, types ${SERVE_TYPES:-f16,oscar2}, prompts of ${SERVE_PROMPT:-2048} tokens"
    python3 -m oscar_gguf.cli bench $M --serve --types ${SERVE_TYPES:-f16,oscar2} -np ${SERVE_CLIENTS:-4,16,64} \
        --prompt-tokens ${SERVE_PROMPT:-2048} --gen-tokens ${SERVE_GEN:-64} -o "$OUT/serve" > "$OUT/serve.log" 2>&1 \
        || log "serve failed: $(tail -3 "$OUT/serve.log")"
    cat "$OUT/serve/serve.txt" 2>/dev/null | tee -a "$OUT/summary.txt"
    tar -C "$OUT/serve" -cJf "$OUT/serve-logs.tar.xz" logs && rm -rf "$OUT/serve/logs"
}
