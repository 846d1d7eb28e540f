"""Pre-faulting a peer's region in the background, so the first copies out of it do not fault page by page.

A same-host consumer maps its producer's region file read-only (:mod:`p2pworker.data.samehost`).  A fresh
mapping has no page tables: the first read of each page takes a fault (the kernel maps up to 16 neighbouring
pages that are in memory per fault).  Measured here (a read-only map of a /dev/shm file another mapping had
written, our destination pre-faulted, 16 MiB ``memmove``, 2026-12-02): 4.1-4.4 ms from fresh pages, 2.1 ms once
the source is populated.  vLLM's region is tens of GiB in production and its rows are handed out in no order, so
without this a consumer copies at half speed until it has read every page of the peer's region at least once.

:class:`Prefault` walks the mapping on a daemon thread, ``CHUNK_BYTES`` at a time, and for each chunk asks
which pages are in memory (``mincore``) and populates only those (``MADV_POPULATE_READ``; the GIL is released
during both calls).  Only pages in memory: populating a hole of the peer's sparse file would allocate it, i.e.
spend the peer's /dev/shm on rows its vLLM never wrote.  Rows the peer writes after the walk passed them fault at
their first copy, as before.  Where a read would be a SIGBUS (the file shrunk under the mapping) the kernel
answers EFAULT instead: the walk ends FAILED, nothing is signalled.

Invariant 7: populating reads no byte and writes none; it only fills this process's page tables.  Invariant 2
(drain, then unmap): :meth:`Prefault.stop` returns once the thread is out of the mapping, and the owner calls it
before it unmaps (a walk still inside a range being unmapped would only get ENOMEM; the order keeps it from ever
populating whatever is mapped at that address next).  Invariant 4: the wait in stop() is bounded.

Costs: ~0.1 ms of one core per MiB populated (256 MiB: 27 ms here), and the page tables themselves (8 bytes per
4 KiB page: 2 MiB per GiB of the peer's region).  ``[worker] prefault = false`` turns it off, with our own
region's MAP_POPULATE at attach.
"""

from __future__ import annotations

import enum
import logging
import os
import threading

import numpy as np

from p2pworker.shm import vm

log = logging.getLogger(__name__)


class PrefaultState(enum.Enum):
    RUNNING = "running"
    DONE = "done"  # every page that was in memory when the walk reached it is mapped
    STOPPED = "stopped"  # stop() before the end (the mapping is going away)
    FAILED = "failed"  # the kernel refused (EINVAL: before 5.14; EFAULT: the file shrank): copies fault as before


# The only moves: the walk ends once, one way.  Tests read this table.
MOVES: dict[PrefaultState, frozenset[PrefaultState]] = {
    PrefaultState.RUNNING: frozenset({PrefaultState.DONE, PrefaultState.STOPPED, PrefaultState.FAILED}),
    PrefaultState.DONE: frozenset(),
    PrefaultState.STOPPED: frozenset(),
    PrefaultState.FAILED: frozenset(),
}


def runs_of(resident: np.ndarray) -> list[tuple[int, int]]:
    """(first page, pages) of each run of True in ``resident``."""
    edges = np.diff(np.concatenate(([0], resident.view(np.int8), [0])))
    starts = np.flatnonzero(edges == 1)
    ends = np.flatnonzero(edges == -1)
    return list(zip(starts.tolist(), (ends - starts).tolist()))


class Prefault:
    """Populates the resident pages of ``[address, address + nbytes)`` on a daemon thread (started here)."""

    CHUNK_BYTES = 16 << 20  # one mincore + populate round: ~2 ms here, so stop() waits at most about that

    def __init__(self, address: int, nbytes: int, *, name: str = "") -> None:
        if address % vm.PAGE_BYTES:
            raise ValueError(f"address {address:#x} is not page-aligned")
        self.address = address
        self.nbytes = vm.round_up(nbytes)
        self.scanned_bytes = 0
        self.populated_bytes = 0
        self.error = ""
        self.state = PrefaultState.RUNNING
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"p2pw-prefault {name}".rstrip(), daemon=True)
        self._thread.start()

    def _end(self, state: PrefaultState, error: str = "") -> None:
        assert state in MOVES[self.state], (self.state, state)
        self.error = error
        self.state = state

    def _run(self) -> None:
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

    def stop(self, timeout_s: float = 5.0) -> bool:
        """End the walk; True once the thread is out of the mapping (call before unmapping it)."""
        self._stop.set()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.warning("prefault of %#x+%d still running after %.1f s", self.address, self.nbytes, timeout_s)
            return False
        return True

    def status(self) -> dict:
        return {"state": self.state.value, "populated_bytes": self.populated_bytes,
                "scanned_bytes": self.scanned_bytes, "nbytes": self.nbytes, "error": self.error}
