"""Named points where test code may watch or change what a worker does.

The worker calls its ``instruments`` (an ``Instruments``; the default does nothing) at these points, and nowhere
else lets outside code in:

    point          when                                                    may
    on_command     a command was read from the adapter, before it is run   watch it
    on_attach      AttachRegion is about to be run                         raise (an attach error), block (a stuck
                                                                           worker), write to the event ring
    on_ready       the Ready about to be sent to the adapter               return another Ready (an older release)
    on_job_done    a job's end, before it is queued for the adapter        write the job's own rows (a load's reads
                   (a load's reads have settled)                           settled; the job is not reported yet)

Test code reaches them through ``$P2PWORKER_HOOK=module:function`` (``p2pworker.worker.install_hook``): the function
gets the worker and sets ``worker.instruments`` to its own subclass.  tests/hooks/ holds the ones the suite uses.
Renaming a worker method cannot silently break a hook: hooks name only these points.
"""

from __future__ import annotations

from p2pworker import api
from p2pworker.session.reporter import JobDone


class Instruments:
    """The worker's instrument points; each does nothing here.  Subclass and override what a test needs."""

    def on_command(self, cmd: api.Command) -> None:
        """A command from the adapter, before the worker runs it."""

    def on_attach(self, cmd: api.AttachRegion) -> None:
        """Before the worker attaches the region AttachRegion names."""

    def on_ready(self, ready: api.Ready) -> api.Ready:
        """The Ready the worker is about to send; what this returns is sent."""
        return ready

    def on_job_done(self, ev: JobDone) -> None:
        """A job's end, before it is queued for the adapter."""
