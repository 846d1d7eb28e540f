"""The data transport interface the session layer drives, and what all backends share.

A data transport moves whole KV rows from a peer's region into the local
region: the consumer PULLS (it READs the producer's rows into its own rows).
Pull, not push, because then the only process that ever writes a row of an
engine's region is that engine's own worker (invariant 7): a stalled peer
cannot land bytes in rows that vLLM already reused after the load was
reported, since we stop copying (ZMQ) or wait for our own reads to settle
(NIXL) before we report.

It never decides *what* to move: the session layer grants and binds rows; the
transport validates the rows against both geometries, coalesces them, posts
them in bounded pieces and reports each transfer exactly once, done or
failed, from :meth:`DataTransport.poll`.

Peers are keyed per control link (``peer_key``, e.g. ``"out-3"``), not per
peer id: a symmetric pair has two links between the same two workers and a
reconnect may overlap the old link, so several keys can name the same remote
agent at once.
"""

from __future__ import annotations

import abc
import enum
from dataclasses import dataclass, field

import numpy as np

from p2pworker.errors import TransferFailed
from p2pworker.protocol.peer_info import PeerDataInfo  # noqa: F401  (the wire type; re-exported for the backends)
from p2pworker.shm.region import KVRegion


class XferState(enum.Enum):
    """NIXL's string states (and our own), mapped at the edge."""

    PROC = "PROC"
    DONE = "DONE"
    ERR = "ERR"

    @classmethod
    def from_nixl(cls, s: str) -> "XferState":
        try:
            return cls(s)
        except ValueError:
            return cls.ERR


def coalesce(local_rows: np.ndarray, remote_rows: np.ndarray) -> np.ndarray:
    """Runs of rows contiguous on BOTH sides: an ``(n, 3)`` int64 array of
    ``(local_start, remote_start, count)``, in the given order."""
    lr = np.asarray(local_rows, dtype=np.int64)
    rr = np.asarray(remote_rows, dtype=np.int64)
    n = lr.size
    if n == 0:
        return np.empty((0, 3), dtype=np.int64)
    brk = np.empty(n, dtype=bool)
    brk[0] = True
    np.not_equal(lr[1:] - lr[:-1], 1, out=brk[1:])
    brk[1:] |= (rr[1:] - rr[:-1]) != 1
    starts = np.flatnonzero(brk)
    out = np.empty((starts.size, 3), dtype=np.int64)
    out[:, 0] = lr[starts]
    out[:, 1] = rr[starts]
    out[:-1, 2] = starts[1:] - starts[:-1]
    out[-1, 2] = n - starts[-1]
    return out


def split_runs(runs: np.ndarray, block_bytes: int, max_piece_bytes: int) -> list[np.ndarray]:
    """Cut runs into pieces of at most ``max_piece_bytes`` (at least one row each).

    One piece is one post: with NIXL's synchronous cma copies, the piece size
    bounds how long one post can stall the event loop.
    """
    max_rows = max(1, max_piece_bytes // block_bytes)
    if runs.size and int(runs[:, 2].sum()) <= max_rows:
        return [runs]  # the common case: one piece
    pieces: list[np.ndarray] = []
    cur: list[tuple[int, int, int]] = []
    cur_rows = 0
    for l0, r0, n in runs.tolist():
        while n > 0:
            take = min(n, max_rows - cur_rows)
            cur.append((l0, r0, take))
            cur_rows += take
            l0, r0, n = l0 + take, r0 + take, n - take
            if cur_rows == max_rows:
                pieces.append(np.array(cur, dtype=np.int64))
                cur, cur_rows = [], 0
    if cur:
        pieces.append(np.array(cur, dtype=np.int64))
    return pieces


# Up to this many rows given as lists (what the sessions post), plain Python checks and coalesces them: numpy's
# fixed cost per call (~3 us, a dozen calls) was most of read_blocks for a 64-row request (benchmarks/hops' profile).
SMALL_ROWS = 512


def rows_to_runs(local_rows, remote_rows, local_blocks: int, remote_blocks: int) -> tuple[np.ndarray, int]:
    """:func:`check_rows` then :func:`coalesce`: (runs, number of rows).  Same checks, messages and runs either
    way (tests/unit/test_data_helpers.py compares them)."""
    if type(local_rows) is list and type(remote_rows) is list and len(local_rows) <= SMALL_ROWS:
        n = len(local_rows)
        if n != len(remote_rows):
            raise TransferFailed(f"{n} local rows but {len(remote_rows)} remote rows")
        if n == 0:
            raise TransferFailed("no rows to transfer")
        lo, hi = min(local_rows), max(local_rows)
        if lo < 0 or hi >= local_blocks:
            raise TransferFailed(f"local rows outside 0..{local_blocks - 1}: [{lo}, {hi}]")
        lo, hi = min(remote_rows), max(remote_rows)
        if lo < 0 or hi >= remote_blocks:
            raise TransferFailed(f"remote rows outside the peer's 0..{remote_blocks - 1}: [{lo}, {hi}]")
        runs: list[tuple[int, int, int]] = []
        l0 = r0 = count = 0
        for lr, rr in zip(local_rows, remote_rows):
            if count and lr == l0 + count and rr == r0 + count:
                count += 1
            else:
                if count:
                    runs.append((l0, r0, count))
                l0, r0, count = lr, rr, 1
        runs.append((l0, r0, count))
        return np.array(runs, dtype=np.int64), n
    lr, rr = check_rows(local_rows, remote_rows, local_blocks, remote_blocks)
    return coalesce(lr, rr), int(lr.size)


def check_rows(local_rows, remote_rows, local_blocks: int, remote_blocks: int) -> tuple[np.ndarray, np.ndarray]:
    """Validate a row mapping against both geometries; raises TransferFailed with the reason."""
    lr = np.asarray(local_rows, dtype=np.int64).reshape(-1)
    rr = np.asarray(remote_rows, dtype=np.int64).reshape(-1)
    if lr.size != rr.size:
        raise TransferFailed(f"{lr.size} local rows but {rr.size} remote rows")
    if lr.size == 0:
        raise TransferFailed("no rows to transfer")
    if lr.min() < 0 or lr.max() >= local_blocks:
        raise TransferFailed(f"local rows outside 0..{local_blocks - 1}: [{lr.min()}, {lr.max()}]")
    if rr.min() < 0 or rr.max() >= remote_blocks:
        raise TransferFailed(f"remote rows outside the peer's 0..{remote_blocks - 1}: [{rr.min()}, {rr.max()}]")
    return lr, rr


@dataclass
class TransferStats:
    submitted: int = 0
    done: int = 0
    failed: int = 0
    bytes_done: int = 0
    descriptors: int = 0  # descriptors posted (one per run per piece)
    posts: int = 0
    last_descriptors: int = 0  # descriptors of the last submitted transfer
    per_peer_bytes: dict[str, int] = field(default_factory=dict)  # bytes read, per live peer key (dropped with it)


class DataTransport(abc.ABC):
    """Register the local region once; read peers' rows into it; report each transfer once."""

    backend: str
    stats: TransferStats  # what it moved (``p2pworker inspect``, metrics)

    @abc.abstractmethod
    def local_info(self) -> PeerDataInfo:
        """What peers need to read rows out of this region."""

    @abc.abstractmethod
    def add_peer(self, peer_key: str, info: PeerDataInfo, *, now: bool = True) -> None:
        """Make the region ``info`` describes readable under ``peer_key``.

        ``now=False`` (a link the peer dialed: it may never be read from) lets
        a transport defer the work of choosing its path to the first read.

        ``peer_key`` is an opaque key, unique per control link (``"out-3"``,
        ``"in-ab12"``), not the peer's id: several keys may name the same
        remote agent, which is loaded once and shared.  Re-adding a key
        retires its old registration first (as :meth:`remove_peer`).  Raises
        ``TransferFailed`` when the peer cannot be used (other backend or
        geometry, metadata refused, its agent name already loaded with other
        metadata while reads through the old one can still land).
        """

    def path_of(self, peer_key: str) -> tuple[str, str] | None:
        """(the path reads from ``peer_key`` take, why not the same-host path); None for an unknown key."""
        return None

    def prefault_of(self, peer_key: str) -> dict | None:
        """The background pre-fault of ``peer_key``'s same-host source (p2pworker.shm.prefault); None if none."""
        return None

    def lane_server(self):
        """Our handover socket (``p2pworker.data.handover.HandoverServer``), where the peers that dialed us open
        their sessions' same-host lanes; None when we offer none."""
        return None

    def lane_target(self, info: PeerDataInfo) -> tuple[str, bytes] | None:
        """(handover socket name, token) of a peer our session may open a same-host lane to; None: no lane."""
        return None

    @abc.abstractmethod
    def remove_peer(self, peer_key: str) -> None:
        """Cancel the key's transfers (unposted pieces are dropped at once); the remote agent
        is forgotten once no key names it and nothing posted through it can still land."""

    @abc.abstractmethod
    def read_blocks(self, peer_key: str, local_rows, remote_rows) -> int:
        """Submit a READ of the peer's ``remote_rows`` into our ``local_rows`` (row i into row i);
        returns a transfer id.

        Raises ``TransferFailed`` when it cannot even be submitted (unknown
        key, rows outside either geometry, closed transport).
        """

    @abc.abstractmethod
    def poll(self) -> tuple[list[int], list[tuple[int, str]]]:
        """Make progress (also as the passive side others read from); return
        (done ids, [(failed id, reason)]) finished since the last call.

        Each transfer is reported exactly once, and only when no piece of it
        can still land in our memory.
        """

    @abc.abstractmethod
    def cancel(self, ids, wait: bool = False, timeout_s: float = 5.0) -> None:
        """Drop unposted pieces of ``ids``; with ``wait``, also wait for posted ones to settle.

        A cancelled transfer is reported failed (``"cancelled"``) once none of
        its posted pieces can land any more; a backend that can guarantee that
        by itself (the ZMQ fallback) abandons posted pieces at once.
        """

    @abc.abstractmethod
    def in_flight(self) -> int:
        """Transfers submitted and not yet reported."""

    @abc.abstractmethod
    def has_backlog(self) -> bool:
        """Pieces are ready to post now (a poll loop should not sleep)."""

    @abc.abstractmethod
    def close(self, timeout_s: float = 10.0) -> bool:
        """Cancel and wait for in-flight transfers, THEN deregister.  Idempotent.

        Returns False when something could still land after ``timeout_s``; the
        memory registration is then kept (leaked) rather than released under a
        transfer.
        """

    @property
    @abc.abstractmethod
    def region(self) -> KVRegion: ...
