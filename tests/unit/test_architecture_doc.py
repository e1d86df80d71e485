"""docs/architecture.md and the README's layout agree with the tree: every `docs/architecture.md §n` a
file cites is a section of it, its state diagram is the transition table's, and the layouts name what
is there."""

from __future__ import annotations

import re
import subprocess

from pdserve.states import mermaid
from tests.import_graph import REPO, ROOTS

DOC = (REPO / "docs" / "architecture.md").read_text()
THIS_FILE = "tests/unit/test_architecture_doc.py"  # it names what it looks for
SECTIONS = {int(n) for n in re.findall(r"^## (\d+)\. ", DOC, flags=re.MULTILINE)}


def _tracked() -> list[str]:
    out = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    return out.split()


def test_every_citation_names_a_section_and_none_cites_the_old_design_document():
    cited: dict[int, list[str]] = {}
    for path in _tracked():
        file = REPO / path
        if not file.is_file() or file.suffix in {".png", ".json"} or path == THIS_FILE:
            continue
        text = file.read_text(errors="replace")
        assert "DESIGN §" not in text, path
        assert "../shared" not in text, path
        for group in re.findall(r"docs/architecture\.md (§\d+(?:, §\d+)*)", text):
            for n in re.findall(r"\d+", group):
                cited.setdefault(int(n), []).append(path)
    assert cited, "nothing cites docs/architecture.md"
    assert set(cited) <= SECTIONS, {n: cited[n] for n in set(cited) - SECTIONS}
    assert SECTIONS == set(range(1, max(SECTIONS) + 1))


def test_the_state_diagram_is_the_transition_table():
    diagram = re.search(r"```mermaid\n(.*?)```", DOC, flags=re.DOTALL)
    assert diagram is not None
    assert diagram.group(1) == mermaid()


def test_the_layouts_name_every_top_level_module_and_entry():
    modules = {p.stem for p in ROOTS[""].iterdir() if p.name != "__init__.py" and p.name != "__pycache__"}
    section1 = DOC.split("## 2. ")[0]
    for name in modules:
        assert f"`{name}`" in section1 or f"`{name}/`" in section1, name
    readme = (REPO / "README.md").read_text()
    layout = re.search(r"## Layout\n\n```\n(.*?)```", readme, flags=re.DOTALL).group(1)
    listed = {line.split()[0].rstrip("/").split("/")[0] for line in layout.splitlines() if line[:1] != " "}
    top = {path.split("/")[0] for path in _tracked()} - {"README.md", ".gitignore", ".dockerignore", ".ci"}
    assert listed == top
    libs = layout.split("libs/pdserve/")[1].split("services/<name>/")[0]
    for name in modules:
        assert re.search(rf"\b{name}\b", libs), name
