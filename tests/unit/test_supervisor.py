"""The adapter's WorkerSupervisor (vllm_adapter/supervisor.py) without vLLM or a worker process: its MOVES table, and
the supervisor driven through every row of it by a fake WorkerClient."""

from __future__ import annotations

import pytest

from p2pworker import api
from p2pworker.shm.ring import PeerStatus
from vllm_adapter.metrics import Counts
from vllm_adapter.supervisor import (
    MOVES,
    Event,
    IllegalMove,
    SupervisorState,
    WorkerHooks,
    WorkerSupervisor,
    next_state,
)

S, E = SupervisorState, Event


class FakeRing:
    def __init__(self):
        self.pending_bytes = 0
        self.peer_pid = 4242
        self.status = PeerStatus.ALIVE
        self.unlinked = False

    def depth(self) -> int:
        return 0

    def peer_status(self) -> PeerStatus:
        return self.status

    def unlink(self) -> None:
        self.unlinked = True


class FakeProc:
    pid = 4242

    def poll(self) -> int:
        return -9


class FakeClient:
    """A WorkerClient as the supervisor uses it; ``dies_on_kill=False``: a worker our SIGKILL does not reach."""

    def __init__(self, spawned: bool = True, dies_on_kill: bool = True):
        self.proc = FakeProc() if spawned else None
        self.cmd, self.evt = FakeRing(), FakeRing()
        self.ready: api.Ready | None = None
        self.sent: list = []
        self.events: list = []
        self.living = True
        self.dies_on_kill = dies_on_kill
        self.kills = 0
        self.closed = self.abandoned = False

    def send(self, cmd) -> bool:
        self.sent.append(cmd)
        return True

    def poll(self) -> list:
        out, self.events = self.events, []
        return out

    def alive(self) -> bool:
        return self.living

    def kill(self) -> None:
        self.kills += 1
        if self.dies_on_kill:
            self.living = False

    def close(self, timeout_s: float = 15.0) -> int:
        self.closed = True
        return 0

    def abandon(self) -> None:
        self.abandoned = True

    def reap(self) -> bool:
        return not self.living


ATTACH = object()  # the AttachRegion the supervisor puts first in each new worker's ring (never encoded here)


RIGS: list["Rig"] = []  # every rig made, for the test that every row of MOVES was taken


class Rig:
    """A supervisor, its fake workers, what its hooks saw, and every move it made."""

    def __init__(self, rings: bool = False, **client_kw):
        RIGS.append(self)
        self.clients: list[FakeClient] = []
        self.jobs = 0
        self.seen: list[str] = []
        self.moves: list[tuple[SupervisorState, Event]] = []
        self.fail_spawn = False
        self.client_kw = client_kw
        self.counts = Counts()
        self.now = 0.0  # the supervisor's clock, driven by the test
        hooks = WorkerHooks(watch=lambda ring: self.seen.append("watch" if ring is not None else "unwatch"),
                            spawned=lambda: self.seen.append("spawned"),
                            ready=lambda ev: self.seen.append("ready"),
                            gone=lambda: self.seen.append("gone"),
                            jobs_open=lambda: self.jobs)
        self.sup = WorkerSupervisor("w", self._spawn, ATTACH, hooks, self.counts, rings=rings, start_s=5.0,
                                    stall_s=2.0, clock=lambda: self.now)
        real = self.sup.move

        def move(event: Event) -> SupervisorState:
            self.moves.append((self.sup.state, event))
            return real(event)
        self.sup.move = move  # the supervisor's own code moves through it

    def _spawn(self) -> FakeClient:
        if self.fail_spawn:
            raise OSError("no room for the rings")
        self.clients.append(FakeClient(**self.client_kw))
        return self.clients[-1]

    @property
    def client(self) -> FakeClient:
        return self.clients[-1]

    def ready(self) -> None:
        assert not self.sup.on_ready(api.Ready("n", "tcp://h:1", "zmq", "f", "a", api=api.RING_API, hold_s=1.0))

    def check(self, at: float) -> bool:
        self.now = at
        return self.sup.check(at)


def test_every_unknown_move_is_refused():
    for state in SupervisorState:
        for event in Event:
            if (state, event) in MOVES:
                assert next_state(state, event) is MOVES[(state, event)]
            else:
                with pytest.raises(IllegalMove, match=f"no move for {event.name} in {state.name}"):
                    next_state(state, event)


def test_only_closing_leaves_stopped_and_only_ready_reaches_serving():
    assert {s for (s, _) in MOVES if s is S.STOPPED} and all(e is E.CLOSED for (s, e) in MOVES if s is S.STOPPED)
    assert {e for (_, e), n in MOVES.items() if n is S.SERVING} == {E.READY}
    assert {s for (s, e) in MOVES if e is E.SPAWNED} == {S.BACKOFF}  # a worker is started only with none running


def test_spawn_ready_death_and_restart():
    rig = Rig()
    rig.fail_spawn = True
    rig.sup.start()  # BACKOFF -SPAWN_FAILED-> BACKOFF
    assert rig.sup.state is S.BACKOFF and rig.sup.client is None and rig.seen == ["unwatch"]
    rig.fail_spawn = False
    rig.now += 1.0  # the backoff has passed
    assert not rig.sup.tend()  # due: BACKOFF -SPAWNED-> STARTING
    assert rig.sup.state is S.STARTING and rig.counts.restarts == 1 and rig.client.sent == [ATTACH]
    assert rig.seen[-2:] == ["watch", "spawned"] and rig.sup.starting and not rig.sup.serving
    rig.ready()  # STARTING -READY-> SERVING
    assert rig.sup.state is S.SERVING and rig.sup.ready and rig.sup.serving and rig.client.evt.unlinked
    rig.ready()  # SERVING -READY-> SERVING (a worker says it once; a repeat is taken as before)
    rig.client.living = False
    assert rig.check(1.0)  # SERVING -GONE-> BACKOFF
    assert rig.sup.state is S.BACKOFF and rig.counts.worker_deaths == 1 and rig.client.closed
    assert rig.seen[-2:] == ["gone", "unwatch"]  # the jobs end before the rings close
    assert rig.sup.wants_steps(stopping=False, woken=False) and not rig.sup.wants_steps(stopping=True, woken=False)


def test_a_wedged_worker_is_killed_and_its_jobs_end_only_once_it_is_gone():
    rig = Rig(dies_on_kill=False)
    rig.sup.start()
    rig.ready()
    rig.jobs = 1
    t = rig.now  # its last event: the Ready
    assert not rig.check(t + 3.0)  # no event for stall_s: SERVING -KILLED-> KILLING
    assert rig.sup.state is S.KILLING and rig.client.kills == 1 and not rig.sup.serving and rig.sup.ready
    assert rig.sup.wants_steps(stopping=True, woken=False)
    assert not rig.check(t + 3.0 + 11.0) and rig.client.kills == 2 and "gone" not in rig.seen  # killed again
    rig.client.living = False
    assert rig.check(t + 30.0)  # KILLING -GONE-> BACKOFF
    assert rig.sup.state is S.BACKOFF and rig.seen.count("gone") == 1 and rig.counts.worker_deaths == 1


def test_a_worker_not_ready_in_time_is_killed_then_given_up_alive_without_jobs():
    rig = Rig(dies_on_kill=False)
    rig.sup.started = True  # the engine's start is over: start_timeout_s bounds a restarted worker
    rig.sup.start()
    assert not rig.check(100.0) and rig.sup.state is S.STARTING  # the clock of its start begins
    assert not rig.check(106.0)  # STARTING -KILLED-> KILLING
    assert rig.sup.state is S.KILLING
    assert rig.check(106.0 + 10.0)  # no job: given up alive, KILLING -GONE-> BACKOFF
    assert rig.sup.state is S.BACKOFF and rig.sup.abandoned == [rig.client] and rig.counts.worker_deaths == 0
    rig.client.living = False
    rig.sup.tend()
    assert rig.sup.abandoned == []  # reaped once it died


def test_configuration_errors_stop_the_restarts():
    rig = Rig()
    rig.sup.start()
    assert rig.sup.on_error(api.WorkerError("bad backend", fatal=True))  # STARTING -REFUSED-> STOPPED
    assert rig.sup.state is S.STOPPED and rig.sup.fatal == "bad backend"
    assert not rig.sup.tend() and len(rig.clients) == 1  # never restarted
    assert not rig.sup.wants_steps(stopping=False, woken=False)

    rig = Rig()  # SERVING -REFUSED-> STOPPED
    rig.sup.start()
    rig.ready()
    rig.sup.config_error("test")
    assert rig.sup.state is S.STOPPED

    rig = Rig(dies_on_kill=False)  # with jobs open it is killed first: KILLING -REFUSED-> STOPPED
    rig.sup.start()
    rig.ready()
    rig.jobs = 1
    rig.sup.config_error("test")
    assert rig.sup.state is S.KILLING and "gone" not in rig.seen
    rig.client.living = False
    assert rig.check(1.0) and rig.sup.state is S.STOPPED and rig.seen.count("gone") == 1


def test_an_operator_worker_refused_after_start_is_waited_out():
    rig = Rig(rings=True, spawned=False)
    rig.sup.start()
    rig.client.evt.status = PeerStatus.PENDING
    assert not rig.sup.starting and not rig.sup.ready_awaited(stopping=False)  # the operator has yet to launch it
    rig.sup.started = True
    rig.sup.config_error("another release")  # STARTING -GONE-> BACKOFF: the rings are re-created later
    assert rig.sup.state is S.BACKOFF and rig.sup.fatal is None and rig.sup.attach_error == "another release"


def test_a_ready_after_our_sigkill_is_ignored():
    rig = Rig(dies_on_kill=False)
    rig.sup.started = True
    rig.sup.start()
    rig.check(0.0)
    rig.check(10.0)
    assert rig.sup.state is S.KILLING
    rig.ready()
    assert rig.sup.state is S.KILLING and not rig.sup.ready


def test_close_stops_from_every_state():
    rig = Rig()
    rig.sup.close()  # BACKOFF -CLOSED-> STOPPED
    rig.sup.close()  # STOPPED -CLOSED-> STOPPED
    rig = Rig()
    rig.sup.start()
    rig.sup.close()  # STARTING
    assert rig.client.closed and rig.sup.client is None and rig.sup.state is S.STOPPED
    rig = Rig()
    rig.sup.start()
    rig.ready()
    rig.sup.close()  # SERVING
    rig = Rig(dies_on_kill=False)
    rig.sup.start()
    rig.ready()
    rig.check(rig.now + 3.0)
    rig.sup.close()  # KILLING
    assert rig.sup.state is S.STOPPED


SCENARIOS = (test_spawn_ready_death_and_restart, test_a_wedged_worker_is_killed_and_its_jobs_end_only_once_it_is_gone,
             test_a_worker_not_ready_in_time_is_killed_then_given_up_alive_without_jobs,
             test_configuration_errors_stop_the_restarts, test_an_operator_worker_refused_after_start_is_waited_out,
             test_a_ready_after_our_sigkill_is_ignored, test_close_stops_from_every_state)


def test_the_scenarios_above_take_every_row():
    """Each row of MOVES is taken by the supervisor's own code in one of this module's scenarios."""
    RIGS.clear()
    for scenario in SCENARIOS:
        scenario()
    seen = {m for rig in RIGS for m in rig.moves}
    assert seen == set(MOVES), sorted((s.name, e.name) for s, e in set(MOVES) - seen)
