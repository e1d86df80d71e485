"""Where a benchmark's result goes: `<stem>.json`, `<stem>.md` and `<stem>.png` under one folder."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path


def write_outputs(out: Path, stem: str, result: dict, markdown: Callable[[dict], str],
                  plot: Callable[[dict, Path], None]) -> str:
    """Write `result` as JSON, its `markdown(result)` and its `plot(result, path)` PNG under `out` (created
    if missing); returns the Markdown."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(result, indent=2))
    text = markdown(result)
    (out / f"{stem}.md").write_text(text)
    plot(result, out / f"{stem}.png")
    return text
