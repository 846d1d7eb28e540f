"""The event outbox: everything the worker tells the adapter, in order, through the event ring.

Two sources feed it: what the sessions report (the Reporter's vocabulary: JobDone, LookupAnswer, ...) and the
worker's own events (Ready, Drained, Heartbeat, WorkerError).  Both go through one queue, so a Drained never
overtakes the jobs it says are done.  A full ring leaves events queued here (``pending``); the loop sleeps on the
ring's space bell instead of polling while the adapter is slow to read.
"""

from __future__ import annotations

import collections
import logging
from typing import Callable, Protocol

from p2pworker import api
from p2pworker.errors import MessageTooLarge
from p2pworker.instruments import Instruments
from p2pworker.session import JobDone, JobSettled, LookupAnswer, Reporter, ServeLookup, SessionClosed, SessionUp
from p2pworker.session.reporter import Event as ReportedEvent
from p2pworker.shm import Ring

log = logging.getLogger("p2pworker.worker")

FAILED_LOG_PER_S = 10


class HasInstruments(Protocol):
    instruments: Instruments


class EventOutbox:
    def __init__(self, evt: Ring, reporter: Reporter, counters: collections.Counter, clock: Callable[[], float],
                 owner: HasInstruments, metrics=None) -> None:
        self.evt = evt
        self.reporter = reporter
        self.counters = counters
        self.clock = clock
        self.owner = owner  # the worker's core: a test hook replaces its instruments after we exist
        self.metrics = metrics
        self.pending: collections.deque = collections.deque()  # events the full event ring could not take
        self._failed_second = 0.0  # when the second of _log_failed's count started
        self._failed_in_second = 0

    @property
    def waiting(self) -> bool:
        """Events queued here, or one that spans slots and is partly out."""
        return bool(self.pending) or self.evt.pending_bytes > 0

    def error(self, message: str, *, fatal: bool = False, attach: bool = False) -> None:
        log.error("%s%s", message, " (configuration error: this worker cannot serve)" if fatal else "")
        self.counters["errors"] += 1
        self.emit(api.WorkerError(message, fatal, attach))

    def emit(self, ev: api.Event) -> None:
        """Queue one of the worker's own events (Ready, Drained, Heartbeat, WorkerError), after whatever the
        sessions reported before it: a Drained must not overtake the jobs it says are done."""
        self.take_reported()
        self.pending.append(ev)

    def take_reported(self) -> None:
        """The sessions' events (session.reporter's vocabulary) into the adapter's (api), in order."""
        for ev in self.reporter.take():
            if isinstance(ev, JobDone):
                # Invariant 7: a hook may write this job's own rows here, by this process, only now: a load's reads
                # have settled and the job is not yet queued for the adapter (so no byte lands after its report)
                self.owner.instruments.on_job_done(ev)
                if not ev.success:
                    self._log_failed(ev)
            elif isinstance(ev, SessionClosed):
                log.info("session with %s closed: %s", ev.peer_id or "?", ev.reason)
            self.pending.append(to_api(ev))

    def flush(self) -> None:
        self.take_reported()
        if self.evt.pending_bytes and not self.evt.flush():  # the tail of an event that spans slots, first
            return
        while self.pending:
            try:
                taken = self.evt.try_put(self.pending[0])
            except MessageTooLarge as e:  # cannot happen below limits.MAX_JOB_KEYS; a job is still reported
                self.pending[0] = too_large(self.pending[0], e)  # encoded once, not again every loop turn
                taken = self.evt.try_put(self.pending[0])
            if not taken:
                self.counters["event_ring_full"] += 1
                return
            ev = self.pending.popleft()
            self.owner.instruments.on_event(ev)
            if isinstance(ev, api.JobFinished):
                self.counters[f"jobs_{ev.kind}_{'ok' if ev.success else 'failed'}"] += 1
                if self.metrics is not None:
                    self.metrics.job(ev)

    def _log_failed(self, ev: JobDone) -> None:
        """One line per failed job (what an operator needs to tell a slow peer from a lost one), at most
        FAILED_LOG_PER_S a second: a dead peer fails thousands of jobs at once; the rest are counted."""
        now = self.clock()
        if now - self._failed_second >= 1.0:
            if self._failed_in_second > FAILED_LOG_PER_S:
                log.info("... and %d more failed jobs in that second", self._failed_in_second - FAILED_LOG_PER_S)
            self._failed_second, self._failed_in_second = now, 0
        self._failed_in_second += 1
        if self._failed_in_second <= FAILED_LOG_PER_S:
            log.info("%s job %d failed after %.3f s (%d keys moved): %s", ev.kind, ev.job_id, ev.seconds,
                     len(ev.keys), ev.reason)


def too_large(ev: api.Event, e: Exception) -> api.Event:
    """What to report instead of an event the event ring refused: the job still ends once, as a failure."""
    log.error("%s event too large for the event ring: %s", type(ev).__name__, e)
    if isinstance(ev, api.JobFinished):
        # an unsettled load stays unsettled: its RowsSettled still decides when vLLM may reuse the rows
        return api.JobFinished(ev.job_id, ev.kind, False, [], 0, ev.seconds, f"report too large: {e}", ev.settled)
    if isinstance(ev, api.LookupResult):
        return api.LookupResult(ev.lookup_id, None, f"answer too large: {e}")
    return api.WorkerError(f"{type(ev).__name__} dropped: {e}")


def to_api(ev: ReportedEvent) -> api.Event:
    if isinstance(ev, JobDone):
        # success means every key of the job moved: the adapter knows them (a 65,536-key job would echo 2.8 MB)
        keys = [] if ev.success else list(ev.keys)
        return api.JobFinished(ev.job_id, ev.kind, ev.success, keys, ev.nbytes, ev.seconds, ev.reason, ev.settled)
    if isinstance(ev, JobSettled):
        return api.RowsSettled(ev.job_id)
    if isinstance(ev, LookupAnswer):
        return api.LookupResult(ev.lookup_id, None if ev.present is None else list(ev.present), ev.reason)
    if isinstance(ev, ServeLookup):
        return api.PeerLookup(ev.peer_id, ev.lookup_id, ev.request_id, list(ev.keys))
    if isinstance(ev, SessionUp):
        return api.PeerUp(ev.peer_id, ev.address)
    if isinstance(ev, SessionClosed):
        return api.PeerDown(ev.peer_id, ev.reason)
    raise TypeError(f"not a session event: {ev!r}")  # the worker's own events go straight to emit
