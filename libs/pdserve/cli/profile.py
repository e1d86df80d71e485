"""`pdserve profile`: measure this engine on this machine into a profile file for `pdserve sim`.

    pdserve profile --out var/profile.json                     # SmolLM2, both families, tcp + ucxx
    pdserve profile --prompt-lengths 16 64 256 --batches 1 8 --contexts 64 512 --transports tcp

Prefill time vs prompt length and chunk size, decode step time vs batch size and context length, KV/state
bytes per token per family, transfer GB/s per transport, this CPU's roofline; the fitted step cost model
with its fit error; accelerator profiles scaled from the measured efficiency (libs/pdserve/sim/).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from pdserve.cli.output import make_console

console = make_console(soft_wrap=True)


def profile(args: argparse.Namespace) -> int:
    from pdserve.sim.profiling import ProfileConfig, run_profile

    cfg = ProfileConfig(
        model=args.model,
        families=args.families,
        prompt_lengths=args.prompt_lengths,
        chunk_sizes=args.chunk_sizes,
        batches=args.batches,
        contexts=args.contexts,
        decode_steps=args.decode_steps,
        reps=args.reps,
        transports=args.transports,
    )
    prof = run_profile(cfg, progress=not args.disable_tqdm)
    prof.write(Path(args.out))
    console.print(summary(prof), markup=False)
    console.print(f"wrote {args.out}")
    return 0


def summary(prof) -> str:
    """A few lines: the fitted model, its error, the efficiency, the transfers."""
    c = prof.cost
    lines = [
        f"model {prof.model.name}: {prof.model.body_params / 1e6:.0f}M body + "
        f"{prof.model.head_params / 1e6:.0f}M "
        f"head parameters, {prof.model.kv_bytes_per_token} KV bytes/token",
        f"prefill step = {c.prefill_fixed_s * 1e3:.2f} ms + {c.prefill_token_s * 1e3:.4f} ms·tokens + "
        f"{c.prefill_pair_s * 1e9:.3f} ns·pairs   (fit error mean {prof.prefill_fit.mean_abs_rel:.1%}, "
        f"max {prof.prefill_fit.max_abs_rel:.1%}, {prof.prefill_fit.samples} samples)",
        f"decode step  = {c.decode_fixed_s * 1e3:.2f} ms + {c.decode_seq_s * 1e3:.3f} ms·batch + "
        f"{c.decode_ctx_s * 1e9:.2f} ns·batch·context   (fit error mean {prof.decode_fit.mean_abs_rel:.1%}, "
        f"max {prof.decode_fit.max_abs_rel:.1%}, {prof.decode_fit.samples} samples)",
        f"roofline: {prof.roofline.gemm_flops / 1e9:.0f} GFLOP/s, "
        f"{prof.roofline.memory_bytes_per_s / 1e9:.1f} GB/s; "
        f"efficiency compute {prof.efficiency.compute:.0%}, memory {prof.efficiency.memory:.0%}",
    ]
    lines += [
        f"cache {f.family} ({f.model}, {f.dtype}): {f.kv_bytes_per_token} KV bytes/token, "
        f"{f.state_bytes_per_request} state bytes/request"
        for f in prof.families
    ]
    lines += [
        f"transfer {t.transport}: {t.gb_s:.2f} GB/s ({t.nbytes / 2**20:.0f} MiB, {t.num_layers} layers)"
        for t in prof.transfers
    ]
    lines += [
        f"hardware {h.name}: prefill {h.cost.prefill_s(1024) * 1e3:.1f} ms @1024 tokens, decode step "
        f"{h.cost.decode_step_s(64, 2048) * 1e3:.1f} ms @64×2048, KV {h.kv_capacity_tokens} tokens"
        for h in prof.hardware
    ]
    lines += prof.notes
    return "\n".join(lines)


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("profile", help="measure this engine and machine into a profile for `pdserve sim`")
    p.add_argument("--model", default="smollm2", help="the model the cost model is fitted for")
    p.add_argument(
        "--families", nargs="+", default=["smollm2", "kimi-tiny"], help="models whose cache bytes to read"
    )
    p.add_argument("--prompt-lengths", type=int, nargs="+", default=[16, 64, 128, 256, 512])
    p.add_argument("--chunk-sizes", type=int, nargs="+", default=[128, 512], help="max_num_batched_tokens")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 32])
    p.add_argument("--contexts", type=int, nargs="+", default=[32, 256, 1024])
    p.add_argument("--decode-steps", type=int, default=6)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--transports", nargs="*", default=["tcp", "ucxx"])
    p.add_argument("--out", default="var/profile.json")
    p.add_argument("--disable-tqdm", action="store_true")
    p.set_defaults(func=profile)
