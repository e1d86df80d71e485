"""Request rate limits per API key: a token bucket per key (the `token-bucket` library's `Limiter` and
`MemoryStorage`; docs/architecture.md §9).

A key with `requests_per_minute` r gets a bucket of capacity `burst` b (default ceil(r): a minute's
worth) refilled at r / 60 tokens per second; every /v1 request takes one token, and a request that finds
none is refused with 429 in OpenAI's error shape — type `requests`, code `rate_limit_exceeded`, as
OpenAI's API answers it — with `Retry-After` (whole seconds until the next token, rounded up). Buckets
live in the gateway process: N gateway replicas admit up to N times a key's rate. A key whose limits
change starts a fresh bucket.
"""

from __future__ import annotations

import math

from token_bucket import Limiter, MemoryStorage

from pdserve.gateway.errors import APIError
from pdserve.gateway.keys import ApiKey


def burst_of(requests_per_minute: float, burst: int | None) -> int:
    """The bucket's capacity: `burst`, else a minute's worth of requests (at least 1)."""
    return burst if burst is not None else max(1, math.ceil(requests_per_minute))


class RateLimits:
    """`admit(key)` takes one request from `key`'s bucket, or raises `APIError` 429."""

    def __init__(self) -> None:
        self._storage = MemoryStorage()
        self._limiters: dict[tuple[float, int], Limiter] = {}

    def admit(self, key: ApiKey) -> None:
        rpm = key.limits.requests_per_minute
        if rpm is None:
            return
        rate, capacity = rpm / 60.0, burst_of(rpm, key.limits.burst)
        limiter = self._limiters.get((rate, capacity))
        if limiter is None:
            limiter = self._limiters[(rate, capacity)] = Limiter(rate, capacity, self._storage)
        bucket = f"{key.key_id}:{rate!r}:{capacity}"
        if limiter.consume(bucket):
            return
        wait_s = max(0.0, 1.0 - self._storage.get_token_count(bucket)) / rate
        raise APIError(
            429,
            f"Rate limit reached for API key {key.name!r} ({key.key_id}) on requests per minute: limit "
            f"{rpm:g}, burst {capacity}. Please try again in {wait_s:.1f}s.",
            type="requests", code="rate_limit_exceeded",
            headers={"Retry-After": str(max(1, math.ceil(wait_s)))},
        )
