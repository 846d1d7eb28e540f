"""Session transitions, both roles of the pull protocol and illegal messages, over an in-memory pair (sans-IO)."""

from __future__ import annotations

import pytest

from p2pworker.errors import LocalProtocolError
from p2pworker.fingerprint import Fingerprint
from p2pworker.protocol import messages as m
from p2pworker.session import (
    ALLOWED, LOAD_MOVES, AddDataPeer, JobDone, LookupAnswer, PostRead, Send, ServeLookup, SessionClosed,
    SessionConfig, SessionUp, State,
)
from p2pworker.session.parking import LeasePhase
from p2pworker.session.session import LEASE_MARGIN_S, LoadEvent, LoadPhase
from tests.helpers.session import BLOCK, KEYS, REUSED, Pair, sample_messages



def jobs(events):
    return {e.job_id: e for e in events if isinstance(e, JobDone)}


def sent(side, kind):
    return [msg for msg in map(m.decode, side.outbox) if isinstance(msg, kind)]


def wire(p, kind):
    return [msg for msg in map(m.decode, p.wire_a_to_b) if isinstance(msg, kind)]


# ---------------------------------------------------------------- handshake
def test_handshake_brings_both_sides_up_and_registers_data_peers_per_link():
    p = Pair()
    p.a.run(p.sa, p.sa.start())
    assert p.sa.state is State.HELLO_SENT and p.sb.state is State.IDLE
    p.deliver()
    assert p.sa.state is State.ACTIVE and p.sb.state is State.ACTIVE
    # keyed by the control link, not the peer id: two links to one peer never share a registration
    assert set(p.a.data.peers) == {"out-1"} and set(p.b.data.peers) == {"in-1"}
    assert SessionUp("B") in p.a.events() and SessionUp("A") in p.b.events()


def test_the_session_returns_actions_and_calls_nothing():
    p = Pair()
    out = p.sa.start()
    assert [type(a) for a in out] == [Send] and isinstance(out[0].msg, m.Hello)
    out = p.sb.receive(m.encode(out[0].msg))
    assert [type(a) for a in out] == [AddDataPeer, Send] and out[1].msg.accepted


def test_messages_before_the_handshake_are_queued_then_sent_in_order():
    p = Pair()
    p.a.run(p.sa, p.sa.start())
    p.a.load(1, "r", [b"a"], [0])
    p.a.load(2, "r", [b"b"], [1])
    p.a.lookup(7, [b"z"], "r")
    assert [type(m.decode(f)) for f in p.a.outbox] == [m.Hello]  # held back
    p.deliver()
    sent_ = [m.decode(f) for f in p.wire_a_to_b if isinstance(m.decode(f), (m.Fetch, m.Lookup))]
    assert [type(x).__name__ for x in sent_] == ["Fetch", "Fetch", "Lookup"]
    assert sent_[0].round < sent_[1].round


def test_version_mismatch_is_rejected_naming_both_versions():
    p = Pair()
    p.sa.state = State.HELLO_SENT
    fp = Fingerprint.build(block_bytes=BLOCK, protocol_version=m.PROTOCOL_VERSION)
    p.b.run(p.sb, p.sb.receive(m.encode(m.Hello(1, "A", p.a.ctx.data_info, fp))))
    assert p.sb.state is State.CLOSED
    assert f"peer 'A' speaks version 1, this worker speaks version {m.PROTOCOL_VERSION}" in p.sb.close_reason
    p.deliver()
    assert p.sa.state is State.CLOSED and "rejected by the peer: protocol version mismatch" in p.sa.close_reason
    assert "version 1" in p.sa.close_reason and f"version {m.PROTOCOL_VERSION}" in p.sa.close_reason


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
    assert p.sa.state is State.CLOSED and p.sb.state is State.CLOSED
    assert "block_bytes=8192, local block_bytes=4096" in p.sb.close_reason
    assert not sent(p.b, m.HelloAck), "the ack after a refused data peer must not go out"


def test_hello_from_a_peer_other_than_the_authenticated_one_is_refused():
    p = Pair()
    p.sb = p.b.new_session(expected_peer_id="SOMEONE-ELSE", link="in-1")
    p.handshake()
    assert p.sb.state is State.CLOSED and "authenticated as 'SOMEONE-ELSE'" in p.sb.close_reason


# ---------------------------------------------------------------- illegal messages per state
CASES = [(state, kind) for state in (State.IDLE, State.HELLO_SENT, State.ACTIVE) for kind in sample_messages()
         if kind not in ALLOWED[state]]


@pytest.mark.parametrize("state,kind", CASES, ids=[f"{s.value}-{k.__name__}" for s, k in CASES])
def test_every_illegal_message_per_state_closes_only_that_session(state, kind):
    p = Pair()
    if state is State.HELLO_SENT:
        p.a.run(p.sa, p.sa.start())
        target, side = p.sa, p.a
    elif state is State.ACTIVE:
        p.handshake()
        p.a.load(1, "r", [b"x"], [0])
        target, side = p.sa, p.a
    else:
        target, side = p.sb, p.b
    assert target.state is state
    side.run(target, target.receive(m.encode(sample_messages()[kind])))
    assert target.state is State.CLOSED and "not allowed in state" in target.close_reason
    assert target.counters.protocol_errors == 1
    evs = side.events()
    assert any(isinstance(e, SessionClosed) for e in evs)
    if state is State.ACTIVE:
        assert jobs(evs)[1].success is False  # its open job failed, once
    assert target.receive(m.encode(sample_messages()[m.Bye])) == []  # a closed session ignores everything


def test_closed_state_allows_nothing():
    assert ALLOWED[State.CLOSED] == frozenset()


@pytest.mark.parametrize("frame,match", [
    (b"\xc1", "undecodable"),
    (m.encode(m.Bye()) + b"x", "undecodable"),
    (b"\x82\xa4type\xa5fetch\xa1x\x01", "undecodable"),
])
def test_garbage_frames_close_with_the_reason(frame, match):
    p = Pair().handshake()
    p.a.run(p.sa, p.sa.receive(frame))
    assert p.sa.state is State.CLOSED and match in p.sa.close_reason


def test_offer_and_fetch_validation():
    def closed_with(msg_or_frame, match, setup=None, side="b"):
        p = Pair().handshake()
        if setup:
            setup(p)
        s = p.sb if side == "b" else p.sa
        frame = msg_or_frame if isinstance(msg_or_frame, bytes) else m.encode(msg_or_frame)
        (p.b if side == "b" else p.a).run(s, s.receive(frame))
        assert s.state is State.CLOSED and match in s.close_reason, s.close_reason

    closed_with(m.Fetch("r", 1, [b"a", b"a"], 1000), "duplicate")
    closed_with(m.encode(m.Fetch("r", 1, [b"a"], 1000)).replace(b"\xcd\x03\xe8", b"\x00"), "undecodable")  # lease 0
    load = lambda p: p.a.load(100, "r", [b"a", b"b"], [0, 1])  # noqa: E731
    closed_with(m.Offer("r", 1, [b"a", b"b"], [1]), "2 keys but 1 rows", load, "a")
    closed_with(m.Offer("r", 1, [b"a"], [64]), "outside the peer's 0..63", load, "a")
    closed_with(m.Offer("r", 1, [b"zz"], [3]), "not requested", load, "a")
    closed_with(m.Offer("r", 99, [b"a"], [3]), "never fetched", load, "a")

    def twice(p):
        load(p)
        p.a.receive(m.encode(m.Offer("r", 1, [b"a"], [3])))
    closed_with(m.Offer("r", 1, [b"a"], [4]), "names a key twice", twice, "a")


# ---------------------------------------------------------------- PD flows (pull)
def test_store_then_fetch_reads_exactly_the_offered_rows_into_the_granted_ones():
    p = Pair().handshake()
    p.b.store(1, "req", KEYS, [10, 11, 12, 13])
    p.a.load(100, "req", KEYS, [3, 2, 1, 0])
    p.deliver()
    [r] = p.a.data.log
    assert (r.local_rows, r.remote_rows) == ([3, 2, 1, 0], [10, 11, 12, 13])
    assert p.b.lot.parcels["req"].lease.phase is LeasePhase.HELD  # the final offer went out with the keys
    assert not jobs(p.b.events()), "the producer's rows stay pinned until the release"
    p.a.copy_and_settle_all(p.b)
    a = jobs(p.a.events())
    assert a[100].success and a[100].keys == tuple(KEYS) and a[100].nbytes == 4 * BLOCK
    assert p.a.region[:4] == list(reversed(KEYS))
    p.deliver()  # Release
    b = jobs(p.b.events())
    assert b[1].success and b[1].kind == "store" and p.b.lot.parcels["req"].lease is None
    assert p.a.reporter.open_jobs == 0 and p.b.reporter.open_jobs == 0


def test_fetch_first_then_stores_are_offered_as_they_arrive():
    p = Pair().handshake()
    p.a.load(100, "req", KEYS, [0, 1, 2, 3])
    p.deliver()
    assert p.a.data.log == []
    p.b.store(1, "req", KEYS[:2], [20, 21])
    p.deliver()
    p.b.store(2, "req", KEYS[2:], [22, 23])
    p.deliver()
    assert [r.remote_rows for r in p.a.data.log] == [[20, 21], [22, 23]]
    p.pull_all()
    assert jobs(p.a.events())[100].success
    assert {j: e.success for j, e in jobs(p.b.events()).items()} == {1: True, 2: True}


def test_partial_success_when_the_request_finishes_short():
    p = Pair().handshake()
    p.b.store(1, "req", KEYS[:2], [20, 21])
    p.a.load(100, "req", KEYS, [0, 1, 2, 3])
    p.deliver()
    p.b.finish("req")
    p.pull_all()
    a = jobs(p.a.events())[100]
    assert a.success is False and a.keys == tuple(KEYS[:2]) and "finished before" in a.reason
    assert jobs(p.b.events())[1].success
    assert "req" not in p.b.lot.parcels


def test_fetch_after_the_request_finished_with_nothing_parked_is_answered_at_once():
    """A producer whose stores never reached this worker (e.g. its previous worker died) still reports the
    request finished; a consumer's fetch that comes later gets an empty final offer now."""
    p = Pair().handshake()
    p.b.finish("gone")
    p.a.load(100, "gone", KEYS, [0, 1, 2, 3])
    p.deliver()
    a = jobs(p.a.events())[100]
    assert a.success is False and a.keys == () and "finished before" in a.reason
    assert p.a.data.log == [] and p.b.reporter.open_jobs == 0
    p.advance(61.0)
    p.b.lot.tick()
    assert "gone" not in p.b.lot.parcels and p.b.lot.reaped == 0


def test_unrequested_keys_are_released_when_the_request_finishes():
    p = Pair().handshake()
    p.b.store(1, "req", KEYS, [20, 21, 22, 23])
    p.a.load(100, "req", KEYS[:1], [0])
    p.pull_all()
    assert jobs(p.a.events())[100].success
    assert p.b.reporter.open_jobs == 1  # more keys may still be asked for
    p.b.finish("req")
    b = jobs(p.b.events())[1]
    assert b.success and b.keys == (KEYS[0],) and b.reason == "not requested by the consumer"


def test_done_from_a_consumer_that_fetched_nothing_releases_the_parked_stores_at_once():
    """A shared prefix: the decode held those blocks already and never fetched the producer's copies.  Its request's
    end (Done) ends the producer's store jobs at once (success: nobody asked for them), not park_timeout_s after the
    producer's request ended; a store that comes after the Done is not parked at all."""
    p = Pair().handshake()
    p.b.store(1, "req", KEYS[:2], [20, 21])
    p.b.finish("req")
    assert p.b.reporter.open_jobs == 1
    p.a.done("req")
    p.deliver()
    b = jobs(p.b.events())
    assert b[1].success and b[1].keys == () and b[1].reason == "not requested by the consumer"
    assert p.b.reporter.open_jobs == 0
    p.b.store(2, "req", KEYS[2:], [22, 23])
    b = jobs(p.b.events())
    assert b[2].success and "needs nothing more" in b[2].reason and p.b.reporter.open_jobs == 0
    p.advance(61.0)
    p.b.lot.tick()
    assert "req" not in p.b.lot.parcels  # the tombstone goes at the reaper's first look


def test_a_dones_tombstone_lasts_park_timeout_s_from_the_done_not_from_the_parcel():
    """A decode aborted late in a long prefill: the parcel was made (by an early store or fetch) long before the
    Done; stores that come within park_timeout_s of the Done are still not parked."""
    p = Pair().handshake()
    p.a.load(100, "long", KEYS[:1], [0])  # the fetch makes the parcel at t=0
    p.deliver()
    p.advance(31.0)
    p.a.tick()  # the consumer's lease (30 s) ran out: load reported, Release sent
    p.deliver()
    p.advance(20.0)
    p.a.done("long")  # t=51
    p.deliver()
    p.advance(30.0)  # t=81: past the parcel's first look (60 s), within 60 s of the Done
    p.b.lot.tick()
    p.b.store(1, "long", KEYS[1:2], [21])
    b = jobs(p.b.events())
    assert b[1].success and "needs nothing more" in b[1].reason
    p.advance(31.0)  # t=112: 61 s after the Done
    p.b.lot.tick()
    assert "long" not in p.b.lot.parcels


def test_done_never_ends_a_store_whose_rows_are_still_leased():
    """Invariant 7: a Done that overtakes its round's Release (another link, a reconnect) leaves the offered rows
    pinned; they end with the Release, and the keys nobody fetched with them."""
    p = Pair().handshake()
    p.b.store(1, "req", KEYS[:2], [20, 21])
    p.b.store(2, "req", KEYS[2:], [22, 23])
    p.a.load(100, "req", KEYS[:2], [0, 1])
    p.deliver()  # Fetch, then the offer: rows 20, 21 are leased
    p.b.lot.consumer_done("req")  # the Done arrives before the Release
    assert p.b.reporter.open_jobs == 2
    p.pull_all()  # the reads land, the Release goes
    b = jobs(p.b.events())
    assert b[1].success and b[1].keys == tuple(KEYS[:2]) and b[2].success and b[2].keys == ()
    assert p.b.reporter.open_jobs == 0


def test_done_before_the_handshake_is_queued_and_sent_once_up():
    p = Pair()
    p.b.store(1, "req", KEYS, [20, 21, 22, 23])
    p.a.done("req")
    assert p.b.reporter.open_jobs == 1
    p.handshake()
    p.deliver()
    assert p.b.reporter.open_jobs == 0 and jobs(p.b.events())[1].success


def test_a_drain_reset_without_loads_leaves_the_consumers_load_running():
    """vLLM drains for shutdown (ResetCache with loads=False): the producer's unleased parked stores fail at once,
    while a load in flight on the same worker keeps running (its request still finishes in the drain)."""
    p = Pair().handshake()
    p.b.store(1, "other", KEYS, [20, 21, 22, 23])
    p.a.store(5, "mine", KEYS[:1], [30])
    p.b.store(2, "req", KEYS[:1], [24])
    p.a.load(100, "req", KEYS[:1], [0])
    p.deliver()
    p.a.reset("vLLM is shutting down", loads=False)
    a = jobs(p.a.events())
    assert a[5].success is False and 100 not in a
    p.pull_all()
    assert jobs(p.a.events())[100].success


def test_consumer_deadline_cancels_waits_for_its_reads_then_reports_and_releases():
    """The load is reported only once every read it posted settled; a read seen done after the deadline
    counts as failed; the Release goes out after the report."""
    p = Pair().handshake()
    p.b.store(1, "req", KEYS, [10, 11, 12, 13])
    p.a.load(100, "req", KEYS, [0, 1, 2, 3])
    p.deliver()
    [r] = p.a.data.log
    p.advance(30)
    p.a.tick()
    assert r.cancelled and not jobs(p.a.events()), "reported while a read could still land"
    assert p.sa.load_phase(1) is LoadPhase.SETTLING
    p.a.copy(r.tid, p.b)  # the stalled copy finishes after all...
    p.a.settle(r.tid, ok=True)  # ...and reports DONE, past the deadline
    a = jobs(p.a.events())[100]
    assert not a.success and a.keys == () and "timed out after 30 s" in a.reason
    p.deliver()
    b = jobs(p.b.events())[1]
    assert not b.success and "did not read it" in b.reason


def test_a_read_seen_done_after_the_deadline_never_counts():
    p = Pair(a={"config": SessionConfig(load_timeout_s=5.0)}).handshake()
    p.b.store(1, "req", KEYS[:1], [10])
    p.a.load(100, "req", KEYS[:1], [0])
    p.deliver()
    [r] = p.a.data.log
    p.a.copy(r.tid, p.b)
    p.advance(5.0)  # no tick ran: the result alone must be judged against the deadline
    p.a.settle(r.tid, ok=True)
    a = jobs(p.a.events())[100]
    assert not a.success and a.keys == () and "after the load's deadline" in a.reason
    assert p.sa.counters.late_reads == 1


def test_producer_holds_offered_rows_past_the_consumers_deadline_whatever_the_clocks_say():
    """The hold starts when the Fetch is received (after it was sent) and lasts longer than the lease."""
    for skew in (-1e6, 0.0, 1e6):
        p = Pair(skew_s=skew, a={"config": SessionConfig(load_timeout_s=4.0)}).handshake()
        p.b.store(1, "req", KEYS[:1], [10])
        p.a.load(100, "req", KEYS[:1], [0])
        p.advance(0.3)  # the Fetch is in flight
        p.deliver()
        lease = p.b.lot.parcels["req"].lease
        assert lease.hold_until - p.clock_b() >= 4.0 + LEASE_MARGIN_S - 1e-9
        p.advance(4.0 + 0.3)  # the consumer's deadline passed; the producer's hold did not
        p.b.lot.tick()
        assert p.b.lot.parcels["req"].lease is lease and not jobs(p.b.events())
        p.advance(LEASE_MARGIN_S + 0.01)
        p.b.lot.tick()
        b = jobs(p.b.events())[1]
        assert not b.success and "ran out" in b.reason and p.b.lot.leases_expired == 1


def test_producer_offers_end_before_the_consumer_gives_up():
    p = Pair().handshake()
    p.b.store(1, "req", KEYS[:1], [10])
    p.a.load(100, "req", KEYS, [0, 1, 2, 3])
    p.deliver()
    p.advance(20)
    p.b.tick()
    p.pull_all()
    a = jobs(p.a.events())[100]
    assert not a.success and a.keys == (KEYS[0],) and "timed out on the producer" in a.reason


def test_read_submission_failure_fails_the_load_and_the_unread_store():
    p = Pair().handshake()
    p.b.store(1, "req", KEYS, [10, 11, 12, 13])
    p.a.data.fail_submit = True
    p.a.load(100, "req", KEYS, [0, 1, 2, 3])
    p.deliver()
    a = jobs(p.a.events())[100]
    assert not a.success and a.keys == () and "injected submit failure" in a.reason
    b = jobs(p.b.events())[1]
    assert not b.success and "did not read it" in b.reason


def test_async_read_failure_fails_store_and_load():
    p = Pair().handshake()
    p.b.store(1, "req", KEYS, [10, 11, 12, 13])
    p.a.load(100, "req", KEYS, [0, 1, 2, 3])
    p.pull_all(ok=False)
    assert not jobs(p.b.events())[1].success
    assert not jobs(p.a.events())[100].success


def test_unfetched_stores_are_reaped_park_timeout_s_after_their_request_ends():
    """The clock starts at the request's end, not at its first store: a long prefill stores its first chunks long
    before the consumer can ask (before, they were reaped 60 s after the store, while the request still ran)."""
    p = Pair().handshake()
    p.b.store(1, "req", KEYS, [10, 11, 12, 13])
    p.advance(300)  # the prefill runs on
    p.b.lot.tick()
    p.b.store(2, "req", [b"late"], [14])
    p.b.finish("req")
    p.advance(59)
    p.b.lot.tick()
    assert not jobs(p.b.events()) and p.b.lot.parcels["req"].rows
    p.advance(1)
    p.b.lot.tick()
    done = jobs(p.b.events())
    assert sorted(done) == [1, 2] and not any(d.success for d in done.values())
    assert "not fetched within 60 s of its request's end" in done[1].reason and p.b.lot.reaped == 1


def test_stores_of_a_request_that_never_ends_are_reaped_after_park_unfinished_s():
    """A bound, not a schedule: vLLM tells every request's end, but a parcel whose end never came does not pin its
    rows for ever (invariant 1: every job reported within a bounded time)."""
    p = Pair().handshake()
    p.b.store(1, "req", KEYS, [10, 11, 12, 13])
    p.advance(p.b.lot.park_unfinished_s - 1)
    p.b.lot.tick()
    assert not jobs(p.b.events())
    p.advance(1)
    p.b.lot.tick()
    b = jobs(p.b.events())[1]
    assert not b.success and "its request did not end within 1800 s" in b.reason and p.b.lot.reaped == 1


def test_a_consumer_asking_long_after_the_first_store_gets_every_key():
    """The e2e failure this fixes, in small: the first store parks, the request runs past park_timeout_s, more
    stores park, the request ends, the consumer fetches: every key is offered and read, both stores succeed."""
    p = Pair().handshake()
    p.b.store(1, "req", KEYS[:2], [10, 11])
    p.advance(150)
    p.b.lot.tick()
    p.b.store(2, "req", KEYS[2:], [12, 13])
    p.b.finish("req")
    p.advance(5)
    p.b.lot.tick()
    p.a.load(100, "req", KEYS, [0, 1, 2, 3])
    p.pull_all()
    a = jobs(p.a.events())[100]
    assert a.success and sorted(a.keys) == sorted(KEYS)
    b = jobs(p.b.events())
    assert b[1].success and b[2].success


def test_consumer_death_keeps_offered_rows_pinned_until_the_lease_ends():
    """A consumer whose link died may still be reading (NIXL READ is one-sided): the producer must not hand
    the rows back to vLLM before the lease ends."""
    p = Pair().handshake()
    p.b.store(1, "req", KEYS, [10, 11, 12, 13])
    p.b.store(2, "other", [b"x"], [20])
    p.a.load(100, "req", KEYS, [0, 1, 2, 3])
    p.deliver()
    p.b.close("heartbeat lost")
    assert not jobs(p.b.events()), "leased rows released on link loss"
    assert "in-1" in p.b.data.removed
    p.advance(30 + LEASE_MARGIN_S + 0.1)
    p.b.lot.tick()
    b = jobs(p.b.events())
    assert not b[1].success and "ran out" in b[1].reason and 2 not in b  # the unfetched parcel waits on


def test_peer_death_fails_every_consumer_job_once_after_its_reads_settle():
    p = Pair().handshake()
    p.b.store(1, "req", KEYS, [10, 11, 12, 13])
    p.a.load(100, "req", KEYS, [0, 1, 2, 3])
    p.a.load(101, "other", [b"x"], [9])
    p.a.lookup(5, [b"x"], "req")
    p.deliver()
    [r] = p.a.data.log
    p.a.close("heartbeat lost")
    evs_a = p.a.events()
    assert {j: e.success for j, e in jobs(evs_a).items()} == {101: False}, "100 has a read in flight"
    assert LookupAnswer(5, None, "session to B closed: heartbeat lost") in evs_a
    assert r.cancelled and "out-1" in p.a.data.removed and not p.sa.settled
    p.a.settle(r.tid, ok=False, reason="cancelled")
    a = jobs(p.a.events())[100]
    assert not a.success and "heartbeat lost" in a.reason and p.sa.settled
    p.a.load(102, "r", [b"y"], [1])  # a load on a dead session fails at once
    assert not jobs(p.a.events())[102].success


def test_reads_that_never_settle_are_never_reported_the_worker_is_asked_to_exit():
    """NIXL cannot abort a posted READ: a load whose cancelled reads do not settle is never reported (the bytes
    could land after vLLM reused the rows); the session's tick returns an Abort (once) and the worker exits, which
    ends every read it initiated; the adapter then fails the jobs of the dead worker."""
    p = Pair(a={"config": SessionConfig(load_timeout_s=2.0, settle_timeout_s=3.0)}).handshake()
    p.b.store(1, "req", KEYS[:1], [10])
    p.a.load(100, "req", KEYS[:1], [0])
    p.deliver()
    p.advance(2.0)
    p.a.tick()
    assert not jobs(p.a.events()) and not p.a.aborts
    p.advance(3.0)
    p.a.tick()
    assert not jobs(p.a.events()), "reported while a read could still land"
    [(s, why)] = p.a.aborts
    assert s is p.sa
    assert "did not settle within 3 s" in why and p.sa.counters.unsettled_reads == 1
    assert p.sa.load_phase(1) is LoadPhase.STUCK
    p.advance(10.0)
    assert p.sa.tick() == []  # one Abort is enough: the worker exits on it
    [r] = p.a.data.log
    p.a.settle(r.tid, ok=False, reason="cancelled")  # (were it to settle after all, it is reported then)
    assert not jobs(p.a.events())[100].success


def test_a_load_withdrawn_before_the_handshake_sends_neither_fetch_nor_release():
    p = Pair(a={"config": SessionConfig(load_timeout_s=2.0)})
    p.a.run(p.sa, p.sa.start())
    p.a.load(100, "req", KEYS[:1], [0])
    p.advance(2.0)
    p.a.tick()
    assert not jobs(p.a.events())[100].success
    p.deliver()
    assert not wire(p, m.Fetch) and not wire(p, m.Release) and p.b.lot.leases == 0


def test_a_full_handshake_queue_fails_the_job_instead_of_raising():
    p = Pair(a={"config": SessionConfig(max_queued=2)})
    p.a.run(p.sa, p.sa.start())
    for j in range(3):
        p.a.load(100 + j, "req", [b"k%d" % j], [j])
    a = jobs(p.a.events())
    assert list(a) == [102] and "already wait for the handshake" in a[102].reason


def test_bye_closes_and_fails_jobs():
    p = Pair().handshake()
    p.a.load(100, "req", KEYS, [0, 1, 2, 3])
    p.b.run(p.sb, p.sb.close("shutting down", bye=True))
    p.deliver()
    assert p.sa.state is State.CLOSED and "peer said bye: shutting down" in p.sa.close_reason
    assert not jobs(p.a.events())[100].success


def test_a_second_fetch_while_a_lease_is_held_is_answered_empty_and_final():
    p = Pair().handshake()
    p.b.store(1, "req", KEYS, [10, 11, 12, 13])
    p.a.load(100, "req", KEYS[:1], [0])
    p.a.load(101, "req", KEYS[1:2], [1])
    p.deliver()
    a = jobs(p.a.events())
    assert not a[101].success and "leased to another fetch" in a[101].reason
    p.pull_all()
    assert jobs(p.a.events())[100].success


def test_rounds_are_unique_across_sessions_of_one_worker():
    """A reconnect's new session must not reuse a round number (the old design dropped its round 0 as stale)."""
    p = Pair().handshake()
    p.a.load(100, "req", [b"a"], [0])
    first = p.sa.open_rounds()
    s2 = p.a.new_session(link="out-2")
    p.a.run(s2, s2.load(101, "req", [b"b"], [1]))
    assert first and first.isdisjoint(s2.open_rounds())


def test_late_offer_after_the_report_is_ignored_and_an_unknown_release_is_counted():
    p = Pair(a={"config": SessionConfig(load_timeout_s=2.0)}).handshake()
    p.a.load(100, "req", [b"a"], [0])
    p.advance(2)
    p.a.tick()
    assert not jobs(p.a.events())[100].success
    p.a.receive(m.encode(m.Offer("req", 1, [b"a"], [5], True)))
    assert p.sa.state is State.ACTIVE and p.sa.counters.late_offers == 1 and not p.a.data.log
    p.b.receive(m.encode(m.Release("nope", 7, [])))
    assert p.sb.state is State.ACTIVE and p.sb.counters.stale_releases == 1


def test_release_naming_keys_never_offered_is_a_protocol_error():
    p = Pair().handshake()
    p.b.store(1, "req", [b"a"], [10])
    p.a.load(100, "req", [b"a"], [0])
    p.deliver()
    p.b.receive(m.encode(m.Release("req", 1, [b"zz"])))
    assert p.sb.state is State.CLOSED and "not offered" in p.sb.close_reason
    assert not jobs(p.b.events()), "the lease still holds after a protocol error"


def test_lease_longer_than_the_producer_grants_is_refused():
    p = Pair(a={"config": SessionConfig(load_timeout_s=600.0)}).handshake()
    p.b.store(1, "req", [b"a"], [10])
    p.a.load(100, "req", [b"a"], [0])
    p.deliver()
    a = jobs(p.a.events())[100]
    assert not a.success and "exceeds this producer's max_lease_s=300" in a.reason


def test_lookups_round_trip_time_out_and_are_validated():
    p = Pair().handshake()
    p.a.lookup(1, [b"a", b"b"], "req")
    p.deliver()
    serve = [e for e in p.b.events() if isinstance(e, ServeLookup)]
    assert serve == [ServeLookup("A", 1, "req", (b"a", b"b"))]
    p.b.answer(1, [True, False])
    p.deliver()
    assert LookupAnswer(1, (True, False), "") in p.a.events()
    p.a.lookup(2, [b"c"], "req")
    p.advance(5)
    p.a.tick()
    assert LookupAnswer(2, None, "lookup timed out after 5 s") in p.a.events()
    p.a.lookup(3, [b"c"], "req")
    p.a.receive(m.encode(m.LookupResp(3, [True, True])))
    assert p.sa.state is State.CLOSED and "2 answers for 1 keys" in p.sa.close_reason


def test_duplicate_job_ids_are_a_local_error():
    p = Pair().handshake()
    p.a.load(1, "r", [b"a"], [0])
    with pytest.raises(LocalProtocolError, match="duplicate job id 1"):
        p.a.load(1, "r2", [b"b"], [1])
    with pytest.raises(LocalProtocolError, match="not open"):
        p.a.reporter.done(999, True, (), 0, 0.0)


def test_bad_loads_are_refused_at_once():
    p = Pair().handshake()
    p.a.load(1, "r", [b"a", b"a"], [0, 1])
    p.a.load(2, "r", [b"a", b"b"], [3, 3])
    p.a.load(3, "r", [], [])
    assert {j: e.success for j, e in jobs(p.a.events()).items()} == {1: False, 2: False, 3: False}


def test_rows_of_a_reported_store_are_never_offered_again():
    """Once a store job is reported its rows are vLLM's again: a later round must not read them."""
    p = Pair().handshake()
    p.b.store(1, "req", [b"a"], [10])
    p.a.load(100, "req", [b"a"], [0])
    p.pull_all()
    assert jobs(p.b.events())[1].success and jobs(p.a.events())[100].success
    p.b.region[10] = REUSED
    p.a.load(101, "req", [b"a"], [1])  # a second round asks for the same key again
    p.deliver()
    assert len(p.a.data.log) == 1, "a reported store's row was offered again"
    p.b.finish("req")
    p.pull_all()
    a = jobs(p.a.events())[101]
    assert not a.success and a.keys == () and p.a.region[1] != REUSED


def test_load_phase_table_is_what_the_session_follows():
    assert LOAD_MOVES[(LoadPhase.WAITING, LoadEvent.DEADLINE)] is LoadPhase.SETTLING
    assert LOAD_MOVES[(LoadPhase.WAITING, LoadEvent.CLOSED)] is LoadPhase.SETTLING
    assert (LoadPhase.SETTLING, LoadEvent.DEADLINE) not in LOAD_MOVES  # a settling load waits only on its reads
    assert PostRead.__dataclass_fields__.keys() == {"read_id", "local_rows", "remote_rows"}


def test_a_load_waiting_for_the_first_handshake_fails_after_handshake_timeout():
    """A Fetch must not sit in the queue until some later process on that address answers: that process (a
    restarted producer) never heard of the request and would make the load wait out its fetch_timeout_s."""
    p = Pair(a={"config": SessionConfig(handshake_timeout_s=3.0)})
    p.a.run(p.sa, p.sa.start())
    p.a.load(100, "req", KEYS[:1], [0])
    p.advance(2.9)
    p.a.tick()
    assert not jobs(p.a.events())
    p.advance(0.1)
    p.a.tick()
    a = jobs(p.a.events())[100]
    assert not a.success and "no handshake with the peer within 3 s" in a.reason
    p.deliver()
    assert not wire(p, m.Fetch), "a withdrawn fetch went out after all"


# ---------------------------------------------------------------- any number of keys (invariant 8)
def _big_round(n: int) -> tuple[Pair, float]:
    import time

    p = Pair(a={"num_blocks": n}, b={"num_blocks": n}).handshake()
    keys = [i.to_bytes(32, "little") for i in range(n)]
    t0 = time.perf_counter()
    p.b.store(1, "req", keys, list(range(n)))
    p.b.finish("req")
    p.a.load(100, "req", keys, list(range(n - 1, -1, -1)))
    p.pull_all()
    elapsed = time.perf_counter() - t0
    a, b = jobs(p.a.events()), jobs(p.b.events())
    assert a[100].success and len(a[100].keys) == n and b[1].success, (a, b)
    assert p.a.region == list(reversed(keys))  # every row holds exactly its key's bytes
    return p, elapsed


def test_a_round_of_65536_keys_goes_in_parts_and_is_reported_once():
    n = 65_536
    p, elapsed = _big_round(n)
    fetches, releases = wire(p, m.Fetch), wire(p, m.Release)
    assert [f.part for f in fetches] == list(range(n // m.MAX_KEYS))
    assert [f.more for f in fetches] == [True] * (n // m.MAX_KEYS - 1) + [False]
    assert [r.more for r in releases] == [True] * (n // m.MAX_KEYS - 1) + [False]
    assert max(map(len, p.wire_a_to_b)) < m.MAX_FRAME_BYTES // 4  # every frame far below the frame limit
    assert p.a.reporter.open_jobs == 0 and p.b.reporter.open_jobs == 0 and not p.b.lot.parcels
    # Linearity is measured in benchmarks/scale_keys.py (a timing ratio here would fail on a noisy day).
    print(f"{n}-key round through the sans-IO pair: {elapsed:.3f} s")


def test_no_final_offer_before_the_last_fetch_part(monkeypatch):
    """Every key stored and the request finished: the producer must still wait for the Fetch's last part, or
    the keys in it would be reported missing."""
    monkeypatch.setattr(m, "MAX_KEYS", 2)
    p = Pair().handshake()
    keys = [b"k%d" % i for i in range(5)]
    p.b.store(1, "req", keys, [10, 11, 12, 13, 14])
    p.b.finish("req")
    p.a.load(100, "req", keys, [0, 1, 2, 3, 4])
    assert [(f.part, f.more) for f in map(m.decode, p.a.outbox)] == [(0, True), (1, True), (2, False)]
    p.b.receive(p.a.outbox.pop(0))
    offers = sent(p.b, m.Offer)
    assert offers and not any(o.final for o in offers)
    p.pull_all()
    assert jobs(p.a.events())[100].success and jobs(p.b.events())[1].success


def test_fetch_parts_are_validated_and_stale_ones_ignored(monkeypatch):
    monkeypatch.setattr(m, "MAX_KEYS", 2)
    p = Pair().handshake()
    p.b.store(1, "req", [b"a", b"b", b"c"], [1, 2, 3])
    # a part of a round whose first part never came (refused, or its lease ended): ignored, not an error
    p.b.receive(m.encode(m.Fetch("req", 7, [b"c"], 30_000, part=1)))
    assert p.sb.state is State.ACTIVE and p.sb.counters.stale_fetch_parts == 1
    p.b.receive(m.encode(m.Fetch("req", 8, [b"a", b"b"], 30_000, part=0, more=True)))
    p.b.receive(m.encode(m.Fetch("req", 8, [b"c"], 30_000, part=2)))  # part 1 skipped
    assert p.sb.state is State.CLOSED and "part 2 out of order" in p.sb.close_reason
    p = Pair().handshake()
    p.b.receive(m.encode(m.Fetch("req", 9, [b"a", b"b"], 30_000, part=0, more=True)))
    p.b.receive(m.encode(m.Fetch("req", 9, [b"b"], 30_000, part=1)))  # a key of part 0 again
    assert p.sb.state is State.CLOSED and "duplicate keys" in p.sb.close_reason
    # the producer ended the round's offers (fetch_timeout_s) before the last part came: that part is stale
    p = Pair().handshake()
    p.b.receive(m.encode(m.Fetch("req", 10, [b"a", b"b"], 30_000, part=0, more=True)))
    p.advance(21)
    p.b.tick()
    assert [o.final for o in sent(p.b, m.Offer)] == [True]
    p.b.receive(m.encode(m.Fetch("req", 10, [b"c"], 30_000, part=1)))
    assert p.sb.state is State.ACTIVE and p.sb.counters.stale_fetch_parts == 1


def test_a_release_in_parts_unpins_only_at_its_last_part(monkeypatch):
    monkeypatch.setattr(m, "MAX_KEYS", 2)
    p = Pair().handshake()
    keys = [b"k%d" % i for i in range(5)]
    p.b.store(1, "req", keys, [10, 11, 12, 13, 14])
    p.a.load(100, "req", keys, [0, 1, 2, 3, 4])
    p.deliver()
    p.a.copy_and_settle_all(p.b)
    assert jobs(p.a.events())[100].success
    releases = sent(p.a, m.Release)
    assert [r.more for r in releases] == [True, True, False]
    for frame in p.a.outbox[:-1]:
        p.b.receive(frame)
        assert p.b.lot.parcels["req"].lease is not None  # still pinned
    p.b.receive(p.a.outbox[-1])
    assert p.b.lot.parcels.get("req") is None or p.b.lot.parcels["req"].lease is None
    assert jobs(p.b.events())[1].success


def test_a_lookup_of_65536_keys_is_asked_and_answered_in_parts():
    n = 65_536
    p = Pair().handshake()
    keys = [i.to_bytes(32, "little") for i in range(n)]
    p.a.lookup(1, keys, "req")
    p.deliver()
    [serve] = [e for e in p.b.events() if isinstance(e, ServeLookup)]
    assert serve.keys == tuple(keys)
    present = [i % 3 == 0 for i in range(n)]
    p.b.answer(1, present)
    p.deliver()
    [answer] = [e for e in p.a.events() if isinstance(e, LookupAnswer)]
    assert answer.present == tuple(present)
    assert len(wire(p, m.Lookup)) == n // m.MAX_KEYS


def test_jobs_and_lookups_over_the_hard_limit_fail_at_once_naming_it():
    from p2pworker.limits import MAX_JOB_KEYS

    p = Pair().handshake()
    keys = [i.to_bytes(8, "little") for i in range(MAX_JOB_KEYS + 1)]
    p.a.load(1, "r", keys, list(range(len(keys))))
    p.a.lookup(2, keys, "r")
    events = p.a.events()
    assert not jobs(events)[1].success and f"hard limit of {MAX_JOB_KEYS}" in jobs(events)[1].reason
    [answer] = [e for e in events if isinstance(e, LookupAnswer)]
    assert answer.present is None and f"hard limit of {MAX_JOB_KEYS}" in answer.reason
    assert p.a.outbox == []  # nothing sent


def test_a_peer_cannot_leave_lookups_or_fetches_unfinished_to_grow_our_memory(monkeypatch):
    """An honest peer sends the parts of one lookup (one Fetch) back to back.  A second one started before the
    first's last part is a protocol error, so unfinished parts hold at most one lookup and one round per session."""
    monkeypatch.setattr(m, "MAX_KEYS", 2)
    p = Pair().handshake()
    p.b.receive(m.encode(m.Lookup(1, "req", [b"a", b"b"], part=0, more=True)))
    p.b.receive(m.encode(m.Lookup(2, "req", [b"c"], part=0, more=True)))
    assert p.sb.state is State.CLOSED and "started before lookup 1" in p.sb.close_reason
    p = Pair().handshake()
    p.b.receive(m.encode(m.Fetch("r1", 5, [b"a", b"b"], 30_000, part=0, more=True)))
    p.b.receive(m.encode(m.Fetch("r2", 6, [b"c"], 30_000, part=0, more=True)))
    assert p.sb.state is State.CLOSED and "started before round 5" in p.sb.close_reason


def test_lookup_parts_are_validated_on_both_sides(monkeypatch):
    monkeypatch.setattr(m, "MAX_KEYS", 2)
    p = Pair().handshake()
    p.b.receive(m.encode(m.Lookup(1, "req", [b"a"], part=1)))  # a part 1 with no part 0
    assert p.sb.state is State.CLOSED and "part 1 out of order" in p.sb.close_reason
    p = Pair().handshake()
    p.b.receive(m.encode(m.Lookup(1, "req", [b"a"])))
    p.b.receive(m.encode(m.Lookup(1, "req", [b"a"])))  # the same id while the first is served
    assert p.sb.state is State.CLOSED and "asked again" in p.sb.close_reason
    p = Pair().handshake()
    p.a.lookup(3, [b"a", b"b", b"c"], "req")
    p.a.receive(m.encode(m.LookupResp(3, [True, True], more=True)))
    p.a.receive(m.encode(m.LookupResp(3, [True, False], more=True)))  # 4 answers for 3 keys
    assert p.sa.state is State.CLOSED and "4 answers for 3 keys" in p.sa.close_reason
    [answer] = [e for e in p.a.events() if isinstance(e, LookupAnswer)]
    assert answer.lookup_id == 3 and answer.present is None  # failed once, by the close


def _offered_round(keys) -> tuple[Pair, int]:
    """A pair whose producer offered ``keys`` of "req" under a lease; (pair, the round)."""
    p = Pair().handshake()
    p.b.store(1, "req", keys, [10 + i for i in range(len(keys))])
    p.a.load(100, "req", keys, list(range(len(keys))))
    p.deliver()
    return p, p.b.lot.parcels["req"].lease.round


def test_release_parts_naming_unoffered_keys_or_outliving_the_lease(monkeypatch):
    monkeypatch.setattr(m, "MAX_KEYS", 2)
    keys = [b"k%d" % i for i in range(4)]
    p, rnd = _offered_round(keys)
    p.b.receive(m.encode(m.Release("req", rnd, [b"k0", b"k1"], more=True)))
    p.b.receive(m.encode(m.Release("req", rnd, [b"k0", b"k1"], more=True)))
    p.b.receive(m.encode(m.Release("req", rnd, [b"k2"], more=True)))  # 5 named, 4 offered
    assert p.sb.state is State.CLOSED and "more keys than were offered" in p.sb.close_reason
    # the lease runs out between two Release parts: the rows are released by the lease's end, once; the last
    # part is stale (counted), and the store job is reported exactly once, failed (no complete Release came)
    p, rnd = _offered_round(keys)
    p.b.receive(m.encode(m.Release("req", rnd, [b"k0", b"k1"], more=True)))
    assert p.b.lot.parcels["req"].lease is not None
    p.advance(31)
    p.b.tick()
    assert p.b.lot.parcels.get("req") is None or p.b.lot.parcels["req"].lease is None
    p.b.receive(m.encode(m.Release("req", rnd, [b"k2", b"k3"])))
    assert p.sb.state is State.ACTIVE and p.sb.counters.stale_releases == 1
    stores = jobs(p.b.events())
    assert list(stores) == [1] and not stores[1].success


# ---------------------------------------------------------------- same-host lane (p2pworker.control.lane)
def _same_host_info(node: str):
    from p2pworker.data.base import PeerDataInfo
    from p2pworker.protocol.peer_info import SameHostInfo

    return PeerDataInfo("fake", node, 0, 64, BLOCK,
                        same_host=SameHostInfo("boot", "p2pworker-ho-0123456789abcdef", b"t" * 32, ()))


def test_a_lane_is_asked_for_only_by_the_dialer_with_a_key_told_to_its_peer_alone():
    import dataclasses

    from p2pworker.session import DialLane, ExpectLane

    p = Pair()
    p.a.ctx.lanes = p.b.ctx.lanes = True
    p.b.ctx.data_info = _same_host_info("B")
    hello = p.sa.start()[0].msg
    assert len(hello.lane) == 32 and hello.lane == p.sa.lane_key
    acts = p.sb.receive(m.encode(hello))
    # the acceptor's handover socket must expect the key before the peer can dial it (on the ack)
    assert [type(a) for a in acts] == [AddDataPeer, ExpectLane, Send] and acts[1].key == hello.lane
    assert p.sb.lane_key == b"" and p.sb.peer_lane_key == hello.lane  # it never dials a lane itself
    acts = p.sa.receive(m.encode(acts[2].msg))
    assert [type(a) for a in acts] == [AddDataPeer, DialLane] and acts[1].key == hello.lane

    # an acceptor with lanes off expects none, and without its same-host info (another host, or it offers none)
    # the dialer dials none
    q = Pair()
    q.a.ctx.lanes = True
    acts = q.sb.receive(m.encode(q.sa.start()[0].msg))
    assert [type(a) for a in acts] == [AddDataPeer, Send]
    assert [type(a) for a in q.sa.receive(m.encode(acts[1].msg))] == [AddDataPeer]
    assert q.sa.state is State.ACTIVE
    # lanes off on the dialer: no key in its Hello
    r = Pair()
    assert r.sa.start()[0].msg.lane == b""
    assert dataclasses.is_dataclass(DialLane) and dataclasses.is_dataclass(ExpectLane)


def test_lane_up_switches_the_peer_stream_once_and_for_good():
    """After the peer's LaneUp its messages come on the lane only: one more on the control link (or a second
    LaneUp) closes the session (two streams could reorder a round's messages)."""
    p = Pair()
    p.handshake()
    assert not p.sa.lane_in
    p.a.receive(m.encode(m.LaneUp()))
    assert p.sa.lane_in and p.sa.state is State.ACTIVE
    p.a.load(1, "r", [b"k"], [0])
    p.a.run(p.sa, p.sa.receive(m.encode(m.Offer("r", p.sa.last_round, [b"k"], [3])), lane=True))
    assert p.sa.state is State.ACTIVE and len(p.a.data.reads) == 1  # on the lane: taken
    p.a.receive(m.encode(m.Offer("r", 99, [], [], True)))  # on the control link after LaneUp
    assert p.sa.state is State.CLOSED and "on the control link after lane_up" in p.sa.close_reason
    q = Pair()
    q.handshake()
    q.a.receive(m.encode(m.LaneUp()))
    q.a.run(q.sa, q.sa.receive(m.encode(m.LaneUp()), lane=True))
    assert q.sa.state is State.CLOSED and "second lane_up" in q.sa.close_reason
    r = Pair()  # a Bye may still come on the link (the peer's lane broke): its reason is kept
    r.handshake()
    r.a.receive(m.encode(m.LaneUp()))
    r.a.receive(m.encode(m.Bye("its lane broke")))
    assert r.sa.state is State.CLOSED and "its lane broke" in r.sa.close_reason
    assert r.sa.counters.protocol_errors == 0


# ---------------------------------------------------------------- vLLM resets its cache (the tier's drain_jobs)
def test_a_reset_fails_at_once_what_no_consumer_can_be_reading_and_waits_for_the_leases():
    """ParkingLot.reset: a parcel without a lease (nobody can be reading its rows) fails now; a leased one gets its
    final offer, keeps its offered rows pinned, and its jobs close only when the lease ends."""
    p = Pair().handshake()
    p.b.store(1, "idle", KEYS[:2], [10, 11])  # parked, never fetched
    p.b.store(2, "read", KEYS[:2], [20, 21])
    p.b.store(3, "read", KEYS[2:], [22, 23])  # not asked for by the load below
    p.a.load(100, "read", KEYS[:3], [0, 1, 2])  # KEYS[2] is parked: offered; KEYS[:2] too
    p.deliver()
    owners = p.b.lot.reset("vLLM reset its cache")
    b = jobs(p.b.events())
    assert set(b) == {1} and not b[1].success and b[1].reason == "vLLM reset its cache"
    assert set(p.b.lot.parcels) == {"read"} and [q.request_id for q in owners] == ["read"]  # "idle" forgotten
    assert p.b.lot.parcels["read"].finished
    p.b.run(p.sb, p.sb.pump(owners[0]))
    assert not jobs(p.b.events()), "rows a consumer may be reading are not handed back"
    p.pull_all()  # the consumer reads, reports, releases
    assert jobs(p.a.events())[100].success
    b = jobs(p.b.events())
    assert b[2].success and b[3].success and b[3].reason == "not requested by the consumer"  # KEYS[3] never asked
    assert p.b.reporter.open_jobs == 0 and not p.b.lot.parcels


def test_a_lease_whose_consumer_never_releases_ends_the_reset_at_the_leases_end():
    p = Pair(a={"config": SessionConfig(load_timeout_s=4.0)}).handshake()
    p.b.store(1, "req", KEYS[:1], [10])
    p.a.load(100, "req", KEYS[:1], [0])
    p.deliver()  # offered; the consumer stalls (no copy, no release)
    p.b.lot.reset("vLLM reset its cache")
    p.advance(4.0)
    p.b.lot.tick()
    assert not jobs(p.b.events()), "the hold outlasts the consumer's deadline"
    p.advance(LEASE_MARGIN_S + 0.1)
    p.b.lot.tick()
    b = jobs(p.b.events())[1]
    assert not b.success and "ran out" in b.reason and p.b.reporter.open_jobs == 0


def test_a_finished_request_reset_is_answered_at_once_when_a_consumer_asks_later():
    """vLLM does not say again that a request finished: the reset keeps a finished request as a tombstone, so a
    consumer asking for it later gets its empty final offer now, not after fetch_timeout_s."""
    p = Pair().handshake()
    p.b.store(1, "done", KEYS[:2], [10, 11])
    p.b.finish("done")
    p.b.finish("never")  # a tombstone before the reset
    p.b.lot.reset("vLLM reset its cache")
    assert not jobs(p.b.events())[1].success and p.b.lot.parcels["done"].finished
    p.a.load(100, "done", KEYS[:2], [0, 1])
    p.a.load(101, "never", KEYS[:1], [2])
    p.deliver()
    a = jobs(p.a.events())
    assert not a[100].success and not a[101].success and "finished before" in a[100].reason
    assert p.a.data.log == [], "nothing of the reset rows is read"


def test_stores_after_a_reset_are_parked_and_served_as_usual():
    p = Pair().handshake()
    p.b.store(1, "req", KEYS[:1], [10])
    p.b.lot.reset("vLLM reset its cache")
    assert not jobs(p.b.events())[1].success
    p.b.store(2, "req", KEYS[:1], [12])  # the same request id, after the reset: a fresh parcel
    p.a.load(100, "req", KEYS[:1], [0])
    p.pull_all()
    assert jobs(p.a.events())[100].success and p.a.region[0] == KEYS[0] and jobs(p.b.events())[2].success
