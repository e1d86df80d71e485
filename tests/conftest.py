"""Real NATS, Postgres and Mooncake Store for every test that needs them (docs/architecture.md §9).

Providers, in order: `PDS_TEST_NATS_URL` / `PDS_TEST_DATABASE_URL` / `PDS_TEST_MOONCAKE_URL` (CI points
them at the machine's own servers); testcontainers when a Docker engine answers; the embedded servers
(`pdserve.embedded`) otherwise. Each test run gets its own database, JetStream stream and subject prefix,
so runs sharing a server never see each other's messages.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import Iterator

import pytest

from pdserve.config import CommonSettings


def _docker_available() -> bool:
    try:
        import docker

        docker.from_env(timeout=3).ping()
        return True
    except Exception:
        return False


@pytest.fixture(scope="session")
def run_id() -> str:
    return uuid.uuid4().hex[:8]


@pytest.fixture(scope="session")
def nats_url(tmp_path_factory) -> Iterator[str]:
    if url := os.environ.get("PDS_TEST_NATS_URL"):
        yield url
        return
    if _docker_available():
        from testcontainers.nats import NatsContainer

        with NatsContainer(jetstream=True) as c:
            yield c.nats_uri()
        return
    from pdserve.embedded import start_nats

    server = start_nats(store_dir=tmp_path_factory.mktemp("nats"))
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture(scope="session")
def postgres_admin_url(tmp_path_factory) -> Iterator[str]:
    """A SQLAlchemy asyncpg URL to the server's `postgres` database (used to create per-run databases)."""
    if url := os.environ.get("PDS_TEST_DATABASE_URL"):
        yield url
        return
    if _docker_available():
        from testcontainers.postgres import PostgresContainer

        with PostgresContainer("postgres:16", driver="asyncpg") as c:
            yield c.get_connection_url()
        return
    from pdserve.embedded import start_postgres

    server = start_postgres(data_dir=tmp_path_factory.mktemp("pg"))
    try:
        yield server.url
    finally:
        server.stop()


def mooncake_importable() -> str:
    """'' when the Mooncake Store client loads, else why not (its wheel links Debian's libibverbs1)."""
    try:
        import mooncake.store  # noqa: F401
    except ImportError as e:
        return f"mooncake.store does not load ({e}): `make kv-store-tools` installs libibverbs1"
    return ""


@pytest.fixture(scope="session")
def mooncake_url(tmp_path_factory) -> Iterator[str]:
    """A Mooncake Store (master + the memory-holding client): `mooncake://host:port` of its master.
    Embedded: `pdserve.embedded.start_mooncake` (256 MiB). Testcontainers: the compose image (`pdserve:dev`,
    or `PDS_TEST_MOONCAKE_IMAGE`), master and store client in one container."""
    if url := os.environ.get("PDS_TEST_MOONCAKE_URL"):
        yield url
        return
    if why := mooncake_importable():
        pytest.skip(why)
    if _docker_available():
        from testcontainers.core.container import DockerContainer
        from testcontainers.core.waiting_utils import wait_for_logs

        from pdserve.embedded import free_port

        # Host networking: the store client tells its peers its address in the P2P handshake, and the
        # test process must reach that address as the container sees it.
        image = os.environ.get("PDS_TEST_MOONCAKE_IMAGE", "pdserve:dev")
        port, client_port = free_port(), free_port()
        cmd = (f"sh -c 'mooncake_master --rpc_address=127.0.0.1 --rpc_port={port} --metrics_host=127.0.0.1 "
               f"--metrics_port={free_port()} --enable_http_metadata_server=false & sleep 1; exec "
               f"mooncake_client --host=127.0.0.1 --port={client_port} "
               f"--master_server_address=127.0.0.1:{port} "
               "--metadata_server=P2PHANDSHAKE --global_segment_size=268435456 --local_buffer_size=0'")
        with DockerContainer(image).with_command(cmd).with_kwargs(network_mode="host") as c:
            wait_for_logs(c, "Starting real client service", timeout=30)
            yield f"mooncake://127.0.0.1:{port}"
        return
    from pdserve.embedded import start_mooncake

    server = start_mooncake(tmp_path_factory.mktemp("mooncake"), segment_bytes=256 << 20)
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture(scope="session")
def database_url(postgres_admin_url: str, run_id: str) -> Iterator[str]:
    """A fresh database for this run, migrated to head with Alembic."""
    from pdserve.store.migrate import create_database, drop_database, upgrade

    url = create_database(postgres_admin_url, f"pdserve_test_{run_id}")
    upgrade(url)
    yield url
    drop_database(postgres_admin_url, f"pdserve_test_{run_id}")


@pytest.fixture(scope="session")
def settings(nats_url: str, database_url: str, run_id: str, tmp_path_factory) -> Iterator[CommonSettings]:
    """Settings every service of this run shares: own subject prefix and events stream. At the end of the
    run every events stream it made (`PDS_EVENTS_<run_id>…`) is deleted, so a long-lived server (CI's)
    does not keep one per run."""
    yield CommonSettings(
        nats_url=nats_url,
        database_url=database_url,
        subject_prefix=f"t{run_id}",
        events_stream=f"PDS_EVENTS_{run_id}",
        var_dir=tmp_path_factory.mktemp("var"),
    )
    asyncio.run(_delete_streams(nats_url, f"PDS_EVENTS_{run_id}"))


async def _delete_streams(nats_url: str, name_prefix: str) -> None:
    import nats

    nc = await nats.connect(nats_url)
    try:
        js = nc.jetstream()
        for info in await js.streams_info():
            # KV_…: the coordinators' lease buckets
            if info.config.name.startswith((name_prefix, f"KV_{name_prefix}")):
                await js.delete_stream(info.config.name)
    finally:
        await nc.close()


@pytest.fixture(scope="session")
def reference(settings):
    """(model, tokenizer) of the tiny Llama in this process: the greedy oracle of tiny stacks (its weights
    are generated from a seeded config, the same in every var dir)."""
    from pdserve.engine.loader import load_model
    from pdserve.engine.model import LlamaModel

    loaded = load_model("tiny", settings.var_dir / "weights")
    return LlamaModel(loaded.config, loaded.weights), loaded.tokenizer


@pytest.fixture(scope="session")
def isolated_settings(settings: CommonSettings, postgres_admin_url: str, run_id: str):
    """`make(name)` → settings with a database, events stream and subject prefix of their own, so a full
    stack (with its own recorder and coordinator) never answers or records another test's traffic."""
    from pdserve.store.migrate import create_database, drop_database, upgrade

    created: list[str] = []

    def make(name: str) -> CommonSettings:
        db = f"pdserve_test_{run_id}_{name}"
        url = create_database(postgres_admin_url, db)
        upgrade(url)
        created.append(db)
        return settings.model_copy(update={
            "database_url": url,
            "subject_prefix": f"{settings.subject_prefix}{name}",
            "events_stream": f"{settings.events_stream}_{name}",
        })

    yield make
    for db in created:
        drop_database(postgres_admin_url, db)


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M-Instruct as pdserve loads it (dequantized once, cached as safetensors)."""
    from pdserve.config import ModelSettings
    from pdserve.engine.loader import load_model

    return load_model("smollm2", ModelSettings().weights_cache_dir)


@pytest.fixture(scope="session")
def smollm2_hf():
    """HF transformers' own load of the same GGUF: the correctness oracle (about 35 s; loaded once)."""
    import torch
    import transformers

    from pdserve.engine.model_files import smollm2_gguf_path

    path = smollm2_gguf_path()
    return transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()


@pytest.fixture(scope="session")
def kimi(tmp_path_factory):
    """kimi-tiny as pdserve loads it: generated into a fresh cache directory of this test session."""
    from pdserve.engine.loader import load_model

    return load_model("kimi-tiny", tmp_path_factory.mktemp("kimi-weights"))


@pytest.fixture(scope="session")
def kimi_dir(kimi):
    """The HF-layout directory kimi-tiny was generated into."""
    return kimi.path


@pytest.fixture(scope="session")
def kimi_hf(kimi_dir):
    """HF transformers' KimiLinearForCausalLM loaded from that same directory: the oracle."""
    import transformers

    return transformers.KimiLinearForCausalLM.from_pretrained(kimi_dir).eval()


@pytest.fixture(scope="module")
def one_torch_thread():
    """One intra-op thread for a module's tests, as a worker runs: on 2 shared cores, more threads are many
    times slower under load (OpenMP threads wait on a core another process holds)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
