"""A data plane whose reads stall: while the file ``$P2PW_STALL_READS`` exists, the worker collects no settled read,
so its sessions keep every posted read pending (as a slow NIC or a stalled peer would).

``P2PWORKER_HOOK=tests.hooks.stalled_reads:install`` (with ``PYTHONPATH`` naming the repository).  Removing the file
lets the reads settle on the loop's next turn.  ``$P2PW_STALL_LOG`` (optional) gets one line per read settled and per
job reported, with the monotonic time, so a test can tell which came first.
"""

from __future__ import annotations

import os
import time

from p2pworker.instruments import Instruments


class StalledReads(Instruments):
    def __init__(self, flag: str, log: str | None):
        self._flag, self._log = flag, log

    def on_poll_data(self) -> bool:
        return not os.path.exists(self._flag)

    def on_read_settled(self, transfer_id: int, ok: bool) -> None:
        self._write(f"read {transfer_id} {ok}")

    def on_event(self, ev) -> None:
        kind = type(ev).__name__
        if kind in ("JobFinished", "RowsSettled"):
            self._write(f"{kind} {ev.job_id} {getattr(ev, 'settled', '')}")

    def _write(self, line: str) -> None:
        if self._log:
            with open(self._log, "a") as f:
                f.write(f"{time.monotonic():.6f} {line}\n")


def install(worker) -> None:
    worker.instruments = StalledReads(os.environ["P2PW_STALL_READS"], os.environ.get("P2PW_STALL_LOG"))
