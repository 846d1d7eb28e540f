"""The control transport interface: authenticated links between workers, bytes in and out.

The session layer sees only this: links that come up (with the peer's node id
proven by the shared secret), payloads that arrive on them, and links that go
down (heartbeat lost, unreachable, rejected), each reported once.
"""

from __future__ import annotations

import abc
import os
from typing import NamedTuple, Union

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


class LinkDown(NamedTuple):
    link: str
    node_id: str
    reason: str


ControlEvent = Union[Received, LinkUp, LinkDown]


class ControlTransport(abc.ABC):
    node_id: str
    address: str  # where peers reach us, e.g. tcp://127.0.0.1:5710

    @abc.abstractmethod
    def connect(self, address: str) -> str:
        """Start an outbound link to ``address`` (host:port or tcp://host:port); returns its link id.

        Raises ``PeerUnreachable`` at once when the host does not resolve; an
        address nobody answers on is reported as ``LinkDown`` within the deadline.
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

    @abc.abstractmethod
    def disconnect(self, link: str) -> None:
        """Say bye and forget ``link``; no LinkDown is reported for it."""

    @abc.abstractmethod
    def close(self) -> None: ...
