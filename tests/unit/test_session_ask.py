"""A pull in one round trip (``Fetch.ask``): the producer asks its engine for the keys when the Fetch is in, offers
the hits its engine parks, and ends the round's offers at the engine's answer.  Over an in-memory pair (sans-IO)."""

from __future__ import annotations

from p2pworker.protocol import messages as m
from p2pworker.session import JobDone, ServeLookup, SessionConfig
from p2pworker.session.parking import Ask
from tests.helpers.session import KEYS, Pair


def jobs(events):
    return {e.job_id: e for e in events if isinstance(e, JobDone)}


def asks(side):
    return [e for e in side.events() if isinstance(e, ServeLookup)]


def serve(side, ask: ServeLookup, held: int, job: int = 1, rows=(20, 21, 22, 23)) -> None:
    """The producer's engine answers ``ask`` as the adapter does: it pins and parks the first ``held`` keys (a store
    job), says the request finished, then answers; all on one ring, in that order."""
    keys = list(ask.keys)
    if held:
        side.store(job, ask.request_id, keys[:held], list(rows[:held]))
        side.finish(ask.request_id)
    side.answer(ask.lookup_id, [i < held for i in range(len(keys))])


def test_the_engine_is_asked_once_the_fetch_is_in_and_its_hits_are_read():
    p = Pair().handshake()
    p.a.load(100, "req", KEYS, [0, 1, 2, 3], ask=True)
    p.deliver()
    [ask] = asks(p.b)
    assert ask.request_id == "req" and ask.keys == tuple(KEYS) and ask.lookup_id < 0  # never a peer's lookup id
    assert p.a.data.log == []  # nothing offered before the engine parked something
    serve(p.b, ask, held=2)
    p.pull_all()
    a = jobs(p.a.events())[100]
    # the load brings what the engine held; the rest fails (vLLM recomputes from the first key not loaded)
    assert a.success is False and a.keys == tuple(KEYS[:2]) and "does not hold" in a.reason
    assert [p.a.region[r] for r in (0, 1)] == KEYS[:2]
    assert {j: e.success for j, e in jobs(p.b.events()).items()} == {1: True}
    assert p.b.reporter.open_jobs == 0 and "req" not in p.b.lot.parcels


def test_an_engine_that_holds_nothing_ends_the_round_at_its_answer_not_at_a_timeout():
    p = Pair().handshake()
    p.a.load(100, "req", KEYS, [0, 1, 2, 3], ask=True)
    p.deliver()
    [ask] = asks(p.b)
    serve(p.b, ask, held=0)  # no store job, no RequestFinished: only the answer
    p.deliver()
    a = jobs(p.a.events())[100]
    assert a.success is False and a.keys == () and "does not hold" in a.reason
    assert p.a.data.log == []


def test_an_earlier_end_of_the_request_does_not_end_an_asking_round():
    """A request id finished here before (an earlier round, a two-step lookup): the asking round still waits for
    the engine's answer instead of taking the old end as its own."""
    p = Pair().handshake()
    p.b.finish("req")
    p.a.load(100, "req", KEYS, [0, 1, 2, 3], ask=True)
    p.deliver()
    assert jobs(p.a.events()) == {}
    [ask] = asks(p.b)
    serve(p.b, ask, held=4)
    p.pull_all()
    assert jobs(p.a.events())[100].success


def test_keys_parked_already_are_offered_at_once_and_only_the_rest_is_asked():
    p = Pair().handshake()
    p.b.store(1, "req", KEYS[:2], [20, 21])
    p.a.load(100, "req", KEYS, [0, 1, 2, 3], ask=True)
    p.deliver()
    [ask] = asks(p.b)
    assert ask.keys == tuple(KEYS[2:])
    assert [r.remote_rows for r in p.a.data.log] == [[20, 21]]
    serve(p.b, ask, held=2, job=2, rows=(22, 23))
    p.pull_all()
    assert jobs(p.a.events())[100].success


def test_an_engine_that_never_answers_ends_the_offers_at_lookup_timeout_s_and_a_late_answer_changes_nothing():
    p = Pair(b={"config": SessionConfig(lookup_timeout_s=2.0)}).handshake()
    p.a.load(100, "req", KEYS, [0, 1, 2, 3], ask=True)
    p.deliver()
    [ask] = asks(p.b)
    p.advance(2.0)
    p.b.tick()
    p.pull_all()
    a = jobs(p.a.events())[100]
    assert a.success is False and a.keys == () and "timed out" in a.reason
    # the engine answers late: its pinned store joins the parcel unoffered and ends once the request is served
    serve(p.b, ask, held=2)
    p.deliver()
    assert p.a.data.log == [] and jobs(p.a.events()) == {}
    assert {j: e.success for j, e in jobs(p.b.events()).items()} == {1: True}
    assert p.b.reporter.open_jobs == 0


def test_too_many_lookups_in_flight_ends_an_asking_round_without_asking():
    p = Pair(b={"config": SessionConfig(max_inbound_lookups=1)}).handshake()
    p.a.load(100, "r1", KEYS[:2], [0, 1], ask=True)
    p.a.load(101, "r2", KEYS[2:], [2, 3], ask=True)
    p.deliver()
    assert [e.request_id for e in asks(p.b)] == ["r1"]
    got = jobs(p.a.events())
    assert list(got) == [101] and got[101].success is False and got[101].keys == ()


def test_a_plain_fetch_never_asks_and_an_ask_fetch_round_trips_on_the_wire():
    p = Pair().handshake()
    p.a.load(100, "req", KEYS, [0, 1, 2, 3])
    p.deliver()
    assert asks(p.b) == []
    lease = p.b.lot.parcels["req"].lease
    assert lease is not None and lease.ask is Ask.NONE
    fetch = m.Fetch("r", 1, [b"k"], 1000, ask=True)
    assert m.decode(m.encode(fetch)) == fetch


def test_a_session_closed_mid_ask_leaves_a_tombstone_so_the_engines_late_stores_end_at_once():
    """The link dies after the engine was asked and before it answered: nothing was offered, so nobody can read what
    it pins now; those stores end at once (a success: nobody asked for them), not park_timeout_s later."""
    p = Pair().handshake()
    p.a.load(100, "req", KEYS, [0, 1, 2, 3], ask=True)
    p.deliver()
    [ask] = asks(p.b)
    p.b.close("link lost")
    serve(p.b, ask, held=2)  # the engine answers late: its store joins nothing
    assert {j: e.success for j, e in jobs(p.b.events()).items()} == {1: True}
    assert p.b.reporter.open_jobs == 0


def test_a_reset_during_an_ask_ends_the_rounds_offers_at_once():
    p = Pair().handshake()
    p.a.load(100, "req", KEYS, [0, 1, 2, 3], ask=True)
    p.deliver()
    [ask] = asks(p.b)
    p.b.reset("vLLM reset its cache", loads=False)
    p.deliver()
    a = jobs(p.a.events())[100]
    # a failure, not the engine's answer: the consumer must not count it short nor learn the keys as lacked
    assert a.success is False and a.keys == () and m.NOT_HELD not in a.reason and "reset" in a.reason
    serve(p.b, ask, held=2)  # answered after the reset: pinned, never offered, ended with the request
    p.deliver()
    assert {j: e.success for j, e in jobs(p.b.events()).items()} == {1: True} and p.b.reporter.open_jobs == 0


def test_a_round_asked_twice_at_once_is_a_protocol_error():
    p = Pair().handshake()
    p.b.receive(m.encode(m.Fetch("r1", 5, [b"a"], 30_000, ask=True)))
    p.b.receive(m.encode(m.Fetch("r2", 5, [b"b"], 30_000, ask=True)))  # another request, the same round
    assert p.sb.state.name == "CLOSED" and "asked again" in p.sb.close_reason


def test_a_short_round_whose_read_then_fails_is_a_failure_not_short():
    """The engine held the first key only (NOT_HELD for the rest), and the read of that key failed: the load failed.
    Kept NOT_HELD, the adapter would count it short and learn the keys as lacked at a source that holds them."""
    p = Pair().handshake()
    p.a.load(100, "req", KEYS[:2], [0, 1], ask=True)
    p.deliver()
    [ask] = asks(p.b)
    serve(p.b, ask, held=1)
    p.deliver()
    [tid] = list(p.a.data.reads)
    p.a.settle(tid, ok=False, reason="injected")
    a = jobs(p.a.events())[100]
    assert a.success is False and m.NOT_HELD not in a.reason and "injected" in a.reason
