"""What every wire message shares: the `Message` base, worker roles, and the replies any command may get
(`Ack`, the typed refusal `Rejected` and its `RejectCode`)."""

from __future__ import annotations

from enum import StrEnum

from pydantic import BaseModel, ConfigDict


class Message(BaseModel):
    """Base of every wire message: immutable, unknown fields rejected."""

    model_config = ConfigDict(frozen=True, extra="forbid")


class Role(StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"
    UNIFIED = "unified"


class Ack(Message):
    ok: bool = True


class RejectCode(StrEnum):
    INVALID = "invalid"  # the request failed validation
    CAPACITY = "capacity"  # no room now (decode full); retry later
    NOT_FOUND = "not_found"  # unknown request / transfer
    DUPLICATE = "duplicate"  # id already seen
    NO_WORKERS = "no_workers"  # nothing registered can serve it
    TRANSFER_FAILED = "transfer_failed"  # KV did not arrive verified
    UNAVAILABLE = "unavailable"  # this server cannot take it now (its lease store unreachable): another may
    INTERNAL = "internal"


class Rejected(Message):
    """The typed refusal any handler may reply with instead of its reply type."""

    code: RejectCode
    message: str
