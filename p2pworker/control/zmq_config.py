"""[control] settings of the ZMQ control transport, and the address a bound socket advertises to peers."""

from __future__ import annotations

import os
import socket
from typing import Annotated

import msgspec
from msgspec import Meta

from p2pworker.limits import MAX_FRAME_BYTES
from p2pworker.schema import DPIndex, Port, Pos, PosInt


class ControlConfig(msgspec.Struct, forbid_unknown_fields=True):
    """[control] settings (schema types checked by msgspec when a file, JSON or flag sets them)."""

    host: str = "127.0.0.1"
    port: Port | None = None  # None: VLLM_P2P_SIDE_CHANNEL_PORT (5710) + dp_index; 0: any free port
    dp_index: DPIndex = 0
    heartbeat_interval_s: Pos = 1.0
    heartbeat_liveness: PosInt = 3
    reconnect_min_s: Pos = 0.1
    # a DOWN link is redialled at most this far apart: a restarted peer is found within it of listening again (while
    # the worker keeps redialling: forget_down_s), and a dial nothing accepts costs one SYN and its reset
    reconnect_max_s: Pos = 1.0
    # an outbound link down this long after it was up, to an address the adapter did not ask to keep, is dropped:
    # a source gone for good (a scaled-down pod) is not redialled for ever; the next pull naming it dials afresh
    forget_down_s: Pos = 60.0
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
