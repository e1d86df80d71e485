"""API keys at the gateway, with real Postgres (migration 0003) and the `pdserve keys` CLI: no key, a
wrong key and a revoked key are each a 401 in OpenAI's shape; a live key is served; a loopback-only
gateway runs open under `auto`, any other needs keys. A key's own limits (migration 0005, `pdserve keys
create|limit --rpm --burst --max-request-bytes`): past its rate a 429 `rate_limit_exceeded`, past its size
a 413, both in OpenAI's shape."""

from __future__ import annotations

import asyncio
import re

import httpx
import openai
import pytest

from pdserve.cli.main import main as pdserve
from pdserve.gateway.app import create_app
from pdserve.gateway.keys import keys_required
from tests.integration.gateway_harness import MODEL, answer_ids, in_order


@pytest.fixture(scope="module")
def keyed_app(bus, tokenizer, gw_settings, db):
    settings = gw_settings.model_copy(update={"api_keys": "required", "api_key_cache_s": 0.0})
    return create_app(bus, tokenizer, settings, db)


def cli(database_url: str, *args: str, capsys) -> tuple[int, str]:
    rc = pdserve(["keys", "--database-url", database_url, *args])
    return rc, capsys.readouterr().out


async def test_no_wrong_or_revoked_key_is_a_401_and_a_live_key_is_served(
        keyed_app, coord, tokenizer, database_url, capsys):
    rc, out = await asyncio.to_thread(cli, database_url, "create", "--name", "test", capsys=capsys)
    assert rc == 0, out
    key = re.search(r"^(pds-\S+)$", out, re.M)[1]
    key_id = re.search(r"key id (\S+)", out)[1]
    transport = httpx.ASGITransport(keyed_app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as c:
        coord.script = in_order(answer_ids(tokenizer))
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 10}
        for headers in ({}, {"Authorization": "Bearer pds-wrong"}, {"Authorization": f"Basic {key}"}):
            r = await c.post("/v1/completions", json=body, headers=headers)
            assert r.status_code == 401, (headers, r.text)
            assert r.json()["error"]["code"] == "invalid_api_key"
            assert r.headers["www-authenticate"] == "Bearer"
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}
        assert (await c.get("/v1/models")).status_code == 401
        assert (await c.get("/health")).status_code == 200  # probes stay open

        client = openai.AsyncOpenAI(base_url="http://gw/v1", api_key=key, max_retries=0,
                                    http_client=httpx.AsyncClient(transport=transport))
        completion = await client.completions.create(model=MODEL, prompt="hi", max_tokens=10)
        assert completion.choices[0].text

        rc, out = await asyncio.to_thread(cli, database_url, "list", capsys=capsys)
        assert rc == 0 and key_id in out and key not in out  # never the key itself
        rc, out = await asyncio.to_thread(cli, database_url, "revoke", key_id, capsys=capsys)
        assert rc == 0, out
        with pytest.raises(openai.AuthenticationError):
            await client.completions.create(model=MODEL, prompt="hi", max_tokens=10)
        await client.close()


def test_loopback_gateways_may_run_open_and_others_need_keys():
    assert not keys_required("auto", "127.0.0.1") and not keys_required("auto", "::1")
    assert not keys_required("auto", "localhost")
    assert keys_required("auto", "0.0.0.0") and keys_required("auto", "gateway.example")
    assert keys_required("required", "127.0.0.1") and not keys_required("off", "0.0.0.0")
    with pytest.raises(ValueError):
        keys_required("maybe", "127.0.0.1")


def new_key(database_url: str, capsys, *args: str) -> tuple[str, str]:
    rc, out = cli(database_url, "create", *args, capsys=capsys)
    assert rc == 0, out
    return re.search(r"key id (\S+)", out)[1], re.search(r"^(pds-\S+)$", out, re.M)[1]


async def test_a_keys_rate_limit_is_a_429_and_its_size_limit_a_413_in_openais_shape(
        keyed_app, coord, tokenizer, database_url, capsys):
    limited_id, limited = await asyncio.to_thread(new_key, database_url, capsys, "--name", "rl", "--rpm", "1",
                                                  "--burst", "2")
    _, small = await asyncio.to_thread(new_key, database_url, capsys, "--name", "small",
                                       "--max-request-bytes", "200")
    _, free = await asyncio.to_thread(new_key, database_url, capsys, "--name", "free")
    coord.script = in_order(answer_ids(tokenizer))
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 10}
    transport = httpx.ASGITransport(keyed_app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as c:
        def as_key(key: str) -> dict[str, str]:
            return {"Authorization": f"Bearer {key}"}

        for _ in range(2):  # the burst
            r = await c.post("/v1/completions", json=body, headers=as_key(limited))
            assert r.status_code == 200, r.text
        r = await c.post("/v1/completions", json=body, headers=as_key(limited))
        assert r.status_code == 429, r.text
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert (error["type"], error["code"]) == ("requests", "rate_limit_exceeded")
        assert 59 <= int(r.headers["retry-after"]) <= 60  # 1 per minute: the next token in a minute
        assert (await c.get("/v1/models", headers=as_key(limited))).status_code == 429  # every /v1 route
        assert (await c.post("/v1/completions", json=body, headers=as_key(free))).status_code == 200

        client = openai.AsyncOpenAI(base_url="http://gw/v1", api_key=limited, max_retries=0,
                                    http_client=httpx.AsyncClient(transport=transport))
        with pytest.raises(openai.RateLimitError) as e:
            await client.completions.create(model=MODEL, prompt="hi", max_tokens=10)
        assert e.value.code == "rate_limit_exceeded"
        await client.close()
        rc, out = await asyncio.to_thread(cli, database_url, "limit", limited_id, "--rpm", "0", capsys=capsys)
        assert rc == 0, out
        assert (await c.post("/v1/completions", json=body, headers=as_key(limited))).status_code == 200

        big = {**body, "prompt": "x" * 300}
        r = await c.post("/v1/completions", json=big, headers=as_key(small))
        assert r.status_code == 413, r.text
        assert r.json()["error"]["code"] == "request_too_large" and "'small'" in r.json()["error"]["message"]
        assert (await c.post("/v1/completions", json=body, headers=as_key(small))).status_code == 200
        assert (await c.post("/v1/completions", json=big, headers=as_key(free))).status_code == 200

    rc, out = await asyncio.to_thread(cli, database_url, "list", capsys=capsys)
    assert rc == 0 and "≤ 200 B" in out
    rc, out = await asyncio.to_thread(cli, database_url, "create", "--name", "bad", "--rpm", "-1",
                                      capsys=capsys)
    assert rc == 2 and "must be > 0" in out
