"""Pre-faulting a peer's region in the background, so the first copies out of it do not fault page by page.

A same-host consumer maps its producer's region file read-only (:mod:`p2pworker.data.samehost`).  A fresh
mapping has no page tables: the first read of each page takes a fault (the kernel maps up to 16 neighbouring
pages that are in memory per fault).  Measured here (a read-only map of a /dev/shm file another mapping had
written, our destination pre-faulted, 16 MiB ``memmove``, 2026-12-02): 4.1-4.4 ms from fresh pages, 2.1 ms once
the source is populated.  vLLM's region is tens of GiB in production and its rows are handed out in no order, so
without this a consumer copies at half speed until it has read every page of the peer's region at least once.

:class:`Prefault` walks the rows' range on a daemon thread, ``CHUNK_BYTES`` at a time, and for each chunk asks
which pages are in memory (``mincore``) and populates only those (``MADV_POPULATE_READ``; the GIL is released
during both calls).  Only pages in memory: populating a hole of the peer's sparse file would allocate it, i.e.
spend the peer's /dev/shm on rows its vLLM never wrote.  Rows the peer writes after the walk passed them fault at
their first copy, as before.  Where a read would be a SIGBUS (the file shrunk under the mapping) the kernel
answers EFAULT instead: the walk ends FAILED, nothing is signalled.

``mincore`` tells the truth about a file's pages only to its owner, a process that may write it, or one with
CAP_FOWNER; anyone else is told that every page is in memory (so that it cannot watch another user's page cache),
and populating those "resident" holes would allocate them.  :func:`walk_refusal` checks that first (owner or
CAP_FOWNER; a writer that is neither is refused too: conservative): a refused walk is SKIPPED, never started.

Invariant 7: populating reads no byte and writes none; it only fills this process's page tables.  Invariant 2
(drain, then unmap): the owner unmaps through :meth:`Prefault.stop_then`, which runs the unmap once the thread is
out of the mapping: at once when the walk stops within its wait, else on the walk's own thread as it leaves (so
the walk never populates whatever is mapped at that address next, and the mapping is not kept for good).
Invariant 4: the event loop waits ``timeout_s`` (0.2 s) at most; one round is ~0.5 ms here.

Costs: ~0.1 ms of one core per MiB populated (256 MiB: 27 ms here), at the worker's own priority (a lower one
could leave the event loop waiting for the GIL on a walk that the scheduler does not run), and the page tables
themselves (8 bytes per 4 KiB page: 2 MiB per GiB of the peer's rows).  ``[data] prefault_peers = false`` turns
it off.
"""

from __future__ import annotations

import enum
import logging
import os
import threading
from typing import Callable

import numpy as np

from p2pworker.shm import vm

log = logging.getLogger(__name__)

CAP_FOWNER = 3  # capability bit: "bypass permission checks on operations that require the file's owner"


class PrefaultState(enum.Enum):
    RUNNING = "running"
    SKIPPED = "skipped"  # never started: mincore cannot be trusted here (walk_refusal), see ``error``
    DONE = "done"  # every page that was in memory when the walk reached it is mapped
    STOPPED = "stopped"  # stop() before the end (the mapping is going away)
    FAILED = "failed"  # the kernel refused (EINVAL: before 5.14; EFAULT: the file shrank): copies fault as before


# The only moves: a walk starts RUNNING (or SKIPPED, never started) and ends once, one way.  Tests read this table.
MOVES: dict[PrefaultState, frozenset[PrefaultState]] = {
    PrefaultState.RUNNING: frozenset({PrefaultState.DONE, PrefaultState.STOPPED, PrefaultState.FAILED}),
    PrefaultState.SKIPPED: frozenset(),
    PrefaultState.DONE: frozenset(),
    PrefaultState.STOPPED: frozenset(),
    PrefaultState.FAILED: frozenset(),
}


def has_cap(bit: int) -> bool:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> bit & 1)
    except OSError:
        pass
    return False


def initial_user_namespace() -> bool:
    """Every uid maps to itself: CAP_FOWNER here counts for any file (in another user namespace the kernel honours
    it only for files whose owner is mapped into it, which a file of an unmapped owner is not)."""
    try:
        with open("/proc/self/uid_map") as f:
            return f.read().split() == ["0", "0", "4294967295"]
    except OSError:
        return False


def walk_refusal(fds) -> str:
    """'' when ``mincore`` tells this process the truth about the files behind ``fds``; else why not."""
    if has_cap(CAP_FOWNER) and initial_user_namespace():
        return ""
    euid = os.geteuid()
    for fd in fds:
        uid = os.fstat(fd).st_uid
        if uid != euid:
            return (f"not the owner of the peer's file (uid {uid}, we are {euid}): mincore would call every page "
                    f"in memory, and populating its holes would allocate them")
    return ""


def runs_of(resident: np.ndarray) -> list[tuple[int, int]]:
    """(first page, pages) of each run of True in ``resident``."""
    edges = np.diff(np.concatenate(([0], resident.view(np.int8), [0])))
    starts = np.flatnonzero(edges == 1)
    ends = np.flatnonzero(edges == -1)
    return list(zip(starts.tolist(), (ends - starts).tolist()))


class Prefault:
    """Populates the resident pages of ``[address, address + nbytes)`` on a daemon thread (started here), or, given
    a ``refusal``, records why it does not (SKIPPED, no thread)."""

    CHUNK_BYTES = 4 << 20  # one mincore + populate round: ~0.5 ms here, so stop() returns about that fast

    def __init__(self, address: int, nbytes: int, *, name: str = "", refusal: str = "") -> None:
        page = vm.PAGE_BYTES
        start = address - address % page  # rows need not start on a page (data_offset): walk whole pages
        self.address = start
        self.nbytes = vm.round_up(nbytes + (address - start))
        self.scanned_bytes = 0
        self.populated_bytes = 0
        self.error = refusal
        self.state = PrefaultState.SKIPPED if refusal else PrefaultState.RUNNING
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._out = False  # the thread has left the mapping for good (set last thing in _run)
        self._then: Callable[[], None] | None = None  # stop_then's release, when the walk was still inside
        self._thread: threading.Thread | None = None
        if not refusal:
            self._thread = threading.Thread(target=self._run, name=f"p2pw-prefault {name}".rstrip(), daemon=True)
            self._thread.start()

    @property
    def thread(self) -> threading.Thread | None:
        """The walk's thread (it ends by itself; ``stop`` cuts it short); None when the walk was refused."""
        return self._thread

    @property
    def left(self) -> bool:
        """The thread has left the mapping for good (the last thing it does); False while it may still touch it."""
        return self._out

    def _end(self, state: PrefaultState, error: str = "") -> None:
        assert state in MOVES[self.state], (self.state, state)
        self.error = error
        self.state = state

    def _run(self) -> None:
        try:
            self._walk()
        finally:
            with self._lock:
                self._out = True
                then, self._then = self._then, None
            if then is not None:  # its owner let go while we were inside: the unmap is ours to do, now
                try:
                    then()
                except Exception as e:
                    log.error("releasing a pre-faulted mapping after the walk: %s: %s", type(e).__name__, e)

    def _walk(self) -> None:
        page = vm.PAGE_BYTES
        try:
            for off in range(0, self.nbytes, self.CHUNK_BYTES):
                if self._stop.is_set():
                    self._end(PrefaultState.STOPPED)
                    return
                at, length = self.address + off, min(self.CHUNK_BYTES, self.nbytes - off)
                for first, pages in runs_of(vm.resident(at, length)):
                    err = vm.populate_read(at + first * page, pages * page)
                    if err:
                        self._end(PrefaultState.FAILED, f"madvise(MADV_POPULATE_READ): {os.strerror(err)}")
                        return
                    self.populated_bytes += pages * page
                self.scanned_bytes = off + length
            self._end(PrefaultState.DONE)
        except Exception as e:  # mincore refused (the range is not mapped): copies fault as they would anyway
            self._end(PrefaultState.FAILED, f"{type(e).__name__}: {e}")

    def stop(self, timeout_s: float = 1.0) -> bool:
        """End the walk; True once the thread is out of the mapping (only then may its owner unmap it)."""
        self._stop.set()
        if self._thread is None:
            return True
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def stop_then(self, release: Callable[[], None], timeout_s: float = 0.2) -> bool:
        """End the walk and run ``release`` (the unmap) once the thread is out of the mapping: here when it leaves
        within ``timeout_s`` (True), else on the walk's thread as it leaves (False): never under the walk, and the
        caller (the event loop) waits ``timeout_s`` at most."""
        self.stop(timeout_s)
        with self._lock:
            now = self._thread is None or self._out
            if not now:
                self._then = release
        if now:
            release()
        return now

    def status(self) -> dict:
        return {"state": self.state.value, "populated_bytes": self.populated_bytes,
                "scanned_bytes": self.scanned_bytes, "nbytes": self.nbytes, "error": self.error}
