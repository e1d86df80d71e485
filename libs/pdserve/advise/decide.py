"""The decision: which of the four stages a stack's measurements justify, and why, step by step.

The stages and their order are the four-stage method (docs/advise.md): 1 one pool with prefix caching (the
baseline), 2 more capacity where bound (a host offload tier for cross-request recompute, more KV for
capacity), 3 disaggregated prefill and decode, 4 several replicas with cache-aware routing and a shared store.
Each stage is warranted only by a measurement of the one before; "not yet" is an answer. Stage 3's test is
the disaggregation checklist (all must hold): the transfer is cheaper than the prefill it saves, chunked
prefill is on, p99 ITL ≥ 2 × p50 with it, the colocated baseline misses its SLO for enough requests that
there is goodput to win (the seed's "the gain is largest when SLOs are tight on both TTFT and ITL";
DistServe's goodput counts requests within the SLO), the prompt:output ratio is extreme (≥ 10:1 or ≤ 1:20),
and the second pool's weight copy is a small share of the fleet; with an engine profile, also that
`pdserve sim`, fitted to this log, gives a split of the same fleet ≥ 1.1× the baseline's goodput on these
requests (`whatif.py`: DistServe's placement search, asked of the traffic served). Thresholds are
`Thresholds`' fields.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

from pdserve.advise.economics import Duplication, duplication
from pdserve.advise.evidence import Evidence, Measurement, measured, missing
from pdserve.advise.models import ModelSpec
from pdserve.advise.whatif import GAIN
from pdserve.hardware.links import Link, classify

Answer = Literal["yes", "no", "unknown"]
Status = Literal["baseline", "in place", "warranted", "not yet", "unknown"]


class Thresholds(BaseModel):
    """Where each check flips. `interference_ratio`: the checklist's p99 < 2 × p50; `extreme_ratio`: RAG's
    10:1 and long generation's 1:20; the rest are pdserve's choices, stated in docs/advise.md."""

    model_config = ConfigDict(frozen=True)

    interference_ratio: float = 2.0
    slo_attainment: float = 0.90  # DistServe's attainment target (§6: 90% of requests within the SLO)
    split_gain: float = 1.1  # the simulated split's goodput ÷ the baseline's (bench compare's 10% margin)
    extreme_in_out: float = 10.0
    extreme_out_in: float = 20.0
    transfer_over_prefill: float = 1.0
    duplication_share: float = 0.05
    deferred_share: float = 0.05
    eviction_gap_share: float = 0.10
    routing_gap_share: float = 0.10


class Check(BaseModel):
    """One question of the method, its answer and the measurements it read (`Advice.measurements` keys)."""

    model_config = ConfigDict(frozen=True)

    stage: int
    question: str
    answer: Answer
    because: str
    reads: tuple[str, ...]


class StageVerdict(BaseModel):
    model_config = ConfigDict(frozen=True)

    stage: int
    name: str
    status: Status
    because: str


class ReplicaHit(BaseModel):
    """One prefill replica's hit rate against the router's ceiling (`routing.report.ReplicaStats`)."""

    model_config = ConfigDict(frozen=True)

    replica: str
    requests: int
    hit_rate: float
    ceiling_hit_rate: float


class Advice(BaseModel):
    """The answer: `stage` (1-4) the measurements justify, `verdict` in words, each stage's status, every
    check, every measurement (with its source; value None where it could not be measured, with why)."""

    model_config = ConfigDict(frozen=True)

    stage: int
    verdict: str
    stages: tuple[StageVerdict, ...]
    checks: tuple[Check, ...]
    measurements: dict[str, Measurement]
    model: ModelSpec
    link: Link
    duplication: Duplication
    requests: int
    completed: int
    modes: dict[str, int]
    replicas: tuple[ReplicaHit, ...] = ()


STAGE_NAMES = {
    1: "one pool, prefix caching on",
    2: "capacity where bound (offload tier, more KV)",
    3: "disaggregated prefill and decode",
    4: "replicas with cache-aware routing and a shared store",
}


def _fmt(x: Measurement | None, digits: int = 2) -> str:
    if x is None or x.value is None:
        return "unmeasured"
    return f"{x.value:.{digits}f}"


def advise(
    ev: Evidence,
    model: ModelSpec,
    link: Link,
    fleet_accelerators: int,
    accelerator_memory_bytes: float,
    accelerator_source: str,
    t: Thresholds | None = None,
) -> Advice:
    """Decide from `ev`. `model`: the served model's spec (KV and state bytes when the log has no transfer);
    `link`: the interconnect a disaggregated deployment of this stack would use (the transfer estimate when
    the log has none); `fleet_accelerators` × `accelerator_memory_bytes`: the fleet for the duplication
    share."""
    t = t or Thresholds()
    m = dict(ev.m)
    checks: list[Check] = []

    def check(stage: int, question: str, answer: Answer, because: str, *reads: str) -> Answer:
        checks.append(Check(stage=stage, question=question, answer=answer, because=because, reads=reads))
        return answer

    mode_text = ", ".join(f"{k} {v}" for k, v in sorted(ev.modes.items())) or "none routed"
    colocated = ev.modes.get("colocated", 0) > 0
    disagg = ev.modes.get("disaggregated", 0) > 0

    # --- stage 2: capacity where bound
    deferred = m["admission_deferred_share"]
    cap = check(
        2,
        "Capacity-bound? (admission deferrals)",
        "yes" if (deferred.value or 0) >= t.deferred_share else "no",
        f"{deferred.value:.1%} of requests waited for KV (threshold {t.deferred_share:.0%})",
        "admission_deferred_share",
        "preemptions",
    )
    ev_gap = m.get("eviction_gap_share")
    recompute = check(
        2,
        "Bound by cross-request recompute? (blocks computed before, held by no worker)",
        "unknown" if ev_gap is None else "yes" if ev_gap.value >= t.eviction_gap_share else "no",
        "the log has no prompt block hashes with cached-token counts (no PrefillCompleted)"
        if ev_gap is None
        else f"{ev_gap.value:.1%} of prompt tokens were computed again although an earlier request had "
        f"computed them (threshold {t.eviction_gap_share:.0%})",
        "reuse_ceiling_hit_rate",
        "router_ceiling_hit_rate",
        "eviction_gap_share",
    )
    tiers_in_place = bool(ev.tiers)

    # --- stage 3: the checklist
    p50, p95 = m.get("prompt_tokens_p50"), m.get("prompt_tokens_p95")
    if "transfer_bytes_p95" in m:
        bytes95 = m["transfer_bytes_p95"].value
        bytes_src = "transfer_bytes_p95"
    elif p95 is not None and p95.value is not None:
        bytes95 = model.transfer_bytes(int(round(p95.value)))
        m["kv_bytes_p95_estimated"] = measured(
            "kv_bytes_p95_estimated",
            bytes95,
            "B",
            f"prompt_tokens_p95 × {model.kv_bytes_per_token} B/token + "
            f"{model.state_bytes_per_request} B state "
            f"({model.name}: {model.source})",
            p95.samples,
        )
        bytes_src = "kv_bytes_p95_estimated"
    else:
        bytes95, bytes_src = None, "prompt_tokens_p95"
    if p50 is not None and p50.value is not None:
        m["kv_bytes_p50_estimated"] = measured(
            "kv_bytes_p50_estimated",
            model.transfer_bytes(int(round(p50.value))),
            "B",
            f"prompt_tokens_p50 × {model.kv_bytes_per_token} B/token + "
            f"{model.state_bytes_per_request} B state",
            p50.samples,
        )
    measured_bw = m["transfer_GB_s_max"].value if "transfer_GB_s_max" in m else None
    if measured_bw:
        match = classify(measured_bw)
        m["interconnect_class"] = measured(
            "interconnect_class",
            measured_bw,
            "GB/s",
            m["transfer_GB_s_max"].source,
            m["transfer_GB_s_max"].samples,
            f"nearest in the link table: {match.nearest.name}; reaches "
            f"{match.fastest_reached.name if match.fastest_reached else 'none of the fabric links'}; "
            f"RDMA class: {'yes' if match.rdma_class else 'no'}",
        )
    prefill95 = m.get("prefill_s_p95")
    if bytes95 is not None and prefill95 is not None:
        xfer95 = link.transfer_s(bytes95)
        m["transfer_s_p95_on_link"] = measured(
            "transfer_s_p95_on_link",
            xfer95,
            "s",
            f"{bytes_src} on {link.name} ({link.achievable_GB_s} GB/s: {link.achievable_source})",
            m[bytes_src].samples,
        )
        ratio = xfer95 / prefill95.value if prefill95.value else float("inf")
        cheap = check(
            3,
            "Is moving the KV cheaper than recomputing it? (p95 prompt)",
            "yes" if ratio < t.transfer_over_prefill else "no",
            f"{bytes95 / 1e6:.2f} MB over {link.name} takes {xfer95 * 1e3:.2f} ms against "
            f"{prefill95.value * 1e3:.1f} ms of prefill ({ratio:.3f}×)",
            bytes_src,
            "transfer_s_p95_on_link",
            "prefill_s_p95",
            "interconnect_class",
        )
    else:
        cheap = check(
            3,
            "Is moving the KV cheaper than recomputing it? (p95 prompt)",
            "unknown",
            "no completed request with a prompt length and a prefill time in the window",
            "prompt_tokens_p95",
            "prefill_s_p95",
        )
    chunked = check(
        3,
        "Is chunked prefill on?",
        "yes" if colocated else "unknown",
        "pdserve's unified (colocated) worker always schedules prefill in chunks under "
        "PDS_MAX_NUM_BATCHED_TOKENS (the log does not record the budget)"
        if colocated
        else f"no colocated request in the window ({mode_text}): the checklist asks this of the "
        "colocated baseline",
    )
    itl = m.get("itl_p99_over_p50")
    if itl is None or itl.value is None:
        interf: Answer = check(
            3,
            "Prefill/decode interference after chunked prefill? (p99 ITL ≥ 2 × p50)",
            "unknown",
            itl.note if itl else "ITL not measured",
            "itl_p99_over_p50",
        )
    elif not colocated:
        interf = check(
            3,
            "Prefill/decode interference after chunked prefill? (p99 ITL ≥ 2 × p50)",
            "unknown",
            f"this log's p99/p50 ITL is {itl.value:.2f}× but its requests ran {mode_text}: "
            "interference is a property of the colocated baseline",
            "itl_p99_over_p50",
        )
    else:
        interf = check(
            3,
            "Prefill/decode interference after chunked prefill? (p99 ITL ≥ 2 × p50)",
            "yes" if itl.value >= t.interference_ratio else "no",
            f"p99 ITL {_fmt(m.get('itl_p99_ms'), 1)} ms = {itl.value:.2f}× p50 "
            f"{_fmt(m.get('itl_p50_ms'), 1)} ms (threshold {t.interference_ratio:g}×)",
            "itl_p50_ms",
            "itl_p99_ms",
            "itl_p99_over_p50",
        )
    att = m["slo_attainment"]
    slo_question = f"Does the baseline miss its SLO? (attainment < {t.slo_attainment:.0%})"
    if att.value is None or not colocated:
        slo_missed: Answer = check(
            3,
            slo_question,
            "unknown",
            att.note
            if att.value is None
            else f"{att.value:.0%} met the SLO but the requests ran {mode_text}: the question is asked of "
            "the colocated baseline",
            "slo_attainment",
        )
    else:
        slo_missed = check(
            3,
            slo_question,
            "yes" if att.value < t.slo_attainment else "no",
            f"{att.value:.0%} of {att.samples} requests met it ({att.source})"
            + (
                ""
                if att.value < t.slo_attainment
                else ": whatever interference there is costs no goodput at this load, and disaggregation's "
                "gain is goodput at the same SLO"
            ),
            "slo_attainment",
        )
    gain = m.get(GAIN)
    split_question = (
        f"Would a split of this fleet serve more of these requests within the SLO? (simulated, ≥ "
        f"{t.split_gain:g}× goodput)"
    )
    if gain is None or gain.value is None:
        split: Answer = check(
            3,
            split_question,
            "unknown",
            gain.note
            if gain is not None
            else "no engine profile given (--profile, from `pdserve profile`): the split was not simulated",
        )
    elif not colocated:
        split = check(
            3, split_question, "unknown", f"the requests ran {mode_text}: the log is not the baseline's", GAIN
        )
    else:
        best, co = m["split_goodput_best"], m["split_goodput_colocated"]
        split = check(
            3,
            split_question,
            "yes" if gain.value >= t.split_gain else "no",
            f"{best.value:.3f} req/s simulated for {best.note} against {co.value:.3f} for {co.note} "
            f"({gain.value:.2f}×)",
            "split_goodput_colocated",
            "split_goodput_best",
            GAIN,
        )
    r = m["prompt_to_output_ratio"]
    if r.value is None:
        extreme: Answer = check(
            3,
            "Is the prefill:decode ratio extreme? (≥ 10:1 or ≤ 1:20)",
            "unknown",
            r.note,
            "prompt_to_output_ratio",
        )
    else:
        lop = r.value >= t.extreme_in_out or r.value <= 1 / t.extreme_out_in
        extreme = check(
            3,
            "Is the prefill:decode ratio extreme? (≥ 10:1 or ≤ 1:20)",
            "yes" if lop else "no",
            f"prompt:output tokens {r.value:.2f}:1",
            "prompt_to_output_ratio",
            "computed_to_output_ratio",
        )
    dup = duplication(
        model.weight_bytes,
        accelerator_memory_bytes,
        accelerator_source,
        fleets=(fleet_accelerators,),
        threshold=t.duplication_share,
    )
    share = dup.rows[0].weight_share
    m["weight_duplication_share"] = measured(
        "weight_duplication_share",
        share,
        "of fleet memory",
        f"{model.name} weights {model.weight_bytes / 1e9:.3f} GB ({model.source}) / ({fleet_accelerators} × "
        f"{accelerator_memory_bytes / 1e9:.1f} GB: {accelerator_source})",
        1,
    )
    scale = check(
        3,
        "Is the second pool's weight copy a small share of the fleet?",
        "yes" if share <= t.duplication_share else "no",
        f"{share:.2%} of {fleet_accelerators} accelerators' memory (threshold {t.duplication_share:.0%}; "
        f"≤ it from {dup.fleet_for_threshold} accelerators)",
        "weight_duplication_share",
    )
    check(
        3,
        "Engineering capacity for the transfer path, cross-pool scheduling and their failure modes?",
        "unknown",
        "not a measurement: a question for whoever runs it",
    )

    # --- stage 4: replicas and routing
    replicas = max(len(ev.prefill_workers), len(ev.decode_workers) if colocated else 0)
    gap = m.get("routing_gap_share")
    multi = check(
        4,
        "Several replicas? (the 1/N hit-rate problem)",
        "yes" if replicas >= 2 else "no",
        f"{replicas} replica(s) prefilled requests in the window",
        "hit_rate",
    )
    if gap is None:
        routing_gap: Answer = check(
            4,
            "Does routing lose prefix hits? (router ceiling − hit rate)",
            "unknown",
            m["hit_rate"].note if "hit_rate" in m else "no routing facts",
            "hit_rate",
        )
    else:
        routing_gap = check(
            4,
            "Does routing lose prefix hits? (router ceiling − hit rate)",
            "yes" if gap.value >= t.routing_gap_share else "no",
            f"hit rate {m['hit_rate'].value:.1%} against the perfect router's "
            f"{m['router_ceiling_hit_rate'].value:.1%}"
            f": {gap.value:.1%} of prompt tokens recomputed that a replica held (threshold "
            f"{t.routing_gap_share:.0%}); per replica: "
            + ", ".join(
                f"{x.replica} {x.hit_rate:.0%}/{x.ceiling_hit_rate:.0%}" for x in ev.routing.replicas
            ),
            "hit_rate",
            "router_ceiling_hit_rate",
            "routing_gap_share",
        )

    # --- verdicts
    stages = [
        StageVerdict(
            stage=1,
            name=STAGE_NAMES[1],
            status="baseline",
            because="every deployment starts here; its measurements decide the next stage",
        )
    ]
    if tiers_in_place:
        s2: Status = "in place"
        why2 = "KV tiers hit: " + ", ".join(f"{k} {v} tokens" for k, v in sorted(ev.tiers.items()))
    elif "yes" in (cap, recompute):
        s2, why2 = (
            "warranted",
            ("capacity-bound" if cap == "yes" else "recompute of evicted prefixes")
            + " (see the stage-2 checks)",
        )
    elif recompute == "unknown" and cap == "no":
        s2, why2 = "not yet", "no admission pressure; recompute not measurable from this log"
    else:
        s2, why2 = "not yet", "neither capacity- nor recompute-bound"
    stages.append(StageVerdict(stage=2, name=STAGE_NAMES[2], status=s2, because=why2))
    # The simulated split is asked only where it was simulated (an engine profile): without one, stage 3
    # rests on the checklist alone, as the seed's does.
    s3_answers = (cheap, chunked, interf, slo_missed, extreme, scale) + (
        (split,) if split != "unknown" else ()
    )
    failed = [c.question for c in checks if c.stage == 3 and c.answer == "no"]
    if disagg and not colocated:
        s3: Status = "in place"
        why3 = f"the stack runs disaggregated ({mode_text}); transfer check: {cheap}"
    elif all(a == "yes" for a in s3_answers):
        s3, why3 = "warranted", "every measurable checklist item holds"
    elif failed:
        s3, why3 = "not yet", "no: " + "; ".join(failed)
    else:
        s3, why3 = (
            "unknown",
            "unmeasured: "
            + "; ".join(c.question for c in checks if c.stage == 3 and c.answer == "unknown" and c.reads),
        )
    stages.append(StageVerdict(stage=3, name=STAGE_NAMES[3], status=s3, because=why3))
    ceiling = m.get("router_ceiling_hit_rate")
    if multi == "yes" and ceiling is not None and ceiling.value < t.routing_gap_share:
        s4: Status = "not yet"
        why4 = (
            f"no prefix the replicas could share: the perfect router would hit {ceiling.value:.1%} of prompt "
            "tokens"
        )
    elif multi == "yes" and routing_gap == "no" and ev.routing.policies.get("kv"):
        s4 = "in place"
        why4 = f"cache-aware routing (kv) reaches {ev.routing.of_ceiling:.1%} of the ceiling"
    elif multi == "yes" and routing_gap == "yes":
        s4, why4 = "warranted", "replicas lose prefix hits to placement (see the stage-4 checks)"
    elif multi == "no":
        s4, why4 = "not yet", "one replica: no 1/N problem"
    elif routing_gap == "unknown":
        s4, why4 = "unknown", "hit rate per replica not measurable from this log"
    else:
        s4, why4 = "not yet", "routing already reaches the ceiling"
    stages.append(StageVerdict(stage=4, name=STAGE_NAMES[4], status=s4, because=why4))

    stage = max(v.stage for v in stages if v.status in ("baseline", "in place", "warranted"))
    warranted = [v for v in stages if v.status == "warranted"]
    if warranted:
        verdict = (
            "go to stage "
            + " and ".join(str(v.stage) for v in warranted)
            + ": "
            + "; ".join(f"{v.name} ({v.because})" for v in warranted)
        )
    else:
        where = stages[stage - 1]
        placed = ", in place" if where.status == "in place" else ""
        verdict = f"not yet: stay at stage {stage} ({where.name}{placed})"
    return Advice(
        stage=stage,
        verdict=verdict,
        stages=tuple(stages),
        checks=tuple(checks),
        measurements=m,
        model=model,
        link=link,
        duplication=dup,
        requests=ev.requests,
        completed=ev.completed,
        modes=ev.modes,
        replicas=tuple(
            ReplicaHit(
                replica=x.replica,
                requests=x.requests,
                hit_rate=x.hit_rate,
                ceiling_hit_rate=x.ceiling_hit_rate,
            )
            for x in ev.routing.replicas
        ),
    )


__all__ = ["Advice", "Check", "StageVerdict", "Thresholds", "advise", "missing"]
