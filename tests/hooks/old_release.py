"""A worker of a p2pworker release from before the ring API was versioned, as far as the adapter can tell.

``P2PWORKER_HOOK=tests.hooks.old_release:install`` (with ``PYTHONPATH`` naming the repository): the worker takes
every command as usual but its ``Ready`` carries neither ``api`` nor ``hold_s`` (both at their defaults, 0), as an
operator-launched worker of an older image would send it.  The adapter must refuse it at start, not serve with it.
"""

from __future__ import annotations

from p2pworker import api


def install(worker) -> None:
    ready = api.Ready

    def old_ready(*args, **kw):
        kw.pop("api", None)
        kw.pop("hold_s", None)
        return ready(*args, **kw)

    api.Ready = old_ready  # the worker looks api.Ready up when it attaches, after this hook ran
