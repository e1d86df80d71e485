"""The one way pdserve's commands print: a rich Console sized for where the output goes."""

from __future__ import annotations

import os
import sys

from rich.console import Console

PIPED_WIDTH = 160  # columns when stdout is not a terminal (rich's own default there is 80)


def make_console(**options) -> Console:
    """A Console without syntax highlighting. Piped (a file, a CI log, `make` in a script) it is
    `PIPED_WIDTH` columns wide instead of rich's 80, which cut the trace waterfall's columns and the
    replay table's details; a terminal's own width, or `COLUMNS`, is used otherwise."""
    piped = not sys.stdout.isatty() and "COLUMNS" not in os.environ
    return Console(highlight=False, width=PIPED_WIDTH if piped else None, **options)
