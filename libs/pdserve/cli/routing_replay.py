"""`pdserve replay --routing`: re-decide the logged requests of a window offline with other routing
policies or weights and print the hit rate each would have reached (`pdserve.routing.replay`), beside
what the logged router achieved."""

from __future__ import annotations

import argparse
import asyncio
from datetime import datetime

from rich.table import Table

from pdserve.cli.output import make_console
from pdserve.config import RouterSettings
from pdserve.routing.log import routed_requests
from pdserve.routing.policy import POLICY_NAMES
from pdserve.routing.replay import logged_config, replay_routing
from pdserve.routing.report import RoutedRequest, summarize
from pdserve.store.queries import make_db

console = make_console()
WEIGHT_KEYS = {
    "overlap": "overlap_score_weight",
    "temperature": "temperature",
    "queue": "active_prefill_weight",
    "balance": "balance_weight",
}


def parse_weights(text: str) -> dict[str, float]:
    """`overlap=2,temperature=0.1` → RouterSettings fields. Raises argparse.ArgumentTypeError."""
    out: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, _, value = part.partition("=")
        if key not in WEIGHT_KEYS:
            raise argparse.ArgumentTypeError(f"{key!r}: weights are {', '.join(WEIGHT_KEYS)}")
        try:
            out[WEIGHT_KEYS[key]] = float(value)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"{part!r}: not key=number") from e
    return out


def parse_policies(text: str) -> list[str]:
    names = [p.strip() for p in text.split(",") if p.strip()]
    bad = [n for n in names if n not in POLICY_NAMES]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"{','.join(bad) or text!r}: policies are {', '.join(POLICY_NAMES)}")
    return names


async def _load(url: str, since: datetime | None) -> list[RoutedRequest]:
    db = make_db(url)
    try:
        return await routed_requests(db, since)
    finally:
        await db.dispose()


def run(args: argparse.Namespace, url: str) -> int:
    """Exit status 0, or 1 when no logged request carries its prompt's block hashes."""
    logged = asyncio.run(_load(url, args.since))
    config = logged_config(logged, args.prefill_workers, args.capacity_blocks)
    settings = [
        (
            f"{name} {args.weights}" if args.weights and name == "kv" else name,
            RouterSettings(policy=name, seed=0, **(args.weights or {})),
        )
        for name in args.policy
    ]
    results = replay_routing(logged, settings, config)
    if not results:
        console.print("no routed request in the window carries its prompt's block hashes: nothing to replay")
        return 1
    actual = summarize(logged)
    console.print(
        f"{results[0].summary['requests']} logged requests re-decided on {config.num_prefill_workers} "
        f"modelled prefill workers × {config.capacity_blocks} blocks of {config.block_size} tokens "
        f"(prefill {config.prefill_s_per_token * 1e3:.3f} ms per uncached token, from the log)"
    )
    table = Table(
        "setting", "hit rate", "ceiling", "of ceiling", "max/min requests", "prefill p50", header_style="bold"
    )
    table.add_row(
        f"logged ({', '.join(actual.policies)})",
        f"{actual.hit_rate:.1%}",
        f"{actual.ceiling_hit_rate:.1%}",
        f"{actual.of_ceiling:.1%}",
        f"{actual.max_min_requests:.2f}",
        "—",
        style="dim",
    )
    for r in results:
        s = r.summary
        table.add_row(
            r.label,
            f"{s['hit_rate']:.1%}",
            f"{s['ceiling_hit_rate']:.1%}",
            f"{s['of_ceiling']:.1%}",
            f"{s['max_min_requests']:.2f}",
            f"{s['prefill_latency_p50_s'] * 1e3:.0f} ms",
        )
    console.print(table)
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The `--routing` options of `pdserve replay`."""
    p.add_argument(
        "--routing",
        action="store_true",
        help="Re-decide the logged requests with other routing settings and report the hit rate "
        "they would have reached (prefix caches modelled per prefill worker).",
    )
    p.add_argument(
        "--policy",
        type=parse_policies,
        default=list(POLICY_NAMES),
        help=f"With --routing: comma-separated policies (default: {','.join(POLICY_NAMES)}).",
    )
    p.add_argument(
        "--weights",
        type=parse_weights,
        default=None,
        help="With --routing: kv weights, e.g. overlap=2,temperature=0.1,queue=1,balance=0 (default: "
        "RouterSettings').",
    )
    p.add_argument(
        "--capacity-blocks",
        type=int,
        default=2048,
        help="With --routing: prefix-cache blocks per modelled prefill worker (default 2048).",
    )
    p.add_argument(
        "--prefill-workers",
        type=int,
        default=None,
        help="With --routing: modelled prefill workers (default: as many as the log shows).",
    )
