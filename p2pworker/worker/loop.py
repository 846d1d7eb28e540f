"""The transfer worker: one event-loop thread that owns every ring, socket, NIXL handle and session.

Loop (``Worker.step``): take commands from the command ring; poll the control
transport (links up/down, frames into sessions); poll the data transport (write
results back to the sessions that submitted them); run timers (session and
parking-lot time-outs, adapter liveness); push events to the event ring; answer
the admin socket.  Then sleep on the ring's bell, the control sockets and the
admin socket together: up to ``busy_poll_s`` while transfers may be landing
(NIXL's progress is driven from here; its own spinning thread is off), up to
the next timer otherwise.

Shutdown (Shutdown command, SIGTERM/SIGINT, or the adapter gone): stop taking
work, fail every open job once (queued commands included), cancel and WAIT for
in-flight transfers, then deregister, then unmap, then exit 0.  A second
signal exits at once with status 1.
"""

from __future__ import annotations

import collections
import ctypes
import importlib
import logging
import math
import os
import signal
import time
from typing import Any, Callable

import msgspec
import zmq

from p2pworker import api
from p2pworker.admin import AdminServer
from p2pworker.config import WorkerConfig
from p2pworker.control import ControlTransport, LinkDown, LinkState, LinkUp, Received, ZmqControl
from p2pworker.control.lane import Lane, LaneBroken, LaneClosed
from p2pworker.data import DataTransport, make_data_transport
from p2pworker.data.handover import TIMEOUT_S as LANE_TIMEOUT_S
from p2pworker.data.handover import LANE_TAKEN, LaneDial, LaneRefused, lane_ids
from p2pworker.data.samehost import auto_copy_threads, available_cpus
from p2pworker.errors import (
    AuthError,
    DataPlaneUnavailable,
    MessageTooLarge,
    P2PError,
    PeerUnusable,
    RemoteProtocolError,
    RingApiMismatch,
    TransferFailed,
)
from p2pworker.fingerprint import Fingerprint
from p2pworker.instruments import Instruments
from p2pworker.protocol.messages import PROTOCOL_VERSION, Bye, LaneUp, decode, encode
from p2pworker.session import (
    Abort,
    Action,
    AddDataPeer,
    CancelReads,
    CloseCause,
    DialLane,
    ExpectLane,
    JobDone,
    JobKind,
    LookupAnswer,
    ParkingLot,
    PostRead,
    RemoveDataPeer,
    Reporter,
    Send,
    ServeLookup,
    Session,
    SessionClosed,
    SessionContext,
    SessionUp,
    State,
)
from p2pworker.session.reporter import Event as ReportedEvent
from p2pworker.session.session import longest_hold_s
from p2pworker.shm import KVRegion, Ring, Role
from p2pworker.worker.peers import PeerBook, addr_key
from p2pworker.worker.resolver import Resolver

log = logging.getLogger("p2pworker.worker")

HOOK_ENV = "P2PWORKER_HOOK"  # "module:function": called with the Worker before it runs (see install_hook)

LIVENESS_CHECK_S = 0.25
TRIM_S = 60.0  # how often freed heap is handed back to the kernel (see _trim)
_malloc_trim = getattr(ctypes.CDLL(None), "malloc_trim", None)  # glibc only; resolved once
PARKED = "parked until the peer's host name is resolved"
FAILED_LOG_PER_S = 10


def boottime() -> float:
    """The worker's clock.  CLOCK_BOOTTIME keeps counting while the machine is suspended (CLOCK_MONOTONIC does
    not): a consumer whose host slept past its lease must see that its lease is over."""
    return time.clock_gettime(time.CLOCK_BOOTTIME)


def poll_timeout_s(cfg: WorkerConfig, *, busy: bool, now: float, next_tick: float, offering: int,
                   last_offer_at: float) -> float:
    """How long the loop may sleep on its sockets: busy_poll_s while our own reads are in flight; otherwise until
    the next timer, but while leases hold offered rows (``offering``) a peer may be reading them, which over TCP
    moves only while we progress: passive_burst_poll_s for passive_burst_s after the last offer (the consumer's
    READ is in flight then), passive_poll_s after that (a lease held long, e.g. by a slow consumer, costs less).
    A lease with nothing offered yet (a Fetch before the stores) costs nothing: nobody reads before an offer.

    Invariant 7: this sets only how long the loop sleeps.  It writes no row and releases none: offered rows stay
    pinned until the consumer's Release or the lease's end (ParkingLot.release), however often we poll; our own
    rows are written only by our reads, reported after they settle."""
    if busy:
        return cfg.busy_poll_s
    timeout_s = max(0.0, min(cfg.idle_poll_s, next_tick - now))
    if offering:
        burst = now - last_offer_at < cfg.passive_burst_s
        timeout_s = min(timeout_s, cfg.passive_burst_poll_s if burst else cfg.passive_poll_s)
    return timeout_s


def _attach_ring(name: str, role: Role, msg_type: Any, deadline: float, clock: Callable[[], float]) -> Ring:
    """Attach ring `name`, retrying every 0.1 s while it does not exist yet, until `deadline` (then raise)."""
    while True:
        try:
            return Ring.attach(name, role, msg_type=msg_type)
        except P2PError:
            if clock() >= deadline:
                raise
            time.sleep(0.1)


class Worker:
    def __init__(self, cfg: WorkerConfig, *, clock: Callable[[], float] = boottime):
        if not cfg.rings:
            raise P2PError("the worker needs --rings PREFIX (the adapter creates <PREFIX>.cmd and <PREFIX>.evt)")
        self.cfg = cfg
        self.clock = clock
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
        self.started = clock()
        self.reporter = Reporter()
        self.region: KVRegion | None = None
        self.data: DataTransport | None = None
        self.copy_threads = 0  # set at attach
        self.ctl: ControlTransport | None = None
        self.ctx: SessionContext | None = None
        self.fingerprint: Fingerprint | None = None
        self.sessions: dict[str, Session] = {}  # control link id -> session
        # outbound links by address, which came up once, the backoff of failed addresses, the kept peers (the tier's
        # `peers`: a PD decode lists its prefill workers, so the first request finds the session and the data path
        # set up; re-opened on the tick, with backoff)
        self.peers = PeerBook()
        self._settling: list[Session] = []  # closed sessions whose cancelled reads have not settled yet
        self._reads: dict[int, tuple[Session, int]] = {}  # data transfer id -> (session, its read id)
        self._tids: dict[tuple[Session, int], int] = {}  # (session, read id) -> data transfer id
        self._held_sends: list | None = None  # see _poll_data
        self._failed_log = [0.0, 0]  # [second started, failed jobs in it]
        self.resolver = Resolver(clock)  # host names resolved off the loop (a slow resolver stalls nothing)
        self.pending: collections.deque = collections.deque()  # events the full event ring could not take
        self.stopping = False
        self.stop_reason = ""
        self.draining = False
        self._drained_sent = False
        self._signals = 0
        self._next_tick = clock()
        self._next_liveness = clock()
        self._next_heartbeat = clock()
        self._next_trim = clock() + TRIM_S
        self._heartbeats = 0
        self.counters = collections.Counter()
        self._poller = zmq.Poller()
        self._poll_epoch: tuple | None = None  # the (control sockets_epoch, lane epoch) the poller was built for
        # What the last sleep's poll found readable, for the loop turn right after it (None: no poll, read all).
        # A source it watched and did not find readable is skipped that turn: ~10 us of empty reads (admin, control
        # sockets, lanes, bells) saved per turn, three turns per request.
        self._readable: set | None = None
        # Same-host lanes (p2pworker.control.lane), by control link, each with the session it belongs to:
        # - _lanes: ours is switched (LaneUp went out on the link: every message of the session goes on the lane);
        # - _dials: we dialed, the acceptor has not taken it yet (until handover.TIMEOUT_S);
        # - _offered: we accepted and took it ("K" sent), the dialer has not said LaneUp yet (until 2 x TIMEOUT_S);
        #   we switch only after the dialer did, so a dialer that gave up never leaves us sending into a lane.
        self._lanes: dict[str, tuple[Session, Lane]] = {}
        self._dials: dict[str, tuple[Session, LaneDial]] = {}
        self._offered: dict[str, tuple[Session, Lane, float]] = {}
        self._lane_epoch = 0
        self.admin = AdminServer(cfg.admin_path or f"/tmp/p2pworker-{cfg.name}-{os.getpid()}.admin", self.status)
        self.identity: dict = {}  # the adapter's KV identity (model, dtype, ...) from AttachRegion; metric labels
        # the named points test hooks implement (p2pworker/instruments.py); nothing runs at them by default
        self.instruments = Instruments()
        self.metrics = None
        if cfg.metrics_port:
            from p2pworker.metrics import Metrics

            # port + DP index, like the control port: every DP rank of an engine serves its own
            self.metrics = Metrics(self, cfg.metrics_port + cfg.control.dp_index, cfg.metrics_host)

    # ------------------------------------------------------------ running
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
        if not self.stopping:
            log.info("stopping: %s", reason)
            self.stopping = True
            self.stop_reason = reason

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
        did = self._take_commands()
        if self.ctl is not None and not (self._watched() and self.ctl.quiet(self._readable)):
            for ev in self.ctl.poll(0):
                did = True
                self._on_control(ev)
        if self._lanes or self._dials:
            did = self._poll_lanes() or did
        server = self.data.lane_server() if self.data is not None else None
        if server is not None and server.lanes_waiting:
            did = True
            self._take_lanes(server)
        if self.data is not None:
            did = self._poll_data() or did
        if self.resolver:
            did = self._resolved() or did
        now = self.clock()
        if now >= self._next_tick:
            self._next_tick = now + self.cfg.tick_s
            for link, s in list(self.sessions.items()):
                self._run(link, s, s.tick())
            for s in list(self._settling):
                self._run(None, s, s.tick())
            self._lane_deadlines(now)
            if self.ctx is not None:
                self.ctx.lot.tick()
                for key in self.peers.kept:  # a kept peer whose session closed: open a new one (_session_for backs off)
                    link = self.peers.links.get(key)
                    lk = self.ctl.link(link) if link is not None else None
                    # no link, or one the control transport gave up on (_session_for drops it, then backs off)
                    if (lk is None or lk.state is LinkState.FAILED) and key not in self.resolver \
                            and not self.stopping:
                        self._session_for(key, api.OpenSession(key))
            if self.draining and not self._drained_sent and self.reporter.open_jobs == 0 and not self._in_flight():
                self._drained_sent = True  # draining stays in force: new work is still refused
                self._emit(api.Drained())
        # Events waiting, here or unread in the ring, prove liveness already.  And an idle vLLM 0.32 engine is woken
        # for what its tier must read (vllm_adapter.engine_hook): one heartbeat left unread there is not that.
        if now >= self._next_heartbeat and not self.pending and not self.evt.depth():
            self._next_heartbeat = now + api.HEARTBEAT_S
            self._heartbeats += 1
            self._emit(api.Heartbeat(self._heartbeats))
        if now >= self._next_trim:
            self._next_trim = now + TRIM_S
            _trim()
        if now >= self._next_liveness:
            self._next_liveness = now + LIVENESS_CHECK_S
            status = self.cmd.peer_status()
            if status.gone:
                self.stop(f"the adapter is gone (command ring producer {status.value})")
        self._flush_events()
        if not self._unready(self.admin.socket):
            self.admin.serve()
        self._readable = None  # valid for this turn only
        # pending events, or one that spans slots and is partly out: the adapter frees slots as it polls
        # Events the full event ring could not take yet are not "busy": _sleep waits for the adapter to free a slot
        # (the ring's space bell), instead of polling every busy_poll_s while an adapter is slow to read.
        return did or self._needs_polling() or any(lane.backlog for _, lane in self._lanes.values())

    # ------------------------------------------------------------ same-host lanes
    def _poll_lanes(self) -> bool:
        did = False
        for link, (s, dial) in list(self._dials.items()):
            try:
                if not dial.step():
                    continue
                if self.clock() >= dial.deadline:  # taken too late: the acceptor may have given up on it already
                    raise LaneRefused(f"{dial.name} took the lane after {LANE_TIMEOUT_S:g} s")
            except LaneRefused as e:
                log.info("no same-host lane to %s: %s", s.peer_id or link, e)
                self._drop_dial(link)
                continue
            did = True
            del self._dials[link]
            self._lane_epoch += 1
            if self.sessions.get(link) is s and s.state is State.ACTIVE:
                self._lane_up(link, s, Lane(dial.sock, self.cfg.control.max_frame_bytes, self.cfg.control.hwm))
            else:
                dial.close()
        for link, (s, lane) in list(self._lanes.items()):
            try:
                # first: what the peer sent before a close (its Bye)
                frames = lane.recv() if lane.reading and not self._unready(lane.fileno()) else ()
                if lane.backlog:
                    lane.flush()
            except LaneBroken as e:
                # closed by the peer (it closed the session, or died): as a lost link ("peer lost" keeps an outbound
                # link to reconnect, see _retire); anything else is a broken session, closed with a Bye
                gone = isinstance(e, LaneClosed)
                self._drop_lane(s)  # a Bye goes on the control link
                self._run(link if not gone else None, s, s.close(
                    f"same-host lane: {e}", cause=CloseCause.PEER_LOST if gone else CloseCause.LOCAL, bye=not gone))
                self._retire(s)
                continue
            did = self._deliver_lane(link, s, frames) or did
        return did

    def _deliver_lane(self, link: str, s: Session, frames) -> bool:
        """Hand ``s`` the frames read from its lane, in order, while it still owns ``link``; True when any came."""
        for frame in frames:
            if self.sessions.get(link) is not s:
                break
            self._on_control(Received(link, frame), lane=True)
        return bool(frames)

    def _lane_up(self, link: str, s: Session, lane: Lane) -> None:
        """Switch ``s``'s messages to ``lane``: LaneUp on the control link first, then only the lane."""
        try:
            self.ctl.send(link, encode(LaneUp()))
        except P2PError as e:
            log.info("no same-host lane to %s: %s", s.peer_id or link, e)
            lane.close()
            return
        self._lanes[link] = (s, lane)
        self._lane_epoch += 1
        self.counters["lanes_up"] += 1
        if s.lane_in:
            lane.reading = True

    def _lane_read(self, link: str, s: Session) -> None:
        """The peer's LaneUp arrived: its later messages are on the lane.  The acceptor switches now too."""
        got = self._lanes.get(link)
        if got is not None and got[0] is s:
            if not got[1].reading:
                got[1].reading = True
                self._lane_epoch += 1
            return
        offered = self._offered.get(link)
        if offered is not None and offered[0] is s:
            del self._offered[link]
            offered[1].reading = True
            self._lane_up(link, s, offered[1])
            return
        # the peer moved its messages to a lane we do not hold (we closed it: taken too late): they would be lost
        self._run(link, s, s.close("the peer moved to a same-host lane we do not hold", bye=True))

    def _take_lanes(self, server) -> None:
        """Lanes dialers proved to our handover thread: tell each dialer we took it; we switch on its LaneUp."""
        for link, key, sock in server.take_lanes():
            s = self.sessions.get(link)
            if s is None or s.state is not State.ACTIVE or s.peer_lane_key != key or link in self._lanes \
                    or link in self._offered:
                sock.close()  # its session is gone (or has one): the dialer sees the close and keeps to the link
                continue
            try:
                sock.send(LANE_TAKEN)
            except OSError:
                sock.close()
                continue
            self._offered[link] = (s, Lane(sock, self.cfg.control.max_frame_bytes, self.cfg.control.hwm),
                                   self.clock() + 2 * LANE_TIMEOUT_S)

    def _lane_deadlines(self, now: float) -> None:
        for link, (s, dial) in list(self._dials.items()):
            if now >= dial.deadline:
                log.info("no same-host lane to %s: not taken within %g s", s.peer_id or link, LANE_TIMEOUT_S)
                self._drop_dial(link)
        for link, (s, lane, by) in list(self._offered.items()):
            if now >= by:  # the dialer gave up before it switched (it logged why): nothing was sent on it
                del self._offered[link]
                lane.close()

    def _drop_dial(self, link: str) -> None:
        _, dial = self._dials.pop(link)
        dial.close()
        self._lane_epoch += 1

    def _drop_lane(self, s: Session) -> None:
        """Everything lane of ``s`` (closed or superseded).  What its lane holds still goes out first (a Bye just
        sent, a last Release), as far as the socket takes it now."""
        link = s.link
        got = self._lanes.get(link)
        if got is not None and got[0] is s:
            del self._lanes[link]
            try:
                got[1].flush()
            except LaneBroken:
                pass
            got[1].close()
            self._lane_epoch += 1
        dial = self._dials.get(link)
        if dial is not None and dial[0] is s:
            self._drop_dial(link)
        offered = self._offered.get(link)
        if offered is not None and offered[0] is s:
            del self._offered[link]
            offered[1].close()
        server = self.data.lane_server() if self.data is not None else None
        if server is not None and s.peer_lane_key:
            server.forget_lane(s.peer_lane_key)

    def _poll_data(self) -> bool:
        """Hand settled reads back to the sessions that posted them."""
        done, failed = self.data.poll()
        if not done and not failed:
            return False
        # What the sessions send about settled reads (Release to the producer) goes out after the events they
        # reported (the load's JobFinished): vLLM waits on the event, the producer only frees rows on the Release
        # (~60 us sooner to vLLM in benchmarks/hops' profile).  The order is safe: the reads settled before either.
        self._held_sends = []
        try:
            for tid in done:
                self._read_result(tid, True, "")
            for tid, reason in failed:
                self._read_result(tid, False, reason)
        finally:
            held, self._held_sends = self._held_sends, None
            self._flush_events()
            for link, s, send in held:  # even if a result raised: a Release withheld would pin the producer's rows
                self._run(link, s, [send])
        return True

    def _read_result(self, tid: int, ok: bool, reason: str) -> None:
        owner = self._reads.pop(tid, None)
        if owner is None:
            self.counters["unowned_transfers"] += 1
            return
        s, rid = owner
        del self._tids[(s, rid)]
        self._run(self._link_of(s), s, s.on_read_result(rid, ok, reason))

    def _link_of(self, s: Session) -> str | None:
        """The link ``s`` may still send on: None once a newer session (or none) owns it."""
        return s.link if self.sessions.get(s.link) is s else None

    def _needs_polling(self) -> bool:
        """Sleep short (busy_poll_s) only while our own posted reads are in flight (NIXL progress and
        completions, the ZMQ fallback's replies).  Leased rows a peer may be reading get the passive rates of
        poll_timeout_s; an idle worker sleeps on its sockets."""
        return self.data is not None and bool(self.data.in_flight())

    def _abort(self, why: str) -> None:
        """Reads we posted will not settle and cannot be aborted (NIXL): the only safe end is this process's death,
        which stops every read it initiated before the adapter reports their jobs.  No orderly shutdown: that
        would unmap and close the rings under the posted reads."""
        log.critical("%s; exiting now so that they cannot land in rows vLLM reuses", why)
        try:
            self.evt.try_put(api.WorkerError(f"exiting: {why}"))
        finally:
            os._exit(70)

    def _in_flight(self) -> bool:
        if self.data is not None and self.data.in_flight():
            return True
        if self.resolver:  # commands parked behind a name lookup are not reported yet
            return True
        return bool(self._settling) or any(s.open_loads or s.leases for s in self.sessions.values())

    def _watched(self) -> bool:
        """The last sleep polled, and over the sources of now: what it did not find readable has nothing to read."""
        return self._readable is not None and self._poll_epoch == self._epoch()

    def _unready(self, source) -> bool:
        """The last sleep's poll watched ``source`` and found nothing to read: skip reading it this turn.  A byte
        or frame that arrived since makes the next poll return at once, so nothing waits longer than a turn."""
        return self._watched() and source not in self._readable

    def _epoch(self) -> tuple:
        return (self.ctl.sockets_epoch if self.ctl is not None else -1, self._lane_epoch)

    def _sleep(self, busy: bool) -> None:
        self._readable = None
        if self.data is not None and self.data.has_backlog():
            return  # pieces are ready to post: no sleeping
        lot = self.ctx.lot if self.ctx is not None else None
        timeout_s = poll_timeout_s(self.cfg, busy=busy, now=self.clock(), next_tick=self._next_tick,
                                   offering=lot.offering if lot is not None else 0,
                                   last_offer_at=lot.last_offer_at if lot is not None else -math.inf)
        epoch = self._epoch()
        if epoch != self._poll_epoch:  # links and lanes come and go: rebuild only then (not O(links) every sleep)
            self._poller = zmq.Poller()
            server = self.data.lane_server() if self.data is not None else None
            lanes = [lane.fileno() for _, lane in self._lanes.values() if lane.reading]
            for sock in (self.cmd.fileno(), self.evt.fileno(), self.admin.socket,
                         *(self.ctl.sockets() if self.ctl is not None else ()),
                         *([server.wake_fd] if server is not None else ()), *lanes,
                         *(dial.fileno() for _, dial in self._dials.values())):
                self._poller.register(sock, zmq.POLLIN)
            self._poll_epoch = epoch
        if self.cmd.arm():
            return
        # Events wait for room in the event ring: the adapter rings our space bell when it takes one (armed here).
        room_wanted = bool(self.pending) or self.evt.pending_bytes > 0
        if room_wanted and self.evt.arm():
            self.cmd.disarm()
            self.evt.disarm()  # the adapter may have rung the bell as it freed that room: empty it (see below)
            return  # room already: flush now
        ready = None
        try:
            if 0 < timeout_s < 0.001 and not self._poller.poll(0):
                # below zmq_poll's millisecond: nothing to read now, so a plain sleep (a passive NIXL target over
                # TCP, whose peer's READ is served only while we progress, wants this while it holds leases)
                time.sleep(timeout_s)
            else:
                # round up: waking early would spin until the timer
                ready = {sock for sock, _ in self._poller.poll(math.ceil(timeout_s * 1000))}
        finally:
            # A bell the poll found readable is emptied; one it did not is not read (an empty read is a syscall and
            # an exception).  A byte the adapter wrote as it saw us armed that lands after the poll makes the next
            # poll return at once with the bell readable: it is emptied then, so no poll keeps returning.
            self.cmd.disarm(drain=ready is None or self.cmd.fileno() in ready)
            self.evt.disarm(drain=ready is None or self.evt.fileno() in ready)
        self._readable = ready

    # ------------------------------------------------------------ commands
    def _take_commands(self) -> bool:
        did = False
        for _ in range(256):
            try:
                cmd = self.cmd.try_get()
            except (msgspec.MsgspecError, UnicodeDecodeError) as e:
                if self.region is None:  # the first command is the adapter's AttachRegion: another release's
                    self._error(f"undecodable command before any region was attached ({e}): the adapter is likely "
                                f"another p2pworker release (this worker speaks ring API {api.RING_API}): install "
                                f"the same release in vLLM's environment and the worker's", fatal=True, attach=True)
                else:
                    self._error(f"undecodable command dropped: {e}")
                continue
            except MessageTooLarge as e:
                # The adapter refuses such a command before sending it (same limit): a job id we could not read would
                # stay open in the adapter forever.  Stop instead; the adapter fails every open job once we are gone.
                self._error(f"command over the ring's limit: {e}")
                self.stop(f"a command exceeded the ring's limit ({e})")
                return True
            if cmd is None:
                break
            did = True
            self.counters["commands"] += 1
            try:
                self.instruments.on_command(cmd)
                self._handle(cmd)
            except P2PError as e:
                attach = isinstance(cmd, api.AttachRegion)
                # Configuration errors (the data plane cannot run here, no secret) do not heal by restarting;
                # a port in use or a full /dev/shm may.
                self._error(f"{type(cmd).__name__}: {e}", attach=attach,
                            fatal=attach and isinstance(e, (DataPlaneUnavailable, AuthError, RingApiMismatch)))
            except Exception as e:
                if not isinstance(cmd, api.AttachRegion):
                    raise
                # A library that fails in its own way at start (NIXL, ZMQ): the cause, not a crash.
                self._error(f"AttachRegion: {type(e).__name__}: {e}", attach=True)
        return did

    def _handle(self, cmd: api.Command) -> None:
        match cmd:
            case api.StoreJob():
                if self._refuse(cmd.job_id, JobKind.STORE):
                    return
                news = self.ctx.lot.store(cmd.job_id, cmd.request_id, cmd.keys, cmd.rows)
                if news is not None:
                    self._pump(*news)
            case api.LoadJob():
                # inspect shows it (tests/e2e/test_long_prompt.py reads it)
                if len(cmd.keys) > self.counters["largest_load_keys"]:
                    self.counters["largest_load_keys"] = len(cmd.keys)
                if self._refuse(cmd.job_id, JobKind.LOAD):
                    return
                s, why = self._session_for(cmd.address, cmd)
                if s is None:
                    if why is not PARKED:
                        self._fail_now(cmd.job_id, JobKind.LOAD, why)
                    return
                self._run(s.link, s, s.load(cmd.job_id, cmd.request_id, cmd.keys, cmd.rows))
            case api.LookupKeys():
                s, why = (None, "worker not ready") if self.ctx is None or self.stopping else \
                    self._session_for(cmd.address, cmd)
                if s is None:
                    if why is PARKED:
                        return
                    self.reporter.open_lookup(cmd.lookup_id)
                    self.reporter.lookup_done(cmd.lookup_id, None, why)
                    return
                self._run(s.link, s, s.lookup(cmd.lookup_id, cmd.keys, cmd.request_id))
            case api.AnswerLookup():
                for link, s in list(self.sessions.items()):
                    if s.peer_id == cmd.peer_id:
                        answer = s.answer_lookup(cmd.lookup_id, cmd.present)
                        if answer.served:
                            self._run(link, s, answer.actions)
                            break
            case api.RequestFinished():
                if self.ctx is not None:
                    self._pump(self.ctx.lot.request_finished(cmd.request_id))
            case api.ConsumerDone():
                if self.ctx is not None and not self.stopping:
                    s, _ = self._session_for(cmd.address, cmd)  # none (unreachable, resolving): its reaper ends them
                    if s is not None:
                        self._run(s.link, s, s.done(cmd.request_id))
            case api.ResetCache():
                if self.ctx is not None:
                    for p in self.ctx.lot.reset(cmd.reason):
                        self._pump(p)
                    if cmd.loads:  # reported once their reads settled (none aborted)
                        for link, s in list(self.sessions.items()):
                            self._run(link, s, s.cancel_loads(cmd.reason))
            case api.OpenSession():
                if cmd.keep:
                    self.peers.kept.add(addr_key(cmd.address))
                if not self.stopping:  # a no-op when the session exists, or the address is in its backoff
                    self._session_for(cmd.address, cmd)
            case api.CloseSession():
                key = addr_key(cmd.address)
                self.peers.kept.discard(key)
                link = self.peers.links.get(key)
                s = self.sessions.get(link) if link is not None else None
                if s is not None:
                    self._run(link, s, s.close("closed by the adapter", bye=True))
                    self.peers.retry.pop(key, None)  # asked for, not a failure: no backoff
                elif link is not None:
                    self.peers.forget(link)
                    self.ctl.disconnect(link)
            case api.AttachRegion():
                self._attach(cmd)
            case api.Drain():
                self.draining = True
            case api.Shutdown():
                self.stop(f"shutdown command{': ' + cmd.reason if cmd.reason else ''}")

    def _refuse(self, job_id: int, kind: JobKind) -> bool:
        if self.ctx is None:
            self._fail_now(job_id, kind, "worker has no region attached yet")
            return True
        if self.stopping or self.draining:
            self._fail_now(job_id, kind, "worker is draining or shutting down")
            return True
        return False

    def _fail_now(self, job_id: int, kind: JobKind, reason: str) -> None:
        now = self.clock()
        self.reporter.open(job_id, kind, now)
        self.reporter.done(job_id, False, (), 0, now, reason)

    def _attach(self, cmd: api.AttachRegion) -> None:
        if self.region is not None:
            raise P2PError("a region is attached already")
        self.instruments.on_attach(cmd)
        why = api.ring_api_mismatch(cmd.api, "the adapter that created our rings")
        if why is not None:
            raise RingApiMismatch(why, cmd.api, api.RING_API)
        cfg = self.cfg
        copy_threads = cfg.data.copy_threads or auto_copy_threads(available_cpus())
        region = KVRegion.attach(cmd.handle, populate=cfg.prefault)
        try:
            self.fingerprint = Fingerprint.build(
                block_bytes=region.block_bytes, protocol_version=PROTOCOL_VERSION, identity=cmd.identity
            )
            self.identity = dict(cmd.identity)
            if self.metrics is not None:
                self.metrics.prime()  # every job series at 0 from now on, labelled with the model just learned
            ctl = ZmqControl(cfg.control)
            data = make_data_transport(
                region, backend=cfg.data.backend, agent_name=f"{cfg.name}-{ctl.node_id}", host=cfg.control.host,
                max_piece_bytes=cfg.data.max_piece_bytes, post_budget_bytes=cfg.data.post_budget_bytes,
                same_host=cfg.data.same_host,
                copy_threads=copy_threads,
                prefault_peers=cfg.data.prefault_peers,
            )
        except BaseException:
            if "ctl" in locals():
                ctl.close()
            region.close()
            raise
        self.region, self.ctl, self.data = region, ctl, data
        self.copy_threads = copy_threads
        lot = ParkingLot(self.reporter, self.clock, block_bytes=region.block_bytes,
                         park_timeout_s=cfg.session.park_timeout_s,
                         park_unfinished_s=cfg.session.park_unfinished_s)
        self.ctx = SessionContext(
            node_id=ctl.node_id, data_info=data.local_info(), fingerprint=self.fingerprint,
            reporter=self.reporter, lot=lot, clock=self.clock, config=cfg.session,
            lanes=cfg.data.same_host and cfg.data.lane and data.lane_server() is not None,
        )
        log.info("region attached (%d x %d B), control %s, data backend %s, fingerprint %s, same-host copies on %d "
                 "thread(s)", region.num_blocks, region.block_bytes, ctl.address, data.backend,
                 self.fingerprint.digest, copy_threads)
        self._emit(self.instruments.on_ready(api.Ready(
            ctl.node_id, ctl.address, data.backend, self.fingerprint.digest, self.admin.endpoint, api=api.RING_API,
            hold_s=longest_hold_s(cfg.session))))

    # ------------------------------------------------------------ sessions
    def _session_for(self, address: str, cmd: Any = None) -> tuple[Session | None, str]:
        """The session of the outbound link to ``address`` (connecting one if needed), or (None, why not).

        (None, PARKED): the host name is being resolved off the loop; ``cmd`` is run again once it is."""
        if self.ctl is None:
            return None, "worker has no region attached yet"
        key = addr_key(address)
        link = self.peers.links.get(key)
        if link is not None:
            lk = self.ctl.link(link)
            if lk is None or lk.state is LinkState.FAILED:
                # The control transport gave up on it (the peer rejected us): drop it; after a backoff the next
                # command opens a fresh link (the peer may have been fixed and restarted meanwhile).
                why = lk.reason if lk is not None else "link gone"
                self._forget_link(link, key, f"control link failed: {why}", f"control link failed: {why}")
                return None, f"peer {address}: control link failed ({why})"
            if lk.state is not LinkState.UP and link in self.peers.was_up:
                # Fail fast: a Fetch queued now would reach whatever process answers next on that address (a
                # restarted producer that never heard of the request) and wait out its fetch_timeout_s.
                return None, f"peer {address}: control link {lk.state.value} ({lk.reason or 'reconnecting'})"
        else:
            now = self.clock()
            b = self.peers.blocked(key, now)
            if b is not None:
                return None, f"peer {address}: {b.why}; retrying in {b.not_before - now:.1f} s"
            target = self.resolver.resolve(key, cmd)
            if target is None:
                return None, PARKED
            try:
                link = self.ctl.connect(target, resolve=False)
            except P2PError as e:
                log.warning("cannot connect to %s: %s", address, e)
                self.peers.backoff(key, f"unreachable: {e}", self.clock())
                return None, f"peer {address} unreachable: {e}"
            self.peers.add(key, link)
        s = self.sessions.get(link)
        if s is None:
            s = self.sessions[link] = self._new_session(link, None)
        return s, ""

    def _forget_link(self, link: str, key: str, close_reason: str, backoff_reason: str) -> None:
        """Drop an outbound link the transport gave up on (or that never came up): its session closes (what waits on
        it fails), and the next command for ``key`` opens a fresh link only after the backoff."""
        self.peers.forget(link)
        self.ctl.disconnect(link)
        s = self.sessions.get(link)
        if s is not None:
            self._run(None, s, s.close(close_reason))
            self._retire(s)
        self.peers.backoff(key, backoff_reason, self.clock())

    def _resolved(self) -> bool:
        """Run the commands whose peer's name resolved (or fail them with the resolver's error or its time-out)."""
        settled = self.resolver.settle()
        for done in settled:
            if done.error is not None:
                self.peers.backoff(done.key, done.error, self.clock())
            for cmd in done.cmds:
                if cmd is not None:
                    self._handle(cmd)  # resolved: proceeds; failed: the backoff entry fails it with the reason
        return bool(settled)

    def _new_session(self, link: str, peer: str | None) -> Session:
        return Session(self.ctx, expected_peer_id=peer, link=link)

    def _pump(self, p, new_keys: list[bytes] | None = None) -> None:
        """The parking lot has news for the session serving ``p``'s lease (new stores, request finished)."""
        if p is not None and p.lease is not None and p.lease.owner is not None:
            s = p.lease.owner
            self._run(self._link_of(s), s, s.pump(p, new_keys))

    def _run(self, link: str | None, s: Session, actions: list[Action]) -> None:
        """Perform what a session asked for, in order.  Failures feed back into the session (iteratively, never
        re-entrantly): a send that fails closes it; a refused data peer closes it before anything else goes out;
        a read that cannot be posted is reported failed to it."""
        todo = collections.deque(actions)
        while todo:
            a = todo.popleft()
            match a:
                case Send(msg=msg):
                    if link is None:
                        continue  # a retired session: its link is gone
                    if self._held_sends is not None:  # inside _poll_data: after the events (in order)
                        self._held_sends.append((link, s, a))
                        continue
                    lane = self._lanes.get(link)
                    try:
                        if lane is not None and lane[0] is s:
                            lane[1].send(encode(msg))  # LaneUp went out on the link: from then on, only the lane
                        else:
                            self.ctl.send(link, encode(msg))
                    except LaneClosed as e:  # the peer's end is gone: as a lost link (see _poll_lanes)
                        link = None
                        cause, detail = lane_end_reason(lane[1], e)
                        todo.extend(s.close(detail, cause=cause))
                    except P2PError as e:  # LaneBroken too
                        log.warning("control link %s: %s; closing its session", link, e)
                        link_was, link = link, None  # nothing more goes out on it
                        todo.extend(s.close(f"control link {link_was} unusable: {e}"))
                case AddDataPeer(info=info, dialed=dialed):
                    try:
                        # a link a peer dialed (a PD producer's 64 consumers) proves its same-host path only when
                        # first read from (never, for a producer): no handover per accepted link
                        self.data.add_peer(link, info, now=dialed)
                    except TransferFailed as e:
                        todo.clear()  # not the HelloAck, not the queued messages
                        todo.extend(s.close(f"data plane refused the peer: {e}", bye=True))
                case RemoveDataPeer():
                    self.data.remove_peer(s.link)
                case DialLane(key=key, info=info):
                    target = self.data.lane_target(info) if link is not None else None
                    if target is not None and link not in self._dials and link not in self._lanes:
                        try:
                            dial = LaneDial(*target, key, lane_ids(self.ctx.node_id, s.peer_id),
                                            self.clock() + LANE_TIMEOUT_S)
                        except LaneRefused as e:
                            log.info("no same-host lane to %s: %s", s.peer_id or link, e)
                        else:
                            self._dials[link] = (s, dial)
                            self._lane_epoch += 1
                case ExpectLane(key=key):
                    server = self.data.lane_server()
                    # only a dialer on our host (same boot, our network namespace): nobody else can dial it here
                    if server is not None and link is not None and s.peer_info is not None and \
                            self.data.lane_target(s.peer_info) is not None:
                        server.expect_lane(key, lane_ids(s.peer_id, self.ctx.node_id), link)
                case PostRead(read_id=rid, local_rows=local, remote_rows=remote):
                    try:
                        tid = self.data.read_blocks(s.link, local, remote)
                    except PeerUnusable as e:  # as a refusal at AddDataPeer: this session cannot move data
                        todo.extend(s.on_read_result(rid, False, f"read refused: {e}"))
                        todo.extend(s.close(f"data plane refused the peer: {e}", bye=True))
                    except TransferFailed as e:
                        todo.extend(s.on_read_result(rid, False, f"read refused: {e}"))
                    else:
                        self._reads[tid] = (s, rid)
                        self._tids[(s, rid)] = tid
                case CancelReads(read_ids=rids):
                    tids = [self._tids[(s, r)] for r in rids if (s, r) in self._tids]
                    if tids:
                        self.data.cancel(tids)
                case Abort(why=why):
                    self._abort(why)
        if s.state is State.CLOSED:
            self._retire(s)
        elif s.lane_in and link is not None:
            self._lane_read(link, s)

    def _retire(self, s: Session) -> None:
        """Forget a closed session's link; keep the session until its cancelled reads settled."""
        link = s.link
        self._drop_lane(s)
        forgotten = False  # removed from one of our collections by this call (counters are folded once)
        if self.sessions.get(link) is s:
            del self.sessions[link]
            forgotten = True
            # the transport's record says who dialled (an outbound link keeps its id across reconnects); a link it
            # forgot already is nobody's to keep (disconnecting it again below is a no-op)
            lk = self.ctl.link(link) if self.ctl is not None else None
            out = lk is not None and lk.outbound
            key = self.peers.addr_of.get(link)  # the address as the adapter gave it (a name stays a name)
            if out and key is not None:
                if self.peers.links.get(key) == link and s.close_cause is not CloseCause.PEER_LOST:
                    # Closed on a live link (protocol error, refused handshake, data plane, send failure): drop the
                    # link and let the next load open a fresh one, after a backoff that doubles while it keeps failing.
                    self.peers.forget(link)
                    self.ctl.disconnect(link)
                    self.peers.backoff(key, s.close_reason, self.clock())
            elif not out and self.ctl is not None and not s.quiet_close:
                # Hang up: the peer's session may still think it is ACTIVE (we may not have been able to send
                # Bye); without the link it notices now instead of sending into a session that ignores it.
                self.ctl.disconnect(link)
        if s.settled:
            if s in self._settling:
                self._settling.remove(s)
                forgotten = True
            if forgotten:  # its counters live on in the worker's (status, metrics)
                for name in ("late_reads", "late_offers", "stale_releases", "unsettled_reads", "protocol_errors"):
                    self.counters[f"sessions_{name}"] += getattr(s.counters, name)
        elif s not in self._settling:
            self._settling.append(s)

    def _on_control(self, ev, *, lane: bool = False) -> None:
        if isinstance(ev, Received):
            s = self.sessions.get(ev.link)
            if s is None:
                return
            actions = s.receive(ev.payload, lane=lane)
            if s.state is State.CLOSED and s.counters.protocol_errors:
                self.counters["protocol_errors"] += 1
                log.warning("peer %s: %s; session closed", s.peer_id or ev.link, s.close_reason)
            self._run(ev.link, s, actions)
        elif isinstance(ev, LinkUp):
            old = self.sessions.get(ev.link)
            if old is not None and old.state is not State.IDLE:
                self._run(None, old, old.close("superseded by a new incarnation of the link"))
                self._retire(old)
            s = self.sessions.get(ev.link)
            if s is None:
                s = self.sessions[ev.link] = self._new_session(ev.link, ev.node_id)
            s.expected_peer_id = ev.node_id
            if ev.outbound:
                self.peers.was_up.add(ev.link)
                self._run(ev.link, s, s.start())
            # An inbound reconnect replaces its old link inside the control transport without a LinkDown:
            # retire sessions whose link is gone.
            for link, other in list(self.sessions.items()):
                if self.ctl.link(link) is None:
                    self._run(None, other, other.close("control link replaced"))
                    self._retire(other)
        elif isinstance(ev, LinkDown):
            self.counters["peer_deaths"] += 1
            key = self.peers.addr_of.get(ev.link)
            if key is not None and ev.link not in self.peers.was_up:
                self._unreachable(ev.link, key, ev.reason)
                return
            s = self.sessions.get(ev.link)
            if s is not None:
                # A peer that shuts down sends its Bye on the session's lane, then closes both; this turn may see the
                # control link go first (the loop reads it before the lanes): read what the lane holds first, so
                # the session ends with the peer's own reason, not "peer lost".
                self._drain_lane(ev.link, s)
            if s is not None and self.sessions.get(ev.link) is s and s.state is not State.CLOSED:
                self._run(None, s, s.close(ev.reason, cause=CloseCause.PEER_LOST))
                self._retire(s)

    def _unreachable(self, link: str, key: str, reason: str) -> None:
        """An outbound link that never came up went down: the address is wrong (refused; not a p2pworker) or silent.
        What waits on it fails now (lookups MISS, loads fail: vLLM recomputes), and so does what comes for it until
        the backoff ends (_session_for), instead of queueing for a handshake that will not come.  Logged once per
        address (bounded) and counted (p2pworker_peers_unreachable)."""
        self.counters["peers_unreachable"] += 1
        if self.peers.first_failure(key):
            # INFO: the control transport already warned, once per address and cause
            log.info("peer %s unreachable: %s; pulls from it recompute (retried after a backoff)", key, reason)
        self._forget_link(link, key, f"peer {key} unreachable: {reason}", f"unreachable: {reason}")

    def _drain_lane(self, link: str, s: Session) -> None:
        """Deliver the frames ``s``'s lane holds now (its end, if it ended, is the caller's to handle).  Writes no
        row: the frames go to the session as on any turn (a read an Offer posts is reported only once it settled,
        and the close that follows cancels it: invariant 7); at most 256 frames, as every lane read."""
        got = self._lanes.get(link)
        if got is None or got[0] is not s or not got[1].reading:
            return
        try:
            frames = got[1].recv()
        except LaneBroken:
            return  # nothing was left on it
        self._deliver_lane(link, s, frames)

    # ------------------------------------------------------------ events
    def _error(self, message: str, *, fatal: bool = False, attach: bool = False) -> None:
        log.error("%s%s", message, " (configuration error: this worker cannot serve)" if fatal else "")
        self.counters["errors"] += 1
        self._emit(api.WorkerError(message, fatal, attach))

    def _emit(self, ev: api.Event) -> None:
        """Queue one of the worker's own events for the adapter (Ready, Drained, Heartbeat, WorkerError), after
        whatever the sessions reported before it: a Drained must not overtake the jobs it says are done."""
        self._take_reported()
        self.pending.append(ev)

    def _take_reported(self) -> None:
        """The sessions' events (session.reporter's vocabulary) into the adapter's (api), in order."""
        for ev in self.reporter.take():
            if isinstance(ev, JobDone):
                # Invariant 7: a hook may write this job's own rows here, by this process, only now: a load's reads
                # have settled and the job is not yet queued for the adapter (so no byte lands after its report)
                self.instruments.on_job_done(ev)
                if not ev.success:
                    self._log_failed(ev)
            elif isinstance(ev, SessionClosed):
                log.info("session with %s closed: %s", ev.peer_id or "?", ev.reason)
            self.pending.append(_to_api(ev))

    def _flush_events(self) -> None:
        self._take_reported()
        if self.evt.pending_bytes and not self.evt.flush():  # the tail of an event that spans slots, first
            return
        while self.pending:
            try:
                taken = self.evt.try_put(self.pending[0])
            except MessageTooLarge as e:  # cannot happen below limits.MAX_JOB_KEYS; a job is still reported
                self.pending[0] = _too_large(self.pending[0], e)  # encoded once, not again every loop turn
                taken = self.evt.try_put(self.pending[0])
            if not taken:
                self.counters["event_ring_full"] += 1
                return
            ev = self.pending.popleft()
            if isinstance(ev, api.JobFinished):
                self.counters[f"jobs_{ev.kind}_{'ok' if ev.success else 'failed'}"] += 1
                if self.metrics is not None:
                    self.metrics.job(ev)

    def _log_failed(self, ev: JobDone) -> None:
        """One line per failed job (what an operator needs to tell a slow peer from a lost one), at most
        FAILED_LOG_PER_S a second: a dead peer fails thousands of jobs at once; the rest are counted."""
        now = self.clock()
        if now - self._failed_log[0] >= 1.0:
            if self._failed_log[1] > FAILED_LOG_PER_S:
                log.info("... and %d more failed jobs in that second", self._failed_log[1] - FAILED_LOG_PER_S)
            self._failed_log = [now, 0]
        self._failed_log[1] += 1
        if self._failed_log[1] <= FAILED_LOG_PER_S:
            log.info("%s job %d failed after %.3f s (%d keys moved): %s", ev.kind, ev.job_id, ev.seconds,
                     len(ev.keys), ev.reason)

    # ------------------------------------------------------------ shutdown
    def shutdown(self) -> None:
        """Fail or finish every job once, drain transfers, deregister, unmap, close the rings."""
        reason = f"worker shutting down ({self.stop_reason or 'exit'})"
        self.stopping = True
        try:
            self._fail_queued_commands(reason)
            for link, sess in list(self.sessions.items()):
                self._run(link, sess, sess.cancel_loads(reason))  # reported once their reads settled
            if self.data is not None:
                if not self.data.close(self.cfg.shutdown_timeout_s):
                    # Posted reads may still land in our rows, and NIXL cannot abort them: report nothing, unmap
                    # nothing; exit, which ends them (the adapter fails the jobs once this process is reaped).
                    self._abort(f"transfers still in flight {self.cfg.shutdown_timeout_s:g} s into the shutdown")
                self._poll_data()  # the cancelled reads settled: loads reported, Releases sent
            for link, sess in list(self.sessions.items()):
                self._run(link, sess, sess.close(reason, bye=True))
            if self.ctx is not None:
                held = self.ctx.lot.shutdown(reason)
                if held:
                    # A consumer may still be reading those rows (a read goes by pid, not by registration):
                    # their store jobs are failed by the adapter once this process is gone, not by us now.
                    log.info("%d leased request(s) stay unreported until this process exits", held)
            for _, lane in self._lanes.values():  # sessions above were retired with theirs: none expected here
                lane.close()
            for _, dial in self._dials.values():
                dial.close()
            for _, lane, _ in self._offered.values():
                lane.close()
            self._lanes.clear()
            self._dials.clear()
            self._offered.clear()
            if self.ctl is not None:
                self.ctl.close()
            deadline = self.clock() + 2.0
            self._flush_events()
            while (self.pending or self.evt.pending_bytes) and self.clock() < deadline and self.cmd.peer_alive():
                time.sleep(0.001)
                self._flush_events()
            if self.pending or self.evt.pending_bytes:
                log.warning("%d events could not be delivered: the adapter is gone or not reading", len(self.pending))
        finally:
            if self.region is not None:
                self.region.close()
            if self.metrics is not None:
                self.metrics.close()
            self.admin.close()
            self.evt.close()
            self.cmd.close()
            log.info("worker stopped: %s", self.stop_reason)

    def _fail_queued_commands(self, reason: str) -> None:
        parked = self.resolver.take_waiting()
        for cmd in parked:
            if isinstance(cmd, api.LoadJob):
                self._fail_now(cmd.job_id, JobKind.LOAD, reason)
            elif isinstance(cmd, api.LookupKeys):
                self.reporter.open_lookup(cmd.lookup_id)
                self.reporter.lookup_done(cmd.lookup_id, None, reason)
        while True:
            try:
                cmd = self.cmd.try_get()
            except (msgspec.MsgspecError, UnicodeDecodeError):
                continue
            except P2PError:
                return
            if cmd is None:
                return
            if isinstance(cmd, (api.StoreJob, api.LoadJob)):
                self._fail_now(cmd.job_id, JobKind.STORE if isinstance(cmd, api.StoreJob) else JobKind.LOAD, reason)
            elif isinstance(cmd, api.LookupKeys):
                self.reporter.open_lookup(cmd.lookup_id)
                self.reporter.lookup_done(cmd.lookup_id, None, reason)

    # ------------------------------------------------------------ status
    def _data_path(self, link: str) -> dict:
        """How a session's reads move (inspect): "same_host" or the backend, and why not same_host."""
        got = self.data.path_of(link) if self.data is not None else None
        path, why = got if got is not None else (None, "")
        prefault = self.data.prefault_of(link) if self.data is not None else None
        return {"data_path": path, "data_path_why": why, "peer_region_prefault": prefault}

    def _lane_state(self, link: str, s: Session) -> str:
        """Where the session's messages go (inspect): "up" (a same-host lane), "dialing", or "control link"."""
        got = self._lanes.get(link)
        if got is not None and got[0] is s:
            return "up"
        return "dialing" if link in self._dials else "control link"

    def status(self) -> dict:
        data = self.data
        return {
            "name": self.cfg.name,
            "pid": os.getpid(),
            "node_id": self.ctl.node_id if self.ctl else None,
            "address": self.ctl.address if self.ctl else None,
            "backend": data.backend if data else None,
            "copy_threads": self.copy_threads,  # [data] copy_threads, or what 0 (auto) chose for this host
            "fingerprint": self.fingerprint.digest if self.fingerprint else None,
            "uptime_s": round(self.clock() - self.started, 3),
            "state": "stopping" if self.stopping else "draining" if self.draining else
                     "running" if self.ctx else "waiting for region",
            "region": None if self.region is None else
                      {"num_blocks": self.region.num_blocks, "block_bytes": self.region.block_bytes},
            "sessions": [
                {"link": link, "peer_id": s.peer_id, "state": s.state.value, "open_loads": s.open_loads,
                 "close_reason": s.close_reason, **self._data_path(link), "lane": self._lane_state(link, s),
                 **s.counters.as_dict()}
                for link, s in self.sessions.items()
            ],
            # what this process's copies run under (p2pworker.copytune: streaming stores for same-host copies)
            "glibc_tunables": os.environ.get("GLIBC_TUNABLES", ""),
            # listed peers (OpenSession keep): re-opened whenever their session ends
            "kept_peers": sorted(self.peers.kept),
            "jobs_in_flight": self.reporter.open_jobs,
            "transfers_in_flight": data.in_flight() if data else 0,
            "bytes_read": data.stats.bytes_done if data else 0,
            "transfers": {"done": data.stats.done, "failed": data.stats.failed} if data else {},
            "parked_requests": len(self.ctx.lot.parcels) if self.ctx else 0,
            "ring_depth": {"cmd": self.cmd.depth(), "evt": self.evt.depth()},
            "control": dict(self.ctl.counters) if self.ctl else {},
            "counters": dict(self.counters),
        }


def _trim() -> None:
    """Hand freed heap back to the kernel.  glibc keeps what a burst freed (the soak's consumer kept ~3 MB
    of free heap after its first minutes: RSS that tracks no live object); one call every TRIM_S costs ~1 ms."""
    if _malloc_trim is not None:
        _malloc_trim(0)


def _too_large(ev: api.Event, e: Exception) -> api.Event:
    """What to report instead of an event the event ring refused: the job still ends once, as a failure."""
    log.error("%s event too large for the event ring: %s", type(ev).__name__, e)
    if isinstance(ev, api.JobFinished):
        return api.JobFinished(ev.job_id, ev.kind, False, [], 0, ev.seconds, f"report too large: {e}")
    if isinstance(ev, api.LookupResult):
        return api.LookupResult(ev.lookup_id, None, f"answer too large: {e}")
    return api.WorkerError(f"{type(ev).__name__} dropped: {e}")


def lane_end_reason(lane: Lane, e: LaneClosed) -> tuple[CloseCause, str]:
    """Why a session ends whose send found its lane closed by the peer.  A peer that closed the session said why
    in a Bye before closing its end, and that Bye may still wait, unread, in our end (our send came first this loop
    turn; Linux reports EPIPE before what is queued): its reason, as if it had been read first.  Otherwise the peer
    is lost.  What is read here is not delivered: the session is closing, and its loads fail either way.  Returns
    the cause and detail Session.close takes."""
    if lane.reading:  # the peer's frames come on the lane (its LaneUp arrived)
        try:
            frames = lane.recv()
        except LaneBroken:
            frames = []
        for frame in frames:
            try:
                msg = decode(frame)
            except RemoteProtocolError:
                break
            if isinstance(msg, Bye):
                return CloseCause.PEER_BYE, msg.reason
    return CloseCause.PEER_LOST, f"same-host lane: {e}"


def _to_api(ev: ReportedEvent) -> api.Event:
    if isinstance(ev, JobDone):
        # success means every key of the job moved: the adapter knows them (a 65,536-key job would echo 2.8 MB)
        keys = [] if ev.success else list(ev.keys)
        return api.JobFinished(ev.job_id, ev.kind, ev.success, keys, ev.nbytes, ev.seconds, ev.reason)
    if isinstance(ev, LookupAnswer):
        return api.LookupResult(ev.lookup_id, None if ev.present is None else list(ev.present), ev.reason)
    if isinstance(ev, ServeLookup):
        return api.PeerLookup(ev.peer_id, ev.lookup_id, ev.request_id, list(ev.keys))
    if isinstance(ev, SessionUp):
        return api.PeerUp(ev.peer_id)
    if isinstance(ev, SessionClosed):
        return api.PeerDown(ev.peer_id, ev.reason)
    raise TypeError(f"not a session event: {ev!r}")  # the worker's own events go straight to _emit


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
