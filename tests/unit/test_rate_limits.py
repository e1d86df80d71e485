"""The gateway's token bucket per API key (pdserve.gateway.rate_limits) on a frozen clock: a key holds
`burst` requests, refills at `requests_per_minute`, and a refusal is a 429 whose Retry-After is the wait
for the next token, rounded up; keys never share a bucket, and a key without a rate is never refused."""

from __future__ import annotations

import pytest
import token_bucket.storage

from pdserve.gateway.errors import APIError
from pdserve.gateway.keys import ApiKey, KeyLimits
from pdserve.gateway.rate_limits import RateLimits, burst_of


@pytest.fixture
def clock(monkeypatch) -> list[float]:
    now = [1000.0]
    monkeypatch.setattr(token_bucket.storage.time, "monotonic", lambda: now[0])
    return now


def refused(limits: RateLimits, key: ApiKey) -> APIError | None:
    try:
        limits.admit(key)
    except APIError as e:
        return e
    return None


def test_burst_then_refill_at_the_keys_rate(clock):
    limits = RateLimits()
    key = ApiKey("k1", "alice", KeyLimits(requests_per_minute=6, burst=2))  # a token every 10 s
    assert refused(limits, key) is None and refused(limits, key) is None
    e = refused(limits, key)
    assert e is not None and e.status == 429 and e.code == "rate_limit_exceeded" and e.type == "requests"
    assert e.headers == {"Retry-After": "10"}
    clock[0] += 4.0
    assert refused(limits, key).headers == {"Retry-After": "6"}
    clock[0] += 6.0
    assert refused(limits, key) is None  # one token back after 10 s
    assert refused(limits, key) is not None
    other = ApiKey("k2", "bob", KeyLimits(requests_per_minute=6, burst=2))
    assert refused(limits, other) is None  # a bucket of its own


def test_no_rate_no_limit_and_the_default_burst_is_a_minutes_worth(clock):
    limits = RateLimits()
    unlimited = ApiKey("k3", "carol")
    assert all(refused(limits, unlimited) is None for _ in range(1000))
    assert burst_of(90, None) == 90 and burst_of(0.5, None) == 1 and burst_of(90, 5) == 5
    key = ApiKey("k4", "dave", KeyLimits(requests_per_minute=3))
    assert [refused(limits, key) is None for _ in range(4)] == [True, True, True, False]


def test_limits_out_of_range_are_refused():
    for bad in ({"requests_per_minute": 0}, {"burst": 0}, {"max_request_bytes": -1}):
        with pytest.raises(ValueError):
            KeyLimits(**bad)
