"""Is a started stack ready to serve: every worker heartbeating on NATS, as the router sees them."""

from __future__ import annotations

import asyncio
from collections.abc import Collection, Mapping

import nats

from pdserve.messages import Subjects


def heartbeating(
    nats_url: str, subjects: Subjects, worker_ids: Collection[str], window_s: float = 1.5,
    credentials: Mapping[str, str] | None = None,
) -> set[str]:
    """The ids among `worker_ids` whose heartbeat (`subjects.heartbeat(id)`) arrives within `window_s`
    seconds; workers beat every `heartbeat_interval_s` (0.5 s by default). Empty when NATS does not answer.
    `nats_url`: one server's URL, or a cluster's, comma-separated (as `PDS_NATS_URL`).
    `credentials`: `user` / `password` when the server requires them (`StackState.nats_admin_credentials`)."""

    servers = [url.strip() for url in nats_url.split(",") if url.strip()]

    async def listen() -> set[str]:
        heard: set[str] = set()
        try:
            nc = await asyncio.wait_for(  # nats-py retries a refused first connect on its own
                nats.connect(servers, connect_timeout=1, max_reconnect_attempts=0, allow_reconnect=False,
                             **(credentials or {})),
                timeout=window_s,
            )
        except Exception:  # not up yet (or gone): nobody heard
            return heard

        async def on_heartbeat(msg) -> None:
            heard.add(msg.subject.rsplit(".", 1)[-1])

        try:
            await nc.subscribe(subjects.heartbeat(), cb=on_heartbeat)
            loop = asyncio.get_running_loop()
            deadline = loop.time() + window_s
            while not heard >= set(worker_ids) and loop.time() < deadline:
                await asyncio.sleep(0.05)
        finally:
            await nc.close()
        return heard & set(worker_ids)

    return asyncio.run(listen())
