"""Transfers from submission to their one report (sans-IO: posting is the transport's).

A transfer (a READ of a peer's rows into ours) is cut into pieces; it is reported exactly once, done or failed,
when none of its pieces is pending or can still land in our memory.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from p2pworker.data.base import TransferStats
from p2pworker.data.peer_book import Peer

_EMPTY: tuple[tuple[int, ...], tuple[tuple[int, str], ...]] = ((), ())


@dataclass(eq=False)
class Transfer:
    tid: int
    peer: Peer
    pieces: deque  # (n, 3) run arrays (local_start, remote_start, count) not posted yet
    nbytes: int
    posted: list = field(default_factory=list)  # backend handles still in flight
    error: str | None = None
    t_submit: float = 0.0

    @property
    def ready(self) -> bool:
        """It has a piece to post now: pieces left, no error, and none posted (one piece at a time)."""
        return bool(self.pieces) and self.error is None and not self.posted


class TransferBook:
    """The transfers in flight by id, and the reports not handed out yet; counts into ``stats``."""

    def __init__(self, stats: TransferStats) -> None:
        self.stats = stats
        self._transfers: dict[int, Transfer] = {}
        self._next_id = 1
        self._done: list[int] = []
        self._failed: list[tuple[int, str]] = []

    def submit(self, peer: Peer, pieces: deque, nbytes: int, t_submit: float) -> int:
        tid = self._next_id
        self._next_id += 1
        self._transfers[tid] = Transfer(tid, peer, pieces, nbytes, t_submit=t_submit)
        peer.transfers.add(tid)
        self.stats.submitted += 1
        self.stats.last_descriptors = sum(len(p) for p in pieces)
        return tid

    def get(self, tid: int) -> Transfer | None:
        return self._transfers.get(tid)

    def __len__(self) -> int:
        return len(self._transfers)

    def all(self) -> list[Transfer]:
        """Every transfer in flight (a copy: settling one while walking them is fine)."""
        return list(self._transfers.values())

    def with_posted(self, ids: set[int] | None = None) -> list[Transfer]:
        """The transfers (of ``ids``, or all) with a piece posted and not yet checked DONE/ERR."""
        return [t for t in self._transfers.values() if t.posted and (ids is None or t.tid in ids)]

    def any_posted(self, peer: Peer) -> bool:
        """Whether a piece posted through ``peer``'s record can still land."""
        return any(self._transfers[t].posted for t in peer.transfers if t in self._transfers)

    def posted_count(self) -> int:
        return sum(len(t.posted) for t in self._transfers.values())

    def has_backlog(self) -> bool:
        return any(t.ready for t in self._transfers.values())

    def settle(self, t: Transfer) -> None:
        """Report ``t`` exactly once, when nothing of it is pending or can still land."""
        if t.posted or (t.pieces and t.error is None):
            return
        del self._transfers[t.tid]
        t.peer.transfers.discard(t.tid)
        if t.error is None:
            self._done.append(t.tid)
            self.stats.done += 1
            self.stats.bytes_done += t.nbytes
            per = self.stats.per_peer_bytes
            per[t.peer.key] = per.get(t.peer.key, 0) + t.nbytes
        else:
            self._failed.append((t.tid, t.error))
            self.stats.failed += 1

    def take_reports(self) -> tuple:
        """(done ids, [(failed id, why)]) since the last call; each transfer appears once."""
        if not self._done and not self._failed:
            return _EMPTY
        out = (self._done, self._failed)
        self._done, self._failed = [], []
        return out
