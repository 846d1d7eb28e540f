"""The ZMQ control transport's wire vocabulary: frame kinds, handshake bodies, and the tables that say what a
received frame (DEALER_MOVES, ROUTER_MOVES) or a socket-monitor event (MONITOR_MOVES) does.  No I/O; the transport
(zmq_control.py) applies them, and the tests read them."""

from __future__ import annotations

import enum
import functools
import hashlib
import hmac
import operator
import socket
from collections import deque
from dataclasses import dataclass, field

import msgspec
import zmq

from p2pworker.control.base import DownCause, LinkState
from p2pworker.errors import PeerUnreachable

CONTROL_VERSION = 1

K_HELLO, K_CHALLENGE, K_AUTH, K_WELCOME = b"H", b"C", b"U", b"K"
K_REJECT, K_RESET, K_PING, K_DATA, K_BYE = b"X", b"R", b"P", b"D", b"B"

_EMPTY: tuple = ()


class HandshakeHello(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    version: int
    node_id: str
    nonce: bytes


class HandshakeChallenge(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    node_id: str
    nonce: bytes
    proof: bytes


class HandshakeAuth(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    proof: bytes


def handshake_proof(secret: bytes, role: bytes, cn: bytes, sn: bytes, client: str, server: str) -> bytes:
    """HMAC-SHA256 over both nonces and both node ids, bound to the prover's ``role`` (b"client"/b"server") so one
    side's proof cannot be replayed as the other's.  Empty with authentication off (``secret`` empty): an empty
    proof matches an empty expectation, so a caller with authentication on must have refused an empty secret first
    (``ZmqControl`` does, at construction)."""
    if not secret:
        return b""
    msg = b"p2pw-ctl-v1|" + role + b"|" + cn + sn + client.encode() + b"|" + server.encode()
    return hmac.new(secret, msg, hashlib.sha256).digest()


_enc = msgspec.msgpack.Encoder()
_hello_dec = msgspec.msgpack.Decoder(HandshakeHello)
_challenge_dec = msgspec.msgpack.Decoder(HandshakeChallenge)
_auth_dec = msgspec.msgpack.Decoder(HandshakeAuth)


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
    UP = "up"  # our handshake done too: the link is UP, and the end of its TCP connection is the peer gone


# Socket-monitor events of an outbound link's DEALER before UP: (wire, or ANY, event) -> the wire it moves to, or
# the cause of taking the link DOWN at once; the exact wire first, then ANY; not listed: ignored.  libzmq's
# sequences (4.3): refused:  CONNECT_RETRIED with no CONNECTED before it;  TCP accepted, then garbage or a hang-up:
# CONNECTED, HANDSHAKE_FAILED_NO_DETAIL (errno), DISCONNECTED, CONNECT_RETRIED;  a ZMTP peer: CONNECTED,
# HANDSHAKE_SUCCEEDED.  A CONNECT_RETRIED after a CONNECTED follows a drop, which already took the link down.
# Once the link is UP (Wire.UP), a DISCONNECTED is the peer's process gone (the kernel closed its socket: it exited,
# was killed, or restarted) or a reset on the path: DOWN at once, not after 3 s of heartbeat silence while libzmq
# redials under the link.  A peer that is only silent (stopped, a cut path) sends no FIN: heartbeats still judge it.
MONITOR_MOVES: dict[tuple[Wire | None, zmq.Event], Wire | DownCause] = {
    (ANY, zmq.Event.CONNECTED): Wire.TCP,
    (ANY, zmq.Event.HANDSHAKE_SUCCEEDED): Wire.ZMTP,
    (Wire.DIALING, zmq.Event.CONNECT_RETRIED): DownCause.REFUSED,
    (ANY, zmq.Event.HANDSHAKE_FAILED_NO_DETAIL): DownCause.HANDSHAKE_FAILED,  # hung up / reset in the greeting
    (ANY, zmq.Event.HANDSHAKE_FAILED_PROTOCOL): DownCause.HANDSHAKE_FAILED,  # a greeting that is not ZMTP 3
    (Wire.TCP, zmq.Event.DISCONNECTED): DownCause.HANDSHAKE_FAILED,  # (libzmq says HANDSHAKE_FAILED first)
    (Wire.ZMTP, zmq.Event.DISCONNECTED): DownCause.HANDSHAKE_DROPPED,
    (Wire.UP, zmq.Event.DISCONNECTED): DownCause.CLOSED,
}
# the events the monitor subscribes to: only those the table reads (CONNECT_DELAYED, "connect in progress", is not
# a failure and would only wake the loop)
MONITOR_EVENTS: int = functools.reduce(operator.or_, (int(ev) for _, ev in MONITOR_MOVES))

# counters[...] += 1 for each failure of that cause (each attempt, not each report)
CAUSE_COUNTERS: dict[DownCause, str] = {
    DownCause.REFUSED: "connect_refused",
    DownCause.HANDSHAKE_FAILED: "handshake_failed",
    DownCause.HANDSHAKE_DROPPED: "handshake_dropped",
    DownCause.CLOSED: "connection_closed",
}

# what the LinkDown reason says after "<cause>: <address>: "
_CAUSE_DETAIL: dict[DownCause, str] = {
    DownCause.REFUSED: "nothing accepts TCP connections there (or there is no route to it)",
    DownCause.HANDSHAKE_FAILED: "it accepted TCP but does not speak ZMTP (not a p2pworker control port?)",
    DownCause.HANDSHAKE_DROPPED: "it closed the connection before our handshake completed",
    DownCause.CLOSED: "the peer's process exited or restarted (or the path reset the connection)",
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
    monitor: zmq.Socket | None = None  # outbound: sock's socket monitor (closed with sock)
    wire: Wire = Wire.DIALING  # outbound: how far sock's TCP connection got (from the monitor)
    ident: bytes = b""
    nonce: bytes = b""
    peer_nonce: bytes = b""
    last_recv: float = 0.0  # run clock (liveness.py): when we last heard the peer, any frame
    last_send: float = 0.0  # wall clock: pings go out one interval after our last frame, stalls or not
    deadline: float = 0.0  # run clock: the end of a handshake (CONNECTING, AUTHING, CHALLENGED)
    queued: deque = field(default_factory=deque)
    backoff_s: float = 0.0
    next_attempt: float = 0.0
    up_at: float = 0.0  # wall clock: when it last came UP (a link that drops soon after keeps its backoff)
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
