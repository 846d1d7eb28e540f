"""The worker loop's rooms without processes: its phase table, timers, read book, same-host lane records, event
outbox and command table (p2pworker/worker/)."""

from __future__ import annotations

import collections
import threading
import types
import typing

import pytest

from p2pworker import api
from p2pworker.control import LinkState
from p2pworker.errors import MessageTooLarge, P2PError
from p2pworker.protocol import messages as m
from p2pworker.session import CloseCause, Reporter, Send, SessionClosed, State
from p2pworker.session.client import UNREACHABLE
from p2pworker.session.core import SessionCounters
from p2pworker.worker.actions import ActionRunner, ReadBook
from p2pworker.worker.commands import Commands
from p2pworker.worker.lane_host import LaneHost
from p2pworker.worker.lanes import LANE_TIMEOUT_S, LaneLink, LaneStage, LaneSwitch
from p2pworker.worker.outbox import EventOutbox
from p2pworker.worker.sessions import SessionHost
from p2pworker.worker.resolver import Resolver
from p2pworker.worker.phase import PHASE_MOVES, PhaseError, PhaseEvent, WorkerPhase, next_phase
from p2pworker.worker.timers import Timer
from p2pworker.instruments import Instruments
from tests.helpers.session import Clock


# ------------------------------------------------------------ phase
@pytest.mark.parametrize("move", sorted(PHASE_MOVES, key=lambda m: (m[0].value, m[1].value)),
                         ids=lambda m: f"{m[0].name}-{m[1].name}")
def test_every_row_of_the_phase_table_is_the_move_the_worker_makes(move):
    assert next_phase(*move) is PHASE_MOVES[move]


def test_a_move_missing_from_the_phase_table_is_an_error_not_a_silent_stay():
    missing = [(p, e) for p in WorkerPhase for e in PhaseEvent if (p, e) not in PHASE_MOVES]
    assert missing  # RUNNING--DRAINED at least: Drained is only for a worker that was told to drain
    for p, e in missing:
        with pytest.raises(PhaseError):
            next_phase(p, e)


def test_only_a_running_worker_takes_work_and_every_phase_can_stop():
    assert [p for p in WorkerPhase if p.takes_work] == [WorkerPhase.RUNNING]
    assert all(next_phase(p, PhaseEvent.STOP) is WorkerPhase.STOPPING for p in WorkerPhase)
    # drained is reached only through draining, and a drained worker stays drained on a second Drain
    assert [k for k, v in PHASE_MOVES.items() if v is WorkerPhase.DRAINED and k[0] is not WorkerPhase.DRAINED] == \
        [(WorkerPhase.DRAINING, PhaseEvent.DRAINED)]


# ------------------------------------------------------------ timers
def test_a_timer_is_due_once_per_period_and_a_late_turn_does_not_make_the_next_one_early():
    t = Timer(1.0, 10.0)
    assert not t.due(9.99)
    assert t.due(10.0) and not t.due(10.5)
    assert t.due(13.7)  # a late turn
    assert not t.due(14.0) and t.due(14.7)


# ------------------------------------------------------------ read book
def test_the_read_book_finds_a_read_both_ways_and_forgets_it_once():
    book = ReadBook()
    a, b = object(), object()
    book.add(7, a, 1)
    book.add(8, a, 2)
    book.add(9, b, 1)
    assert sorted(book.tids(a, [1, 2, 3])) == [7, 8] and book.tids(b, [1]) == [9]
    read = book.pop(7)
    assert (read.session, read.read_id) == (a, 1)
    assert book.pop(7) is None and book.tids(a, [1]) == [] and len(book) == 2


# ------------------------------------------------------------ same-host lanes
class _Session:
    def __init__(self, lane_in=False):
        self.peer_id, self.lane_in = "peer", lane_in


class _Dial:
    name = "peer"

    def __init__(self, deadline, taken=False):
        self.deadline, self.taken, self.closed = deadline, taken, False
        self.sock = object()

    def step(self):
        return self.taken

    def fileno(self):
        return 99

    def close(self):
        self.closed = True


def test_a_link_holds_one_lane_record_and_only_an_up_lane_carries_messages(seqpacket_pair):
    clock = Clock(100.0)
    sw = LaneSwitch(1 << 20, 64, clock)
    s = _Session(lane_in=True)
    sw.offer("L", s, seqpacket_pair[0])
    assert sw.state_of("L", s) == "control link" and sw.sending_lane("L", s) is None
    assert sw.fds() == []  # an offered lane waits silent: nothing to sleep on
    epoch = sw.epoch
    sw.up("L", s, sw.take_offered("L"))
    assert sw.state_of("L", s) == "up" and sw.sending_lane("L", s) is not None
    assert sw.sending_lane("L", _Session()) is None  # another session of the same link: not its lane
    assert sw.epoch > epoch and sw.fds() == [seqpacket_pair[0].fileno()] and sw.polled()
    sw.dial("L", s, ("ignored",), b"k", b"ids")  # a link with a lane dials nothing more
    assert list(sw.links) == ["L"] and sw.links["L"].stage is LaneStage.UP
    sw.drop("L", s)
    assert not sw.links and seqpacket_pair[0].fileno() == -1


def test_lanes_not_taken_or_not_switched_in_time_are_given_up(seqpacket_pair):
    clock = Clock(100.0)
    sw = LaneSwitch(1 << 20, 64, clock)
    s = _Session()
    dial = _Dial(clock() + LANE_TIMEOUT_S)
    sw.links["D"] = LaneLink(s, LaneStage.DIALING, dial=dial, deadline=dial.deadline)
    sw.offer("O", s, seqpacket_pair[0])
    assert sw.state_of("D", s) == "dialing" and sw.fds() == [99]
    clock.t += LANE_TIMEOUT_S
    sw.deadlines(clock())
    assert dial.closed and list(sw.links) == ["O"]  # the dial at its deadline; the offer lasts twice that
    clock.t += LANE_TIMEOUT_S
    sw.deadlines(clock())
    assert not sw.links and seqpacket_pair[0].fileno() == -1


def test_a_dial_taken_after_its_deadline_is_dropped_not_switched():
    clock = Clock(100.0)
    sw = LaneSwitch(1 << 20, 64, clock)
    s = _Session()
    late = _Dial(clock() - 0.1, taken=True)
    on_time = _Dial(clock() + 1.0, taken=True)
    sw.links["late"] = LaneLink(s, LaneStage.DIALING, dial=late, deadline=late.deadline)
    sw.links["ok"] = LaneLink(s, LaneStage.DIALING, dial=on_time, deadline=on_time.deadline)
    taken = list(sw.poll_dials())
    assert [(t.link, t.dial) for t in taken] == [("ok", on_time)]
    assert late.closed and not on_time.closed and not sw.links  # the host switches or closes the taken one


# ------------------------------------------------------------ outbox
class _Ring:
    def __init__(self, room):
        self.room, self.got, self.pending_bytes = room, [], 0

    def try_put(self, ev):
        if isinstance(ev, api.JobFinished) and ev.reason == "huge":
            raise MessageTooLarge(10**9, 1 << 20, "evt")
        if len(self.got) >= self.room:
            return False
        self.got.append(ev)
        return True


class _Owner:
    instruments = Instruments()


def test_the_outbox_keeps_order_waits_for_room_and_reports_an_oversized_job_as_failed():
    clock = Clock(1.0)
    reporter, counters, ring = Reporter(), collections.Counter(), _Ring(room=2)
    box = EventOutbox(ring, reporter, counters, clock, _Owner())
    reporter.open(1, "load", clock())
    reporter.done(1, True, (b"k",), 10, clock(), "")
    box.emit(api.Drained())  # after the job the session reported first
    reporter.emit(SessionClosed("peer", "bye"))
    box.flush()
    assert [type(e) for e in ring.got] == [api.JobFinished, api.Drained]
    assert box.waiting and counters["event_ring_full"] == 1 and counters["jobs_load_ok"] == 1
    ring.room = 10
    box.pending.append(api.JobFinished(2, "store", True, [], 0, 0.0, "huge"))
    box.flush()
    assert not box.waiting and isinstance(ring.got[2], api.PeerDown)
    assert ring.got[3].job_id == 2 and not ring.got[3].success and "report too large" in ring.got[3].reason


def test_job_done_reaches_the_instrument_point_before_the_job_is_queued():
    seen = []

    class Spy(Instruments):
        def on_job_done(self, ev):
            seen.append((ev.job_id, len(box.pending)))

    owner = _Owner()
    owner.instruments = Spy()
    reporter = Reporter()
    box = EventOutbox(_Ring(room=0), reporter, collections.Counter(), Clock(1.0), owner)
    reporter.open(5, "load", 1.0)
    reporter.done(5, False, (), 0, 1.0, "peer lost")
    box.take_reported()
    assert seen == [(5, 0)] and isinstance(box.pending[0], api.JobFinished)


# ------------------------------------------------------------ commands
def test_every_command_of_the_ring_api_has_exactly_one_handler():
    table = Commands.HANDLERS
    assert set(table) == set(typing.get_args(api.Command))
    assert all(callable(getattr(Commands, name, None)) for name in table.values())  # each names a method


# ------------------------------------------------------------ session host and action runner (fakes, no processes)
class _Ctl:
    def __init__(self, outbound=True, fail_send=False):
        self.outbound, self.fail_send = outbound, fail_send
        self.sent, self.disconnected = [], []

    def link(self, link):
        return types.SimpleNamespace(outbound=self.outbound, state=None)

    def disconnect(self, link):
        self.disconnected.append(link)

    def send(self, link, payload):
        if self.fail_send:
            raise P2PError("gone")
        self.sent.append((link, payload))


class _FakeSession:
    """What the host and the runner read of a session; close() returns no further actions."""

    def __init__(self, link, cause=CloseCause.LOCAL, reason="closed"):
        self.link, self.close_cause, self.close_reason = link, cause, reason
        self.state, self.settled, self.quiet_close, self.lane_in = State.CLOSED, True, False, False
        self.peer_lane_key, self.peer_id = b"", "peer"
        self.counters = SessionCounters()
        self.closed_with = []

    def close(self, detail, *, cause=CloseCause.LOCAL, bye=False):
        self.closed_with.append((detail, cause))
        return []


def _worker(ctl):
    w = types.SimpleNamespace(ctl=ctl, data=None, clock=Clock(10.0), counters=collections.Counter(),
                              instruments=Instruments(),
                              cfg=types.SimpleNamespace(control=types.SimpleNamespace(max_frame_bytes=1 << 20, hwm=64,
                                                                                      forget_down_s=60.0)))
    w.outbox = types.SimpleNamespace(flush=lambda: None)
    # built and wired as the worker does (loop.py): each room handed the rooms it calls
    w.host = SessionHost(w)
    w.lanes = LaneHost(w, w.host, lambda source: False)
    w.runner = ActionRunner(w, w.host, w.lanes, w.outbox)
    w.host.wire(w.runner, w.lanes, rerun=lambda cmd: None)
    return w


@pytest.mark.parametrize("cause, backs_off", [(CloseCause.LOCAL, True), (CloseCause.PROTOCOL_ERROR, True),
                                              (CloseCause.PEER_LOST, False)])
def test_a_retired_outbound_session_drops_its_link_with_a_backoff_unless_the_peer_was_lost(cause, backs_off):
    w = _worker(_Ctl(outbound=True))
    s = _FakeSession("out-1", cause)
    w.host.peers.add("p:1", "out-1")
    w.host.sessions["out-1"] = s
    w.host.retire(s)
    assert "out-1" not in w.host.sessions and not w.host.settling
    assert (w.host.peers.blocked("p:1", w.clock()) is not None) is backs_off
    assert (w.host.peers.links.get("p:1") is None) is backs_off  # a lost peer's link is kept: it reconnects
    assert w.ctl.disconnected == (["out-1"] if backs_off else [])


class _DialCtl(_Ctl):
    """The transport as session_for uses it: connect() opens out-N links, link() knows their states."""

    def __init__(self):
        super().__init__()
        self.dialled, self.states = [], {}

    def connect(self, target, resolve=True):
        link = f"out-{len(self.dialled) + 1}"
        self.dialled.append(target)
        self.states[link] = LinkState.CONNECTING
        return link

    def link(self, link):
        state = self.states.get(link)
        return None if state is None else types.SimpleNamespace(outbound=True, state=state, reason="gave up")


GONE = "10.0.0.9:5710"


def test_a_command_for_a_gone_address_fails_at_once_and_dials_it_once():
    w = _worker(_DialCtl())
    w.host.peers.dropped(GONE)
    for _ in range(3):  # the first dials; the rest find that dial in flight
        s, why = w.host.session_for(GONE, object())
        assert s is None and why.startswith(UNREACHABLE) and "dialling it again" in why, why
    assert w.ctl.dialled == [GONE] and w.host.peers.links[GONE] == "out-1" and not w.host.sessions
    assert GONE in w.host.peers.gone  # until that link is up (PeerBook.came_up)


def test_a_gone_address_in_its_backoff_fails_at_once_without_a_dial():
    w = _worker(_DialCtl())
    w.host.peers.dropped(GONE)
    w.host.peers.backoff(GONE, "connection refused", w.clock())
    s, why = w.host.session_for(GONE, object())
    assert s is None and why.startswith(UNREACHABLE) and "retrying in" in why and w.ctl.dialled == []


def test_a_gone_address_whose_dial_the_transport_gave_up_on_is_dialled_afresh():
    w = _worker(_DialCtl())
    w.ctl.states["out-9"] = LinkState.FAILED
    w.host.peers.add(GONE, "out-9")
    w.host.peers.dropped(GONE)
    s, why = w.host.session_for(GONE, object())
    assert s is None and "dialling it again" in why
    assert w.ctl.disconnected == ["out-9"] and w.ctl.dialled == [GONE] and w.host.peers.links[GONE] == "out-1"


def test_a_gone_host_name_fails_the_command_at_once_and_parks_only_a_dial_for_the_lookup():
    """A name's lookup may take seconds (RESOLVE_TIMEOUT_S): the command does not wait for it; a stand-in
    OpenSession (not kept) waits and dials once the name resolved."""
    w = _worker(_DialCtl())
    w.host.resolver = Resolver(w.clock, start_lookup=lambda host, port, now: types.SimpleNamespace(
        started=now, done=threading.Event(), error=None))
    name = "source-7.example:5710"
    w.host.peers.dropped(name)
    cmd = api.LoadJob(1, name, "req", [b"k"], [0])
    s, why = w.host.session_for(name, cmd)
    assert s is None and why.startswith(UNREACHABLE) and "dialling it again" in why, why
    assert w.host.resolver.pending[name].cmds == [api.OpenSession(name, keep=False)] and w.ctl.dialled == []


def test_an_unsettled_session_is_kept_until_its_reads_settle_and_its_counters_fold_once():
    w = _worker(_Ctl(outbound=False))
    s = _FakeSession("in-1")
    s.settled, s.counters.late_reads = False, 2
    w.host.sessions["in-1"] = s
    w.host.retire(s)
    assert w.host.settling == [s] and w.ctl.disconnected == ["in-1"]  # an inbound link is hung up at once
    s.settled = True
    w.host.retire(s)
    w.host.retire(s)
    assert not w.host.settling and w.counters["sessions_late_reads"] == 2


def test_a_send_that_fails_closes_the_session_and_nothing_more_goes_out_on_its_link():
    w = _worker(_Ctl(fail_send=True))
    s = _FakeSession("out-1")
    s.state = State.ACTIVE
    w.host.sessions["out-1"] = s
    w.runner.run("out-1", s, [Send(m.LaneUp()), Send(m.LaneUp())])
    assert len(s.closed_with) == 1 and "unusable" in s.closed_with[0][0]  # the second Send found no link: skipped
