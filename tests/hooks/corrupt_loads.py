"""Negative control for tests/e2e: a worker that scrambles every block it loads.

Loaded into the decode engine's spawned worker with ``P2PWORKER_HOOK=tests.hooks.corrupt_loads:install`` (and
``PYTHONPATH`` naming the repository).  The KV still comes from P2P, but rotated within each row (valid values in
the wrong places), so the engine's output must differ from the single engine's: proof that the equality tests can
fail.

Row writes (invariant 7): our own rows, by the worker's own thread, in ``reporter.take`` — before the load's
JobFinished is queued for the adapter — so never after the job was reported.
"""

from __future__ import annotations

import logging

import numpy as np

from p2pworker import api
from p2pworker.session.reporter import JobDone

log = logging.getLogger("tests.hooks.corrupt_loads")


def install(worker) -> None:
    rows_of_job: dict[int, dict[bytes, int]] = {}
    handle, take = worker._handle, worker.reporter.take

    def handle_and_note(cmd) -> None:
        if isinstance(cmd, api.LoadJob):
            rows_of_job[cmd.job_id] = dict(zip(cmd.keys, cmd.rows))
        handle(cmd)

    def take_and_scramble():
        events = take()
        for ev in events:
            if isinstance(ev, JobDone) and ev.kind == "load":
                rows = rows_of_job.pop(ev.job_id, {})
                if worker.region is not None:  # the keys that moved (all of them on success)
                    _scramble(worker, [rows[k] for k in ev.keys if k in rows])
        return events

    worker._handle, worker.reporter.take = handle_and_note, take_and_scramble
    log.warning("test hook: this worker CORRUPTS every block it loads")


def _scramble(worker, rows: list[int]) -> None:
    arr = worker.region.array()
    shift = max(64, arr.shape[1] // 3 // 64 * 64)  # whole 64-byte units: every value stays a valid number
    for r in rows:
        arr[r] = np.roll(arr[r], shift)
    worker.counters["test_corrupted_rows"] += len(rows)
