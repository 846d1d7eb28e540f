"""What the tier needs from the vLLM engine core it runs in: a way to wake it when idle, and word of its shutdown.

Neither is in the tier contract, so both are read from the engine core object itself, found once (no patching, no
calls into vLLM beyond what its own code does):

- **Waking an idle engine (vLLM 0.32).**  An engine with no request blocks in
  ``EngineCoreProc._process_input_queue`` on ``input_queue.get()`` and calls no tier until a request comes.  A peer
  that pulls from this engine (``remote_kv_source``) waits meanwhile: its lookup sits unread on our event ring until
  the puller's ``lookup_timeout_s`` (5 s), and then it recomputes.  vLLM wakes that same ``get()`` itself with its
  sentinel ``(EngineCoreRequestType.WAKEUP, None)`` (its SIGTERM path does; the loop handles it as a no-op and looks
  at ``has_work()`` again).  :class:`IdleWaker` is a daemon thread that sleeps on the event ring's bell and, while
  the engine is idle (the tier answered ``has_pending_work`` with no since its last call, or it has not called the
  tier for ``IDLE_S``), puts that sentinel there when an event the tier must read arrives; the tier's
  ``has_pending_work`` is True while events are unread, so the engine steps (once, an empty step) and the tier
  reads and serves them.  A heartbeat is not such an event (the worker leaves at most one unread
  heartbeat in the ring).  vLLM 0.33 needs none of this: its tier-poll thread calls ``get_finished_jobs`` and
  ``serve_external_requests`` every ``tier_poll_interval_s`` (1 ms by default), idle or not.
- **Shutdown.**  ``vllm serve`` stops in drain mode: the engine core keeps stepping while any tier job is open, up to
  ``--shutdown-timeout``, then vLLM kills it and its children (the region file and the worker's admin socket are
  left behind).  Our open jobs are mostly stores parked for consumers that may never fetch.  The tier reads the
  engine core's ``shutdown_state`` on each call and, once it is no longer RUNNING, ends them (tier.py).

The engine core is found by walking the stack that constructs the tier (EngineCoreProc creates its ``input_queue``
before it builds the scheduler, the connector, the tiering manager and so our tier): the first frame whose ``self``
has an ``input_queue`` (a ``queue.Queue``) and a ``shutdown_state``.  Where none is (the tests' managers built
without an engine, another vLLM layout), both features are off and the tier behaves as before: an idle 0.32 engine
then serves a pull only when its next request comes (docs/troubleshooting.md).
"""

from __future__ import annotations

import logging
import os
import queue
import select
import sys
import threading
import time
from dataclasses import dataclass
from types import FrameType
from typing import Any, Callable

from p2pworker.shm.ring import Ring

log = logging.getLogger("vllm_adapter.engine_hook")

# The tier not called for this long: the engine is idle (or inside one long step: a wake is harmless).  The bound for
# an engine that stopped without asking has_pending_work; one that asked and heard no counts as idle at once.
IDLE_S = 0.05
WATCH_SLICE_S = 1.0  # the waker's longest sleep (it re-reads its ring after a worker restart at once: interrupt)
REWAKE_S = 1.0  # a wake the engine did not answer (a step running) is repeated at most this often
# An event whose encoding starts with this tag is a heartbeat (msgspec: {"type": "heartbeat", ...}); nothing else is.
_HEARTBEAT_TAG = b"\xa4type\xa9heartbeat"


def _is_heartbeat(head: bytes) -> bool:
    return head[1:1 + len(_HEARTBEAT_TAG)] == _HEARTBEAT_TAG


@dataclass(frozen=True)
class EngineCore:
    """The engine core object of this process, as far as the tier uses it."""

    core: Any

    def wake(self) -> None:
        """Make an idle engine look at ``has_work()`` again: vLLM's own no-op sentinel on its input queue."""
        from vllm.v1.engine import EngineCoreRequestType

        self.core.input_queue.put_nowait((EngineCoreRequestType.WAKEUP, None))

    def aborting(self) -> bool:
        """vLLM stops in abort mode (``--shutdown-timeout 0``): it aborted every request instead of draining."""
        return getattr(getattr(self.core, "vllm_config", None), "shutdown_timeout", None) == 0

    def stopping(self) -> bool:
        """vLLM was asked to shut down (SIGTERM/SIGINT): it drains, then tears the engine down."""
        state = getattr(self.core, "shutdown_state", None)
        return state is not None and getattr(state, "name", "RUNNING") != "RUNNING"


def engine_idle(now: float, last_call: float, idle_said_at: float) -> bool:
    """Whether an engine without a tier-poll thread is (as far as the tier can tell) blocked on its input queue:
    told "no work" since its last call into the tier, or not calling for IDLE_S.  Wrong only towards a wake the
    engine did not need (a no-op it reads at its next input check)."""
    return idle_said_at >= last_call or now - last_call >= IDLE_S


def find_engine_core(frame: FrameType | None = None) -> EngineCore | None:
    """The engine core constructing us, from the caller's stack (None when there is none)."""
    f = frame if frame is not None else sys._getframe(1)
    while f is not None:
        owner = f.f_locals.get("self")
        if isinstance(getattr(owner, "input_queue", None), queue.Queue) and hasattr(owner, "shutdown_state"):
            return EngineCore(owner)
        f = f.f_back
    return None


class IdleWaker:
    """Wakes an idle engine when its tier has events to read.  One daemon thread; ``retarget`` when the worker (and
    so the event ring) changes; ``close`` at the tier's shutdown.

    ``last_call`` is when the engine last called the tier (the tier's own clock, time.monotonic).  The engine is
    idle (:func:`engine_idle`) once the tier told it there is no work (:meth:`said_idle`, from ``has_pending_work``:
    vLLM 0.32 asks it right before it blocks on its input queue) and it has not called since, or once it has not
    called the tier for IDLE_S (a call that is not followed by that question: an engine that stopped some other way).
    The thread:

    1. while the engine is not idle, sleeps up to IDLE_S (the engine steps and reads the ring itself); a
       :meth:`said_idle` cuts that sleep short;
    2. else sleeps on the ring's bell until a slot past the ones it has looked at is published;
    3. looks at the unread slots it has not looked at: any that is not a heartbeat wakes the engine (at most once
       per REWAKE_S until the tier is called again).
    """

    def __init__(self, engine: EngineCore, last_call: Callable[[], float], name: str):
        self._engine = engine
        self._last_call = last_call
        self._lock = threading.Lock()  # held while the thread uses the ring: retarget/close swap it under it
        self._ring: Ring | None = None
        self._seen = 0  # slots below this were looked at (heartbeats only, or a wake was sent for them)
        self._stop = False
        self._wanted = False  # retarget/close waits for the lock: the thread must not start a sleep holding it
        self._rfd, self._wfd = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.wakes = 0
        self._idle_said_at = -1e9  # when the tier last told the engine there is no work (said_idle)
        self._thread = threading.Thread(target=self._run, name=f"p2pworker-waker-{name}", daemon=True)
        self._thread.start()

    def said_idle(self) -> None:
        """The tier just told the engine it has no work (``has_pending_work`` False): vLLM 0.32 blocks on its input
        queue next, so from now until its next call an event wakes it at once.  Called on the engine's thread; costs
        one pipe write per idle spell (the first such answer after a call), none while the engine steps."""
        fresh = self._idle_said_at < self._last_call()
        self._idle_said_at = time.monotonic()
        if fresh:
            self._interrupt()  # the thread may be in its not-idle sleep

    def idle(self, now: float) -> bool:
        """:func:`engine_idle` for this engine at ``now``."""
        return engine_idle(now, self._last_call(), self._idle_said_at)

    def retarget(self, ring: Ring | None) -> None:
        """The event ring of the current worker (None: no worker).  Interrupts the thread's sleep first, so this
        waits only for its current look (microseconds), never for a sleep."""
        self._wanted = True  # before the byte: a thread about to sleep sees one or the other
        self._interrupt()
        with self._lock:
            self._wanted = False
            self._ring = ring
            self._seen = 0

    def close(self) -> None:
        self._stop = True
        self.retarget(None)
        self._thread.join(timeout=2.0)
        if not self._thread.is_alive():  # else it may still poll them: a closed fd's number could be vLLM's next
            for fd in (self._rfd, self._wfd):
                os.close(fd)

    def _interrupt(self) -> None:
        try:
            os.write(self._wfd, b"\x01")
        except BlockingIOError:
            pass  # one byte there already

    def _nap(self, seconds: float) -> None:
        """Sleep ``seconds`` or until an interrupt (said_idle, retarget, close); the interrupt is consumed."""
        if select.select([self._rfd], [], [], seconds)[0]:
            self._drain_interrupt()

    def _drain_interrupt(self) -> None:
        try:
            os.read(self._rfd, 4096)
        except BlockingIOError:
            pass

    def _run(self) -> None:
        woken_at = -1e9
        while not self._stop:
            now = time.monotonic()
            if not self.idle(now):
                self._nap(IDLE_S)  # the engine steps and reads the ring itself; said_idle cuts this short
                continue
            with self._lock:
                ring = self._ring
                try:
                    needs = self._look(ring) if ring is not None else None
                except Exception as e:  # a broken ring: the tier notices and replaces the worker (retarget)
                    log.debug("waker: %s", e)
                    needs = None
                self._drain_interrupt()  # under the lock: a byte written after this wakes the next sleep
            if needs is None:
                if self._ring is None:  # no worker: sleep until retarget (or a slice)
                    self._nap(WATCH_SLICE_S)
            elif needs:
                now = time.monotonic()  # the look may have slept
                if not self.idle(now):
                    continue  # it stepped meanwhile (a request came): it reads the ring itself
                if self._last_call() > woken_at or now - woken_at >= REWAKE_S:
                    woken_at = now
                    self.wakes += 1
                    try:
                        self._engine.wake()
                    except Exception as e:  # never take the engine down for a wake
                        log.warning("could not wake the engine: %s", e)
                else:
                    self._nap(IDLE_S)  # woken already: the engine is in a step, or about to call the tier

    def _look(self, ring: Ring) -> bool:
        """Sleep until a slot not looked at yet is published (or a slice ends); True when an unread one is not a
        heartbeat.  Slots of heartbeats only are marked looked at; others stay unread until the engine reads them
        (TAIL passes them), so a wake the engine missed is repeated (REWAKE_S)."""
        tail, head = ring.published()
        start = max(self._seen, tail)
        if head <= start and not self._wanted:
            ring.watch(start, WATCH_SLICE_S, self._rfd)
            tail, head = ring.published()
            start = max(self._seen, tail)
        for slot in range(start, head):
            if not _is_heartbeat(ring.peek_head(slot)):
                return True
        self._seen = head
        return False
