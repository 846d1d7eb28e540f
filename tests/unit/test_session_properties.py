"""Random interleavings of everything that can happen to a pair of sessions, checked against the byte-level model.

What is promised (invariants 1 and 7, docs/invariants.md), checked after every step:
(1) no byte lands in a consumer row unless the load that was granted that row is still open
    (nothing lands after the load was reported: vLLM may already have reused the row);
(2) no producer row is handed back to vLLM while a read of it can still count: every key a load reports
    as moved holds exactly that key's bytes, even when the producer's rows were reused ("REUSED") the
    moment their store job was reported;
(3) every job is reported exactly once (the Reporter raises on a duplicate or unknown report), and by
    the end every job was reported.

With a deferred release (vLLM 0.34: the consumer's adapter takes a failed load before its reads settle), a load may
be reported failed while cancelled reads are still posted: the rows of the keys it did not report moved stay vLLM's
"write pending" (out of its free pool) until the session's JobSettled, and only then are reused; the rows of the keys
it reported moved are reused at once.  (1) then reads: no byte lands in a row vLLM can reuse.

The adversary (a fake data plane and the test's scheduler) may delay, reorder, split and fail copies and
completions arbitrarily (a cancelled read may still copy and report DONE, at any time), advance time, tick,
lose the link and reconnect, with the two sides' clocks far apart.  A load whose reads never settle is never
reported (the session asks its worker to exit instead: an ``Abort`` action); the end of the run settles every
read.

On the same-host path (``same_host``: p2pworker/data/samehost.py) the consumer's worker copies the rows itself,
synchronously inside the poll that posts the piece, and reports right after: a copy and its report are one step,
a read cancelled before its poll copies nothing, and a copy fails (after copying any part of the rows) only when
the producer's worker died.  The same checker runs against that adversary.

``test_the_checker_catches_the_old_push_design`` replays the push design's order (producer writes into
the consumer's rows; the consumer reports on its deadline without waiting) against the same checker.
"""

from __future__ import annotations

import random
from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from p2pworker.protocol import messages as m
from p2pworker.session import JobDone, JobSettled
from tests.helpers.session import REUSED, Pair

REQS = ["r0", "r1"]
KEYS = [b"k%d" % i for i in range(5)]
CANARY = b"<canary>"

store_op = st.tuples(st.just("store"), st.sampled_from(REQS),
                     st.lists(st.sampled_from(KEYS), min_size=1, max_size=3, unique=True))
# a load that asks (Fetch.ask: a symmetric pull in one round trip) or not
load_op = st.tuples(st.just("load"), st.sampled_from(REQS),
                    st.lists(st.sampled_from(KEYS), min_size=1, max_size=4, unique=True), st.booleans())
deliver_all = st.tuples(st.just("deliver"), st.none())
copy_op = st.tuples(st.just("copy"), st.integers(0, 1000), st.integers(1, 3))
settle_op = st.tuples(st.just("settle"), st.integers(0, 1000), st.booleans() | st.just(True) | st.just(True))
rare = [
    st.tuples(st.just("finish"), st.sampled_from(REQS)),
    st.tuples(st.just("lookup"), st.lists(st.sampled_from(KEYS), max_size=3)),
    st.tuples(st.just("deliver"), st.integers(1, 6)),
    st.tuples(st.just("submit_fail"), st.booleans()),
    st.tuples(st.just("answer")),
    st.tuples(st.just("reconnect"), st.sampled_from(["a", "b", "both"])),
    st.tuples(st.just("done"), st.sampled_from(REQS)),  # the consumer's request ended: Done to the producer
    st.tuples(st.just("drain"), st.booleans()),  # the producer's vLLM drains (ResetCache; with or without loads)
    st.tuples(st.just("reset")),  # the consumer's vLLM resets its cache: its loads are cancelled (ResetCache)
]
# time and the two sides' timers run separately: a consumer that has not ticked past its deadline yet must
# still judge a read by it, and a producer's lease may end while the consumer is stalled
timers = [
    st.tuples(st.just("advance"), st.sampled_from([0.5, 5.0, 21.0, 29.0, 31.0, 61.0])),
    st.tuples(st.just("tick"), st.sampled_from(["a", "b", "both"])),
]
# one_of picks its branches about evenly: the core PD flow is listed several times over
# (the engine's answer to an asking round is listed twice more: without it an asking round only times out)
answer_op = st.tuples(st.just("answer"))
op = st.one_of(*([store_op] * 4 + [load_op] * 4 + [deliver_all] * 5 + [copy_op] * 4 + [settle_op] * 4
                 + [answer_op] * 2 + timers * 3 + rare))


class Violation(AssertionError):
    pass


class Model:
    def __init__(self, seed: int, same_host: bool = False, deferred: bool = False):
        self.same_host = same_host
        self.p = Pair(skew_s=random.Random(seed).uniform(-1e5, 1e5), a={"deferred_release": deferred}).handshake()
        self.deferred: dict[int, list[int]] = {}  # load reported unsettled -> its rows vLLM keeps until JobSettled
        self.rng = random.Random(seed)
        self.next_job = 1
        self.next_lookup = 1
        self.links = 1
        self.opened: set[int] = set()
        self.loads: dict[int, dict[bytes, int]] = {}  # open load -> key -> granted consumer row
        self.row_owner: dict[int, int] = {}  # consumer row -> open load job
        self.stores: dict[int, list[int]] = {}  # open store job -> producer rows
        self.free_a = list(range(64))
        self.free_b = list(range(64))
        self.reported: dict[int, JobDone] = {}
        self.old_sessions: list = []
        self.p.a.land_hook = self.landed

    def landed(self, tid: int, row: int, content: bytes) -> None:
        owner = self.row_owner.get(row)
        if owner is not None and not self.p.a.reporter.is_open(owner):
            self.take_reports()  # reported in this very step (an unsettled report): which rows vLLM still holds
        if owner is None or not (self.p.a.reporter.is_open(owner) or row in self.deferred.get(owner, ())):
            raise Violation(f"read {tid} landed {content!r} in consumer row {row} after its load was reported")

    def job(self) -> int:
        j = self.next_job
        self.next_job += 1
        self.opened.add(j)
        return j

    def take(self, free: list[int], n: int) -> list[int] | None:
        if len(free) < n:
            return None
        rows = self.rng.sample(free, n)
        for r in rows:
            free.remove(r)
        return rows

    def step(self, o) -> None:
        op = self._OPS.get(o[0])
        if op is not None:
            op(self, o)
        self.check()

    # One per kind of op: what the worker (or vLLM, or the network) does to the pair.
    def _store(self, o) -> None:
        rows = self.take(self.free_b, len(o[2]))
        if rows is not None:
            j = self.job()
            self.stores[j] = rows
            self.p.b.store(j, o[1], o[2], rows)

    def _load(self, o) -> None:
        rows = self.take(self.free_a, len(o[2]))
        if rows is not None:
            j = self.job()
            self.loads[j] = dict(zip(o[2], rows))
            for r in rows:
                self.row_owner[r] = j
            self.p.a.load(j, o[1], o[2], rows, ask=len(o) > 3 and o[3])

    def _lookup(self, o) -> None:
        self.p.a.lookup(self.next_lookup, o[1], "r0")
        self.next_lookup += 1

    def _copy(self, o) -> None:
        self._on_posted_read(o, lambda a, tid: a.copy(tid, self.p.b, o[2]))  # lands whatever the sessions think

    def _settle(self, o) -> None:
        self._on_posted_read(o, lambda a, tid: a.settle(tid, o[2]))

    def _on_posted_read(self, o, act) -> None:
        """A "copy" or "settle" op reaches one posted read (none posted: nothing happens); on the same-host path
        the worker's poll does both at once (same_host_poll)."""
        a = self.p.a
        if not a.data.reads:
            return
        if self.same_host:
            self.same_host_poll(o)
            return
        tids = sorted(a.data.reads)
        act(a, tids[o[1] % len(tids)])

    def _submit_fail(self, o) -> None:
        self.p.a.data.fail_submit = o[1]

    def _answer(self, o) -> None:
        for side in (self.p.a, self.p.b):
            for lookup_id, n in list(side.session.serving().items()):
                side.answer(lookup_id, [True] * n)
        for ask in self.p.b.session.asking().values():
            self.serve_ask(ask, self.rng.randint(0, len(ask.keys)))

    def serve_ask(self, ask, held: int) -> None:
        """The producer's engine answers an asking round as the adapter does: it pins ``held`` of the keys (a store
        job on fresh rows, parked under the request id), says the request finished, then answers."""
        keys = list(ask.keys)[:held]
        rows = self.take(self.free_b, len(keys)) if keys else None
        if rows is not None:
            j = self.job()
            self.stores[j] = rows
            self.p.b.store(j, ask.request_id, keys, rows)
            self.p.b.finish(ask.request_id)
        got = set(keys) if rows is not None else set()
        self.p.b.answer(ask.lookup_id, [k in got for k in ask.keys])

    _OPS = {
        "store": _store, "load": _load, "lookup": _lookup, "copy": _copy, "settle": _settle,
        "submit_fail": _submit_fail, "answer": _answer,
        "finish": lambda self, o: self.p.b.finish(o[1]),
        "done": lambda self, o: self.p.a.done(o[1]),
        "drain": lambda self, o: self.p.b.reset("vLLM is shutting down", loads=o[1]),
        "reset": lambda self, o: self.p.a.run(self.p.sa, self.p.sa.cancel_loads("vLLM reset its cache")),
        "deliver": lambda self, o: self.p.deliver(o[1]),
        "advance": lambda self, o: self.p.advance(o[1]),
        "tick": lambda self, o: self.tick(o[1]),
        "reconnect": lambda self, o: self.reconnect(o[1]),
    }

    def same_host_poll(self, o) -> None:
        """The worker's poll reaches one posted read: the same-host copy runs and is reported in that poll.  A read
        cancelled before copies nothing; a "settle" op with ok=False is the producer's worker dying mid-copy (part
        of the rows copied, then the pidfd check fails the piece)."""
        a, b = self.p.a, self.p.b
        tids = sorted(a.data.reads)
        tid = tids[o[1] % len(tids)]
        r = a.data.reads[tid]
        if r.cancelled:
            a.settle(tid, False, "cancelled")
        elif o[0] == "settle" and not o[2]:
            a.copy(tid, b, o[1] % (len(r.local_rows) + 1))
            a.settle(tid, False, "the peer's worker exited during the copy")
        else:
            a.settle(tid, True)  # copies every row, then reports

    def tick(self, who: str = "both") -> None:
        p = self.p
        for s in self.old_sessions:
            side = p.a if s.ctx is p.a.ctx else p.b
            if who in ("both", "a" if side is p.a else "b"):
                side.run(s, s.tick())
        if who in ("a", "both"):
            p.a.tick()
        if who in ("b", "both"):
            p.b.tick()

    def reconnect(self, who: str) -> None:
        """Link loss that one side (or both) notices, then a fresh pair of sessions on new links.  A side that
        did not notice keeps its old session open (its frames are lost) until the end of the run."""
        p = self.p
        for side, s, w in ((p.a, p.sa, "a"), (p.b, p.sb, "b")):
            if who in (w, "both"):
                side.close("link lost")
        p.a.outbox.clear()
        p.b.outbox.clear()
        self.old_sessions += [p.sa, p.sb]
        self.links += 1
        p.sa = p.a.new_session(link=f"out-{self.links}")
        p.sb = p.b.new_session(link=f"in-{self.links}")
        p.handshake()

    def check(self) -> None:
        p = self.p
        a = p.a
        for lot in (a.lot, p.b.lot):  # the counts the worker's polling reads (worker.poll_timeout_s)
            leased = [q.lease for q in lot.parcels.values() if q.lease is not None]
            assert lot.leases == len(leased) and lot.offering == sum(1 for x in leased if x.offered), \
                (lot.leases, lot.offering, [(len(x.offered)) for x in leased])
        self.take_reports()

    def take_reports(self) -> None:
        """What the two reporters said since the last look, applied as vLLM does (rows reused, or held)."""
        p = self.p
        a = p.a
        for ev in a.events() + p.b.events():
            if isinstance(ev, JobSettled):  # vLLM's deferred release: the failed keys' rows are reused from now
                self.reuse(self.deferred.pop(ev.job_id))
                continue
            if not isinstance(ev, JobDone):
                continue
            assert ev.job_id in self.opened, f"report for unknown job {ev.job_id}"
            assert ev.job_id not in self.reported, f"job {ev.job_id} reported twice"
            self.reported[ev.job_id] = ev
            if ev.kind == "load":
                granted = self.loads.pop(ev.job_id)
                assert set(ev.keys) <= set(granted)
                for k in ev.keys:
                    if a.region[granted[k]] != k:
                        raise Violation(f"load {ev.job_id} reported {k!r} moved but its row holds "
                                        f"{a.region[granted[k]]!r}")
                if ev.settled:
                    self.reuse(granted.values())  # vLLM reuses the rows at once
                else:
                    assert not ev.success, f"load {ev.job_id} reported a success unsettled"
                    moved = set(ev.keys)
                    self.reuse(r for k, r in granted.items() if k in moved)
                    self.deferred[ev.job_id] = [r for k, r in granted.items() if k not in moved]
            else:
                for r in self.stores.pop(ev.job_id):
                    p.b.region[r] = REUSED  # vLLM reuses the producer's rows at once
                    self.free_b.append(r)

    def reuse(self, rows) -> None:
        """vLLM takes consumer rows back (and writes into them at once)."""
        for r in list(rows):
            self.p.a.region[r] = CANARY
            del self.row_owner[r]
            self.free_a.append(r)

    def finish(self) -> None:
        """Let everything run out: every job must then have been reported."""
        p = self.p
        p.a.data.fail_submit = False
        for s in self.old_sessions:  # the sides that had not noticed a lost link notice now
            side = p.a if s.ctx is p.a.ctx else p.b
            side.run(s, s.close("link lost (noticed late)"))
        # the last step runs past park_unfinished_s: stores of a request whose end was never told are reaped then
        # (park_timeout_s counts from the end; vLLM tells every end, the model does not always)
        for step_s in (100, 100, 100, 100, 100, p.b.lot.park_unfinished_s):
            p.pull_all()
            self.check()
            for tid in list(p.a.data.reads):
                p.a.settle(tid, False, "cancelled")
            p.advance(step_s)
            self.tick()
            for side in (p.a, p.b):
                for lookup_id, n in list(side.session.serving().items()):
                    side.answer(lookup_id, [False] * n)
            for ask in p.b.session.asking().values():
                self.serve_ask(ask, 0)
            self.check()
        assert p.a.reporter.open_jobs == 0 and p.b.reporter.open_jobs == 0
        assert not p.b.session.asking(), "an asking round outlived the run"
        assert all(s.counters.unsettled_reads for s, _ in p.a.aborts), "an abort without a reason"
        assert set(self.reported) == self.opened, f"never reported: {self.opened - set(self.reported)}"
        assert not self.deferred, f"reported unsettled, never settled: {sorted(self.deferred)}"
        assert p.a.reporter.open_lookups == 0


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(op, min_size=5, max_size=80), st.integers(0, 2**32))
def test_random_interleavings_keep_every_invariant(ops, seed):
    model = Model(seed)
    for o in ops:
        model.step(o)
    model.finish()
    assert model.p.sa.counters.protocol_errors == 0 and model.p.sb.counters.protocol_errors == 0


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(op, min_size=5, max_size=80), st.integers(0, 2**32))
def test_random_interleavings_with_deferred_releases_keep_every_invariant(ops, seed):
    """vLLM 0.34's deferred release: loads that cannot succeed are reported at once, unsettled; no byte may land in a
    row vLLM reuses, every unsettled report is settled once, and every job is still reported once."""
    model = Model(seed, deferred=True)
    for o in ops:
        model.step(o)
    model.finish()
    assert model.p.sa.counters.protocol_errors == 0 and model.p.sb.counters.protocol_errors == 0


@settings(max_examples=800, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(op, min_size=5, max_size=80), st.integers(0, 2**32))
def test_random_interleavings_on_the_same_host_path_keep_every_invariant(ops, seed):
    model = Model(seed, same_host=True)
    for o in ops:
        model.step(o)
    model.finish()
    assert model.p.sa.counters.protocol_errors == 0 and model.p.sb.counters.protocol_errors == 0


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(op, min_size=5, max_size=80), st.integers(0, 2**32))
def test_random_interleavings_with_every_key_list_split_over_frames(ops, seed):
    """The same promises when every Fetch, Offer, Release, Lookup and answer goes in parts (two keys per frame
    here, MAX_KEYS in production): parts delivered one frame at a time, interleaved with copies, deadlines and
    reconnects, still give exactly-once reports and never a wrong byte."""
    with mock.patch.object(m, "MAX_KEYS", 2):
        model = Model(seed)
        for o in ops:
            model.step(o)
        model.finish()
    assert model.p.sa.counters.protocol_errors == 0 and model.p.sb.counters.protocol_errors == 0


# The adversary's sharpest schedules, spelled out so that no search luck is needed to catch a regression in them.
SCHEDULES = {
    # the consumer has not ticked past its deadline when a stalled copy (of rows the producer released) reports
    "copy_after_both_deadlines": [("store", "r0", [b"k0"]), ("load", "r0", [b"k0"]), ("deliver", None),
                                  ("advance", 31.0), ("tick", "b"), ("settle", 0, True)],
    # the producer's hold must outlast the consumer's deadline: nothing may be released before it
    "copy_just_before_the_consumer_deadline": [("store", "r0", [b"k0"]), ("load", "r0", [b"k0"]),
                                               ("deliver", None), ("advance", 29.0), ("tick", "b"),
                                               ("settle", 0, True)],
    # the producer notices a link loss; the consumer, not yet, goes on reading the leased rows
    "producer_drops_the_link_mid_read": [("store", "r0", [b"k0", b"k1"]), ("load", "r0", [b"k0", b"k1"]),
                                         ("deliver", None), ("reconnect", "b"), ("tick", "b"), ("advance", 5.0),
                                         ("tick", "b"), ("settle", 0, True)],
    # the consumer notices first: it must wait for its read before reporting
    "consumer_drops_the_link_mid_read": [("store", "r0", [b"k0"]), ("load", "r0", [b"k0"]), ("deliver", None),
                                         ("copy", 0, 1), ("reconnect", "a"), ("tick", "a"), ("settle", 0, True)],
    # a cancelled read that does not settle for longer than settle_timeout_s, then copies after all
    "read_outlives_the_settle_timeout": [("store", "r0", [b"k0"]), ("load", "r0", [b"k0"]), ("deliver", None),
                                         ("advance", 31.0), ("tick", "a"), ("advance", 21.0), ("tick", "a"),
                                         ("copy", 0, 1), ("settle", 0, True)],
    "stalled_copy_after_the_deadline": [("store", "r0", [b"k0", b"k1"]), ("load", "r0", [b"k0", b"k1"]),
                                        ("deliver", None), ("advance", 31.0), ("tick", "both"), ("copy", 0, 3),
                                        ("settle", 0, True), ("deliver", None)],
    # the consumer's vLLM resets mid-read (a load reported at once under a deferred release): the cancelled read
    # still copies, then settles; it must land only in rows vLLM still holds
    "reset_mid_read_then_the_read_lands": [("store", "r0", [b"k0", b"k1"]), ("load", "r0", [b"k0", b"k1"]),
                                           ("deliver", None), ("reset",), ("copy", 0, 2), ("load", "r1", [b"k2"]),
                                           ("settle", 0, True), ("deliver", None)],
    # reported unsettled at a reset, then its cancelled read outlives settle_timeout_s (the worker is told to exit),
    # then lands after all: still only in rows vLLM holds
    "reset_then_the_read_outlives_the_settle_timeout": [("store", "r0", [b"k0"]), ("load", "r0", [b"k0"]),
                                                        ("deliver", None), ("reset",), ("advance", 21.0),
                                                        ("tick", "a"), ("copy", 0, 1), ("settle", 0, True)],
    # one round trip: the producer's engine answers only after the consumer's deadline; the rows it pins then must
    # never be read into rows the consumer already gave back, and its store job still ends
    "ask_answered_after_the_consumer_deadline": [("load", "r0", [b"k0", b"k1"], True), ("deliver", None),
                                                 ("advance", 31.0), ("tick", "both"), ("answer",), ("deliver", None),
                                                 ("copy", 0, 3), ("settle", 0, True), ("deliver", None)],
    # the engine's answer and an earlier end of the same request, a link loss between the ask and the read
    "ask_then_link_lost_mid_read": [("finish", "r0"), ("load", "r0", [b"k0", b"k1", b"k2"], True),
                                    ("deliver", None), ("answer",), ("deliver", None), ("copy", 0, 1),
                                    ("reconnect", "b"), ("advance", 5.0), ("tick", "b"), ("settle", 0, True)],
}


@pytest.mark.parametrize("deferred", [False, True], ids=["settled", "deferred_release"])
@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_adversarial_schedules(name, deferred):
    model = Model(7, deferred=deferred)
    for o in SCHEDULES[name]:
        model.step(o)
    model.finish()


def test_a_stalled_copy_after_the_deadline_is_caught_by_nothing_but_never_lands_late():
    """The adversary's worst order, spelled out: read posted, deadline passes, the copy finally runs and
    reports DONE.  The load is reported only after that, as a failure, so the landing was into an open load."""
    model = Model(1)
    for o in [("store", "r0", [b"k0", b"k1"]), ("load", "r0", [b"k0", b"k1"]), ("deliver", None),
              ("advance", 31.0), ("tick", "both"), ("copy", 0, 3), ("settle", 0, True), ("deliver", None)]:
        model.step(o)
    [load] = [e for e in model.reported.values() if e.kind == "load"]
    assert not load.success and load.keys == ()
    model.finish()


class _PushDesign:
    """The old design's order of events, for the checker's regression case: the producer WRITES into the
    consumer's granted rows; the consumer reports its load failed on its deadline without waiting."""

    def __init__(self, model: Model):
        self.m = model

    def run(self) -> None:
        m_, a, b = self.m, self.m.p.a, self.m.p.b
        j = m_.job()
        rows = m_.take(m_.free_a, 1)
        m_.loads[j] = {b"k0": rows[0]}
        m_.row_owner[rows[0]] = j
        a.reporter.open(j, "load", a.clock())
        b.region[40] = b"k0"  # the producer's stored row; its write into rows[0] is posted and stalls
        a.clock.advance(31)
        a.reporter.done(j, False, (), 0, a.clock(), "timed out")  # reported at once: nothing waits
        m_.check()  # vLLM reuses the row
        a.region[rows[0]] = b"k0"  # the stalled write resumes and lands
        m_.landed(999, rows[0], b"k0")


def test_the_checker_catches_the_old_push_design():
    model = Model(2)
    try:
        _PushDesign(model).run()
    except Violation as e:
        assert "after its load was reported" in str(e)
    else:
        raise AssertionError("the checker missed a write into a reported load's row")
