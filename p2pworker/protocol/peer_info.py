"""``PeerDataInfo``: what a peer needs to read rows out of our region (a wire type: it travels in Hello/HelloAck).

It lives with the other wire types, so the message module does not import the data plane; the data plane
builds it (``DataTransport.local_info``) and reads it (``add_peer``).
"""

from __future__ import annotations

import msgspec


class RegionFile(msgspec.Struct, frozen=True, forbid_unknown_fields=True, array_like=True):
    """One segment file of a region as its owner mapped it: the path in the owner's mount namespace and what the
    file is (``st_dev``, ``st_ino``), so a peer can tell whether the same path opens the same file for it."""

    path: str
    dev: int
    ino: int
    nbytes: int
    file_offset: int = 0


class SameHostInfo(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What a peer on the same host needs to copy rows straight out of our region file, and to prove it is one:
    the kernel's boot id, the region's files, and where our worker hands their descriptors over (an abstract
    AF_UNIX name, and the token it asks for: sent only over the authenticated control channel).  The peer learns
    our pid from the kernel during the handover, never from us.  Checked by ``p2pworker.data.samehost``."""

    boot_id: str
    socket: str
    token: bytes
    files: tuple[RegionFile, ...]
    data_offset: int = 0
    net_ns: tuple[int, int] = (0, 0)  # (st_dev, st_ino) of /proc/self/ns/net: where ``socket`` is bound


class PeerDataInfo(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What a peer needs to read rows out of our region; sent over the authenticated control channel."""

    backend: str  # "nixl" or "zmq"
    agent_name: str
    base_address: int
    num_blocks: int
    block_bytes: int
    metadata: bytes = b""  # NIXL agent metadata
    endpoint: str = ""  # fallback: the data socket address
    token: bytes = b""  # fallback: a per-process read token; only peers told it may read
    same_host: SameHostInfo | None = None  # offered unless [data] same_host = false
