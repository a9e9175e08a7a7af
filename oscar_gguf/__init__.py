"""oscar-gguf: OSCAR 2-bit KV-cache quantization for llama.cpp and GGUF.

Python side of the project: the bit-exact reference of the `oscar2` block format,
calibration of per-layer rotations and clip ratios, GGUF read/write, and thin helpers
around the patched llama.cpp (library path, tools, `Llama` wrapper).
"""
from .paths import bundled_model_path, library_dir, tool_path

__version__ = "0.1.0"

__all__ = ["bundled_model_path", "library_dir", "tool_path", "__version__"]
