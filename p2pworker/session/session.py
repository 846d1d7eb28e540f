"""One session per control link, holding both roles, as a sans-IO state machine: the connection (handshake, frames
in, close, time) here; the consumer's role in :mod:`p2pworker.session.client`, the producer's in
:mod:`p2pworker.session.server`; what both share in :mod:`p2pworker.session.core`.

No sockets and no data transport here.  Every entry point returns the
*actions* it wants done, in order (:class:`Send` a message, :class:`AddDataPeer`
/ :class:`RemoveDataPeer`, :class:`PostRead` rows of the peer into ours,
:class:`CancelReads`, :class:`Abort`); the worker performs them and feeds results back
(:meth:`Session.on_read_result`).  Time comes from the injected clock; job
results go to the shared :class:`~p2pworker.session.reporter.Reporter`
(exactly once).

Connection states (:data:`MOVES` is the table, :func:`~p2pworker.session.moves.move` the only way the state
changes; :data:`ALLOWED` filters the peer's messages per state; the tests read both)::

    IDLE --start(): send Hello--> HELLO_SENT --HelloAck(accepted)--> ACTIVE
    IDLE --Hello (valid, fingerprints match): send HelloAck--> ACTIVE
    any but CLOSED --Bye / bad frame / illegal message / refused handshake / close()--> CLOSED

A session closes once, with a :class:`CloseCause` (the worker acts on it: a lost peer's outbound link reconnects,
any other close drops the link and backs off) and its text, ``close_reason`` (:func:`close_text`).

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

Load phases (:data:`~p2pworker.session.client.LOAD_MOVES` is the table)::

    WAITING --final Offer--> FINAL --no read pending--> REPORTED
    WAITING | FINAL --deadline, or session closed--> SETTLING (CancelReads) --no read pending--> REPORTED
    SETTLING --reads outlive settle_timeout_s--> STUCK (Abort: the worker exits)

Why a stalled or dead producer cannot corrupt us, and why no clock sync is
needed: the consumer's deadline is ``t_send(Fetch) + lease`` on its clock;
the producer holds offered rows until ``t_recv(Fetch) + lease * (1 + drift)
+ margin`` on its own clock (or the Release).  ``t_send < t_recv`` in real
time, so the producer's hold ends after the consumer's deadline.  A read the
consumer sees DONE before its deadline therefore copied rows that were still
pinned; a read seen DONE at or after it counts as failed.  The only writer
of our rows is our own worker, and a load is reported only after every read
it posted settled (cancelled reads included), so nothing lands in a row
after its job was reported.  Reads that do not settle after their
cancellation are never given up on: the session asks the worker to exit
(:class:`Abort`), and the process's death ends them.
"""


from __future__ import annotations

import secrets

from p2pworker.errors import RemoteProtocolError
from p2pworker.protocol import messages as m
from p2pworker.protocol.peer_info import PeerDataInfo
from p2pworker.session.client import LOAD_MOVES, SESSION_CLOSED, ClientRole, LoadEvent, LoadPhase
from p2pworker.session.core import (
    ALLOWED,
    LEASE_DRIFT,
    LEASE_MARGIN_S,
    MOVES,
    Abort,
    Action,
    AddDataPeer,
    CancelReads,
    CloseCause,
    DialLane,
    ExpectLane,
    PostRead,
    RemoveDataPeer,
    Send,
    SessionConfig,
    SessionContext,
    SessionCounters,
    SessionEvent,
    State,
    close_text,
    fingerprint_diff,
    longest_hold_s,
)
from p2pworker.session.moves import IllegalMove, move
from p2pworker.session.reporter import SessionClosed, SessionUp
from p2pworker.session.server import Answered, ServerRole

__all__ = [
    "ALLOWED", "LEASE_DRIFT", "LEASE_MARGIN_S", "LOAD_MOVES", "MOVES", "Abort", "Action", "AddDataPeer", "Answered",
    "CancelReads", "CloseCause", "DialLane", "ExpectLane", "IllegalMove", "LoadEvent", "LoadPhase", "PostRead",
    "RemoveDataPeer", "Send", "Session", "SessionConfig", "SessionContext", "SessionCounters", "SessionEvent",
    "State", "close_text", "longest_hold_s",
]


class Session(ClientRole, ServerRole):
    """One control link's session: the handshake, the peer's frames dispatched to the roles, the close, time."""

    def __init__(self, ctx: SessionContext, *, expected_peer_id: str | None = None, link: str = ""):
        super().__init__(ctx, expected_peer_id=expected_peer_id, link=link)
        self._data_added = False
        # Same-host lane (p2pworker.control.lane): the key we dial it with (we dialed), the key our peer dials it
        # with (it dialed us), and whether the peer's LaneUp arrived (its messages then come on the lane).
        self.lane_key = b""
        self.peer_lane_key = b""
        self.lane_in = False
        self.quiet_close = False  # closed after answering a probe: the peer hangs up itself
        self.address = ""  # the adapter's host:port of the peer, when we dialed it (SessionUp names it)
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

    # ------------------------------------------------------------ connection
    def start(self) -> list[Action]:
        """Initiator: send Hello."""
        self.state = move(MOVES, self.state, SessionEvent.START)
        if self.ctx.lanes:
            self.lane_key = secrets.token_bytes(32)
        self._emit(m.Hello(m.PROTOCOL_VERSION, self.ctx.node_id, self.ctx.data_info, self.ctx.fingerprint,
                           self.lane_key))
        return self._take()

    def receive(self, frame: bytes, *, lane: bool = False) -> list[Action]:
        """Handle one frame from the peer (``lane``: it came on our same-host lane, not the control link).  A bad
        one closes the session (RemoteProtocolError is not raised: the cause is ``CloseCause.PROTOCOL_ERROR``,
        counted in ``counters.protocol_errors``)."""
        if self.state is State.CLOSED:
            return []
        self.counters.frames_in += 1
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
            self.counters.protocol_errors += 1
            self._close(CloseCause.PROTOCOL_ERROR, str(e), bye=True)
        return self._take()

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
        self.state = move(MOVES, self.state, SessionEvent.HELLO if ack is not None else SessionEvent.HELLO_ACK)
        self.ctx.reporter.emit(SessionUp(peer_id, self.address))
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
                reason = f"config fingerprint mismatch ({fingerprint_diff(diff)})"
        if reason:
            self._emit(m.HelloAck(m.PROTOCOL_VERSION, ctx.node_id, False, reason=reason))
            self.peer_id = msg.peer_id
            self._close(CloseCause.REJECTED, reason)
            return
        if len(msg.lane) == 32:  # any other length: no lane (the session works without one)
            self.peer_lane_key = msg.lane
        self._activate(msg.peer_id, msg.data,
                       m.HelloAck(m.PROTOCOL_VERSION, ctx.node_id, True, ctx.data_info, ctx.fingerprint))

    def _on_hello_ack(self, msg: m.HelloAck) -> None:
        if not msg.accepted:
            self._close(CloseCause.REJECTED_BY_PEER, msg.reason)
            return
        if msg.version != m.PROTOCOL_VERSION:
            raise RemoteProtocolError(f"protocol version mismatch: peer speaks version {msg.version}, "
                                      f"this worker speaks version {m.PROTOCOL_VERSION}")
        if msg.data is None or msg.fingerprint is None:
            raise RemoteProtocolError("accepted hello_ack without data info or fingerprint")
        diff = self.ctx.fingerprint.diff(msg.fingerprint)
        if diff:
            self._close(CloseCause.MISMATCH, fingerprint_diff(diff), bye=True)
            return
        self._activate(msg.peer_id, msg.data)

    def _on_probe(self, msg: m.Probe) -> None:
        """Answer who we are (no data-plane registration), then close quietly."""
        ctx = self.ctx
        self._emit(m.ProbeInfo(m.PROTOCOL_VERSION, ctx.node_id, ctx.fingerprint, ctx.data_info.backend,
                               ctx.data_info.num_blocks, ctx.data_info.block_bytes))
        self.quiet_close = True
        self._close(CloseCause.PROBED, "", quiet=True)

    def _on_lane_up(self, msg: m.LaneUp) -> None:
        if self.lane_in:
            raise RemoteProtocolError("a second lane_up in one session")
        self.lane_in = True  # the worker reads the lane from now on: the peer's later messages are there, in order

    def _on_bye(self, msg: m.Bye) -> None:
        self._close(CloseCause.PEER_BYE, msg.reason)

    def close(self, detail: str, *, cause: CloseCause = CloseCause.LOCAL, bye: bool = False,
              quiet: bool = False) -> list[Action]:
        """Close once: fail what can fail now, cancel our reads (their loads are reported once they settle),
        hand leased parcels to their lease's end.  Idempotent.  The worker's own closes are LOCAL (``detail`` is
        the whole reason); a link or lane that went down is ``PEER_LOST``."""
        self._close(cause, detail, bye=bye, quiet=quiet)
        return self._take()

    def _close(self, cause: CloseCause, detail: str, *, bye: bool = False, quiet: bool = False) -> None:
        if self.state is State.CLOSED:
            return
        reason = close_text(cause, detail)
        if bye and self.state is not State.IDLE:
            self._emit(m.Bye(reason[:1000]))
        self.state = move(MOVES, self.state, SessionEvent.CLOSE)
        self.close_cause = cause
        self.close_reason = reason
        self._queue.clear()
        self._close_client(f"{SESSION_CLOSED}{self.peer_id} closed: {reason}")
        self._close_server(reason)
        if self._data_added:
            self._out.append(RemoveDataPeer())
        if not quiet:
            self.ctx.reporter.emit(SessionClosed(self.peer_id, reason))

    @property
    def settled(self) -> bool:
        """Closed and nothing of ours can still land: the worker may forget this session."""
        return self.state is State.CLOSED and not self._loads

    # ------------------------------------------------------------ time
    def tick(self) -> list[Action]:
        """Time-outs: loads past their deadline (then past settling), lookups, rounds whose offers must end."""
        now = self.ctx.clock()
        abort = self._tick_loads(now)
        if self.state is not State.CLOSED:
            self._tick_lookups(now)
            self._tick_leases(now)
        out = self._take()
        if abort is not None:
            out.append(abort)  # last: what this tick asked for is done before the worker exits
        return out
