"""A worker that cannot attach the region and then does not die, as far as the adapter can tell (one stuck in the
kernel: SIGKILL does not end it until the kernel lets go).

``P2PWORKER_HOOK=tests.hooks.failed_attach_stuck:install`` (with ``PYTHONPATH`` naming the repository): on the
adapter's ``AttachRegion`` the worker reports a (non-fatal) attach error, as one whose port is taken does, then sleeps
in it for good: it reads no Shutdown and sends nothing more.  Only a SIGKILL that reaches it ends it.
"""

from __future__ import annotations

import time

from p2pworker import api


def install(worker) -> None:
    def failed(cmd) -> None:
        # straight into the event ring: the loop that would send it never runs again
        worker.evt.try_put(api.WorkerError("AttachRegion: test hook: cannot attach (then stuck)", False, True))
        while True:
            time.sleep(3600)

    worker._attach = failed  # the command loop looks it up per command, after this hook ran
