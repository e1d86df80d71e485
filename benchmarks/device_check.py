"""The GPU check: pdserve's engine and KV transfer on CUDA memory, in one short run on a lent GPU.

    python benchmarks/device_check.py [--out docs/benchmarks] [--prompts 10] [--sizes-mib 16 256]

Refuses to run without CUDA (`torch.cuda.is_available()`): nothing here is simulated. In one run:
1. **Serving**: a disaggregated SmolLM2 stack (`pdserve up`, 1 prefill + 1 decode worker) with
   `PDS_DEVICE=cuda` (bf16 weights, KV pool and forward on the GPU); 10 greedy completions of 16 tokens
   through the gateway, each compared with HF transformers' greedy decode of the same weights on the same
   GPU in the same dtype (`LlamaForCausalLM` built from pdserve's loader, bf16).
2. **Transfer**, between two processes on the GPU, at 16 and 256 MiB: bare ucxx sending a CUDA tensor
   straight from device memory (UCX's cuda_ipc / cuda_copy transports; `UCX_PROTO_INFO=y` makes the peers
   print the protocol UCX chose into the run's output: the record of no host staging), and pdserve's KV
   path as a CUDA worker runs it today (device → pinned host copy, pdserve's ucxx transport on host
   memory, host → device, in series), beside `cudaMemcpy` device to device in one process
   (`torch.Tensor.copy_` on CUDA), all in GB/s. The transfers are measured by benchmarks/transfer.py's
   own peers (`measure_transport`).
Writes gpu.json and gpu.md (with the GPU's name) under `--out`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import httpx
import torch

MIB = 1 << 20
PROMPTS = [
    "The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
    "The three primary colors are", "import numpy as np\n", "Water boils at", "The largest planet is",
    "A haiku about the sea:", "SELECT * FROM users WHERE", "The speed of light is",
]


def cuda_copy_gb_s(nbytes: int, reps: int = 20) -> float:
    """Device-to-device copy in one process (cudaMemcpy through `copy_`), GB/s of payload."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src)
    torch.cuda.synchronize()
    return reps * nbytes / (time.perf_counter() - t0) / 1e9


def transfers_gb_s(sizes: list[int], reps: int = 3) -> dict[str, dict[int, float]]:
    """Median GB/s between two processes per size, measured as benchmarks/transfer.py measures them:
    bare ucxx from CUDA memory to CUDA memory (`UCX_PROTO_INFO=y`: the peers print the protocols UCX picked
    into the run's output), and pdserve's ucxx transport on host memory (what a CUDA worker's staged KV
    travels through, `workers/kv_transfer.py`)."""
    from tqdm import tqdm

    from benchmarks.transfer import measure_transport
    from benchmarks.transfer_peers import TransportConfig

    configs = [
        TransportConfig("bare ucxx, CUDA to CUDA", "bare-ucxx", {
            "UCX_TLS": "cuda_ipc,cuda_copy,sm,self", "UCX_PROTO_INFO": "y"}, layers=1, memory="cuda"),
        TransportConfig("pdserve ucxx, host memory", "ucxx", {"UCX_TLS": "sm,self"}, layers=1),
    ]
    out: dict[str, dict[int, float]] = {}
    with tqdm(total=len(configs) * len(sizes) * reps, desc="transfers") as bar:
        for cfg in configs:
            rows = measure_transport(cfg, sizes, reps, 1, bar)
            out[cfg.name] = {row.size_mib * MIB: row.gbps_median for row in rows}
    return out


def staging_gb_s(nbytes: int) -> tuple[float, float]:
    """(device → pinned host, pinned host → device) copies of `nbytes`, GB/s each: the staging a CUDA
    worker's KV pays on each side of a host transport."""
    dev = torch.ones(nbytes, dtype=torch.uint8, device="cuda")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    rates = []
    for dst, src in ((host, dev), (dev, host)):
        dst.copy_(src)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        rates.append(nbytes / (time.perf_counter() - t0) / 1e9)
    return rates[0], rates[1]


def serve_and_compare(num_prompts: int, var_dir: Path) -> list[dict]:
    """Greedy completions through a CUDA stack against HF on the same GPU (bf16)."""
    import transformers

    from pdserve.bench.sidebyside import pdserve_stack
    from pdserve.config import ModelSettings
    from pdserve.engine.loader import load_model

    loaded = load_model("smollm2", ModelSettings().weights_cache_dir)
    c = loaded.config
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim, rope_theta=c.rope_theta, rms_norm_eps=c.rms_norm_eps,
        max_position_embeddings=c.max_position_embeddings, tie_word_embeddings=c.tie_word_embeddings))
    hf.load_state_dict(loaded.weights, strict=False)
    hf = hf.to("cuda", torch.bfloat16).eval()
    rows = []
    with pdserve_stack("disaggregated", "smollm2", var_dir, extra_env={"PDS_DEVICE": "cuda"}) as stack:
        for prompt in PROMPTS[:num_prompts]:
            r = httpx.post(f"{stack.state.gateway_url}/v1/completions", timeout=120, json={
                "model": "SmolLM2-135M-Instruct", "prompt": prompt, "max_tokens": 16, "temperature": 0,
                "ignore_eos": True})
            r.raise_for_status()
            ids = loaded.tokenizer.encode(prompt)
            with torch.no_grad():
                out = hf.generate(torch.tensor([ids], device="cuda"), max_new_tokens=16, min_new_tokens=16,
                                  do_sample=False)
            expected = loaded.tokenizer.decode(out[0, len(ids):].tolist())
            got = r.json()["choices"][0]["text"]
            rows.append({"prompt": prompt, "pdserve": got, "hf": expected, "identical": got == expected})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("docs/benchmarks"))
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--sizes-mib", type=int, nargs="+", default=[16, 256])
    args = ap.parse_args()
    if not torch.cuda.is_available():  # `make bench` runs every script: skip, do not fail, do not simulate
        print("no CUDA device: benchmarks/device_check.py runs only on a GPU; nothing measured")
        return 0
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    gpu = torch.cuda.get_device_name(0)
    result: dict = {"gpu": gpu, "generated": time.strftime("%Y-%m-%d %H:%M"), "transfer": []}
    result["greedy"] = serve_and_compare(args.prompts, Path("var") / "device_check")
    sizes = [mib * MIB for mib in args.sizes_mib]
    moved = transfers_gb_s(sizes)
    for n in sizes:
        d2h, h2d = staging_gb_s(n)
        host = moved["pdserve ucxx, host memory"][n]
        staged = n / (n / (d2h * 1e9) + n / (host * 1e9) + n / (h2d * 1e9)) / 1e9  # the three in series
        row = {"mib": n // MIB, "cuda_copy_gb_s": cuda_copy_gb_s(n),
               "bare_ucxx_cuda_gb_s": moved["bare ucxx, CUDA to CUDA"][n], "d2h_gb_s": d2h, "h2d_gb_s": h2d,
               "host_transfer_gb_s": host, "end_to_end_gb_s": staged}
        row["bare_over_copy"] = row["bare_ucxx_cuda_gb_s"] / row["cuda_copy_gb_s"]
        row["staged_over_copy"] = staged / row["cuda_copy_gb_s"]
        result["transfer"].append(row)
        print(row, flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu.json").write_text(json.dumps(result, indent=2))
    (args.out / "gpu.md").write_text(markdown(result))
    return 0


def markdown(r: dict) -> str:
    same = sum(g["identical"] for g in r["greedy"])
    lines = [
        f"# pdserve on {r['gpu']}", "",
        f"Generated by `python benchmarks/device_check.py` on {r['generated']}.", "",
        f"Greedy, SmolLM2 bf16 disaggregated on the GPU vs HF on the same GPU: {same} of {len(r['greedy'])} "
        "completions identical.", "",
        "| MiB | cudaMemcpy D2D GB/s | bare ucxx CUDA GB/s | × D2D | pdserve, host-staged GB/s | × D2D |",
        "|---|---|---|---|---|---|",
        *(f"| {t['mib']} | {t['cuda_copy_gb_s']:.1f} | {t['bare_ucxx_cuda_gb_s']:.1f} | "
          f"{t['bare_over_copy']:.2f}× | {t['end_to_end_gb_s']:.1f} | {t['staged_over_copy']:.2f}× |"
          for t in r["transfer"]),
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
