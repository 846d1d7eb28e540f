"""What both roles of a session share: the connection's state table, why a session closed, the actions (the
outbox), the settings, the worker-wide context, the counters, and :class:`SessionCore` (the outbox and the send
queue).  :mod:`p2pworker.session.session` describes the protocol; the roles live in ``client.py`` (consumer) and
``server.py`` (producer)."""

from __future__ import annotations

import enum
import itertools
from dataclasses import asdict, dataclass, field
from typing import Callable, Iterator, Union

import msgspec

from p2pworker.fingerprint import Fingerprint
from p2pworker.protocol import messages as m
from p2pworker.protocol.peer_info import PeerDataInfo
from p2pworker.schema import Lease as LeaseSeconds
from p2pworker.schema import Pos, PosInt
from p2pworker.session.parking import ParkingLot
from p2pworker.session.reporter import Reporter

# The producer's hold exceeds the consumer's lease by this factor and margin: monotonic clocks of two
# hosts tick at rates within ~1e-4 of each other; 1e-3 and half a second leave room for scheduling.
LEASE_DRIFT = 1e-3
LEASE_MARGIN_S = 0.5


# ---------------------------------------------------------------- the connection's machine
class State(enum.Enum):
    IDLE = "idle"
    HELLO_SENT = "hello_sent"
    ACTIVE = "active"
    CLOSED = "closed"


class SessionEvent(enum.Enum):
    START = "start"  # we dialed: our Hello goes out
    HELLO = "hello"  # the peer's Hello was accepted (our HelloAck goes out)
    HELLO_ACK = "hello_ack"  # the peer accepted our Hello
    CLOSE = "close"  # Bye, a bad frame, an illegal message, a refused handshake, or close()


MOVES: dict[tuple[State, SessionEvent], State] = {
    (State.IDLE, SessionEvent.START): State.HELLO_SENT,
    (State.IDLE, SessionEvent.HELLO): State.ACTIVE,
    (State.HELLO_SENT, SessionEvent.HELLO_ACK): State.ACTIVE,
    (State.IDLE, SessionEvent.CLOSE): State.CLOSED,
    (State.HELLO_SENT, SessionEvent.CLOSE): State.CLOSED,
    (State.ACTIVE, SessionEvent.CLOSE): State.CLOSED,
}

# Which messages each state takes from the peer; any other closes the session as a protocol error (before it can
# drive a move MOVES lacks).
_RUNNING = frozenset({m.Fetch, m.Offer, m.Release, m.Done, m.Lookup, m.LookupResp, m.LaneUp, m.Bye})
ALLOWED: dict[State, frozenset] = {
    State.IDLE: frozenset({m.Hello, m.Probe, m.Bye}),
    State.HELLO_SENT: frozenset({m.HelloAck, m.Bye}),
    State.ACTIVE: _RUNNING,
    State.CLOSED: frozenset(),
}


class CloseCause(enum.Enum):
    """Why a session closed.  The worker acts on the cause (a lost peer keeps its outbound link, which reconnects;
    any other close on a live link drops it and backs off); the text status shows is :func:`close_text`."""

    LOCAL = "local"  # this worker closed it (the adapter, a shutdown, a replaced or unusable link, the data plane)
    PEER_LOST = "peer lost"  # the link or the same-host lane went down under the session
    PEER_BYE = "peer said bye"
    PROTOCOL_ERROR = "protocol error"
    REJECTED = "handshake rejected"  # we refused the peer's Hello
    REJECTED_BY_PEER = "handshake rejected by the peer"
    MISMATCH = "config fingerprint mismatch"  # the peer's HelloAck carries another fingerprint: we hang up
    PROBED = "probed"  # we answered a Probe (``p2pworker ping``)


def close_text(cause: CloseCause, detail: str) -> str:
    """The reason a session closed, as status, logs, the SessionClosed event and our Bye word it: the cause's words,
    then the detail.  A local close is worded by the worker whole; a mismatch lists the differing fields."""
    if cause is CloseCause.LOCAL:
        return detail
    if cause is CloseCause.MISMATCH:
        return f"{cause.value} ({detail})"
    return f"{cause.value}: {detail}" if detail else cause.value


def fingerprint_diff(diff: dict) -> str:
    """The fields two fingerprints disagree on, as a close reason lists them."""
    return ", ".join(f"{k}: local={a!r} remote={b!r}" for k, (a, b) in diff.items())


# ---------------------------------------------------------------- actions (the outbox)
@dataclass(frozen=True, slots=True)
class Send:
    msg: m.Message


@dataclass(frozen=True, slots=True)
class AddDataPeer:
    """Register the peer's region with the data plane under this session's link."""

    info: PeerDataInfo
    dialed: bool = True  # we dialed the peer (to read from it); False: it dialed us, and may never be read from


@dataclass(frozen=True, slots=True)
class RemoveDataPeer:
    pass


@dataclass(frozen=True, slots=True)
class PostRead:
    """READ the peer's ``remote_rows`` into our ``local_rows``; report with ``Session.on_read_result(read_id)``."""

    read_id: int
    local_rows: list[int]
    remote_rows: list[int]


@dataclass(frozen=True, slots=True)
class CancelReads:
    read_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class DialLane:
    """We dialed: open this session's same-host lane to the peer's handover socket, proving ``key``."""

    key: bytes
    info: PeerDataInfo


@dataclass(frozen=True, slots=True)
class ExpectLane:
    """The peer dialed us and wants a lane: let our handover socket accept one proving ``key`` for this session."""

    key: bytes


@dataclass(frozen=True, slots=True)
class Abort:
    """Reads we posted did not settle after their cancellation and cannot be aborted (NIXL): the worker must exit
    now (its death ends every read it initiated; the adapter then fails the jobs).  Emitted once per session."""

    why: str


Action = Union[Send, AddDataPeer, RemoveDataPeer, PostRead, CancelReads, DialLane, ExpectLane, Abort]


# ---------------------------------------------------------------- settings and context
class SessionConfig(msgspec.Struct, forbid_unknown_fields=True):
    """[session] settings (schema types checked by msgspec when a file, JSON or flag sets them)."""

    load_timeout_s: LeaseSeconds = 30.0  # the consumer's lease: no read counts after it
    fetch_timeout_s: Pos = 20.0  # the producer ends a round's offers after this (or 0.9 of the lease)
    lookup_timeout_s: Pos = 5.0
    park_timeout_s: Pos = 60.0  # a producer's stores wait this long after its request's end for a consumer's fetch
    park_unfinished_s: Pos = 1800.0  # ... and at most this long after its first store (or a fetch) if no end comes
    settle_timeout_s: Pos = 10.0  # after the deadline, how long cancelled reads may take to settle
    handshake_timeout_s: Pos = 3.0  # a load still waiting for the first handshake after this fails
    max_lease_s: LeaseSeconds = 300.0  # the longest lease a producer grants
    max_queued: PosInt = 10_000  # messages held while the handshake is pending
    max_inbound_lookups: PosInt = 1024


def longest_hold_s(cfg: SessionConfig) -> float:
    """The longest a job can stay open in a worker with these settings once nothing new arrives (a reset, a drain):
    a lease it grants (offered rows stay pinned until the consumer's Release or the hold's end) or one of its own
    loads and the settling of its reads.  The adapter waits this long (plus slack) before it kills the worker."""
    return max(cfg.max_lease_s * (1 + LEASE_DRIFT) + LEASE_MARGIN_S, cfg.load_timeout_s + cfg.settle_timeout_s)


@dataclass
class SessionContext:
    """What every session of one worker shares."""

    node_id: str
    data_info: PeerDataInfo
    fingerprint: Fingerprint
    reporter: Reporter
    lot: ParkingLot
    clock: Callable[[], float]
    config: SessionConfig = field(default_factory=SessionConfig)
    # Round numbers, worker-wide: unique across every session and reconnect of this worker (from 1: round 0 is
    # never issued, so a late offer check can start above it)
    rounds: Iterator[int] = field(default_factory=lambda: itertools.count(1))
    lanes: bool = False  # offer a same-host lane to the peers we dial (p2pworker.control.lane)
    # The adapter takes a failed load before its reads settled (api.AttachRegion.deferred_release): a load that can
    # no longer succeed is reported at once, unsettled, and settled once no read of it can land (invariant 7)
    deferred_release: bool = False


@dataclass(slots=True)
class SessionCounters:
    """What one session counted: status shows them per session; the worker adds some to its own when it forgets
    the session."""

    late_offers: int = 0  # offers or lookup answers for a round or lookup no longer open (they crossed our Release)
    late_reads: int = 0  # a read result for no pending read, or one seen done at or after its load's deadline
    stale_releases: int = 0  # a Release for a lease that ran out first
    stale_fetch_parts: int = 0  # a later Fetch part for a round refused or ended already
    unsettled_reads: int = 0  # reads still posted settle_timeout_s after their cancellation (then Abort)
    protocol_errors: int = 0
    frames_in: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def parts(items: list):
    """(part number, slice, more) for each frame's share of ``items``; one empty part for an empty list."""
    n = m.MAX_KEYS  # read at call time: the property tests shrink it to split tiny rounds into parts
    total = len(items)
    for i in range(0, max(total, 1), n):
        yield i // n, items[i:i + n], i + n < total


class SessionCore:
    """The connection state, the outbox and the queue held while the handshake is pending: what both roles use."""

    def __init__(self, ctx: SessionContext, *, expected_peer_id: str | None = None, link: str = ""):
        self.ctx = ctx
        self.link = link  # the control link this session lives on (the host's key for its data peer too)
        self.expected_peer_id = expected_peer_id
        self.peer_id = expected_peer_id or ""
        self.peer_info: PeerDataInfo | None = None
        self.state = State.IDLE
        self.close_cause: CloseCause | None = None  # set once, when the session closes
        self.close_reason = ""  # close_text of the cause and its detail: what status and the logs show
        self._out: list[Action] = []
        self._queue: list[m.Message] = []
        self.counters = SessionCounters()

    def _take(self) -> list[Action]:
        out, self._out = self._out, []
        return out

    def _emit(self, msg: m.Message) -> None:
        self._out.append(Send(msg))

    def _send(self, msg: m.Message) -> None:
        """Send now if ACTIVE; queue (in order) while the handshake is pending; drop when closed.

        Callers that queue (load, lookup) check :meth:`_queue_full` first and fail their job instead."""
        if self.state is State.ACTIVE:
            self._emit(msg)
        elif self.state is not State.CLOSED:
            self._queue.append(msg)

    def _queue_full(self) -> bool:
        return self.state is not State.ACTIVE and len(self._queue) >= self.ctx.config.max_queued
