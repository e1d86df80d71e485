"""kill -9 of a kimi-tiny decode worker after it holds the prompt's KV pages but before the KDA state
arrived — the window the state handoff adds (`tests.faults.holding_worker` holds the state sends until
every KV page is delivered, then until the test says go). The request completes on the other decode
worker with the engine alone's text, token for token; the lost state is never installed (the victim
never started decoding), and its recompute resumes from the prefill worker's latest state checkpoint, not
from token 0: the retry's prefill has the KV hit L and the checkpoint C and computes exactly prompt − C."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import torch

from pdserve.config import ModelSettings
from pdserve.service_plan import ServiceSpec
from tests import oracle
from tests.e2e.stack import Stack
from tests.e2e.test_disaggregated_tiny import poll_lifecycle
from tests.faults.conftest import restart
from tests.faults.holding_worker import HOLD_DIR_ENV

pytestmark = [pytest.mark.faults, pytest.mark.stack]

MAX_TOKENS = 12
CHECKPOINT_INTERVAL = 64  # the workers' default (4 blocks of 16)


class HoldingStack(Stack):
    def __init__(self, *args, hold_dir, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.hold_dir = hold_dir

    def env(self, spec: ServiceSpec) -> dict[str, str]:
        return {**super().env(spec), HOLD_DIR_ENV: str(self.hold_dir)}

    def module(self, spec: ServiceSpec) -> str:
        return "tests.faults.holding_worker" if spec.role == "prefill" else super().module(spec)


@pytest.fixture(scope="module")
def reference():
    torch.set_num_threads(1)
    return oracle.reference("kimi-tiny", ModelSettings().weights_cache_dir)


@pytest.fixture(scope="module")
def stack(isolated_settings, tmp_path_factory, reference) -> Iterator[HoldingStack]:
    hold_dir = tmp_path_factory.mktemp("state-hold")
    s = HoldingStack(
        isolated_settings("kimistatelost"),
        tmp_path_factory.mktemp("kimi-state-lost"),
        model="kimi-tiny",
        n_prefill=1,
        n_decode=2,
        hold_dir=hold_dir,
    )
    try:
        yield s.start()
    finally:
        s.stop()


class Streamed(threading.Thread):
    """One streamed completion in a thread: its request id as soon as the gateway answers, then its text."""

    def __init__(self, url: str, prompt: list[int]) -> None:
        super().__init__(daemon=True)
        self.url, self.prompt = url, prompt
        self.request_id: str | None = None
        self.started = threading.Event()
        self.text, self.error = "", None

    def run(self) -> None:
        body = {
            "model": "SmolLM2-135M-Instruct",
            "prompt": self.prompt,
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        try:
            with httpx.stream("POST", f"{self.url}/v1/completions", json=body, timeout=120) as r:
                self.request_id = r.headers.get("x-request-id")
                self.started.set()
                for line in r.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        chunk = json.loads(line[6:])
                        if chunk.get("choices"):
                            self.text += chunk["choices"][0]["text"]
                        if "error" in chunk:
                            self.error = chunk["error"]
        except Exception as e:  # surfaced by the test's assertion
            self.error = repr(e)
        finally:
            self.started.set()


def wait_for(path, timeout_s: float = 60.0) -> str:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < deadline, f"{path.name} never appeared"
        time.sleep(0.02)
    return path.read_text()


def test_decode_killed_between_the_kv_and_the_state_completes_elsewhere_from_the_checkpoint(
    stack, reference
) -> None:
    loaded, model = reference
    # 100 tokens: KV blocks up to 96, a state checkpoint at 64 in the prefill worker's caches after the
    # first attempt; the retry hits L = 96 and resumes at C = 64.
    prompt = loaded.tokenizer.encode("The history of the old harbour town, told by its fishermen. " * 12)[
        :100
    ]
    assert len(prompt) == 100
    expected = loaded.tokenizer.decode(oracle.greedy(model, prompt, MAX_TOKENS))
    hold = stack.hold_dir
    (hold / "arm").write_text("")
    request = Streamed(stack.url, prompt)
    request.start()
    assert request.started.wait(60) and request.request_id, request.error
    transfer_id = wait_for(hold / "held")  # every KV page is at the decode worker, the state is not
    routed = next(
        e["payload"]
        for e in poll_lifecycle(stack.url, request.request_id, "DecodeReserved")["events"]
        if e["type"] == "RequestRouted"
    )
    victim = routed["decode_worker_id"]
    stack.kill(victim)
    (hold / "release").write_text("")
    request.join(120)
    restart(stack, victim)
    assert not request.is_alive() and request.error is None, request.error
    assert request.text == expected

    events = poll_lifecycle(stack.url, request.request_id)["events"]
    types = [e["type"] for e in events]
    migrated = [e["payload"] for e in events if e["type"] == "RequestMigrated"]
    assert [m["from_worker_id"] for m in migrated] == [victim], types
    reserved = [e["payload"] for e in events if e["type"] == "DecodeReserved"]
    assert reserved[0]["transfer_id"] == transfer_id and reserved[0]["decode_worker_id"] == victim
    # The victim never admitted the request (its state never arrived); the other decode worker did, once.
    started = [e["payload"]["decode_worker_id"] for e in events if e["type"] == "DecodeStarted"]
    assert started == [reserved[-1]["decode_worker_id"]] and victim not in started, types
    transfers = [e["payload"] for e in events if e["type"] == "TransferCompleted"]
    assert len(transfers) == 1 and transfers[0]["transfer_id"] == reserved[-1]["transfer_id"]
    assert transfers[0]["checksum_ok"] and transfers[0]["state_bytes"] > 0
    prefills = [e["payload"] for e in events if e["type"] == "PrefillCompleted"]
    first, retry = prefills[0], prefills[-1]
    assert (first["num_cached_tokens"], first["num_checkpoint_tokens"], first["num_computed_tokens"]) == (
        0,
        0,
        100,
    )
    # Recomputed from the latest checkpoint, not token 0: exactly prompt − C tokens.
    assert (retry["num_cached_tokens"], retry["num_checkpoint_tokens"]) == (96, CHECKPOINT_INTERVAL)
    assert retry["num_computed_tokens"] == len(prompt) - CHECKPOINT_INTERVAL
