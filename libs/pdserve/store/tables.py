"""The event store's tables as SQLAlchemy Core metadata (docs/architecture.md §7).

The schema itself is made by the Alembic migrations in `migrations/`; these definitions are what the
recorder and the queries read and write, and what `alembic revision --autogenerate` compares against.

- `events`: one row per lifecycle event, in JetStream stream order (`stream_seq`).
- `requests`: the projection, one row per request, folded from its events by
  `pdserve.store.projection.apply`.
"""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import JSONB

from pdserve.states import RequestState

metadata = sa.MetaData()

# The values `requests.state` may hold: `pdserve.states.RequestState`, in lifecycle order.
REQUEST_STATES: tuple[str, ...] = tuple(s.value for s in RequestState)

events = sa.Table(
    "events",
    metadata,
    sa.Column("event_id", sa.Uuid(as_uuid=False), primary_key=True),
    sa.Column("stream_seq", sa.BigInteger, nullable=False),
    sa.Column("request_id", sa.Uuid(as_uuid=False), nullable=False, index=True),
    sa.Column("type", sa.Text, nullable=False),
    sa.Column("schema_version", sa.Integer, nullable=False),
    sa.Column("ts", sa.DateTime(timezone=True), nullable=False),
    sa.Column("service", sa.Text, nullable=False),
    sa.Column("worker_id", sa.Text),
    sa.Column("trace_id", sa.Text),
    sa.Column("span_id", sa.Text),
    sa.Column("payload", JSONB, nullable=False),
    sa.UniqueConstraint("stream_seq", name="events_stream_seq_key"),
)

requests = sa.Table(
    "requests",
    metadata,
    sa.Column("request_id", sa.Uuid(as_uuid=False), primary_key=True),
    sa.Column("state", sa.Text, nullable=False),
    sa.Column("model", sa.Text),
    sa.Column("mode", sa.Text),
    sa.Column("prefill_worker_id", sa.Text),
    sa.Column("decode_worker_id", sa.Text),
    sa.Column("prompt_tokens", sa.Integer),
    sa.Column("completion_tokens", sa.Integer),
    sa.Column("cached_tokens", sa.Integer),
    sa.Column("computed_tokens", sa.Integer),
    sa.Column("kv_bytes", sa.BigInteger),
    # A hybrid's hit pair (migration 0006): the checkpoint C the prefill resumed from (cached_tokens is L),
    # the router's prediction of both, and the state bytes handed off apart from kv_bytes.
    sa.Column("checkpoint_tokens", sa.Integer),
    sa.Column("predicted_cached_tokens", sa.Integer),
    sa.Column("predicted_checkpoint_tokens", sa.Integer),
    sa.Column("state_bytes", sa.BigInteger),
    sa.Column("transfer_s", sa.Float),
    sa.Column("ttft_s", sa.Float),
    sa.Column("queue_s", sa.Float),
    sa.Column("route_s", sa.Float),
    sa.Column("reserve_s", sa.Float),
    sa.Column("prefill_s", sa.Float),
    sa.Column("exposed_transfer_s", sa.Float),
    sa.Column("first_token_s", sa.Float),
    sa.Column("e2e_s", sa.Float),
    sa.Column("finish_reason", sa.Text),
    sa.Column("failure_phase", sa.Text),
    sa.Column("failure_reason", sa.Text),
    sa.Column("received_at", sa.DateTime(timezone=True)),
    sa.Column("finished_at", sa.DateTime(timezone=True)),
    sa.Column("last_stream_seq", sa.BigInteger, nullable=False),
    sa.CheckConstraint(
        "state IN (" + ", ".join(f"'{s}'" for s in REQUEST_STATES) + ")", name="requests_state_valid"
    ),
    sa.Index("ix_requests_state", "state"),
    sa.Index("ix_requests_received_at", "received_at"),
)

REQUEST_COLUMNS: tuple[str, ...] = tuple(c.name for c in requests.columns)
