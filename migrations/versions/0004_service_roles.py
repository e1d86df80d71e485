"""Least privilege in Postgres (docs/architecture.md §7, §9): a role per kind of service, so only the
recorder can write the event store. `pdserve_recorder` inserts events and upserts the projection;
`pdserve_gateway` reads them and owns the writes to its `api_keys`; `pdserve_reader` (router, coordinator,
workers) only reads. Roles belong to the server, not the database: created if absent (other databases on
the server share them), granted on this database's tables. They log in without a password of their own:
the stack's servers authenticate by where a client connects from (the embedded server's private socket,
compose's network).

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

ROLES = ("pdserve_reader", "pdserve_recorder", "pdserve_gateway")
GRANTS = (
    "GRANT SELECT ON events, requests TO pdserve_reader, pdserve_recorder, pdserve_gateway",
    "GRANT INSERT, UPDATE ON events, requests TO pdserve_recorder",
    "GRANT SELECT, INSERT, UPDATE ON api_keys TO pdserve_gateway",
)


def upgrade() -> None:
    for role in ROLES:
        # Concurrent migrations of two databases may both find it absent: the loser's CREATE is a no-op.
        op.execute(f"""
            DO $$ BEGIN
                IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = '{role}') THEN
                    CREATE ROLE {role} LOGIN;
                END IF;
            EXCEPTION WHEN duplicate_object OR unique_violation THEN NULL;
            END $$""")
    op.execute(f"""
        DO $$ BEGIN
            EXECUTE format('GRANT CONNECT ON DATABASE %I TO {", ".join(ROLES)}', current_database());
        END $$""")
    op.execute(f"GRANT USAGE ON SCHEMA public TO {', '.join(ROLES)}")
    op.execute(f"GRANT SELECT ON alembic_version TO {', '.join(ROLES)}")
    for grant in GRANTS:
        op.execute(grant)


def downgrade() -> None:
    # The roles stay: other databases on the server may be granted to them.
    op.execute(f"REVOKE ALL ON events, requests, api_keys, alembic_version FROM {', '.join(ROLES)}")
    op.execute(f"REVOKE USAGE ON SCHEMA public FROM {', '.join(ROLES)}")
