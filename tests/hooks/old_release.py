"""A worker of a p2pworker release from before the ring API was versioned, as far as the adapter can tell.

``P2PWORKER_HOOK=tests.hooks.old_release:install`` (with ``PYTHONPATH`` naming the repository): the worker takes
every command as usual but its ``Ready`` carries neither ``api`` nor ``hold_s`` (both at their defaults, 0), as an
operator-launched worker of an older image would send it.  The adapter must refuse it at start, not serve with it.
"""

from __future__ import annotations

import msgspec

from p2pworker import api
from p2pworker.instruments import Instruments


class OldRelease(Instruments):
    def on_ready(self, ready: api.Ready) -> api.Ready:
        # the fields an older release did not send, at the defaults its Ready decodes with
        return msgspec.structs.replace(ready, api=0, hold_s=0.0)


def install(worker) -> None:
    worker.instruments = OldRelease()
