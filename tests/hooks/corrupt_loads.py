"""Negative control for tests/e2e: a worker that scrambles every block it loads.

Loaded into the decode engine's spawned worker with ``P2PWORKER_HOOK=tests.hooks.corrupt_loads:install`` (and
``PYTHONPATH`` naming the repository).  The KV still comes from P2P, but rotated within each row (valid values in
the wrong places), so the engine's output must differ from the single engine's: proof that the equality tests can
fail.

Row writes (invariant 7): our own rows, by the worker's own thread, at the instrument point ``on_job_done`` (the
load's reads settled, its JobFinished not yet queued for the adapter), so never after the job was reported.
"""

from __future__ import annotations

import logging

import numpy as np

from p2pworker import api
from p2pworker.instruments import Instruments
from p2pworker.session.reporter import JobDone

log = logging.getLogger("tests.hooks.corrupt_loads")


class CorruptLoads(Instruments):
    """Notes each load's rows when its command arrives; rotates them when the load ends, before it is reported."""

    def __init__(self, worker):
        self.worker = worker
        self.rows_of_job: dict[int, dict[bytes, int]] = {}

    def on_command(self, cmd) -> None:
        if isinstance(cmd, api.LoadJob):
            self.rows_of_job[cmd.job_id] = dict(zip(cmd.keys, cmd.rows))

    def on_job_done(self, ev: JobDone) -> None:
        if ev.kind == "load":
            rows = self.rows_of_job.pop(ev.job_id, {})
            if self.worker.region is not None:  # the keys that moved (all of them on success)
                _scramble(self.worker, [rows[k] for k in ev.keys if k in rows])


def install(worker) -> None:
    worker.instruments = CorruptLoads(worker)
    log.warning("test hook: this worker CORRUPTS every block it loads")


def _scramble(worker, rows: list[int]) -> None:
    arr = worker.region.array()
    shift = max(64, arr.shape[1] // 3 // 64 * 64)  # whole 64-byte units: every value stays a valid number
    for r in rows:
        arr[r] = np.roll(arr[r], shift)
    worker.counters["test_corrupted_rows"] += len(rows)
