"""`pdserve bench compare` as a script: python benchmarks/compare.py [--ratios ...] (same flags).
Writes docs/benchmarks/colocated-vs-disaggregated.{json,md,png}."""

from __future__ import annotations

import sys

from pdserve.cli.main import main

if __name__ == "__main__":
    sys.exit(main(["bench", "compare", *sys.argv[1:]]))
