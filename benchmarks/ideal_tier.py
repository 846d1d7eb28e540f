"""Floors under any secondary tier in ``benchmarks/pd_tier.py``: ``--tiers ideal`` and ``ideal-nocopy``.

The decode scheduler stages each request's bytes here (``STAGED``) before it starts the clock; the tier answers
every staged key HIT.  ``ideal``: ``submit_load`` starts a thread that copies the staged rows into the rows vLLM
assigned (one thread, numpy row by row, off the scheduler thread, as a tier that copies would) and the job is
reported at the first poll after the copy ended.  ``ideal-nocopy``: reported at the next poll without copying
(the harness then skips its byte check): what is left is vLLM's own work, its lookup passes, the promotions, the
step and the sleep, i.e. the time no tier can go below in this harness.  Neither has a process, socket or peer.

The copy floor is optimistic in one way (the staged bytes were just written, so at 1-16 MiB they may be in the
CPU caches, unlike a read out of another process) and pessimistic in another (one thread; ours copies with two).
The prefill side only acknowledges its stores.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import ClassVar

import numpy as np
from vllm.v1.kv_offload.base import LookupResult, Medium, RequestOffloadingContext
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

STAGED: dict[bytes, np.ndarray] = {}  # key -> its row's bytes, staged by the harness outside the timed fetch


class IdealTier(SecondaryTierManager):
    medium: ClassVar[Medium] = Medium.CPU

    def __init__(self, offloading_spec, primary_kv_view, tier_type, backpressure_detector=None, copy: bool = True,
                 **_ignored):
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self._view = np.asarray(primary_kv_view)
        self._copy = copy
        self._done: list[JobResult] = []  # appended by copy threads, taken by the scheduler: under _lock
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    def lookup(self, key, req_context) -> LookupResult:
        return LookupResult.HIT if bytes(key) in STAGED else LookupResult.MISS

    def _finish(self, job_id: int) -> None:
        with self._lock:
            self._done.append(JobResult(job_id, True, transfer_time=0.0))

    def submit_store(self, job: TransferJob) -> None:
        self._finish(job.job_id)

    def submit_load(self, job: TransferJob) -> None:
        if not self._copy:
            self._finish(job.job_id)
            return
        rows = [(row, STAGED[bytes(k)]) for k, row in zip(job.keys, job.chunk_ids.tolist())]

        def copy(view=self._view, job_id=job.job_id):
            for row, data in rows:
                view[row] = data  # numpy drops the GIL for a row this size
            # Invariant 7: the rows vLLM assigned to this load, written by vLLM's own (scheduler) process, all of
            # them before the job is reported just below; nothing writes them after.
            self._finish(job_id)

        t = threading.Thread(target=copy, daemon=True)
        self._threads = [x for x in self._threads if x.is_alive()] + [t]
        t.start()

    def get_finished_jobs(self) -> Iterable[JobResult]:
        with self._lock:
            out, self._done = self._done, []
        return out

    def on_new_request(self, req_context) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def has_pending_work(self) -> bool:
        return any(t.is_alive() for t in self._threads)

    def drain_jobs(self) -> None:
        for t in self._threads:
            t.join(60)

    def shutdown(self) -> None:
        self.drain_jobs()
        self._view = None  # vLLM keeps the region mapped while a view of it lives
