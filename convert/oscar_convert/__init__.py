"""oscar-convert: add OSCAR rotations and clip ratios to a GGUF (see oscar_gguf.gguf_io)."""
from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    from oscar_gguf.convert_cli import main as _main
    return _main(argv)


if __name__ == "__main__":
    sys.exit(main())
