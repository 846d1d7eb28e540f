"""The exactly-once ledger: every job opened is reported once, and only opened jobs are reported.

vLLM's tiering manager asserts on an unknown or duplicate finished job id, and
that assertion takes the whole engine down.  Every job report in p2pworker
goes through one :class:`Reporter`; breaking its rules is a bug on our side
and raises ``LocalProtocolError`` where it happens, never downstream.
"""

from __future__ import annotations

import enum
from typing import NamedTuple, Union

from p2pworker.errors import LocalProtocolError


class JobKind(enum.StrEnum):
    """A job's kind.  A str enum: the adapter's JobFinished, the metrics labels and the worker's counters name it
    by its value."""

    LOAD = "load"  # pull a peer's rows into ours (consumer)
    STORE = "store"  # park our rows for a consumer's fetch (producer)


class JobDone(NamedTuple):
    job_id: int
    kind: JobKind
    success: bool  # every key of the job moved
    keys: tuple  # the keys that did move (partial success: a subset)
    nbytes: int
    seconds: float
    reason: str  # why not everything moved ("" on full success)
    settled: bool = True  # False: a failed load reported while cancelled reads may still land; JobSettled follows


class JobSettled(NamedTuple):
    """A load reported unsettled: none of its reads can land any more (its rows are vLLM's again)."""

    job_id: int


class LookupAnswer(NamedTuple):
    lookup_id: int
    present: tuple | None  # one bool per key asked; None when the peer could not answer
    reason: str


class ServeLookup(NamedTuple):
    """A peer asks which of ``keys`` we hold; answer with Session.answer_lookup."""

    peer_id: str
    lookup_id: int
    request_id: str
    keys: tuple


class SessionUp(NamedTuple):
    peer_id: str
    address: str = ""  # the address our worker dialed it at (the adapter's host:port); "" when the peer dialed us


class SessionClosed(NamedTuple):
    peer_id: str
    reason: str


Event = Union[JobDone, JobSettled, LookupAnswer, ServeLookup, SessionUp, SessionClosed]


class Reporter:
    def __init__(self) -> None:
        self._open: dict[int, tuple[JobKind, float]] = {}
        self._unsettled: set[int] = set()  # loads reported with settled=False: JobSettled still owed
        self._lookups: set[int] = set()
        self.events: list[Event] = []

    def open(self, job_id: int, kind: JobKind, t_submit: float) -> None:
        if job_id in self._open:
            raise LocalProtocolError(f"duplicate job id {job_id} ({kind}); it is still open")
        self._open[job_id] = (kind, t_submit)

    def is_open(self, job_id: int) -> bool:
        return job_id in self._open

    def done(self, job_id: int, success: bool, keys, nbytes: int, now: float, reason: str = "", *,
             settled: bool = True) -> None:
        """Report ``job_id`` once.  ``settled`` False: a failed load whose cancelled reads may still land; it owes
        exactly one :meth:`settled` later."""
        entry = self._open.get(job_id)
        if entry is None:
            raise LocalProtocolError(f"job {job_id} reported but it is not open (unknown or already reported)")
        kind, t0 = entry
        if not settled and (success or kind is not JobKind.LOAD):
            raise LocalProtocolError(f"job {job_id}: only a failed load may be reported before its reads settled")
        del self._open[job_id]
        if not settled:
            self._unsettled.add(job_id)
        self.events.append(JobDone(job_id, kind, success, tuple(keys), nbytes, max(0.0, now - t0), reason, settled))

    def settled(self, job_id: int) -> None:
        """A load reported unsettled: no read of it can land any more."""
        if job_id not in self._unsettled:
            raise LocalProtocolError(f"job {job_id} settled but it was not reported unsettled (or settled twice)")
        self._unsettled.discard(job_id)
        self.events.append(JobSettled(job_id))

    def open_lookup(self, lookup_id: int) -> None:
        if lookup_id in self._lookups:
            raise LocalProtocolError(f"duplicate lookup id {lookup_id}")
        self._lookups.add(lookup_id)

    @property
    def open_lookups(self) -> int:
        """Lookups opened and not answered yet."""
        return len(self._lookups)

    def lookup_done(self, lookup_id: int, present, reason: str = "") -> None:
        if lookup_id not in self._lookups:
            raise LocalProtocolError(f"lookup {lookup_id} answered but it is not open")
        self._lookups.discard(lookup_id)
        self.events.append(LookupAnswer(lookup_id, None if present is None else tuple(present), reason))

    def emit(self, event: Event) -> None:
        """A session event (SessionUp, SessionClosed, ServeLookup); the worker's own events never come here."""
        if not isinstance(event, (SessionUp, SessionClosed, ServeLookup)):
            raise LocalProtocolError(f"not a session event: {event!r}")
        self.events.append(event)

    def take(self) -> list[Event]:
        out, self.events = self.events, []
        return out

    @property
    def open_jobs(self) -> int:
        """Jobs not reported yet, and loads reported whose reads may still land (the worker is not drained)."""
        return len(self._open) + len(self._unsettled)
