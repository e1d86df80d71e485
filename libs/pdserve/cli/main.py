"""`pdserve` command line: one subcommand a module, each adding its own parser."""

from __future__ import annotations

import argparse
import sys

from pdserve.cli import advise, bench, keys, nats_users, profile, readiness, replay, report, sim, stack, trace


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdserve", description="Disaggregated LLM serving.")
    sub = parser.add_subparsers(dest="command", required=True)
    for module in (stack, trace, replay, bench, report, advise, keys, nats_users, readiness, profile, sim):
        module.add_parsers(sub)
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)[1:]
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
