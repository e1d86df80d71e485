"""`pdserve report routing`: how well the router used the prefix caches over a time window, from the
event log — per-replica hit rate against the perfect-router ceiling, the prefill tokens the gap cost,
prediction accuracy and load balance (`pdserve.routing.report`); with KV tiers below the pools, the hit
rate split by the tier each cached token came from ("pool", "offload", ...); for a hybrid model both
lengths of its hits, the KV hit L ("cached") and the state checkpoint C <= L its prefills resumed from
("checkpoint").

The database is found as for `pdserve replay` (`--database-url`, `$PDS_DATABASE_URL`, the running
stack's, the default).
"""

from __future__ import annotations

import argparse
import asyncio
import json
from dataclasses import asdict
from datetime import datetime
from pathlib import Path

from rich.table import Table
from sqlalchemy.exc import DBAPIError

from pdserve.cli.output import make_console
from pdserve.cli.replay import parse_since, resolve_database_url
from pdserve.routing.log import routed_requests
from pdserve.routing.report import RoutingReport, summarize
from pdserve.store.queries import make_db

console = make_console()


async def load_report(url: str, since: datetime | None, until: datetime | None) -> RoutingReport:
    """The routing report of requests routed in [since, until) in the store at `url`."""
    db = make_db(url)
    try:
        return summarize(await routed_requests(db, since, until))
    finally:
        await db.dispose()


def report_dict(report: RoutingReport) -> dict:
    """The report as plain JSON-able data, derived ratios included."""
    out = asdict(report)
    for name in ("hit_rate", "ceiling_hit_rate", "of_ceiling", "max_min_requests", "max_min_active_requests",
                 "hit_rate_by_tier"):
        out[name] = getattr(report, name)
    for row, stats in zip(out["replicas"], report.replicas, strict=True):
        row["hit_rate"], row["ceiling_hit_rate"] = stats.hit_rate, stats.ceiling_hit_rate
        row["hit_rate_by_tier"] = stats.hit_rate_by_tier
    return out


def tier_split(hit_rate_by_tier: dict[str, float]) -> str:
    """'pool 41.0% · offload 12.5%': a hit rate split by tier ('—' when nothing was cached)."""
    return " · ".join(f"{t} {v:.1%}" for t, v in hit_rate_by_tier.items()) or "—"


def print_report(report: RoutingReport) -> None:
    if report.requests == 0:
        console.print(
            f"no routed request with a completed prefill in the window ({report.unfinished} unfinished)"
        )
        return
    hybrid = report.hybrid_requests > 0  # a model with state: the hit is (KV hit L, checkpoint C)
    columns = ["replica", "requests", "prompt tokens", "cached", *(["checkpoint"] if hybrid else []),
               "hit rate", "by tier", "ceiling", "of ceiling", "mean active"]
    table = Table(*columns, title="prefill replicas", title_justify="left", header_style="bold")
    for r in report.replicas:
        of = f"{r.cached_tokens / r.ceiling_tokens:.1%}" if r.ceiling_tokens else "—"
        table.add_row(
            r.replica,
            str(r.requests),
            str(r.prompt_tokens),
            str(r.cached_tokens),
            *([str(r.checkpoint_tokens)] if hybrid else []),
            f"{r.hit_rate:.1%}",
            tier_split(r.hit_rate_by_tier),
            f"{r.ceiling_hit_rate:.1%}",
            of,
            f"{r.mean_active_requests:.2f}",
        )
    console.print(table)
    if hybrid:
        console.print(
            f"hybrid hits (KV hit L, state checkpoint C): {report.hybrid_requests} requests, "
            f"L {report.hybrid_cached_tokens} tokens, C {report.checkpoint_tokens} tokens; the prefills "
            f"compute prompt − C, so {report.hybrid_cached_tokens - report.checkpoint_tokens} cached KV "
            f"tokens were recomputed for the state; checkpoint prediction exact for "
            f"{report.checkpoint_prediction_exact:.1%} of them"
        )
    console.print(
        f"{report.requests} requests ({report.unfinished} without a completed prefill) · policy "
        f"{', '.join(f'{k} {v}' for k, v in report.policies.items())} · mode "
        f"{', '.join(f'{k} {v}' for k, v in report.modes.items())}\n"
        f"hit rate {report.hit_rate:.1%} ({tier_split(report.hit_rate_by_tier)}) vs ceiling "
        f"{report.ceiling_hit_rate:.1%} ({report.of_ceiling:.1%} of it); "
        f"the gap cost {report.gap_tokens} prefill tokens\n"
        f"prediction exact for {report.prediction_exact:.1%} of requests, mean error "
        f"{report.prediction_mae_tokens:.1f} tokens\n"
        f"load balance max/min: requests {report.max_min_requests:.2f}, mean active requests "
        f"{report.max_min_active_requests:.2f}"
    )


def run(args: argparse.Namespace) -> int:
    """Exit status: 0 done, 2 the database could not be read."""
    url = resolve_database_url(args.database_url, args.var_dir)
    try:
        report = asyncio.run(load_report(url, args.since, args.until))
    except (DBAPIError, OSError) as e:
        console.print(f"[red]cannot read the event store at {url}: {type(e).__name__}: {e}[/red]")
        return 2
    if args.json:
        print(json.dumps(report_dict(report), indent=2))
    else:
        print_report(report)
    return 0


def add_parsers(subparsers: argparse._SubParsersAction) -> None:
    """Register `report routing` on the `pdserve` command line."""
    p = subparsers.add_parser("report", help="Reports computed from the event log.")
    kinds = p.add_subparsers(dest="report", required=True)
    r = kinds.add_parser(
        "routing",
        help="Prefix-cache hit rate per replica vs the perfect-router ceiling, "
        "prediction accuracy and load balance over a time window.",
    )
    r.add_argument(
        "--since",
        type=parse_since,
        default=None,
        help="Requests routed at or after this time: ISO 8601 (UTC without an offset) or an age "
        "such as 15m, 2h, 1d (default: all).",
    )
    r.add_argument("--until", type=parse_since, default=None, help="Requests routed before this time.")
    r.add_argument("--json", action="store_true", help="Print the report as JSON.")
    r.add_argument("--database-url", default=None, help="SQLAlchemy asyncpg URL (default as pdserve replay).")
    r.add_argument("--var-dir", type=Path, default=None, help="Where to look for run/stack.json.")
    r.set_defaults(func=run)
