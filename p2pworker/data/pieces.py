"""The transfer bookkeeping every backend shares: pieces, exactly-once reports, retirement.

A transfer (a READ of a peer's rows into ours) is cut into pieces (runs of
rows, at most ``max_piece_bytes``); :meth:`PieceTransport.poll` posts pieces
up to ``post_budget_bytes`` per call, one piece of a transfer at a time,
checks posted ones, and reports a transfer once none of its pieces is pending
or can still land in our memory.

Peers and remote agents::

    peer key (one per control link)        remote agent (one per agent name)
    "out-3"   ─┐
    "in-ab12" ─┼──────────────────────────►  Remote("w1-9f3c", refs={...})
    "out-3"'  ─┘  (retiring: posted pieces     loaded on the first ref,
                   still in flight)            forgotten when refs is empty

A remote on this host whose region file we can prove we see (:mod:`p2pworker.data.samehost`) is not loaded
into the backend at all: its pieces are copied by this process out of a read-only map of that file, inside the
same post/settle bookkeeping (a copy is synchronous: DONE when the post returns).  Everything below, the
reference counts and "forgotten only when nothing can land" included, is the same for both paths.

A remote agent is loaded once (NIXL refuses a second ``add_remote_agent`` for
a name it knows) and shared by every key that names it.  Removing a key
cancels its transfers and retires its record; a retired record keeps its
remote referenced until nothing posted through it can still land, and the
remote is forgotten when its last reference goes.  :meth:`close` waits for
every posted piece before it deregisters.  Backends implement the hooks of
:class:`~p2pworker.data.posting.PiecePosting`.

The rooms: :mod:`~p2pworker.data.peer_book` (keys, retiring records, shared remotes),
:mod:`~p2pworker.data.transfer_book` (transfers by id, the exactly-once reports),
:mod:`~p2pworker.data.posting` (one piece's life with the backend, the hooks); :class:`PieceTransport` here
decides each remote's path and drives the books.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Callable

from p2pworker.data import samehost
from p2pworker.data.base import DataTransport, PeerDataInfo, TransferStats, rows_to_runs, split_runs
from p2pworker.data.peer_book import Peer, PeerBook, Remote, RemotePath
from p2pworker.data.posting import PiecePosting
from p2pworker.data.transfer_book import Transfer, TransferBook
from p2pworker.errors import PeerUnusable, TransferFailed
from p2pworker.shm.region import KVRegion

__all__ = ["Peer", "PieceTransport", "Remote", "RemotePath", "Transfer"]  # the backends import these from here

log = logging.getLogger(__name__)


class PieceTransport(DataTransport, PiecePosting):
    def __init__(
        self,
        region: KVRegion,
        *,
        max_piece_bytes: int = 8 << 20,
        post_budget_bytes: int = 16 << 20,
        same_host: bool = False,
        copy_threads: int = 1,
        prefault_peers: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ):
        self._region = region
        self.same_host = same_host  # offer our region file to same-host peers, and copy from theirs
        # Started by the first _info(), not here: a backend whose constructor fails after ours (NIXL missing under
        # backend "auto") must not leave a handover thread and socket behind; close() ends it.
        self._handover: samehost.handover.HandoverServer | None = None
        self._same_host_info: samehost.SameHostInfo | None = None
        self._offer_tried = False
        self._copier = samehost.Copier(region, threads=copy_threads)
        self.prefault_peers = prefault_peers  # same-host sources: populate their mapping in the background
        self._bb = region.block_bytes
        self.max_piece_bytes = max_piece_bytes
        self.post_budget_bytes = post_budget_bytes
        self._clock = clock
        self._closed = False
        self.stats = TransferStats()
        self.peer_book = PeerBook()
        self.transfer_book = TransferBook(self.stats)

    @property
    def region(self) -> KVRegion:
        return self._region

    def _info(self, **backend_fields) -> PeerDataInfo:
        """This region's PeerDataInfo plus the backend's own fields (metadata, endpoint, ...)."""
        if self.same_host and not self._offer_tried and not self._closed:
            self._offer_tried = True
            try:
                self._handover = samehost.serve(self._region)
                self._same_host_info = samehost.local_info(self._region, self._handover)
            except Exception as e:  # our own files, checked: only an odd host gets here; peers then use the backend
                log.warning("not offering our region to same-host peers: %s: %s", type(e).__name__, e)
        return PeerDataInfo(
            backend=self.backend, agent_name=self.agent_name, base_address=self._region.address,
            num_blocks=self._region.num_blocks, block_bytes=self._bb, same_host=self._same_host_info,
            **backend_fields,
        )

    # ------------------------------------------------------------ peers
    def add_peer(self, peer_key: str, info: PeerDataInfo, *, now: bool = True) -> None:
        if self._closed:
            raise TransferFailed("the data transport is closed")
        if info.backend != self.backend:
            raise TransferFailed(f"peer {peer_key} speaks data backend {info.backend!r}, we speak {self.backend!r}")
        if info.block_bytes != self._bb:
            raise TransferFailed(f"peer {peer_key} has block_bytes={info.block_bytes}, local block_bytes={self._bb}")
        if info.num_blocks <= 0:
            raise TransferFailed(f"peer {peer_key} advertised num_blocks={info.num_blocks}")
        if self.peer_book.get(peer_key) is not None:
            self.remove_peer(peer_key)  # a new incarnation of the link: retire the old registration first
        remote = self.peer_book.known(peer_key, info)  # raises TransferFailed: another incarnation of that agent
        if remote is None:
            remote = self._new_remote(info, now)  # raises TransferFailed: nothing recorded then
            self.peer_book.loaded(remote)
        elif now and remote.path is RemotePath.UNDECIDED:
            self._resolve(remote, at_read=False)  # a link we dialed to an agent first met on one it dialed
        self.peer_book.register(peer_key, remote, info)

    def _new_remote(self, info: PeerDataInfo, now: bool) -> Remote:
        """A remote for an agent first met: its path chosen now (``now``, or not a same-host candidate), or at
        our first read from it (UNDECIDED: nothing loaded)."""
        remote = Remote(info.agent_name, info)
        early = samehost.precheck(self.same_host, info)  # no I/O: the flags, the boot id, the paths
        if early is not None:
            remote.refusal = str(early)
            remote.state = self._remote_add(remote.name, info)
        elif now:
            self._resolve(remote, at_read=False)
        else:
            remote.path = RemotePath.UNDECIDED
        return remote

    def _resolve(self, remote: Remote, *, at_read: bool) -> None:
        """Choose a same-host candidate's path: the handover and the checks (a local round trip to the peer's
        handover thread, bounded by handover.TIMEOUT_S), else the backend.  Raises TransferFailed when the backend
        refuses the remote: from add_peer the link is refused and the remote stays as it was; at a read the remote
        becomes UNUSABLE (PeerUnusable: no second try per read; a later link to that agent starts afresh)."""
        try:
            remote.source = samehost.open_source(self.same_host, remote.info, prefault=self.prefault_peers)
            remote.path = RemotePath.SAME_HOST
            return
        except samehost.NotSameHost as e:
            remote.refusal = str(e)
        try:
            remote.state = self._remote_add(remote.name, remote.info)
        except TransferFailed as e:
            if at_read:
                remote.path = RemotePath.UNUSABLE
                remote.refusal = f"{remote.refusal}; the {self.backend} backend refused it too: {e}"
                raise PeerUnusable(str(e)) from e
            raise
        remote.path = RemotePath.BACKEND

    def remove_peer(self, peer_key: str) -> None:
        peer = self.peer_book.retire(peer_key)
        if peer is None:
            return
        self.cancel(list(peer.transfers))
        self._reap_retiring()

    def peers(self) -> list[str]:
        """The live peer keys."""
        return list(self.peer_book.live)

    def path_of(self, peer_key: str) -> tuple[str, str] | None:
        """(the path this key's reads take: "same_host" or the backend's name, why not same_host), None if unknown."""
        peer = self.peer_book.get(peer_key)
        return None if peer is None else peer.remote.path_view(self.backend)

    def prefault_of(self, peer_key: str) -> dict | None:
        """How far the background pre-fault of this key's same-host source got (inspect); None: no such walk."""
        peer = self.peer_book.get(peer_key)
        source = peer.remote.source if peer is not None else None
        return source.prefault_status() if source is not None else None

    def lane_server(self):
        return None if self._closed else self._handover

    def lane_target(self, info: PeerDataInfo) -> tuple[str, bytes] | None:
        # The same checks as before a handover, without I/O: our flag, same boot, its socket of our naming and in
        # our network namespace (where that name can only be its own).  The lane then proves the session key.
        if samehost.precheck(self.same_host, info) is not None:
            return None
        return info.same_host.socket, info.same_host.token

    def remotes(self) -> dict[str, int]:
        """Loaded remote agents and how many peer records (live or retiring) reference each."""
        return self.peer_book.ref_counts()

    def _reap_retiring(self) -> None:
        for peer in self.peer_book.reap(self.transfer_book.any_posted):
            self._unref(peer)

    def _unref(self, peer: Peer) -> None:
        """Drop ``peer``'s reference; forget its remote agent when it was the last one."""
        if peer.key not in self.peer_book.live:  # the key is gone for good (not re-added): so is its byte count
            self.stats.per_peer_bytes.pop(peer.key, None)
        remote = self.peer_book.drop(peer)
        if remote is None:
            return
        try:
            if remote.path is RemotePath.SAME_HOST:
                remote.source.close()  # nothing copies from it: copies are synchronous, and no ref is left
            elif remote.path is RemotePath.BACKEND:  # the others were never loaded
                self._remote_forget(remote)
        except Exception as e:
            log.debug("forgetting remote agent %s: %s", remote.name, e)

    # ------------------------------------------------------------ transfers
    def read_blocks(self, peer_key: str, local_rows, remote_rows) -> int:
        if self._closed:
            raise TransferFailed("the data transport is closed")
        peer = self.peer_book.get(peer_key)
        if peer is None:
            raise TransferFailed(f"unknown data peer {peer_key!r}")
        runs, n_rows = rows_to_runs(local_rows, remote_rows, self._region.num_blocks, peer.num_blocks)
        if peer.remote.path is RemotePath.UNDECIDED:
            self._resolve(peer.remote, at_read=True)  # raises PeerUnusable: the caller closes the session
        elif peer.remote.path is RemotePath.UNUSABLE:
            raise PeerUnusable(peer.remote.refusal)
        pieces = deque(split_runs(runs, self._bb, self.max_piece_bytes))
        return self.transfer_book.submit(peer, pieces, n_rows * self._bb, self._clock())

    def poll(self):
        if self._closed:  # close() settled everything; only hand out what it reported
            return self.transfer_book.take_reports()
        self._progress()
        if len(self.transfer_book):
            budget = self.post_budget_bytes
            for t in self.transfer_book.all():
                if t.posted:
                    self._check_posted(t)
                while t.ready and budget > 0:
                    piece = t.pieces.popleft()
                    budget -= int(piece[:, 2].sum()) * self._bb
                    self._post(t, piece)
                self.transfer_book.settle(t)
        if self.peer_book.retiring:
            self._reap_retiring()
        return self.transfer_book.take_reports()

    def cancel(self, ids, wait: bool = False, timeout_s: float = 5.0) -> None:
        ids = list(ids)
        for tid in ids:
            t = self.transfer_book.get(tid)
            if t is not None:
                t.pieces.clear()
                t.error = t.error or "cancelled"
                if t.posted:
                    t.posted = [h for h in t.posted if not self._abandon_quiet(h)]
        if wait:
            self._wait_posted(set(ids), timeout_s)
        for tid in ids:
            t = self.transfer_book.get(tid)
            if t is not None:
                self.transfer_book.settle(t)

    def _wait_posted(self, ids: set[int] | None, timeout_s: float) -> bool:
        deadline = self._clock() + timeout_s
        while True:
            pending = self.transfer_book.with_posted(ids)
            if not pending:
                return True
            if self._clock() >= deadline:
                return False
            self._progress()
            for t in pending:
                self._check_posted(t)
            time.sleep(0.0002)

    def in_flight(self) -> int:
        return len(self.transfer_book)

    def has_backlog(self) -> bool:
        """True when a transfer has pieces ready to post now (the caller should not sleep)."""
        return self.transfer_book.has_backlog()

    def close(self, timeout_s: float = 10.0) -> bool:
        if self._closed:
            return True
        if self._handover is not None:
            self._handover.close()  # first: no peer gets our files any more, even if the rest cannot finish yet
        self.cancel([t.tid for t in self.transfer_book.all()])
        if not self._wait_posted(None, timeout_s):
            log.error(
                "%s data transport close: %d posted piece(s) still in flight after %.1f s; keeping the "
                "memory registered rather than releasing it under a live transfer", self.backend,
                self.transfer_book.posted_count(), timeout_s,
            )
            return False
        for t in self.transfer_book.all():
            self.transfer_book.settle(t)
        self._closed = True
        for peer in self.peer_book.records():
            self._unref(peer)
        self.peer_book.clear()
        self._copier.close()
        self._deregister()
        return True
