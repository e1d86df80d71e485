"""bench/bus_floor.py: the round trips are measured between two processes on a nats-server of its own,
and the critical path's messaging floor is exactly its message count × half a round trip."""

from __future__ import annotations

from pdserve.bench.bus_floor import CRITICAL_PATH_MESSAGES, measure_bus_floor


def test_bus_floor_measures_both_round_trips_and_derives_the_critical_path(tmp_path) -> None:
    out = measure_bus_floor(tmp_path, n=30)
    assert out["round_trips"] == 30
    # Submit, the route beside the claim and RequestReceived's store, [reserve,] prefill, the first token
    assert CRITICAL_PATH_MESSAGES == {"colocated": 5, "disaggregated": 7}
    for stack, messages in CRITICAL_PATH_MESSAGES.items():
        assert out[f"critical_path_messages_{stack}"] == messages
        for kind in ("raw", "typed"):
            rt = out[f"{kind}_round_trip_p50_ms"]
            assert 0 < rt < 1000
            assert out[f"critical_path_ms_{kind}_{stack}"] == messages * rt / 2
