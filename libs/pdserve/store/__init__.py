"""The event store: every lifecycle event in Postgres (`events`) and one projection row per request
(`requests`), written only by the recorder (docs/architecture.md §7).

What other packages use is exported here; the modules behind it (tables, rows, projection, recorder
internals) are the store's own business:

- `make_db(url)`: the store's handle (a SQLAlchemy `AsyncEngine`, called `db`).
- `unfinished_requests(db)`, `events_of_requests(db, request_ids)`: reads (more in `store.queries`).
- `recorded_floor(bus)`, `caught_up(bus)`: how far the recorder has committed the events stream.
- `fold(events)`: a request's projection row from its `(stream_seq, event)` pairs.
- `RecordedEvent`, `Row`: a stored event with its stream sequence; a projection row.
"""

from pdserve.store.projection import Row, fold
from pdserve.store.queries import events_of_requests, make_db, unfinished_requests
from pdserve.store.recorder import caught_up, recorded_floor
from pdserve.store.rows import RecordedEvent

__all__ = [
    "RecordedEvent",
    "Row",
    "caught_up",
    "events_of_requests",
    "fold",
    "make_db",
    "recorded_floor",
    "unfinished_requests",
]
