"""Identifiers: UUIDv7 (RFC 9562) for requests, events and transfers, so ids sort by creation time."""

from __future__ import annotations

import uuid_utils


def new_id() -> str:
    """A fresh UUIDv7 as its canonical 36-character string (time-ordered, 74 random bits)."""
    return str(uuid_utils.uuid7())
