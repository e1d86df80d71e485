"""The discrete-event simulation: one clock (virtual seconds), one heap of timed events (`heapq`), the engines
of every pool stepping as pdserve's engine steps, and the request's path as pdserve takes it
(docs/architecture.md §3).

Per request: it reaches the coordinator `overheads.request_s` after it is sent; admission reserves decode KV
for prompt + output on the decode (or unified) replica with the most free blocks (`routing/router.py`: the
fewest booked decode blocks) and, while none has room, the request waits first come first served
(backpressure: `AdmissionDeferred`); a reservation, like every command a worker gets, is taken while its
step in flight computes (`workers/engine_loop.py` holds the compute lock only around the step's schedule
and sampling), and takes effect at the next step; the prefill replica is chosen
by the router's own policy (`routing/policy.py`, `make_policy`) over candidates built from the simulated
replicas — their prefix caches looked up exactly, their queued prefill blocks, their active requests. The
prefill replica's engine schedules it (`engine/scheduler.py`'s rules: a token budget per step, decodes
first, running prefill chunks, then waiting sequences while slots last — chunked prefill); its prefix cache
(`routing/cache_model.PrefixCacheModel`, LRU over pdserve's chained block hashes) gives the hit when it is
admitted. The step that completes its prompt samples the first token (streamed to the client, so TTFT ends
there unless `first_token_from='decode'`). Disaggregated: the KV (prompt tokens × KV bytes per token, plus a
hybrid's state) crosses the prefill replica's link, one transfer at a time; layer-wise, each layer leaves as
it is computed, so the transfer ends at max(prefill end + one layer's share, start + whole transfer); naive,
it starts at the prefill's end. `decode_start_s` later the sequence joins the decode batch (when a slot is
free: `max_num_seqs`). Every decode step emits one token per decoding sequence.

Speed: a decode step does not visit its sequences. Each decoding sequence's finish is a step number in a
heap (it joined before step s and needs m more tokens: it finishes at step s + m), the batch's context sum
is kept incrementally, and the ITL of every token of a step is that step's duration, recorded once with its
weight (the batch size); only a sequence's first decode token, whose gap starts at its first token, is
recorded on its own.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Sequence
from operator import attrgetter

import numpy as np

from pdserve.config import RouterSettings
from pdserve.messages import Role
from pdserve.routing.policy import Candidate, make_policy
from pdserve.sim.config import ClusterConfig, PoolRole
from pdserve.sim.cost import attention_pairs
from pdserve.sim.replica import Replica
from pdserve.sim.results import SimResult
from pdserve.sim.workload import SimRequest

_ARRIVE, _STEP, _JOIN = 0, 1, 2
# Over this many replicas the policy sees a shortlist: the SHORTLIST with the fewest queued prefill blocks
# and every replica holding the prompt's first block (a router does the same to bound its decision time).
SHORTLIST = 8
_load = attrgetter("queued_blocks")
_index = attrgetter("index")
_free = attrgetter("free_blocks")


def simulate(
    cfg: ClusterConfig, requests: Sequence[SimRequest], *, max_time_s: float = float("inf")
) -> SimResult:
    """Run `requests` through `cfg` to the end (every request completes: the config's checks guarantee
    each fits an empty replica, see `SimResult.rejected` for those that cannot) and return the per-request
    times. Deterministic for a given config and workload (the `random` policy is seeded)."""
    n = len(requests)
    colocated = cfg.mode == "colocated"
    if colocated:
        upool = cfg.pool(PoolRole.UNIFIED)
        prefill_pool = decode_pool = upool
    else:
        prefill_pool, decode_pool = cfg.pool(PoolRole.PREFILL), cfg.pool(PoolRole.DECODE)
    prefill_reps = [
        Replica(i, f"{prefill_pool.role.value}-{i}", prefill_pool, cfg.prefix_caching)
        for i in range(prefill_pool.replicas)
    ]
    decode_reps = (
        prefill_reps
        if colocated
        else [Replica(i, f"decode-{i}", decode_pool, cfg.prefix_caching) for i in range(decode_pool.replicas)]
    )
    replicas = list({id(r): r for r in prefill_reps + decode_reps}.values())
    policy = make_policy(cfg.policy, RouterSettings())
    role = Role.UNIFIED if colocated else Role.PREFILL
    bs = prefill_pool.block_size
    link = cfg.link
    ov = cfg.overheads
    model = prefill_pool.hardware.model
    kv_bpt, state_b = model.kv_bytes_per_token, model.state_bytes_per_request
    num_layers = max(model.num_layers, 1)
    first_from_decode = cfg.first_token_from == "decode"

    plen = [r.prompt_len for r in requests]
    olen = [r.output_len for r in requests]
    need = [-(-(r.prompt_len + r.output_len) // bs) for r in requests]
    t_arrive = [r.arrival_s for r in requests]
    t_admit = [np.nan] * n
    t_pstart = [np.nan] * n
    t_pend = [np.nan] * n
    t_first = [np.nan] * n
    t_kv = [np.nan] * n
    t_finish = [np.nan] * n
    cached = [0] * n
    join_step = [-1] * n  # steps its decode replica had completed when it joined the batch
    where_p: list[Replica | None] = [None] * n
    where_d: list[Replica | None] = [None] * n
    itl_vals: list[float] = []
    itl_weights: list[int] = []
    itl_first: list[float] = []
    rejected: list[int] = []
    dependents: dict[int, list[int]] = {}

    heap: list[tuple[float, int, int, object]] = []
    seq = 0

    def push(t: float, kind: int, item: object) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(heap, (t, seq, kind, item))

    admission: deque[int] = deque()
    decode_cap = decode_pool.capacity_blocks
    arrivals: list[tuple[float, int]] = []  # sent without waiting for another: merged in, not heaped
    for i, r in enumerate(requests):
        if need[i] > decode_cap or plen[i] < 1 or olen[i] < 1:
            rejected.append(i)
        elif r.after >= 0:
            dependents.setdefault(r.after, []).append(i)
        else:
            arrivals.append((r.arrival_s + ov.request_s, i))
    arrivals.sort()

    def place(i: int, reps: list[Replica]) -> Replica:
        """The replica the router's policy picks for request `i`'s prefill among `reps`."""
        if len(reps) == 1:
            return reps[0]
        hashes = requests[i].block_hashes
        max_hit = (plen[i] - 1) // bs
        prompt_blocks = -(-plen[i] // bs)
        out = []
        if len(reps) > SHORTLIST:
            short = {id(r): r for r in heapq.nsmallest(SHORTLIST, reps, key=_load)}
            if hashes and max_hit:
                first = hashes[0]
                short.update((id(r), r) for r in reps if r.cache is not None and r.cache.lookup((first,)))
            reps = sorted(short.values(), key=_index)
        for rep in reps:
            hit = rep.cache.lookup(hashes[:max_hit]) if rep.cache is not None and hashes else 0
            out.append(
                Candidate(
                    worker_id=rep.name,
                    role=role,
                    prompt_blocks=prompt_blocks,
                    cached_blocks=hit,
                    active_prefill_blocks=rep.queued_blocks,
                    active_decode_blocks=(decode_cap - rep.free_blocks + (need[i] if colocated else 0)),
                    active_requests=rep.active,
                    kv_usage=1.0 - rep.free_blocks / max(decode_cap, 1),
                )
            )
        return reps[policy.select(out)]

    def pump(now: float) -> None:
        """Admit from the head of the admission queue while a replica has room for its reservation."""
        while admission:
            i = admission[0]
            if colocated:
                rep = place(i, prefill_reps)
                if rep.free_blocks < need[i]:
                    return
                drep = rep
            else:
                drep = max(decode_reps, key=_free)
                if drep.free_blocks < need[i]:
                    return
                rep = place(i, prefill_reps)
            admission.popleft()
            drep.free_blocks -= need[i]
            where_p[i], where_d[i] = rep, drep
            rep.queued_blocks += -(-plen[i] // bs)
            rep.active += 1
            if drep is not rep:
                drep.active += 1
            t_admit[i] = now
            dispatch(i, now)

    def dispatch(i: int, now: float) -> None:
        """The reservation is made: the prompt joins its prefill (or unified) replica's queue."""
        rep = where_p[i]
        assert rep is not None
        rep.waiting.append(i)
        if not rep.busy:
            start_step(rep, now)

    def start_step(rep: Replica, now: float) -> None:
        pool = rep.pool
        max_seqs = pool.max_num_seqs
        joined: list[int] = []
        while rep.pending and rep.n_dec + len(rep.prefilling) < max_seqs:
            i = rep.pending.popleft()
            heapq.heappush(rep.heap, (rep.step_no + olen[i] - 1, i))
            join_step[i] = rep.step_no
            rep.n_dec += 1
            rep.ctx += plen[i] + 1
            joined.append(i)
        budget = pool.max_num_batched_tokens - rep.n_dec
        chunks: list[tuple[list[int], int]] = []
        ptoks = pairs = 0
        for entry in rep.prefilling:
            if budget <= 0:
                break
            k = min(plen[entry[0]] - entry[1], budget)
            chunks.append((entry, k))
            pairs += attention_pairs(entry[1], k)
            ptoks += k
            budget -= k
        while rep.waiting and budget > 0 and rep.n_dec + len(rep.prefilling) < max_seqs:
            i = rep.waiting.popleft()
            hit = 0
            if rep.cache is not None and requests[i].block_hashes:
                hit_blocks, _ = rep.cache.prefill(requests[i].block_hashes, (plen[i] - 1) // bs)
                hit = hit_blocks * bs
                rep.queued_blocks -= hit_blocks
            cached[i] = hit
            t_pstart[i] = now
            entry = [i, hit]
            rep.prefilling.append(entry)
            k = min(plen[i] - hit, budget)
            chunks.append((entry, k))
            pairs += attention_pairs(hit, k)
            ptoks += k
            budget -= k
        if not ptoks and not rep.n_dec:
            rep.busy = rep.prefill_step = False
            return
        dur = rep.cost.step_s(ptoks, pairs, rep.n_dec, rep.ctx) + ov.decode_token_s * rep.n_dec
        if ov.prefill_interference and any(o.busy and o.prefill_step for o in replicas if o is not rep):
            dur *= 1.0 + ov.prefill_interference
        rep.prefill_step = ptoks > 0
        rep.busy = True
        rep.busy_s += dur
        rep.steps += 1
        rep.plan = (chunks, joined, rep.n_dec, dur)
        push(now + dur, _STEP, rep)

    def finish(i: int, now: float) -> None:
        t_finish[i] = now
        drep, prep = where_d[i], where_p[i]
        assert drep is not None and prep is not None
        drep.free_blocks += need[i]
        drep.active -= 1
        if prep is not drep:
            prep.active -= 1
        for j in dependents.pop(i, ()):
            push(max(now, t_arrive[j]) + ov.request_s, _ARRIVE, j)
        pump(now)

    def prefill_done(rep: Replica, i: int, now: float) -> None:
        t_pend[i] = now
        rep.queued_blocks -= -(-(plen[i] - cached[i]) // bs)
        if colocated:
            t_first[i] = now + ov.first_token_s
            if olen[i] == 1:
                finish(i, now)
            else:  # the coordinator's start arrives as the next step runs: it joins the one after
                rep.starting.append(i)
            return
        nbytes = plen[i] * kv_bpt + state_b
        assert link is not None
        whole = link.latency_s + nbytes / link.bandwidth_bytes_per_s
        start = max(t_pstart[i], rep.link_free_s)
        done = (
            max(now + whole / num_layers, start + whole)
            if link.layerwise
            else max(now, rep.link_free_s) + whole
        )
        rep.link_free_s = done
        t_kv[i] = done
        join = done + ov.decode_start_s
        t_first[i] = (join if first_from_decode else now) + ov.first_token_s
        rep.active -= 1
        if olen[i] == 1:
            push(join, _JOIN, -1 - i)  # nothing to decode: the reservation ends when the transfer does
        else:
            push(join, _JOIN, i)

    next_arrival = 0
    while heap or next_arrival < len(arrivals):
        if next_arrival < len(arrivals) and (not heap or arrivals[next_arrival][0] <= heap[0][0]):
            now, item = arrivals[next_arrival]
            next_arrival += 1
            kind = _ARRIVE
        else:
            now, _, kind, item = heapq.heappop(heap)
        if now > max_time_s:
            break
        if kind == _STEP:
            rep = item  # type: ignore[assignment]
            chunks, joined, n_dec, dur = rep.plan
            starting, rep.starting = rep.starting, []  # started while this step ran
            rep.step_no += 1
            rep.step_ends.append(now)
            if n_dec:
                if n_dec > len(joined):
                    itl_vals.append(dur)
                    itl_weights.append(n_dec - len(joined))
                for i in joined:
                    itl_first.append(now - t_first[i])
                rep.ctx += n_dec
                h = rep.heap
                while h and h[0][0] == rep.step_no:
                    _, i = heapq.heappop(h)
                    rep.n_dec -= 1
                    rep.ctx -= plen[i] + olen[i]
                    finish(i, now)
            for entry, k in chunks:
                entry[1] += k
                if entry[1] >= plen[entry[0]]:
                    rep.prefilling.remove(entry)
                    prefill_done(rep, entry[0], now)
            rep.pending.extend(starting)
            start_step(rep, now)
            if not rep.busy and rep.starting:  # nothing to step: the start arrives to an idle engine
                rep.pending.extend(rep.starting)
                rep.starting = []
                start_step(rep, now)
        elif kind == _ARRIVE:
            admission.append(item)  # type: ignore[arg-type]
            pump(now)
        else:  # _JOIN
            i = item  # type: ignore[assignment]
            if i < 0:
                finish(-1 - i, now)
                continue
            drep = where_d[i]
            assert drep is not None
            drep.pending.append(i)
            if not drep.busy:
                start_step(drep, now)
    return SimResult(
        config=cfg,
        requests=list(requests),
        arrival_s=np.asarray(t_arrive),
        admit_s=np.asarray(t_admit),
        prefill_start_s=np.asarray(t_pstart),
        prefill_end_s=np.asarray(t_pend),
        first_token_s=np.asarray(t_first),
        kv_done_s=np.asarray(t_kv),
        finish_s=np.asarray(t_finish),
        cached_tokens=np.asarray(cached),
        itl_values_s=np.asarray(itl_vals),
        itl_weights=np.asarray(itl_weights, dtype=np.int64),
        itl_first_s=np.asarray(itl_first),
        rejected=rejected,
        join_step=np.asarray(join_step),
        decode_replica=[d.name if d is not None else "" for d in where_d],
        step_ends_s={r.name: np.asarray(r.step_ends) for r in replicas},
        busy_s={r.name: r.busy_s for r in replicas},
    )
