"""The parking lot's job bookkeeping against a key-by-key reference model.

``ParkingLot.release`` and ``store`` work per store job with set operations (a 64-key Release cost ~100 us
key by key).  The reference below is the plain statement of the rules (p2pworker/session/parking.py's docstring),
one key at a time: a store job succeeds when every key it parked was read by a consumer, or when the request is
finished and served with the rest never asked for; it fails when an offered key was not read.  Random stores
(duplicate keys within and across jobs), leases over any subset, releases naming any subset of what was offered,
finishes, with many small store jobs per request (both ways of finding a release's jobs run: over 8 open jobs, and
fewer), resets (vLLM's reset_cache: a request without a lease fails at once, one under a lease ends with it): every
job's outcome (success, keys moved, bytes, reason) must be the reference's, and no job may be reported while one of
its keys is offered under a lease.
"""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from p2pworker.session.parking import Lease, LeasePhase, ParkingLot
from p2pworker.session.reporter import JobDone, Reporter
from tests.helpers.session import Clock

BLOCK = 4096


class Reference:
    """Key by key: what each store job parked, what is still unread, what moved; reports by job id."""

    def __init__(self) -> None:
        self.rows: dict[bytes, int] = {}  # parked key -> its job
        self.jobs: dict[int, tuple[list[bytes], set[bytes], list[bytes]]] = {}  # job -> (keys, open, moved)
        self.done: dict[int, tuple[bool, frozenset, int, str]] = {}
        self.finished = self.served = False
        self.unneeded = False  # the consumer said Done: nothing is parked any more

    def store(self, job: int, keys: list[bytes], leased: bool = False) -> None:
        if self.unneeded and not leased:
            self.done[job] = (True, frozenset(), 0, "the consumer needs nothing more of this request")
            return
        new = []
        for k in keys:
            if k not in self.rows:
                self.rows[k] = job
                new.append(k)
        if not new:
            self.done[job] = (True, frozenset(keys), 0, "")
            return
        self.jobs[job] = (new, set(new), [])

    def _close(self, job: int, ok: bool, reason: str) -> None:
        keys, _, moved = self.jobs.pop(job)
        for k in keys:
            del self.rows[k]
        self.done[job] = (ok, frozenset(moved), len(moved) * BLOCK, reason)

    def release(self, offered: list[bytes], read: set[bytes], reason: str) -> None:
        self.served = True
        for k in offered:
            job = self.rows.get(k)
            if job is None or job not in self.jobs or k not in read:
                continue
            _, open_, moved = self.jobs[job]
            if k in open_:
                open_.discard(k)
                moved.append(k)
                if not open_:
                    self._close(job, True, "")
        for job in dict.fromkeys(self.rows[k] for k in offered if k not in read and k in self.rows):
            if job in self.jobs:
                self._close(job, False, reason)
        self._maybe_close()

    def finish(self) -> None:
        self.finished = True
        self._maybe_close()

    def consumer_done(self, leased: bool) -> None:
        """Done: every open job ends now (success, not asked for), or when the lease ends."""
        self.unneeded = self.served = True
        if not leased:
            self._maybe_close()

    def reset(self, leased: bool, reason: str) -> None:
        """vLLM reset its cache: without a lease every open job fails now and the request is forgotten, but for
        having finished (a tombstone); under one, the request is finished (its jobs close when the lease ends)."""
        if leased:
            self.finished = True
            return
        for job in list(self.jobs):
            self._close(job, False, reason)
        self.served = self.unneeded  # an unneeded request stays so (a tombstone)

    def _maybe_close(self) -> None:
        if self.served and (self.finished or self.unneeded):
            for job in list(self.jobs):
                self._close(job, True, "not requested by the consumer")
            if not self.unneeded:
                self.finished = self.served = False  # the lot forgets the request: a later store starts afresh


def outcomes(events: list) -> dict[int, tuple[bool, frozenset, int, str]]:
    return {e.job_id: (e.success, frozenset(e.keys), e.nbytes, e.reason) for e in events if isinstance(e, JobDone)}


class _RandomRun:
    """One random run against the lot and the reference: each method is one kind of step, drawing from ``rnd`` in
    the order the run always has (the same seed replays the same run)."""

    def __init__(self, rnd: random.Random) -> None:
        self.rnd = rnd
        self.universe = [b"k%d" % i for i in range(rnd.choice((6, 24, 80)))]
        self.reporter = Reporter()
        self.lot = ParkingLot(self.reporter, lambda: 0.0, block_bytes=BLOCK)
        self.ref = Reference()
        self.job, self.rows = 0, iter(range(1 << 20))
        self.offered: list[bytes] = []

    def store(self, p) -> None:
        rnd = self.rnd
        self.job += 1
        keys = rnd.sample(self.universe, rnd.randint(1, min(rnd.choice((2, 3, 10)), len(self.universe))))
        if rnd.random() < 0.2:
            keys += rnd.sample(keys, 1)  # a key twice in one job: the first copy serves both
        leased = p is not None and p.lease is not None
        self.lot.store(self.job, "r", keys, [next(self.rows) for _ in keys])
        self.ref.store(self.job, keys, leased)

    def bind(self, p, step: int) -> None:
        self.offered = self.rnd.sample(sorted(p.rows), self.rnd.randint(1, len(p.rows)))
        self.lot.bind(p, Lease(step, None, {}, 1e9, 1e9, offered={k: p.rows[k] for k in self.offered}))

    def release(self, p) -> None:
        rnd = self.rnd
        read = rnd.sample(self.offered, rnd.randint(0, len(self.offered)))
        if rnd.random() < 0.2 and read:
            read += read[:1]  # a Release that names a key twice (across its parts)
        if rnd.random() < 0.2:  # keys never offered (parked or not) count for nothing
            read += rnd.sample(self.universe, 2)
        self.lot.release(p, read, "consumer did not read it")
        self.ref.release(self.offered, set(read), "consumer did not read it")

    def consumer_done(self, p) -> None:  # the consumer's request ended (Done)
        self.lot.consumer_done("r")
        self.ref.consumer_done(p.lease is not None)

    def request_finished(self, p) -> None:
        self.lot.request_finished("r")
        if p.lease is None:
            self.ref.finish()
        else:
            self.ref.finished = True  # the lot closes the rest when the lease ends

    def reset(self, p) -> None:  # the tier's drain_jobs (vLLM's reset_cache)
        leased = p.lease is not None
        self.lot.reset("vLLM reset its cache")
        self.ref.reset(leased, "vLLM reset its cache")

    def check(self) -> None:
        got = outcomes(self.reporter.events)
        assert got == self.ref.done
        p = self.lot.parcels.get("r")
        if p is not None and p.lease is not None:  # offered rows stay pinned: their jobs are open, unreported
            for k in p.lease.offered:
                assert p.job_of.get(k) in p.jobs and p.job_of[k] not in got, k

    def end(self) -> None:
        """The end: the consumer reads all it was offered, the request ends; never-fetched keys get a last round."""
        lot, ref = self.lot, self.ref
        p = lot.parcels.get("r")
        if p is not None and p.lease is not None:
            lot.release(p, list(self.offered), "unread")
            ref.release(self.offered, set(self.offered), "unread")
        lot.request_finished("r")
        ref.finish()
        p = lot.parcels.get("r")
        if p is not None and p.rows:  # never fetched: a last round offers and reads every parked key
            offered = sorted(p.rows)
            lot.bind(p, Lease(-1, None, {}, 1e9, 1e9, offered={k: p.rows[k] for k in offered}))
            lot.release(p, offered, "unread")
            ref.release(offered, set(offered), "unread")


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_release_and_store_match_the_key_by_key_rules(seed):
    rnd = random.Random(seed)
    run = _RandomRun(rnd)
    for step in range(rnd.randint(1, 60)):
        p = run.lot.parcels.get("r")
        act = rnd.random()
        if act < 0.55 or p is None:
            run.store(p)
        elif act < 0.7 and p.lease is None and p.rows:
            run.bind(p, step)
        elif act < 0.9 and p.lease is not None:
            run.release(p)
        elif act < 0.93:
            run.consumer_done(p)
        elif act < 0.96:
            run.request_finished(p)
        else:
            run.reset(p)
        run.check()
    run.end()
    assert outcomes(run.reporter.events) == run.ref.done
    assert run.reporter.open_jobs == 0 and sorted(run.ref.done) == list(range(1, run.job + 1))  # every job, once


def test_a_job_fetched_one_key_per_round_costs_what_the_rounds_move():
    """A 20,000-key store job whose keys are read in 20,000 rounds of one key each (a consumer loading a long
    prompt piece by piece while the producer's request runs on): every round moves one key, and the job is reported
    once, with every key, after the last.  Per round the lot touches the keys of that round, not the whole job
    (the job's keys are read back whole only once, when it closes): 20,000 rounds finish in a few seconds here,
    where work proportional to the job per round would be 20,000 x 20,000 key visits."""
    reporter = Reporter()
    lot = ParkingLot(reporter, lambda: 0.0, block_bytes=BLOCK)
    keys = [b"k%d" % i for i in range(20_000)]
    lot.store(1, "r", keys, list(range(len(keys))))
    p = lot.parcels["r"]
    for i, k in enumerate(keys):
        lot.bind(p, Lease(i, None, {}, 1e9, 1e9, offered={k: i}))
        lot.release(p, [k], "unread")
        assert not reporter.events or i == len(keys) - 1
    [done] = reporter.events
    assert done.success and sorted(done.keys) == sorted(keys) and done.nbytes == len(keys) * BLOCK


def test_parcels_that_ended_leave_the_reap_heap_within_park_timeout_s():
    """Each parcel's heap entry keeps it in memory until the entry comes up.  The first look is park_timeout_s after
    its creation, not park_unfinished_s (1800 s): 1,000 requests stored, finished and read leave nothing behind
    61 s later (at 150 requests/s a first look at 1800 s would hold 30 minutes of them)."""
    clock, reporter = Clock(0.0), Reporter()
    lot = ParkingLot(reporter, clock, block_bytes=BLOCK, park_timeout_s=60.0, park_unfinished_s=1800.0)
    for i in range(1000):
        lot.store(i, f"r{i}", [b"k"], [i])
        lot.request_finished(f"r{i}")
        p = lot.parcels[f"r{i}"]
        lot.bind(p, Lease(i, None, {}, 20.0, 30.0, offered={b"k": i}))  # a lease's entry stays until its end
        lot.release(p, [b"k"], "unread")
    assert not lot.parcels and all(e.success for e in reporter.events if isinstance(e, JobDone))
    clock.now = 61.0
    lot.tick()
    assert lot.due.times() == []


def test_a_store_joining_a_finished_request_gets_its_own_park_timeout_s():
    """A peer's lookup answered twice for the same asker id: the second store joins the parcel the first end
    finished, and the second end starts the clock again (before: reaped seconds after it was parked)."""
    clock, reporter = Clock(0.0), Reporter()
    lot = ParkingLot(reporter, clock, block_bytes=BLOCK, park_timeout_s=60.0, park_unfinished_s=1800.0)
    lot.store(1, "asker", [b"a"], [1])
    lot.request_finished("asker")
    clock.now = 50.0
    lot.store(2, "asker", [b"b"], [2])
    lot.request_finished("asker")
    clock.now = 61.0
    lot.tick()
    assert not reporter.events and "asker" in lot.parcels
    clock.now = 111.0
    lot.tick()
    assert sorted(e.job_id for e in reporter.events if isinstance(e, JobDone) and not e.success) == [1, 2]


def test_a_parcel_a_fetch_made_for_an_id_never_stored_is_dropped_after_park_timeout_s():
    """A consumer's Fetch makes a parcel for its id; with nothing ever parked and no end told it holds no row, and
    is dropped at the first look (not kept for park_unfinished_s: a peer could make them at will)."""
    clock, reporter = Clock(0.0), Reporter()
    lot = ParkingLot(reporter, clock, block_bytes=BLOCK, park_timeout_s=60.0, park_unfinished_s=1800.0)
    lot.parcel("never")
    clock.now = 61.0
    lot.tick()
    assert "never" not in lot.parcels and lot.due.times() == [] and not reporter.events


def test_an_unfinished_parcel_with_stores_is_kept_past_the_first_look():
    clock, reporter = Clock(0.0), Reporter()
    lot = ParkingLot(reporter, clock, block_bytes=BLOCK, park_timeout_s=60.0, park_unfinished_s=1800.0)
    lot.store(1, "long", [b"a"], [1])
    clock.now = 61.0
    lot.tick()
    assert "long" in lot.parcels and not reporter.events and lot.due.times() == [1800.0]


def test_a_dones_tombstone_outlives_the_close_of_a_session_whose_lease_offered_nothing():
    """A consumer's Fetch binds a lease before anything is parked, its Done comes, then its session closes (a link
    reset): abandon() ends the empty lease.  The Done still holds: a store that comes later is reported at once
    (success, not parked for nobody), not pinned until park_timeout_s."""
    clock, reporter = Clock(0.0), Reporter()
    lot = ParkingLot(reporter, clock, block_bytes=BLOCK, park_timeout_s=60.0, park_unfinished_s=1800.0)
    p = lot.parcel("req")
    lot.bind(p, Lease(1, object(), {}, 20.0, 30.0))  # a consumer's fetch, nothing offered yet
    lot.consumer_done("req")
    lot.abandon(p, "session closed")
    clock.now = 1.0
    lot.store(7, "req", [b"k"], [3])
    (done,) = [e for e in reporter.events if isinstance(e, JobDone) and e.job_id == 7]
    assert done.success and not lot.parcels["req"].jobs
    clock.now = 61.0
    lot.tick()
    assert "req" not in lot.parcels  # the tombstone still goes at the reaper's look


def _offered_lease(lot: ParkingLot, req: str, job: int, owner: object, row: int) -> tuple:
    """``req`` parked (one key, job ``job``) and offered under a lease ``owner`` serves; the request finished."""
    lot.store(job, req, [req.encode()], [row])
    lot.request_finished(req)
    p = lot.parcel(req)
    lease = Lease(1, owner, {}, 20.0, 30.0)
    lot.bind(p, lease)
    lot.offering_starts(lease, 0.0)
    lease.offered[req.encode()] = row
    lease.phase = LeasePhase.HELD
    return p, lease


def test_a_closed_sessions_leases_end_when_its_reader_is_gone_and_not_before():
    """abandon() keeps the offered rows pinned (the reader may still read) and records whose they were; orphans.count()
    counts them; reader_gone() ends them at once, failing what was not released, and only that reader's; a lease
    that ended otherwise (its hold ran out) leaves no record behind."""
    clock, reporter = Clock(0.0), Reporter()
    lot = ParkingLot(reporter, clock, block_bytes=BLOCK)
    a, b = object(), object()
    pa, _ = _offered_lease(lot, "ra", 1, a, 1)
    pa2, _ = _offered_lease(lot, "ra2", 2, a, 2)
    pb, _ = _offered_lease(lot, "rb", 3, b, 3)
    for p in (pa, pa2, pb):
        lot.abandon(p, "session closed")
    assert lot.orphans.count(a) == 2 and lot.orphans.count(b) == 1
    assert not [e for e in reporter.events if isinstance(e, JobDone)]  # pinned: nothing reported
    assert lot.reader_gone(a, "consumer exited") == 2
    done = {e.job_id: e for e in reporter.events if isinstance(e, JobDone)}
    assert set(done) == {1, 2} and not any(d.success for d in done.values())
    assert all(d.reason == "consumer exited" for d in done.values())
    assert lot.orphans.count(a) == 0 and lot.orphans.count(b) == 1 and lot.leases == 1 and lot.offering == 1
    assert lot.reader_gone(a, "again") == 0  # once
    clock.now = 40.0  # b's lease runs out: its record goes with it
    lot.tick()
    assert lot.orphans.count(b) == 0 and lot.leases == 0 and lot.offering == 0
    assert {e.job_id for e in reporter.events if isinstance(e, JobDone)} == {1, 2, 3}


def test_a_lease_whose_session_lives_is_no_readers_to_end():
    """Only a closed session's leases are a reader's: a live owner's lease is untouched by reader_gone()."""
    clock, reporter = Clock(0.0), Reporter()
    lot = ParkingLot(reporter, clock, block_bytes=BLOCK)
    owner = object()
    p, lease = _offered_lease(lot, "r", 1, owner, 1)
    assert lot.orphans.count(owner) == 0 and lot.reader_gone(owner, "exited") == 0
    assert p.lease is lease and not reporter.events
