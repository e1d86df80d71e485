"""Metrics the recorder derives from the events it commits (docs/architecture.md §8): each request's TTFT
by phase and its lifecycle outcomes, counted once whichever process emitted the event, so a dashboard
shows exactly what the event log holds (`pdserve:ttft_phase_seconds`, `pdserve:request_outcomes_total`).
"""

from __future__ import annotations

from collections.abc import Iterable

from pdserve.events import (
    Event,
    RequestAborted,
    RequestCompleted,
    RequestFailed,
    RequestMigrated,
    RequestRecovered,
)
from pdserve.messages import FinishReason
from pdserve.states import Phase, RecoveryAction
from pdserve.telemetry.metrics import REQUEST_OUTCOMES, TTFT_PHASE_SECONDS

# RequestCompleted.ttft's fields → the `phase` label, in the order the phases happen.
TTFT_PHASES = {"queue_s": "queue", "route_s": "route", "reserve_s": "reserve", "prefill_s": "prefill",
               "exposed_transfer_s": "exposed_transfer", "first_token_s": "first_token"}
SUBMIT_PHASE = "submit"  # the gateway's RequestFailed when the coordinator refuses or ignores a Submit


def init_series() -> None:
    """Every outcome and phase the recorder can count, at 0: a panel then plots "none yet" rather than
    nothing."""
    for phase in TTFT_PHASES.values():
        TTFT_PHASE_SECONDS.labels(phase=phase)
    for reason in FinishReason:
        REQUEST_OUTCOMES.labels(outcome="completed", reason=reason.value)
    for phase in [*Phase, SUBMIT_PHASE]:
        REQUEST_OUTCOMES.labels(outcome="failed", reason=str(phase))
        REQUEST_OUTCOMES.labels(outcome="migrated", reason=str(phase))
    for action in RecoveryAction:
        REQUEST_OUTCOMES.labels(outcome="recovered", reason=action.value)
    REQUEST_OUTCOMES.labels(outcome="aborted", reason="")


def observe(events: Iterable[Event]) -> None:
    """Count newly committed events (redeliveries must not be passed twice). Payloads are read as the
    dicts they travel as: no validation on the recorder's path."""
    for e in events:
        p = e.payload
        if e.type == RequestCompleted.type:
            REQUEST_OUTCOMES.labels(outcome="completed", reason=str(p["finish_reason"])).inc()
            ttft = p.get("ttft") or {}
            # A request resumed while decoding has no placement of its own: only its total is known.
            if any(ttft.get(f) for f in TTFT_PHASES):
                for field, phase in TTFT_PHASES.items():
                    TTFT_PHASE_SECONDS.labels(phase=phase).observe(float(ttft.get(field, 0.0)))
        elif e.type == RequestFailed.type:
            REQUEST_OUTCOMES.labels(outcome="failed", reason=str(p.get("phase", ""))).inc()
        elif e.type == RequestMigrated.type:
            REQUEST_OUTCOMES.labels(outcome="migrated", reason=str(p.get("phase", ""))).inc()
        elif e.type == RequestRecovered.type:
            REQUEST_OUTCOMES.labels(outcome="recovered", reason=str(p.get("action", ""))).inc()
        elif e.type == RequestAborted.type:
            # The reason is free text (a phase, a client's disconnect): not a label.
            REQUEST_OUTCOMES.labels(outcome="aborted", reason="").inc()
