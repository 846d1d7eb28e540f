"""The session machines are their tables: every row of MOVES (connection), LOAD_MOVES (a load) and LEASE_MOVES (a
producer's lease) is taken by a real pair of sessions, a move outside a table is refused, and the package assigns a
state or phase nowhere but through ``move``."""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

import pytest

from p2pworker.protocol import messages as m
from p2pworker.session import SessionConfig, client, parking, server, session
from p2pworker.session.client import LOAD_MOVES, LoadEvent, LoadPhase
from p2pworker.session.core import MOVES, CloseCause, SessionEvent, State, close_text
from p2pworker.session.moves import IllegalMove, move
from p2pworker.session.reporter import JobDone, JobSettled
from p2pworker.session.parking import LEASE_MOVES, LeaseEvent, LeasePhase
from tests.helpers.session import KEYS, Pair

CFG = SessionConfig(load_timeout_s=2.0, settle_timeout_s=3.0, handshake_timeout_s=1.0)


@pytest.fixture
def taken(monkeypatch):
    """Every (state, event) -> next state the code moved, in order, whichever machine."""
    seen: list[tuple] = []

    def spy(table, state, event):
        nxt = move(table, state, event)
        seen.append((state, event, nxt))
        return nxt

    for mod in (session, client, parking, server):
        monkeypatch.setattr(mod, "move", spy)
    return seen


@pytest.mark.parametrize("table", [MOVES, LOAD_MOVES, LEASE_MOVES], ids=["session", "load", "lease"])
def test_a_move_not_in_the_table_is_refused(table):
    (state_type, event_type) = map(type, next(iter(table)))
    for state, event in itertools.product(state_type, event_type):
        if (state, event) in table:
            assert move(table, state, event) is table[(state, event)]
        else:
            with pytest.raises(IllegalMove, match=f"{state_type.__name__}.{state.name} has no move"):
                move(table, state, event)


def test_nothing_leaves_the_end_states():
    assert not [k for k in MOVES if k[0] is State.CLOSED]
    assert not [k for k in LOAD_MOVES if k[0] is LoadPhase.REPORTED]
    assert not [k for k in LEASE_MOVES if k[0] is LeasePhase.ENDED]
    assert not [k for k in LOAD_MOVES if k[0] is LoadPhase.WAITING and k[1] is LoadEvent.SETTLED], \
        "a load is reported only once its final offer came or it settled"


# ---------------------------------------------------------------- the connection
def _connection(row) -> Pair:
    p = Pair(a={"config": CFG})
    state, event = row
    if event is SessionEvent.START:
        p.a.run(p.sa, p.sa.start())
    elif event is SessionEvent.HELLO:
        p.a.run(p.sa, p.sa.start())
        p.deliver(max_frames=1)  # the Hello only
    elif event is SessionEvent.HELLO_ACK:
        p.handshake()
    elif state is State.IDLE:
        p.b.close("gone")
    elif state is State.HELLO_SENT:
        p.a.run(p.sa, p.sa.start())
        p.a.close("gone")
    else:
        p.handshake()
        p.a.close("gone")
    return p


@pytest.mark.parametrize("row", list(MOVES), ids=[f"{s.name}-{e.name}" for s, e in MOVES])
def test_every_connection_move_is_taken(row, taken):
    _connection(row)
    assert (*row, MOVES[row]) in taken


def test_start_twice_is_refused():
    p = Pair()
    p.a.run(p.sa, p.sa.start())
    with pytest.raises(IllegalMove, match="HELLO_SENT has no move on SessionEvent.START"):
        p.sa.start()


# ---------------------------------------------------------------- a load
def _load_in(phase: LoadPhase, deferred: bool = False):
    """A pair whose consumer has one load in ``phase`` (a read pending from FINAL on); returns (pair, its round).
    ``deferred``: the consumer's adapter takes loads reported before their reads settle (DEFERRED implies it)."""
    p = Pair(a={"config": CFG, "deferred_release": deferred or phase is LoadPhase.DEFERRED}).handshake()
    if phase is not LoadPhase.WAITING:
        p.b.store(1, "req", KEYS[:1], [10])
    p.a.load(100, "req", KEYS[:1], [0])
    p.deliver()
    rnd = p.sa.last_round
    if phase in (LoadPhase.SETTLING, LoadPhase.STUCK, LoadPhase.DEFERRED):
        p.advance(CFG.load_timeout_s)
        p.a.tick()
    if phase is LoadPhase.STUCK:
        p.advance(CFG.settle_timeout_s)
        p.a.tick()
    assert p.sa.load_phase(rnd) is phase
    return p, rnd


def _short_with_a_read_past_the_gap(p: Pair) -> int:
    """A load of two keys whose peer offers the second, then says (final) it lacks the first: the read of the
    second is useless to vLLM, which recomputes from the first.  Returns the round."""
    p.a.load(100, "req", KEYS[:2], [0, 1])
    p.deliver()
    rnd = p.sa.last_round
    p.a.receive(m.encode(m.Offer("req", rnd, [KEYS[1]], [11], False, "")))
    assert len(p.a.data.reads) == 1
    p.a.receive(m.encode(m.Offer("req", rnd, [], [], True, "not held")))
    return rnd


def _apply(p: Pair, rnd: int, event: LoadEvent) -> None:
    phase = p.sa.load_phase(rnd)
    if event is LoadEvent.FINAL_OFFER:
        keys, rows = ([KEYS[0]], [10]) if phase is LoadPhase.WAITING else ([], [])  # WAITING: one to read
        p.a.receive(m.encode(m.Offer("req", rnd, keys, rows, True, "final")))
    elif event is LoadEvent.DEADLINE:
        p.advance(CFG.load_timeout_s)
        p.a.tick()
    elif event is LoadEvent.CLOSED:
        p.a.close("gone")
    elif event is LoadEvent.CANCELLED:
        p.a.run(p.sa, p.sa.cancel_loads("shutting down"))
    elif event is LoadEvent.SETTLE_TIMEOUT:
        p.advance(CFG.settle_timeout_s)
        p.a.tick()
    elif event is LoadEvent.SETTLED:
        for tid in list(p.a.data.reads):
            p.a.settle(tid, ok=phase is LoadPhase.FINAL)


LOAD_ROWS = [k for k in LOAD_MOVES if k[1] not in (LoadEvent.NO_HANDSHAKE, LoadEvent.REPORTED_EARLY)]


@pytest.mark.parametrize("row", LOAD_ROWS, ids=[f"{s.name}-{e.name}" for s, e in LOAD_ROWS])
def test_every_load_move_is_taken(row, taken):
    phase, event = row
    p, rnd = _load_in(phase)
    del taken[:]
    _apply(p, rnd, event)
    assert [t for t in taken if isinstance(t[0], LoadPhase)][0] == (phase, event, LOAD_MOVES[row])
    if LOAD_MOVES[row] is LoadPhase.REPORTED:
        assert p.a.reporter.open_jobs == 0 and p.sa.load_phase(rnd) is None and not p.sa.open_rounds()


def test_a_cancelled_load_with_reads_posted_is_reported_at_once_unsettled_where_vllm_defers_the_release(taken):
    """SETTLING -> DEFERRED: the deadline passes with a read posted; the job is reported failed now (settled
    False), and settled once the read settles."""
    p, rnd = _load_in(LoadPhase.FINAL, deferred=True)
    del taken[:]
    _apply(p, rnd, LoadEvent.DEADLINE)
    assert (LoadPhase.SETTLING, LoadEvent.REPORTED_EARLY, LoadPhase.DEFERRED) in taken
    [done] = [e for e in p.a.reporter.take() if isinstance(e, JobDone)]
    assert (done.job_id, done.success, done.settled) == (100, False, False)
    assert p.a.reporter.open_jobs == 1  # owed its JobSettled
    _apply(p, rnd, LoadEvent.SETTLED)
    assert [e for e in p.a.reporter.take() if isinstance(e, JobSettled)] == [JobSettled(100)]
    assert p.a.reporter.open_jobs == 0


def test_a_short_final_offer_cancels_the_reads_past_the_gap_and_reports_at_once(taken):
    """FINAL -> DEFERRED: the only read posted is of a key past the first one the peer lacks."""
    p = Pair(a={"config": CFG, "deferred_release": True}).handshake()
    rnd = _short_with_a_read_past_the_gap(p)
    assert (LoadPhase.FINAL, LoadEvent.REPORTED_EARLY, LoadPhase.DEFERRED) in taken
    [done] = [e for e in p.a.reporter.take() if isinstance(e, JobDone)]
    assert not done.success and not done.settled and done.keys == () and done.reason == "not held"
    assert all(r.cancelled for r in p.a.data.reads.values()), "the read past the gap was not cancelled"
    assert p.sa.load_phase(rnd) is LoadPhase.DEFERRED


def test_without_deferred_release_a_short_load_waits_for_its_reads():
    p = Pair(a={"config": CFG}).handshake()
    rnd = _short_with_a_read_past_the_gap(p)
    assert p.sa.load_phase(rnd) is LoadPhase.FINAL
    assert not [e for e in p.a.reporter.take() if isinstance(e, JobDone)]
    assert not any(r.cancelled for r in p.a.data.reads.values())


def test_a_load_that_never_met_its_peer_fails_at_the_handshake_timeout(taken):
    p = Pair(a={"config": CFG})
    p.a.run(p.sa, p.sa.start())  # the HelloAck never comes
    p.a.load(100, "req", KEYS[:1], [0])
    p.advance(CFG.handshake_timeout_s)
    p.a.tick()
    assert (LoadPhase.WAITING, LoadEvent.NO_HANDSHAKE, LoadPhase.SETTLING) in taken
    assert (LoadPhase.SETTLING, LoadEvent.SETTLED, LoadPhase.REPORTED) in taken  # nothing was posted: at once


def test_a_stuck_load_asks_the_worker_to_exit_once(taken):
    p, rnd = _load_in(LoadPhase.STUCK)
    [(s, why)] = p.a.aborts
    assert s is p.sa and "did not settle within 3 s" in why
    p.advance(100.0)
    p.a.tick()
    assert len(p.a.aborts) == 1 and p.sa.load_phase(rnd) is LoadPhase.STUCK


# ---------------------------------------------------------------- a lease
def _lease(row) -> Pair:
    phase, event = row
    p = Pair().handshake()
    # OFFERING: nothing stored (the lease ends at the close), or one of two keys (offered: it outlives the close);
    # HELD: the only key asked is stored (the final offer goes out with it)
    if not (phase is LeasePhase.OFFERING and event is LeaseEvent.END):
        p.b.store(1, "req", KEYS[:1], [10])
    keys = KEYS[:2] if phase is LeasePhase.OFFERING else KEYS[:1]
    p.a.load(100, "req", keys, [0, 1][:len(keys)])
    p.deliver(max_frames=1)  # the Fetch only
    lease = p.b.lot.parcels["req"].lease
    assert lease.phase is phase
    if event is LeaseEvent.OWNER_GONE or phase is LeasePhase.OFFERING:
        p.b.close("gone")
    else:
        p.pull_all()  # read, reported, released
    return p


LEASE_ROWS = [k for k in LEASE_MOVES if k[1] is not LeaseEvent.FINAL_OFFER]


@pytest.mark.parametrize("row", LEASE_ROWS, ids=[f"{s.name}-{e.name}" for s, e in LEASE_ROWS])
def test_every_lease_move_is_taken(row, taken):
    _lease(row)
    assert (*row, LEASE_MOVES[row]) in taken


def test_a_lease_whose_keys_are_all_stored_is_held_at_the_first_offer(taken):
    p = Pair().handshake()
    p.b.store(1, "req", KEYS[:1], [10])
    p.a.load(100, "req", KEYS[:1], [0])
    p.deliver(max_frames=1)
    assert (LeasePhase.OFFERING, LeaseEvent.FINAL_OFFER, LeasePhase.HELD) in taken


# ---------------------------------------------------------------- close causes
def test_close_text_keeps_the_words_status_shows():
    assert close_text(CloseCause.PEER_LOST, "heartbeat lost") == "peer lost: heartbeat lost"
    assert close_text(CloseCause.PEER_BYE, "") == "peer said bye"
    assert close_text(CloseCause.PEER_BYE, "draining") == "peer said bye: draining"
    assert close_text(CloseCause.PROBED, "") == "probed"
    assert close_text(CloseCause.MISMATCH, "a: local=1 remote=2") == "config fingerprint mismatch (a: local=1 remote=2)"
    assert close_text(CloseCause.LOCAL, "closed by the adapter") == "closed by the adapter"


def test_a_session_closes_with_its_cause():
    p = Pair().handshake()
    p.a.run(p.sa, p.sa.close("heartbeat lost", cause=CloseCause.PEER_LOST))
    assert p.sa.close_cause is CloseCause.PEER_LOST and p.sa.close_reason == "peer lost: heartbeat lost"
    p.deliver()
    assert p.sb.state is State.ACTIVE and p.sb.close_cause is None  # no Bye goes out on a lost link
    q = Pair().handshake()
    q.b.receive(b"\xff not a frame")
    assert q.sb.close_cause is CloseCause.PROTOCOL_ERROR and q.sb.close_reason.startswith("protocol error: ")
    q.deliver()
    assert q.sa.close_cause is CloseCause.PEER_BYE and q.sa.close_reason.startswith("peer said bye: protocol error")


# ---------------------------------------------------------------- only move() assigns
def test_states_and_phases_change_only_through_move():
    """In p2pworker/session/, an assignment to ``.state`` or ``.phase`` is ``move(...)``, but for the one initial
    state of a session (a load's and a lease's start as their dataclass default)."""
    root = Path(session.__file__).parent
    bad = []
    for path in sorted(root.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Assign):
                continue
            for target in node.targets:
                if isinstance(target, ast.Attribute) and target.attr in ("state", "phase"):
                    value = node.value
                    is_move = isinstance(value, ast.Call) and getattr(value.func, "id", "") == "move"
                    initial = ast.unparse(value) == "State.IDLE"
                    if not (is_move or initial):
                        bad.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    assert not bad, bad
