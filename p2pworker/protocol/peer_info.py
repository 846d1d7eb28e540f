"""``PeerDataInfo``: what a peer needs to read rows out of our region (a wire type: it travels in Hello/HelloAck).

It lives with the other wire types, so the message module does not import the data plane; the data plane
builds it (``DataTransport.local_info``) and reads it (``add_peer``).
"""

from __future__ import annotations

import msgspec


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
