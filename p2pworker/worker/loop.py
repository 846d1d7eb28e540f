"""The transfer worker: one event-loop thread that owns every ring, socket, NIXL handle and session.

Loop (``Worker.step``): take commands from the command ring (commands.py); poll the control transport (links
up/down, frames into sessions: sessions.py); the same-host lanes (lane_host.py); the data transport (settled reads
back to the sessions that posted them: actions.py); run the timers (timers.py: session and parking-lot time-outs,
adapter liveness); push events to the event ring (outbox.py); answer the admin socket (status.py).  Then sleep
(sleeper.py) on the ring's bell, the control sockets and the admin socket together: up to ``busy_poll_s`` while
transfers may be landing (NIXL's progress is driven from here; its own spinning thread is off), up to the next
timer otherwise.

Shutdown (Shutdown command, SIGTERM/SIGINT, or the adapter gone): shutdown.py.  A second signal exits at once
with status 1.
"""

from __future__ import annotations

import importlib
import logging
import os
import signal
import time
from typing import Any, Callable

from p2pworker import api
from p2pworker.admin import AdminServer
from p2pworker.config import WorkerConfig
from p2pworker.errors import P2PError
from p2pworker.session.session import longest_hold_s
from p2pworker.shm import Ring, Role
from p2pworker.worker.actions import ActionRunner
from p2pworker.worker.attachment import attach
from p2pworker.worker.commands import Commands
from p2pworker.worker.core import Core
from p2pworker.worker.lane_host import LaneHost
from p2pworker.worker.outbox import EventOutbox
from p2pworker.worker.phase import PhaseEvent, WorkerPhase, next_phase
from p2pworker.worker.sessions import SessionHost
from p2pworker.worker.shutdown import StopRooms, shut_down
from p2pworker.worker.sleeper import Sleeper, poll_timeout_s
from p2pworker.worker.status import status
from p2pworker.worker.timers import Timers, boottime, trim_heap

log = logging.getLogger("p2pworker.worker")

HOOK_ENV = "P2PWORKER_HOOK"  # "module:function": called with the Worker before it runs (see install_hook)


def _attach_ring(name: str, role: Role, msg_type: Any, deadline: float, clock: Callable[[], float]) -> Ring:
    """Attach ring `name`, retrying every 0.1 s while it does not exist yet, until `deadline` (then raise)."""
    while True:
        try:
            return Ring.attach(name, role, msg_type=msg_type)
        except P2PError:
            if clock() >= deadline:
                raise
            time.sleep(0.1)


def _shared(name: str, settable: bool = True) -> property:
    """One of the core's attributes, read (and, unless it is derived, set) through the Worker (what tests, hooks and
    metrics use)."""
    def get(self):
        return getattr(self.core, name)

    return property(get, (lambda self, value: setattr(self.core, name, value)) if settable else None)


class Worker:
    def __init__(self, cfg: WorkerConfig, *, clock: Callable[[], float] = boottime):
        if not cfg.rings:
            raise P2PError("the worker needs --rings PREFIX (the adapter creates <PREFIX>.cmd and <PREFIX>.evt)")
        cmd_name, evt_name = api.ring_names(cfg.rings)
        deadline = clock() + cfg.wait_rings_s
        # an operator may start the worker before vLLM creates the rings, and the adapter creates the command ring
        # before the event ring: wait for each within the one deadline
        self.cmd = _attach_ring(cmd_name, Role.CONSUMER, api.Command, deadline, clock)
        try:
            self.evt = _attach_ring(evt_name, Role.PRODUCER, api.Event, deadline, clock)
        except BaseException:
            self.cmd.close()
            raise
        self.core = Core(cfg, clock, self.cmd, self.evt)
        core = self.core
        self.outbox = EventOutbox(self.evt, core.reporter, core.counters, clock, core)
        # each room is handed the rooms it calls (ports.py), never this Worker
        self.host = SessionHost(core)
        self.lanes = LaneHost(core, self.host, self.unready)
        self.runner = ActionRunner(core, self.host, self.lanes, self.outbox)
        self.commands = Commands(core, self.host, self.outbox, self.attach)
        self.host.wire(self.runner, self.lanes, self.commands.handle)
        self.timers = Timers.start(cfg.tick_s, clock)
        self.sleeper = Sleeper(self.cmd, self.evt)
        self._signals = 0
        self._heartbeats = 0
        self.admin = AdminServer(cfg.admin_path or f"/tmp/p2pworker-{cfg.name}-{os.getpid()}.admin", self.status)
        self.metrics = None
        if cfg.metrics_port:  # last: a scrape reads the rooms above
            from p2pworker.metrics import Metrics

            # port + DP index, like the control port: every DP rank of an engine serves its own
            self.metrics = Metrics(self, cfg.metrics_port + cfg.control.dp_index, cfg.metrics_host)
            self.outbox.metrics = self.metrics

    # ------------------------------------------------------------ what the rooms share (core.py), read through here
    cfg = _shared("cfg")
    clock = _shared("clock")
    started = _shared("started")
    counters = _shared("counters")
    reporter = _shared("reporter")
    instruments = _shared("instruments")  # a test hook sets it (install_hook): the rooms read it from the core
    att = _shared("att")
    phase = _shared("phase")
    stop_reason = _shared("stop_reason")
    ctl = _shared("ctl", settable=False)  # derived from the attachment / the phase
    data = _shared("data", settable=False)
    ctx = _shared("ctx", settable=False)
    region = _shared("region", settable=False)
    identity = _shared("identity", settable=False)
    stopping = _shared("stopping", settable=False)

    @property
    def sessions(self) -> dict:
        return self.host.sessions

    # ------------------------------------------------------------ phase
    def install_signal_handlers(self) -> None:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)

    def _on_signal(self, signum: int, _frame: Any) -> None:
        self._signals += 1
        if self._signals > 1:
            log.error("second signal (%s): exiting now without an orderly shutdown", signal.Signals(signum).name)
            os._exit(1)
        self.stop(f"signal {signal.Signals(signum).name}")

    def stop(self, reason: str) -> None:
        self.core.stop(reason)

    def drain(self) -> None:
        self.core.drain()

    def abort(self, why: str) -> None:
        self.core.abort(why)

    def attach(self, cmd: api.AttachRegion) -> None:
        if self.att is not None:
            raise P2PError("a region is attached already")
        self.instruments.on_attach(cmd)
        self.core.att = attach(self.cfg, cmd, self.reporter, self.clock)
        if self.metrics is not None:
            self.metrics.prime()  # every job series at 0 from now on, labelled with the model just learned
        att = self.att
        self.outbox.emit(self.instruments.on_ready(api.Ready(
            att.ctl.node_id, att.ctl.address, att.data.backend, att.fingerprint.digest, self.admin.endpoint,
            api=api.RING_API, hold_s=longest_hold_s(self.cfg.session))))

    # ------------------------------------------------------------ running
    def run(self) -> int:
        try:
            while not self.stopping:
                busy = self.step()
                if not self.stopping:
                    self._sleep(busy)
        finally:
            self.shutdown()
        return 0

    def step(self) -> bool:
        """One loop iteration; True when more work is expected soon (do not sleep long)."""
        self.counters["loops"] += 1
        did = self._poll()
        self._on_timers(self.clock())
        self.outbox.flush()
        if not self.unready(self.admin.socket):
            self.admin.serve()
        self.sleeper.forget()  # what the last sleep found readable was for this turn only
        # Events the full event ring could not take yet are not "busy": _sleep waits for the adapter to free a slot
        # (the ring's space bell), instead of polling every busy_poll_s while an adapter is slow to read.
        return did or self._reads_in_flight() or self.lanes.switch.backlog()

    def _poll(self) -> bool:
        """Everything that may have arrived: commands, control events, lanes, settled reads, resolved names."""
        did = self.commands.take()
        att = self.att  # read once per turn: this runs several times per request
        if att is not None:
            ctl = att.ctl
            if not (self.sleeper.watched(self._epoch()) and ctl.quiet(self.sleeper.readable)):
                for ev in ctl.poll(0):
                    did = True
                    self.host.on_control(ev)
        if self.lanes.switch.polled():
            did = self.lanes.poll() or did
        if att is not None:
            server = att.data.lane_server()
            if server is not None and server.lanes_waiting:
                did = True
                self.lanes.take(server)
            did = self.runner.poll_data() or did
        if self.host.resolver:
            did = self.host.resolved() or did
        return did

    def _on_timers(self, now: float) -> None:
        t = self.timers
        if t.tick.due(now):
            self._tick(now)
        # Events waiting, here or unread in the ring, prove liveness already.  And an idle vLLM 0.32 engine is woken
        # for what its tier must read (vllm_adapter.engine_hook): one heartbeat left unread there is not that.
        if not self.outbox.pending and not self.evt.depth() and t.heartbeat.due(now):
            self._heartbeats += 1
            self.outbox.emit(api.Heartbeat(self._heartbeats))
        if t.trim.due(now):
            trim_heap()
        if t.liveness.due(now):
            peer = self.cmd.peer_status()
            if peer.gone:
                self.stop(f"the adapter is gone (command ring producer {peer.value})")

    def _tick(self, now: float) -> None:
        self.host.tick()
        self.lanes.switch.deadlines(now)
        if self.ctx is not None:
            self.ctx.lot.tick()
            self.lanes.exits.tick()
            self.host.reopen_kept()
        if self.phase is WorkerPhase.DRAINING and self.reporter.open_jobs == 0 and not self._in_flight():
            self.core.phase = next_phase(self.phase, PhaseEvent.DRAINED)  # still refusing new work
            self.outbox.emit(api.Drained())

    def _reads_in_flight(self) -> bool:
        """Sleep short (busy_poll_s) only while our own posted reads are in flight (NIXL progress and
        completions, the ZMQ fallback's replies).  Leased rows a peer may be reading get the passive rates of
        poll_timeout_s; an idle worker sleeps on its sockets."""
        return self.data is not None and bool(self.data.in_flight())

    def _in_flight(self) -> bool:
        return self._reads_in_flight() or self.host.in_flight()

    # ------------------------------------------------------------ sleeping
    def _epoch(self) -> tuple:
        return (self.ctl.sockets_epoch if self.ctl is not None else -1, self.lanes.switch.epoch)

    def unready(self, source) -> bool:
        """The last sleep's poll watched ``source`` and found nothing to read: skip reading it this turn."""
        return self.sleeper.unready(source, self._epoch())

    def _sleep(self, busy: bool) -> None:
        self.sleeper.forget()
        if self.data is not None and self.data.has_backlog():
            return  # pieces are ready to post: no sleeping
        lot = self.ctx.lot if self.ctx is not None else None
        timeout_s = poll_timeout_s(self.cfg, busy=busy, now=self.clock(), next_tick=self.timers.tick.next_at,
                                   offering=lot.offering if lot is not None else 0,
                                   last_offer_at=lot.last_offer_at if lot is not None else -float("inf"))
        self.instruments.on_sleep(timeout_s)
        self.sleeper.sleep(timeout_s, self._epoch(), self._sleep_sources, room_wanted=self.outbox.waiting)
        self.instruments.on_woke()

    def _sleep_sources(self) -> list:
        server = self.data.lane_server() if self.data is not None else None
        return [self.admin.socket, *(self.ctl.sockets() if self.ctl is not None else ()),
                *([server.wake_fd] if server is not None else ()), *self.lanes.switch.fds()]

    # ------------------------------------------------------------ stopping and showing
    def shutdown(self) -> None:
        """Fail or finish every job once, drain transfers, deregister, unmap, close the rings (shutdown.py)."""
        self.core.phase = next_phase(self.phase, PhaseEvent.STOP)
        try:
            self.instruments.on_stop()
        except Exception:  # noqa: BLE001  (hook code: whatever it raised, the orderly stop still runs)
            log.exception("instrument point on_stop raised; stopping anyway")
        try:
            shut_down(self.core, StopRooms(self.commands, self.host, self.runner, self.outbox, self.lanes.switch,
                                           tuple(x for x in (self.metrics, self.admin) if x is not None)))
        finally:
            self.lanes.exits.close()

    def status(self) -> dict:
        return status(self.core, self.host, self.lanes.switch)


def install_hook(worker: Worker, env=os.environ) -> str | None:
    """The one extension point: ``$P2PWORKER_HOOK=module:function`` calls ``function(worker)`` before the worker
    runs; the function sets ``worker.instruments`` to its own :class:`~p2pworker.instruments.Instruments` (e.g.
    tests/hooks/corrupt_loads.py, the e2e negative control).  Test code only: it runs inside the worker with full
    access, so the worker logs a warning naming it.  Returns what was installed."""
    spec = env.get(HOOK_ENV)
    if not spec:
        return None
    module, sep, name = spec.partition(":")
    if not sep or not module or not name:
        raise ValueError(f"${HOOK_ENV}={spec!r}: expected module:function")
    log.warning("$%s=%s: installing; this worker runs test code", HOOK_ENV, spec)
    getattr(importlib.import_module(module), name)(worker)
    return spec
