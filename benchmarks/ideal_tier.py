"""The floor under any secondary tier in ``benchmarks/pd_tier.py`` (``--tiers ideal``): a tier that moves the
bytes at no cost but one in-process copy.

The decode scheduler stages each request's bytes here (``STAGED``) before it starts the clock; the tier then
answers every staged key HIT, and ``submit_load`` copies the staged bytes into the rows vLLM assigned, on the
scheduler thread, and reports the job done at the next poll.  No process, socket or peer: what is left is vLLM's
own work (its lookup passes, the promotion, the step) and one copy of the request.  A real tier pays at least
that; ``ideal`` ÷ a tier's warm time is how far that tier is from the floor, and in-tree ÷ ``ideal`` is the most
any tier can beat the in-tree one by in this harness.  The prefill side only acknowledges its stores.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import ClassVar

import numpy as np
from vllm.v1.kv_offload.base import LookupResult, Medium, RequestOffloadingContext
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

STAGED: dict[bytes, np.ndarray] = {}  # key -> its row's bytes, staged by the harness outside the timed fetch


class IdealTier(SecondaryTierManager):
    medium: ClassVar[Medium] = Medium.CPU

    def __init__(self, offloading_spec, primary_kv_view, tier_type, backpressure_detector=None, **_ignored):
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self._view = np.asarray(primary_kv_view)
        self._done: list[JobResult] = []

    def lookup(self, key, req_context) -> LookupResult:
        return LookupResult.HIT if bytes(key) in STAGED else LookupResult.MISS

    def submit_store(self, job: TransferJob) -> None:
        self._done.append(JobResult(job.job_id, True))

    def submit_load(self, job: TransferJob) -> None:
        view = self._view
        for k, row in zip(job.keys, job.chunk_ids.tolist()):
            view[row] = STAGED[bytes(k)]
        self._done.append(JobResult(job.job_id, True, transfer_time=0.0))

    def get_finished_jobs(self) -> Iterable[JobResult]:
        out, self._done = self._done, []
        return out

    def on_new_request(self, req_context) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def drain_jobs(self) -> None:
        return  # every job is done when submitted

    def shutdown(self) -> None:
        self._view = None  # vLLM keeps the region mapped while a view of it lives
