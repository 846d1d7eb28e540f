"""The control transport interface: authenticated links between workers, bytes in and out.

The session layer sees only this: links that come up (with the peer's node id
proven by the shared secret), payloads that arrive on them, and links that go
down (heartbeat lost, unreachable, rejected), each reported once.
"""

from __future__ import annotations

import abc
import enum
import os
from typing import Any, NamedTuple, Protocol, Union

DEFAULT_PORT = 5710
PORT_ENV = "VLLM_P2P_SIDE_CHANNEL_PORT"
HOST_ENV = "VLLM_P2P_SIDE_CHANNEL_HOST"
SECRET_ENV = "P2PWORKER_SECRET"


def default_port(dp_index: int = 0) -> int:
    """vLLM's convention: base port from ``VLLM_P2P_SIDE_CHANNEL_PORT`` (5710) plus the DP index."""
    return int(os.environ.get(PORT_ENV, DEFAULT_PORT)) + dp_index


class Received(NamedTuple):
    link: str
    payload: bytes


class LinkUp(NamedTuple):
    link: str
    node_id: str  # the peer's node id, proven during the handshake
    outbound: bool  # True: we connected to it; False: it connected to us
    address: str


class DownCause(enum.Enum):
    """Why a link went down, where the transport can tell (``LinkDown.cause``, ``LinkInfo.cause``).  The value
    starts the reason string of the first four; each of them has a counter (the transport's ``counters``)."""

    REFUSED = "connection refused"  # the TCP connect failed: nothing listens at the address (or no route there)
    HANDSHAKE_FAILED = "handshake failed (protocol)"  # TCP accepted, but what answers is not our transport
    HANDSHAKE_DROPPED = "connection closed during the handshake"  # a peer of our kind hung up before the welcome
    CLOSED = "connection closed"  # an UP link's TCP connection ended: the peer's process exited (or a path reset)
    OTHER = "other"  # anything else: no answer, heartbeat lost, reset, bye, rejected (see the reason)


class LinkDown(NamedTuple):
    link: str
    node_id: str
    reason: str
    cause: DownCause = DownCause.OTHER


ControlEvent = Union[Received, LinkUp, LinkDown]


class LinkState(enum.Enum):
    CONNECTING = "connecting"  # outbound: hello sent
    AUTHING = "authing"  # outbound: our proof sent, waiting for the welcome
    CHALLENGED = "challenged"  # inbound: challenge sent, waiting for the peer's proof
    UP = "up"
    DOWN = "down"  # outbound: reconnects after a backoff; inbound: forgotten
    FAILED = "failed"  # outbound: refused for good (bad secret, other version)


class LinkInfo(Protocol):
    """What the worker may read of a link (the transport's own record)."""

    link_id: str
    outbound: bool
    address: str
    state: LinkState
    node_id: str
    reason: str  # why it went down or failed
    cause: DownCause  # the same, as a kind (OTHER while up)


class ControlTransport(abc.ABC):
    """What the worker needs of a control transport: links, payloads, events, and what its poll loop watches."""

    node_id: str
    address: str  # where peers reach us, e.g. tcp://127.0.0.1:5710
    counters: dict[str, int]  # frames in/out, handshakes refused, ... (``p2pworker inspect``)
    sockets_epoch: int  # bumped whenever sockets() changes: an outer poll loop rebuilds its poller only then

    @abc.abstractmethod
    def sockets(self) -> list[Any]:
        """Every socket (zmq socket or file descriptor) an outer poll loop should watch for POLLIN."""

    @abc.abstractmethod
    def link(self, link_id: str) -> LinkInfo | None:
        """The link's record, or None once the transport has forgotten it."""

    @abc.abstractmethod
    def connect(self, address: str) -> str:
        """Start an outbound link to ``address`` (host:port or tcp://host:port); returns its link id.

        Raises ``PeerUnreachable`` at once when the host does not resolve; an
        address that refuses the connection, or answers with something else than
        the control protocol, is reported as ``LinkDown`` at once (``cause``
        REFUSED / HANDSHAKE_FAILED); one that says nothing within the deadline.
        """

    @abc.abstractmethod
    def send(self, link: str, payload: bytes) -> None:
        """Queue ``payload`` on ``link`` (in order; held until the handshake completes).

        Raises ``PeerLost`` for a link that is down or unknown, ``Backpressure``
        when the link's bounded queue is full.
        """

    @abc.abstractmethod
    def poll(self, timeout_ms: int = 0) -> "tuple[ControlEvent, ...] | list[ControlEvent]":
        """What happened since the last call; waits up to ``timeout_ms`` for something."""

    def quiet(self, readable) -> bool:
        """True only when ``poll(0)`` would have nothing to do, given what an outer poll over the transport's
        sockets found readable.  Unsure is False (the default): the caller then polls."""
        return False

    @abc.abstractmethod
    def disconnect(self, link: str) -> None:
        """Say bye and forget ``link``; no LinkDown is reported for it."""

    @abc.abstractmethod
    def close(self) -> None: ...
