"""`pdserve bench serve` as a script: python benchmarks/serve.py --base-url ... (same flags)."""

from __future__ import annotations

import sys

from pdserve.cli.main import main

if __name__ == "__main__":
    sys.exit(main(["bench", "serve", *sys.argv[1:]]))
