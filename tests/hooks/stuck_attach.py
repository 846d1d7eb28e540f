"""A worker stuck on its way to Ready (a hung import, a registration that never returns), as far as the adapter
can tell.

``P2PWORKER_HOOK=tests.hooks.stuck_attach:install`` (with ``PYTHONPATH`` naming the repository): the worker attaches
the rings and takes the adapter's ``AttachRegion``, then sleeps in it for good: no port bound, no ``Ready``, no
heartbeat.  SIGKILL ends it (a first SIGTERM only asks the loop it never returns to).
"""

from __future__ import annotations

import time

from p2pworker.instruments import Instruments


class StuckAttach(Instruments):
    def on_attach(self, cmd) -> None:
        while True:
            time.sleep(3600)


def install(worker) -> None:
    worker.instruments = StuckAttach()
