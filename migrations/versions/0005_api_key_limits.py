"""Per-key limits of the gateway's API keys: a request rate (a token bucket per key: `requests_per_minute`
refilled, `burst` held at most; over it, 429 `rate_limit_exceeded`) and a request size
(`max_request_bytes`; over it, 413). NULL is no limit of the key's own (the gateway's `max_body_bytes`
still holds). Set by `pdserve keys create|limit`; read by the gateway's role (migration 0004's grant on
`api_keys` covers the new columns).

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-02
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("api_keys", sa.Column("requests_per_minute", sa.Float))
    op.add_column("api_keys", sa.Column("burst", sa.Integer))
    op.add_column("api_keys", sa.Column("max_request_bytes", sa.Integer))
    op.create_check_constraint("api_keys_limits_positive", "api_keys",
                               "(requests_per_minute IS NULL OR requests_per_minute > 0) AND "
                               "(burst IS NULL OR burst >= 1) AND "
                               "(max_request_bytes IS NULL OR max_request_bytes >= 1)")


def downgrade() -> None:
    op.drop_constraint("api_keys_limits_positive", "api_keys")
    op.drop_column("api_keys", "max_request_bytes")
    op.drop_column("api_keys", "burst")
    op.drop_column("api_keys", "requests_per_minute")
