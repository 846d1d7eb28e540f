"""JobBook: the store and load jobs vLLM submitted that the worker has not reported yet, each reported exactly once.

A job is opened and its command queued in one place (``submit``); one the worker cannot take fails at once, through
the same path as a failure the worker reports.  When the worker is gone every open job fails once (``fail_all``); a
job is never failed while its worker may still run (the supervisor calls ``fail_all`` only then: invariant 7)."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from vllm.v1.kv_offload.tiering.base import JobResult, TransferJob

from p2pworker import api
from p2pworker.api import JobKind  # the worker's own enum: one for both sides of the rings
from vllm_adapter.hints import SourceHints
from vllm_adapter.metrics import Counts
from vllm_adapter.outbox import Outbox

log = logging.getLogger("vllm_adapter.tier")

# vLLM drains for shutdown (its engine core's shutdown_state): parked stores no consumer is reading end at once, and
# again this often while jobs are open (a request still finishing in the drain parks afresh; its consumer had this
# long to fetch it).  Without it every stop waits out --shutdown-timeout and ends in a kill (invariant 6).
STOP_RESET_S = 2.0


@dataclass
class LoadState:
    """One request's loads, kept in that request's own ReqContext: two live requests may share a kv_request_id
    (sampling with n > 1, orchestrators that reuse ids), so nothing of this is keyed by the id."""

    failed: bool = False  # a load of it failed: its later lookups answer MISS (vLLM recomputes; no re-promotion loop)
    # a load of it went out: its later lookups answer MISS.  At most one load per request: when vLLM's CPU tier has
    # less room than the prompt, it promotes what fits, then its LRU evicts the request's own landed chunks to
    # promote the rest, and a HIT again would start another load, and so on (a pull that churns).  A request that
    # vLLM preempts and resumes keeps its context: what it lost meanwhile is recomputed, not pulled again.
    loaded: bool = False


def load_state(req_context) -> LoadState:
    """The request's LoadState (made at its first use)."""
    state = req_context.get_state(LoadState)
    if state is None:
        state = LoadState()
        req_context.set_state(state)
    return state


@dataclass(frozen=True)
class OpenJob:
    """A job vLLM submitted that the worker has not reported yet."""

    kind: JobKind
    keys: list[bytes]
    kv_request_id: str
    t0: float  # monotonic, at submit
    address: str = ""  # a load: the peer it pulls from
    ask: bool = False  # a load in one round trip: its keys were promised (HIT) before the peer was asked
    state: LoadState | None = None  # a load: its request's


class JobBook:
    def __init__(self, name: str, outbox: Outbox, counts: Counts, clock: Callable[[], float] = time.monotonic,
                 hints: SourceHints | None = None):
        self.clock = clock  # monotonic seconds; tests pass their own
        self.open: dict[int, OpenJob] = {}  # submitted to the worker, not yet reported to vLLM
        self.results: list[JobResult] = []  # reported by the worker (or failed here), not yet handed to vLLM
        self._name, self._outbox, self._counts = name, outbox, counts
        self._hints = hints if hints is not None else SourceHints(clock)  # what one-trip loads found missing
        self._stop_reset_at: float | None = None  # vLLM is draining for shutdown: the next ResetCache then
        # Loads reported failed before the worker's reads into their rows settled (vLLM 0.34's deferred release):
        # job id -> the event vLLM waits on before it reuses those rows.  Set on RowsSettled, or once the worker is
        # gone (its death ends every read it posted); never earlier (invariant 7).
        self.deferred: dict[int, threading.Event] = {}

    @property
    def pending(self) -> bool:
        """Jobs open, results vLLM has not taken yet, or rows whose release vLLM defers to us."""
        return bool(self.open or self.results or self.deferred)

    def take_results(self) -> list[JobResult]:
        out, self.results = self.results, []
        return out

    def submit(self, kind: JobKind, job: TransferJob, kv_request_id: str, refused: str, *, address: str = "",
               send: bool = True, now: float | None = None, ask: bool = False) -> bool:
        """Open ``job`` and queue its command; a job the worker cannot take (past the key limit, ``send`` False, no
        serving worker) fails now with ``refused`` as its reason.  ``ask``: a load in one round trip (its peer is
        asked for the keys when the fetch arrives).  True: queued."""
        keys = list(job.keys)  # OffloadKey is bytes
        state = load_state(job.req_context) if kind is JobKind.LOAD else None
        if state is not None:
            state.loaded = True
        self.open[job.job_id] = OpenJob(kind, keys, kv_request_id, self.clock() if now is None else now, address, ask,
                                        state)
        if len(keys) > api.MAX_JOB_KEYS:
            self.finish(job.job_id, False, None, 0.0, None, _too_many(len(keys)))
            return False
        cmd = _command(kind, job.job_id, kv_request_id, address, keys, job.chunk_ids, ask)
        if not send or not self._outbox.send(cmd):
            self.finish(job.job_id, False, None, 0.0, None, refused)
            return False
        return True

    def skip(self, job_id: int) -> None:
        """A store with nothing to keep for peers: reported done without a worker."""
        self.results.append(JobResult(job_id, True))

    def report(self, ev: api.JobFinished) -> None:
        """The worker's report of a job."""
        if ev.job_id not in self.open:
            log.error("worker reported unknown job %d; ignored", ev.job_id)
            return
        self.finish(ev.job_id, ev.success, ev.keys, ev.seconds, ev.nbytes, ev.reason, settled=ev.settled)

    def rows_settled(self, job_id: int) -> None:
        """The worker's RowsSettled: no read of that load can land any more; vLLM may reuse its rows."""
        event = self.deferred.pop(job_id, None)
        if event is None:
            log.error("worker settled job %d, which was not reported unsettled; ignored", job_id)
            return
        event.set()

    def release_deferred(self) -> None:
        """The worker is gone (its death ended every read it posted): every deferred release is set."""
        deferred, self.deferred = self.deferred, {}
        for event in deferred.values():
            event.set()

    def finish(self, job_id: int, success: bool, keys, seconds, nbytes, reason: str = "", *,
               settled: bool = True) -> None:
        """Report ``job_id`` to vLLM once.  ``settled`` False (a load the worker reported before its reads
        settled, only where vLLM defers releases): vLLM fails its keys at once and keeps their rows until the
        worker's RowsSettled sets the event."""
        job = self.open.pop(job_id)
        job_keys, rid = job.keys, job.kv_request_id
        if job.kind is JobKind.LOAD:
            if success:
                landed = job_keys  # success: every key moved (the worker does not echo them)
            else:
                asked = set(job_keys)
                landed = [k for k in (keys or []) if k in asked]
            if settled or set(landed) >= set(job_keys):  # nothing failed: vLLM takes no event (it asserts so)
                self.results.append(JobResult(job_id, success, successful_keys=landed, transfer_time=seconds,
                                              transfer_bytes=nbytes))
            else:
                event = self.deferred[job_id] = threading.Event()
                self.results.append(JobResult(job_id, False, successful_keys=landed, transfer_time=seconds,
                                              transfer_bytes=nbytes, deferred_release=event))
            # a one-trip load the source's engine answered short (not one that timed out, was refused, or lost its
            # worker or its peer: those stay failures, and say nothing of what the source holds)
            short = job.ask and not success and api.NOT_HELD in (reason or "")
            if job.ask:
                self._one_trip_done(job, landed, success, short, reason)
            if not success and job.state is not None:
                job.state.failed = True  # its later lookups MISS: vLLM recomputes, no re-promotion loop
            if success:
                self._counts.loads_ok += 1
            elif short:  # the expected way a one-trip load learns what its peer lacks
                self._counts.loads_short += 1
            else:
                self._counts.loads_failed += 1
                log.warning("load for %s failed (%s); recomputing", rid, reason or "worker gone")
        else:
            self.results.append(JobResult(job_id, success, transfer_time=seconds, transfer_bytes=nbytes))
            if success:
                self._counts.stores_ok += 1
            else:
                self._counts.stores_failed += 1

    def _one_trip_done(self, job: OpenJob, landed: list[bytes], success: bool, short: bool, reason: str) -> None:
        """A one-trip load ended: count what its promise brought, and remember at its peer what did and did not come
        (the next request that starts with a missing key asks first: vllm_adapter/hints.py)."""
        self._counts.pull_keys_landed += len(landed)
        self._hints.held(job.address, landed)
        if success or landed:
            self._hints.answered(job.address)
        if success:
            return
        self._counts.pull_keys_missed += len(job.keys) - len(landed)
        if short:  # only the source's own answer says what it lacks: the first key it did not bring (the source
            got = set(landed)  # asks its engine for the prefix only, so keys past that one say nothing)
            gap = next((k for k in job.keys if k not in got), None)
            if gap is not None:
                self._hints.lacked(job.address, [gap])
        else:  # the source failed (dead, refusing, busy, another model)? its next pulls ask first a while (hints.py)
            self._hints.failed(job.address, reason)
        log.info("pulled %d of %d keys of %s from %s; vLLM recomputes from the first key not loaded (%s)",
                 len(landed), len(job.keys), job.kv_request_id, job.address, reason or "worker gone")

    def fail_all(self) -> None:
        """The worker is gone: every open job fails, once."""
        now = self.clock()
        for job_id, job in list(self.open.items()):
            self.finish(job_id, False, None, now - job.t0, None)  # no reason: our worker went, not the source

    def refuse(self, cmd: api.Command, why: str) -> bool:
        """A job command the ring cannot carry: its job ends now.  False: not an open job's command."""
        if isinstance(cmd, (api.StoreJob, api.LoadJob)) and cmd.job_id in self.open:
            self.finish(cmd.job_id, False, None, 0.0, None, why)
            return True
        return False

    def end_parked_for_stop(self, engine: Any) -> None:
        """vLLM drains for shutdown: our open jobs keep it stepping until --shutdown-timeout, then it kills the engine
        and leaves the region file behind.  The worker ends the parked stores no consumer is reading (a lease holds
        its rows until the consumer's Release, the lease's end or its process's exit: invariant 7), now and every
        STOP_RESET_S while jobs are open; loads go on (their requests finish in the drain)."""
        now = self.clock()
        if self._stop_reset_at is not None and now < self._stop_reset_at:
            return
        if self._stop_reset_at is None:
            log.info("vLLM is shutting down: ending the %d parked store(s) of p2pworker %s that no consumer is "
                     "reading", sum(j.kind is JobKind.STORE for j in self.open.values()), self._name)
        self._stop_reset_at = now + STOP_RESET_S
        # loads go on in a drain (their requests still finish); in abort mode (--shutdown-timeout 0) vLLM aborted
        # every request, so they are cancelled too
        if self._outbox.send(api.ResetCache("vLLM is shutting down", loads=engine.aborting())):
            self._outbox.flush()


def _command(kind: JobKind, job_id: int, kv_request_id: str, address: str, keys: list[bytes], chunk_ids,
             ask: bool) -> api.Command:
    if kind is JobKind.LOAD:
        return api.LoadJob(job_id, address, kv_request_id, keys, _rows(chunk_ids), ask)
    return api.StoreJob(job_id, kv_request_id, keys, _rows(chunk_ids))


def _too_many(n: int) -> str:
    return (f"job of {n} keys exceeds p2pworker's hard limit of {api.MAX_JOB_KEYS} keys per job "
            f"(p2pworker.limits.MAX_JOB_KEYS)")


def _rows(chunk_ids) -> list[int]:
    return np.asarray(chunk_ids).tolist()  # one C call (vs ~0.2 us per row in a comprehension)
