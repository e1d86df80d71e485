"""Is a started stack ready to serve: every worker heartbeating on NATS, as the router sees them.

`pdserve ready --heartbeat [WORKER_ID]` is the same check for one worker, as a Kubernetes probe runs it
in the worker's pod (deploy/k8s): it connects as the pod's own NATS user (`PDS_NATS_USER`, whose
permissions let it hear its own heartbeat and no other's, pdserve.nats_auth) and exits 0 once that
worker's heartbeat arrives, 1 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import os
from collections.abc import Collection, Mapping

import nats

from pdserve.config import nats_servers
from pdserve.messages import Subjects


def heartbeating(
    nats_url: str, subjects: Subjects, worker_ids: Collection[str], window_s: float = 1.5,
    credentials: Mapping[str, str] | None = None,
) -> set[str]:
    """The ids among `worker_ids` whose heartbeat (`subjects.heartbeat(id)`) arrives within `window_s`
    seconds; workers beat every `heartbeat_interval_s` (0.5 s by default). Empty when NATS does not answer.
    `nats_url`: one server's URL, or a cluster's, comma-separated (as `PDS_NATS_URL`).
    `credentials`: `user` / `password` when the server requires them (`StackState.nats_admin_credentials`,
    or a worker's own, which may hear only its own heartbeat: hence one subscription per id)."""

    servers = nats_servers(nats_url)

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
            for worker_id in worker_ids:
                await nc.subscribe(subjects.heartbeat(worker_id), cb=on_heartbeat)
            loop = asyncio.get_running_loop()
            deadline = loop.time() + window_s
            while not heard >= set(worker_ids) and loop.time() < deadline:
                await asyncio.sleep(0.05)
        finally:
            await nc.close()
        return heard & set(worker_ids)

    return asyncio.run(listen())


def add_parsers(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("ready", help="Exit 0 when this worker is ready: its heartbeat reaches NATS "
                                            "(a Kubernetes probe).")
    p.add_argument("--heartbeat", nargs="?", const="", default="", metavar="WORKER_ID",
                   help="The worker whose heartbeat to hear (default: $PDS_WORKER_ID).")
    p.add_argument("--window", type=float, default=3.0,
                   help="Seconds to wait for one heartbeat (default 3; workers beat every 0.5 s).")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """0 when the worker's heartbeat arrived within `--window`; 1 when it did not; 2 without a worker id.
    NATS URL and credentials are the process's settings (`PDS_NATS_URL`, `PDS_NATS_USER`, ...)."""
    from pdserve.config import CommonSettings

    settings = CommonSettings()
    worker_id = args.heartbeat or os.environ.get("PDS_WORKER_ID", "")
    if not worker_id:
        print("pdserve ready: no worker id (--heartbeat WORKER_ID or $PDS_WORKER_ID)")
        return 2
    heard = heartbeating(settings.nats_url, Subjects(settings.subject_prefix), [worker_id], args.window,
                         credentials=settings.nats_credentials())
    print(f"{worker_id}: {'heartbeating' if heard else f'no heartbeat within {args.window:g} s'}")
    return 0 if heard else 1
