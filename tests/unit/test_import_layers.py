"""The import-layering contracts of `.importlinter` hold, they see the whole namespace (kernels/ and
services/ included), every top-level module of pdserve is under them, and a broken one is reported."""

from __future__ import annotations

import configparser
import re

import pytest

from tests.import_graph import REPO, ROOTS, lint_imports

CONFIG = configparser.ConfigParser()
CONFIG.read(REPO / ".importlinter")


def _modules(option: str, contract: str) -> set[str]:
    raw = CONFIG[f"importlinter:contract:{contract}"][option]
    return {m.strip() for line in raw.splitlines() for m in line.split("|") if m.strip()}


def _top_level() -> set[str]:
    """Every top-level module of the pdserve namespace, from the tree."""
    libs = {f"pdserve.{p.stem}" for p in ROOTS[""].iterdir()
            if p.name != "__init__.py" and (p.suffix == ".py" or (p / "__init__.py").exists())}
    return libs | {"pdserve.kernels", "pdserve.services"}


def test_every_contract_is_kept_over_the_whole_namespace():
    done = lint_imports()
    assert done.returncode == 0, done.stdout + done.stderr
    assert re.search(r"Contracts: 4 kept, 0 broken", done.stdout), done.stdout
    analyzed = int(re.search(r"Analyzed (\d+) files", done.stdout).group(1))
    files = sum(1 for root in ROOTS.values() for p in root.rglob("*.py") if "__pycache__" not in p.parts)
    assert analyzed == files  # kernels/ and services/ are in the graph, not only libs/


def test_every_top_level_module_is_under_the_contracts():
    modules = _top_level()
    assert _modules("layers", "layers") == modules
    assert _modules("source_modules", "services") == modules - {"pdserve.services"}
    assert _modules("forbidden_modules", "kernels") == modules - {"pdserve.kernels"}


@pytest.mark.parametrize(
    ("overlay", "broken"),
    [
        ({"kernels/probe.py": "import pdserve.messages\n"}, "kernels import nothing of pdserve BROKEN"),
        ({"engine/probe.py": "import pdserve.bus\n"}, "nor the services BROKEN"),
        ({"store/probe.py": "import pdserve.services.router\n"}, "libs imports the services BROKEN"),
        ({"store/probe.py": "import pdserve.lifecycle.coordinator\n"}, "downward only (no cycles) BROKEN"),
    ],
)
def test_a_broken_contract_is_reported(overlay, broken):
    done = lint_imports(overlay)
    assert done.returncode == 1
    assert broken in done.stdout, done.stdout

