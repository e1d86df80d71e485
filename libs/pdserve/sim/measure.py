"""`pdserve profile`'s measurements of this engine on this machine, one torch thread (as a worker runs).

- Prefill: one prompt of each length, chunked at each budget (`max_num_batched_tokens`), every step of
  the prompt timed on `LLMEngine` (fastest of `reps`). A fresh cache salt per call: no prefix hit.
- Decode: `batch` sequences whose prompt KV is marked computed without a forward (`reserve` +
  `mark_computed` + `admit`, the decode worker's own path after a transfer; the values in the KV do not
  change the time), then the median of `steps` decode steps.
- Cache bytes per family: `cache_spec()` of each model (engine/model_family.py `CacheSpec`).
- Transfers: a sender transport here and a receiver in a spawned process, a `num_layers`-layer KV sent as a
  prefill worker sends it (every layer's chunk in flight, end marker, wait), fastest of `reps`.
- Roofline: a 2048³ fp32 GEMM through `engine/linear.Linear` (oneDNN prepacked) and a 256 MiB copy.
"""

from __future__ import annotations

import asyncio
import itertools
import statistics
import time
from collections.abc import Callable, Iterable

import torch

from pdserve.engine.linear import Linear
from pdserve.engine.llm_engine import EngineConfig, LLMEngine
from pdserve.engine.model_family import EngineModel
from pdserve.engine.sequence import Sequence
from pdserve.messages import SamplingParams
from pdserve.sim.profile import CacheBytes, DecodeSample, PrefillSample, Roofline, TransferSample

_salt = itertools.count()


def _best(reps: int, fn: Callable[[], float | None]) -> float:
    """Fastest of `reps` calls; `fn` returns its own seconds or None to be timed whole."""
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        s = fn()
        out.append(s if s is not None else time.perf_counter() - t0)
    return min(out)


def roofline() -> Roofline:
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    packed = Linear(b.t())
    gemm_s = _best(3, lambda: (packed(a), None)[1])
    src = torch.ones(64 << 20)
    dst = torch.empty_like(src)
    copy_s = _best(3, lambda: (dst.copy_(src), None)[1])
    return Roofline(
        gemm_flops=2 * 2048**3 / gemm_s,
        memory_bytes_per_s=2 * src.nbytes / copy_s,
        threads=torch.get_num_threads(),
    )


def _prompt(vocab: int, n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab, (n,), generator=g).tolist()


def measure_prefill(
    model: EngineModel, lengths: Iterable[int], chunks: Iterable[int], reps: int, tick: Callable[[str], None]
) -> list[PrefillSample]:
    vocab = model.config.vocab_size
    out = []
    for chunk in chunks:
        engine = LLMEngine(model, EngineConfig(num_blocks=512, max_num_batched_tokens=chunk, max_num_seqs=8))
        for n in lengths:
            prompt = _prompt(vocab, n, n)

            def run(prompt: list[int] = prompt, engine: LLMEngine = engine) -> float:
                seq = Sequence(
                    "p",
                    prompt,
                    SamplingParams(max_tokens=1, temperature=0, ignore_eos=True),
                    cache_salt=str(next(_salt)),
                )
                engine.add_request(seq)
                t0 = time.perf_counter()
                while engine.has_work:
                    engine.step()
                return time.perf_counter() - t0

            out.append(PrefillSample(prompt_tokens=n, chunk_tokens=chunk, seconds=_best(reps, run)))
            tick(f"prefill {n} tokens, chunk {chunk}: {out[-1].seconds * 1000:.0f} ms")
    return out


def measure_decode(
    model: EngineModel,
    batches: Iterable[int],
    contexts: Iterable[int],
    steps: int,
    tick: Callable[[str], None],
) -> list[DecodeSample]:
    vocab = model.config.vocab_size
    batches, contexts = list(batches), list(contexts)
    out = []
    for ctx in contexts:
        need = max(batches) * (-(-(ctx + steps + 2) // 16))
        engine = LLMEngine(
            model,
            EngineConfig(
                num_blocks=need + 16, max_num_batched_tokens=max(512, max(batches)), max_num_seqs=max(batches)
            ),
        )
        for b in batches:
            seqs = []
            for k in range(b):
                seq = Sequence(
                    f"d{k}",
                    _prompt(vocab, ctx, k),
                    SamplingParams(max_tokens=steps + 2, temperature=0, ignore_eos=True),
                    cache_salt=str(next(_salt)),
                )
                engine.reserve(seq, steps + 2)
                engine.mark_computed(seq, len(seq))
                engine.admit(seq, 1000 + k)
                seqs.append(seq)
            times = []
            for _ in range(steps):
                t0 = time.perf_counter()
                engine.step()
                times.append(time.perf_counter() - t0)
            for seq in seqs:
                engine.free(seq)
            # the context a step attends over: prompt + first token + the steps before it (mid-run value)
            out.append(DecodeSample(batch=b, context=ctx + 1 + steps // 2, seconds=statistics.median(times)))
            tick(f"decode batch {b}, context {ctx}: {out[-1].seconds * 1000:.1f} ms/step")
    return out


def cache_bytes(name: str, model: EngineModel) -> CacheBytes:
    spec = model.cache_spec()
    return CacheBytes(
        family=getattr(model, "family", "llama"),
        model=name,
        dtype=str(model.dtype).removeprefix("torch."),
        num_paged_layers=spec.num_paged_layers,
        paged_row_shape=list(spec.paged_row_shape),
        kv_bytes_per_token=spec.kv_bytes_per_token(model.dtype),
        state_bytes_per_request=spec.state.bytes_per_slot(model.dtype) if spec.state is not None else 0,
    )


def _receiver(kind: str, nbytes: int, num_layers: int, reps: int, conn) -> None:
    """Child process: a receiving transport; expects each transfer, reports when it was all verified
    (perf_counter: CLOCK_MONOTONIC, comparable across processes)."""

    async def main() -> None:
        from pdserve.transfer import make_transport

        transport = make_transport(kind)
        await transport.start()
        try:
            dst = [torch.zeros(nbytes // num_layers // 4096, 2, 8, 64) for _ in range(num_layers)]
            conn.send(transport.endpoint())
            for rep in range(reps + 1):
                inbound = transport.expect(f"profile-{rep}", dst)
                conn.send("ready")
                await inbound.wait(120)
                conn.send(time.perf_counter())
        finally:
            await transport.stop()

    asyncio.run(main())


async def _send_all(kind: str, nbytes: int, num_layers: int, reps: int, conn) -> list[float]:
    from pdserve.transfer import make_transport

    sender = make_transport(kind)
    await sender.start()
    try:
        src = [torch.rand(nbytes // num_layers // 4096, 2, 8, 64) for _ in range(num_layers)]
        endpoint = await asyncio.to_thread(conn.recv)
        seconds = []
        for rep in range(reps + 1):  # the first warms up the endpoint and page-faults the buffers
            await asyncio.to_thread(conn.recv)  # the receiver expects it
            tid = f"profile-{rep}"
            t0 = time.perf_counter()
            sends = [sender.send_layer(endpoint, tid, layer, 0, 0, data) for layer, data in enumerate(src)]
            await asyncio.gather(*sends, sender.finish(endpoint, tid, num_layers, 1))
            landed = await asyncio.to_thread(conn.recv)
            if rep:
                seconds.append(landed - t0)
        return seconds
    finally:
        await sender.stop()


def measure_transfer(kind: str, nbytes: int, num_layers: int, reps: int) -> TransferSample:
    """Sender here, receiver in a spawned process (one UCX worker per process). Raises whatever the
    transport raises, TimeoutError when the receiver does not answer (the caller records it as not
    measured)."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    child = ctx.Process(target=_receiver, args=(kind, nbytes, num_layers, reps, there), daemon=True)
    child.start()
    try:
        if not here.poll(120):
            raise TimeoutError(f"{kind} receiver did not start in 120 s")
        seconds = asyncio.run(_send_all(kind, nbytes, num_layers, reps, here))
    finally:
        child.join(30)
        if child.is_alive():
            child.kill()
    return TransferSample(
        transport=kind,
        nbytes=nbytes - nbytes % (num_layers * 4096),
        num_layers=num_layers,
        seconds=min(seconds),
    )
