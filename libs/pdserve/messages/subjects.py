"""Every NATS subject's name, built from one prefix (the table is in `pdserve.messages`)."""

from __future__ import annotations

from typing import Literal


class Subjects:
    """All subject names, built from one prefix."""

    def __init__(self, prefix: str = "pds") -> None:
        self.prefix = prefix

    @property
    def submit(self) -> str:
        return f"{self.prefix}.coord.submit"

    @property
    def abort(self) -> str:
        return f"{self.prefix}.coord.abort"

    def finished(self, worker_id: str = "*") -> str:
        """A decode worker's DecodeFinished reports, under its own subjects: a worker publishes nothing under
        `coord.` (docs/architecture.md §9)."""
        return f"{self.prefix}.worker.{worker_id}.finished"

    @property
    def route(self) -> str:
        return f"{self.prefix}.router.route"

    @property
    def booked(self) -> str:
        """Each router's placements (`RouteBooked`), heard by every router (routing/active_load.py)."""
        return f"{self.prefix}.router.booked"

    def worker(self, worker_id: str, command: Literal["reserve", "prefill", "start", "release"]) -> str:
        return f"{self.prefix}.worker.{worker_id}.{command}"

    def heartbeat(self, worker_id: str = "*") -> str:
        return f"{self.prefix}.heartbeat.{worker_id}"

    def kv_events(self, worker_id: str = "*") -> str:
        return f"{self.prefix}.kv.{worker_id}"

    def kv_digest(self, worker_id: str = "*") -> str:
        return f"{self.prefix}.kvdigest.{worker_id}"

    def tokens(self, request_id: str) -> str:
        return f"{self.prefix}.tokens.{request_id}"

    def incompatible(self, worker_id: str = "*") -> str:
        return f"{self.prefix}.incompatible.{worker_id}"

    def event(self, request_id: str, event_type: str) -> str:
        return f"{self.prefix}.events.{request_id}.{event_type}"

    @property
    def all_events(self) -> str:
        return f"{self.prefix}.events.>"
