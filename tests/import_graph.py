"""Run import-linter (`lint-imports`, contracts in `.importlinter`) over pdserve as it is installed.

pdserve is one namespace from three roots: libs/pdserve, plus kernels/ and services/ mapped in as
pdserve.kernels and pdserve.services (pyproject's package-dir). import-linter's graph builder (grimp)
walks one directory per package, so it would not see kernels/ and services/; this builds a view of the
tree — a `pdserve/` directory of symlinks to libs/pdserve's entries, kernels/ and services/ — and runs
lint-imports with that view first on the path. `overlay` adds files to the view (tests prove a broken
contract is reported).

    python -m tests.import_graph     # what `make lint` runs; exit status is lint-imports'
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# Where each part of the pdserve namespace lives in the repository.
ROOTS = {"": REPO / "libs" / "pdserve", "kernels": REPO / "kernels", "services": REPO / "services"}


def build_view(dest: Path, overlay: dict[str, str] | None = None) -> Path:
    """Make `dest/pdserve` the pdserve namespace as symlinks; `overlay` maps a path inside the namespace
    (e.g. "kernels/probe.py") to a file's text, written into the view (the repository is not touched).
    Returns `dest`."""
    children = {p.name: p for p in ROOTS[""].iterdir()} | {name: p for name, p in ROOTS.items() if name}
    _populate(dest / "pdserve", children, overlay or {})
    return dest


def _populate(target: Path, children: dict[str, Path], overlay: dict[str, str]) -> None:
    """Directory `target` holding a symlink to each of `children`, except where `overlay` (paths
    relative to `target`) adds files below a child: that child becomes a directory, populated alike."""
    target.mkdir(parents=True)
    for name, source in children.items():
        if name == "__pycache__":
            continue
        below = {rel.partition("/")[2]: text for rel, text in overlay.items()
                 if rel.partition("/")[0] == name and "/" in rel}
        if below:
            _populate(target / name, {c.name: c for c in source.iterdir()}, below)
        else:
            (target / name).symlink_to(source)
    for rel, text in overlay.items():
        if "/" not in rel:
            (target / rel).write_text(text)


def lint_imports(overlay: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run `lint-imports` (from this interpreter's environment) on the view, in the repository root
    (where `.importlinter` is). Returns the finished process: returncode 0 when every contract is kept,
    its report in stdout."""
    lint = Path(sys.executable).parent / "lint-imports"
    with tempfile.TemporaryDirectory(prefix="pdserve-imports-") as tmp:
        view = build_view(Path(tmp), overlay)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(view), os.environ.get("PYTHONPATH", "")])}
        return subprocess.run([str(lint), "--no-cache"], cwd=REPO, env=env, capture_output=True, text=True)


def main() -> int:
    done = lint_imports()
    sys.stdout.write(done.stdout)
    sys.stderr.write(done.stderr)
    return done.returncode


if __name__ == "__main__":
    sys.exit(main())
