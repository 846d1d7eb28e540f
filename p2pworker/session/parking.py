"""The producer's parking lot: stored blocks wait here, per request id, until a consumer's fetch binds them.

Worker-wide (a store names a request, not a peer; the fetch arrives on
whichever session the consumer opened).  Either order works: stores first
then the fetch (PD's usual order), or the fetch first and stores later.

A store job's rows belong to vLLM again the moment the job is reported, so a
key leaves the lot (can no longer be written anywhere) as soon as its job is
reported, success or failure.  A store job is reported:

- success: when every key of it landed at a consumer, or when the request is
  finished and served and the consumer did not ask for the rest;
- failure: when a write of one of its keys failed, when its parcel was never
  fetched within ``park_timeout_s`` (reaped), or when the consumer serving it
  aborted or died.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from p2pworker.session.reporter import Reporter


@dataclass(eq=False)
class FetchState:
    round: int
    wanted: dict[bytes, int]  # key -> consumer row granted for it
    deadline: float
    landed: set[bytes] = field(default_factory=set)
    given_up: set[bytes] = field(default_factory=set)
    sending: set[bytes] = field(default_factory=set)
    inflight: dict[int, list[bytes]] = field(default_factory=dict)  # transfer id -> keys
    aborted: bool = False


@dataclass(eq=False)
class Parcel:
    request_id: str
    created: float
    rows: dict[bytes, int] = field(default_factory=dict)  # parked key -> local row
    job_of: dict[bytes, int] = field(default_factory=dict)  # parked key -> store job
    open_keys: dict[int, set[bytes]] = field(default_factory=dict)  # open store job -> keys not landed yet
    moved: dict[int, list[bytes]] = field(default_factory=dict)  # store job -> keys landed
    finished: bool = False  # the producer's request ended: no more stores will come
    served_round: int = -1
    owner: Any = None  # the session whose fetch is active
    fetch: FetchState | None = None


class ParkingLot:
    def __init__(self, reporter: Reporter, clock: Callable[[], float], *, block_bytes: int, park_timeout_s: float = 60.0):
        self.reporter = reporter
        self.clock = clock
        self.block_bytes = block_bytes
        self.park_timeout_s = park_timeout_s
        self.parcels: dict[str, Parcel] = {}
        self.reaped = 0

    def parcel(self, request_id: str) -> Parcel:
        p = self.parcels.get(request_id)
        if p is None:
            p = self.parcels[request_id] = Parcel(request_id, self.clock())
        return p

    # ------------------------------------------------------------ from the adapter
    def store(self, job_id: int, request_id: str, keys: list[bytes], rows: list[int]) -> None:
        now = self.clock()
        self.reporter.open(job_id, "store", now)
        if len(keys) != len(rows) or not keys:
            self.reporter.done(job_id, False, (), 0, now, f"bad store: {len(keys)} keys, {len(rows)} rows")
            return
        p = self.parcel(request_id)
        if p.finished and p.served_round >= 0 and p.fetch is None:
            self.reporter.done(job_id, False, (), 0, now, "request already served")
            return
        new = set()
        for key, row in zip(keys, rows):
            if key not in p.rows:  # a key parked twice: the first copy serves both
                p.rows[key] = row
                p.job_of[key] = job_id
                new.add(key)
        if not new:
            self.reporter.done(job_id, True, keys, 0, now, "")
            return
        p.open_keys[job_id] = new
        p.moved[job_id] = []
        if p.owner is not None:
            p.owner.pump(p)

    def request_finished(self, request_id: str) -> None:
        p = self.parcels.get(request_id)
        if p is None:
            # Nothing parked (its stores failed, or went to a worker that died before us): keep a
            # tombstone until park_timeout_s so a fetch that comes later is answered at once, empty,
            # instead of waiting out fetch_timeout_s for stores that will never come.
            p = self.parcel(request_id)
            p.finished = True
            return
        p.finished = True
        if p.owner is not None:
            p.owner.pump(p)
        else:
            self.maybe_close(p)

    # ------------------------------------------------------------ from sessions
    def delivered(self, p: Parcel, keys: list[bytes]) -> None:
        now = self.clock()
        for key in keys:
            job = p.job_of.get(key)
            if job is None or job not in p.open_keys:
                continue
            p.open_keys[job].discard(key)
            p.moved[job].append(key)
            if not p.open_keys[job]:
                self._close_job(p, job, True, now, "")

    def failed(self, p: Parcel, keys: list[bytes], reason: str) -> None:
        now = self.clock()
        for job in {p.job_of[k] for k in keys if k in p.job_of}:
            if job in p.open_keys:
                self._close_job(p, job, False, now, reason)

    def _close_job(self, p: Parcel, job: int, success: bool, now: float, reason: str) -> None:
        moved = p.moved.pop(job, [])
        p.open_keys.pop(job, None)
        for key in [k for k, j in p.job_of.items() if j == job]:
            del p.job_of[key]
            del p.rows[key]  # the row is vLLM's again: never write it after this
        self.reporter.done(job, success, moved, len(moved) * self.block_bytes, now, reason)

    def maybe_close(self, p: Parcel) -> None:
        """A finished request whose fetch was served: the keys nobody asked for are done."""
        if p.finished and p.fetch is None and p.served_round >= 0 and p.owner is None:
            for job in list(p.open_keys):
                self._close_job(p, job, True, self.clock(), "not requested by the consumer")
            self.parcels.pop(p.request_id, None)

    def drop(self, p: Parcel, reason: str) -> None:
        """Fail every open store job of ``p`` and forget it."""
        now = self.clock()
        for job in list(p.open_keys):
            self._close_job(p, job, False, now, reason)
        p.owner = None
        p.fetch = None
        self.parcels.pop(p.request_id, None)

    def tick(self) -> None:
        now = self.clock()
        for p in list(self.parcels.values()):
            if p.owner is None and p.fetch is None and now - p.created >= self.park_timeout_s:
                self.reaped += bool(p.open_keys)  # tombstones (nothing parked) are not reaped stores
                self.drop(p, f"not fetched within {self.park_timeout_s:g} s")

    @property
    def open_jobs(self) -> int:
        return sum(len(p.open_keys) for p in self.parcels.values())
