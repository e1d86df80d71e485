"""`pdserve` command line: one subcommand a module, each adding its own parser.

A command imports only its own module (`COMMANDS`): the modules of `advise`, `report` or `keys` pull in
torch, SQLAlchemy and the advisor's models (~3.5 s of imports here), which `pdserve status` or
`pdserve down` never use. `pdserve --help` (or no command, or an unknown one) imports them all, to list
every command.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# command -> the module under pdserve.cli that registers it (`add_parsers`) and runs it
COMMANDS: dict[str, str] = {
    "up": "stack", "down": "stack", "status": "stack", "logs": "stack", "migrate": "stack",
    "trace": "trace", "replay": "replay", "bench": "bench", "report": "report", "advise": "advise",
    "keys": "keys", "nats-users": "nats_users", "ready": "readiness", "profile": "profile", "sim": "sim",
}


def modules_for(argv: list[str]) -> list[str]:
    """The modules to import for `argv` (the arguments after `pdserve`): the command's own, or every one
    (in `COMMANDS`' order) when the first argument names no command."""
    if argv and argv[0] in COMMANDS:
        return [COMMANDS[argv[0]]]
    return list(dict.fromkeys(COMMANDS.values()))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="pdserve", description="Disaggregated LLM serving.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in modules_for(argv):
        importlib.import_module(f"pdserve.cli.{name}").add_parsers(sub)
    args = parser.parse_args(argv)
    args.argv = argv[1:]
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
