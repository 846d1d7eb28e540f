"""A worker that cannot attach the region and then does not die, as far as the adapter can tell (one stuck in the
kernel: SIGKILL does not end it until the kernel lets go).

``P2PWORKER_HOOK=tests.hooks.failed_attach_stuck:install`` (with ``PYTHONPATH`` naming the repository): on the
adapter's ``AttachRegion`` the worker reports a (non-fatal) attach error, as one whose port is taken does, then sleeps
in it for good: it reads no Shutdown and sends nothing more.  Only a SIGKILL that reaches it ends it.
"""

from __future__ import annotations

import time

from p2pworker import api
from p2pworker.instruments import Instruments


class FailedAttachStuck(Instruments):
    def __init__(self, worker):
        self.worker = worker

    def on_attach(self, cmd) -> None:
        # straight into the event ring: the loop that would send it never runs again
        self.worker.evt.try_put(api.WorkerError("AttachRegion: test hook: cannot attach (then stuck)", False, True))
        while True:
            time.sleep(3600)


def install(worker) -> None:
    worker.instruments = FailedAttachStuck(worker)
