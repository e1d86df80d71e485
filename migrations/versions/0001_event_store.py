"""Event store: the events log and the requests projection.

Revision ID: 0001
Revises:
Create Date: 2026-11-29
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Spelled out here, not imported from pdserve.store.tables: a migration is a frozen record of the schema.
_STATES = ("received", "routed", "reserved", "prefilling", "transferred", "decoding", "completed", "failed",
           "aborted")


def upgrade() -> None:
    op.create_table(
        "events",
        sa.Column("event_id", sa.Uuid(as_uuid=False), primary_key=True),
        sa.Column("stream_seq", sa.BigInteger, nullable=False),
        sa.Column("request_id", sa.Uuid(as_uuid=False), nullable=False),
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
    op.create_index("ix_events_request_id", "events", ["request_id"])

    op.create_table(
        "requests",
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
        sa.CheckConstraint("state IN (" + ", ".join(f"'{s}'" for s in _STATES) + ")",
                           name="requests_state_valid"),
    )
    op.create_index("ix_requests_state", "requests", ["state"])
    op.create_index("ix_requests_received_at", "requests", ["received_at"])


def downgrade() -> None:
    op.drop_index("ix_requests_received_at", table_name="requests")
    op.drop_index("ix_requests_state", table_name="requests")
    op.drop_table("requests")
    op.drop_index("ix_events_request_id", table_name="events")
    op.drop_table("events")
