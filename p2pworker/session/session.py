"""One session per control link, holding both roles, as a sans-IO state machine.

No sockets and no data transport here.  Every entry point returns the
*actions* it wants done, in order (:class:`Send` a message, :class:`AddDataPeer`
/ :class:`RemoveDataPeer`, :class:`PostRead` rows of the peer into ours,
:class:`CancelReads`); the worker performs them and feeds results back
(:meth:`Session.on_read_result`).  Time comes from the injected clock; job
results go to the shared :class:`~p2pworker.session.reporter.Reporter`
(exactly once).

Connection states (the table :data:`ALLOWED` is what the tests read)::

    IDLE --start(): send Hello--> HELLO_SENT --HelloAck(accepted)--> ACTIVE
    IDLE --Hello (valid, fingerprints match): send HelloAck--> ACTIVE
    any --Bye / bad frame / illegal message / close()--> CLOSED

Same host: the dialer's Hello carries a key for the session's lane (DialLane / ExpectLane: the worker opens it,
p2pworker.control.lane); ACTIVE --LaneUp--> the peer's later messages come on the lane only (``lane_in``: one on
the control link is a protocol error).

The data plane is consumer pull (protocol version 2).  Consumer (client
role), one load = one round (round numbers are worker-wide, so they never
collide across reconnects)::

    load(): Fetch(keys, lease_ms)[parts] --------------> producer pins offered rows
            <------------------- Offer(keys, rows)*      (as stores arrive)
    PostRead(producer rows -> granted rows)
            <------------------- Offer(final)
    all reads settled: report the job, then Release(read keys)[parts] --> rows unpinned

Any number of keys (invariant 8): a frame carries at most ``MAX_KEYS``; a
round's Fetch goes in parts (the producer offers each part's keys as they
come and sends the final Offer only after the last part), Offers go in
pieces, a Release in parts (the producer acts on the last), and lookups and
their answers likewise.  Every path is linear in the keys it touches.

Load phases (:data:`LOAD_MOVES` is the table)::

    WAITING --final offer seen and no read pending--> (reported)
    WAITING --deadline, or session closed--> SETTLING (CancelReads) --no read pending--> (reported)

Why a stalled or dead producer cannot corrupt us, and why no clock sync is
needed: the consumer's deadline is ``t_send(Fetch) + lease`` on its clock;
the producer holds offered rows until ``t_recv(Fetch) + lease * (1 + drift)
+ margin`` on its own clock (or the Release).  ``t_send < t_recv`` in real
time, so the producer's hold ends after the consumer's deadline.  A read the
consumer sees DONE before its deadline therefore copied rows that were still
pinned; a read seen DONE at or after it counts as failed.  The only writer
of our rows is our own worker, and a load is reported only after every read
it posted settled (cancelled reads included), so nothing lands in a row
after its job was reported.
"""

from __future__ import annotations

import enum
import logging
import math
import secrets
from dataclasses import dataclass, field
from typing import Callable, Union

import msgspec

from p2pworker.protocol.peer_info import PeerDataInfo
from p2pworker.errors import LocalProtocolError, RemoteProtocolError
from p2pworker.fingerprint import Fingerprint
from p2pworker.limits import MAX_JOB_KEYS
from p2pworker.protocol import messages as m
from p2pworker.schema import Lease as LeaseSeconds
from p2pworker.schema import Pos, PosInt
from p2pworker.session.parking import Lease, LeasePhase, Parcel, ParkingLot
from p2pworker.session.reporter import Reporter, ServeLookup, SessionClosed, SessionUp

log = logging.getLogger(__name__)

# The producer's hold exceeds the consumer's lease by this factor and margin: monotonic clocks of two
# hosts tick at rates within ~1e-4 of each other; 1e-3 and half a second leave room for scheduling.
LEASE_DRIFT = 1e-3
LEASE_MARGIN_S = 0.5


class State(enum.Enum):
    IDLE = "idle"
    HELLO_SENT = "hello_sent"
    ACTIVE = "active"
    CLOSED = "closed"


_RUNNING = frozenset({m.Fetch, m.Offer, m.Release, m.Done, m.Lookup, m.LookupResp, m.LaneUp, m.Bye})
ALLOWED: dict[State, frozenset] = {
    State.IDLE: frozenset({m.Hello, m.Probe, m.Bye}),
    State.HELLO_SENT: frozenset({m.HelloAck, m.Bye}),
    State.ACTIVE: _RUNNING,
    State.CLOSED: frozenset(),
}


class LoadPhase(enum.Enum):
    WAITING = "waiting"  # offers arrive, reads are posted
    SETTLING = "settling"  # past the deadline or the session closed: reads cancelled, waiting for them


class LoadEvent(enum.Enum):
    DEADLINE = "deadline"
    CLOSED = "closed"
    CANCELLED = "cancelled"  # the worker is shutting down: the link still works, so the Release can go out


LOAD_MOVES: dict[tuple[LoadPhase, LoadEvent], LoadPhase] = {
    (LoadPhase.WAITING, LoadEvent.DEADLINE): LoadPhase.SETTLING,
    (LoadPhase.WAITING, LoadEvent.CLOSED): LoadPhase.SETTLING,
    (LoadPhase.WAITING, LoadEvent.CANCELLED): LoadPhase.SETTLING,
    (LoadPhase.SETTLING, LoadEvent.CLOSED): LoadPhase.SETTLING,
    (LoadPhase.SETTLING, LoadEvent.CANCELLED): LoadPhase.SETTLING,
}


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


Action = Union[Send, AddDataPeer, RemoveDataPeer, PostRead, CancelReads, DialLane, ExpectLane]


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


class Rounds:
    """Worker-wide round numbers: unique across every session and reconnect of this worker."""

    def __init__(self) -> None:
        self._next = 0

    def next(self) -> int:
        self._next += 1
        return self._next


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
    rounds: Rounds = field(default_factory=Rounds)
    lanes: bool = False  # offer a same-host lane to the peers we dial (p2pworker.control.lane)


@dataclass(eq=False)
class _Load:
    job_id: int
    request_id: str
    round: int
    rows: dict[bytes, int]  # asked key -> our granted row
    deadline: float  # the lease, on our clock: no read counts at or after it
    offered: set[bytes] = field(default_factory=set)
    reads: dict[int, list[bytes]] = field(default_factory=dict)  # pending read id -> keys
    read_ok: list[bytes] = field(default_factory=list)
    final: bool = False
    reason: str = ""
    phase: LoadPhase = LoadPhase.WAITING
    settle_by: float = math.inf
    fetches: list[m.Fetch] = field(default_factory=list)  # while they wait for the handshake: withdrawable
    handshake_by: float = math.inf  # a Fetch still queued then is withdrawn: whoever answers later on that
    # address (a restarted producer) never heard of the request and would make us wait out its fetch_timeout_s


@dataclass(eq=False)
class _Asked:
    """A lookup we sent: its answers arrive in parts, in the order of the keys."""

    deadline: float
    n: int
    present: list[bool] = field(default_factory=list)


@dataclass(eq=False)
class _Inbound:
    """A peer's lookup whose parts are still arriving."""

    request_id: str
    refused: bool  # too many lookups served already: answered all-False at the end, keys not kept
    keys: list[bytes] = field(default_factory=list)
    n: int = 0
    parts: int = 0


def bye_reason(msg: m.Bye) -> str:
    """A session the peer ended with ``msg`` closes with this reason (also when the worker finds the Bye queued on a
    lane our send found closed: p2pworker.worker.lane_end_reason)."""
    return f"peer said bye: {msg.reason}" if msg.reason else "peer said bye"


def _parts(items: list):
    """(part number, slice, more) for each frame's share of ``items``; one empty part for an empty list."""
    n = m.MAX_KEYS  # read at call time: the property tests shrink it to split tiny rounds into parts
    total = len(items)
    for i in range(0, max(total, 1), n):
        yield i // n, items[i:i + n], i + n < total


class Session:
    def __init__(self, ctx: SessionContext, *, expected_peer_id: str | None = None, link: str = ""):
        self.ctx = ctx
        self.link = link  # the control link this session lives on (the host's key for its data peer too)
        self.expected_peer_id = expected_peer_id
        self.peer_id = expected_peer_id or ""
        self.peer_info: PeerDataInfo | None = None
        self.state = State.IDLE
        self.close_reason = ""
        self._out: list[Action] = []
        self._queue: list[m.Message] = []
        self._loads: dict[int, _Load] = {}  # round -> load
        self._reads: dict[int, _Load] = {}  # pending read id -> its load
        self._next_read = 0
        # Late offers (they crossed our Release, or came after our deadline) are ignored, not errors: any round at
        # or below the highest one this session issued and no longer open.  Rounds only grow (worker-wide), so one
        # number replaces a set of finished rounds (a 10,000-entry dict cost ~0.9 MB per session in the soak).
        self._max_round = 0
        self._lookups: dict[int, _Asked] = {}  # lookups we sent, not answered in full yet
        self._inbound: dict[int, _Inbound] = {}  # a peer's lookups whose parts are still arriving
        self._serving: dict[int, int] = {}  # inbound lookup id -> keys asked (waiting for answer_lookup)
        self._parcels: set[Parcel] = set()  # parcels whose lease this session serves
        self._fetch_open: Lease | None = None  # the lease whose Fetch parts are still arriving
        self._withdrawn: set[int] = set()  # rounds whose queued Fetch parts must not be sent (see _report)
        self._data_added = False
        # Same-host lane (p2pworker.control.lane): the key we dial it with (we dialed), the key our peer dials it
        # with (it dialed us), and whether the peer's LaneUp arrived (its messages then come on the lane).
        self.lane_key = b""
        self.peer_lane_key = b""
        self.lane_in = False
        self.stuck = ""  # set when posted reads never settle: the worker must exit (see tick)
        self.quiet_close = False  # closed after answering a probe: the peer hangs up itself
        self.counters = {"late_offers": 0, "late_reads": 0, "stale_releases": 0, "stale_fetch_parts": 0,
                         "unsettled_reads": 0, "protocol_errors": 0, "frames_in": 0}
        self._handlers = {
            m.Hello: self._on_hello,
            m.HelloAck: self._on_hello_ack,
            m.Fetch: self._on_fetch,
            m.Offer: self._on_offer,
            m.Release: self._on_release,
            m.Done: self._on_done,
            m.Lookup: self._on_lookup,
            m.LookupResp: self._on_lookup_resp,
            m.Probe: self._on_probe,
            m.LaneUp: self._on_lane_up,
            m.Bye: self._on_bye,
        }

    def _take(self) -> list[Action]:
        out, self._out = self._out, []
        return out

    # ------------------------------------------------------------ connection
    def start(self) -> list[Action]:
        """Initiator: send Hello."""
        if self.state is not State.IDLE:
            raise LocalProtocolError(f"start() in state {self.state.value}")
        self.state = State.HELLO_SENT
        if self.ctx.lanes:
            self.lane_key = secrets.token_bytes(32)
        self._emit(m.Hello(m.PROTOCOL_VERSION, self.ctx.node_id, self.ctx.data_info, self.ctx.fingerprint,
                           self.lane_key))
        return self._take()

    def receive(self, frame: bytes, *, lane: bool = False) -> list[Action]:
        """Handle one frame from the peer (``lane``: it came on our same-host lane, not the control link).  A bad
        one closes the session (RemoteProtocolError is not raised: the reason is in ``close_reason`` and
        ``counters['protocol_errors']``)."""
        if self.state is State.CLOSED:
            return []
        self.counters["frames_in"] += 1
        try:
            msg = m.decode(frame)
            # After its LaneUp the peer sends on the lane only (one stream, in order); a Bye may still come on the
            # link (the peer's lane broke: nothing to keep in order any more).
            if self.lane_in and not lane and type(msg) is not m.Bye:
                raise RemoteProtocolError("a message on the control link after lane_up")
            if type(msg) not in ALLOWED[self.state]:
                raise RemoteProtocolError(f"{type(msg).__name__} is not allowed in state {self.state.value}")
            self._handlers[type(msg)](msg)
        except RemoteProtocolError as e:
            self.counters["protocol_errors"] += 1
            self._close(f"protocol error: {e}", bye=True)
        return self._take()

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

    def _activate(self, peer_id: str, info: PeerDataInfo, ack: m.HelloAck | None = None) -> None:
        """Handshake done: register the peer's data plane, (acceptor) ack, then flush the queue in order.

        The worker performs AddDataPeer first; if the data plane refuses the
        peer, it drops the rest of this outbox (the ack and the queue) and
        calls :meth:`close`.
        """
        if self.expected_peer_id and peer_id != self.expected_peer_id:
            raise RemoteProtocolError(f"hello from {peer_id!r} on a link authenticated as {self.expected_peer_id!r}")
        self.peer_id = peer_id
        self._out.append(AddDataPeer(info, dialed=ack is None))
        self._data_added = True
        self.peer_info = info
        if ack is not None:
            if self.peer_lane_key and self.ctx.lanes:
                self._out.append(ExpectLane(self.peer_lane_key))  # before the ack: the peer dials it on the ack
            self._emit(ack)
        elif self.lane_key and info.same_host is not None:
            self._out.append(DialLane(self.lane_key, info))
        self.state = State.ACTIVE
        self.ctx.reporter.emit(SessionUp(peer_id))
        queued, self._queue = self._queue, []
        withdrawn, self._withdrawn = self._withdrawn, set()
        for msg in queued:
            if not (isinstance(msg, m.Fetch) and msg.round in withdrawn):
                self._emit(msg)

    def _on_hello(self, msg: m.Hello) -> None:
        ctx = self.ctx
        reason = ""
        if msg.version != m.PROTOCOL_VERSION:
            reason = (f"protocol version mismatch: peer {msg.peer_id!r} speaks version {msg.version}, "
                      f"this worker speaks version {m.PROTOCOL_VERSION}; run the same p2pworker release on both")
        else:
            diff = ctx.fingerprint.diff(msg.fingerprint)
            if diff:
                reason = "config fingerprint mismatch (" + ", ".join(
                    f"{k}: local={a!r} remote={b!r}" for k, (a, b) in diff.items()) + ")"
        if reason:
            self._emit(m.HelloAck(m.PROTOCOL_VERSION, ctx.node_id, False, reason=reason))
            self.peer_id = msg.peer_id
            self._close(f"handshake rejected: {reason}")
            return
        if len(msg.lane) == 32:  # any other length: no lane (the session works without one)
            self.peer_lane_key = msg.lane
        self._activate(msg.peer_id, msg.data,
                       m.HelloAck(m.PROTOCOL_VERSION, ctx.node_id, True, ctx.data_info, ctx.fingerprint))

    def _on_hello_ack(self, msg: m.HelloAck) -> None:
        if not msg.accepted:
            self._close(f"handshake rejected by the peer: {msg.reason}")
            return
        if msg.version != m.PROTOCOL_VERSION:
            raise RemoteProtocolError(f"protocol version mismatch: peer speaks version {msg.version}, "
                                      f"this worker speaks version {m.PROTOCOL_VERSION}")
        if msg.data is None or msg.fingerprint is None:
            raise RemoteProtocolError("accepted hello_ack without data info or fingerprint")
        diff = self.ctx.fingerprint.diff(msg.fingerprint)
        if diff:
            self._close("config fingerprint mismatch (" + ", ".join(
                f"{k}: local={a!r} remote={b!r}" for k, (a, b) in diff.items()) + ")", bye=True)
            return
        self._activate(msg.peer_id, msg.data)

    def _on_probe(self, msg: m.Probe) -> None:
        """Answer who we are (no data-plane registration), then close quietly."""
        ctx = self.ctx
        self._emit(m.ProbeInfo(m.PROTOCOL_VERSION, ctx.node_id, ctx.fingerprint, ctx.data_info.backend,
                               ctx.data_info.num_blocks, ctx.data_info.block_bytes))
        self.quiet_close = True
        self._close("probed", quiet=True)

    def _on_lane_up(self, msg: m.LaneUp) -> None:
        if self.lane_in:
            raise RemoteProtocolError("a second lane_up in one session")
        self.lane_in = True  # the worker reads the lane from now on: the peer's later messages are there, in order

    def _on_bye(self, msg: m.Bye) -> None:
        self._close(bye_reason(msg))

    def close(self, reason: str, *, bye: bool = False, quiet: bool = False) -> list[Action]:
        """Close once: fail what can fail now, cancel our reads (their loads are reported once they settle),
        hand leased parcels to their lease's end.  Idempotent."""
        self._close(reason, bye=bye, quiet=quiet)
        return self._take()

    def _close(self, reason: str, *, bye: bool = False, quiet: bool = False) -> None:
        if self.state is State.CLOSED:
            return
        if bye and self.state is not State.IDLE:
            self._emit(m.Bye(reason[:1000]))
        self.state = State.CLOSED
        self.close_reason = reason
        self._queue.clear()
        ctx = self.ctx
        why = f"session to {self.peer_id} closed: {reason}"
        for load in list(self._loads.values()):
            self._settle(load, LoadEvent.CLOSED, why)
        for lookup_id in list(self._lookups):
            ctx.reporter.lookup_done(lookup_id, None, why)
        self._lookups.clear()
        self._inbound.clear()
        self._serving.clear()
        for p in list(self._parcels):
            if p.lease is not None and p.lease.owner is self:
                ctx.lot.abandon(p, f"consumer {self.peer_id} lost: {reason}")
        self._parcels.clear()
        if self._data_added:
            self._out.append(RemoveDataPeer())
        if not quiet:
            ctx.reporter.emit(SessionClosed(self.peer_id, reason))

    def cancel_loads(self, reason: str) -> list[Action]:
        """Shutdown, first step: cancel every load's reads; each is reported (and its Release sent on the
        still-open link) once its reads settled."""
        for load in list(self._loads.values()):
            self._settle(load, LoadEvent.CANCELLED, reason)
        return self._take()

    @property
    def settled(self) -> bool:
        """Closed and nothing of ours can still land: the worker may forget this session."""
        return self.state is State.CLOSED and not self._loads

    # ------------------------------------------------------------ client role (consumer)
    def load(self, job_id: int, request_id: str, keys: list[bytes], rows: list[int]) -> list[Action]:
        """Pull ``keys`` of ``request_id`` from the peer into our granted ``rows``."""
        ctx = self.ctx
        now = ctx.clock()
        ctx.reporter.open(job_id, "load", now)
        if self.state is State.CLOSED:
            ctx.reporter.done(job_id, False, (), 0, now, f"session to {self.peer_id} closed: {self.close_reason}")
            return []
        if len(keys) > MAX_JOB_KEYS:
            ctx.reporter.done(job_id, False, (), 0, now, f"load of {len(keys)} keys exceeds the hard limit of "
                                                          f"{MAX_JOB_KEYS} keys per job (p2pworker.limits)")
            return []
        granted = dict(zip(keys, map(int, rows)))
        if not keys or len(keys) != len(rows) or len(granted) != len(keys) or len(set(granted.values())) != len(keys):
            ctx.reporter.done(job_id, False, (), 0, now, f"bad load: {len(keys)} keys, {len(rows)} rows "
                                                          f"(no duplicates allowed)")
            return []
        lease_ms = math.ceil(ctx.config.load_timeout_s * 1000)
        if not 1 <= lease_ms <= m.MAX_LEASE_MS:
            ctx.reporter.done(job_id, False, (), 0, now, f"load_timeout_s={ctx.config.load_timeout_s:g} is outside "
                                                          f"0.001..{m.MAX_LEASE_MS // 1000} s (a lease no peer grants)")
            return []
        if self._queue_full():
            ctx.reporter.done(job_id, False, (), 0, now, f"{len(self._queue)} messages already wait for the "
                                                          f"handshake with {self.peer_id or 'the peer'}")
            return []
        lease_s = ctx.config.load_timeout_s
        rnd = self._max_round = ctx.rounds.next()
        # The deadline is taken BEFORE the Fetch is sent (or queued): the producer's hold starts later.
        load = self._loads[rnd] = _Load(job_id, request_id, rnd, granted, now + lease_s,
                                        handshake_by=now + ctx.config.handshake_timeout_s)
        load.fetches = [m.Fetch(request_id, rnd, part_keys, lease_ms, part, more)
                        for part, part_keys, more in _parts(list(keys))]
        for fetch in load.fetches:
            self._send(fetch)
        if self.state is State.ACTIVE:
            load.fetches = []  # sent: nothing to withdraw
        return self._take()

    def done(self, request_id: str) -> list[Action]:
        """Our request ``request_id`` ended: tell the producer it may release what we did not fetch (Done).  Queued
        while the handshake is pending; dropped when the session is closed or its queue is full (the producer's
        park_timeout_s still ends those rows: this only makes it sooner)."""
        if not self._queue_full():
            self._send(m.Done(request_id))
        return self._take()

    def lookup(self, lookup_id: int, keys: list[bytes], request_id: str) -> list[Action]:
        ctx = self.ctx
        ctx.reporter.open_lookup(lookup_id)
        if self.state is State.CLOSED or self._queue_full() or len(keys) > MAX_JOB_KEYS:
            ctx.reporter.lookup_done(lookup_id, None, f"session closed: {self.close_reason}" if self.state is
                                     State.CLOSED else "too many messages wait for the handshake"
                                     if self._queue_full() else f"lookup of {len(keys)} keys exceeds the hard "
                                     f"limit of {MAX_JOB_KEYS} (p2pworker.limits)")
            return []
        self._lookups[lookup_id] = _Asked(ctx.clock() + ctx.config.lookup_timeout_s, len(keys))
        for part, part_keys, more in _parts(list(keys)):
            self._send(m.Lookup(lookup_id, request_id, part_keys, part, more))
        return self._take()

    def _on_offer(self, msg: m.Offer) -> None:
        load = self._loads.get(msg.round)
        if load is None and 0 < msg.round <= self._max_round:
            self.counters["late_offers"] += 1  # crossed our Release, or came after our deadline
            return
        if load is None or load.request_id != msg.request_id:
            raise RemoteProtocolError(f"offer for {msg.request_id!r} round {msg.round} that was never fetched")
        keys, rows = msg.keys, msg.rows
        if len(keys) != len(rows):  # decode() refuses such a frame already; a row for every key, whoever built it
            raise RemoteProtocolError(f"offer {msg.request_id!r}: {len(keys)} keys but {len(rows)} rows")
        # Checked as sets (C loops: the per-key loop was the consumer's largest Python cost per request).
        new = set(keys)
        if not load.rows.keys() >= new:
            raise RemoteProtocolError(f"offer for {msg.request_id!r} names a key that was not requested")
        if len(new) != len(keys) or not load.offered.isdisjoint(new):
            raise RemoteProtocolError(f"offer for {msg.request_id!r} names a key twice")
        nb = self.peer_info.num_blocks
        top = max(rows, default=0)
        if top >= nb:
            raise RemoteProtocolError(f"offer for {msg.request_id!r}: row {top} outside the peer's 0..{nb - 1}")
        load.offered |= new
        local = list(map(load.rows.__getitem__, keys))
        remote = list(rows)
        if msg.final:
            load.final = True
            load.reason = msg.reason
        if load.phase is not LoadPhase.WAITING:
            return  # settling: post nothing new
        if msg.keys:
            self._next_read += 1
            rid = self._next_read
            load.reads[rid] = list(msg.keys)
            self._reads[rid] = load
            self._out.append(PostRead(rid, local, remote))
        self._maybe_report(load)

    def on_read_result(self, read_id: int, ok: bool, reason: str = "") -> list[Action]:
        """The data plane settled read ``read_id``: nothing of it can land any more."""
        load = self._reads.pop(read_id, None)
        if load is None:
            self.counters["late_reads"] += 1
            return []
        keys = load.reads.pop(read_id)
        now = self.ctx.clock()
        if ok and now < load.deadline and load.phase is LoadPhase.WAITING:
            load.read_ok.extend(keys)
        elif ok:
            # Seen done at or after our deadline: the producer may have released the rows before the copy
            # ran (a SIGSTOP between post and copy, say).  Never count it.
            self.counters["late_reads"] += 1
            load.reason = load.reason or "a read completed after the load's deadline and was discarded"
        else:
            load.reason = load.reason or f"read from {self.peer_id} failed: {reason}"
        self._maybe_report(load)
        return self._take()

    def _maybe_report(self, load: _Load) -> None:
        if load.reads:
            return
        if load.phase is LoadPhase.WAITING and not load.final:
            return
        self._report(load)

    def _report(self, load: _Load) -> None:
        """Report the job once, then release the producer's rows (the job is over: no read of it can run)."""
        ctx = self.ctx
        for rid in load.reads:  # only on a settle time-out: those reads are given up on
            self._reads.pop(rid, None)
        del self._loads[load.round]
        n = len(load.rows)
        ok = len(load.read_ok) == n and load.phase is LoadPhase.WAITING
        reason = "" if ok else load.reason or f"{n - len(load.read_ok)} of {n} keys did not arrive"
        ctx.reporter.done(load.job_id, ok, load.read_ok, len(load.read_ok) * ctx.data_info.block_bytes,
                          ctx.clock(), reason)
        if self.state is not State.ACTIVE and load.fetches:
            self._withdrawn.add(load.round)  # never sent: nothing leased, nothing to release (O(1): skipped later)
            return
        for _, part_keys, more in _parts(load.read_ok):
            self._send(m.Release(load.request_id, load.round, part_keys, more))

    def _settle(self, load: _Load, event: LoadEvent, reason: str) -> None:
        """Deadline or close: cancel the load's reads; report when none is pending."""
        load.phase = LOAD_MOVES[(load.phase, event)]
        if load.settle_by == math.inf:
            load.settle_by = self.ctx.clock() + self.ctx.config.settle_timeout_s
            load.reason = reason
        if load.reads:
            self._out.append(CancelReads(tuple(load.reads)))
        else:
            self._report(load)

    def _on_lookup_resp(self, msg: m.LookupResp) -> None:
        asked = self._lookups.get(msg.lookup_id)
        if asked is None:
            self.counters["late_offers"] += 1
            return
        asked.present += msg.present
        if len(asked.present) > asked.n or (not msg.more and len(asked.present) != asked.n):
            # left in _lookups: the close this raises reports it failed
            raise RemoteProtocolError(f"lookup_resp {msg.lookup_id}: {len(asked.present)} answers for {asked.n} keys")
        if not msg.more:
            del self._lookups[msg.lookup_id]
            self.ctx.reporter.lookup_done(msg.lookup_id, asked.present)

    # ------------------------------------------------------------ server role (producer)
    def _on_lookup(self, msg: m.Lookup) -> None:
        limit = self.ctx.config.max_inbound_lookups
        inb = self._inbound.get(msg.lookup_id)
        if msg.part == 0:
            if inb is not None or msg.lookup_id in self._serving:
                raise RemoteProtocolError(f"lookup {msg.lookup_id} asked again while the first is open")
            if self._inbound:
                # A peer sends all parts of a lookup back to back (lookup() emits them at once), so at most one is
                # ever unfinished: a second one is abuse that would hold up to MAX_JOB_KEYS keys each, forever.
                raise RemoteProtocolError(f"lookup {msg.lookup_id} started before lookup {next(iter(self._inbound))} "
                                          f"sent its last part")
            inb = self._inbound[msg.lookup_id] = _Inbound(msg.request_id, refused=len(self._serving) >= limit)
        elif inb is None or msg.part != inb.parts or msg.request_id != inb.request_id:
            raise RemoteProtocolError(f"lookup {msg.lookup_id}: part {msg.part} out of order")
        inb.parts += 1
        inb.n += len(msg.keys)
        if inb.n > MAX_JOB_KEYS:
            raise RemoteProtocolError(f"lookup {msg.lookup_id} of more than {MAX_JOB_KEYS} keys")
        if not inb.refused:
            inb.keys += msg.keys
        if msg.more:
            return
        del self._inbound[msg.lookup_id]
        if inb.refused:
            self._answer_parts(msg.lookup_id, [False] * inb.n)
            return
        self._serving[msg.lookup_id] = inb.n
        self.ctx.reporter.emit(ServeLookup(self.peer_id, msg.lookup_id, inb.request_id, tuple(inb.keys)))

    def _answer_parts(self, lookup_id: int, present: list[bool]) -> None:
        for _, part, more in _parts(present):
            self._emit(m.LookupResp(lookup_id, part, more))

    def answer_lookup(self, lookup_id: int, present: list[bool]) -> tuple[bool, list[Action]]:
        """Answer a peer's lookup; (False, []) when this session is not serving ``lookup_id``."""
        n = self._serving.pop(lookup_id, None)
        if n is None or self.state is not State.ACTIVE:
            return False, []
        if len(present) != n:
            raise LocalProtocolError(f"lookup {lookup_id}: {len(present)} answers for {n} keys")
        self._answer_parts(lookup_id, list(present))
        return True, self._take()

    def _on_fetch(self, msg: m.Fetch) -> None:
        ctx = self.ctx
        now = ctx.clock()
        if len(set(msg.keys)) != len(msg.keys):
            raise RemoteProtocolError(f"fetch {msg.request_id!r}: duplicate keys")
        if msg.part:
            self._on_fetch_part(msg)
            return
        if self._fetch_open is not None and self._fetch_open.more and self._fetch_open.owner is self:
            # Parts of one Fetch go back to back (load() emits them at once): a new round before the last part of
            # the previous one is abuse (each unfinished round could hold up to MAX_JOB_KEYS keys).
            raise RemoteProtocolError(f"fetch {msg.request_id!r} round {msg.round} started before round "
                                      f"{self._fetch_open.round} sent its last part")
        lease_s = msg.lease_ms / 1000
        if lease_s > ctx.config.max_lease_s:
            self._emit(m.Offer(msg.request_id, msg.round, [], [], True,
                               f"lease of {lease_s:g} s exceeds this producer's "
                               f"max_lease_s={ctx.config.max_lease_s:g}"))
            return
        lot = ctx.lot
        p = lot.parcel(msg.request_id)
        if p.lease is not None:
            self._emit(m.Offer(msg.request_id, msg.round, [], [], True,
                               f"request is leased to another fetch (round {p.lease.round}) until it is released"))
            return
        # offer_until: later offers would arrive too close to the consumer's deadline to be read in time.
        lease = Lease(msg.round, self, dict.fromkeys(msg.keys), now + min(ctx.config.fetch_timeout_s, 0.9 * lease_s),
                      now + lease_s * (1 + LEASE_DRIFT) + LEASE_MARGIN_S, more=msg.more, parts=1)
        lot.bind(p, lease)
        self._parcels.add(p)
        self._fetch_open = lease if msg.more else None
        self._offer(p)

    def _on_fetch_part(self, msg: m.Fetch) -> None:
        """A later part of a round's Fetch: its keys join the lease (the hold still counts from part 0)."""
        p = self.ctx.lot.parcels.get(msg.request_id)
        lease = p.lease if p is not None else None
        if lease is None or lease.owner is not self or lease.round != msg.round or lease.phase is LeasePhase.HELD:
            # Part 0 was refused, or the round's offers already ended (fetch_timeout_s) or its lease did: the
            # consumer has (or will have) its final Offer; these keys were never offered.  Nothing to add to.
            self.counters["stale_fetch_parts"] += 1
            return
        if not lease.more or msg.part != lease.parts:
            raise RemoteProtocolError(f"fetch {msg.request_id!r} round {msg.round}: part {msg.part} out of order")
        if lease.parts * m.MAX_KEYS + len(msg.keys) > MAX_JOB_KEYS:
            raise RemoteProtocolError(f"fetch {msg.request_id!r} of more than {MAX_JOB_KEYS} keys")
        pending, offered = lease.pending, lease.offered
        for k in msg.keys:
            if k in pending or k in offered:
                raise RemoteProtocolError(f"fetch {msg.request_id!r}: duplicate keys")
            pending[k] = None
        lease.parts += 1
        lease.more = msg.more
        self._offer(p, msg.keys)

    def pump(self, p: Parcel, new_keys: list[bytes] | None = None) -> list[Action]:
        """New stores (``new_keys``: only those are looked at, so a request fed one key at a time costs
        linear time), or the request finished (``None``): offer what can be offered."""
        self._offer(p, new_keys)
        return self._take()

    def _offer(self, p: Parcel, candidates: list[bytes] | None = None) -> None:
        lease = p.lease
        if lease is None or lease.owner is not self or lease.phase is not LeasePhase.OFFERING:
            return
        pending, parked = lease.pending, p.rows
        keys = ([k for k in pending if k in parked] if candidates is None
                else [k for k in candidates if k in pending and k in parked])
        rows = list(map(parked.__getitem__, keys))
        now = self.ctx.clock()
        if keys:
            self.ctx.lot.offering_starts(lease, now)
            if len(keys) == len(pending):  # keys are distinct members of pending: all of it
                pending.clear()
            else:
                for k in keys:
                    del pending[k]
            lease.offered.update(zip(keys, rows))
        # While Fetch parts are still coming, "nothing pending" or "request finished" says nothing about their keys.
        final = (not lease.more and (not lease.pending or p.finished)) or now >= lease.offer_until
        if not keys and not final:
            return
        reason = ""
        if final and lease.pending:
            reason = ("request finished before every key was stored" if p.finished
                      else "fetch timed out on the producer")
            log.info("fetch %r round %d from %s: %d of %d keys offered: %s", p.request_id, lease.round,
                     self.peer_id, len(lease.offered), len(lease.offered) + len(lease.pending), reason)
            lease.pending.clear()
        if final:
            lease.phase = LeasePhase.HELD
            lease.more = False  # parts still to come are ignored: the consumer has its final offer
        for part, part_keys, more in _parts(keys):  # pieces of MAX_KEYS; only the last one may be final
            i = part * m.MAX_KEYS
            self._emit(m.Offer(p.request_id, lease.round, part_keys, rows[i:i + m.MAX_KEYS], final and not more,
                               "" if more else reason))

    def _on_done(self, msg: m.Done) -> None:
        self.ctx.lot.consumer_done(msg.request_id)

    def _on_release(self, msg: m.Release) -> None:
        p = self.ctx.lot.parcels.get(msg.request_id)
        lease = p.lease if p is not None else None
        if lease is None or lease.owner is not self or lease.round != msg.round:
            self.counters["stale_releases"] += 1  # the lease ran out first
            return
        if not lease.offered.keys() >= set(msg.read):
            raise RemoteProtocolError(f"release for {msg.request_id!r} names keys that were not offered")
        lease.read += msg.read
        if len(lease.read) > len(lease.offered):
            raise RemoteProtocolError(f"release for {msg.request_id!r} names more keys than were offered")
        if msg.more:
            return  # the rows stay pinned until the last part
        self._parcels.discard(p)
        self.ctx.lot.release(p, lease.read, f"consumer {self.peer_id} did not read it")

    # ------------------------------------------------------------ time
    def tick(self) -> list[Action]:
        """Time-outs: loads past their deadline (then past settling), lookups, rounds whose offers must end."""
        ctx = self.ctx
        now = ctx.clock()
        for load in list(self._loads.values()):
            if load.phase is LoadPhase.WAITING and now >= load.deadline:
                self._settle(load, LoadEvent.DEADLINE,
                             f"timed out after {ctx.config.load_timeout_s:g} s waiting for {self.peer_id}")
            elif (load.phase is LoadPhase.WAITING and now >= load.handshake_by and self.state is not State.ACTIVE
                    and self.state is not State.CLOSED):
                self._settle(load, LoadEvent.DEADLINE, f"no handshake with the peer within "
                                                       f"{ctx.config.handshake_timeout_s:g} s")
            elif load.phase is LoadPhase.SETTLING and now >= load.settle_by and not self.stuck:
                # Reads still posted settle_timeout_s after their cancellation: NIXL cannot abort a posted READ,
                # so reporting the load now would let the bytes land in rows vLLM reused.  Never report it: ask
                # the worker to exit (its death ends every read it initiated); the adapter then fails the jobs.
                self.counters["unsettled_reads"] += len(load.reads)
                self.stuck = (f"{len(load.reads)} read(s) from {self.peer_id} did not settle within "
                              f"{ctx.config.settle_timeout_s:g} s of their cancellation ({load.reason})")
        if self.state is State.CLOSED:
            return self._take()
        for lookup_id, asked in list(self._lookups.items()):
            if now >= asked.deadline:
                del self._lookups[lookup_id]
                ctx.reporter.lookup_done(lookup_id, None, f"lookup timed out after {ctx.config.lookup_timeout_s:g} s")
        for p in list(self._parcels):
            if p.lease is None or p.lease.owner is not self:
                self._parcels.discard(p)  # released by the lot (lease ran out)
            elif p.lease.phase is LeasePhase.OFFERING and now >= p.lease.offer_until:
                self._offer(p)
        return self._take()

    @property
    def open_loads(self) -> int:
        return len(self._loads)

    @property
    def leases(self) -> int:
        return len(self._parcels)
