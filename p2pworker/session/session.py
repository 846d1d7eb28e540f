"""One session per peer, holding both roles, as a sans-IO state machine.

No sockets here: frames come in through :meth:`Session.receive`, go out
through the injected ``send`` callable, writes go to the injected data
transport, and time comes from the injected clock.  Job results go to the
shared :class:`~p2pworker.session.reporter.Reporter` (exactly once).

Connection states (the table :data:`ALLOWED` is what the tests read)::

    IDLE --start(): send Hello--> HELLO_SENT --HelloAck(accepted)--> ACTIVE
    IDLE --Hello (valid, fingerprints match): send HelloAck--> ACTIVE
    any --Bye / bad frame / illegal message / close()--> CLOSED

Anything but the handshake message before ACTIVE is a remote protocol error;
messages the host asks to send before ACTIVE are queued and sent after the
handshake, in order.

Client role (consumer): ``load()`` sends Fetch(request, round, keys, granted
rows); TransferDone reports the job (partial success allowed); past
``load_timeout_s`` the job is reported failed and AbortFetch is sent; a
TransferDone or AbortAck that arrives after that is counted and ignored.

Server role (producer): a Fetch binds the request's parcel in the parking lot;
parked keys are written into the granted rows (only those); the round ends
with TransferDone when every wanted key landed or failed, or the request is
finished, or ``fetch_timeout_s`` passed.  AbortFetch cancels what is not
posted, waits for what is, then answers AbortAck.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Callable, Protocol

from p2pworker.data.base import PeerDataInfo
from p2pworker.errors import LocalProtocolError, RemoteProtocolError, TransferFailed
from p2pworker.fingerprint import Fingerprint
from p2pworker.protocol import messages as m
from p2pworker.session.parking import FetchState, Parcel, ParkingLot
from p2pworker.session.reporter import Reporter, ServeLookup, SessionClosed, SessionUp


class State(enum.Enum):
    IDLE = "idle"
    HELLO_SENT = "hello_sent"
    ACTIVE = "active"
    CLOSED = "closed"


_RUNNING = frozenset({m.Fetch, m.TransferDone, m.AbortFetch, m.AbortAck, m.Lookup, m.LookupResp, m.Bye})
ALLOWED: dict[State, frozenset] = {
    State.IDLE: frozenset({m.Hello, m.Probe, m.Bye}),
    State.HELLO_SENT: frozenset({m.HelloAck, m.Bye}),
    State.ACTIVE: _RUNNING,
    State.CLOSED: frozenset(),
}


class DataLike(Protocol):
    def add_peer(self, peer_id: str, info: PeerDataInfo) -> None: ...
    def remove_peer(self, peer_id: str) -> None: ...
    def write_blocks(self, peer_id: str, local_rows, remote_rows) -> int: ...
    def cancel(self, ids, wait: bool = False, timeout_s: float = 5.0) -> None: ...


@dataclass
class SessionConfig:
    load_timeout_s: float = 30.0
    fetch_timeout_s: float = 20.0  # below load_timeout_s: the producer answers partial before the consumer gives up
    lookup_timeout_s: float = 5.0
    park_timeout_s: float = 60.0
    max_queued: int = 10_000  # messages held while the handshake is pending
    max_inbound_lookups: int = 1024
    max_aborted_remembered: int = 10_000


@dataclass
class SessionContext:
    """What every session of one worker shares."""

    node_id: str
    data_info: PeerDataInfo
    fingerprint: Fingerprint
    data: DataLike
    reporter: Reporter
    lot: ParkingLot
    clock: Callable[[], float]
    config: SessionConfig = field(default_factory=SessionConfig)
    write_owner: dict[int, tuple] = field(default_factory=dict)  # transfer id -> (session, parcel, fetch)
    late_writes: int = 0

    def on_write_result(self, tid: int, ok: bool, reason: str = "") -> None:
        """Route a data-transport result to the session that submitted it."""
        owner = self.write_owner.pop(tid, None)
        if owner is None:
            self.late_writes += 1
            return
        owner[0]._on_write_result(tid, owner[1], owner[2], ok, reason)


@dataclass(eq=False)
class _Load:
    job_id: int
    request_id: str
    round: int
    keys: list[bytes]
    deadline: float


class Session:
    def __init__(self, ctx: SessionContext, send: Callable[[bytes], None], *, expected_peer_id: str | None = None):
        self.ctx = ctx
        self._send_frame = send
        self.expected_peer_id = expected_peer_id
        self.peer_id = expected_peer_id or ""
        self.peer_info: PeerDataInfo | None = None
        self.state = State.IDLE
        self.close_reason = ""
        self._queue: list[m.Message] = []
        self._loads: dict[tuple[str, int], _Load] = {}
        self._rounds: dict[str, int] = {}
        self._aborted: dict[tuple[str, int], float] = {}
        self._lookups: dict[int, tuple[float, int]] = {}  # lookup id -> (deadline, keys asked)
        self._serving: dict[int, int] = {}  # inbound lookup id -> keys asked
        self._parcels: set[Parcel] = set()  # parcels whose active fetch this session serves
        self._data_added = False
        self.counters = {"late_completions": 0, "stale_fetches": 0, "protocol_errors": 0, "frames_in": 0}
        self._handlers = {
            m.Hello: self._on_hello,
            m.HelloAck: self._on_hello_ack,
            m.Fetch: self._on_fetch,
            m.TransferDone: self._on_transfer_done,
            m.AbortFetch: self._on_abort_fetch,
            m.AbortAck: self._on_abort_ack,
            m.Lookup: self._on_lookup,
            m.LookupResp: self._on_lookup_resp,
            m.Probe: self._on_probe,
            m.Bye: self._on_bye,
        }

    # ------------------------------------------------------------ connection
    def start(self) -> None:
        """Initiator: send Hello."""
        if self.state is not State.IDLE:
            raise LocalProtocolError(f"start() in state {self.state.value}")
        self.state = State.HELLO_SENT
        self._emit(m.Hello(m.PROTOCOL_VERSION, self.ctx.node_id, self.ctx.data_info, self.ctx.fingerprint))

    def receive(self, frame: bytes) -> None:
        """Handle one frame from the peer.  Raises only RemoteProtocolError (after closing the session)."""
        if self.state is State.CLOSED:
            return
        self.counters["frames_in"] += 1
        try:
            msg = m.decode(frame)
            if type(msg) not in ALLOWED[self.state]:
                raise RemoteProtocolError(f"{type(msg).__name__} is not allowed in state {self.state.value}")
            self._handlers[type(msg)](msg)
        except RemoteProtocolError as e:
            self.counters["protocol_errors"] += 1
            self.close(f"protocol error: {e}", bye=True)
            raise

    def _emit(self, msg: m.Message) -> None:
        self._send_frame(m.encode(msg))

    def _send(self, msg: m.Message) -> None:
        """Send now if ACTIVE; queue (in order) while the handshake is pending; drop when closed."""
        if self.state is State.ACTIVE:
            self._emit(msg)
        elif self.state is not State.CLOSED:
            if len(self._queue) >= self.ctx.config.max_queued:
                raise LocalProtocolError(f"{len(self._queue)} messages queued before the handshake completed")
            self._queue.append(msg)

    def _activate(self, peer_id: str, info: PeerDataInfo, ack: m.HelloAck | None = None) -> None:
        """Handshake done: register the peer's data plane, (acceptor) ack, then flush the queue in order."""
        if self.expected_peer_id and peer_id != self.expected_peer_id:
            raise RemoteProtocolError(f"hello from {peer_id!r} on a link authenticated as {self.expected_peer_id!r}")
        self.peer_id = peer_id
        try:
            self.ctx.data.add_peer(peer_id, info)
        except TransferFailed as e:
            if ack is not None:
                self._emit(m.HelloAck(m.PROTOCOL_VERSION, self.ctx.node_id, False, reason=str(e)))
            self.close(f"data plane refused the peer: {e}", bye=ack is None)
            return
        self._data_added = True
        self.peer_info = info
        if ack is not None:
            self._emit(ack)
        self.state = State.ACTIVE
        self.ctx.reporter.emit(SessionUp(peer_id))
        queued, self._queue = self._queue, []
        for msg in queued:
            self._emit(msg)

    def _on_hello(self, msg: m.Hello) -> None:
        ctx = self.ctx
        reason = ""
        if msg.version != m.PROTOCOL_VERSION:
            reason = f"protocol version {msg.version}, expected {m.PROTOCOL_VERSION}"
        else:
            diff = ctx.fingerprint.diff(msg.fingerprint)
            if diff:
                reason = "config fingerprint mismatch (" + ", ".join(
                    f"{k}: local={a!r} remote={b!r}" for k, (a, b) in diff.items()) + ")"
        if reason:
            self._emit(m.HelloAck(m.PROTOCOL_VERSION, ctx.node_id, False, reason=reason))
            self.peer_id = msg.peer_id
            self.close(f"handshake rejected: {reason}")
            return
        self._activate(msg.peer_id, msg.data, m.HelloAck(m.PROTOCOL_VERSION, ctx.node_id, True, ctx.data_info, ctx.fingerprint))

    def _on_hello_ack(self, msg: m.HelloAck) -> None:
        if not msg.accepted:
            self.close(f"handshake rejected by the peer: {msg.reason}")
            return
        if msg.data is None or msg.fingerprint is None:
            raise RemoteProtocolError("accepted hello_ack without data info or fingerprint")
        diff = self.ctx.fingerprint.diff(msg.fingerprint)
        if diff:
            self.close("config fingerprint mismatch (" + ", ".join(
                f"{k}: local={a!r} remote={b!r}" for k, (a, b) in diff.items()) + ")", bye=True)
            return
        self._activate(msg.peer_id, msg.data)

    def _on_probe(self, msg: m.Probe) -> None:
        """Answer who we are (no data-plane registration), then close quietly."""
        ctx = self.ctx
        self._emit(m.ProbeInfo(m.PROTOCOL_VERSION, ctx.node_id, ctx.fingerprint, ctx.data_info.backend,
                               ctx.data_info.num_blocks, ctx.data_info.block_bytes))
        self.close("probed", quiet=True)

    def _on_bye(self, msg: m.Bye) -> None:
        self.close(f"peer said bye: {msg.reason}" if msg.reason else "peer said bye")

    def close(self, reason: str, *, bye: bool = False, quiet: bool = False) -> None:
        """Fail every job of this session once, release its parcels, forget the peer.  Idempotent."""
        if self.state is State.CLOSED:
            return
        if bye and self.state is not State.IDLE:
            try:
                self._emit(m.Bye(reason[:1000]))
            except Exception:  # the link may be gone already
                pass
        self.state = State.CLOSED
        self.close_reason = reason
        self._queue.clear()
        ctx = self.ctx
        now = ctx.clock()
        for load in list(self._loads.values()):
            ctx.reporter.done(load.job_id, False, (), 0, now, f"session to {self.peer_id} closed: {reason}")
        self._loads.clear()
        for lookup_id in list(self._lookups):
            ctx.reporter.lookup_done(lookup_id, None, f"session to {self.peer_id} closed: {reason}")
        self._lookups.clear()
        self._serving.clear()
        for p in list(self._parcels):
            f = p.fetch
            if f is not None and f.inflight:
                ctx.data.cancel(list(f.inflight))
            ctx.lot.drop(p, f"consumer {self.peer_id} lost: {reason}")
        self._parcels.clear()
        if self._data_added:
            ctx.data.remove_peer(self.peer_id)
        if not quiet:
            ctx.reporter.emit(SessionClosed(self.peer_id, reason))

    # ------------------------------------------------------------ client role
    def load(self, job_id: int, request_id: str, keys: list[bytes], rows: list[int]) -> None:
        """Ask the peer to write ``keys`` of ``request_id`` into our granted ``rows``."""
        ctx = self.ctx
        now = ctx.clock()
        ctx.reporter.open(job_id, "load", now)
        if self.state is State.CLOSED:
            ctx.reporter.done(job_id, False, (), 0, now, f"session to {self.peer_id} closed: {self.close_reason}")
            return
        if not keys or len(keys) != len(rows) or len(keys) > m.MAX_KEYS:
            ctx.reporter.done(job_id, False, (), 0, now, f"bad load: {len(keys)} keys, {len(rows)} rows")
            return
        rnd = self._rounds.get(request_id, -1) + 1
        self._rounds[request_id] = rnd
        self._loads[(request_id, rnd)] = _Load(job_id, request_id, rnd, list(keys), now + ctx.config.load_timeout_s)
        self._send(m.Fetch(request_id, rnd, list(keys), [int(r) for r in rows]))

    def lookup(self, lookup_id: int, keys: list[bytes], request_id: str) -> None:
        ctx = self.ctx
        ctx.reporter.open_lookup(lookup_id)
        if self.state is State.CLOSED:
            ctx.reporter.lookup_done(lookup_id, None, f"session closed: {self.close_reason}")
            return
        self._lookups[lookup_id] = (ctx.clock() + ctx.config.lookup_timeout_s, len(keys))
        self._send(m.Lookup(lookup_id, request_id, list(keys)))

    def _on_transfer_done(self, msg: m.TransferDone) -> None:
        key = (msg.request_id, msg.round)
        load = self._loads.pop(key, None)
        if load is None:
            if self._aborted.pop(key, None) is not None:
                self.counters["late_completions"] += 1
                self.ctx.reporter.late += 1
                return
            raise RemoteProtocolError(f"transfer_done for {msg.request_id!r} round {msg.round} that was never fetched")
        asked = set(load.keys)
        landed = list(dict.fromkeys(msg.landed))
        if not asked.issuperset(landed):
            self._loads[key] = load  # close() fails it
            raise RemoteProtocolError(f"transfer_done for {msg.request_id!r} names keys that were not requested")
        ok = len(landed) == len(asked)
        self.ctx.reporter.done(
            load.job_id, ok, landed, len(landed) * self.ctx.data_info.block_bytes, self.ctx.clock(),
            "" if ok else (msg.reason or f"{len(asked) - len(landed)} of {len(asked)} keys did not land"),
        )

    def _on_abort_ack(self, msg: m.AbortAck) -> None:
        self._aborted.pop((msg.request_id, msg.round), None)

    def _on_lookup_resp(self, msg: m.LookupResp) -> None:
        pending = self._lookups.pop(msg.lookup_id, None)
        if pending is None:
            self.counters["late_completions"] += 1
            return
        if len(msg.present) != pending[1]:
            self._lookups[msg.lookup_id] = pending
            raise RemoteProtocolError(f"lookup_resp {msg.lookup_id}: {len(msg.present)} answers for {pending[1]} keys")
        self.ctx.reporter.lookup_done(msg.lookup_id, msg.present)

    # ------------------------------------------------------------ server role
    def _on_lookup(self, msg: m.Lookup) -> None:
        if len(self._serving) >= self.ctx.config.max_inbound_lookups:
            self._emit(m.LookupResp(msg.lookup_id, [False] * len(msg.keys)))
            return
        self._serving[msg.lookup_id] = len(msg.keys)
        self.ctx.reporter.emit(ServeLookup(self.peer_id, msg.lookup_id, msg.request_id, tuple(msg.keys)))

    def answer_lookup(self, lookup_id: int, present: list[bool]) -> bool:
        """Answer a peer's lookup; False when this session is not serving ``lookup_id``."""
        n = self._serving.pop(lookup_id, None)
        if n is None or self.state is not State.ACTIVE:
            return False
        if len(present) != n:
            raise LocalProtocolError(f"lookup {lookup_id}: {len(present)} answers for {n} keys")
        self._emit(m.LookupResp(lookup_id, list(present)))
        return True

    def _on_fetch(self, msg: m.Fetch) -> None:
        nb = self.peer_info.num_blocks
        bad = [r for r in msg.rows if r >= nb]
        if bad:
            raise RemoteProtocolError(f"fetch {msg.request_id!r}: rows {bad[:3]} outside the peer's 0..{nb - 1}")
        if len(set(msg.rows)) != len(msg.rows) or len(set(msg.keys)) != len(msg.keys):
            raise RemoteProtocolError(f"fetch {msg.request_id!r}: duplicate keys or rows")
        lot = self.ctx.lot
        p = lot.parcel(msg.request_id)
        if p.owner is not None and p.owner is not self:
            self._emit(m.TransferDone(msg.request_id, msg.round, [], "request is being served to another peer"))
            return
        if msg.round <= p.served_round or (p.fetch is not None and msg.round <= p.fetch.round):
            self.counters["stale_fetches"] += 1
            return
        if p.fetch is not None:  # one round at a time: the consumer may retry once the current one ends
            self._emit(m.TransferDone(msg.request_id, msg.round, [], "previous round still in progress"))
            return
        p.owner = self
        p.fetch = FetchState(msg.round, dict(zip(msg.keys, msg.rows)), self.ctx.clock() + self.ctx.config.fetch_timeout_s)
        self._parcels.add(p)
        self.pump(p)

    def pump(self, p: Parcel) -> None:
        """Write what can be written for the parcel's fetch; end the round when it is over."""
        f = p.fetch
        if f is None or self.state is State.CLOSED:
            return
        ctx = self.ctx
        if not f.aborted:
            todo = [k for k in f.wanted if k in p.rows and k not in f.landed and k not in f.given_up and k not in f.sending]
            if todo:
                try:
                    tid = ctx.data.write_blocks(self.peer_id, [p.rows[k] for k in todo], [f.wanted[k] for k in todo])
                except TransferFailed as e:
                    f.given_up.update(todo)
                    ctx.lot.failed(p, todo, f"write to {self.peer_id} refused: {e}")
                else:
                    f.inflight[tid] = todo
                    f.sending.update(todo)
                    ctx.write_owner[tid] = (self, p, f)
        if f.inflight:
            return
        if f.aborted:
            self._emit(m.AbortAck(p.request_id, f.round))
            self._release(p)
            ctx.lot.drop(p, f"consumer {self.peer_id} aborted the fetch")
            return
        all_settled = all(k in f.landed or k in f.given_up for k in f.wanted)
        if all_settled or p.finished or ctx.clock() >= f.deadline:
            landed = [k for k in f.wanted if k in f.landed]
            reason = "" if len(landed) == len(f.wanted) else (
                "request finished before every key was stored" if p.finished and not all_settled
                else "fetch timed out on the producer" if not all_settled else "some writes failed")
            self._emit(m.TransferDone(p.request_id, f.round, landed, reason))
            p.served_round = f.round
            self._release(p)
            ctx.lot.maybe_close(p)

    def _release(self, p: Parcel) -> None:
        p.fetch = None
        p.owner = None
        self._parcels.discard(p)

    def _on_write_result(self, tid: int, p: Parcel, f: FetchState, ok: bool, reason: str) -> None:
        keys = f.inflight.pop(tid, None)
        if keys is None or p.fetch is not f or self.state is State.CLOSED:
            self.ctx.late_writes += 1
            return
        f.sending.difference_update(keys)
        if ok:
            f.landed.update(keys)
            self.ctx.lot.delivered(p, keys)
        else:
            f.given_up.update(keys)
            self.ctx.lot.failed(p, keys, f"write to {self.peer_id} failed: {reason}")
        self.pump(p)

    def _on_abort_fetch(self, msg: m.AbortFetch) -> None:
        p = self.ctx.lot.parcels.get(msg.request_id)
        if p is None or p.owner is not self or p.fetch is None or p.fetch.round != msg.round:
            self._emit(m.AbortAck(msg.request_id, msg.round))  # nothing of it in flight: ack at once
            return
        f = p.fetch
        f.aborted = True
        if f.inflight:
            self.ctx.data.cancel(list(f.inflight))
        self.pump(p)

    # ------------------------------------------------------------ time
    def tick(self) -> None:
        """Time-outs: loads and lookups past their deadline, fetch rounds past theirs."""
        if self.state is State.CLOSED:
            return
        ctx = self.ctx
        now = ctx.clock()
        for key, load in list(self._loads.items()):
            if now >= load.deadline:
                del self._loads[key]
                self._remember_aborted(key, now)
                self._send(m.AbortFetch(load.request_id, load.round))
                ctx.reporter.done(load.job_id, False, (), 0, now,
                                  f"timed out after {ctx.config.load_timeout_s:g} s waiting for {self.peer_id}")
        for lookup_id, (deadline, _) in list(self._lookups.items()):
            if now >= deadline:
                del self._lookups[lookup_id]
                ctx.reporter.lookup_done(lookup_id, None, f"lookup timed out after {ctx.config.lookup_timeout_s:g} s")
        for p in list(self._parcels):
            if p.fetch is not None and now >= p.fetch.deadline:
                self.pump(p)

    def _remember_aborted(self, key: tuple[str, int], now: float) -> None:
        self._aborted[key] = now
        if len(self._aborted) > self.ctx.config.max_aborted_remembered:
            del self._aborted[next(iter(self._aborted))]

    @property
    def open_loads(self) -> int:
        return len(self._loads)

