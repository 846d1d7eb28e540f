"""Which same-host peers' processes exited: a lease whose reader is gone ends then, not at its hold's end.

A lease pins the rows it offered until the consumer's Release or the lease's end (parking.py), because a consumer
whose session closed may still have a read of them running.  A consumer on this host reads our rows from its own
worker process (a copy out of our region's files, or its NIXL agent), so once that process has exited no read of
it can run, and its leases can end at once: its store jobs are reported, and vLLM's stop, reset or eviction waits
for nothing.  (Without this, a consumer killed mid-read pinned the rows it was offered for its whole lease: 30 s
by default.)

How we know the process exited, and not merely that a session ended: a pidfd of the lane's peer, from the kernel
(``SO_PEERPIDFD`` on the lane's socket, Linux 6.5+), never from the peer's word.  A lane that closes says only that
the peer's session ended, and a live peer whose session ended may still have a cancelled read settling; the pidfd
turns readable only at the process's exit.  The kernel closes a dying process's sockets before its pidfd shows the
exit, so the lane ends first and the pidfd is polled at each tick after.

Only peers with a same-host lane have a pidfd.  A consumer on another host, or one without a lane, keeps its leases
until their end: a link that went down cannot tell a dead consumer from a partitioned one still reading.
"""

from __future__ import annotations

import logging
import os
import select
from typing import Any, Callable

from p2pworker.data.handover import peer_pidfd
from p2pworker.session.parking import ParkingLot

log = logging.getLogger("p2pworker.worker")


class PeerExits:
    def __init__(self, lot: Callable[[], ParkingLot | None], counters) -> None:
        self._lot = lot  # the session context's lot once attached (no lane exists before)
        self.counters = counters
        self.known: dict[Any, int] = {}  # a session with a lane -> its peer's pidfd
        self.watched: dict[Any, int] = {}  # a closed session whose leases still pin rows -> its peer's pidfd

    def know(self, s, sock) -> None:
        """``s`` switched to a lane over ``sock``: keep a pidfd of the process at its other end (none on kernels
        older than 6.5: then its leases end at their hold's end, as over a link)."""
        if s in self.known:
            return
        fd = peer_pidfd(sock)
        if fd is not None:
            self.known[s] = fd

    def retired(self, s) -> None:
        """``s`` closed (its leases are with the lot, ownerless): watch its peer while any of them pins rows."""
        fd = self.known.pop(s, None)
        if fd is None:
            return
        lot = self._lot()
        if lot is not None and lot.orphans.count(s):
            self.watched[s] = fd
        else:
            os.close(fd)

    def tick(self) -> int:
        """End the leases of every watched peer whose process exited; forget peers whose leases ended otherwise
        (released, or their hold ran out).  Returns how many leases ended here."""
        if not self.watched:
            return 0
        lot = self._lot()
        poll = select.poll()
        for fd in self.watched.values():
            poll.register(fd, select.POLLIN)
        # a pidfd is readable (POLLIN) once its process exited; nothing else here says so
        exited = {fd for fd, ev in poll.poll(0) if ev & select.POLLIN}
        ended = 0
        for s, fd in list(self.watched.items()):
            if fd in exited and lot is not None:
                # Invariant 7: the reader's process is gone, so no read of these rows can run or start; they end
                # as a lease that ran out does (what was offered and not released counts as not read).
                n = lot.reader_gone(s, f"consumer {s.peer_id} exited (its process is gone) holding a lease")
                if n:
                    log.info("consumer %s exited: %d lease(s) it held ended now", s.peer_id, n)
                ended += n
            elif lot is not None and lot.orphans.count(s):
                continue
            del self.watched[s]
            os.close(fd)
        self.counters["leases_ended_reader_exited"] += ended
        return ended

    def close(self) -> None:
        for fd in (*self.known.values(), *self.watched.values()):
            os.close(fd)
        self.known.clear()
        self.watched.clear()
