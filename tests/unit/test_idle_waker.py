"""The idle waker (vllm_adapter/engine_hook.py) without vLLM: a real event ring, a stand-in engine whose wake() is
recorded, and a last-call time the test sets.  IDLE_S is raised to a minute, so a wake that waited for it would not
come within these tests' bounds: a wake that comes was sent because the engine counts as idle for another reason."""

from __future__ import annotations

import threading
import time

import pytest

from p2pworker import api
from p2pworker.shm.ring import Ring, Role
from vllm_adapter import engine_hook
from vllm_adapter.engine_hook import IdleWaker, engine_idle

LONG_IDLE_S = 60.0


class RecordingEngine:
    def __init__(self) -> None:
        self.woken = threading.Event()

    def wake(self) -> None:
        self.woken.set()


@pytest.fixture
def rings(shm_prefix):
    """The event ring as the tier holds it (consumer, creator) and the worker's end (producer)."""
    evt = Ring.create(f"{shm_prefix}evt", Role.CONSUMER, nslots=8, slot_bytes=256, msg_type=api.Event)
    worker = Ring.attach(f"{shm_prefix}evt", Role.PRODUCER, msg_type=api.Event)
    yield evt, worker
    worker.close()
    evt.close()


@pytest.fixture
def waker_of(monkeypatch):
    monkeypatch.setattr(engine_hook, "IDLE_S", LONG_IDLE_S)
    made = []

    def make(ring: Ring, last_call: list[float]) -> tuple[IdleWaker, RecordingEngine]:
        engine = RecordingEngine()
        w = IdleWaker(engine, lambda: last_call[0], "t")
        w.retarget(ring)
        made.append(w)
        return w, engine

    yield make
    for w in made:
        w.close()


@pytest.mark.parametrize("now, last_call, said_at, idle", [
    (10.0, 9.99, 9.995, True),  # told "no work" after its last call: blocked on its input queue
    (10.0, 9.99, 9.98, False),  # called the tier since it was told: stepping
    (10.0, 9.99, -1e9, False),  # never told, called 10 ms ago: stepping
    (10.0, 10.0 - LONG_IDLE_S, -1e9, True),  # not called for IDLE_S: idle, however it stopped
])
def test_the_engine_is_idle_once_told_no_work_since_its_last_call_or_after_idle_s(monkeypatch, now, last_call,
                                                                                   said_at, idle):
    monkeypatch.setattr(engine_hook, "IDLE_S", LONG_IDLE_S)
    assert engine_idle(now, last_call, said_at) is idle


def test_an_engine_told_no_work_is_woken_for_the_next_event_without_waiting_idle_s(rings, waker_of):
    evt, worker = rings
    last_call = [time.monotonic()]  # it just stepped
    waker, engine = waker_of(evt, last_call)
    waker.said_idle()  # has_pending_work answered False: it blocks on its input queue now
    worker.put(api.WorkerError("a peer's lookup, say"), timeout_s=1)
    assert engine.woken.wait(10), "the wake waited for IDLE_S"
    assert waker.wakes == 1


def test_an_engine_still_stepping_is_not_woken_for_an_event(rings, waker_of):
    evt, worker = rings
    last_call = [time.monotonic()]
    waker, engine = waker_of(evt, last_call)
    worker.put(api.WorkerError("read at its next step"), timeout_s=1)
    assert not engine.woken.wait(0.5)  # it reads the ring at its next call; a wake would be a wasted no-op
    last_call[0] = time.monotonic()
    waker.said_idle()  # ...but it stopped without reading it: woken now
    assert engine.woken.wait(10)


def test_a_heartbeat_wakes_no_idle_engine(rings, waker_of):
    evt, worker = rings
    last_call = [time.monotonic()]
    waker, engine = waker_of(evt, last_call)
    waker.said_idle()
    worker.put(api.Heartbeat(1), timeout_s=1)
    assert not engine.woken.wait(0.5)
    worker.put(api.WorkerError("this one is for the tier"), timeout_s=1)
    assert engine.woken.wait(10) and waker.wakes == 1
