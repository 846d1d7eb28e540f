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
        |  deadline, refused,       | deadline,         | silent > interval x liveness, RESET, BYE
        |  ZMTP failed / dropped    | ZMTP dropped      |
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
was UP).  The monitor is closed when the link comes UP: heartbeats watch an UP
link, and libzmq's own reconnects under it (a TCP hiccup) are not failures.

Inbound links exist per routing id: CHALLENGED --AUTH ok--> UP, and vanish on
silence, BYE or a failed proof.  What each received frame does, by side and
link state, is the tables :data:`DEALER_MOVES` and :data:`ROUTER_MOVES` (the
tests read them): a frame not in the table is counted and dropped (outbound,
or an inbound link that is UP) or answered with RESET (an inbound identity
that has not authenticated).  Any inbound traffic counts as alive; each
side pings when it has sent nothing for one interval.  ``LinkDown`` is
reported once per up-period (once in all for a link that never came up).
"""

from __future__ import annotations

import enum
import errno
import functools
import hashlib
import hmac
import logging
import operator
import os
import secrets
import socket
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Annotated, Callable

import msgspec
from msgspec import Meta
import zmq
from zmq.utils.monitor import recv_monitor_message

from p2pworker.control.base import (
    SECRET_ENV,
    ControlTransport,
    DownCause,
    LinkDown,
    LinkState,
    LinkUp,
    Received,
    default_port,
)
from p2pworker.errors import AuthError, Backpressure, P2PError, PeerLost, PeerUnreachable
from p2pworker.limits import MAX_FRAME_BYTES
from p2pworker.schema import DPIndex, Port, Pos, PosInt

log = logging.getLogger(__name__)

CONTROL_VERSION = 1

K_HELLO, K_CHALLENGE, K_AUTH, K_WELCOME = b"H", b"C", b"U", b"K"
K_REJECT, K_RESET, K_PING, K_DATA, K_BYE = b"X", b"R", b"P", b"D", b"B"

_EMPTY: tuple = ()


class _Hello(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    version: int
    node_id: str
    nonce: bytes


class _Challenge(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    node_id: str
    nonce: bytes
    proof: bytes


class _Auth(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    proof: bytes


_enc = msgspec.msgpack.Encoder()
_hello_dec = msgspec.msgpack.Decoder(_Hello)
_challenge_dec = msgspec.msgpack.Decoder(_Challenge)
_auth_dec = msgspec.msgpack.Decoder(_Auth)


class ControlConfig(msgspec.Struct, forbid_unknown_fields=True):
    """[control] settings (schema types checked by msgspec when a file, JSON or flag sets them)."""

    host: str = "127.0.0.1"
    port: Port | None = None  # None: VLLM_P2P_SIDE_CHANNEL_PORT (5710) + dp_index; 0: any free port
    dp_index: DPIndex = 0
    heartbeat_interval_s: Pos = 1.0
    heartbeat_liveness: PosInt = 3
    reconnect_min_s: Pos = 0.1
    reconnect_max_s: Pos = 5.0
    secret: str | None = None  # None: $P2PWORKER_SECRET (code may also pass bytes)
    auth: bool = True  # False only on purpose: logs a warning
    hwm: PosInt = 1000  # per-socket queue bound, messages
    # larger frames make ZMQ drop the sender's connection; a frame must hold MAX_MSG_KEYS keys (limits.py)
    max_frame_bytes: Annotated[int, Meta(ge=MAX_FRAME_BYTES, le=64 * MAX_FRAME_BYTES)] = MAX_FRAME_BYTES
    max_pending_auth: PosInt = 256  # inbound handshakes in progress at once
    max_batch: PosInt = 1000  # frames taken per socket per poll
    # where peers reach us when that is not the bound host (a wildcard bind, NAT, a pod): None -> the bound host,
    # or for a wildcard bind $POD_IP, else this machine's host name resolved
    advertise_host: str | None = None

    @property
    def deadline_s(self) -> float:
        return self.heartbeat_interval_s * self.heartbeat_liveness


_WILDCARDS = ("0.0.0.0", "::", "[::]", "*", "")


def advertised(bound: str, advertise_host: str | None, env=os.environ) -> str:
    """The address peers should dial for a socket bound at ``bound`` (tcp://host:port): ``advertise_host`` if
    set; the bound host unless it is a wildcard (peers cannot dial 0.0.0.0); else $POD_IP (Kubernetes' downward
    API), else this machine's host name resolved."""
    host, _, port = bound.removeprefix("tcp://").rpartition(":")
    if advertise_host:
        host = advertise_host
    elif host in _WILDCARDS:
        host = env.get("POD_IP") or _own_address()
    return f"tcp://{f'[{host}]' if ':' in host and not host.startswith('[') else host}:{port}"


def _own_address() -> str:
    name = socket.gethostname()
    try:
        return socket.gethostbyname(name)
    except OSError:
        return name  # peers resolve it themselves (libzmq resolves names on every connect)


class Act(enum.Enum):
    """What a received control frame does (the value of DEALER_MOVES / ROUTER_MOVES)."""

    DELIVER = "deliver"  # DATA on an UP link: hand the payload up (Received)
    KEEPALIVE = "keepalive"  # PING: nothing beyond counting as traffic
    CHALLENGE = "challenge"  # check the acceptor's proof, answer AUTH: CONNECTING -> AUTHING
    WELCOME = "welcome"  # AUTHING -> UP
    REJECTED = "rejected"  # the peer refused us for good: FAILED, no retry
    RESET = "reset"  # the peer does not know this link (it restarted?): DOWN, reconnect
    BYE = "bye"  # the peer closed the link: DOWN (an outbound link reconnects)
    HELLO = "hello"  # a new inbound handshake for this routing id: CHALLENGED (any old link is dropped)
    AUTH = "auth"  # check the initiator's proof: CHALLENGED -> UP, or REJECT
    MALFORMED = "malformed"  # not allowed here: counted, dropped
    UNAUTHENTICATED = "unauthenticated"  # from an identity that is not UP: counted, answered with RESET


ANY = None  # DEALER_MOVES: a frame allowed in every state of the outbound link

# Outbound links (our DEALER): (link state, or ANY, frame kind) -> Act; the exact state first, then ANY; not
# listed: MALFORMED.  Nothing but the handshake before UP: DATA is delivered only on an UP link.
DEALER_MOVES: dict[tuple[LinkState | None, bytes], Act] = {
    (LinkState.UP, K_DATA): Act.DELIVER,
    (LinkState.CONNECTING, K_CHALLENGE): Act.CHALLENGE,
    (LinkState.AUTHING, K_WELCOME): Act.WELCOME,
    (ANY, K_PING): Act.KEEPALIVE,
    (ANY, K_REJECT): Act.REJECTED,
    (ANY, K_RESET): Act.RESET,
    (ANY, K_BYE): Act.BYE,
}

# Inbound links (our ROUTER): (state of the link this routing id has, None for none yet, frame kind) -> Act; not
# listed: MALFORMED on an UP link, else UNAUTHENTICATED.  An inbound link is only ever CHALLENGED or UP.
ROUTER_MOVES: dict[tuple[LinkState | None, bytes], Act] = {
    (LinkState.UP, K_DATA): Act.DELIVER,
    (LinkState.UP, K_PING): Act.KEEPALIVE,
    (LinkState.UP, K_BYE): Act.BYE,
    (None, K_HELLO): Act.HELLO,
    (LinkState.CHALLENGED, K_HELLO): Act.HELLO,
    (LinkState.CHALLENGED, K_AUTH): Act.AUTH,
}


class Wire(enum.Enum):
    """How far the TCP connection under an outbound link's current DEALER got, per its socket monitor."""

    DIALING = "dialing"  # TCP connect in progress (libzmq retries it on its own until we close the DEALER)
    TCP = "tcp"  # TCP connected; no ZMTP greeting from the peer yet
    ZMTP = "zmtp"  # libzmq's ZMTP handshake done: only our HELLO / CHALLENGE / AUTH / WELCOME remains


# Socket-monitor events of an outbound link's DEALER before UP: (wire, or ANY, event) -> the wire it moves to, or
# the cause of taking the link DOWN at once; the exact wire first, then ANY; not listed: ignored.  libzmq's
# sequences (4.3): refused:  CONNECT_RETRIED with no CONNECTED before it;  TCP accepted, then garbage or a hang-up:
# CONNECTED, HANDSHAKE_FAILED_NO_DETAIL (errno), DISCONNECTED, CONNECT_RETRIED;  a ZMTP peer: CONNECTED,
# HANDSHAKE_SUCCEEDED.  A CONNECT_RETRIED after a CONNECTED follows a drop, which already took the link down.
MONITOR_MOVES: dict[tuple[Wire | None, zmq.Event], Wire | DownCause] = {
    (ANY, zmq.Event.CONNECTED): Wire.TCP,
    (ANY, zmq.Event.HANDSHAKE_SUCCEEDED): Wire.ZMTP,
    (Wire.DIALING, zmq.Event.CONNECT_RETRIED): DownCause.REFUSED,
    (ANY, zmq.Event.HANDSHAKE_FAILED_NO_DETAIL): DownCause.HANDSHAKE_FAILED,  # hung up / reset in the greeting
    (ANY, zmq.Event.HANDSHAKE_FAILED_PROTOCOL): DownCause.HANDSHAKE_FAILED,  # a greeting that is not ZMTP 3
    (Wire.TCP, zmq.Event.DISCONNECTED): DownCause.HANDSHAKE_FAILED,  # (libzmq says HANDSHAKE_FAILED first)
    (Wire.ZMTP, zmq.Event.DISCONNECTED): DownCause.HANDSHAKE_DROPPED,
}
# the events the monitor subscribes to: only those the table reads (CONNECT_DELAYED, "connect in progress", is not
# a failure and would only wake the loop)
MONITOR_EVENTS: int = functools.reduce(operator.or_, (int(ev) for _, ev in MONITOR_MOVES))

# counters[...] += 1 for each failure of that cause (each attempt, not each report)
CAUSE_COUNTERS: dict[DownCause, str] = {
    DownCause.REFUSED: "connect_refused",
    DownCause.HANDSHAKE_FAILED: "handshake_failed",
    DownCause.HANDSHAKE_DROPPED: "handshake_dropped",
}

# what the LinkDown reason says after "<cause>: <address>: "
_CAUSE_DETAIL: dict[DownCause, str] = {
    DownCause.REFUSED: "nothing accepts TCP connections there (or there is no route to it)",
    DownCause.HANDSHAKE_FAILED: "it accepted TCP but does not speak ZMTP (not a p2pworker control port?)",
    DownCause.HANDSHAKE_DROPPED: "it closed the connection before our handshake completed",
}

_WARNED_MAX = 1024  # (address, cause) pairs remembered for log-once; the oldest is forgotten beyond


def monitor_move(wire: Wire, event: zmq.Event) -> Wire | DownCause | None:
    return MONITOR_MOVES.get((wire, event)) or MONITOR_MOVES.get((ANY, event))


def dealer_move(state: LinkState, kind: bytes) -> Act:
    return DEALER_MOVES.get((state, kind)) or DEALER_MOVES.get((ANY, kind)) or Act.MALFORMED


def router_move(state: LinkState | None, kind: bytes) -> Act:
    return ROUTER_MOVES.get((state, kind)) or (Act.MALFORMED if state is LinkState.UP else Act.UNAUTHENTICATED)


@dataclass(eq=False)
class Link:
    link_id: str
    outbound: bool
    address: str
    state: LinkState
    node_id: str = ""
    sock: zmq.Socket | None = None
    monitor: zmq.Socket | None = None  # outbound, before UP: sock's socket monitor (closed with sock, or at UP)
    wire: Wire = Wire.DIALING  # outbound: how far sock's TCP connection got (from the monitor)
    ident: bytes = b""
    nonce: bytes = b""
    peer_nonce: bytes = b""
    last_recv: float = 0.0
    last_send: float = 0.0
    deadline: float = 0.0
    queued: deque = field(default_factory=deque)
    backoff_s: float = 0.0
    next_attempt: float = 0.0
    incarnation: int = 0
    reported_down: bool = False
    reason: str = ""
    cause: DownCause = DownCause.OTHER


def _normalize(address: str, resolve: bool = True) -> tuple[str, str, int]:
    addr = address[len("tcp://") :] if address.startswith("tcp://") else address
    host, sep, port_s = addr.rpartition(":")
    if not sep or not host or not port_s.isdigit():
        raise PeerUnreachable(f"bad control address {address!r}: expected host:port")
    host = host.strip("[]")
    port = int(port_s)
    if not resolve:  # the caller checked the name off its loop; libzmq resolves it again on each (re)connect
        return f"tcp://{host}:{port}", host, port
    try:
        socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise PeerUnreachable(f"cannot resolve control host {host!r} of {address!r}: {e}") from e
    return f"tcp://{host}:{port}", host, port


class ZmqControl(ControlTransport):
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
        self._closed = False
        self._warned: OrderedDict[tuple[str, DownCause], None] = OrderedDict()  # dial failures logged (log once)
        self.counters = {
            "frames_in": 0,
            "frames_out": 0,
            "unauthenticated_frames": 0,
            "malformed_frames": 0,
            "rejected_handshakes": 0,
            "links_down": 0,
            **{name: 0 for name in CAUSE_COUNTERS.values()},
        }

    # ------------------------------------------------------------ auth
    def _proof(self, role: bytes, cn: bytes, sn: bytes, client: str, server: str) -> bytes:
        if not self.config.auth:
            return b""
        msg = b"p2pw-ctl-v1|" + role + b"|" + cn + sn + client.encode() + b"|" + server.encode()
        return hmac.new(self._secret, msg, hashlib.sha256).digest()

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
        """Every socket to watch for POLLIN (for an outer poll loop): the router, each DEALER and, before its link
        is UP, the DEALER's socket monitor."""
        return [self._router] + [s for lk in self._links.values() for s in (lk.sock, lk.monitor) if s is not None]

    def quiet(self, readable) -> bool:
        """Nothing for ``poll(0)`` to do, given ``readable``, what an outer poll over :meth:`sockets` just found
        readable: none of ours, no event queued, no tick due.  O(readable), not O(links)."""
        if self._closed or self._events or self._clock() >= self._next_tick:
            return False
        return not any(sock is self._router or sock in self._by_sock for sock in readable)

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
        if not ready and clock() < self._next_tick:
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
            if e.errno == errno.EHOSTUNREACH:
                self._down(link, "peer connection gone", retry=link.outbound)
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

    # ------------------------------------------------------------ outbound links
    def _open(self, link: Link) -> None:
        link.incarnation += 1
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, self.config.hwm)
        sock.setsockopt(zmq.RCVHWM, self.config.hwm)
        sock.setsockopt(zmq.MAXMSGSIZE, self.config.max_frame_bytes)
        sock.setsockopt(zmq.ROUTING_ID, f"{self.node_id}#{link.link_id}#{link.incarnation}".encode())
        monitor = None
        try:
            # before connect(): the monitor sees the dial from its first event on
            monitor = sock.get_monitor_socket(MONITOR_EVENTS)
            sock.connect(link.address)
        except zmq.ZMQError:
            # not yet ours to track (no link holds them): close both here or they leak, one pair per failed dial
            if monitor is not None:
                sock.disable_monitor()
                monitor.close(linger=0)
            sock.close(linger=0)
            raise
        link.sock, link.monitor, link.wire = sock, monitor, Wire.DIALING
        for s in (sock, monitor):  # the DEALER first: poll() drains it before its monitor
            self._poller.register(s, zmq.POLLIN)
            self._by_sock[s] = link
        self.sockets_epoch += 1
        link.nonce = secrets.token_bytes(16)
        link.state = LinkState.CONNECTING
        link.deadline = self._clock() + self.config.deadline_s
        self._send_quiet(link, K_HELLO, _enc.encode(_Hello(CONTROL_VERSION, self.node_id, link.nonce)))

    def _unwatch(self, link: Link) -> None:
        """Close ``link``'s socket monitor (at UP, or with its DEALER)."""
        monitor = link.monitor
        if monitor is None:
            return
        link.monitor = None
        # libzmq's side first: it sends events with a blocking send from its I/O thread, and a PAIR whose peer is
        # closed never takes one; stopping also unbinds the inproc address
        link.sock.disable_monitor()
        self._poller.unregister(monitor)
        self._by_sock.pop(monitor, None)
        self.sockets_epoch += 1
        monitor.close(linger=0)

    def _close_sock(self, link: Link) -> None:
        self._unwatch(link)
        if link.sock is not None:
            self._poller.unregister(link.sock)
            self._by_sock.pop(link.sock, None)
            self.sockets_epoch += 1
            link.sock.close(linger=0)
            link.sock = None

    def _drop(self, link: Link) -> None:
        self._close_sock(link)
        if not link.outbound:
            self._inbound.pop(link.ident, None)

    def _retry_later(self, link: Link) -> None:
        """The next dial of a DOWN outbound link after its backoff, which doubles up to reconnect_max_s."""
        link.next_attempt = self._clock() + link.backoff_s
        link.backoff_s = min(link.backoff_s * 2, self.config.reconnect_max_s)

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
                self._retry_later(link)
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

    def _dial_failed(self, link: Link, cause: DownCause, detail: str = "") -> None:
        """The monitor (or the deadline, for a silent TCP peer) says this dial cannot work: DOWN now, retried
        after the link's backoff like any other DOWN; counted each time, logged once per address and cause."""
        self.counters[CAUSE_COUNTERS[cause]] += 1
        reason = f"{cause.value}: {link.address}: {detail or _CAUSE_DETAIL[cause]}"
        key = (link.address, cause)
        if key not in self._warned:
            self._warned[key] = None
            if len(self._warned) > _WARNED_MAX:
                self._warned.popitem(last=False)
            log.warning("control link %s: %s (retrying with backoff up to %.1f s; logged once per address)",
                        link.link_id, reason, self.config.reconnect_max_s)
        self._down(link, reason, retry=True, cause=cause)

    def _drain_monitor(self, link: Link) -> None:
        monitor = link.monitor
        if monitor is None:
            return
        for _ in range(self.config.max_batch):
            if link.monitor is not monitor:  # the link came up or went down meanwhile: its monitor is closed
                return
            try:
                event = recv_monitor_message(monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            move = monitor_move(link.wire, event["event"])
            if isinstance(move, Wire):
                link.wire = move
            elif isinstance(move, DownCause):
                # what the DEALER already holds first: a REJECT before the hang-up is the truer reason
                self._drain_dealer(link)
                if link.monitor is monitor and link.state in (LinkState.CONNECTING, LinkState.AUTHING):
                    err = int(event["value"])
                    detail = _CAUSE_DETAIL[move]
                    if move is DownCause.HANDSHAKE_FAILED and err:  # NO_DETAIL / PROTOCOL carry an errno
                        detail += f" ({os.strerror(err)})"
                    self._dial_failed(link, move, detail)

    def _up(self, link: Link) -> None:
        if link.outbound:
            self._unwatch(link)  # heartbeats watch an UP link: libzmq reconnecting under it is no failure
            for cause in CAUSE_COUNTERS:  # it works now: a later failure there is news again
                self._warned.pop((link.address, cause), None)
        link.state = LinkState.UP
        link.reported_down = False
        link.reason = ""
        link.cause = DownCause.OTHER
        link.backoff_s = self.config.reconnect_min_s
        link.last_recv = self._clock()
        self._events.append(LinkUp(link.link_id, link.node_id, link.outbound, link.address))
        while link.queued and link.state is LinkState.UP:
            self._send_quiet(link, K_DATA, link.queued.popleft())

    def _drain_dealer(self, link: Link) -> None:
        for _ in range(self.config.max_batch):
            if link.sock is None:
                return
            try:
                frames = link.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self.counters["frames_in"] += 1
            if len(frames) != 2:
                self.counters["malformed_frames"] += 1
                continue
            kind, body = frames
            if link.state is LinkState.UP:
                link.last_recv = self._clock()
            self._on_dealer_frame(link, dealer_move(link.state, kind), body)

    def _on_dealer_frame(self, link: Link, act: Act, body: bytes) -> None:
        """One well-formed frame on an outbound link, as :func:`dealer_move` classed it."""
        match act:
            case Act.DELIVER:
                self._events.append(Received(link.link_id, body))
            case Act.KEEPALIVE:
                pass
            case Act.CHALLENGE:
                self._on_challenge(link, body)
            case Act.WELCOME:
                self._up(link)
            case Act.REJECTED:
                self.counters["rejected_handshakes"] += 1
                self._down(link, f"rejected by {link.address}: {body.decode(errors='replace')}", retry=False)
            case Act.RESET:
                self._down(link, f"{link.address} no longer knows this link (it restarted?)", retry=True)
            case Act.BYE:
                self._down(link, "peer closed the link", retry=True)
            case _:
                self.counters["malformed_frames"] += 1

    def _on_challenge(self, link: Link, body: bytes) -> None:
        try:
            ch = _challenge_dec.decode(body)
        except (msgspec.MsgspecError, UnicodeDecodeError):
            self.counters["malformed_frames"] += 1
            return
        expect = self._proof(b"server", link.nonce, ch.nonce, self.node_id, ch.node_id)
        if not hmac.compare_digest(expect, ch.proof):
            self.counters["rejected_handshakes"] += 1
            self._down(link, f"{link.address} failed to prove the shared secret", retry=False)
            return
        link.node_id = ch.node_id
        link.peer_nonce = ch.nonce
        link.state = LinkState.AUTHING
        proof = self._proof(b"client", link.nonce, ch.nonce, self.node_id, ch.node_id)
        self._send_quiet(link, K_AUTH, _enc.encode(_Auth(proof)))

    # ------------------------------------------------------------ inbound links
    def _drain_router(self) -> None:
        for _ in range(self.config.max_batch):
            try:
                frames = self._router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self.counters["frames_in"] += 1
            if len(frames) != 3:
                self.counters["malformed_frames"] += 1
                continue
            ident, kind, body = frames
            link = self._inbound.get(ident)
            state = link.state if link is not None else None
            if state is LinkState.UP:
                link.last_recv = self._clock()
            match router_move(state, kind):
                case Act.DELIVER:
                    self._events.append(Received(link.link_id, body))
                case Act.KEEPALIVE:
                    pass
                case Act.BYE:
                    self._down(link, "peer closed the link", retry=False)
                case Act.HELLO:
                    self._on_hello(ident, body, link)
                case Act.AUTH:
                    self._on_auth(link, body)
                case Act.MALFORMED:
                    self.counters["malformed_frames"] += 1
                case _:
                    self.counters["unauthenticated_frames"] += 1
                    self._router_reply(ident, K_RESET, b"")

    def _on_hello(self, ident: bytes, body: bytes, old: Link | None) -> None:
        try:
            hello = _hello_dec.decode(body)
        except (msgspec.MsgspecError, UnicodeDecodeError):
            self.counters["malformed_frames"] += 1
            self._router_reply(ident, K_REJECT, b"malformed hello")
            return
        if hello.version != CONTROL_VERSION:
            self.counters["rejected_handshakes"] += 1
            self._router_reply(
                ident, K_REJECT, f"control protocol version {hello.version}, expected {CONTROL_VERSION}".encode()
            )
            return
        if old is not None:
            self._links.pop(old.link_id, None)
            self._drop(old)
        pending = [lk for lk in self._inbound.values() if lk.state is LinkState.CHALLENGED]
        if len(pending) >= self.config.max_pending_auth:
            oldest = min(pending, key=lambda lk: lk.deadline)
            self._links.pop(oldest.link_id, None)
            self._drop(oldest)
        self._seq += 1
        now = self._clock()
        link = Link(
            f"in-{self._seq}", False, "", LinkState.CHALLENGED, node_id=hello.node_id, ident=ident,
            nonce=secrets.token_bytes(16), peer_nonce=hello.nonce, deadline=now + self.config.deadline_s,
            last_recv=now,
        )
        self._inbound[ident] = link
        self._links[link.link_id] = link
        proof = self._proof(b"server", hello.nonce, link.nonce, hello.node_id, self.node_id)
        self._send_quiet(link, K_CHALLENGE, _enc.encode(_Challenge(self.node_id, link.nonce, proof)))

    def _on_auth(self, link: Link, body: bytes) -> None:
        try:
            proof = _auth_dec.decode(body).proof
        except (msgspec.MsgspecError, UnicodeDecodeError):
            proof = None
        expect = self._proof(b"client", link.peer_nonce, link.nonce, link.node_id, self.node_id)
        if proof is None or not hmac.compare_digest(expect, proof):
            self.counters["rejected_handshakes"] += 1
            log.warning("rejected control peer %r: it failed to prove the shared secret", link.node_id)
            self._router_reply(link.ident, K_REJECT, b"authentication failed")
            self._links.pop(link.link_id, None)
            self._drop(link)
            return
        self._send_quiet(link, K_WELCOME, b"")
        if link.state is LinkState.CHALLENGED:  # the welcome can find the peer gone: then it never was up
            self._up(link)

    # ------------------------------------------------------------ timers
    def _on_deadline(self, link: Link) -> None:
        """An outbound handshake ran past its deadline: say how far it got."""
        st, d = link.state, self.config.deadline_s
        self._drain_monitor(link)  # how far the wire got, up to now (a failure event takes the link down here)
        if link.state is not st:
            return
        if link.wire is Wire.TCP:  # a peer's libzmq answers the greeting on its own I/O thread: not our kind there
            self._dial_failed(link, DownCause.HANDSHAKE_FAILED,
                              f"it accepted TCP but sent no ZMTP greeting within {d:.1f} s "
                              f"(not a p2pworker control port, or a stopped process)")
        else:
            self._down(link, f"no answer from {link.address} within {d:.1f} s", retry=True)

    def _tick(self) -> None:
        cfg = self.config
        now = self._clock()
        self._next_tick = now + self._tick_s
        for link in list(self._links.values()):
            st = link.state
            if st is LinkState.UP:
                silent = now - link.last_recv
                if silent > cfg.deadline_s:
                    self._down(link, f"heartbeat lost: silent for {silent:.1f} s", retry=link.outbound)
                elif now - link.last_send >= cfg.heartbeat_interval_s:
                    self._send_quiet(link, K_PING, b"")
            elif st in (LinkState.CONNECTING, LinkState.AUTHING):
                if now >= link.deadline:
                    self._on_deadline(link)
            elif st is LinkState.CHALLENGED:
                if now >= link.deadline:
                    self._links.pop(link.link_id, None)
                    self._drop(link)
            elif st is LinkState.DOWN and link.outbound and now >= link.next_attempt:
                try:
                    self._open(link)
                except zmq.ZMQError as e:  # e.g. out of file descriptors: the link stays DOWN, tried after its backoff
                    self._retry_later(link)
                    log.warning("control link %s: cannot dial %s again: %s", link.link_id, link.address, e)
