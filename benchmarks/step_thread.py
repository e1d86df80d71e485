"""Where a worker's forwards run, and on how many threads: the measurement behind engine/threads.py.

    python benchmarks/step_thread.py [--out docs/benchmarks] [--reps 12]

SmolLM2 fp32 through `LLMEngine`, each variant in a fresh process of its own (OpenMP's teams are
per process), the same seeded prompts in each:
- **one thread**: every step on one dedicated thread, one torch thread (a worker of one core).
- **step thread**: every step on one dedicated thread with two torch threads; the main thread never opens a
  parallel region (what a worker does now).
- **pool threads**: the main thread runs a forward on two threads first (so it has an OpenMP team), then
  the steps run on four threads in turn, two torch threads each (what a worker did when its steps went
  through `asyncio.to_thread`, which takes whichever pool thread is free).
Per variant: the median time of a 128-token prefill step (one prompt) and of a decode step of 8 sequences
(128-token prompts), each over `--reps` steps after one warm-up. Ratios are against one thread in the same
run. Writes step_thread.json, .md and .png under `--out`.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import itertools
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

VARIANTS = ("one thread", "step thread", "pool threads")


def measure(variant: str, reps: int) -> dict[str, float]:
    """Run in the variant's own process: median prefill and decode step times, ms."""
    import torch

    from pdserve.config import ModelSettings
    from pdserve.engine.host_memory import retain_freed_memory
    from pdserve.engine.llm_engine import EngineConfig, LLMEngine
    from pdserve.engine.loader import build_model, load_model
    from pdserve.engine.sequence import Sequence
    from pdserve.messages import SamplingParams

    threads = 1 if variant == "one thread" else 2
    torch.set_num_threads(2 if variant == "pool threads" else 1)  # the main thread's own team, or none
    retain_freed_memory()
    loaded = load_model("smollm2", ModelSettings().weights_cache_dir)
    model = build_model(loaded)  # as a worker builds it: GEMM paths calibrated, C kernels built
    engine = LLMEngine(model, EngineConfig(num_blocks=1024, max_num_batched_tokens=2048))
    if variant == "pool threads":
        engine.add_request(Sequence("warm", list(range(100, 164)), SamplingParams(max_tokens=1)))
        engine.step()  # the main thread opens its team, as a worker's start-up did
    # four threads taken in turn (as asyncio.to_thread takes whichever is free), or one
    pools = itertools.cycle([cf.ThreadPoolExecutor(1, initializer=torch.set_num_threads, initargs=(threads,))
                             for _ in range(4 if variant == "pool threads" else 1)])

    def on_pool(fn):
        return next(pools).submit(fn).result()

    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(100, loaded.config.vocab_size, (reps + 1 + 8, 128), generator=g).tolist()

    def timed(fn) -> float:
        t0 = time.perf_counter()
        on_pool(fn)
        return (time.perf_counter() - t0) * 1e3

    prefill = []
    for i in range(reps + 1):
        engine.add_request(Sequence(f"p{i}", prompts[i], SamplingParams(max_tokens=1, temperature=0)))
        prefill.append(timed(engine.step))
    sampling = SamplingParams(max_tokens=reps + 2, temperature=0, ignore_eos=True)
    for i in range(8):
        engine.add_request(Sequence(f"d{i}", prompts[reps + 1 + i], sampling))
    on_pool(engine.step)  # the 8 prompts
    decode = [timed(engine.step) for _ in range(reps + 1)]
    return {"prefill_128_ms": statistics.median(prefill[1:]), "decode_8_ms": statistics.median(decode[1:])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("docs/benchmarks"))
    ap.add_argument("--reps", type=int, default=12)
    ap.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)  # one variant, this process
    args = ap.parse_args()
    if args.variant:
        print(json.dumps(measure(args.variant, args.reps)))
        return
    from tqdm import tqdm

    rows = {}
    for variant in tqdm(VARIANTS, desc="variants"):
        out = subprocess.run([sys.executable, __file__, "--variant", variant, "--reps", str(args.reps)],
                             capture_output=True, text=True, check=True)
        rows[variant] = json.loads(out.stdout.strip().splitlines()[-1])
    base = rows["one thread"]
    result = {"generated": time.strftime("%Y-%m-%d %H:%M"), "reps": args.reps, "variants": rows,
              "vs_one_thread": {v: {k: base[k] / r[k] for k in r} for v, r in rows.items()}}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "step_thread.json").write_text(json.dumps(result, indent=2))
    lines = [
        "# Where a worker's forwards run: one step thread against asyncio's pool",
        "",
        f"Generated by `python benchmarks/step_thread.py --reps {args.reps}` on {result['generated']}: "
        "SmolLM2 fp32 through `LLMEngine`, each variant in a process of its own, medians of "
        f"{args.reps} steps. **× one thread** = one thread's time ÷ the variant's (higher is faster), "
        "measured in the same run. engine/threads.py says what the variants are and why it matters.",
        "",
        "| variant | 128-token prefill ms | × one thread | 8-sequence decode step ms | × one thread |",
        "|---|---|---|---|---|",
        *(f"| {v} | {r['prefill_128_ms']:.1f} | {result['vs_one_thread'][v]['prefill_128_ms']:.2f}× | "
          f"{r['decode_8_ms']:.1f} | {result['vs_one_thread'][v]['decode_8_ms']:.2f}× |"
          for v, r in rows.items()),
        "",
    ]
    (args.out / "step_thread.md").write_text("\n".join(lines))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    keys = (("prefill_128_ms", "128-token prefill"), ("decode_8_ms", "8-sequence decode step"))
    for j, v in enumerate(VARIANTS):
        ax.bar([i + 0.27 * j for i in range(len(keys))], [result["vs_one_thread"][v][k] for k, _ in keys],
               0.27, label=v)
    ax.axhline(1.0, color="k", lw=1, ls="--")
    ax.set_xticks([i + 0.27 for i in range(len(keys))], [label for _, label in keys])
    ax.set_ylabel("speed ÷ one thread (same run)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out / "step_thread.png", dpi=100)
    print((args.out / "step_thread.md").read_text())


if __name__ == "__main__":
    main()
