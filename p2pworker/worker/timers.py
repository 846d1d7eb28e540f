"""The loop's clock and its periodic duties, each a :class:`Timer` the loop asks "due now?" once per turn.

    tick        tick_s        session and parking-lot time-outs, lane deadlines, kept peers re-opened, Drained
    heartbeat   HEARTBEAT_S   proof of life for the adapter, only while no event is waiting anyway
    liveness    0.25 s        is the adapter (the command ring's producer) still there?
    trim        60 s          freed heap handed back to the kernel
"""

from __future__ import annotations

import ctypes
import time
from dataclasses import dataclass
from typing import Callable

from p2pworker import api

LIVENESS_CHECK_S = 0.25
TRIM_S = 60.0  # how often freed heap is handed back to the kernel (see trim_heap)
_malloc_trim = getattr(ctypes.CDLL(None), "malloc_trim", None)  # glibc only; resolved once


def boottime() -> float:
    """The worker's clock.  CLOCK_BOOTTIME keeps counting while the machine is suspended (CLOCK_MONOTONIC does
    not): a consumer whose host slept past its lease must see that its lease is over."""
    return time.clock_gettime(time.CLOCK_BOOTTIME)


def trim_heap() -> None:
    """Hand freed heap back to the kernel.  glibc keeps what a burst freed (the soak's consumer kept ~3 MB
    of free heap after its first minutes: RSS that tracks no live object); one call every TRIM_S costs ~1 ms."""
    if _malloc_trim is not None:
        _malloc_trim(0)


@dataclass
class Timer:
    period_s: float
    next_at: float

    def due(self, now: float) -> bool:
        """True once per period: the next one counts from now (a late turn does not make the next one early)."""
        if now < self.next_at:
            return False
        self.next_at = now + self.period_s
        return True


@dataclass
class Timers:
    tick: Timer
    heartbeat: Timer
    liveness: Timer
    trim: Timer

    @classmethod
    def start(cls, tick_s: float, clock: Callable[[], float]) -> "Timers":
        now = clock()
        return cls(tick=Timer(tick_s, now), heartbeat=Timer(api.HEARTBEAT_S, now),
                   liveness=Timer(LIVENESS_CHECK_S, now), trim=Timer(TRIM_S, now + TRIM_S))
