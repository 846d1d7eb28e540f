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
    on_send        a session message about to go out on its link or lane   watch it
    on_received    a peer's frame, before its session decodes it           watch it (decode a copy)
    on_read_settled  one of our posted reads settled (ok or not)           watch it
    on_poll_data   the loop is about to collect settled reads             return False to leave them for a later
                                                                           turn (a stalled data plane)
    on_event       an event the event ring took                            watch it
    on_sleep       the loop is about to sleep up to timeout_s              watch it
    on_woke        that sleep ended                                        watch it
    on_stop        the orderly stop begins (nothing is closed yet)         watch it (write what it gathered)

The watch-only points are for tracing (benchmarks/hops/trace_hook.py): each is one call of a method that does
nothing unless a hook overrides it, so they stay on the hot path.

Test code reaches them through ``$P2PWORKER_HOOK=module:function`` (``p2pworker.worker.install_hook``): the function
gets the worker and sets ``worker.instruments`` to its own subclass.  tests/hooks/ holds the ones the suite uses.
Renaming a worker method cannot silently break a hook: hooks name only these points.
"""

from __future__ import annotations

from p2pworker import api
from p2pworker.protocol.messages import Message
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

    def on_send(self, link: str, msg: Message, lane: bool) -> None:
        """A session's message, before it is encoded and sent on ``link``'s control socket or (``lane``) its lane."""

    def on_received(self, link: str, frame: bytes, lane: bool) -> None:
        """A frame from ``link`` (its control socket, or ``lane``), before its session decodes it."""

    def on_read_settled(self, transfer_id: int, ok: bool) -> None:
        """One of this worker's posted reads settled (the data plane says so); its session is told next."""

    def on_poll_data(self) -> bool:
        """False: the loop leaves settled reads uncollected this turn (their sessions still count them pending)."""
        return True

    def on_event(self, ev: api.Event) -> None:
        """The event ring took ``ev`` (it is the adapter's now)."""

    def on_sleep(self, timeout_s: float) -> None:
        """The loop is about to wait on its sources for up to ``timeout_s``."""

    def on_woke(self) -> None:
        """The wait that ``on_sleep`` announced ended (a source is ready, or the timeout passed)."""

    def on_stop(self) -> None:
        """The orderly stop begins; nothing is closed yet."""
