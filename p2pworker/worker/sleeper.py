"""How the loop sleeps: on the command ring's bell, the event ring's space bell, the admin socket, the control
sockets, the same-host lanes and dials, all at once, for as long as :func:`poll_timeout_s` allows.

It remembers what its poll found readable for the turn right after it: a source it watched and did not find
readable is skipped that turn (``unready``), ~10 us of empty reads (admin, control sockets, lanes, bells) saved per
turn, three turns per request.  A byte that arrives since makes the next poll return at once, so nothing waits
longer than a turn.
"""

from __future__ import annotations

import math
import time
from typing import Callable, Iterable

import zmq

from p2pworker.config import WorkerConfig
from p2pworker.shm import Ring


def poll_timeout_s(cfg: WorkerConfig, *, busy: bool, now: float, next_tick: float, offering: int,
                   last_offer_at: float) -> float:
    """How long the loop may sleep on its sockets: busy_poll_s while our own reads are in flight; otherwise until
    the next timer, but while leases hold offered rows (``offering``) a peer may be reading them, which over TCP
    moves only while we progress: passive_burst_poll_s for passive_burst_s after the last offer (the consumer's
    READ is in flight then), passive_poll_s after that (a lease held long, e.g. by a slow consumer, costs less).
    A lease with nothing offered yet (a Fetch before the stores) costs nothing: nobody reads before an offer.

    Invariant 7: this sets only how long the loop sleeps.  It writes no row and releases none: offered rows stay
    pinned until the consumer's Release, the lease's end or its exit (ParkingLot), however often we poll; our own
    rows are written only by our reads, reported after they settle."""
    if busy:
        return cfg.busy_poll_s
    timeout_s = max(0.0, min(cfg.idle_poll_s, next_tick - now))
    if offering:
        burst = now - last_offer_at < cfg.passive_burst_s
        timeout_s = min(timeout_s, cfg.passive_burst_poll_s if burst else cfg.passive_poll_s)
    return timeout_s


class Sleeper:
    def __init__(self, cmd: Ring, evt: Ring) -> None:
        self.cmd = cmd
        self.evt = evt
        self._poller = zmq.Poller()
        self._epoch: tuple | None = None  # the sources' epoch the poller was built for
        self.readable: set | None = None  # what the last poll found readable (None: no poll, read everything)

    def forget(self) -> None:
        """The turn is over: what the last poll found is stale now."""
        self.readable = None

    def watched(self, epoch: tuple) -> bool:
        """The last sleep polled, and over the sources of now: what it did not find readable has nothing to read."""
        return self.readable is not None and self._epoch == epoch

    def unready(self, source, epoch: tuple) -> bool:
        """The last sleep's poll watched ``source`` and found nothing to read: skip reading it this turn."""
        return self.watched(epoch) and source not in self.readable

    def sleep(self, timeout_s: float, epoch: tuple, sources: Callable[[], Iterable], *, room_wanted: bool) -> None:
        """Sleep up to ``timeout_s`` on ``sources()`` (rebuilt only when ``epoch`` moved: links and lanes come and go,
        and rebuilding costs O(links)) and the two ring bells.  ``room_wanted``: events wait for room in the event
        ring, so its space bell (the adapter rings it when it takes one) wakes us too."""
        self.readable = None
        if epoch != self._epoch:
            self._poller = zmq.Poller()
            for sock in (self.cmd.fileno(), self.evt.fileno(), *sources()):
                self._poller.register(sock, zmq.POLLIN)
            self._epoch = epoch
        if self.cmd.arm():
            return
        if room_wanted and self.evt.arm():
            self.cmd.disarm()
            self.evt.disarm()  # the adapter may have rung the bell as it freed that room: empty it (see below)
            return  # room already: flush now
        ready = None
        try:
            if 0 < timeout_s < 0.001 and not self._poller.poll(0):
                # below zmq_poll's millisecond: nothing to read now, so a plain sleep (a passive NIXL target over
                # TCP, whose peer's READ is served only while we progress, wants this while it holds leases)
                time.sleep(timeout_s)
            else:
                # round up: waking early would spin until the timer
                ready = {sock for sock, _ in self._poller.poll(math.ceil(timeout_s * 1000))}
        finally:
            # A bell the poll found readable is emptied; one it did not is not read (an empty read is a syscall and
            # an exception).  A byte the adapter wrote as it saw us armed that lands after the poll makes the next
            # poll return at once with the bell readable: it is emptied then, so no poll keeps returning.
            self.cmd.disarm(drain=ready is None or self.cmd.fileno() in ready)
            self.evt.disarm(drain=ready is None or self.evt.fileno() in ready)
        self.readable = ready
