"""Identifiers: UUIDv7 (RFC 9562) for requests, events and transfers, so ids sort by creation time."""

from __future__ import annotations

import uuid_utils


def new_id() -> str:
    """A fresh UUIDv7 as its canonical 36-character string (time-ordered, 74 random bits)."""
    return str(uuid_utils.uuid7())


# The OpenAI objects' ids the gateway builds from a request id (gateway/responses.py).
OPENAI_ID_PREFIXES = ("chatcmpl-", "cmpl-")


def request_id_of(text: str) -> str:
    """The request id in `text`: itself, or the id of the completion object a client holds
    (`chatcmpl-<request_id>`, `cmpl-<request_id>`), for commands that take what the user pasted."""
    for prefix in OPENAI_ID_PREFIXES:
        if text.startswith(prefix):
            return text.removeprefix(prefix)
    return text
