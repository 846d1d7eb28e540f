"""Error types shared across p2pworker.  Errors carry what the caller needs."""

from __future__ import annotations


class P2PError(Exception):
    """Base class of every error p2pworker raises on purpose."""


class RegionError(P2PError):
    """A KV region cannot be created, attached or validated."""


class RegionGeometryError(RegionError):
    """The files behind a region do not match the geometry asked for."""


class RegionIdentityError(RegionError):
    """A path opens another file than the one a peer mapped (another mount namespace, a re-created file)."""


class RingError(P2PError):
    """A shared-memory ring is unusable (bad layout, role taken, closed)."""


class MessageTooLarge(RingError, ValueError):
    """A message exceeds a ring's hard limit (``max_message_bytes``; messages may span slots up to it)."""

    def __init__(self, nbytes: int, capacity: int, ring: str):
        super().__init__(
            f"message of {nbytes} bytes exceeds the hard limit of ring {ring!r} "
            f"(max_message_bytes={capacity}; p2pworker.limits documents it)"
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


class TransferFailed(P2PError):
    """A data-plane transfer could not be submitted or did not complete."""

    def __init__(self, message: str, transfer_id: int | None = None):
        super().__init__(message)
        self.transfer_id = transfer_id


class PeerUnusable(TransferFailed):
    """The data plane cannot read from this peer at all (found at the first read from a peer that dialed us): the
    session is closed, as when the peer is refused when it is added."""


class DataPlaneUnavailable(P2PError):
    """The configured data-plane backend cannot run here (library missing, backend not created,
    region not registered); the message names the cause and the remedy."""


class FingerprintMismatch(P2PError):
    """Two peers disagree on fields that must match (geometry, model/layout, protocol)."""

    def __init__(self, diffs: dict[str, tuple[object, object]]):
        parts = ", ".join(f"{k}: local={a!r} remote={b!r}" for k, (a, b) in sorted(diffs.items()))
        super().__init__(f"config fingerprint mismatch ({parts})")
        self.diffs = diffs


class RingApiMismatch(P2PError):
    """The adapter and its worker are different p2pworker releases that disagree on the rings' commands and events
    (api.RING_API): a configuration error, restarting the same worker does not heal it."""

    def __init__(self, message: str, theirs: int, ours: int):
        super().__init__(message)
        self.theirs, self.ours = theirs, ours


class AuthError(P2PError):
    """A peer failed to prove it holds the shared secret."""


class PeerUnreachable(P2PError):
    """A peer address cannot be resolved or did not answer within the deadline."""


class PeerLost(P2PError):
    """A control link is down or unknown; what was sent on it is not delivered."""


class Backpressure(P2PError):
    """A bounded queue is full (ZMQ high-water mark); the caller must retry later or fail the work."""


class ProtocolError(P2PError):
    """A session protocol rule was broken."""


class RemoteProtocolError(ProtocolError):
    """The peer sent something invalid: the session that received it is closed, nothing else."""


class LocalProtocolError(ProtocolError):
    """We misused the protocol (a bug on our side, e.g. a duplicate job id)."""
