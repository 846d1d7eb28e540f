"""ZMQ control transport: one ROUTER bound per worker, one DEALER per outbound peer.

Wire format (multipart; the ROUTER sees the DEALER's routing id in front)::

    [kind(1 byte), body]

    H  HELLO      initiator -> acceptor   msgpack [version, node_id, client_nonce]
    C  CHALLENGE  acceptor -> initiator   msgpack [node_id, server_nonce, server_proof]
    U  AUTH       initiator -> acceptor   msgpack [client_proof]
    K  WELCOME    acceptor -> initiator   (empty)       link is UP on both sides
    X  REJECT     either                  reason        permanent: bad proof / version
    R  RESET      acceptor -> initiator   (empty)       "I do not know you": re-handshake
    P  PING       either                  (empty)       heartbeat
    D  DATA       either                  payload       only on UP links
    B  BYE        either                  (empty)

Authentication is mutual HMAC-SHA256 challenge-response over a shared secret:
``proof = HMAC(secret, role | client_nonce | server_nonce | client_id | server_id)``.
The secret never crosses the wire, a replayed proof is useless against a new
nonce, and nothing but the handshake is accepted before the link is UP, so an
unauthenticated peer never sees NIXL metadata (which the session layer only
sends as DATA).

Link states (outbound)::

    CONNECTING --CHALLENGE ok--> AUTHING --WELCOME--> UP
        |  deadline, refused,       | deadline,         | silent > interval x liveness, RESET, BYE,
        |  ZMTP failed / dropped    | ZMTP dropped      | its TCP connection closed (CLOSED)
        v                           v                   v
       DOWN (reconnect after bounded exponential backoff, new DEALER, new routing id)
    any --REJECT / bad server proof--> FAILED (permanent until disconnect)

Until it is UP, each DEALER has a socket monitor (an inproc PAIR, polled with the
sockets) that follows how far the TCP connection under it got, :class:`Wire`
DIALING --TCP connected--> TCP --ZMTP greeting done--> ZMTP, and takes the
link DOWN at once, without waiting for the deadline, when libzmq says the
dial failed: the table :data:`MONITOR_MOVES` (the tests read it).  A refused
connect (nothing listens there) is ``DownCause.REFUSED``, a peer that accepts
TCP but does not speak ZMTP (an HTTP server, or one that hangs up at once) is
``DownCause.HANDSHAKE_FAILED``, as is one still silent at the deadline; a ZMTP
peer that hangs up before our handshake ends is ``DownCause.HANDSHAKE_DROPPED``.
Each such failure counts in ``counters`` (:data:`CAUSE_COUNTERS`) and is
logged at WARNING once per address and cause (again only after a link to it
was UP).  The monitor stays while the link is UP (Wire.UP): the end of the TCP
connection under it is the peer's process gone (the kernel closed its socket:
it exited, was killed or restarted) or a reset on the path, and takes the link
DOWN at once as ``DownCause.CLOSED`` (libzmq would redial under the link, and
only 3 s of heartbeat silence would tell).  A peer that is silent without a
close (stopped, starved, a cut path) is the heartbeats' to judge.

Inbound links exist per routing id: CHALLENGED --AUTH ok--> UP, and vanish on
silence, BYE or a failed proof.  What each received frame does, by side and
link state, is the tables :data:`DEALER_MOVES` and :data:`ROUTER_MOVES` (the
tests read them): a frame not in the table is counted and dropped (outbound,
or an inbound link that is UP) or answered with RESET (an inbound identity
that has not authenticated).  Any inbound traffic counts as alive; each
side pings when it has sent nothing for one interval.  ``LinkDown`` is
reported once per up-period (once in all for a link that never came up).

Liveness (liveness.py): a peer's silence, and every handshake deadline, is
measured on the run clock, which does not count our own stalls (this process
stopped or starved of CPU: the peer's pings waited in our sockets meanwhile);
the tick right after a stall reads and pings but judges no link.  Stalls are
counted (``stalls``, ``stalled_ms``) and logged; links declared lost for
silence are counted (``heartbeat_lost``).
"""

from __future__ import annotations

import errno
import logging
import os
import secrets
import socket
import time
from collections import OrderedDict
from typing import Callable

import zmq

from p2pworker.control.base import SECRET_ENV, ControlTransport, DownCause, LinkDown, LinkState, LinkUp, default_port
from p2pworker.control.liveness import RunClock, stall_bound_s
from p2pworker.control.zmq_config import ControlConfig, advertised
from p2pworker.control.zmq_inbound import InboundLinks
from p2pworker.control.zmq_outbound import OutboundLinks
from p2pworker.control.zmq_wire import (
    _EMPTY,
    Wire,
    CAUSE_COUNTERS,
    K_BYE,
    K_DATA,
    K_PING,
    Link,
    handshake_proof,
    _normalize,
)
from p2pworker.errors import AuthError, Backpressure, P2PError, PeerLost, PeerUnreachable

log = logging.getLogger(__name__)


class ZmqControl(OutboundLinks, InboundLinks, ControlTransport):
    def __init__(
        self,
        config: ControlConfig | None = None,
        *,
        node_id: str | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.config = cfg = config or ControlConfig()
        self._clock = clock
        self.node_id = node_id or f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"
        secret = cfg.secret if cfg.secret is not None else os.environ.get(SECRET_ENV)
        if cfg.auth:
            if not secret:
                raise AuthError(
                    f"control-plane authentication is on but no shared secret is set: set control.secret "
                    f"or ${SECRET_ENV}, or turn authentication off explicitly (control.auth: false)"
                )
            self._secret = secret.encode() if isinstance(secret, str) else bytes(secret)
        else:
            log.warning("control-plane authentication is DISABLED: any process that reaches %s can talk to us",
                        cfg.host)
            self._secret = b""
        self._ctx = zmq.Context()
        self._router = self._ctx.socket(zmq.ROUTER)
        r = self._router
        r.setsockopt(zmq.LINGER, 0)
        r.setsockopt(zmq.ROUTER_MANDATORY, 1)
        r.setsockopt(zmq.SNDHWM, cfg.hwm)
        r.setsockopt(zmq.RCVHWM, cfg.hwm)
        r.setsockopt(zmq.MAXMSGSIZE, cfg.max_frame_bytes)
        port = default_port(cfg.dp_index) if cfg.port is None else (cfg.port + cfg.dp_index if cfg.port else 0)
        try:
            r.bind(f"tcp://{cfg.host}:{port}")
        except zmq.ZMQError as e:
            r.close(linger=0)
            self._ctx.term()
            raise P2PError(f"cannot bind the control socket on {cfg.host}:{port}: {e}") from e
        self.bound_address = r.getsockopt_string(zmq.LAST_ENDPOINT)
        self.address = advertised(self.bound_address, cfg.advertise_host)
        self._poller = zmq.Poller()
        self._poller.register(r, zmq.POLLIN)
        self._by_sock: dict[zmq.Socket, Link] = {}  # dealer socket, or its monitor -> its outbound link
        self.sockets_epoch = 0  # bumped whenever sockets() changes: an outer poll loop rebuilds only then
        self._links: dict[str, Link] = {}
        self._inbound: dict[bytes, Link] = {}
        self._events: list = []
        self._seq = 0
        self._tick_s = min(0.25, cfg.heartbeat_interval_s / 4)
        self._next_tick = clock() + self._tick_s
        self._run = RunClock(clock(), stall_bound_s(self._tick_s))  # peers' silence: our own stalls not counted
        self._closed = False
        self._warned: OrderedDict[tuple[str, DownCause], None] = OrderedDict()  # dial failures logged (log once)
        self.counters = {
            "frames_in": 0,
            "frames_out": 0,
            "unauthenticated_frames": 0,
            "malformed_frames": 0,
            "rejected_handshakes": 0,
            "links_down": 0,
            "heartbeat_lost": 0,  # UP links declared lost for silence (on the run clock)
            "stalls": 0,  # gaps between two reads of our sockets past the run clock's bound (ours, not the peers')
            "stalled_ms": 0,  # their length beyond that bound: time not counted against any peer
            **{name: 0 for name in CAUSE_COUNTERS.values()},
        }

    # ------------------------------------------------------------ auth
    def _proof(self, role: bytes, cn: bytes, sn: bytes, client: str, server: str) -> bytes:
        return handshake_proof(self._secret, role, cn, sn, client, server)  # the secret is b"" with auth off

    # ------------------------------------------------------------ public API
    def connect(self, address: str, *, resolve: bool = True) -> str:
        """``resolve=False``: do not call getaddrinfo here (an event loop that must not block passes a name it
        checked elsewhere; libzmq resolves it in its own I/O thread, again on every reconnect)."""
        self._check_open()
        endpoint, _, _ = _normalize(address, resolve)
        self._seq += 1
        link = Link(f"out-{self._seq}", True, endpoint, LinkState.CONNECTING, backoff_s=self.config.reconnect_min_s)
        self._links[link.link_id] = link
        try:
            self._open(link)
        except zmq.ZMQError as e:  # e.g. out of file descriptors: a clear refusal, no half-made link kept
            self._links.pop(link.link_id, None)
            raise PeerUnreachable(f"cannot dial control address {address!r}: {e}") from None
        return link.link_id

    def send(self, link_id: str, payload: bytes) -> None:
        link = self._links.get(link_id)
        if link is None:
            raise PeerLost(f"unknown control link {link_id!r}")
        if len(payload) > self.config.max_frame_bytes - 64:
            raise P2PError(
                f"control payload of {len(payload)} bytes exceeds max_frame_bytes={self.config.max_frame_bytes} "
                f"(peers drop the connection of a sender of larger frames)"
            )
        if link.state is LinkState.UP:
            self._send(link, K_DATA, payload)
        elif link.outbound and link.state in (LinkState.CONNECTING, LinkState.AUTHING):
            if len(link.queued) >= self.config.hwm:
                raise Backpressure(f"control link {link_id} to {link.address}: {len(link.queued)} messages queued")
            link.queued.append(payload)
        else:
            raise PeerLost(f"control link {link_id} to {link.address or link.node_id} is {link.state.value}: "
                           f"{link.reason}")

    def disconnect(self, link_id: str) -> None:
        link = self._links.pop(link_id, None)
        if link is None:
            return
        if link.state is LinkState.UP:
            try:
                self._send(link, K_BYE, b"")
            except P2PError:
                pass
        self._drop(link)

    def link(self, link_id: str) -> Link | None:
        return self._links.get(link_id)

    def sockets(self) -> list[zmq.Socket]:
        """Every socket to watch for POLLIN (for an outer poll loop): the router, each DEALER and its socket
        monitor."""
        return [self._router] + [s for lk in self._links.values() for s in (lk.sock, lk.monitor) if s is not None]

    def quiet(self, readable) -> bool:
        """Nothing for ``poll(0)`` to do, given ``readable``, what an outer poll over :meth:`sockets` just found
        readable: none of ours, no event queued, no tick due.  O(readable), not O(links).  True is a look at our
        sockets that found nothing (liveness.py: the run clock runs on)."""
        now = self._clock()
        if self._closed or self._events or now >= self._next_tick:
            return False
        if any(sock is self._router or sock in self._by_sock for sock in readable):
            return False
        self._look(now)
        return True

    def poll(self, timeout_ms: int = 0):
        if self._closed:
            return _EMPTY
        clock = self._clock
        wait_ms = 0
        if timeout_ms > 0:
            wait_ms = max(0, min(timeout_ms, int((self._next_tick - clock()) * 1000) + 1))
        # One zmq_poll over every socket (C, level-triggered), then Python work only for the readable ones: an
        # idle link costs nothing per loop turn (invariant 8: per-loop work independent of idle links).
        ready = self._poller.poll(wait_ms)
        now = clock()
        self._look(now)  # after the wait: a stop inside it is a gap like any other
        if not ready and now < self._next_tick:
            return _EMPTY
        for sock, _ in ready:
            if sock is self._router:
                self._drain_router()
            else:
                link = self._by_sock.get(sock)  # None: closed by an earlier one of this batch
                if link is None:
                    continue
                if link.sock is sock:
                    self._drain_dealer(link)
                elif link.monitor is sock:
                    self._drain_monitor(link)
        if clock() >= self._next_tick:
            self._tick()
        if not self._events:
            return _EMPTY
        out, self._events = self._events, []
        return out

    def close(self) -> None:
        if self._closed:
            return
        for link in list(self._links.values()):
            self.disconnect(link.link_id)
        self._closed = True
        self._router.close(linger=0)
        self._ctx.term()

    def __enter__(self) -> "ZmqControl":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _look(self, now: float) -> None:
        """Our loop reads its sockets now: a gap since the last read past the run clock's bound was our own stall."""
        gap = self._run.look(now)
        # counted and logged only with links: a stall before any (a worker attaching its region) matters to no peer
        if gap and self._links and (line := self._run.note(gap, now, self.config.heartbeat_interval_s, self.counters)):
            log.warning("%s", line)

    def _check_open(self) -> None:
        if self._closed:
            raise P2PError("the control transport is closed")

    # ------------------------------------------------------------ sending
    def _send(self, link: Link, kind: bytes, body: bytes) -> None:
        try:
            if link.outbound:
                link.sock.send_multipart([kind, body], flags=zmq.NOBLOCK)
            else:
                self._router.send_multipart([link.ident, kind, body], flags=zmq.NOBLOCK)
        except zmq.Again as e:
            raise Backpressure(f"control link {link.link_id} to {link.node_id or link.address}: queue full") from e
        except zmq.ZMQError as e:
            if e.errno == errno.EHOSTUNREACH:  # the peer closed it: maybe it declared us lost as we stalled
                hint = self._run.hint(self._clock(), self.config.deadline_s)
                self._down(link, "peer connection gone" + (f" (it {hint})" if hint else ""), retry=link.outbound)
                raise PeerLost(f"control link {link.link_id}: peer connection gone") from e
            raise
        link.last_send = self._clock()
        self.counters["frames_out"] += 1

    def _send_quiet(self, link: Link, kind: bytes, body: bytes) -> None:
        try:
            self._send(link, kind, body)
        except P2PError:
            pass

    def _router_reply(self, ident: bytes, kind: bytes, body: bytes) -> None:
        try:
            self._router.send_multipart([ident, kind, body], flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            pass

    # ------------------------------------------------------------ links going and coming
    def _drop(self, link: Link) -> None:
        self._close_sock(link)
        if not link.outbound:
            self._inbound.pop(link.ident, None)

    def _down(self, link: Link, reason: str, retry: bool, cause: DownCause = DownCause.OTHER) -> None:
        """A link stopped working: report once, then reconnect (outbound) or forget (inbound)."""
        was_up = link.state is LinkState.UP
        link.reason = reason
        link.cause = cause
        link.queued.clear()
        if link.outbound:
            self._close_sock(link)
            if retry:
                link.state = LinkState.DOWN
                self._retry_later(link, was_up)
            else:
                link.state = LinkState.FAILED
            report = not link.reported_down
        else:
            link.state = LinkState.DOWN
            self._links.pop(link.link_id, None)
            self._drop(link)
            report = was_up
        if report:
            link.reported_down = True
            self.counters["links_down"] += 1
            log.info("control link %s (%s %s) down: %s", link.link_id, link.node_id, link.address, reason)
            self._events.append(LinkDown(link.link_id, link.node_id, reason, cause))

    def _up(self, link: Link) -> None:
        if link.outbound:
            # the monitor stays: a drop of the TCP connection under an UP link is the peer gone (MONITOR_MOVES)
            link.wire = Wire.UP
            for cause in CAUSE_COUNTERS:  # it works now: a later failure there is news again
                self._warned.pop((link.address, cause), None)
        link.state = LinkState.UP
        link.reported_down = False
        link.reason = ""
        link.cause = DownCause.OTHER
        link.up_at = self._clock()  # the backoff restarts only once it stayed up (_retry_later)
        link.last_recv = self._run.now(self._clock())  # the run clock (liveness.py)
        self._events.append(LinkUp(link.link_id, link.node_id, link.outbound, link.address))
        while link.queued and link.state is LinkState.UP:
            self._send_quiet(link, K_DATA, link.queued.popleft())

    # ------------------------------------------------------------ timers
    def _tick(self) -> None:
        cfg = self.config
        now = self._clock()
        self._next_tick = now + self._tick_s
        run = self._run.now(now)  # silence and deadlines: on the run clock, our own stalls not counted
        judge = self._run.tick()  # False right after a stall: what the peers sent meanwhile is read first
        for link in list(self._links.values()):
            st = link.state
            if st is LinkState.UP:
                silent = run - link.last_recv
                if judge and silent > cfg.deadline_s:
                    self.counters["heartbeat_lost"] += 1
                    self._down(link, f"heartbeat lost: silent for {silent:.1f} s", retry=link.outbound)
                elif now - link.last_send >= cfg.heartbeat_interval_s:  # wall: after a stall of ours, ping at once
                    self._send_quiet(link, K_PING, b"")
            elif st in (LinkState.CONNECTING, LinkState.AUTHING):
                if judge and run >= link.deadline:
                    self._on_deadline(link)
            elif st is LinkState.CHALLENGED:
                if judge and run >= link.deadline:
                    self._links.pop(link.link_id, None)
                    self._drop(link)
            elif st is LinkState.DOWN and link.outbound and now >= link.next_attempt:
                try:
                    self._open(link)
                except zmq.ZMQError as e:  # e.g. out of file descriptors: the link stays DOWN, tried after its backoff
                    self._retry_later(link)
                    log.warning("control link %s: cannot dial %s again: %s", link.link_id, link.address, e)
