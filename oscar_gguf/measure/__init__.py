"""The measuring tools: `oscar eval` (KLD and PPL against f16 KV; --passkey), `oscar bench`
(llama-bench per KV type and depth, with a roofline; --serve: llama-server under concurrent
clients), `oscar synth` (random-weight GGUFs with real shapes) and `oscar demo` (the whole job
on one model).

    cli.py          the eval, bench and synth subcommands (`oscar demo` is in oscar_gguf/cli.py)
    evaluate.py     `oscar eval`: the f16 reference run, then one run per KV setting
    passkey.py      `oscar eval --passkey`: needle-in-a-haystack retrieval through llama-server
    bench.py        `oscar bench` and the decode roofline
    serve.py        `oscar bench --serve`: llama-server per KV type, -np N and the default slots
    serve_client.py  its concurrent streaming clients, token times, TTFT and inter-token latency
    synth.py        `oscar synth`
    demo.py         `oscar demo`: calibrate, convert, evaluate, KV memory, generate
    settings.py     the KV settings every tool compares
    kv_memory.py    KV bytes per element, token and sequence, the f16 window's share, and the sizes
                    llama.cpp logs
    eval_table.py   the `oscar eval` table; csv_rows.py, plots.py: result files and figures
    perplexity_log.py  reading llama-perplexity's output
    texts.py        the shipped held-out text and calibration corpus, and their overlap check
    tool_runs.py    running the llama.cpp tools, the tools' error type, output folders
"""
