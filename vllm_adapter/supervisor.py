"""WorkerSupervisor: the life of the tier's p2pworker process, as a state machine whose moves are the MOVES table.

A dead worker fails every job in flight exactly once, lookups answer MISS, and a new worker is started after a
bounded backoff without blocking the scheduler.  With ``rings`` set the tier spawns nothing: it creates the rings and
an operator's ``p2pworker launch --rings <rings>`` attaches; after a death the rings are re-created for its restart.

States (``SupervisorState``): BACKOFF (no worker; the next is started once the backoff has passed), STARTING (rings
exist, its Ready not read), SERVING (work goes to it), KILLING (SIGKILLed, not seen gone yet), STOPPED (a
configuration error: no restarts; or shut down).  Every change of state goes through ``move``, which applies MOVES
and refuses any move not in it.  The supervisor never touches jobs or lookups: its hooks (``WorkerHooks``) tell the
tier when a worker's rings exist, when its Ready was read and when it is gone.  Never blocks, except in ``close``
and ``kill_and_wait``, whose callers' contracts are to wait.
"""

from __future__ import annotations

import enum
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable

from p2pworker import api
from p2pworker.client import KILL_WAIT_S, WorkerClient
from p2pworker.errors import P2PError
from p2pworker.shm.ring import PeerStatus
from vllm_adapter.metrics import Counts

log = logging.getLogger("vllm_adapter.tier")

RESTART_MIN_S, RESTART_MAX_S = 1.0, 30.0
LIVENESS_CHECK_S = 0.05
DRAIN_LOG_S = 10.0  # kill_and_wait: how often it says it waits
# A worker still alive this long after our SIGKILL (not ours to kill: an operator's run as another user; or stuck in
# the kernel): one with jobs is killed again and said in the log, every time (its jobs end once it is gone); one
# without (it never said Ready, or its jobs ended) is given up then: its rings closed, the next worker started.
KILL_RETRY_S = 10.0


class SupervisorState(enum.Enum):
    BACKOFF = "backoff"  # no worker: the next one is started once the backoff has passed
    STARTING = "starting"  # its rings exist (the process spawned, or an operator's yet to attach); Ready not read
    SERVING = "serving"  # its Ready read and not decided to kill it: new work goes to it
    KILLING = "killing"  # SIGKILLed (wedged, not ready in time, ended with jobs open), not seen gone yet
    STOPPED = "stopped"  # a configuration error (no restarts), or shut down


class Event(enum.Enum):
    SPAWNED = "spawned"  # rings created and the AttachRegion in them
    SPAWN_FAILED = "spawn failed"  # creating the rings or spawning failed: the next try after the backoff
    READY = "ready"  # its Ready read (a worker says it once; a repeated one is taken again, as it always was)
    KILLED = "killed"  # SIGKILLed: its jobs stay open until it is gone
    GONE = "gone"  # dead, or given up alive holding no job: its jobs fail once, the next one after the backoff
    REFUSED = "refused"  # gone after a configuration error: not restarted
    CLOSED = "closed"  # vLLM shut the tier down


_S, _E = SupervisorState, Event
MOVES: dict[tuple[SupervisorState, Event], SupervisorState] = {
    (_S.BACKOFF, _E.SPAWNED): _S.STARTING,
    (_S.BACKOFF, _E.SPAWN_FAILED): _S.BACKOFF,
    (_S.STARTING, _E.READY): _S.SERVING,
    (_S.SERVING, _E.READY): _S.SERVING,
    (_S.STARTING, _E.KILLED): _S.KILLING,
    (_S.SERVING, _E.KILLED): _S.KILLING,
    (_S.STARTING, _E.GONE): _S.BACKOFF,
    (_S.SERVING, _E.GONE): _S.BACKOFF,
    (_S.KILLING, _E.GONE): _S.BACKOFF,
    (_S.STARTING, _E.REFUSED): _S.STOPPED,
    (_S.SERVING, _E.REFUSED): _S.STOPPED,
    (_S.KILLING, _E.REFUSED): _S.STOPPED,
    **{(s, _E.CLOSED): _S.STOPPED for s in SupervisorState},
}


class IllegalMove(RuntimeError):
    """A (state, event) pair MOVES does not have."""


def next_state(state: SupervisorState, event: Event) -> SupervisorState:
    """MOVES applied: the state after ``event`` in ``state``; IllegalMove for a move the table does not have."""
    nxt = MOVES.get((state, event))
    if nxt is None:
        raise IllegalMove(f"worker supervisor: no move for {event.name} in {state.name}")
    return nxt


@dataclass(frozen=True)
class WorkerHooks:
    """What the tier does at the supervisor's moves (the supervisor owns no job, lookup or command queue)."""

    watch: Callable[[Any], None]  # the waker follows this event ring (None: no worker; called before rings close)
    spawned: Callable[[], None]  # a new worker's rings exist, its AttachRegion in the command ring
    ready: Callable[[api.Ready], None]  # its Ready was read: what waited for a ready worker goes out
    gone: Callable[[], None]  # it is gone or given up: every job fails once, lookups MISS, queued commands dropped
    jobs_open: Callable[[], int]  # jobs of ours with the worker (one with jobs is never given up alive)


class WorkerSupervisor:
    """Owns the WorkerClient: starts it, reads its Ready and errors, watches it live, kills, gives up and reaps it."""

    def __init__(self, name: str, spawn: Callable[[], WorkerClient], attach: api.AttachRegion, hooks: WorkerHooks,
                 counts: Counts, *, rings: bool, start_s: float, stall_s: float,
                 clock: Callable[[], float] = time.monotonic):
        self.name = name
        self.state = SupervisorState.BACKOFF
        self.client: WorkerClient | None = None
        self.fatal: str | None = None  # the worker reported a configuration error: no restarts
        self.attach_error: str | None = None
        self.started = False  # the engine's start (the tier's __init__) is over
        self._reaper = Reaper(name)
        self.stall_s = float(stall_s)
        self.start_s = float(start_s)  # also bounds a restarted worker's way to Ready (see check)
        self._spawn, self._attach, self._hooks, self._counts = spawn, attach, hooks, counts
        self._clock = clock  # monotonic seconds (a test drives its own)
        self._rings = rings  # attach to an operator-launched worker (p2pworker launch --rings <rings>)
        self._restart_at = 0.0
        self._backoff_s = RESTART_MIN_S
        self._next_liveness = 0.0
        self._last_event = self._clock()
        self._starting_since: float | None = None  # a worker process exists, its Ready not read yet, since then
        self._killing_since: float | None = None  # a wedged worker was SIGKILLed at this time; not gone yet
        self._kill_retry_at = 0.0  # ... and is killed again (and logged) from then on, every KILL_RETRY_S
        self._kill_reason = ""  # why, for the log line once it is gone

    def move(self, event: Event) -> SupervisorState:
        self.state = next_state(self.state, event)
        return self.state

    @property
    def abandoned(self) -> list[WorkerClient]:
        """Workers given up alive, not reaped yet."""
        return self._reaper.workers

    # ------------------------------------------------------------ what the tier asks
    @property
    def ready(self) -> bool:
        """The current worker's Ready was read (it may since have been SIGKILLed)."""
        return self.client is not None and self.client.ready is not None

    @property
    def serving(self) -> bool:
        """A ready worker we have not decided to kill: new work goes to it, else fails (MISS) at once.  A worker
        that outlives our SIGKILL would otherwise take every new job into a ring it never reads, each one open
        (its rows pinned) until it is gone."""
        return self.state is SupervisorState.SERVING

    @property
    def starting(self) -> bool:
        """A worker process exists and its Ready has not been read: one we spawned, or an operator's that attached
        the rings (not one the operator has yet to launch: its AttachRegion waits in the ring, for as long as it
        takes)."""
        client = self.client
        return self.state is SupervisorState.STARTING and client is not None and (
            client.proc is not None or client.evt.peer_status() is not PeerStatus.PENDING)

    def wants_steps(self, stopping: bool, woken: bool) -> bool:
        """vLLM must keep calling the tier for the worker's sake (has_pending_work).  ``stopping``: vLLM drains for
        shutdown; ``woken``: an IdleWaker wakes the idle engine for unread events."""
        # A worker we SIGKILLed: until vLLM calls us nobody sees it gone (and restarts one) or gives it up; bounded,
        # without jobs, by KILL_RETRY_S (_kill_failed).  A given-up one is not waited for (it may never die).
        return (self.restart_awaited(stopping) or self.ready_awaited(stopping) or self.ring_unread(woken)
                or self.state is SupervisorState.KILLING)

    def restart_awaited(self, stopping: bool) -> bool:
        """No worker: pending until one is restarted (vLLM keeps calling us meanwhile), but not for a tier that
        stopped restarting after a configuration error (vLLM would step for nothing forever).  While vLLM stops, a
        worker to (re)start is not work: its drain would wait for it, then kill the engine."""
        return self.state is SupervisorState.BACKOFF and not stopping

    def ready_awaited(self, stopping: bool) -> bool:
        """A worker that started and has not said Ready: its Ready is read only when vLLM calls us, and vLLM 0.32 (no
        tier-poll thread) calls only while this is True.  Until it is read every job fails ("worker not ready"),
        listed peers are not connected, and a worker stuck before it is never killed.  (The finished requests a
        consumer may fetch no longer wait for it: they are in the ring behind the AttachRegion, finished.py.)
        Bounded: such a worker is killed after start_timeout_s (check)."""
        return self.starting and not stopping

    def ring_unread(self, woken: bool) -> bool:
        """Commands not out on the ring yet; or events unread on it: vLLM 0.32's idle engine steps once when the
        waker woke it, and reads them."""
        client = self.client
        return client is not None and (client.cmd.pending_bytes > 0 or (woken and client.evt.depth() > 0))

    # ------------------------------------------------------------ start, restart
    def start(self) -> None:
        try:
            self.client = self._spawn()
            self._hooks.watch(self.client.evt)
            if not self.client.send(self._attach):
                raise P2PError("command ring full at start")
            # Right behind the AttachRegion, not on Ready: the worker serves its port from the AttachRegion on, and
            # reads these before it reads its sockets again, whether or not vLLM calls us to read its Ready (an idle
            # vLLM 0.32 engine does not while an operator relaunches the worker).
            self._hooks.spawned()
        except (P2PError, OSError) as e:
            log.error("starting p2pworker failed: %s", e)
            self.client = None
            self._hooks.watch(None)
            self.move(Event.SPAWN_FAILED)
            self._schedule_restart()
            return
        self.move(Event.SPAWNED)

    def tend(self) -> bool:
        """Reap given-up workers; start the next worker when due.  True when a worker's rings exist to be read."""
        if self._reaper.workers:  # ~2 us (waitpid) each, only while one is left: reaped even while no worker runs
            self._reaper.reap()
        if self.client is not None:
            return True
        if self.state is SupervisorState.BACKOFF and self._clock() >= self._restart_at:
            self._counts.restarts += 1
            self.start()
        return False

    def _schedule_restart(self) -> None:
        self._restart_at = self._clock() + self._backoff_s
        self._backoff_s = min(self._backoff_s * 2, RESTART_MAX_S)

    # ------------------------------------------------------------ what the worker says
    def poll(self) -> list[api.Event]:
        try:
            events = self.client.poll()
        except P2PError as e:
            events = []
            log.error("event ring: %s", e)
        if events:
            self._last_event = self._clock()  # read before judging liveness: a slow poller is not a wedge
        return events

    def on_ready(self, ev: api.Ready) -> bool:
        """The worker's Ready.  True: the worker was ended for it (its other events are moot)."""
        if self.state is SupervisorState.KILLING:  # too late: no job goes to a worker we decided to kill
            log.warning("p2pworker %s said Ready after our SIGKILL (%s): ignored", self.name, self._kill_reason)
            return False
        why = api.ring_api_mismatch(ev.api, f"p2pworker {self.name} (control {ev.address})")
        if why is not None:  # another release: it would drop commands it cannot decode
            log.error("p2pworker: %s", why)
            self.config_error(why)
            return True
        self.move(Event.READY)
        self._starting_since = None
        self.attach_error = None
        self._last_event = self._clock()
        self._backoff_s = RESTART_MIN_S
        client = self.client
        client.ready = ev
        client.cmd.unlink()
        client.evt.unlink()
        self._hooks.ready(ev)
        return False

    def on_error(self, ev: api.WorkerError) -> bool:
        """An error the worker reported.  True: the worker was ended for it."""
        log.error("p2pworker: %s", ev.message)
        if ev.fatal:
            self.config_error(ev.message)
            return True
        if ev.attach:  # this worker cannot serve; a new one may (a port freed, memory available)
            self.attach_error = ev.message
            self.worker_died(f"could not attach the region: {ev.message}")
            return True
        return False

    def config_error(self, why: str) -> None:
        """The worker cannot serve as configured.  A spawned worker's configuration is ours (the tier's settings,
        this install): restarting it would fail the same way, so the tier stops restarting (at start-up vLLM's start
        fails with the cause).  An operator-launched worker (`rings`) that fails this way after start-up is fixed by
        the operator relaunching it (the right release, its config): its rings are re-created after the backoff, as
        for a worker that died, and this cause is logged again on every try until one attaches."""
        if self._rings and self.started:
            self.attach_error = why
            self.worker_died(f"configuration error of the operator-launched worker ({why}); the rings are "
                             f"re-created for the operator to relaunch it")
        else:
            self.fatal = why
            self.worker_died(f"configuration error: {why}")

    # ------------------------------------------------------------ liveness
    def check(self, now: float) -> bool:
        """A dead worker is noticed within LIVENESS_CHECK_S (its jobs then fail at once); a wedged one, or one not
        ready within start_timeout_s, is killed.  True: the worker ended."""
        if now < self._next_liveness:  # ~2 us (waitpid) + ~15 us (/proc): not on every poll
            return False
        self._next_liveness = now + LIVENESS_CHECK_S
        client = self.client
        if not client.alive():
            if self.state is SupervisorState.KILLING:
                self.worker_died(f"{self._kill_reason}; killed")
            else:
                self.worker_died(f"exit code {client.proc.poll() if client.proc else '?'}")
            return True
        if self.state is SupervisorState.KILLING:
            return now >= self._kill_retry_at and self._kill_failed(client, now)
        if self.state is SupervisorState.SERVING:
            self._check_stall(client, now)
        elif self.started and self.starting:
            self._check_start(client, now)
        return False

    def _check_stall(self, client: WorkerClient, now: float) -> None:
        if now - self._last_event > self.stall_s:
            # The pid lives but the loop does not (SIGSTOP, a deadlock, a stuck syscall).  Its jobs are failed
            # only once it is really gone: a stopped worker that resumed could still copy into our rows.
            log.error("p2pworker %s sent nothing for %.1f s (heartbeat every %g s): killing it",
                      self.name, now - self._last_event, api.HEARTBEAT_S)
            self._kill(client, now, f"wedged (no heartbeat for {self.stall_s:g} s while its pid lived)")

    def _check_start(self, client: WorkerClient, now: float) -> None:
        # A restarted worker that never says Ready (stuck importing, attaching, SIGSTOPped) is killed after
        # the bound vLLM's start gives the first one; has_pending_work keeps vLLM stepping until then.
        if self._starting_since is None:
            self._starting_since = now
        elif now - self._starting_since > self.start_s:
            log.error("p2pworker %s not ready %.0f s after it started (start_timeout_s): killing it",
                      self.name, now - self._starting_since)
            self._kill(client, now, f"not ready within start_timeout_s = {self.start_s:g} s")

    # ------------------------------------------------------------ kill, give up, close
    def _kill(self, client: WorkerClient, now: float, why: str) -> None:
        """SIGKILL a worker whose pid lives but that does not serve; its jobs fail once it is gone (check)."""
        self.move(Event.KILLED)
        self._killing_since, self._kill_reason = now, why
        self._kill_retry_at = now + KILL_RETRY_S
        client.kill()

    def _kill_failed(self, client: WorkerClient, now: float) -> bool:
        """The worker outlived our SIGKILL by KILL_RETRY_S.  True when it was given up (its rings are closed)."""
        self._kill_retry_at = now + KILL_RETRY_S
        pid = client.proc.pid if client.proc is not None else client.evt.peer_pid
        alive_s = now - self._killing_since
        jobs = self._hooks.jobs_open()
        if not jobs:
            # No job of ours is with it (one that never said Ready never got one, nor one past our kill: see
            # serving), so no row of ours is being read or written by it and nothing waits for its death; while it
            # lived, has_pending_work would keep vLLM stepping for it.  If it ever runs on, it finds its command ring
            # closed and stops by itself.
            self.worker_died(f"{self._kill_reason}; pid {pid} still alive {alive_s:.0f} s after SIGKILL (not ours "
                             f"to kill, or stuck in the kernel): stop it by hand; it may hold the port "
                             f"the next worker needs", gone=False)
            return True
        log.error("p2pworker %s (pid %d) still alive %.0f s after SIGKILL (%s): its %d job(s) stay open until it "
                  "is gone (a job failed while it lives could let it write into rows vLLM reused); killing it again",
                  self.name, pid, alive_s, self._kill_reason, jobs)
        client.kill()
        return False

    def worker_died(self, why: str, gone: bool = True) -> None:
        """Every job and lookup of the worker ends (failed, MISS) and the next worker is started after the backoff.
        ``gone=False``: a worker given up alive, holding no job: its rings are closed without waiting for it (it is
        reaped once it dies: tend).  Never waits for a process, and never fails a job while its worker may run."""
        client = self.client
        jobs = self._hooks.jobs_open()
        if gone and jobs and client is not None and client.alive():
            # A worker ended for what it said (a configuration error) while jobs of ours are with it: one that runs
            # on could still copy into, or let a consumer read, rows vLLM reuses once they are reported failed
            # (invariant 7).  Killed; they fail once it is gone (check), as a wedged worker's do.  The worker sends
            # such errors only before its Ready (and jobs come only after), so this keeps the rule, not the case.
            log.error("p2pworker %s: %s, with %d job(s) open: killing it; they fail once it is gone", self.name,
                      why, jobs)
            if self.state is not SupervisorState.KILLING:
                self._kill(client, self._clock(), why)
            return
        log.error(*_end_line(self.name, why, gone, jobs, self.fatal, self._rings, self._backoff_s))
        self._killing_since = None
        self._starting_since = None
        if gone:
            self._counts.worker_deaths += 1
        self._hooks.gone()
        self.client = None
        if client is not None:
            self.move(Event.REFUSED if self.fatal is not None else Event.GONE)
        self._hooks.watch(None)  # before its rings close under it
        if client is not None:
            self._reaper.let_go(client, gone)
        self._schedule_restart()

    def kill_and_wait(self) -> None:
        """drain_jobs: the worker SIGKILLed and waited for until it is gone (kill_until_gone)."""
        kill_until_gone(self.client, self.name)

    def close(self) -> None:
        """vLLM's shutdown: the worker stopped and its rings closed; given-up workers waited for, bounded."""
        client, self.client = self.client, None
        self.move(Event.CLOSED)
        if client is not None:
            code = client.close()
            log.info("p2pworker %s exited with %s", self.name, code)
        # bounded: vLLM's shutdown must not hang on a process that does not die (as close() waits after its SIGKILL)
        self._reaper.wait(KILL_WAIT_S)


def _end_line(name: str, why: str, gone: bool, jobs: int, fatal: str | None, rings: bool,
              backoff_s: float) -> tuple:
    """The log line (format and arguments) for a worker that is gone (``gone``) or given up alive."""
    if not gone:
        nxt = ("NOT restarting (configuration error)" if fatal is not None else
               f"re-creating the rings for the operator's next worker in {backoff_s:.0f} s" if rings
               else f"starting the next one in {backoff_s:.0f} s")
        return "p2pworker %s given up (%s): %s", name, why, nxt
    if fatal is not None:
        return ("p2pworker %s cannot serve (%s): failing %d job(s); NOT restarting it: fix the configuration "
                "and restart vLLM (until then every transfer through this tier fails at once)", name, why, jobs)
    return "p2pworker %s died (%s): failing %d job(s), restarting in %.0f s", name, why, jobs, backoff_s


class Reaper:
    """Workers given up alive (_kill_failed; an attach or configuration error): reaped once they die."""

    def __init__(self, name: str):
        self.name = name
        self.workers: list[WorkerClient] = []

    def let_go(self, client: WorkerClient, gone: bool) -> None:
        """Close a gone worker's rings; abandon one that lives (reaped once it dies)."""
        try:
            if gone and client.proc is not None and client.alive():
                # A spawned worker that reported an attach or configuration error: it lives on, waiting for a
                # Shutdown.  No job of ours is with it (checked in worker_died), so nothing needs its death; vLLM's
                # scheduler thread must not wait for it either: one stuck in the kernel does not die of SIGKILL
                # (close() waited for it, unbounded).
                client.kill()
                gone = False
            if gone:
                client.close(timeout_s=0)  # gone already, or an operator's worker (it stops on its rings closing)
            else:
                client.abandon()  # close() would wait for a process that does not die
                self.workers.append(client)
        except Exception as e:  # the rings are ours; closing them must not take vLLM down
            log.warning("closing the dead worker's rings: %s", e)

    def reap(self) -> None:
        """Forget the given-up workers that are gone (each reaped: no zombie)."""
        self.workers = [c for c in self.workers if not c.reap()]

    def wait(self, timeout_s: float) -> None:
        """Reap for at most ``timeout_s``; say which are still alive."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.reap()
            if not self.workers or time.monotonic() > deadline:
                break
            time.sleep(0.01)
        for c in self.workers:
            log.error("p2pworker %s: a worker given up earlier (pid %d) is still alive; stop it by hand", self.name,
                      c.proc.pid)


def kill_until_gone(client: WorkerClient | None, name: str) -> None:
    """SIGKILL the worker and wait until it is gone (drain_jobs: a blocked reset is visible; a job failed while
    the worker lives is not safe), killing it again and saying so every DRAIN_LOG_S."""
    if client is None:
        return
    client.kill()
    next_log = time.monotonic() + DRAIN_LOG_S
    while client.alive():
        if time.monotonic() >= next_log:
            next_log += DRAIN_LOG_S
            log.error("drain: p2pworker %s still alive after SIGKILL; vLLM's reset waits for it", name)
            client.kill()
        time.sleep(0.01)
