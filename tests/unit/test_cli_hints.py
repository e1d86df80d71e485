"""The commands `pdserve up` prints as hints are ones the user can run from where they are: `pdserve` when it
is on PATH, else the path it was started by (`make up` runs `.venv/bin/pdserve`)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from pdserve.cli import stack


@pytest.fixture
def started_as(monkeypatch, tmp_path):
    def start(argv0: Path | str, on_path: bool) -> None:
        monkeypatch.chdir(tmp_path)
        monkeypatch.setattr(sys, "argv", [str(argv0), "up"])
        monkeypatch.setattr(stack.shutil, "which", lambda name: f"/usr/bin/{name}" if on_path else None)

    return start


def test_on_path_the_hint_is_the_bare_command(started_as, tmp_path) -> None:
    started_as(tmp_path / ".venv" / "bin" / "pdserve", on_path=True)
    assert stack.cli_command() == "pdserve"


def test_off_path_the_hint_is_the_venv_path_relative_to_the_working_directory(started_as, tmp_path) -> None:
    started_as(tmp_path / ".venv" / "bin" / "pdserve", on_path=False)
    assert stack.cli_command() == ".venv/bin/pdserve"


def test_off_path_outside_the_working_directory_the_hint_is_the_path_as_started(started_as) -> None:
    started_as("/opt/pdserve/bin/pdserve", on_path=False)
    assert stack.cli_command() == "/opt/pdserve/bin/pdserve"


def test_run_as_a_module_the_hint_is_the_bare_command(started_as) -> None:
    started_as("/some/where/pdserve/cli/__main__.py", on_path=False)
    assert stack.cli_command() == "pdserve"


def test_an_unknown_service_is_named_as_typed(tmp_path, capsys) -> None:
    """`pdserve logs [service]` typed from the hint: the answer shows what was typed, not markup of it."""
    import argparse

    (tmp_path / "log").mkdir()
    (tmp_path / "log" / "gateway.log").write_text("")
    args = argparse.Namespace(var_dir=str(tmp_path), service="[service]", follow=False, lines=10)
    assert stack.logs(args) == 1
    assert "no log for '[service]'; known: gateway" in capsys.readouterr().out
