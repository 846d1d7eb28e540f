"""Session transitions, roles and illegal messages, over an in-memory pair (sans-IO)."""

from __future__ import annotations

import pytest

from p2pworker.errors import LocalProtocolError, RemoteProtocolError
from p2pworker.fingerprint import Fingerprint
from p2pworker.protocol import messages as m
from p2pworker.session import ALLOWED, JobDone, LookupAnswer, ServeLookup, SessionClosed, SessionConfig, SessionUp, State
from tests.unit.session_harness import BLOCK, Pair, sample_messages

KEYS = [b"k0", b"k1", b"k2", b"k3"]


def jobs(events):
    return {e.job_id: e for e in events if isinstance(e, JobDone)}


def sent(side, kind):
    return [msg for msg in map(m.decode, side.outbox) if isinstance(msg, kind)]


# ---------------------------------------------------------------- handshake
def test_handshake_brings_both_sides_up_and_registers_data_peers():
    p = Pair()
    p.sa.start()
    assert p.sa.state is State.HELLO_SENT and p.sb.state is State.IDLE
    p.deliver()
    assert p.sa.state is State.ACTIVE and p.sb.state is State.ACTIVE
    assert set(p.a.data.peers) == {"B"} and set(p.b.data.peers) == {"A"}
    assert SessionUp("B") in p.a.events() and SessionUp("A") in p.b.events()


def test_messages_before_the_handshake_are_queued_then_sent_in_order():
    p = Pair()
    p.sa.start()
    p.sa.load(1, "r", [b"a"], [0])
    p.sa.load(2, "r", [b"b"], [1])
    p.sa.lookup(7, [b"z"], "r")
    assert [type(m.decode(f)) for f in p.a.outbox] == [m.Hello]  # held back
    p.deliver()
    fetches = [m.decode(f) for f in p.wire_a_to_b if isinstance(m.decode(f), (m.Fetch, m.Lookup))]
    assert [(type(x).__name__, getattr(x, "round", None)) for x in fetches] == [
        ("Fetch", 0), ("Fetch", 1), ("Lookup", None)]


def test_version_mismatch_is_rejected_with_both_versions():
    p = Pair()
    p.sa.state = State.HELLO_SENT
    fp = Fingerprint.build(block_bytes=BLOCK, protocol_version=m.PROTOCOL_VERSION)
    p.sb.receive(m.encode(m.Hello(99, "A", p.a.ctx.data_info, fp)))
    assert p.sb.state is State.CLOSED and "protocol version 99, expected 1" in p.sb.close_reason
    p.deliver()
    assert p.sa.state is State.CLOSED and "rejected by the peer: protocol version 99" in p.sa.close_reason


def test_fingerprint_mismatch_names_both_values_on_both_sides():
    fp_b = Fingerprint.build(block_bytes=BLOCK, protocol_version=m.PROTOCOL_VERSION, identity={"model": "other"})
    p = Pair(b={"fingerprint": fp_b})
    p.handshake()
    assert p.sa.state is State.CLOSED and p.sb.state is State.CLOSED
    for s in (p.sa, p.sb):
        assert "model.model" in s.close_reason and "'other'" in s.close_reason and "<absent>" in s.close_reason
    assert not p.a.data.peers and not p.b.data.peers


def test_block_size_mismatch_is_refused_by_the_data_plane():
    p = Pair(b={"block_bytes": 8192})
    p.sb.ctx.fingerprint = p.sa.ctx.fingerprint  # fingerprints agree; the data plane still refuses
    p.handshake()
    assert p.sa.state is State.CLOSED
    assert "block_bytes=8192, local block_bytes=4096" in p.sb.close_reason + p.sa.close_reason


def test_hello_from_a_peer_other_than_the_authenticated_one_is_refused():
    p = Pair()
    p.sb = p.b.new_session(expected_peer_id="SOMEONE-ELSE")
    p.sa.start()
    with pytest.raises(RemoteProtocolError, match="authenticated as 'SOMEONE-ELSE'"):
        p.deliver()


# ---------------------------------------------------------------- illegal messages per state
CASES = [(state, kind) for state in (State.IDLE, State.HELLO_SENT, State.ACTIVE) for kind in sample_messages()
         if kind not in ALLOWED[state]]


@pytest.mark.parametrize("state,kind", CASES, ids=[f"{s.value}-{k.__name__}" for s, k in CASES])
def test_every_illegal_message_per_state_closes_only_that_session(state, kind):
    p = Pair()
    if state is State.HELLO_SENT:
        p.sa.start()
        target, side = p.sa, p.a
    elif state is State.ACTIVE:
        p.handshake()
        p.sa.load(1, "r", [b"x"], [0])
        target, side = p.sa, p.a
    else:
        target, side = p.sb, p.b
    assert target.state is state
    with pytest.raises(RemoteProtocolError, match="not allowed in state"):
        target.receive(m.encode(sample_messages()[kind]))
    assert target.state is State.CLOSED
    evs = side.events()
    assert any(isinstance(e, SessionClosed) for e in evs)
    if state is State.ACTIVE:
        assert jobs(evs)[1].success is False  # its open job failed, once
    target.receive(m.encode(sample_messages()[m.Bye]))  # a closed session ignores everything


def test_closed_state_allows_nothing():
    assert ALLOWED[State.CLOSED] == frozenset()


@pytest.mark.parametrize("frame,match", [
    (b"\xc1", "undecodable"),
    (m.encode(m.Bye()) + b"x", "undecodable"),
    (b"\x82\xa4type\xa5fetch\xa1x\x01", "undecodable"),
])
def test_garbage_frames_raise_the_typed_error(frame, match):
    p = Pair().handshake()
    with pytest.raises(RemoteProtocolError, match=match):
        p.sa.receive(frame)
    assert p.sa.state is State.CLOSED


def test_fetch_validation():
    p = Pair().handshake()
    with pytest.raises(RemoteProtocolError, match="2 keys but 1 rows"):
        p.sb.receive(m.encode(m.Fetch("r", 0, [b"a", b"b"], [1])))
    p = Pair().handshake()
    with pytest.raises(RemoteProtocolError, match="outside the peer's 0..63"):
        p.sb.receive(m.encode(m.Fetch("r", 0, [b"a"], [64])))
    p = Pair().handshake()
    with pytest.raises(RemoteProtocolError, match="duplicate"):
        p.sb.receive(m.encode(m.Fetch("r", 0, [b"a", b"a"], [1, 2])))
    p = Pair().handshake()
    with pytest.raises(RemoteProtocolError, match="undecodable"):
        p.sb.receive(m.encode(m.Fetch("r", 0, [b"a"], [1])).replace(b"\x01", b"\xff"))  # row -1


# ---------------------------------------------------------------- PD flows
def test_store_then_fetch_writes_exactly_the_granted_rows():
    p = Pair().handshake()
    p.b.lot.store(1, "req", KEYS, [10, 11, 12, 13])
    p.sa.load(100, "req", KEYS, [3, 2, 1, 0])
    p.deliver()
    assert [(w[0], w[2], w[3]) for w in p.b.data.writes] == [("A", [10, 11, 12, 13], [3, 2, 1, 0])]
    p.b.complete_all()
    p.deliver()
    a, b = jobs(p.a.events()), jobs(p.b.events())
    assert a[100].success and a[100].keys == tuple(KEYS) and a[100].nbytes == 4 * BLOCK
    assert b[1].success and b[1].kind == "store"
    assert p.a.reporter.open_jobs == 0 and p.b.reporter.open_jobs == 0


def test_fetch_first_then_stores_bind_as_they_arrive():
    p = Pair().handshake()
    p.sa.load(100, "req", KEYS, [0, 1, 2, 3])
    p.deliver()
    assert p.b.data.writes == []
    p.b.lot.store(1, "req", KEYS[:2], [20, 21])
    p.b.lot.store(2, "req", KEYS[2:], [22, 23])
    assert [w[3] for w in p.b.data.writes] == [[0, 1], [2, 3]]
    p.b.complete_all()
    p.deliver()
    assert jobs(p.a.events())[100].success
    assert {j: e.success for j, e in jobs(p.b.events()).items()} == {1: True, 2: True}


def test_partial_success_when_the_request_finishes_short():
    p = Pair().handshake()
    p.b.lot.store(1, "req", KEYS[:2], [20, 21])
    p.sa.load(100, "req", KEYS, [0, 1, 2, 3])
    p.deliver()
    p.b.complete_all()
    p.b.lot.request_finished("req")
    p.deliver()
    a = jobs(p.a.events())[100]
    assert a.success is False and a.keys == tuple(KEYS[:2]) and "finished before" in a.reason
    assert jobs(p.b.events())[1].success
    assert "req" not in p.b.lot.parcels


def test_fetch_after_the_request_finished_with_nothing_parked_is_answered_at_once():
    """A producer whose stores never reached this worker (e.g. its previous worker died) still reports the
    request finished; a consumer's fetch that comes later gets an empty answer now, not after fetch_timeout_s."""
    p = Pair().handshake()
    p.b.lot.request_finished("gone")
    p.sa.load(100, "gone", KEYS, [0, 1, 2, 3])
    p.deliver()
    a = jobs(p.a.events())[100]
    assert a.success is False and a.keys == () and "finished before" in a.reason
    assert p.b.data.writes == [] and p.b.reporter.open_jobs == 0
    p.clock.advance(61.0)
    p.b.lot.tick()
    assert "gone" not in p.b.lot.parcels and p.b.lot.reaped == 0


def test_unrequested_keys_are_released_when_the_request_finishes():
    p = Pair().handshake()
    p.b.lot.store(1, "req", KEYS, [20, 21, 22, 23])
    p.sa.load(100, "req", KEYS[:1], [0])
    p.deliver()
    p.b.complete_all()
    p.deliver()
    assert jobs(p.a.events())[100].success
    assert p.b.reporter.open_jobs == 1  # more keys may still be asked for
    p.b.lot.request_finished("req")
    b = jobs(p.b.events())[1]
    assert b.success and b.keys == (KEYS[0],) and b.reason == "not requested by the consumer"


def test_client_timeout_aborts_and_a_late_completion_is_ignored():
    p = Pair().handshake()
    p.sa.load(100, "req", KEYS, [0, 1, 2, 3])
    p.deliver()
    p.b.lot.store(1, "req", KEYS, [10, 11, 12, 13])  # written, but the completion is slow
    p.clock.advance(30)
    p.sa.tick()
    a = jobs(p.a.events())[100]
    assert a.success is False and "timed out after 30 s" in a.reason
    p.deliver()  # AbortFetch reaches B while its write is in flight: no ack yet
    assert not sent(p.b, m.AbortAck)
    assert p.b.data.cancelled == {1}
    p.b.complete_all()
    acks = sent(p.b, m.AbortAck)
    assert len(acks) == 1 and not sent(p.b, m.TransferDone)
    p.deliver()
    assert not jobs(p.a.events())  # nothing reported twice
    assert jobs(p.b.events())[1].success  # its bytes did land before the abort ended
    late = m.TransferDone("req", 0, KEYS)
    p.sa._aborted[("req", 0)] = p.clock()  # as if the ack had been lost and the round completed anyway
    p.sa.receive(m.encode(late))
    assert p.sa.counters["late_completions"] == 1 and not jobs(p.a.events())


def test_producer_fetch_timeout_answers_partial_before_the_consumer_gives_up():
    p = Pair().handshake()
    p.b.lot.store(1, "req", KEYS[:1], [10])
    p.sa.load(100, "req", KEYS, [0, 1, 2, 3])
    p.deliver()
    p.b.complete_all()
    p.clock.advance(20)
    p.sb.tick()
    p.deliver()
    a = jobs(p.a.events())[100]
    assert not a.success and a.keys == (KEYS[0],) and "timed out on the producer" in a.reason


def test_write_submission_failure_fails_the_store_at_once():
    p = Pair().handshake()
    p.b.lot.store(1, "req", KEYS, [10, 11, 12, 13])
    p.b.data.fail_submit = True
    p.sa.load(100, "req", KEYS, [0, 1, 2, 3])
    p.deliver()
    b = jobs(p.b.events())[1]
    assert not b.success and "injected submit failure" in b.reason
    a = jobs(p.a.events())[100]
    assert not a.success and a.keys == ()


def test_async_write_failure_fails_store_and_load():
    p = Pair().handshake()
    p.b.lot.store(1, "req", KEYS, [10, 11, 12, 13])
    p.sa.load(100, "req", KEYS, [0, 1, 2, 3])
    p.deliver()
    p.b.complete_all(ok=False)
    p.deliver()
    assert not jobs(p.b.events())[1].success
    assert not jobs(p.a.events())[100].success


def test_unfetched_stores_are_reaped_and_reported_failed():
    p = Pair().handshake()
    p.b.lot.store(1, "req", KEYS, [10, 11, 12, 13])
    p.clock.advance(59)
    p.b.lot.tick()
    assert not jobs(p.b.events())
    p.clock.advance(1)
    p.b.lot.tick()
    b = jobs(p.b.events())[1]
    assert not b.success and "not fetched within 60 s" in b.reason and p.b.lot.reaped == 1


def test_peer_death_fails_every_job_of_that_peer_once():
    p = Pair().handshake()
    p.b.lot.store(1, "req", KEYS, [10, 11, 12, 13])
    p.sa.load(100, "req", KEYS, [0, 1, 2, 3])
    p.sa.load(101, "other", [b"x"], [9])
    p.sa.lookup(5, [b"x"], "req")
    p.deliver()
    p.sa.close("heartbeat lost")
    p.sb.close("heartbeat lost")
    evs_a = p.a.events()
    assert {j: e.success for j, e in jobs(evs_a).items()} == {100: False, 101: False}
    assert LookupAnswer(5, None, "session to B closed: heartbeat lost") in evs_a
    b = jobs(p.b.events())
    assert not b[1].success and "consumer A lost" in b[1].reason
    assert p.b.data.cancelled == {1} and "A" in p.b.data.removed
    p.b.complete_all()  # the cancelled write reports late: ignored
    assert p.b.ctx.late_writes == 1
    assert not jobs(p.a.events()) and not jobs(p.b.events())
    p.sa.load(102, "r", [b"y"], [1])  # a load on a dead session fails at once
    assert not jobs(p.a.events())[102].success


def test_bye_closes_and_fails_jobs():
    p = Pair().handshake()
    p.sa.load(100, "req", KEYS, [0, 1, 2, 3])
    p.sb.close("shutting down", bye=True)
    p.deliver()
    assert p.sa.state is State.CLOSED and "peer said bye: shutting down" in p.sa.close_reason
    assert not jobs(p.a.events())[100].success


def test_second_round_while_one_is_active_is_refused_and_stale_rounds_ignored():
    p = Pair().handshake()
    p.sa.load(100, "req", KEYS[:1], [0])
    p.sa.load(101, "req", KEYS[1:2], [1])
    p.deliver()
    a = jobs(p.a.events())
    assert not a[101].success and "previous round still in progress" in a[101].reason
    p.sb.receive(m.encode(m.Fetch("req", 0, [b"k9"], [5])))
    assert p.sb.counters["stale_fetches"] == 1


def test_transfer_done_that_was_never_asked_for_is_a_protocol_error():
    p = Pair().handshake()
    with pytest.raises(RemoteProtocolError, match="never fetched"):
        p.sa.receive(m.encode(m.TransferDone("nope", 0, [])))
    p = Pair().handshake()
    p.sa.load(100, "req", [b"a"], [0])
    with pytest.raises(RemoteProtocolError, match="not requested"):
        p.sa.receive(m.encode(m.TransferDone("req", 0, [b"zzz"])))
    assert not jobs(p.a.events())[100].success


def test_lookups_round_trip_time_out_and_are_validated():
    p = Pair().handshake()
    p.sa.lookup(1, [b"a", b"b"], "req")
    p.deliver()
    serve = [e for e in p.b.events() if isinstance(e, ServeLookup)]
    assert serve == [ServeLookup("A", 1, "req", (b"a", b"b"))]
    p.sb.answer_lookup(1, [True, False])
    p.deliver()
    assert LookupAnswer(1, (True, False), "") in p.a.events()
    p.sa.lookup(2, [b"c"], "req")
    p.clock.advance(5)
    p.sa.tick()
    assert LookupAnswer(2, None, "lookup timed out after 5 s") in p.a.events()
    p.sa.lookup(3, [b"c"], "req")
    with pytest.raises(RemoteProtocolError, match="2 answers for 1 keys"):
        p.sa.receive(m.encode(m.LookupResp(3, [True, True])))


def test_duplicate_job_ids_are_a_local_error():
    p = Pair().handshake()
    p.sa.load(1, "r", [b"a"], [0])
    with pytest.raises(LocalProtocolError, match="duplicate job id 1"):
        p.sa.load(1, "r2", [b"b"], [1])
    with pytest.raises(LocalProtocolError, match="not open"):
        p.a.reporter.done(999, True, (), 0, 0.0)


def test_config_timeouts_are_used():
    p = Pair(a={"config": SessionConfig(load_timeout_s=2.0)}).handshake()
    p.sa.load(1, "r", [b"a"], [0])
    p.clock.advance(2)
    p.sa.tick()
    assert "timed out after 2 s" in jobs(p.a.events())[1].reason



def test_rows_of_a_reported_store_are_never_written_again():
    """Once a store job is reported its rows are vLLM's again: a later round must not read them."""
    p = Pair().handshake()
    p.b.lot.store(1, "req", [b"a"], [10])
    p.sa.load(100, "req", [b"a"], [0])
    p.deliver()
    p.b.complete_all()
    p.deliver()
    assert jobs(p.b.events())[1].success and jobs(p.a.events())[100].success
    p.sa.load(101, "req", [b"a"], [1])  # round 1 asks for the same key again
    p.deliver()
    assert len(p.b.data.writes) == 1, "a reported store's row was read again"
    p.b.lot.request_finished("req")
    p.deliver()
    a = jobs(p.a.events())[101]
    assert not a.success and a.keys == ()
