"""The worker's phase: what it still takes, as a table the loop and its tests read.

Whether a region is attached is not a phase (it is the optional :class:`~p2pworker.worker.attachment.Attachment`):
a worker may be told to drain, or to stop, before the adapter attached anything.

    RUNNING   --DRAIN-->   DRAINING   new stores and loads are refused; what is open finishes
    DRAINING  --DRAINED--> DRAINED    nothing open and nothing in flight: Drained went out once; still refusing
    any       --STOP-->    STOPPING   the loop ends after this turn; shutdown fails or finishes every job once
"""

from __future__ import annotations

import enum


class WorkerPhase(enum.Enum):
    RUNNING = "running"
    DRAINING = "draining"
    DRAINED = "drained"
    STOPPING = "stopping"

    @property
    def takes_work(self) -> bool:
        return self is WorkerPhase.RUNNING


class PhaseEvent(enum.Enum):
    DRAIN = "drain"  # the adapter's Drain command
    DRAINED = "drained"  # nothing open, nothing in flight, while draining
    STOP = "stop"  # Shutdown command, a signal, the adapter gone, a command over the ring's limit


# (phase, event) -> next phase.  A move missing here is a bug in the loop (PhaseError), not something to ignore.
PHASE_MOVES: dict[tuple[WorkerPhase, PhaseEvent], WorkerPhase] = {
    (WorkerPhase.RUNNING, PhaseEvent.DRAIN): WorkerPhase.DRAINING,
    (WorkerPhase.DRAINING, PhaseEvent.DRAIN): WorkerPhase.DRAINING,
    (WorkerPhase.DRAINED, PhaseEvent.DRAIN): WorkerPhase.DRAINED,  # a second Drain: Drained went out already
    (WorkerPhase.STOPPING, PhaseEvent.DRAIN): WorkerPhase.STOPPING,  # stopping refuses more than draining does
    (WorkerPhase.DRAINING, PhaseEvent.DRAINED): WorkerPhase.DRAINED,
    (WorkerPhase.RUNNING, PhaseEvent.STOP): WorkerPhase.STOPPING,
    (WorkerPhase.DRAINING, PhaseEvent.STOP): WorkerPhase.STOPPING,
    (WorkerPhase.DRAINED, PhaseEvent.STOP): WorkerPhase.STOPPING,
    (WorkerPhase.STOPPING, PhaseEvent.STOP): WorkerPhase.STOPPING,
}


class PhaseError(RuntimeError):
    pass


def next_phase(phase: WorkerPhase, event: PhaseEvent) -> WorkerPhase:
    try:
        return PHASE_MOVES[(phase, event)]
    except KeyError:
        raise PhaseError(f"no move from {phase.name} on {event.name}") from None
