"""Error types shared across p2pworker.  Errors carry what the caller needs."""

from __future__ import annotations


class P2PError(Exception):
    """Base class of every error p2pworker raises on purpose."""


class RegionError(P2PError):
    """A KV region cannot be created, attached or validated."""


class RegionGeometryError(RegionError):
    """The files behind a region do not match the geometry asked for."""


class RingError(P2PError):
    """A shared-memory ring is unusable (bad layout, role taken, closed)."""


class MessageTooLarge(RingError, ValueError):
    """A message does not fit in one ring slot."""

    def __init__(self, nbytes: int, capacity: int, ring: str):
        super().__init__(
            f"message of {nbytes} bytes does not fit in a slot of ring {ring!r} "
            f"(capacity {capacity} bytes); raise slot_bytes or split the message"
        )
        self.nbytes = nbytes
        self.capacity = capacity


class PeerDead(RingError, ConnectionError):
    """The process on the other end of a ring exited, crashed or closed it."""

    def __init__(self, ring: str, role: str, pid: int, why: str):
        super().__init__(f"{role} of ring {ring!r} (pid {pid}) is gone: {why}")
        self.ring = ring
        self.role = role
        self.pid = pid
        self.why = why
