"""Every message that crosses a process boundary, and the NATS subject it travels on.

Each command subject has exactly one request type and one reply type. A handler that refuses a command
replies with `Rejected` instead (the bus raises it as `RejectedError` on the caller's side), so a caller
always gets either its reply type or a typed reason. Payloads are JSON (pydantic v2).

Subjects (prefix `pds` by default, configurable so tests can share a server):

| subject                          | request          | reply             | from → to               |
|----------------------------------|------------------|-------------------|-------------------------|
| pds.coord.submit                 | Submit           | Accepted          | gateway → coordinator   |
| pds.coord.abort                  | Abort            | Ack               | gateway → coordinator   |
| pds.worker.<id>.finished         | DecodeFinished   | Ack               | decode → coordinator    |
| pds.router.route                 | RouteRequest     | RouteDecision     | coordinator → router    |
| pds.worker.<id>.reserve          | ReserveRequest   | Reservation       | coordinator → decode    |
| pds.worker.<id>.prefill          | PrefillRequest   | PrefillResult     | coordinator → prefill * |
| pds.worker.<id>.start            | StartDecode      | DecodeAdmitted    | coordinator → decode    |
| pds.worker.<id>.release          | Release          | Ack               | coordinator → workers   |
| pds.router.booked     (publish)  | RouteBooked      | —                 | router → routers        |
| pds.heartbeat.<id>    (publish)  | Heartbeat        | —                 | workers → router        |
| pds.kv.<id>           (publish)  | KVEvents         | —                 | workers → router        |
| pds.kvdigest.<id>     (publish)  | KVDigest         | —                 | workers → router        |
| pds.tokens.<request_id> (publish)| TokenChunk       | —                 | decode/coord → gateway  |
| pds.events.<request_id>.<type>   | events.Event     | JetStream ack     | everyone → recorder     |

* or, for a local placement (prefill and decode on one worker), to that worker, the reservation made in the
same command (`PrefillRequest.reserve`) instead of by a reserve before it.

One module per counterpart: `common` (the `Message` base, `Role`, `Ack`, `Rejected`), `subjects`,
`coordinator` (gateway/decode → coordinator, tokens → gateway), `router`, `worker` (coordinator → workers),
`heartbeat`, `kv_events`. Import from here: every name is re-exported, the engine's wire types too.
"""

# The engine's own vocabulary, carried on the wire as the engine defines it (re-exported here).
from pdserve.engine.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    CheckpointRemoved,
    CheckpointStored,
)
from pdserve.engine.outputs import FinishReason, TokenLogprobs
from pdserve.engine.sampling_params import SamplingParams
from pdserve.messages.common import Ack, Message, RejectCode, Rejected, Role
from pdserve.messages.coordinator import Abort, Accepted, DecodeFinished, Receipt, Submit, TokenChunk
from pdserve.messages.heartbeat import CompatibilityDescriptor, Heartbeat
from pdserve.messages.kv_events import KVDigest, KVEvents
from pdserve.messages.router import (
    CandidateCost,
    RouteBooked,
    RouteDecision,
    RouteOutcome,
    RouteRequest,
    WorkerIncompatible,
)
from pdserve.messages.subjects import Subjects
from pdserve.messages.worker import (
    LOCAL_ENDPOINT,
    DecodeAdmitted,
    KVEndpoint,
    KVTransportKind,
    LocalReserve,
    PrefillOutcome,
    PrefillRequest,
    PrefillResult,
    Release,
    Reservation,
    ReserveRequest,
    StartDecode,
)

__all__ = [
    "Abort",
    "Accepted",
    "Ack",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "CandidateCost",
    "CheckpointRemoved",
    "CheckpointStored",
    "CompatibilityDescriptor",
    "DecodeAdmitted",
    "DecodeFinished",
    "FinishReason",
    "Heartbeat",
    "KVDigest",
    "KVEndpoint",
    "KVEvents",
    "KVTransportKind",
    "LOCAL_ENDPOINT",
    "LocalReserve",
    "Message",
    "PrefillOutcome",
    "PrefillRequest",
    "PrefillResult",
    "RejectCode",
    "Rejected",
    "Release",
    "Reservation",
    "ReserveRequest",
    "Role",
    "RouteBooked",
    "RouteDecision",
    "RouteOutcome",
    "RouteRequest",
    "SamplingParams",
    "StartDecode",
    "Subjects",
    "Receipt",
    "Submit",
    "TokenChunk",
    "TokenLogprobs",
    "WorkerIncompatible",
]
