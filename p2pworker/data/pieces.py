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
every posted piece before it deregisters.  Backends implement the hooks at
the bottom.
"""

from __future__ import annotations

import abc
import enum
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from p2pworker.data import samehost
from p2pworker.data.base import DataTransport, PeerDataInfo, TransferStats, XferState, rows_to_runs, split_runs
from p2pworker.errors import PeerUnusable, TransferFailed
from p2pworker.shm.region import KVRegion

log = logging.getLogger(__name__)

_EMPTY: tuple[tuple[int, ...], tuple[tuple[int, str], ...]] = ((), ())


class RemotePath(enum.Enum):
    """How reads from a remote move (inspect shows the value)."""

    UNDECIDED = "undecided"  # a same-host candidate on a link it dialed: chosen at our first read, nothing loaded
    SAME_HOST = "same_host"  # copied out of its region file (``source``); the backend never saw it
    BACKEND = "backend"  # loaded into the backend (``state``)
    UNUSABLE = "unusable"  # the backend refused it at our first read: reads fail (the worker closes the session)


@dataclass(eq=False)
class Remote:
    """One remote agent, loaded once, shared by every peer record that names it."""

    name: str
    info: PeerDataInfo  # as first loaded: a later key must describe the same incarnation
    refs: set = field(default_factory=set)  # Peer records (live or retiring) that use it
    state: Any = None  # backend state (e.g. a socket)
    source: samehost.SameHostSource | None = None  # set: the same-host path (the backend never saw this remote)
    refusal: str = ""  # why not the same-host path (inspect)
    path: RemotePath = RemotePath.BACKEND


@dataclass(eq=False)
class Peer:
    """One registration under a peer key; several may share a :class:`Remote`."""

    key: str
    remote: Remote
    base_address: int
    num_blocks: int
    transfers: set[int] = field(default_factory=set)


@dataclass(eq=False)
class Transfer:
    tid: int
    peer: Peer
    pieces: deque  # (n, 3) run arrays (local_start, remote_start, count) not posted yet
    nbytes: int
    posted: list = field(default_factory=list)  # backend handles still in flight
    error: str | None = None
    t_submit: float = 0.0


def _same_incarnation(a: PeerDataInfo, b: PeerDataInfo) -> bool:
    """Two infos naming one agent describe the same process start (and so one loaded remote)."""
    # same_host too: a peer naming another's agent with its own files must not have them used for the other
    return (a.metadata, a.endpoint, a.token, a.base_address, a.num_blocks, a.same_host) == (
        b.metadata, b.endpoint, b.token, b.base_address, b.num_blocks, b.same_host
    )


class PieceTransport(DataTransport):
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
        self._peers: dict[str, Peer] = {}
        self._retiring: list[Peer] = []
        self._remotes: dict[str, Remote] = {}
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
        if peer_key in self._peers:
            self.remove_peer(peer_key)  # a new incarnation of the link: retire the old registration first
        remote = self._remotes.get(info.agent_name)
        if remote is not None and remote.path is RemotePath.UNUSABLE:
            remote = None  # nothing was loaded or posted through it: a new link starts afresh (the old keys keep it)
        if remote is None:
            remote = Remote(info.agent_name, info)
            early = samehost.precheck(self.same_host, info)  # no I/O: the flags, the boot id, the paths
            if early is not None:
                remote.refusal = str(early)
                remote.state = self._remote_add(remote.name, info)  # raises TransferFailed: nothing recorded then
            elif now:
                self._resolve(remote, at_read=False)  # raises TransferFailed: nothing recorded then
            else:
                remote.path = RemotePath.UNDECIDED
            self._remotes[remote.name] = remote
        elif not _same_incarnation(remote.info, info):
            # A restarted peer reusing its agent name while reads through the old incarnation can
            # still land: NIXL holds one agent per name, and unloading the old one now would leave
            # those reads' outcome unknowable (a transfer is reported only once nothing can land).
            raise TransferFailed(
                f"peer {peer_key}: agent {info.agent_name!r} is already loaded with other metadata "
                f"(used by {sorted(p.key for p in remote.refs)}); remove those links and let their reads "
                f"settle first, or give each process start a unique agent name"
            )
        elif now and remote.path is RemotePath.UNDECIDED:
            self._resolve(remote, at_read=False)  # a link we dialed to an agent first met on one it dialed
        peer = Peer(peer_key, remote, info.base_address, info.num_blocks)
        remote.refs.add(peer)
        self._peers[peer_key] = peer

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
        peer = self._peers.pop(peer_key, None)
        if peer is None:
            return
        self.cancel(list(peer.transfers))
        self._retiring.append(peer)
        self._reap_retiring()

    def peers(self) -> list[str]:
        """The live peer keys."""
        return list(self._peers)

    def path_of(self, peer_key: str) -> tuple[str, str] | None:
        """(the path this key's reads take: "same_host" or the backend's name, why not same_host), None if unknown."""
        peer = self._peers.get(peer_key)
        if peer is None:
            return None
        match peer.remote.path:
            case RemotePath.SAME_HOST:
                return "same_host", ""
            case RemotePath.UNDECIDED:
                return "undecided", "chosen at the first read from this peer (it dialed us)"
            case RemotePath.UNUSABLE:
                return "unusable", peer.remote.refusal
        return self.backend, peer.remote.refusal

    def prefault_of(self, peer_key: str) -> dict | None:
        """How far the background pre-fault of this key's same-host source got (inspect); None: no such walk."""
        peer = self._peers.get(peer_key)
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
        return {name: len(r.refs) for name, r in self._remotes.items()}

    def _reap_retiring(self) -> None:
        for peer in list(self._retiring):
            if not any(self._transfers[t].posted for t in peer.transfers if t in self._transfers):
                self._retiring.remove(peer)
                self._unref(peer)

    def _unref(self, peer: Peer) -> None:
        """Drop ``peer``'s reference; forget its remote agent when it was the last one."""
        if peer.key not in self._peers:  # the key is gone for good (not re-added): so is its byte count
            self.stats.per_peer_bytes.pop(peer.key, None)
        remote = peer.remote
        remote.refs.discard(peer)
        if remote.refs or self._remotes.get(remote.name) is not remote:
            return
        del self._remotes[remote.name]
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
        peer = self._peers.get(peer_key)
        if peer is None:
            raise TransferFailed(f"unknown data peer {peer_key!r}")
        runs, n_rows = rows_to_runs(local_rows, remote_rows, self._region.num_blocks, peer.num_blocks)
        if peer.remote.path is RemotePath.UNDECIDED:
            self._resolve(peer.remote, at_read=True)  # raises PeerUnusable: the caller closes the session
        elif peer.remote.path is RemotePath.UNUSABLE:
            raise PeerUnusable(peer.remote.refusal)
        pieces = deque(split_runs(runs, self._bb, self.max_piece_bytes))
        tid = self._next_id
        self._next_id += 1
        self._transfers[tid] = Transfer(tid, peer, pieces, n_rows * self._bb, t_submit=self._clock())
        peer.transfers.add(tid)
        self.stats.submitted += 1
        self.stats.last_descriptors = sum(len(p) for p in pieces)
        return tid

    def _post(self, t: Transfer, piece: np.ndarray) -> None:
        handle = None
        source = t.peer.remote.source
        try:
            if source is not None:
                self._copier.copy(source, piece)  # every byte copied, or it raised
                state = XferState.DONE
            else:
                state, handle = self._post_piece(t, piece)
        except Exception as e:
            state = XferState.ERR
            how = "same-host copy" if source is not None else f"{self.backend} post"
            t.error = t.error or f"{how} failed: {type(e).__name__}: {e}"
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

    def _abandon_quiet(self, handle: Any) -> bool:
        try:
            return self._abandon_handle(handle)
        except Exception as e:  # could not make sure: keep waiting for DONE/ERR
            log.warning("abandoning a %s transfer handle: %s", self.backend, e)
            return False

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
            per[t.peer.key] = per.get(t.peer.key, 0) + t.nbytes
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
                if t.posted:
                    t.posted = [h for h in t.posted if not self._abandon_quiet(h)]
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
        if self._handover is not None:
            self._handover.close()  # first: no peer gets our files any more, even if the rest cannot finish yet
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
            self._unref(peer)
        self._peers.clear()
        self._retiring.clear()
        self._copier.close()
        self._deregister()
        return True

    # ------------------------------------------------------------ backend hooks
    @abc.abstractmethod
    def _remote_add(self, name: str, info: PeerDataInfo) -> Any:
        """Load the remote agent ``name`` (first key naming it); return backend state for
        ``Remote.state``; raise TransferFailed (leaving nothing loaded) when it cannot be used."""

    @abc.abstractmethod
    def _remote_forget(self, remote: Remote) -> None:
        """Unload ``remote``: no key names it and nothing posted through it can still land."""

    @abc.abstractmethod
    def _post_piece(self, t: Transfer, piece: np.ndarray) -> tuple[XferState, Any]:
        """Post a READ of one piece (runs of ``(local_start, remote_start, count)``) from
        ``t.peer``; return (DONE|PROC|ERR, handle or None).  May raise."""

    @abc.abstractmethod
    def _check_handle(self, handle: Any) -> XferState: ...

    @abc.abstractmethod
    def _release_handle(self, handle: Any) -> None: ...

    def _abandon_handle(self, handle: Any) -> bool:
        """Cancel a posted piece so that nothing of it lands from now on; True when that is guaranteed.

        Then the piece counts as settled at once; the backend frees the handle
        itself (no :meth:`_release_handle` follows).  The default is False: with NIXL, releasing a handle does not
        stop the
        bytes already in flight, so a cancelled piece is waited for (DONE/ERR)
        like any other.
        """
        return False

    @abc.abstractmethod
    def _progress(self) -> None:
        """Drive the backend (and the passive side peers read from) once; never blocks."""

    @abc.abstractmethod
    def _deregister(self) -> None: ...
