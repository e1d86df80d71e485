"""`pdserve`'s command table (`cli.main.COMMANDS`) names each module's own commands, so a command that
imports only its module still finds itself, and `--help` lists every command."""

from __future__ import annotations

import argparse
import importlib
import subprocess
import sys

import pytest

from pdserve.cli.main import COMMANDS, main, modules_for


def registered(module: str) -> set[str]:
    sub = argparse.ArgumentParser().add_subparsers()
    importlib.import_module(f"pdserve.cli.{module}").add_parsers(sub)
    return set(sub.choices)


@pytest.mark.parametrize("module", sorted(set(COMMANDS.values())))
def test_each_module_registers_exactly_the_commands_the_table_gives_it(module: str) -> None:
    assert registered(module) == {c for c, m in COMMANDS.items() if m == module}


def test_a_command_imports_its_module_alone_and_help_imports_them_all() -> None:
    assert modules_for(["status", "--var-dir", "x"]) == ["stack"]
    assert modules_for(["bench", "serve"]) == ["bench"]
    assert modules_for(["--help"]) == modules_for([]) == modules_for(["nope"]) == list(
        dict.fromkeys(COMMANDS.values()))


def test_status_does_not_import_torch() -> None:
    code = ("import contextlib, sys\n"
            "from pdserve.cli.main import main\n"
            "with contextlib.suppress(SystemExit):\n"
            "    main(['status', '--var-dir', '/nonexistent-pdserve-var'])\n"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip().splitlines()[-1] == "False", out.stdout + out.stderr


def test_help_lists_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    listed = capsys.readouterr().out
    assert all(command in listed for command in COMMANDS)
