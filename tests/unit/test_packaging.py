"""pyproject's explicit package list (docs/architecture.md §1: setuptools' find cannot remap libs/,
services/ and kernels/) names every package the tree holds, so a non-editable install (the Dockerfile's,
a wheel) carries them all, not only the editable install the tests run from."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_package_is_listed() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    found: set[str] = set()
    for prefix, base in config["package-dir"].items():
        root = ROOT / base
        for init in root.rglob("__init__.py"):
            parts = init.parent.relative_to(root).parts
            found.add(".".join(p for p in (prefix, *parts) if p))
    assert found - listed == set(), "packages missing from pyproject's [tool.setuptools] packages"
    assert listed - found == set(), "pyproject lists packages that do not exist"
