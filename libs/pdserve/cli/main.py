"""`pdserve` command line: one subcommand a module, each adding its own parser."""

from __future__ import annotations

import argparse
import sys

from pdserve.cli import bench, keys, nats_users, readiness, replay, report, stack, trace


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdserve", description="Disaggregated LLM serving.")
    sub = parser.add_subparsers(dest="command", required=True)
    for module in (stack, trace, replay, bench, report, keys, nats_users, readiness):
        module.add_parsers(sub)
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
