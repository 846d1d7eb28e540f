"""Which silence counts against a control peer, and when it is judged (sans-IO: the transport feeds it its clock).

A link is declared lost when its peer has been silent for ``deadline_s`` (heartbeat_interval_s x heartbeat_liveness,
3 s by default).  We measure that silence, and we can only hear a peer while our own loop runs: when this process is
not scheduled for seconds (SIGSTOP, a host whose other work starves it of CPU, swapping), the peer's pings wait in
the kernel and in libzmq's pipes, and a tick that judged by the wall clock on waking would blame the peer for our own
stall.  (So it went on a 2-core host with a compile in another login session: both workers logged ``heartbeat lost:
silent for 3.3 s`` about a healthy link, and the load on it failed.)

The rule:

- **Any frame counts.**  Every frame received on an UP link (data, ping, anything) restarts its peer's silence.
- **The run clock.**  Silence is measured on :class:`RunClock`: the wall clock, except that a gap between two reads
  of our sockets ("looks") counts for at most ``stall_s``.  A longer gap is a stall of ours: only ``stall_s`` of it
  is counted against peers, the rest is ``excluded_s``.  Between looks the clock stops once ``stall_s`` has passed,
  so whatever asks it the time meanwhile gets the value the next look confirms (it never jumps back).
- **Read before judging.**  A look that ends a stall may find nothing readable yet: libzmq's I/O thread was stopped
  too, and the bytes the peer sent meanwhile are still in the kernel.  So the tick right after a stall judges no
  link; the next one does, whatever happened since (a loop that stalls at every look still judges every other
  tick, so a dead peer is never hidden for ever).  The table :data:`CLOCK_MOVES` says it; :data:`JUDGING` lists
  the phases whose tick judges.

The bound on noticing a dead peer: a link is declared lost at the first judging tick after its peer's silence on the
run clock passed ``deadline_s``.  While our loop runs (it looks at its sockets at least every ``stall_s``), that is
within ``deadline_s + tick_s`` of the peer's last frame (3.25 s by default); a stall of ours adds only its length
beyond ``stall_s`` and at most one tick.  A refused or failed dial is still known at once (the socket monitor,
zmq_outbound.py).
"""

from __future__ import annotations

import enum

# A gap between two looks shorter than this is an ordinary hiccup of a Python loop (a GC pass, a long turn), never a
# stall, whatever the tick; with the default tick (0.25 s) the bound is 2 ticks, 0.5 s.
MIN_STALL_S = 0.2
WARN_EVERY_S = 60.0  # stalls are logged at most this often (each is counted)


def stall_bound_s(tick_s: float) -> float:
    """The longest gap between two looks that still counts in full: two ticks (a loop that runs looks at least once
    per tick, the worker's at most one of its own turns later), never under MIN_STALL_S."""
    return max(2 * tick_s, MIN_STALL_S)


class Phase(enum.Enum):
    RUNNING = "running"  # no stall since the last judging tick: the next tick judges
    RESUMED = "resumed"  # a look just ended a stall: what the peers sent meanwhile may not be readable yet
    WAITED = "waited"  # one tick passed without judging since the stall: the next tick judges, stalls or not


class Event(enum.Enum):
    STALL = "stall"  # a look after a gap longer than stall_s
    TICK = "tick"  # the transport's timer tick


# (phase, event) -> next phase.  A look without a stall changes nothing.
CLOCK_MOVES: dict[tuple[Phase, Event], Phase] = {
    (Phase.RUNNING, Event.STALL): Phase.RESUMED,
    (Phase.RESUMED, Event.STALL): Phase.RESUMED,  # still no tick since: still nothing judged
    (Phase.WAITED, Event.STALL): Phase.WAITED,  # a tick was skipped already: the next one judges (bounded delay)
    (Phase.RUNNING, Event.TICK): Phase.RUNNING,
    (Phase.RESUMED, Event.TICK): Phase.WAITED,  # this tick reads and pings, judges nobody
    (Phase.WAITED, Event.TICK): Phase.RUNNING,
}
JUDGING = frozenset({Phase.RUNNING, Phase.WAITED})  # the phases whose tick may declare a link lost


class RunClock:
    """Time as far as a peer's silence is concerned: the wall time our loop was there to hear it."""

    def __init__(self, now: float, stall_s: float) -> None:
        self.stall_s = stall_s
        self.phase = Phase.RUNNING
        self.excluded_s = 0.0  # wall time not counted: every stall beyond stall_s, so far
        self.last_stall_s = 0.0  # the latest stall's whole gap, and the wall time it ended
        self.last_stall_end = float("-inf")
        self._looked = now
        self._warned = float("-inf")  # wall time of the last WARNING about a stall

    def now(self, wall: float) -> float:
        """The run clock at wall time ``wall``: stopped ``stall_s`` after the last look until the next one."""
        return wall - self.excluded_s - max(0.0, wall - self._looked - self.stall_s)

    def look(self, wall: float) -> float:
        """Our loop reads its sockets at ``wall``.  Returns the gap since the previous look when it was a stall
        (longer than ``stall_s``), else 0.0."""
        gap = wall - self._looked
        if gap <= 0.0:  # same instant (or a clock that went back): nothing ran in between
            return 0.0
        self._looked = wall
        if gap <= self.stall_s:
            return 0.0
        self.excluded_s += gap - self.stall_s
        self.last_stall_s, self.last_stall_end = gap, wall
        self.phase = CLOCK_MOVES[(self.phase, Event.STALL)]
        return gap

    def tick(self) -> bool:
        """The transport's tick: True when it may judge silence (declare a link lost)."""
        judges = self.phase in JUDGING
        self.phase = CLOCK_MOVES[(self.phase, Event.TICK)]
        return judges

    def note(self, gap_s: float, wall: float, min_gap_s: float, counters: dict[str, int]) -> str | None:
        """Count a stall of ``gap_s`` that just ended in ``counters`` (``stalls``, ``stalled_ms``: the transport's);
        returns the WARNING line for it if it is worth one: at least ``min_gap_s`` (the heartbeat interval: shorter
        ones are only counted) and none logged for a minute (a starved host stalls often)."""
        counters["stalls"] += 1
        counters["stalled_ms"] += int((gap_s - self.stall_s) * 1000)
        if gap_s < min_gap_s or wall - self._warned < WARN_EVERY_S:
            return None
        self._warned = wall
        return (f"control: this worker did not read its sockets for {gap_s:.1f} s (stopped, starved of CPU by its "
                f"host, or a long turn of its loop); that silence is not counted against its peers "
                f"({counters['stalls']} stall(s) so far, {counters['stalled_ms'] / 1000:.1f} s not counted; "
                f"logged at most once a minute)")

    def hint(self, wall: float, within_s: float) -> str:
        """For the reason of a link the peer dropped: "declared us lost while this process did not run for 4.0 s"
        when a stall ended within ``within_s`` before ``wall`` (a peer that kept running heard nothing for real
        meanwhile, and may have declared us lost), else ""."""
        if wall - self.last_stall_end > within_s:
            return ""
        return f"declared us lost while this process did not run for {self.last_stall_s:.1f} s"
