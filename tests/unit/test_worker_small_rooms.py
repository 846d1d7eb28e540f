"""The worker's small rooms without processes: the attachment (p2pworker/worker/attachment.py), the sleeper
(sleeper.py), the status report (status.py) and the command handlers' branches (commands.py).

Collaborators are small stand-ins; the region, the rings and the bells are real where that is cheap (/dev/shm
under the test's own prefix, pipes, an inproc ZMQ pair), so what a test reads is what the worker would see.
"""

from __future__ import annotations

import collections
import math
import os
import socket
import time
import types

import msgspec
import pytest
import zmq

from p2pworker import api
from p2pworker.config import DataConfig, WorkerConfig
from p2pworker.control.base import SECRET_ENV
from p2pworker.control.zmq_config import ControlConfig
from p2pworker.data.samehost import auto_copy_threads, available_cpus
from p2pworker.errors import (
    AuthError,
    DataPlaneUnavailable,
    LocalProtocolError,
    MessageTooLarge,
    P2PError,
    RegionError,
    RingApiMismatch,
)
from p2pworker.fingerprint import Fingerprint
from p2pworker.instruments import Instruments
from p2pworker.protocol.messages import PROTOCOL_VERSION
from p2pworker.session import JobDone, LookupAnswer, Reporter, State
from p2pworker.session.core import SessionCounters
from p2pworker.shm import KVRegion, Ring, Role
from p2pworker.worker import Worker, attachment
from p2pworker.worker.attachment import Attachment
from p2pworker.worker.commands import TAKE_PER_TURN, Commands
from p2pworker.worker.peers import PeerBook
from p2pworker.worker.phase import WorkerPhase
from p2pworker.worker.sessions import PARKED
from p2pworker.worker.sleeper import Sleeper, poll_timeout_s
from p2pworker.worker.status import status
from tests.helpers.session import Clock

BLOCK = 4096


# ------------------------------------------------------------ shared stand-ins and helpers
def _mappings(path: str) -> int:
    """How many mappings of ``path`` this process holds: what an attach maps and an undo must unmap."""
    with open("/proc/self/maps") as f:
        return sum(path in line for line in f)


@pytest.fixture
def region(shm_prefix):
    """The adapter's region (owner: it maps it once itself); the attach under test maps it a second time."""
    reg = KVRegion.create(f"{shm_prefix}kv", 4, BLOCK)
    yield reg
    reg.close()


class _Ctl:
    """The control transport as the attachment and the worker's stop use it; records that it was closed."""

    made: list = []

    def __init__(self, cfg):
        self.cfg, self.closed = cfg, False
        self.node_id, self.address = f"node-{len(_Ctl.made)}", "tcp://127.0.0.1:5710"
        self.counters = {"frames_in": 7}
        _Ctl.made.append(self)

    def close(self):
        self.closed = True


class _Data:
    """The data transport as the attachment, the status report and the worker's stop read it."""

    backend = "zmq"

    def __init__(self, region, kw, lane_server=None):
        self.region, self.kw, self.lane = region, kw, lane_server
        self.info = object()  # what peers need: handed on to the session context as is
        self.closed = False
        self.stats = types.SimpleNamespace(bytes_done=0, done=0, failed=0)

    def local_info(self):
        return self.info

    def lane_server(self):
        return self.lane

    def in_flight(self):
        return 0

    def poll(self):
        return [], []

    def close(self, timeout_s=10.0):
        self.closed = True
        return True


def _data_plane(made: list, *, fails: BaseException | None = None, lane_server=None):
    """A make_data_transport that records what it was asked for, or raises ``fails``."""
    def make(region, **kw):
        if fails is not None:
            raise fails
        made.append(_Data(region, kw, lane_server))
        return made[-1]
    return make


def _attach_cmd(region: KVRegion, ring_api: int = api.RING_API) -> api.AttachRegion:
    return api.AttachRegion(region.handle, {"model": "tiny", "dtype": "bf16"}, ring_api)


# ------------------------------------------------------------ attachment: a failed attach is undone
def test_an_adapter_of_another_ring_api_is_refused_before_anything_is_mapped(region, monkeypatch):
    _Ctl.made = []
    monkeypatch.setattr(attachment, "ZmqControl", _Ctl)
    path = region.handle.segments[0].path
    before = _mappings(path)
    with pytest.raises(RingApiMismatch, match=f"ring API {api.RING_API + 1}"):
        attachment.attach(WorkerConfig(prefault=False), _attach_cmd(region, api.RING_API + 1), Reporter(), Clock())
    assert _mappings(path) == before and _Ctl.made == []


def test_a_control_plane_that_cannot_start_unmaps_the_region_it_had_mapped(region, monkeypatch):
    # The real ZmqControl refuses to start with auth on and no secret: no stand-in, nothing bound.
    monkeypatch.delenv(SECRET_ENV, raising=False)
    path = region.handle.segments[0].path
    before = _mappings(path)
    cfg = WorkerConfig(prefault=False, control=ControlConfig(port=0, auth=True, secret=None))
    with pytest.raises(AuthError, match="no shared secret"):
        attachment.attach(cfg, _attach_cmd(region), Reporter(), Clock())
    assert _mappings(path) == before


@pytest.mark.parametrize("fails", [DataPlaneUnavailable("NIXL is not installed"), RuntimeError("UCX failed"),
                                   KeyboardInterrupt()], ids=lambda e: type(e).__name__)
def test_a_data_plane_that_cannot_start_closes_the_control_and_unmaps_the_region(region, monkeypatch, fails):
    _Ctl.made, made = [], []
    monkeypatch.setattr(attachment, "ZmqControl", _Ctl)
    monkeypatch.setattr(attachment, "make_data_transport", _data_plane(made, fails=fails))
    path = region.handle.segments[0].path
    before = _mappings(path)
    with pytest.raises(type(fails)):
        attachment.attach(WorkerConfig(prefault=False), _attach_cmd(region), Reporter(), Clock())
    (ctl,) = _Ctl.made
    assert ctl.closed and _mappings(path) == before and made == []


class _LateFailingData(_Data):
    """A data plane that starts, then fails when the session context asks it what peers need."""

    def local_info(self):
        raise RuntimeError("UCX worker address unavailable")


class _UndrainedData(_LateFailingData):
    """Fails like _LateFailingData, and then cannot say its transfers are over (close returns False)."""

    def close(self, timeout_s=10.0):
        self.closed = True
        return False


class _CloseRaisesData(_LateFailingData):
    def close(self, timeout_s=10.0):
        self.closed = True
        raise OSError("deregistration failed")


@pytest.mark.parametrize("kind, unmapped", [(_LateFailingData, True), (_UndrainedData, False),
                                            (_CloseRaisesData, False)], ids=["drained", "close-false", "close-raises"])
def test_a_step_failing_after_the_data_plane_started_closes_it_and_the_control_and_unmaps_once_drained(
        region, monkeypatch, kind, unmapped):
    # invariant 2: unmap only after the data plane said nothing can land (else the mapping is leaked, on purpose:
    # never unmapped under a transfer); the attach's own error is what surfaces
    _Ctl.made, made = [], []
    monkeypatch.setattr(attachment, "ZmqControl", _Ctl)

    def make(region, **kw):
        made.append(kind(region, kw))
        return made[-1]
    monkeypatch.setattr(attachment, "make_data_transport", make)
    path = region.handle.segments[0].path
    before = _mappings(path)
    with pytest.raises(RuntimeError, match="UCX worker address"):
        attachment.attach(WorkerConfig(prefault=False), _attach_cmd(region), Reporter(), Clock())
    (ctl,), (data,) = _Ctl.made, made
    assert data.closed and ctl.closed
    assert _mappings(path) == (before if unmapped else before + 1)


# ------------------------------------------------------------ attachment: a successful attach, and its undoing
@pytest.mark.parametrize("copy_threads", [3, 0], ids=["configured", "auto"])
@pytest.mark.parametrize("lane_server", [None, "handover"], ids=["no-lanes", "lanes"])
def test_a_successful_attach_maps_the_adapters_rows_and_hands_the_config_on(region, monkeypatch, copy_threads,
                                                                             lane_server):
    _Ctl.made, made = [], []
    monkeypatch.setattr(attachment, "ZmqControl", _Ctl)
    monkeypatch.setattr(attachment, "make_data_transport", _data_plane(made, lane_server=lane_server))
    path = region.handle.segments[0].path
    before = _mappings(path)
    cfg = WorkerConfig(name="w1", prefault=False, data=DataConfig(copy_threads=copy_threads))
    cmd = _attach_cmd(region)
    reporter, clock = Reporter(), Clock(5.0)
    att = attachment.attach(cfg, cmd, reporter, clock)

    (ctl,), (data,) = _Ctl.made, made
    want_threads = copy_threads or auto_copy_threads(available_cpus())
    assert (att.ctl, att.data, att.copy_threads) == (ctl, data, want_threads)
    assert data.region is att.region and data.kw["copy_threads"] == want_threads
    assert data.kw["agent_name"] == f"w1-{ctl.node_id}" and data.kw["backend"] == cfg.data.backend
    assert att.fingerprint == Fingerprint.build(block_bytes=BLOCK, protocol_version=PROTOCOL_VERSION,
                                                identity=cmd.identity)
    assert (att.ctx.node_id, att.ctx.data_info, att.ctx.reporter, att.ctx.clock) == (ctl.node_id, data.info,
                                                                                    reporter, clock)
    assert att.ctx.lanes is (lane_server is not None)  # lanes only with a handover server to take them
    assert att.ctx.lot.block_bytes == BLOCK and att.identity == cmd.identity and att.identity is not cmd.identity

    # the worker's mapping is the adapter's rows: a write by the adapter is what the worker reads
    region.array()[2, :4] = [1, 2, 3, 4]
    assert _mappings(path) == before + 1 and list(att.region.array()[2, :4]) == [1, 2, 3, 4]
    # undoing it (what the worker's stop does) unmaps the worker's view only; the adapter's rows stay
    att.region.close()
    with pytest.raises(RegionError):
        att.region.array()
    assert _mappings(path) == before and list(region.array()[2, :4]) == [1, 2, 3, 4]


# ------------------------------------------------------------ attachment through a real worker (rings, admin)
@pytest.fixture
def worker(shm_prefix, tmp_path):
    """A real Worker on real rings under the test's prefix; yields (worker, command producer, event consumer)."""
    prefix = f"{shm_prefix}w"
    cmd_name, evt_name = api.ring_names(prefix)
    cmd = Ring.create(cmd_name, Role.PRODUCER, nslots=16, slot_bytes=4096, msg_type=api.Command)
    evt = Ring.create(evt_name, Role.CONSUMER, nslots=16, slot_bytes=4096, msg_type=api.Event)
    w = None
    try:
        cfg = WorkerConfig(rings=prefix, admin_path=str(tmp_path / "w.admin"), prefault=False,
                           control=ControlConfig(port=0, auth=True, secret=None))
        w = Worker(cfg, clock=Clock(100.0))
        yield w, cmd, evt
    finally:
        if w is not None:
            w.shutdown()
        evt.close()
        cmd.close()


def test_a_hook_that_raises_at_on_stop_does_not_skip_the_orderly_stop(worker, tmp_path):
    w, _, _ = worker

    class Raises(Instruments):
        def on_stop(self):
            raise RuntimeError("hook bug")

    w.instruments = Raises()
    admin = tmp_path / "w.admin"
    assert admin.exists()
    w.shutdown()  # does not raise: the hook's error is logged
    assert not admin.exists()  # the stop ran to its end: the admin socket is gone


def _events(evt: Ring) -> list:
    out = []
    while (ev := evt.try_get()) is not None:
        out.append(ev)
    return out


def test_a_failed_attach_leaves_the_worker_unattached_and_says_why_as_a_fatal_attach_error(worker, region,
                                                                                           monkeypatch):
    w, cmd, evt = worker
    monkeypatch.delenv(SECRET_ENV, raising=False)  # the real control plane refuses to start without one
    path = region.handle.segments[0].path
    before = _mappings(path)
    assert cmd.try_put(_attach_cmd(region))
    assert cmd.try_put(api.StoreJob(9, "req", [b"k"], [0]))
    w.step()
    got = [e for e in _events(evt) if not isinstance(e, api.Heartbeat)]
    assert [type(e) for e in got] == [api.WorkerError, api.JobFinished]  # no Ready
    err, job = got
    assert err.attach and err.fatal and err.message.startswith("AttachRegion: ") and "secret" in err.message
    assert (job.job_id, job.success, job.reason) == (9, False, "worker has no region attached yet")
    assert w.att is None and w.status()["state"] == "waiting for region" and _mappings(path) == before


def test_after_a_failed_attach_the_next_one_attaches_and_a_third_is_refused(worker, region, monkeypatch):
    w, _, evt = worker
    _Ctl.made, made = [], []
    monkeypatch.setattr(attachment, "ZmqControl", _Ctl)
    monkeypatch.setattr(attachment, "make_data_transport", _data_plane(made, fails=DataPlaneUnavailable("no NIXL")))
    path = region.handle.segments[0].path
    before = _mappings(path)
    with pytest.raises(DataPlaneUnavailable):
        w.attach(_attach_cmd(region))
    assert w.att is None and _Ctl.made[0].closed and _mappings(path) == before

    monkeypatch.setattr(attachment, "make_data_transport", _data_plane(made))
    w.attach(_attach_cmd(region))
    att = w.att
    assert att is not None and att.ctl is _Ctl.made[1] and _mappings(path) == before + 1
    with pytest.raises(P2PError, match="attached already"):
        w.attach(_attach_cmd(region))
    assert w.att is att and len(_Ctl.made) == 2 and _mappings(path) == before + 1  # the first one untouched
    w.outbox.flush()
    (ready,) = [e for e in _events(evt) if isinstance(e, api.Ready)]
    assert (ready.node_id, ready.backend, ready.fingerprint, ready.api) == (att.ctl.node_id, "zmq",
                                                                           att.fingerprint.digest, api.RING_API)
    w.shutdown()  # the stop undoes the attach: data plane, control, the worker's mapping
    assert made[0].closed and att.ctl.closed and _mappings(path) == before


# ------------------------------------------------------------ poll_timeout_s: edges tests/unit/test_passive_poll.py
# does not cover
CFG = WorkerConfig()


@pytest.mark.parametrize("case, kw, want", [
    ("busy beats an overdue timer", dict(busy=True, next_tick=99.0), CFG.busy_poll_s),
    ("a timer due now", dict(next_tick=100.0), 0.0),
    ("an overdue timer beats the passive rate", dict(next_tick=99.0, offering=2, last_offer_at=100.0), 0.0),
    ("a timer nearer than the burst rate", dict(next_tick=100.0001, offering=1, last_offer_at=100.0), 0.0001),
    ("a timer nearer than the passive rate", dict(next_tick=100.0005, offering=1), 0.0005),
    ("an offer stamped ahead of our clock is still a burst", dict(next_tick=101.0, offering=1, last_offer_at=100.5),
     CFG.passive_burst_poll_s),
])
def test_poll_timeout_edges(case, kw, want):
    args = dict(busy=False, now=100.0, next_tick=101.0, offering=0, last_offer_at=-math.inf) | kw
    assert poll_timeout_s(CFG, **args) == pytest.approx(want, abs=1e-12), case


def test_a_passive_rate_set_above_the_idle_cap_never_lengthens_the_sleep():
    slow = WorkerConfig(idle_poll_s=0.05, passive_poll_s=0.5, passive_burst_poll_s=0.2)
    for last in (100.0, -math.inf):  # in the burst window and after it
        assert poll_timeout_s(slow, busy=False, now=100.0, next_tick=200.0, offering=1, last_offer_at=last) == 0.05


# ------------------------------------------------------------ sleeper
class _Bell:
    """A ring as the sleeper uses it: a real pipe as its bell; ``ready`` is what arm() answers."""

    def __init__(self):
        self.r, self.w = os.pipe()
        os.set_blocking(self.r, False)
        self.ready, self.arms, self.disarms = False, 0, []

    def fileno(self):
        return self.r

    def arm(self):
        self.arms += 1
        return self.ready

    def disarm(self, drain=True):
        self.disarms.append(drain)
        if drain:
            try:
                os.read(self.r, 4096)
            except BlockingIOError:
                pass

    def ring(self):
        os.write(self.w, b"\1")

    def empty(self) -> bool:
        try:
            os.read(self.r, 1)
        except BlockingIOError:
            return True
        return False

    def close(self):
        os.close(self.r)
        os.close(self.w)


@pytest.fixture
def bells():
    cmd, evt = _Bell(), _Bell()
    yield cmd, evt
    cmd.close()
    evt.close()


@pytest.fixture
def zpair():
    """A control socket stand-in: a real inproc ZMQ pair (``a`` is watched, ``b`` makes it readable)."""
    ctx = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    for s in (a, b):
        s.setsockopt(zmq.LINGER, 0)
    a.bind("inproc://sleeper")
    b.connect("inproc://sleeper")
    yield a, b
    a.close()
    b.close()
    ctx.term()


def test_one_poll_over_every_source_wakes_on_the_readable_one_and_the_turn_skips_the_rest(bells, zpair, seqpacket_pair):
    cmd, evt = bells
    dial_a, dial_b = socket.socketpair()
    try:
        dial = dial_a.fileno()  # lanes and dials are watched by fd (LaneSwitch.fds): the poll answers with the int
        sources = [zpair[0], seqpacket_pair[0].fileno(), dial]
        sl, epoch = Sleeper(cmd, evt), (1, 1)
        zpair[1].send(b"frame")
        t0 = time.monotonic()
        sl.sleep(1.0, epoch, lambda: sources, room_wanted=False)
        assert time.monotonic() - t0 < 0.5 and sl.readable == {zpair[0]} and sl.watched(epoch)
        assert not sl.unready(zpair[0], epoch)
        assert all(sl.unready(src, epoch) for src in (seqpacket_pair[0].fileno(), dial, cmd.fileno(), evt.fileno()))
        assert not sl.unready(seqpacket_pair[0].fileno(), (2, 1))  # sources of another epoch: read everything
        assert cmd.disarms == [False] and evt.disarms == [False] and evt.arms == 0  # silent bells are not read
        sl.forget()
        assert not sl.watched(epoch) and not sl.unready(seqpacket_pair[0].fileno(), epoch)

        seqpacket_pair[1].send(b"x")  # a lane and a dial are woken on just like a control socket
        dial_b.send(b"y")
        sl.sleep(1.0, epoch, lambda: sources, room_wanted=False)
        assert sl.readable == {zpair[0], seqpacket_pair[0].fileno(), dial}  # the frame on the pair is still unread
    finally:
        dial_a.close()
        dial_b.close()


def test_the_sources_are_rebuilt_only_when_their_epoch_moves(bells, zpair, seqpacket_pair):
    cmd, evt = bells
    asked = []

    def sources():
        asked.append(len(asked))
        return [zpair[0]] if len(asked) == 1 else [zpair[0], seqpacket_pair[0].fileno()]

    sl = Sleeper(cmd, evt)
    seqpacket_pair[1].send(b"x")
    sl.sleep(0.0, (1, 0), sources, room_wanted=False)
    sl.sleep(0.0, (1, 0), sources, room_wanted=False)
    assert len(asked) == 1 and sl.readable == set()  # the lane is not watched yet: its byte goes unseen
    sl.sleep(0.0, (1, 1), sources, room_wanted=False)  # a lane came up: the epoch moved
    assert len(asked) == 2 and sl.readable == {seqpacket_pair[0].fileno()}


def test_a_command_already_in_the_ring_skips_the_sleep(bells, zpair):
    cmd, evt = bells
    cmd.ready = True
    sl = Sleeper(cmd, evt)
    t0 = time.monotonic()
    sl.sleep(1.0, (0, 0), lambda: [zpair[0]], room_wanted=True)
    # arm() that says "ready" leaves nothing armed: no disarm, and the event ring's bell is not even armed
    assert time.monotonic() - t0 < 0.5 and sl.readable is None and not sl.watched((0, 0))
    assert cmd.disarms == [] and evt.arms == 0


def test_room_in_the_event_ring_wakes_only_a_sleeper_that_waits_for_it(bells):
    cmd, evt = bells
    evt.ready = True
    sl = Sleeper(cmd, evt)
    t0 = time.monotonic()
    sl.sleep(1.0, (0, 0), list, room_wanted=True)
    assert time.monotonic() - t0 < 0.5 and sl.readable is None
    assert cmd.disarms == [True] and evt.disarms == [True]  # both bells emptied: the adapter may have rung one

    sl.sleep(0.01, (0, 0), list, room_wanted=False)  # nothing waits to go out: room is no reason to wake
    assert evt.arms == 1 and sl.readable == set()


def test_a_rung_bell_is_emptied_after_the_poll_and_a_silent_one_is_left_unread(bells):
    cmd, evt = bells
    cmd.ring()
    sl = Sleeper(cmd, evt)
    t0 = time.monotonic()
    sl.sleep(1.0, (0, 0), list, room_wanted=True)
    assert time.monotonic() - t0 < 0.5 and sl.readable == {cmd.fileno()}
    assert cmd.disarms == [True] and evt.disarms == [False] and cmd.empty()


def test_below_a_millisecond_with_nothing_ready_it_sleeps_plainly_then_reads_every_source(bells, seqpacket_pair):
    cmd, evt = bells
    sl = Sleeper(cmd, evt)
    t0 = time.monotonic()
    sl.sleep(0.0005, (0, 0), lambda: [seqpacket_pair[0].fileno()], room_wanted=False)
    assert time.monotonic() - t0 >= 0.0005
    # no poll found anything: nothing is known unready, and both bells are emptied as after any unwatched wait
    assert sl.readable is None and not sl.unready(seqpacket_pair[0].fileno(), (0, 0))
    assert cmd.disarms == [True] and evt.disarms == [True]


def test_below_a_millisecond_with_a_source_ready_it_polls_instead(bells, seqpacket_pair):
    cmd, evt = bells
    seqpacket_pair[1].send(b"x")
    sl = Sleeper(cmd, evt)
    sl.sleep(0.0005, (0, 0), lambda: [seqpacket_pair[0].fileno()], room_wanted=False)
    assert sl.readable == {seqpacket_pair[0].fileno()} and cmd.disarms == [False]


def test_with_the_real_rings_a_published_command_ends_the_sleep_at_once(shm_prefix):
    cmd_name, evt_name = api.ring_names(f"{shm_prefix}sl")
    adapter_cmd = Ring.create(cmd_name, Role.PRODUCER, nslots=8, slot_bytes=256, msg_type=api.Command)
    adapter_evt = Ring.create(evt_name, Role.CONSUMER, nslots=8, slot_bytes=256, msg_type=api.Event)
    cmd = Ring.attach(cmd_name, Role.CONSUMER, msg_type=api.Command)
    evt = Ring.attach(evt_name, Role.PRODUCER, msg_type=api.Event)
    try:
        sl = Sleeper(cmd, evt)
        assert adapter_cmd.try_put(api.Drain())
        t0 = time.monotonic()
        sl.sleep(1.0, (0, 0), list, room_wanted=False)
        assert time.monotonic() - t0 < 0.5 and isinstance(cmd.try_get(), api.Drain)
        t0 = time.monotonic()
        sl.sleep(0.02, (0, 0), list, room_wanted=False)  # an empty ring: the whole timeout, nothing readable
        assert time.monotonic() - t0 >= 0.015 and sl.readable == set()
    finally:
        for r in (evt, cmd, adapter_evt, adapter_cmd):
            r.close()


# ------------------------------------------------------------ status
class _StatusSession:
    def __init__(self, peer_id, state):
        self.peer_id, self.state, self.open_loads, self.close_reason = peer_id, state, 2, ""
        self.counters = SessionCounters(late_reads=1, frames_in=5)


class _StatusData(_Data):
    def __init__(self):
        super().__init__(None, {})
        self.stats = types.SimpleNamespace(bytes_done=1 << 20, done=4, failed=1)

    def in_flight(self):
        return 3

    def path_of(self, link):
        return ("same_host", "") if link == "out-1" else None

    def prefault_of(self, link):
        return {"done": True} if link == "out-1" else None


def _status_worker(phase=WorkerPhase.RUNNING, attached=False):
    reporter = Reporter()
    reporter.open(1, "load", 0.0)
    att = None
    if attached:
        att = Attachment(
            region=types.SimpleNamespace(num_blocks=8, block_bytes=BLOCK), ctl=_Ctl(None), data=_StatusData(),
            ctx=types.SimpleNamespace(lot=types.SimpleNamespace(parcels={"r1": None, "r2": None}, leases=1,
                                                                offering=1)),
            fingerprint=Fingerprint.build(block_bytes=BLOCK, protocol_version=PROTOCOL_VERSION),
            copy_threads=4)
    ring = types.SimpleNamespace(depth=lambda: 1)
    lanes = {"out-1": "up"}
    return types.SimpleNamespace(
        cfg=WorkerConfig(name="st"), att=att, data=att.data if att else None, clock=Clock(110.5), started=100.0,
        phase=phase, stopping=phase is WorkerPhase.STOPPING, reporter=reporter, cmd=ring, evt=ring,
        counters=collections.Counter(loops=12),
        host=types.SimpleNamespace(sessions={}, peers=types.SimpleNamespace(kept={"b:2", "a:1"},
                                                                        down_since={"out-3": 1.0})),
        lanes=types.SimpleNamespace(switch=types.SimpleNamespace(
            state_of=lambda link, s: lanes.get(link, "control link"))))


def _status(w) -> dict:
    return status(w, w.host, w.lanes.switch)  # what the worker hands it: the core (here w), the host, the lanes


def test_an_unattached_worker_reports_no_region_no_data_plane_and_is_waiting(monkeypatch):
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.x=1")
    w = _status_worker()
    st = _status(w)
    assert st["state"] == "waiting for region" and st["name"] == "st" and st["pid"] == os.getpid()
    assert {k: st[k] for k in ("node_id", "address", "backend", "fingerprint", "region")} == dict.fromkeys(
        ("node_id", "address", "backend", "fingerprint", "region"))
    assert (st["copy_threads"], st["transfers_in_flight"], st["bytes_read"], st["parked_requests"]) == (0, 0, 0, 0)
    assert st["transfers"] == {} and st["control"] == {} and st["sessions"] == []
    assert st["uptime_s"] == 10.5 and st["jobs_in_flight"] == 1 and st["ring_depth"] == {"cmd": 1, "evt": 1}
    assert st["kept_peers"] == ["a:1", "b:2"] and st["links_down"] == 1 and st["glibc_tunables"] == "glibc.x=1"
    w.counters["loops"] += 1
    assert st["counters"] == {"loops": 12}  # a copy, taken when asked


def test_an_attached_worker_reports_its_region_data_plane_and_one_row_per_session():
    w = _status_worker(attached=True)
    w.host.sessions.update({"out-1": _StatusSession("peer-b", State.ACTIVE),
                            "in-7": _StatusSession("peer-c", State.HELLO_SENT)})
    st = _status(w)
    att = w.att
    assert st["state"] == "running" and (st["node_id"], st["address"]) == (att.ctl.node_id, att.ctl.address)
    assert (st["backend"], st["copy_threads"], st["fingerprint"]) == ("zmq", 4, att.fingerprint.digest)
    assert st["region"] == {"num_blocks": 8, "block_bytes": BLOCK}
    assert st["transfers"] == {"done": 4, "failed": 1} and st["bytes_read"] == 1 << 20
    assert (st["transfers_in_flight"], st["parked_requests"], st["control"]) == (3, 2, {"frames_in": 7})
    assert (st["leases"], st["leases_offering"]) == (1, 1)
    out, inb = st["sessions"]
    assert (out["link"], out["peer_id"], out["state"], out["open_loads"], out["lane"]) == (
        "out-1", "peer-b", "active", 2, "up")
    assert (out["data_path"], out["data_path_why"], out["peer_region_prefault"]) == ("same_host", "", {"done": True})
    assert out["late_reads"] == 1 and out["frames_in"] == 5  # the session's own counters, flattened in
    # a link the data plane does not know yet (no data peer added): undecided, not an error
    assert (inb["state"], inb["lane"], inb["data_path"], inb["data_path_why"], inb["peer_region_prefault"]) == (
        "hello_sent", "control link", None, "", None)


@pytest.mark.parametrize("phase, attached, want", [
    (WorkerPhase.RUNNING, True, "running"),
    (WorkerPhase.DRAINING, True, "draining"),
    (WorkerPhase.DRAINED, False, "draining"),  # drained still refuses work: shown as draining
    (WorkerPhase.STOPPING, True, "stopping"),
    (WorkerPhase.STOPPING, False, "stopping"),  # stopping wins over waiting for a region
])
def test_the_state_shown_follows_the_phase_before_the_attachment(phase, attached, want):
    assert _status(_status_worker(phase, attached))["state"] == want


# ------------------------------------------------------------ commands: stand-ins for the worker's rooms
class _CmdRing:
    """The command ring as Commands reads it: items are returned in order; an exception item is raised."""

    def __init__(self, items=()):
        self.items = collections.deque(items)

    def try_get(self):
        if not self.items:
            return None
        item = self.items.popleft()
        if isinstance(item, BaseException):
            raise item
        return item


class _Outbox:
    def __init__(self):
        self.events = []

    def error(self, message, *, fatal=False, attach=False):
        self.events.append(api.WorkerError(message, fatal, attach))


class _Lot:
    def __init__(self):
        self.stored, self.finished, self.resets = [], [], []
        self.news = None  # what store() answers: (parcel, new keys) when a lease's owner should offer them
        self.reset_answer = []

    def store(self, job_id, request_id, keys, rows):
        self.stored.append((job_id, request_id, keys, rows))
        return self.news

    def request_finished(self, request_id):
        self.finished.append(request_id)
        return f"parcel {request_id}"

    def reset(self, reason):
        self.resets.append(reason)
        return self.reset_answer


class _Session:
    """A session as the handlers drive it: each move returns one named action, recorded."""

    def __init__(self, link, peer_id="peer-b", served=True):
        self.link, self.peer_id, self.served = link, peer_id, served
        self.calls = []

    def _did(self, *call):
        self.calls.append(call)
        return [f"{call[0]}@{self.link}"]

    def load(self, job_id, request_id, keys, rows, *, ask=False):
        return self._did("load", job_id, request_id, keys, rows, *(("ask",) if ask else ()))

    def lookup(self, lookup_id, keys, request_id):
        return self._did("lookup", lookup_id, keys, request_id)

    def done(self, request_id):
        return self._did("done", request_id)

    def cancel_loads(self, reason):
        return self._did("cancel_loads", reason)

    def close(self, detail, bye=False):
        return self._did("close", detail, bye)

    def answer_lookup(self, lookup_id, present):
        self.calls.append(("answer_lookup", lookup_id, present))
        return types.SimpleNamespace(served=self.served, actions=[f"answer@{self.link}"])


class _Host:
    def __init__(self):
        self.sessions, self.peers = {}, PeerBook()
        self.resolver = types.SimpleNamespace(waiting=[])
        self.resolver.take_waiting = lambda: self.resolver.waiting
        self.route = (None, "peer p:1 unreachable: refused")  # what session_for answers
        self.asked, self.ran, self.pumped = [], [], []

    def session_for(self, address, cmd=None):
        self.asked.append((address, cmd))
        return self.route

    def run(self, link, s, actions):
        self.ran.append((link, list(actions)))

    def pump(self, *news):
        self.pumped.append(news)


class _W:
    def __init__(self, *, attached=True, phase=WorkerPhase.RUNNING, items=()):
        self.clock, self.reporter, self.counters = Clock(5.0), Reporter(), collections.Counter()
        self.instruments, self.phase = Instruments(), phase
        self.lot = _Lot()
        self.att = object() if attached else None
        self.ctx = types.SimpleNamespace(lot=self.lot) if attached else None
        self.host, self.outbox, self.cmd = _Host(), _Outbox(), _CmdRing(items)
        self.ctl = types.SimpleNamespace(disconnected=[])
        self.ctl.disconnect = self.ctl.disconnected.append
        self.stopped, self.drains, self.attaches = [], 0, []
        self.attach_error: BaseException | None = None

    @property
    def stopping(self):
        return self.phase is WorkerPhase.STOPPING

    def stop(self, reason):
        self.stopped.append(reason)
        self.phase = WorkerPhase.STOPPING

    def drain(self):
        self.drains += 1

    def attach(self, cmd):
        self.attaches.append(cmd)
        if self.attach_error is not None:
            raise self.attach_error


def _commands(w: _W) -> Commands:
    """The commands room, handed what the worker hands it: the core (here _W), the session host, the outbox and
    the attach step."""
    return Commands(w, w.host, w.outbox, w.attach)


def _reported(w: _W) -> list:
    """(id, success or present, reason) of what the reporter was told, jobs and lookups alike."""
    out = []
    for ev in w.reporter.take():
        if isinstance(ev, JobDone):
            out.append((ev.kind.value, ev.job_id, ev.success, ev.reason))
        elif isinstance(ev, LookupAnswer):
            out.append(("lookup", ev.lookup_id, ev.present, ev.reason))
    return out


LOAD = api.LoadJob(3, "tcp://p:1", "req", [b"k0", b"k1"], [4, 5])
STORE = api.StoreJob(2, "req", [b"k0"], [7])


# ------------------------------------------------------------ commands: refusals, each ending in a clear report
@pytest.mark.parametrize("attached, phase, reason", [
    (False, WorkerPhase.RUNNING, "worker has no region attached yet"),
    (True, WorkerPhase.DRAINING, "worker is draining or shutting down"),
    (True, WorkerPhase.DRAINED, "worker is draining or shutting down"),
    (True, WorkerPhase.STOPPING, "worker is draining or shutting down"),
    (False, WorkerPhase.DRAINING, "worker has no region attached yet"),  # no region says more than draining
])
def test_a_job_in_the_wrong_phase_fails_at_once_with_the_reason_and_touches_nothing(attached, phase, reason):
    w = _W(attached=attached, phase=phase)
    c = _commands(w)
    c.handle(STORE)
    c.handle(LOAD)
    assert _reported(w) == [("store", 2, False, reason), ("load", 3, False, reason)]
    assert w.lot.stored == [] and w.host.asked == [] and w.host.ran == [] and w.reporter.open_jobs == 0
    assert w.counters["largest_load_keys"] == 2  # inspect's largest load counts refused ones too


def test_a_load_for_an_unreachable_peer_fails_with_the_hosts_reason_and_a_parked_one_waits_unreported():
    w = _W()
    c = _commands(w)
    c.handle(LOAD)
    assert w.host.asked == [("tcp://p:1", LOAD)] and _reported(w) == [("load", 3, False, w.host.route[1])]
    w.host.route = (None, PARKED)  # its name is being resolved: the host runs it again later
    c.handle(api.LoadJob(4, "prefill:1", "req", [b"k"], [1]))
    assert _reported(w) == [] and w.reporter.open_jobs == 0 and w.host.ran == []


def test_a_load_is_routed_to_the_session_the_host_finds_for_its_address():
    w = _W()
    s = _Session("out-1")
    w.host.route = (s, "")
    _commands(w).handle(LOAD)
    assert s.calls == [("load", 3, "req", [b"k0", b"k1"], [4, 5])]
    assert w.host.ran == [("out-1", ["load@out-1"])] and _reported(w) == []
    _commands(w).handle(api.LoadJob(4, "h:1", "req", [b"k0"], [6], ask=True))  # one trip: the Fetch asks
    assert s.calls[-1] == ("load", 4, "req", [b"k0"], [6], "ask")


def test_a_store_is_parked_and_only_news_for_a_lease_reaches_the_host():
    w = _W()
    c = _commands(w)
    c.handle(STORE)
    assert w.lot.stored == [(2, "req", [b"k0"], [7])] and w.host.pumped == []  # nobody leases it yet
    w.lot.news = ("parcel", [b"k9"])
    c.handle(api.StoreJob(5, "req", [b"k9"], [8]))
    assert w.host.pumped == [("parcel", [b"k9"])] and w.host.asked == []  # a store dials no peer


@pytest.mark.parametrize("attached, phase, route, want", [
    (False, WorkerPhase.RUNNING, None, [("lookup", 8, None, "worker not ready")]),
    (True, WorkerPhase.STOPPING, None, [("lookup", 8, None, "worker not ready")]),
    (True, WorkerPhase.RUNNING, (None, "peer p:1 unreachable"), [("lookup", 8, None, "peer p:1 unreachable")]),
    (True, WorkerPhase.RUNNING, (None, PARKED), []),
])
def test_a_lookup_that_cannot_run_is_answered_as_a_miss_with_the_reason(attached, phase, route, want):
    w = _W(attached=attached, phase=phase)
    if route is not None:
        w.host.route = route
    _commands(w).handle(api.LookupKeys(8, "p:1", "req", [b"k"]))
    assert _reported(w) == want and w.host.ran == []
    assert (w.host.asked != []) is (route is not None)  # not ready or stopping: no session looked for


def test_a_lookup_runs_on_its_session_even_while_draining():
    # lookups are not jobs: a draining worker still answers them (only stores and loads are refused)
    w = _W(phase=WorkerPhase.DRAINING)
    s = _Session("out-1")
    w.host.route = (s, "")
    _commands(w).handle(api.LookupKeys(8, "p:1", "req", [b"k"]))
    assert s.calls == [("lookup", 8, [b"k"], "req")] and w.host.ran == [("out-1", ["lookup@out-1"])]


# ------------------------------------------------------------ commands: the other handlers' branches
def test_a_peers_lookup_is_answered_by_the_first_of_its_sessions_that_serves_it():
    w = _W()
    stale, live, later = _Session("in-1", served=False), _Session("in-2"), _Session("in-3")
    other = _Session("in-0", peer_id="someone-else")
    w.host.sessions.update({"in-0": other, "in-1": stale, "in-2": live, "in-3": later})
    _commands(w).handle(api.AnswerLookup("peer-b", 4, [True, False]))
    assert other.calls == [] and later.calls == []
    assert stale.calls == live.calls == [("answer_lookup", 4, [True, False])]
    assert w.host.ran == [("in-2", ["answer@in-2"])]


def test_request_finished_and_reset_need_a_region_and_reset_cancels_loads_only_when_asked():
    w = _W(attached=False)
    c = _commands(w)
    c.handle(api.RequestFinished("req"))
    c.handle(api.ResetCache("sleep"))
    assert w.host.pumped == [] and w.host.ran == []

    w = _W()
    w.host.sessions.update({"out-1": _Session("out-1"), "in-2": _Session("in-2")})
    w.lot.reset_answer = ["p1", "p2"]
    c = _commands(w)
    c.handle(api.RequestFinished("req"))
    c.handle(api.ResetCache("drain for shutdown", loads=False))
    assert w.host.pumped == [("parcel req",), ("p1",), ("p2",)] and w.host.ran == []
    c.handle(api.ResetCache("weights updated"))
    assert w.lot.resets == ["drain for shutdown", "weights updated"]
    assert w.host.ran == [("out-1", ["cancel_loads@out-1"]), ("in-2", ["cancel_loads@in-2"])]


def test_consumer_done_reaches_its_session_unless_stopping_or_no_session_is_found():
    w = _W()
    s = _Session("out-1")
    w.host.route = (s, "")
    c = _commands(w)
    c.handle(api.ConsumerDone("p:1", "req"))
    assert w.host.ran == [("out-1", ["done@out-1"])]
    w.host.route = (None, "unreachable")  # its reaper ends what was parked there: nothing to report here
    c.handle(api.ConsumerDone("p:1", "req2"))
    w.phase = WorkerPhase.STOPPING
    c.handle(api.ConsumerDone("p:1", "req3"))
    assert len(w.host.asked) == 2 and len(w.host.ran) == 1 and _reported(w) == []


def test_open_session_keeps_a_listed_peer_and_dials_unless_stopping():
    w = _W()
    c = _commands(w)
    c.handle(api.OpenSession("tcp://p:1"))
    c.handle(api.OpenSession("q:2", keep=False))
    assert w.host.peers.kept == {"p:1"} and [a for a, _ in w.host.asked] == ["tcp://p:1", "q:2"]
    w.phase = WorkerPhase.STOPPING
    c.handle(api.OpenSession("r:3"))
    assert w.host.peers.kept == {"p:1", "r:3"} and len(w.host.asked) == 2  # listed, but nothing dialled now


def test_close_session_says_bye_on_a_live_session_and_clears_its_backoff():
    w = _W()
    s = _Session("out-1")
    w.host.peers.add("p:1", "out-1")
    w.host.peers.kept.add("p:1")
    w.host.peers.backoff("p:1", "refused", w.clock())
    w.host.sessions["out-1"] = s
    _commands(w).handle(api.CloseSession("tcp://p:1"))
    assert s.calls == [("close", "closed by the adapter", True)] and w.host.ran == [("out-1", ["close@out-1"])]
    assert "p:1" not in w.host.peers.kept and w.host.peers.blocked("p:1", w.clock()) is None
    assert w.ctl.disconnected == []  # the session's bye goes first; its retirement hangs up


def test_close_session_of_a_link_without_a_session_forgets_and_hangs_up_the_link():
    w = _W()
    w.host.peers.add("p:1", "out-1")
    c = _commands(w)
    c.handle(api.CloseSession("p:1"))
    assert w.host.peers.links == {} and w.ctl.disconnected == ["out-1"]
    c.handle(api.CloseSession("p:1"))  # nothing left: a no-op
    assert w.ctl.disconnected == ["out-1"] and w.host.ran == []


@pytest.mark.parametrize("reason, want", [("", "shutdown command"), ("vLLM exits", "shutdown command: vLLM exits")])
def test_drain_and_shutdown_reach_the_worker(reason, want):
    w = _W()
    c = _commands(w)
    c.handle(api.Drain())
    c.handle(api.Shutdown(reason))
    assert w.drains == 1 and w.stopped == [want]


# ------------------------------------------------------------ commands: taking from the ring, errors, the stop
def test_a_turn_takes_at_most_its_share_of_commands():
    w = _W(items=[api.Drain() for _ in range(TAKE_PER_TURN + 3)])
    c = _commands(w)
    assert c.take() and w.drains == TAKE_PER_TURN and w.counters["commands"] == TAKE_PER_TURN
    assert c.take() and w.drains == TAKE_PER_TURN + 3
    assert not c.take()  # an empty ring: nothing done


@pytest.mark.parametrize("attached, fatal, says", [
    (False, True, f"this worker speaks ring API {api.RING_API}"),  # before any region: another release's adapter
    (True, False, "undecodable command dropped"),
])
def test_an_undecodable_command_is_reported_and_the_next_one_still_runs(attached, fatal, says):
    w = _W(attached=attached, items=[msgspec.DecodeError("bad tag"), api.Drain()])
    assert _commands(w).take()
    (err,) = w.outbox.events
    assert says in err.message and (err.fatal, err.attach) == (fatal, not attached) and w.drains == 1


def test_a_command_over_the_rings_limit_stops_the_worker_and_leaves_the_rest_untaken():
    w = _W(items=[MessageTooLarge(10**9, 1 << 20, "cmd"), api.Drain()])
    assert _commands(w).take()
    (err,) = w.outbox.events
    assert "over the ring's limit" in err.message and not err.fatal and w.drains == 0
    assert len(w.stopped) == 1 and "exceeded the ring's limit" in w.stopped[0] and len(w.cmd.items) == 1


@pytest.mark.parametrize("error, fatal", [
    (AuthError("no secret"), True),
    (DataPlaneUnavailable("no NIXL"), True),
    (RingApiMismatch("another release", 1, api.RING_API), True),
    (P2PError("a region is attached already"), False),
    (OSError("No space left on device"), False),  # a full /dev/shm may heal: not fatal
])
def test_an_attach_that_fails_is_an_attach_error_fatal_only_for_configuration_errors(error, fatal):
    w = _W(attached=False, items=[api.AttachRegion(None)])
    w.attach_error = error
    _commands(w).take()
    (err,) = w.outbox.events
    assert err.attach and err.fatal is fatal and err.message.startswith("AttachRegion: ") and str(error) in err.message
    assert len(w.attaches) == 1 and w.stopped == []


def test_a_p2p_error_in_another_command_is_reported_and_a_bug_is_raised():
    w = _W()

    def broken(*_a):
        raise LocalProtocolError("duplicate job id 2")

    w.lot.store = broken
    w.cmd.items.append(STORE)
    c = _commands(w)
    c.take()
    (err,) = w.outbox.events
    assert err.message == "StoreJob: duplicate job id 2" and not err.attach and not err.fatal

    def bug(*_a):
        raise KeyError("a bug in the worker")

    w.lot.store = bug
    w.cmd.items.append(STORE)
    with pytest.raises(KeyError):  # not an attach: a bug stops the loop loudly rather than being swallowed
        c.take()


def test_at_shutdown_every_queued_job_and_lookup_fails_once_and_other_commands_are_dropped():
    w = _W(items=[STORE, msgspec.DecodeError("junk"), api.Drain(), api.LookupKeys(9, "p:1", "r", [b"k"]),
                  api.LoadJob(4, "p:1", "r", [b"k"], [1])])
    w.host.resolver.waiting = [LOAD, api.OpenSession("q:2"), api.LookupKeys(8, "q:2", "r", [b"k"])]
    _commands(w).fail_queued("worker shutting down")
    why = "worker shutting down"
    assert _reported(w) == [("load", 3, False, why), ("lookup", 8, None, why), ("store", 2, False, why),
                            ("lookup", 9, None, why), ("load", 4, False, why)]
    assert w.drains == 0 and not w.cmd.items and w.reporter.open_jobs == 0


def test_at_shutdown_a_ring_that_fails_ends_the_sweep():
    w = _W(items=[STORE, MessageTooLarge(10**9, 1 << 20, "cmd"), LOAD])
    _commands(w).fail_queued("bye")
    assert _reported(w) == [("store", 2, False, "bye")] and list(w.cmd.items) == [LOAD]
