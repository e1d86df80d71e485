"""`pdserve bench serve | compare`: the load generator and the colocated-vs-disaggregated sweep.

    pdserve bench serve --dataset random --input-len 256 --output-len 32 \
        --num-prompts 40 --request-rate 2 --burstiness 1 --goodput ttft:2000 tpot:200 --out docs/benchmarks
    pdserve bench compare --model smollm2 --ratios 10:1 1:1 1:20 --rates 0.25 0.5 1

Flags and metric definitions follow `vllm bench serve` (vllm/benchmarks/serve.py).
"""

from __future__ import annotations

import argparse
import asyncio
import os
from pathlib import Path

from pdserve.bench.datasets import DATASETS
from pdserve.bench.metrics import parse_goodput
from pdserve.cli.output import make_console
from pdserve.stack_state import StackState, read_state

console = make_console(soft_wrap=True)


DEFAULT_BASE_URL = "http://127.0.0.1:8000"


def _stack(args: argparse.Namespace) -> StackState | None:
    return read_state(Path(args.var_dir or os.environ.get("PDS_VAR_DIR") or "var").resolve())


def base_url(args: argparse.Namespace) -> str:
    """--base-url, else the gateway of the running `pdserve up` stack (var/run/stack.json, whatever port
    it was started on), else http://127.0.0.1:8000."""
    if args.base_url:
        return args.base_url.rstrip("/")
    state = _stack(args)
    if state is not None and state.gateway_url:
        return state.gateway_url.rstrip("/")
    return DEFAULT_BASE_URL


def _database_url(args: argparse.Namespace, url: str) -> str | None:
    """--database-url, else the event store of the `pdserve up` stack that serves `url`, else None."""
    if args.database_url:
        return args.database_url
    if args.no_breakdown:
        return None
    state = _stack(args)
    if state is not None and state.gateway_url.rstrip("/") == url:
        return state.database_url or None
    return None


def serve(args: argparse.Namespace) -> int:
    from pdserve.bench.report import markdown, write_report
    from pdserve.bench.serve import ServeConfig, run_serve

    url = base_url(args)
    cfg = ServeConfig(
        base_url=url, dataset=args.dataset, num_prompts=args.num_prompts,
        input_len=args.input_len, output_len=args.output_len, range_ratio=args.range_ratio,
        prefix_len=args.prefix_len, suffix_len=args.suffix_len, num_prefixes=args.num_prefixes,
        num_turns=args.num_turns, request_rate=args.request_rate, burstiness=args.burstiness,
        max_concurrency=args.max_concurrency, seed=args.seed, percentiles=args.percentiles,
        goodput_slo_ms=parse_goodput(args.goodput or []), ignore_eos=not args.no_ignore_eos,
        model=args.model, database_url=_database_url(args, url),
    )
    report = asyncio.run(run_serve(cfg, progress=not args.disable_tqdm))
    console.print(markdown(report), markup=False)
    if args.out:
        stem = args.label or f"serve-{cfg.dataset}"
        for path in write_report(report, Path(args.out), stem):
            console.print(f"wrote {path}")
    return 0 if report.metrics.completed else 1


def compare(args: argparse.Namespace) -> int:
    from pdserve.bench.compare import STEM, CompareConfig, load_results, parse_ratio, run_compare
    from pdserve.bench.compare_report import write_compare

    if args.render:
        for path in write_compare(load_results(Path(args.render)), Path(args.out), STEM):
            console.print(f"wrote {path}")
        return 0
    cfg = CompareConfig(
        model=args.model, modes=args.modes, ratios=[parse_ratio(r) for r in args.ratios], rates=args.rates,
        num_prompts=args.num_prompts, tokens_per_request=args.tokens_per_request, burstiness=args.burstiness,
        seed=args.seed, goodput_slo_ms=parse_goodput(args.goodput), port=args.port,
        var_dir=Path(args.var_dir or "var/bench-compare").resolve(), pin_cores=not args.no_pin,
    )
    return run_compare(cfg, Path(args.out))


def add_parsers(sub: argparse._SubParsersAction) -> None:
    """Register `bench serve` and `bench compare` on the `pdserve` command line."""
    bench = sub.add_parser("bench", help="load generator and serving benchmarks").add_subparsers(
        dest="bench_command", required=True)

    p = bench.add_parser("serve", help="drive a running gateway with vllm bench serve's workload and metrics")
    p.add_argument("--base-url", help=f"gateway (default: the running `pdserve up` stack's, else "
                   f"{DEFAULT_BASE_URL})")
    p.add_argument("--model", help="model name to send (default: the first of GET /v1/models)")
    p.add_argument("--dataset", "--dataset-name", choices=DATASETS, default="random")
    p.add_argument("--num-prompts", type=int, default=40,
                   help="requests (shared_prefix: conversations) (default %(default)s)")
    p.add_argument("--input-len", "--random-input-len", type=int, default=128,
                   help="prompt tokens (shared_prefix: question tokens per turn) (default %(default)s)")
    p.add_argument("--output-len", "--random-output-len", type=int, default=32,
                   help="max_tokens per request (default %(default)s)")
    p.add_argument("--range-ratio", "--random-range-ratio", type=float, default=0.0,
                   help="random: lengths uniform in [L(1-r), L(1+r)] (default %(default)s)")
    p.add_argument("--prefix-len", type=int, default=0,
                   help="random: shared prefix; prefix_repetition: prefix; shared_prefix: system prompt")
    p.add_argument("--suffix-len", type=int, default=128, help="prefix_repetition: suffix tokens")
    p.add_argument("--num-prefixes", type=int, default=4,
                   help="prefix_repetition / shared_prefix: distinct prefixes (default %(default)s)")
    p.add_argument("--num-turns", type=int, default=3, help="shared_prefix: turns per conversation")
    p.add_argument("--request-rate", type=float, default=float("inf"), help="req/s; inf = all at once")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; 1 = Poisson (default 1)")
    p.add_argument("--max-concurrency", type=int, help="requests in flight at most (default unbounded)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--percentiles", "--metric-percentiles", type=float, nargs="+", default=[50.0, 90.0, 99.0])
    p.add_argument("--goodput", nargs="+", metavar="KEY:MS", help="SLOs, e.g. ttft:2000 tpot:200 e2el:10000")
    p.add_argument("--no-ignore-eos", action="store_true", help="let EOS end a request early")
    p.add_argument("--database-url",
                   help="event store for the TTFT breakdown (default: the `pdserve up` stack's)")
    p.add_argument("--no-breakdown", action="store_true", help="do not read the event store")
    p.add_argument("--var-dir", help="where `pdserve up` keeps its state (default $PDS_VAR_DIR or ./var)")
    p.add_argument("--out", help="write <label>.json/.md/.png into this folder")
    p.add_argument("--label", help="file stem under --out (default serve-<dataset>)")
    p.add_argument("--disable-tqdm", action="store_true")
    p.set_defaults(func=serve)

    p = bench.add_parser("compare", help="colocated vs disaggregated stacks over input:output ratios × rates")
    p.add_argument("--model", choices=("smollm2", "tiny"), default="smollm2")
    p.add_argument("--modes", nargs="+", default=["colocated", "disaggregated"])
    p.add_argument("--ratios", nargs="+", default=["10:1", "1:1", "1:20"], help="input:output token ratios")
    p.add_argument("--rates", type=float, nargs="+", default=[0.25, 0.5, 1.0], help="request rates, req/s")
    p.add_argument("--num-prompts", type=int, default=20, help="requests per point (default %(default)s)")
    p.add_argument("--tokens-per-request", type=int, default=220,
                   help="input + output tokens per request, split by the ratio (default %(default)s)")
    p.add_argument("--burstiness", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--goodput", nargs="+", default=["ttft:2000", "tpot:200"], metavar="KEY:MS",
                   help="the SLO goodput is counted at (default %(default)s)")
    p.add_argument("--port", type=int, default=18700, help="gateway port of the stacks it starts")
    p.add_argument("--var-dir", help="state and logs of the stacks (default var/bench-compare)")
    p.add_argument("--no-pin", action="store_true", help="do not pin each worker pool to its own core")
    p.add_argument("--out", default="docs/benchmarks", help="folder for colocated-vs-disaggregated.*")
    p.add_argument("--render", metavar="JSON", help="only re-render the Markdown and PNG of a results JSON")
    p.set_defaults(func=compare)
