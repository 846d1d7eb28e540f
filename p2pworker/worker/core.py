"""What every room of the worker shares: the config, the clock, the rings, the job ledger, the counters, the
instrument points, the attachment (once AttachRegion came) and the phase.

Not a room and not a way between rooms: a room that needs another room's help is handed that room (typed by the
protocols of ports.py), so the worker's modules import each other in one direction only, with loop.py on top.
"""

from __future__ import annotations

import collections
import logging
import os
from typing import Callable

from p2pworker import api
from p2pworker.config import WorkerConfig
from p2pworker.control import ControlTransport
from p2pworker.data import DataTransport
from p2pworker.instruments import Instruments
from p2pworker.session import Reporter, SessionContext
from p2pworker.shm import KVRegion, Ring
from p2pworker.worker.attachment import Attachment
from p2pworker.worker.phase import PhaseEvent, WorkerPhase, next_phase

log = logging.getLogger("p2pworker.worker")


class Core:
    def __init__(self, cfg: WorkerConfig, clock: Callable[[], float], cmd: Ring, evt: Ring) -> None:
        self.cfg = cfg
        self.clock = clock
        self.cmd = cmd
        self.evt = evt
        self.started = clock()
        self.counters: collections.Counter = collections.Counter()
        self.reporter = Reporter()
        # the named points test hooks implement (p2pworker/instruments.py); nothing runs at them by default.  A hook
        # replaces this object after the rooms exist: rooms read it through the core at each use, never keep it.
        self.instruments = Instruments()
        self.att: Attachment | None = None  # set once by AttachRegion
        self.phase = WorkerPhase.RUNNING
        self.stop_reason = ""

    # ------------------------------------------------------------ the attachment's parts (None before AttachRegion)
    @property
    def ctl(self) -> ControlTransport | None:
        return self.att.ctl if self.att is not None else None

    @property
    def data(self) -> DataTransport | None:
        return self.att.data if self.att is not None else None

    @property
    def ctx(self) -> SessionContext | None:
        return self.att.ctx if self.att is not None else None

    @property
    def region(self) -> KVRegion | None:
        return self.att.region if self.att is not None else None

    @property
    def identity(self) -> dict:
        """The adapter's KV identity (model, dtype, ...) from AttachRegion: the metrics' labels."""
        return self.att.identity if self.att is not None else {}

    # ------------------------------------------------------------ phase
    @property
    def stopping(self) -> bool:
        return self.phase is WorkerPhase.STOPPING

    def stop(self, reason: str) -> None:
        if not self.stopping:
            log.info("stopping: %s", reason)
            self.phase = next_phase(self.phase, PhaseEvent.STOP)
            self.stop_reason = reason

    def drain(self) -> None:
        self.phase = next_phase(self.phase, PhaseEvent.DRAIN)

    def abort(self, why: str) -> None:
        """Reads we posted will not settle and cannot be aborted (NIXL): the only safe end is this process's death,
        which stops every read it initiated before the adapter reports their jobs.  No orderly shutdown: that
        would unmap and close the rings under the posted reads."""
        log.critical("%s; exiting now so that they cannot land in rows vLLM reuses", why)
        try:
            self.evt.try_put(api.WorkerError(f"exiting: {why}"))
        finally:
            os._exit(70)
