"""A hybrid model's prefix hit is a pair of lengths (docs/architecture.md §12): the requests projection
keeps the state checkpoint the prefill resumed from (`checkpoint_tokens`, C, beside `cached_tokens`, L)
and the router's prediction of both (`predicted_cached_tokens`, `predicted_checkpoint_tokens`), and the
state bytes the handoff carried (`state_bytes`, apart from `kv_bytes`). All null for rows folded before.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-02
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Spelled out here, not imported from pdserve.store.tables: a migration is a frozen record of the schema.
_COLUMNS = (
    ("checkpoint_tokens", sa.Integer),
    ("predicted_cached_tokens", sa.Integer),
    ("predicted_checkpoint_tokens", sa.Integer),
    ("state_bytes", sa.BigInteger),
)


def upgrade() -> None:
    for name, kind in _COLUMNS:
        op.add_column("requests", sa.Column(name, kind))


def downgrade() -> None:
    for name, _ in reversed(_COLUMNS):
        op.drop_column("requests", name)
