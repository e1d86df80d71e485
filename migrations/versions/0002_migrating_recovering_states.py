"""Request states `migrating` and `recovering`: the projection follows `RequestMigrated` and
`RequestRecovered` (a request between placements no longer reads as still `decoding`).

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-29
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Spelled out here, not imported from pdserve.store.tables: a migration is a frozen record of the schema.
_OLD = ("received", "routed", "reserved", "prefilling", "transferred", "decoding", "completed", "failed",
        "aborted")
_NEW = ("received", "routed", "reserved", "prefilling", "transferred", "decoding", "migrating", "recovering",
        "completed", "failed", "aborted")
_NAME = "requests_state_valid"


def _check(states: tuple[str, ...]) -> str:
    return "state IN (" + ", ".join(f"'{s}'" for s in states) + ")"


def upgrade() -> None:
    op.drop_constraint(_NAME, "requests", type_="check")
    op.create_check_constraint(_NAME, "requests", _check(_NEW))


def downgrade() -> None:
    # A request between placements has none: in the old states that is `received` (not yet routed).
    op.execute(f"UPDATE requests SET state = 'received' WHERE NOT ({_check(_OLD)})")
    op.drop_constraint(_NAME, "requests", type_="check")
    op.create_check_constraint(_NAME, "requests", _check(_OLD))
