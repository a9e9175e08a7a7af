"""The format contract: every fact about oscar2 data and OSCAR GGUFs, each defined once.

    oscar2.py      the oscar2 block format (type ids, group sizes) and its bit-exact numpy twin
    gguf_keys.py   GGUF key and tensor names, the runtime's defaults (clip ratios, the f16
                   window) for what the keys do not say, the patched tools' flags
    rotations.py   Rotations and their one check (finite, square, orthogonal within a limit)
    gguf_read.py   ModelInfo and the GGUF readers (a fast header walk; gguf-py's GGUFReader)
    gguf_write.py  the oscar.* keys, the byte-for-byte copy with additions, new files on gguf-py

The C side mirrors it: ggml-oscar/oscar2.h (the block format and the clip defaults) and
ggml-oscar/llama/llama-oscar.cpp (the names, the window defaults, the same rotation check at load).
"""
