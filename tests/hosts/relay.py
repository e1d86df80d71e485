"""A TCP relay from the bridge to a server of the root namespace (`python -m tests.hosts.relay LISTEN_HOST
TARGET`), printing `listening <port>` once bound.

The test hosts reach the test run's Postgres through it: the hosts' services connect to
`<bridge address>:<port>` over the bridge, the relay connects on to the root namespace's server (TARGET:
`host:port`, or the path of a Unix socket, as the embedded Postgres listens). Postgres then sees every
connection come from the relay on its own machine, which its loopback `trust` authentication admits (the
roles of migration 0004 have no passwords, docs/architecture.md §9).
"""

from __future__ import annotations

import asyncio
import sys


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(1 << 16):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, asyncio.CancelledError):
        pass
    finally:
        writer.close()


async def main(listen_host: str, target: str) -> None:
    async def connect() -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        if target.startswith("/"):
            return await asyncio.open_unix_connection(target)
        host, port = target.rsplit(":", 1)
        return await asyncio.open_connection(host, int(port))

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await connect()
        except OSError:
            writer.close()
            return
        await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))

    server = await asyncio.start_server(handle, listen_host, 0)
    print(f"listening {server.sockets[0].getsockname()[1]}", flush=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2]))
