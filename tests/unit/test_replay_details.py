"""`pdserve replay --request`'s details column names every event type pdserve emits."""

from __future__ import annotations

import pytest

from pdserve.cli.replay import KEY_FIELDS, details
from pdserve.events import PAYLOAD_TYPES, Event, RequestMigrated, RequestRecovered
from pdserve.store.rows import RecordedEvent


def test_every_event_type_has_its_key_fields():
    assert set(PAYLOAD_TYPES) <= set(KEY_FIELDS)
    for name, fields in KEY_FIELDS.items():
        assert set(fields) <= set(PAYLOAD_TYPES[name].model_fields), name


@pytest.mark.parametrize(("payload", "expected"), [
    (RequestMigrated(from_worker_id="decode-0", phase="decode", reason="silent 2.0 s",
                     num_committed_tokens=17, attempt=1),
     "from_worker=decode-0  phase=decode  reason=silent 2.0 s  num_committed_tokens=17  attempt=1"),
    (RequestRecovered(state="decoding", num_committed_tokens=32, action="re-prefill"),
     "state=decoding  num_committed_tokens=32  action=re-prefill"),
])
def test_migrated_and_recovered_rows_show_their_fields(payload, expected):
    event = Event.of("0190a0b0-0000-7000-8000-000000000000", payload, service="coordinator")
    assert details(RecordedEvent(1, event)) == expected
