"""The transfer bookkeeping every backend shares: pieces, exactly-once reports, retirement.

A transfer is cut into pieces (runs of rows, at most ``max_piece_bytes``);
:meth:`PieceTransport.poll` posts pieces up to ``post_budget_bytes`` per call,
one piece of a transfer at a time, checks posted ones, and reports a transfer
once none of its pieces is pending or can still land.  A removed peer is
forgotten (its remote handle dropped) only when nothing posted to it is still
in flight, and :meth:`close` waits for every posted piece before it
deregisters.  Backends implement the hooks at the bottom.
"""

from __future__ import annotations

import abc
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from p2pworker.data.base import DataTransport, PeerDataInfo, TransferStats, XferState, check_rows, coalesce, split_runs
from p2pworker.errors import TransferFailed
from p2pworker.shm.region import KVRegion

log = logging.getLogger(__name__)

_EMPTY: tuple[tuple[int, ...], tuple[tuple[int, str], ...]] = ((), ())


@dataclass(eq=False)
class Peer:
    peer_id: str
    remote_name: str
    base_address: int
    num_blocks: int
    transfers: set[int] = field(default_factory=set)
    extra: Any = None  # backend state (e.g. a socket)


@dataclass(eq=False)
class Transfer:
    tid: int
    peer: Peer
    pieces: deque  # (n, 3) run arrays (local_start, remote_start, count) not posted yet
    nbytes: int
    posted: list = field(default_factory=list)  # backend handles still in flight
    error: str | None = None
    t_submit: float = 0.0


class PieceTransport(DataTransport):
    def __init__(
        self,
        region: KVRegion,
        *,
        max_piece_bytes: int = 8 << 20,
        post_budget_bytes: int = 16 << 20,
        clock: Callable[[], float] = time.monotonic,
    ):
        self._region = region
        self._bb = region.block_bytes
        self.max_piece_bytes = max_piece_bytes
        self.post_budget_bytes = post_budget_bytes
        self._clock = clock
        self._peers: dict[str, Peer] = {}
        self._retiring: list[Peer] = []
        self._transfers: dict[int, Transfer] = {}
        self._next_id = 1
        self._done: list[int] = []
        self._failed: list[tuple[int, str]] = []
        self._closed = False
        self.stats = TransferStats()

    @property
    def region(self) -> KVRegion:
        return self._region

    def _info(self, **backend_fields) -> PeerDataInfo:
        """This region's PeerDataInfo plus the backend's own fields (metadata, endpoint, ...)."""
        return PeerDataInfo(
            backend=self.backend, agent_name=self.agent_name, base_address=self._region.address,
            num_blocks=self._region.num_blocks, block_bytes=self._bb, **backend_fields,
        )

    # ------------------------------------------------------------ peers
    def add_peer(self, peer_id: str, info: PeerDataInfo) -> None:
        if self._closed:
            raise TransferFailed("the data transport is closed")
        if info.backend != self.backend:
            raise TransferFailed(f"peer {peer_id} speaks data backend {info.backend!r}, we speak {self.backend!r}")
        if info.block_bytes != self._bb:
            raise TransferFailed(f"peer {peer_id} has block_bytes={info.block_bytes}, local block_bytes={self._bb}")
        if info.num_blocks <= 0:
            raise TransferFailed(f"peer {peer_id} advertised num_blocks={info.num_blocks}")
        if peer_id in self._peers:
            self.remove_peer(peer_id)  # a new incarnation: retire the old one first
        for old in list(self._retiring):
            if old.remote_name == info.agent_name and not old.transfers:
                self._forget(old)
        peer = Peer(peer_id, info.agent_name, info.base_address, info.num_blocks)
        self._remote_add(peer, info)
        self._peers[peer_id] = peer

    def remove_peer(self, peer_id: str) -> None:
        peer = self._peers.pop(peer_id, None)
        if peer is None:
            return
        self.cancel(list(peer.transfers))
        self._retiring.append(peer)
        self._reap_retiring()

    def peers(self) -> list[str]:
        return list(self._peers)

    def _reap_retiring(self) -> None:
        for peer in list(self._retiring):
            if not any(self._transfers[t].posted for t in peer.transfers if t in self._transfers):
                self._forget(peer)

    def _forget(self, peer: Peer) -> None:
        try:
            self._remote_forget(peer)
        except Exception as e:
            log.debug("forgetting peer %s: %s", peer.peer_id, e)
        if peer in self._retiring:
            self._retiring.remove(peer)

    # ------------------------------------------------------------ transfers
    def write_blocks(self, peer_id: str, local_rows, remote_rows) -> int:
        if self._closed:
            raise TransferFailed("the data transport is closed")
        peer = self._peers.get(peer_id)
        if peer is None:
            raise TransferFailed(f"unknown data peer {peer_id!r}")
        lr, rr = check_rows(local_rows, remote_rows, self._region.num_blocks, peer.num_blocks)
        pieces = deque(split_runs(coalesce(lr, rr), self._bb, self.max_piece_bytes))
        tid = self._next_id
        self._next_id += 1
        self._transfers[tid] = Transfer(tid, peer, pieces, lr.size * self._bb, t_submit=self._clock())
        peer.transfers.add(tid)
        self.stats.submitted += 1
        self.stats.last_descriptors = sum(len(p) for p in pieces)
        return tid

    def _post(self, t: Transfer, piece: np.ndarray) -> None:
        handle = None
        try:
            state, handle = self._post_piece(t, piece)
        except Exception as e:
            state = XferState.ERR
            t.error = t.error or f"{self.backend} post failed: {type(e).__name__}: {e}"
        self.stats.posts += 1
        self.stats.descriptors += len(piece)
        if state is XferState.PROC:
            t.posted.append(handle)
            return
        if handle is not None:
            self._release_quiet(handle)
        if state is XferState.ERR:
            t.error = t.error or f"{self.backend} transfer state ERR"
            t.pieces.clear()

    def _release_quiet(self, handle: Any) -> None:
        try:
            self._release_handle(handle)
        except Exception as e:
            log.warning("releasing a %s transfer handle: %s", self.backend, e)

    def _check_posted(self, t: Transfer) -> None:
        still = []
        for handle in t.posted:
            try:
                state = self._check_handle(handle)
            except Exception as e:
                state = XferState.ERR
                t.error = t.error or f"{self.backend} transfer failed: {type(e).__name__}: {e}"
            if state is XferState.PROC:
                still.append(handle)
                continue
            self._release_quiet(handle)
            if state is XferState.ERR:
                t.error = t.error or f"{self.backend} transfer state ERR"
                t.pieces.clear()
        t.posted = still

    def _settle(self, t: Transfer) -> None:
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
            per[t.peer.peer_id] = per.get(t.peer.peer_id, 0) + t.nbytes
        else:
            self._failed.append((t.tid, t.error))
            self.stats.failed += 1

    def poll(self):
        if self._closed:  # close() settled everything; only hand out what it reported
            return self._take_reports()
        self._progress()
        if self._transfers:
            budget = self.post_budget_bytes
            for t in list(self._transfers.values()):
                if t.posted:
                    self._check_posted(t)
                while t.pieces and t.error is None and budget > 0 and not t.posted:
                    piece = t.pieces.popleft()
                    budget -= int(piece[:, 2].sum()) * self._bb
                    self._post(t, piece)
                self._settle(t)
        if self._retiring:
            self._reap_retiring()
        return self._take_reports()

    def _take_reports(self):
        if not self._done and not self._failed:
            return _EMPTY
        out = (self._done, self._failed)
        self._done, self._failed = [], []
        return out

    def cancel(self, ids, wait: bool = False, timeout_s: float = 5.0) -> None:
        ids = list(ids)
        for tid in ids:
            t = self._transfers.get(tid)
            if t is not None:
                t.pieces.clear()
                t.error = t.error or "cancelled"
        if wait:
            self._wait_posted(set(ids), timeout_s)
        for tid in ids:
            t = self._transfers.get(tid)
            if t is not None:
                self._settle(t)

    def _wait_posted(self, ids: set[int] | None, timeout_s: float) -> bool:
        deadline = self._clock() + timeout_s
        while True:
            pending = [t for t in self._transfers.values() if t.posted and (ids is None or t.tid in ids)]
            if not pending:
                return True
            if self._clock() >= deadline:
                return False
            self._progress()
            for t in pending:
                self._check_posted(t)
            time.sleep(0.0002)

    def in_flight(self) -> int:
        return len(self._transfers)

    def has_backlog(self) -> bool:
        """True when a transfer has pieces ready to post now (the caller should not sleep)."""
        return any(t.pieces and t.error is None and not t.posted for t in self._transfers.values())

    def close(self, timeout_s: float = 10.0) -> bool:
        if self._closed:
            return True
        self.cancel(list(self._transfers))
        if not self._wait_posted(None, timeout_s):
            n = sum(len(t.posted) for t in self._transfers.values())
            log.error(
                "%s data transport close: %d posted piece(s) still in flight after %.1f s; keeping the "
                "memory registered rather than releasing it under a live transfer", self.backend, n, timeout_s,
            )
            return False
        for t in list(self._transfers.values()):
            self._settle(t)
        self._closed = True
        for peer in list(self._peers.values()) + list(self._retiring):
            self._forget(peer)
        self._peers.clear()
        self._deregister()
        return True

    # ------------------------------------------------------------ backend hooks
    @abc.abstractmethod
    def _remote_add(self, peer: Peer, info: PeerDataInfo) -> None:
        """Connect to the peer; may set ``peer.remote_name``/``peer.extra``; raise TransferFailed."""

    @abc.abstractmethod
    def _remote_forget(self, peer: Peer) -> None: ...

    @abc.abstractmethod
    def _post_piece(self, t: Transfer, piece: np.ndarray) -> tuple[XferState, Any]:
        """Post one piece; return (DONE|PROC|ERR, handle or None).  May raise."""

    @abc.abstractmethod
    def _check_handle(self, handle: Any) -> XferState: ...

    @abc.abstractmethod
    def _release_handle(self, handle: Any) -> None: ...

    @abc.abstractmethod
    def _progress(self) -> None:
        """Drive the backend (and the passive target side) once; never blocks."""

    @abc.abstractmethod
    def _deregister(self) -> None: ...
