"""What a hybrid's recurrent state costs: the handoff per request beside a Llama of similar size, and the
checkpoint interval's effect on prefix caching (the seed's alignment claim), measured in one run.

    python benchmarks/hybrid.py [--lengths 128 256 512 1024 2048] [--rounds 3]
                                [--intervals 16 32 48 64 80 96 128 256 0] [--out docs/benchmarks]

**Handoff** (part 1). Two disaggregated stacks (tests/e2e/stack.py; one prefill and one decode worker
each), up side by side on the machine's NATS and Postgres (`PDS_TEST_NATS_URL`, `PDS_TEST_DATABASE_URL`),
each with a database, stream and subject prefix of its own: kimi-tiny (KDA + MLA + MoE), and a seeded
random Llama written by HF transformers' `LlamaForCausalLM.save_pretrained` with kimi-tiny's vocabulary,
hidden size, depth and dense MLP width (`llama_like_kimi_tiny`; the parameter ratio is in the report).
Each round sends one fresh random prompt of each length to both stacks in turn, the order rotated every
round, as a 2-token completion (no prefix hit). Per request, from its event log: KV bytes and state bytes
(`TransferCompleted`), the compute's end (`PrefillStarted.ts + PrefillCompleted.prefill_s`), the exposed
KV transfer (`kv_verified_ts` − compute end, clamped at 0: the layer-wise KV streams during the compute)
and the serial state transfer (`state_verified_ts` − compute end: the state exists only after the last
chunk, none of it overlaps). Medians over rounds; the hybrid's figures are also given as ratios to the
Llama's of the same round.

**Checkpoint interval** (part 2). A shared-prefix workload — a system prompt of `SYSTEM` tokens shared by
every request, `GROUPS` documents of `DOCUMENT` tokens each shared by the `QUESTIONS` questions asked
about it (so the shared prefixes end at SYSTEM and SYSTEM + DOCUMENT tokens) — run through kimi-tiny's
engine in this process, one request at a time, once per checkpoint interval (0 = no checkpoints), with
state slots enough that no checkpoint is evicted. Exact counts, not timings: the KV hit L and checkpoint
C of every request, the prompt tokens computed (prompt − C each), the checkpoints held at the end and
their bytes. Baselines from the same run: interval 0 (no checkpoint: a hit saves nothing) and the KV
ideal (prompt − L: what caching would save if the state after every block were held).

Writes hybrid.json, hybrid.md and hybrid.png under `--out`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdserve.config import CommonSettings  # noqa: E402
from pdserve.service_plan import ServiceSpec  # noqa: E402
from pdserve.store.migrate import create_database, drop_database, upgrade  # noqa: E402
from tests.e2e.stack import Stack  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"
BLOCK_SIZE = 16
SYSTEM, DOCUMENT, GROUPS, QUESTIONS = 80, 176, 4, 6
PREFIXES = (SYSTEM, SYSTEM + DOCUMENT)  # where the workload's shared prefixes end
LLAMA_SEED = 7


# ---------------------------------------------------------------- models


def llama_like_kimi_tiny(path: Path, kimi_config) -> Path:
    """A seeded random Llama in HF layout with kimi-tiny's vocabulary, hidden size, depth, heads and dense
    MLP width (HF `LlamaForCausalLM.save_pretrained`), SmolLM2's tokenizer beside it."""
    import torch
    import transformers

    from pdserve.engine.tokenizer import load_tokenizer

    tokenizer = load_tokenizer("smollm2")
    config = transformers.LlamaConfig(
        vocab_size=kimi_config.vocab_size,
        hidden_size=kimi_config.hidden_size,
        intermediate_size=kimi_config.intermediate_size,
        num_hidden_layers=kimi_config.num_hidden_layers,
        num_attention_heads=kimi_config.num_attention_heads,
        num_key_value_heads=kimi_config.num_attention_heads,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        rms_norm_eps=1e-5,
        initializer_range=0.1,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=None,
    )
    torch.manual_seed(LLAMA_SEED)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_hf(path)
    return path


def num_parameters(loaded) -> int:
    return sum(t.numel() for t in loaded.weights.values())


# ---------------------------------------------------------------- part 1: the handoff


class BenchStack(Stack):
    def env(self, spec: ServiceSpec) -> dict[str, str]:
        env = super().env(spec)
        env.update(PDS_KV_CAPACITY_TOKENS="8192", PDS_MAX_MODEL_LEN="4096", PDS_MAX_NUM_BATCHED_TOKENS="2048")
        return env


@contextlib.contextmanager
def bench_stack(
    name: str, model: str, base: CommonSettings, admin_url: str, var_dir: Path
) -> Iterator[Stack]:
    """A disaggregated stack of `model` with a database of its own (dropped afterwards), warmed up."""
    tag = f"hy{uuid.uuid4().hex[:8]}"
    db = f"pdserve_bench_{tag}"
    settings = base.model_copy(
        update={
            "database_url": create_database(admin_url, db),
            "subject_prefix": tag,
            "events_stream": f"PDS_EVENTS_{tag}",
        }
    )
    upgrade(settings.database_url)
    stack = BenchStack(settings, var_dir / name, model=model, mode="disaggregated")
    try:
        stack.start(timeout_s=300)
        one_request(stack, random_prompt(random.Random(1), 64))
        yield stack
    finally:
        stack.stop()
        drop_database(admin_url, db)


def random_prompt(rng: random.Random, n_tokens: int) -> list[int]:
    return [rng.randrange(1000, 40000) for _ in range(n_tokens)]


def one_request(stack: Stack, prompt: list[int], timeout_s: float = 120.0) -> dict:
    """Send `prompt` as a 2-token completion; its handoff figures from the event log."""
    r = httpx.post(
        f"{stack.url}/v1/completions",
        timeout=300,
        json={"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0, "ignore_eos": True},
    )
    r.raise_for_status()
    rid = r.headers["x-request-id"]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = httpx.get(f"{stack.url}/v1/requests/{rid}")
        if got.status_code == 200:
            events = got.json()["events"]
            by = {e["type"]: e for e in events}
            if "RequestCompleted" in by and "TransferCompleted" in by:
                started, prefilled, xfer = (
                    by["PrefillStarted"],
                    by["PrefillCompleted"],
                    by["TransferCompleted"],
                )
                compute_end = started["ts"] + prefilled["payload"]["prefill_s"]
                p = xfer["payload"]
                return {
                    "prompt_tokens": len(prompt),
                    "kv_bytes": p["kv_bytes"],
                    "state_bytes": p["state_bytes"],
                    "prefill_s": prefilled["payload"]["prefill_s"],
                    "kv_tail_s": p["kv_verified_ts"] - compute_end,  # < 0: all KV verified before it
                    "exposed_kv_s": max(0.0, p["kv_verified_ts"] - compute_end),
                    "state_s": (p["state_verified_ts"] - compute_end) if p["state_bytes"] else 0.0,
                    "ttft_state_transfer_s": by["RequestCompleted"]["payload"]["ttft"].get(
                        "state_transfer_s", 0.0
                    ),
                }
        time.sleep(0.2)
    raise TimeoutError(f"RequestCompleted of {rid} not recorded in {timeout_s} s")


def run_handoff(
    stacks: dict[str, Stack], lengths: list[int], rounds: int
) -> dict[str, dict[int, list[dict]]]:
    """Round i of length n sends one fresh prompt to both stacks, starting with stack i mod 2."""
    names, rng = list(stacks), random.Random(0)
    raw: dict[str, dict[int, list[dict]]] = {name: {n: [] for n in lengths} for name in names}
    with tqdm(total=len(lengths) * rounds * len(names), desc="handoff requests") as bar:
        for n in lengths:
            for i in range(rounds):
                prompt = random_prompt(rng, n)
                k = i % len(names)
                for name in names[k:] + names[:k]:
                    raw[name][n].append(one_request(stacks[name], prompt))
                    bar.update()
    return raw


def summarise_handoff(raw: dict[str, dict[int, list[dict]]], lengths: list[int]) -> list[dict]:
    med = statistics.median
    rows = []
    for n in lengths:
        k, ll = raw["kimi-tiny"][n], raw["llama"][n]
        # the hybrid's whole handoff tail (KV and state both in) per round, over the Llama's exposed KV
        tails = [max(a["exposed_kv_s"], a["state_s"]) for a in k]
        rows.append(
            {
                "prompt_tokens": n,
                "kimi_kv_bytes": int(med(a["kv_bytes"] for a in k)),
                "kimi_state_bytes": int(med(a["state_bytes"] for a in k)),
                "llama_kv_bytes": int(med(a["kv_bytes"] for a in ll)),
                "kimi_exposed_kv_s": med(a["exposed_kv_s"] for a in k),
                "kimi_state_s": med(a["state_s"] for a in k),
                "kimi_tail_s": med(tails),
                "llama_exposed_kv_s": med(a["exposed_kv_s"] for a in ll),
                "kimi_kv_tail_s": med(a["kv_tail_s"] for a in k),
                "llama_kv_tail_s": med(a["kv_tail_s"] for a in ll),
                "kimi_prefill_s": med(a["prefill_s"] for a in k),
                "llama_prefill_s": med(a["prefill_s"] for a in ll),
                "handoff_bytes_ratio": med(
                    (a["kv_bytes"] + a["state_bytes"]) / b["kv_bytes"] for a, b in zip(k, ll, strict=True)
                ),
                # what the state adds after the compute, beside the Llama's exposed KV of the same round, and
                # that as a share of the hybrid's own prefill compute
                "extra_tail_s": med(t - b["exposed_kv_s"] for t, b in zip(tails, ll, strict=True)),
                "tail_over_kimi_prefill": med(t / a["prefill_s"] for t, a in zip(tails, k, strict=True)),
            }
        )
    return rows


# ---------------------------------------------------------------- part 2: the checkpoint interval


def shared_prefix_workload(seed: int = 0) -> list[list[int]]:
    """GROUPS × QUESTIONS prompts: system (SYSTEM tokens, all) + document g (DOCUMENT tokens, group g) +
    a question of 24..40 tokens (its own), groups interleaved (question q of every group, then q + 1)."""
    rng = random.Random(seed)
    system = random_prompt(rng, SYSTEM)
    documents = [random_prompt(rng, DOCUMENT) for _ in range(GROUPS)]
    return [
        system + documents[g] + random_prompt(rng, rng.randrange(24, 41))
        for _ in range(QUESTIONS)
        for g in range(GROUPS)
    ]


def run_interval(model, prompts: list[list[int]], interval: int) -> dict:
    from pdserve.engine.llm_engine import EngineConfig, LLMEngine
    from pdserve.engine.sequence import Sequence
    from pdserve.messages import SamplingParams

    engine = LLMEngine(
        model,
        EngineConfig(
            num_blocks=1024,
            block_size=BLOCK_SIZE,
            max_num_batched_tokens=512,
            num_state_slots=1024,
            checkpoint_interval=interval,
        ),
    )
    sampling = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    kv_hit = checkpoint = 0
    for i, ids in enumerate(prompts):
        seq = Sequence(f"r{i}", ids, sampling)
        engine.add_request(seq)
        while engine.has_work:
            engine.step()
        kv_hit += seq.num_cached_tokens
        checkpoint += seq.num_checkpoint_tokens
    pool = engine.state_pool
    held = len(pool.checkpoints)
    return {
        "interval": interval,
        "prompt_tokens": sum(map(len, prompts)),
        "kv_hit_tokens": kv_hit,
        "checkpoint_tokens": checkpoint,
        "computed_tokens": engine.stats.num_prompt_tokens_computed,
        "checkpoints_held": held,
        "checkpoint_bytes": held * pool.layout.bytes_per_slot(model.dtype),
    }


def run_sweep(intervals: list[int]) -> tuple[list[dict], dict]:
    import torch

    from pdserve.config import ModelSettings
    from tests import oracle

    torch.set_num_threads(1)
    _, model = oracle.reference("kimi-tiny", ModelSettings().weights_cache_dir)
    prompts = shared_prefix_workload()
    rows = [run_interval(model, prompts, i) for i in tqdm(intervals, desc="checkpoint intervals")]
    none = next(r for r in rows if r["interval"] == 0)
    for r in rows:
        r["kv_hit_rate"] = r["kv_hit_tokens"] / r["prompt_tokens"]
        r["usable_hit_rate"] = r["checkpoint_tokens"] / r["prompt_tokens"]
        r["computed_over_no_checkpoint"] = r["computed_tokens"] / none["computed_tokens"]
        r["computed_over_kv_ideal"] = r["computed_tokens"] / (r["prompt_tokens"] - r["kv_hit_tokens"])
        # where a request resumes at each shared prefix's end: the last multiple of the interval
        r["resumes_at"] = [n // r["interval"] * r["interval"] if r["interval"] else 0 for n in PREFIXES]
        r["aligned"] = sum(at == n for at, n in zip(r["resumes_at"], PREFIXES, strict=True))
    meta = {
        "system_tokens": SYSTEM,
        "document_tokens": DOCUMENT,
        "groups": GROUPS,
        "questions": QUESTIONS,
        "requests": len(prompts),
        "state_bytes_per_slot": model.cache_spec().state.bytes_per_slot(model.dtype),
    }
    return rows, meta


# ---------------------------------------------------------------- reports


def write_reports(handoff: list[dict], sweep: list[dict], meta: dict, raw: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "hybrid.json").write_text(
        json.dumps({"meta": meta, "handoff": handoff, "sweep": sweep, "raw": raw}, indent=2)
    )
    ms = lambda s: f"{s * 1e3:.1f}"  # noqa: E731
    kib = lambda b: f"{b / 1024:.1f}"  # noqa: E731
    sw = meta["sweep"]
    lines = [
        "# Hybrid (Kimi Linear) state: the handoff and the checkpoint interval",
        "",
        f"Generated by `python benchmarks/hybrid.py --rounds {meta['rounds']}` on {meta['when']} "
        f"({meta['machine']}; load average {meta['load_avg_1min'][0]:.2f} before, "
        f"{meta['load_avg_1min'][1]:.2f} after, a shared machine), transport {meta['transport']}, "
        "fp32 on the CPU.",
        "",
        "## The handoff per request, beside a Llama of similar size",
        "",
        f"kimi-tiny ({meta['kimi_parameters'] / 1e6:.2f} M parameters: {meta['kimi_layers']}) against a "
        f"seeded random Llama ({meta['llama_parameters'] / 1e6:.2f} M parameters, "
        f"{meta['llama_parameters'] / meta['kimi_parameters']:.2f}× kimi-tiny's: {meta['llama_layers']}), "
        f"each on its own disaggregated stack, {meta['rounds']} rounds per length, each round one fresh "
        "random prompt to both, 2-token completions, medians. **exposed KV** = "
        "`TransferCompleted.kv_verified_ts` − "
        "the compute's end (`PrefillStarted.ts + prefill_s`), clamped at 0; **state** = "
        "`state_verified_ts` − the compute's end: the state is sent whole only once the last prefill chunk "
        "is computed, so all of it is serial, while the layer-wise KV streams during the compute. "
        "**tail** = the later of the two (the decode worker admits only once both are verified). **KV "
        "tail** = the same without the clamp (negative: the decode worker held every page that long before "
        "the compute ended). **extra** = the hybrid's tail − the Llama's exposed KV of the same round: what "
        "the state adds; **of prefill** = the hybrid's tail / its own prefill compute. Ratios are per "
        "round, medians. The prefill worker streams the first token itself, so this tail "
        "delays the *second* token (the coordinator's TTFT breakdown has `state_transfer_s` = "
        f"{meta['ttft_state_transfer_s_max']:.3f} s at most over these requests; it carries the tail when "
        "the first token waits for the decode worker).",
        "",
        "| prompt tokens | kimi KV KiB | kimi state KiB | Llama KV KiB | handoff bytes kimi / Llama "
        "| KV tail kimi / Llama ms | kimi exposed KV ms | kimi state ms | kimi tail ms | Llama exposed KV ms "
        "| extra ms | of prefill | prefill kimi / Llama ms |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in handoff:
        lines.append(
            f"| {r['prompt_tokens']} | {kib(r['kimi_kv_bytes'])} | {kib(r['kimi_state_bytes'])} | "
            f"{kib(r['llama_kv_bytes'])} | {r['handoff_bytes_ratio']:.3f} | "
            f"{ms(r['kimi_kv_tail_s'])} / {ms(r['llama_kv_tail_s'])} | {ms(r['kimi_exposed_kv_s'])} | "
            f"{ms(r['kimi_state_s'])} | {ms(r['kimi_tail_s'])} | {ms(r['llama_exposed_kv_s'])} | "
            f"{ms(r['extra_tail_s'])} | {r['tail_over_kimi_prefill']:.1%} | "
            f"{ms(r['kimi_prefill_s'])} / {ms(r['llama_prefill_s'])} |"
        )
    best = min((r for r in sweep if r["interval"]), key=lambda r: r["computed_tokens"])
    lines += [
        "",
        "## The checkpoint interval on a shared-prefix workload",
        "",
        f"{sw['requests']} requests through kimi-tiny's engine, one at a time: a {sw['system_tokens']}-token "
        f"system prompt shared by all, {sw['groups']} documents of {sw['document_tokens']} tokens each "
        f"shared by its {sw['questions']} questions (24–40 tokens each), so the shared prefixes end at "
        f"{sw['system_tokens']} and {sw['system_tokens'] + sw['document_tokens']} tokens. Exact counts. "
        "**KV hit** = Σ L / Σ prompt (the MLA pages found cached), **usable hit** = Σ C / Σ prompt (the "
        "state checkpoint resumed from, C ≤ L), **computed** = Σ (prompt − C), the prompt tokens the "
        "prefills ran; "
        "beside interval 0 (no checkpoint) and the KV ideal Σ (prompt − L) of the same run. **checkpoint "
        f"memory** = checkpoints held at the end × {kib(sw['state_bytes_per_slot'])} KiB of state each "
        "(nothing evicted). **resumes at**: the checkpoint a request resumes from at each shared prefix's "
        f"end ({' / '.join(map(str, PREFIXES))} tokens; the KV hit is the prefix itself), **aligned**: how "
        "many of the two the interval divides.",
        "",
        "| interval | resumes at | aligned | KV hit | usable hit | computed tokens "
        "| computed / no checkpoint | computed / KV ideal | checkpoints | checkpoint memory KiB |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in sweep:
        lines.append(
            f"| {r['interval'] or 'none'} | {' / '.join(map(str, r['resumes_at']))} | {r['aligned']} of 2 | "
            f"{r['kv_hit_rate']:.1%} | "
            f"{r['usable_hit_rate']:.1%} | {r['computed_tokens']} | {r['computed_over_no_checkpoint']:.3f} | "
            f"{r['computed_over_kv_ideal']:.3f} | {r['checkpoints_held']} | {kib(r['checkpoint_bytes'])} |"
        )
    lines += [
        "",
        f"Fewest tokens computed: interval {best['interval']} ({best['computed_over_kv_ideal']:.3f}× the KV "
        f"ideal, {kib(best['checkpoint_bytes'])} KiB of checkpoints). An interval that does not divide a "
        "shared prefix's length resumes at the checkpoint before it and recomputes the rest of the cached "
        "prefix for the state: the KV hit is the same at every interval, the usable hit is not. By "
        "alignment: "
        + "; ".join(
            f"dividing {n} of 2 shared prefixes, computed {min(g):.3f}–{max(g):.3f}× the KV ideal"
            for n in (2, 1, 0)
            if (g := [r["computed_over_kv_ideal"] for r in sweep if r["interval"] and r["aligned"] == n])
        )
        + ".",
    ]
    (out / "hybrid.md").write_text("\n".join(lines) + "\n")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.5))
    xs = [r["prompt_tokens"] for r in handoff]
    a1.plot(xs, [r["kimi_exposed_kv_s"] * 1e3 for r in handoff], marker="o", label="kimi-tiny exposed KV")
    a1.plot(xs, [r["kimi_state_s"] * 1e3 for r in handoff], marker="o", label="kimi-tiny state (serial)")
    a1.plot(xs, [r["llama_exposed_kv_s"] * 1e3 for r in handoff], marker="s", label="Llama exposed KV")
    a1.set_xscale("log", base=2)
    a1.set_xlabel("prompt tokens")
    a1.set_ylabel("after the compute (ms)")
    a1.set_title("Handoff tail per request")
    a1b = a1.twinx()
    a1b.plot(xs, [r["handoff_bytes_ratio"] for r in handoff], "k--", label="handoff bytes kimi / Llama")
    a1b.set_ylabel("bytes ratio")
    lines1, labels1 = a1.get_legend_handles_labels()
    lines2, labels2 = a1b.get_legend_handles_labels()
    a1.legend(lines1 + lines2, labels1 + labels2, fontsize=8)
    labels = [str(r["interval"] or "none") for r in sweep]
    a2.bar(
        labels,
        [r["computed_over_kv_ideal"] for r in sweep],
        color=[
            ("tab:red", "tab:orange", "tab:green")[r["aligned"]] if r["interval"] else "tab:gray"
            for r in sweep
        ],
    )
    a2.set_xlabel("checkpoint interval (tokens; green / orange / red: divides 2 / 1 / 0 shared prefixes)")
    a2.set_ylabel("prompt tokens computed / KV ideal")
    a2.set_title("Checkpoint interval vs shared prefixes")
    a2b = a2.twinx()
    a2b.plot(labels, [r["checkpoint_bytes"] / 2**20 for r in sweep], "k.-", label="checkpoint memory MiB")
    a2b.set_ylabel("checkpoint memory (MiB)")
    a2b.legend(fontsize=8, loc="upper center")
    fig.tight_layout()
    fig.savefig(out / "hybrid.png", dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[128, 256, 512, 1024, 2048])
    ap.add_argument("--rounds", type=int, default=3, help="rounds per prompt length")
    ap.add_argument("--intervals", type=int, nargs="+", default=[16, 32, 48, 64, 80, 96, 128, 256, 0])
    ap.add_argument("--out", type=Path, default=Path("docs/benchmarks"))
    ap.add_argument("--var-dir", type=Path, default=Path("var/bench/hybrid"))
    ap.add_argument("--from-json", type=Path, help="re-render the reports from an earlier run's JSON")
    args = ap.parse_args()
    if args.from_json:
        saved = json.loads(args.from_json.read_text())
        write_reports(saved["handoff"], saved["sweep"], saved["meta"], saved["raw"], args.out)
        print((args.out / "hybrid.md").read_text())
        return
    if 0 not in args.intervals:
        args.intervals.append(0)  # the baseline
    from pdserve.engine.loader import load_model

    base = CommonSettings(
        nats_url=os.environ.get("PDS_TEST_NATS_URL", "nats://127.0.0.1:4222"), var_dir=Path("var").resolve()
    )
    admin_url = os.environ.get(
        "PDS_TEST_DATABASE_URL", "postgresql+asyncpg://postgres@127.0.0.1:5432/postgres"
    )
    load_before = os.getloadavg()[0]
    sweep, sweep_meta = run_sweep(args.intervals)
    kimi = load_model("kimi-tiny", base.var_dir / "weights")
    with tempfile.TemporaryDirectory(prefix="pds-llama-") as tmp, contextlib.ExitStack() as up:
        llama_dir = llama_like_kimi_tiny(Path(tmp), kimi.config)
        llama = load_model(str(llama_dir), base.var_dir / "weights")
        stacks = {
            "kimi-tiny": up.enter_context(
                bench_stack("kimi", "kimi-tiny", base, admin_url, args.var_dir.resolve())
            ),
            "llama": up.enter_context(
                bench_stack("llama", str(llama_dir), base, admin_url, args.var_dir.resolve())
            ),
        }
        raw = run_handoff(stacks, args.lengths, args.rounds)
    kc, lc = kimi.config, llama.config
    meta = {
        "when": time.strftime("%Y-%m-%d %H:%M"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "rounds": args.rounds,
        "transport": os.environ.get("PDS_KV_TRANSPORT", "ucxx"),
        "load_avg_1min": [load_before, os.getloadavg()[0]],
        "kimi_parameters": num_parameters(kimi),
        "llama_parameters": num_parameters(llama),
        "kimi_layers": f"{kc.num_hidden_layers} layers ({kc.num_kda_layers} KDA, {kc.num_mla_layers} MLA), "
        f"hidden {kc.hidden_size}",
        "llama_layers": f"{lc.num_layers} layers, hidden {lc.hidden_size}, {lc.num_kv_heads} KV heads × "
        f"{lc.head_dim}",
        "ttft_state_transfer_s_max": max(
            x["ttft_state_transfer_s"] for d in raw["kimi-tiny"].values() for x in d
        ),
        "sweep": sweep_meta,
    }
    handoff = summarise_handoff(raw, args.lengths)
    write_reports(
        handoff, sweep, meta, {k: {str(n): v for n, v in d.items()} for k, d in raw.items()}, args.out
    )
    print((args.out / "hybrid.md").read_text())


if __name__ == "__main__":
    main()
