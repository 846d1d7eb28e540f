"""The producer's parking lot: stored blocks wait here, per request id, until a consumer's fetch leases them.

Worker-wide (a store names a request, not a peer; the fetch arrives on
whichever session the consumer opened).  Either order works: stores first
then the fetch (PD's usual order), or the fetch first and stores later.

A store job's rows belong to vLLM again the moment the job is reported, so a
job is reported only when none of its rows can still be read by a consumer:

- an offered row is *leased*: it stays parked until the consumer's Release,
  the lease's end (``Lease.hold_until``), or the kernel saying the consumer's
  process exited (``reader_gone``), whichever comes first.  Nothing else
  releases it: not the consumer's link going down, not its session closing,
  not a protocol error (a consumer whose link died may still be reading, and
  nothing in this process can stop a one-sided READ);
- success: when every key of the job was read by a consumer (its Release
  named it), or when the request is finished and served and the consumer
  did not ask for the rest, or when the consumer said it needs nothing more of
  the request (``Done``: its own request ended; it held a shared prefix
  already, recomputed, or was aborted): then the parcel's unleased stores end at
  once, and stores that come later are not parked;
- failure: when an offered key was not read (Release without it, or the
  lease ran out), when its parcel was not fetched within ``park_timeout_s``
  of its request's end, or its request did not end within
  ``park_unfinished_s`` (reaped), or when the worker shuts down (after the
  region is deregistered and unmapped, so no read can reach it).

Reaping counts from the request's end, not from its first store: a long
prompt's prefill stores its first chunks long before the request ends and the
consumer can ask (a 52,000-token prompt took 157-171 s on a 2-core AVX2 box;
its first chunks were reaped after 60 s while later ones parked afresh, and the
consumer got 1,113 of 1,625 keys).  vLLM tells every request's end (an aborted
one's too); ``park_unfinished_s`` only bounds a parcel whose end never came
(counted from its creation: its first store, or a consumer's Fetch).  A parcel
still unfinished ``park_timeout_s`` after its creation with nothing parked (a
Fetch for an id never stored here) is dropped then: it holds no row.

Lease phases (a parcel has at most one lease at a time; :data:`LEASE_MOVES` is the table,
:func:`~p2pworker.session.moves.move` the only way a phase changes)::

    (none) --Fetch--> OFFERING --final Offer sent--> HELD
    OFFERING | HELD --its session closed with rows offered--> HELD (no owner: nothing more is offered)
    OFFERING | HELD --Release, now >= hold_until, or nothing offered when its session closed--> ENDED (none)
    HELD (no owner) --the closed session's peer process exited (reader_gone)--> ENDED (none)

A consumer's process that exited reads nothing more: the worker tells the lot so (``reader_gone``) where the kernel
says it (a pidfd of a same-host lane's peer, p2pworker/worker/exits.py), and that session's leases end then, as
one that ran out does.  A link's end never says it: a partitioned consumer may still be reading.
"""

from __future__ import annotations

import enum
import heapq
import itertools
import math
from dataclasses import dataclass, field
from typing import Any, Callable

from p2pworker.limits import MAX_JOB_KEYS
from p2pworker.session.moves import move
from p2pworker.session.reporter import JobKind, Reporter


class LeasePhase(enum.Enum):
    OFFERING = "offering"  # keys are offered as their stores arrive
    HELD = "held"  # the final offer went out (or its session closed); the rows stay pinned until Release or hold_until
    ENDED = "ended"  # unbound from its parcel: its rows are the store jobs' to end


class Ask(enum.Enum):
    """A round whose Fetch asked (``Fetch.ask``): nothing was parked for it in advance, so its offers end when our
    engine answered which keys it holds, not when the request was told finished (an earlier round's end may have)."""

    NONE = "none"  # a plain Fetch: the offers end with the request's end, or when every key was offered
    ASKED = "asked"  # our engine was asked (ServeLookup); its hits arrive as store jobs and are offered
    ANSWERED = "answered"  # it answered: every hit it had is parked, so the offers end now
    RESET = "reset"  # a reset ended the ask before it answered: the offers end now; what is missing says nothing of
    # what the engine holds (the consumer must not count it short nor learn the keys as lacked)
    REFUSED = "refused"  # too many lookups in flight here: the engine was not asked, the offers end now


class LeaseEvent(enum.Enum):
    FINAL_OFFER = "final_offer"
    OWNER_GONE = "owner_gone"  # the serving session closed with rows offered: they stay pinned (invariant 7)
    END = "end"  # Release, the hold's end, its reader's process exited, or nothing offered (its session closed, or
    # the worker shuts down)


LEASE_MOVES: dict[tuple[LeasePhase, LeaseEvent], LeasePhase] = {
    (LeasePhase.OFFERING, LeaseEvent.FINAL_OFFER): LeasePhase.HELD,
    (LeasePhase.OFFERING, LeaseEvent.OWNER_GONE): LeasePhase.HELD,
    (LeasePhase.HELD, LeaseEvent.OWNER_GONE): LeasePhase.HELD,
    (LeasePhase.OFFERING, LeaseEvent.END): LeasePhase.ENDED,
    (LeasePhase.HELD, LeaseEvent.END): LeasePhase.ENDED,
}


@dataclass(eq=False)
class Lease:
    """One consumer round: what it wants, what was offered (and is pinned), and until when."""

    round: int
    owner: Any  # the session serving it; None once that session closed (the lease still holds)
    pending: dict[bytes, None]  # wanted keys not offered yet (a dict: ordered, O(1) removal)
    offer_until: float  # after this the round's offers end (final Offer)
    hold_until: float  # the lease's end: pinned rows are released even without a Release
    offered: dict[bytes, int] = field(default_factory=dict)  # key -> our row, pinned
    phase: LeasePhase = LeasePhase.OFFERING
    more: bool = False  # more Fetch parts of this round are to come (no final Offer before the last)
    parts: int = 1  # Fetch parts received
    read: list[bytes] = field(default_factory=list)  # keys named by the Release parts received so far
    ask: Ask = Ask.NONE
    reader: Any = None  # once its session closed with rows offered: that session (reader_gone() ends it early)


@dataclass(eq=False)
class StoreRecord:
    keys: list[bytes]  # keys this job parked (a key parked twice belongs to its first job)
    open: set[bytes]  # keys not read by a consumer yet
    moved: list[bytes] = field(default_factory=list)  # keys read by a consumer


@dataclass(eq=False)
class Parcel:
    request_id: str
    created: float
    rows: dict[bytes, int] = field(default_factory=dict)  # parked key -> local row
    job_of: dict[bytes, int] = field(default_factory=dict)  # parked key -> store job
    jobs: dict[int, StoreRecord] = field(default_factory=dict)  # open store jobs
    finished_at: float = math.inf  # when the producer's request ended (the park_timeout_s clock starts); inf: not yet
    served: bool = False  # a lease ended (released or expired) at least once
    lease: Lease | None = None
    # The consumer needs nothing more of it (Done): its unleased stores end at once and later ones are not parked.
    # Kept (a tombstone) until the reaper's next look, so a store that comes after the Done is not parked either.
    unneeded: bool = False
    unneeded_at: float = -math.inf  # the last Done: an unneeded tombstone lasts park_timeout_s from it

    @property
    def finished(self) -> bool:
        """The producer's request ended: no more stores will come."""
        return self.finished_at != math.inf


class DueHeap:
    """When the lot's tick() must look at a parcel (reap) or a lease (its end).  A heap, so a tick costs what is due,
    not a walk over every parked request (invariant 8).  Stale entries (a parcel forgotten, a lease released) are
    skipped by the tick when they come up; until then each holds its parcel in memory."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Parcel, Lease | None]] = []
        self._seq = itertools.count()  # ties in time come up in push order, and never compare parcels

    def push(self, at: float, p: Parcel, lease: Lease | None = None) -> None:
        heapq.heappush(self._heap, (at, next(self._seq), p, lease))

    def pop_due(self, now: float) -> tuple[Parcel, Lease | None] | None:
        """The soonest entry due by ``now`` (removed), or None."""
        if not self._heap or self._heap[0][0] > now:
            return None
        _, _, p, lease = heapq.heappop(self._heap)
        return p, lease

    def times(self) -> list[float]:
        """When each entry comes up, soonest first (stale ones included)."""
        return sorted(at for at, *_ in self._heap)


class Orphans:
    """Leases whose session closed with rows offered, by that session (their reader), for reader_gone()."""

    def __init__(self) -> None:
        self._by: dict[Any, dict[Parcel, Lease]] = {}

    def add(self, p: Parcel, lease: Lease) -> None:
        """``lease``'s owner closed: it is the lease's reader from now on."""
        if lease.owner is None:  # abandoned already: its reader is recorded
            return
        lease.reader = lease.owner
        self._by.setdefault(lease.reader, {})[p] = lease

    def ended(self, p: Parcel, lease: Lease) -> None:
        held = self._by.get(lease.reader) if lease.reader is not None else None
        if held is not None:
            held.pop(p, None)
            if not held:
                del self._by[lease.reader]

    def count(self, reader: Any) -> int:
        return len(self._by.get(reader, ()))

    def gone(self, reader: Any, release: Callable[[Parcel, list[bytes], str], None], reason: str) -> int:
        """The process behind ``reader`` exited: ``release`` each of its leases still bound, none read.  Call only
        when the kernel says it exited (invariant 7: a read runs in its reader's process), never on a link's end."""
        held = self._by.pop(reader, {})
        for p, lease in held.items():
            if p.lease is lease:
                release(p, [], reason)
        return len(held)


class ParkingLot:
    def __init__(self, reporter: Reporter, clock: Callable[[], float], *, block_bytes: int,
                 park_timeout_s: float = 60.0, park_unfinished_s: float = 1800.0):
        self.reporter = reporter
        self.clock = clock
        self.block_bytes = block_bytes
        self.park_timeout_s = park_timeout_s
        self.park_unfinished_s = park_unfinished_s
        self.parcels: dict[str, Parcel] = {}
        self.reaped = self.leases_expired = 0
        self.leases = 0  # parcels under a lease now
        self.offering = 0  # leases with rows offered: read over TCP only while we progress, so the worker polls then
        self.orphans = Orphans()
        self.last_offer_at = -math.inf  # when rows were last offered (the worker polls fastest right after)
        self.due = DueHeap()

    def parcel(self, request_id: str) -> Parcel:
        p = self.parcels.get(request_id)
        if p is None:
            p = self.parcels[request_id] = Parcel(request_id, self.clock())
            self.due.push(self._first_look(p), p)
        return p

    def _reap_at(self, p: Parcel) -> float:
        """When ``p``, without a lease, is dropped (its open jobs failed)."""
        if p.finished:
            return p.finished_at + self.park_timeout_s
        return p.created + self.park_unfinished_s

    def _first_look(self, p: Parcel) -> float:
        # Not at the unfinished bound: a parcel's entry keeps it (dropped or not) in the heap until it comes up, and
        # most parcels end within seconds.  One still unfinished then is pushed again to the bound in force (tick).
        return p.created + min(self.park_timeout_s, self.park_unfinished_s)

    def _finish(self, p: Parcel) -> None:
        """The request ended (again: a lookup's store for the same asker id joins a finished parcel, and each one
        gets its own park_timeout_s).  One heap entry per end told: linear in the commands."""
        p.finished_at = self.clock()
        self.due.push(self._reap_at(p), p)

    # ------------------------------------------------------------ from the adapter
    def store(self, job_id: int, request_id: str, keys: list[bytes], rows: list[int]
              ) -> tuple[Parcel, list[bytes]] | None:
        """Park a store job.  Returns (parcel, new keys) when a session should offer them (its lease's owner)."""
        now = self.clock()
        self.reporter.open(job_id, JobKind.STORE, now)
        if len(keys) != len(rows) or not keys:
            self.reporter.done(job_id, False, (), 0, now, f"bad store: {len(keys)} keys, {len(rows)} rows")
            return None
        if len(keys) > MAX_JOB_KEYS:
            self.reporter.done(job_id, False, (), 0, now, f"store of {len(keys)} keys exceeds the hard limit of "
                                                          f"{MAX_JOB_KEYS} keys per job (p2pworker.limits)")
            return None
        p = self.parcel(request_id)
        if p.unneeded and p.lease is None:
            # Not parked: nobody will fetch it.  A success, as keys a consumer did not ask for (maybe_close).
            self.reporter.done(job_id, True, (), 0, now, "the consumer needs nothing more of this request")
            return None
        if p.finished and p.served and p.lease is None:
            self.reporter.done(job_id, False, (), 0, now, "request already served")
            return None
        fresh = dict(zip(keys, rows))
        if len(fresh) == len(keys) and p.rows.keys().isdisjoint(fresh):
            # The usual store (distinct keys, none parked yet) in C loops: ~3x faster than the loop below at 64 keys.
            p.rows.update(fresh)
            p.job_of.update(dict.fromkeys(fresh, job_id))
            new = list(fresh)
        else:
            new = []
            for key, row in zip(keys, rows):
                if key not in p.rows:  # a key parked twice (or twice in this job): the first copy serves both
                    p.rows[key] = row
                    p.job_of[key] = job_id
                    new.append(key)
        if not new:
            self.reporter.done(job_id, True, keys, 0, now, "")
            return None
        p.jobs[job_id] = StoreRecord(new, set(new))
        return (p, new) if p.lease is not None and p.lease.owner is not None else None

    def request_finished(self, request_id: str) -> Parcel | None:
        """No more stores for the request.  Returns the parcel when its lease's owner should end the offers."""
        p = self.parcels.get(request_id)
        if p is None:
            # Nothing parked (its stores failed, or went to a worker that died before us): keep a
            # tombstone until park_timeout_s so a fetch that comes later is answered at once, empty,
            # instead of waiting out fetch_timeout_s for stores that will never come.
            self._finish(self.parcel(request_id))
            return None
        self._finish(p)
        if p.lease is not None:
            return p if p.lease.owner is not None else None
        self.maybe_close(p)
        return None

    def consumer_done(self, request_id: str) -> None:
        """The consumer's request ended (Done): it fetches nothing more.  Unleased stores end now (success: they were
        not asked for, as in maybe_close); under a lease they end once it is released or runs out (invariant 7: a
        row under a lease may still be read).  Idempotent; a Done for a request nothing was parked for leaves a
        tombstone (dropped at the reaper's first look, park_timeout_s on) so stores that still come are not parked."""
        p = self.parcel(request_id)
        p.unneeded = True
        p.served = True
        p.unneeded_at = now = self.clock()
        self.due.push(now + self.park_timeout_s, p)
        self.maybe_close(p)

    # ------------------------------------------------------------ leases
    def offering_starts(self, lease: Lease, now: float) -> None:
        """Rows of ``lease`` are about to be offered: count the lease among those with offered rows (once) and
        note when (the worker polls fastest right after an offer).  Bookkeeping for polling only: what is pinned
        and when it is released stays with the lease (invariant 7).  O(1) per offer, whatever the key count."""
        if not lease.offered:
            self.offering += 1
        self.last_offer_at = now

    def bind(self, p: Parcel, lease: Lease) -> None:
        if p.lease is not None:
            raise ValueError(f"parcel {p.request_id!r} is leased already (round {p.lease.round})")
        p.lease = lease
        self.leases += 1
        self.due.push(lease.hold_until, p, lease)

    def release(self, p: Parcel, read: list[bytes], reason: str) -> None:
        """End ``p``'s lease: ``read`` keys were read intact; other offered keys fail their jobs with ``reason``.

        Call only when no read of the offered rows can still count: the
        consumer said so (Release), the lease ran out, or its process exited.
        """
        lease = p.lease
        if lease is None:
            return
        self._unbind(p, lease)
        p.served = True
        now = self.clock()
        offered = lease.offered
        moved = set(read).intersection(offered)  # only what was offered can count as read
        unread = [] if len(moved) == len(offered) else [k for k in offered if k not in moved]
        # Per store job, with set operations (C loops instead of a Python call per key).  Jobs in
        # the order they were stored (a few) or their keys were offered (many), the same on every run.
        jobs = list(p.jobs) if len(p.jobs) <= 8 else dict.fromkeys(map(p.job_of.get, offered))
        for job in jobs:
            rec = p.jobs.get(job) if job is not None else None
            if rec is None:
                continue
            hit = rec.open & moved
            if not hit:
                continue
            rec.open -= hit
            # O(keys moved), not O(job): a job fetched in many small rounds would cost O(job) per round.  Sorted so
            # reports are the same on every run (the adapter does not use a store job's keys).
            rec.moved += rec.keys if len(hit) == len(rec.keys) else sorted(hit)
            if not rec.open:
                self._close_job(p, job, True, now, "")
        self._fail_keys(p, unread, reason, now)
        # The lease stays referenced from the deadline heap until its hold_until: keep nothing big alive with it
        # (a 65,536-key lease's tables are ~9 MB).
        lease.offered, lease.pending, lease.read = {}, {}, []
        self.maybe_close(p)

    def abandon(self, p: Parcel, reason: str) -> None:
        """The session serving ``p``'s lease closed.  Offered rows stay pinned until the lease ends."""
        lease = p.lease
        if lease is None:
            return
        if not lease.offered:  # nothing can be read: end it now
            self._unbind(p, lease)
            # Invariant 7: nothing was offered under this lease, so no read of p's rows can run; its jobs may end now.
            if p.unneeded:  # its consumer's Done stands: the tombstone stays (later stores are not parked for nobody)
                self.maybe_close(p)
            else:
                self.drop(p, reason)
            return
        self.orphans.add(p, lease)
        lease.owner = None
        lease.phase = move(LEASE_MOVES, lease.phase, LeaseEvent.OWNER_GONE)

    def reader_gone(self, reader: Any, reason: str) -> int:
        """The process behind ``reader`` (a closed session's peer) exited: its leases end now (Orphans.gone)."""
        return self.orphans.gone(reader, self.release, reason)

    def _unbind(self, p: Parcel, lease: Lease) -> None:
        """``lease`` ends: ``p`` is free of it, and it no longer counts among the leases (with offered rows)."""
        lease.phase = move(LEASE_MOVES, lease.phase, LeaseEvent.END)
        p.lease = None
        self.leases -= 1
        if lease.offered:
            self.offering -= 1
        self.orphans.ended(p, lease)

    # ------------------------------------------------------------ job bookkeeping
    def _fail_keys(self, p: Parcel, keys: list[bytes], reason: str, now: float) -> None:
        for job in {p.job_of[k] for k in keys if k in p.job_of}:
            if job in p.jobs:
                self._close_job(p, job, False, now, reason)

    def _close_job(self, p: Parcel, job: int, success: bool, now: float, reason: str) -> None:
        rec = p.jobs.pop(job)
        lease = p.lease
        if lease is not None and not lease.offered.keys().isdisjoint(rec.keys):
            # cannot happen: leased keys close only via release()
            raise AssertionError(f"store job {job} closed while a key of it is leased")
        if len(rec.keys) == len(p.rows):  # the parcel's only job (its keys are all parked): drop the tables whole
            p.job_of.clear()
            p.rows.clear()  # the rows are vLLM's again: never offer them after this
        else:
            for key in rec.keys:
                del p.job_of[key]
                del p.rows[key]  # the row is vLLM's again: never offer it after this
        self.reporter.done(job, success, rec.moved, len(rec.moved) * self.block_bytes, now, reason)

    def maybe_close(self, p: Parcel) -> None:
        """A finished request whose fetch was served, or one its consumer needs nothing more of: the keys nobody
        asked for are done."""
        if p.lease is None and p.served and (p.finished or p.unneeded):
            now = self.clock()
            for job in list(p.jobs):
                self._close_job(p, job, True, now, "not requested by the consumer")
            if not p.unneeded:  # an unneeded one stays a tombstone until the reaper's look (see consumer_done)
                self.parcels.pop(p.request_id, None)

    def drop(self, p: Parcel, reason: str) -> None:
        """Fail every open store job of ``p`` and forget it.  Only for a parcel without a lease."""
        if p.lease is not None:
            raise AssertionError(f"drop() of parcel {p.request_id!r} under a lease")
        now = self.clock()
        for job in list(p.jobs):
            self._close_job(p, job, False, now, reason)
        self.parcels.pop(p.request_id, None)

    def tick(self) -> None:
        """Lease ends and reaping, for what is due only.  Time is only compared here, never trusted from a peer."""
        now = self.clock()
        while (entry := self.due.pop_due(now)) is not None:
            p, lease = entry
            if self.parcels.get(p.request_id) is not p:
                continue  # forgotten already
            if lease is not None:
                if p.lease is lease:
                    self.leases_expired += 1
                    self.release(p, [], f"lease of round {lease.round} ran out without the consumer's release")
            elif p.lease is not None:  # not reaped under a lease: look again when it ends
                self.due.push(max(now, p.lease.hold_until), p)
            elif not p.finished and not p.jobs:
                if p.unneeded and now < p.unneeded_at + self.park_timeout_s:
                    continue  # a Done's tombstone lasts park_timeout_s from that Done (its own heap entry)
                self.parcels.pop(p.request_id, None)  # nothing parked, no end told (a Fetch for an id never stored)
            elif now < (at := self._reap_at(p)):
                # the first look at an unfinished parcel, or an entry of an earlier end: the bound in force
                self.due.push(at, p)
            else:
                # Invariant 7: only a parcel without a lease is dropped (drop() asserts it), and a consumer reads only
                # rows offered under a lease, so no read of these rows runs or can start once their jobs are reported;
                # the rows are vLLM's (the producer engine's) again.  Invariant 8: per parcel, one entry at its first
                # look, one per end told and one per lease; a tick pops only what is due.
                self.reaped += bool(p.jobs)  # tombstones (nothing parked) are not reaped stores
                self.drop(p, f"not fetched within {self.park_timeout_s:g} s of its request's end" if p.finished
                          else f"its request did not end within {self.park_unfinished_s:g} s")

    def reset(self, reason: str) -> list[Parcel]:
        """vLLM reset its cache: fail now the store jobs of every parcel without a lease (a consumer reads only rows
        offered to it, under a lease).  A finished request stays a tombstone (a later ask is answered at once, empty;
        vLLM does not tell its end again).  A leased parcel is marked finished: its owner sends the final offer now,
        later stores join it unoffered, its jobs close when the lease ends.  Returns the parcels whose lease's owner
        should end its offers.  O(parcels), once per reset."""
        owners = []
        for p in list(self.parcels.values()):
            if p.lease is None:
                finished, unneeded = p.finished, p.unneeded
                self.drop(p, reason)
                if finished or unneeded:
                    tomb = self.parcel(p.request_id)
                    tomb.unneeded = tomb.served = unneeded
                    if finished:
                        self._finish(tomb)
            else:
                self._finish(p)
                if p.lease.ask is Ask.ASKED:  # the engine pins nothing more for it: its offers end now too
                    p.lease.ask = Ask.RESET
                if p.lease.owner is not None:
                    owners.append(p)
        return owners

    def shutdown(self, reason: str) -> int:
        """Worker exit: fail the store jobs of parcels without a lease.  Leased ones are NOT reported: a consumer may
        still read their rows until this process is gone (the adapter fails them then).  Returns how many stay."""
        held = 0
        for p in list(self.parcels.values()):
            if p.lease is not None and p.lease.offered:
                held += 1
                continue
            if p.lease is not None:
                self._unbind(p, p.lease)
            self.drop(p, reason)
        return held

    @property
    def open_jobs(self) -> int:
        return sum(len(p.jobs) for p in self.parcels.values())
