"""SourceHints: which keys a source recently did not hold, so a request's pull takes the path that suits it.

A symmetric pull (``remote_kv_source``) goes one of two ways (:class:`PullPath`):

- ``ONE_TRIP``: every lookup answers HIT at once, vLLM allocates and submits the load, and the load itself asks the
  source (``LoadJob.ask``, protocol ``Fetch.ask``), which pins what it holds and offers it in the same exchange.
  What the source lacks fails that part of the load; vLLM's tiering manager drops those keys from its CPU tier, the
  request's later lookups answer MISS, and vLLM recomputes from the first key not loaded (docs/architecture.md,
  "A load that brings fewer keys than promised").  The fast path when the source holds the prefix.
- ``ASK_FIRST``: the lookups ask the source first (RETRY until it answered) and answer HIT or MISS from its answer;
  the load then fetches what it parked.  One round trip more, but a miss allocates nothing and the load never
  fails: the better path when the source is not expected to hold the request's first key.

The hint is only that expectation: the first key of a request was missing at that source within ``HINT_S``, or the
source itself failed a pull (dead, refusing, unreachable, of another model, too busy, the request leased to another
fetch) within ``FAILED_S``.  A failed one-trip load has made vLLM allocate a CPU row for every promised key, evicting
other requests' ready chunks, before it failed; asking first allocates nothing, so while a source is failing its
pulls cost the puller's cache nothing.  A source that could not be reached at all (``down``) is not even asked: its
pulls recompute at once until FAILED_S has passed or our worker linked to it again (its PeerUp names the address: a
restarted source is asked again as soon as the link redialled, at most ``reconnect_max_s`` apart, or, once the worker
stopped redialling it after ``forget_down_s``, as soon as the dial of a request naming it linked: its open-ahead
OpenSession, at most one per OPEN_AHEAD_S, or its ask once FAILED_S passed); then they ask first until it answers.
A hint picks the path, never an answer (but for ``down``: MISS, a recompute), so a stale hint costs time, not
correctness.  Bounded (``HINT_MAX`` entries, oldest dropped first), per (source, key) and per source, fed by the
loads' and the lookups' outcomes.
"""

from __future__ import annotations

import enum
import time
from collections import OrderedDict
from typing import Callable, Iterable

from p2pworker.api import PEER_DOWN, PEER_FAILED

HINT_S = 10.0  # a key a source lacked is expected missing there this long
HINT_MAX = 65_536  # (source, key) entries kept at most: ~10 MB at vLLM's 32-byte keys
FAILED_S = 10.0  # a source that failed a pull is asked first this long (an answer from it ends that at once)
RELINKED = "linked again after: "  # a down source our worker linked to again: asked first, no longer down


class PullPath(enum.Enum):
    ONE_TRIP = "one_trip"  # HIT at once; the load asks the source
    ASK_FIRST = "ask_first"  # RETRY until the source answered; the load fetches what it parked


class SourceHints:
    def __init__(self, clock: Callable[[], float] = time.monotonic, *, hint_s: float = HINT_S,
                 max_entries: int = HINT_MAX):
        self.clock = clock
        self.hint_s, self.max_entries = hint_s, max_entries
        self._missing: OrderedDict[tuple[str, bytes], float] = OrderedDict()  # (source, key) -> until
        self._failing: OrderedDict[str, tuple[float, str]] = OrderedDict()  # source -> (until, why)

    def __len__(self) -> int:
        return len(self._missing)

    def missing(self, address: str, key: bytes) -> bool:
        """The source lacked ``key`` within ``hint_s``."""
        until = self._missing.get((address, key))
        if until is None:
            return False
        if until <= self.clock():
            del self._missing[(address, key)]
            return False
        return True

    def failing(self, address: str) -> str | None:
        """Why ``address`` failed a pull within FAILED_S (None: it did not)."""
        entry = self._failing.get(address)
        return entry[1] if entry is not None and entry[0] > self.clock() else None

    def path(self, address: str, first_key: bytes) -> PullPath:
        """How a request whose first looked-up key is ``first_key`` pulls from ``address``: asking first while the
        source failed and has not answered since (past FAILED_S too: a lookup allocates nothing, so a source that is
        still dead costs the puller's cache nothing; its answer ends that), or lately lacked that key."""
        if address in self._failing or self.missing(address, first_key):
            return PullPath.ASK_FIRST
        return PullPath.ONE_TRIP

    def failed(self, address: str, why: str) -> bool:
        """A pull from ``address`` failed with ``why``.  If that is the source's own failure (api.PEER_FAILED: it was
        unreachable, or it could not serve; not a reset, our worker stopping, nor the request's own state) its pulls
        ask first: recompute at once while it is ``down`` (FAILED_S), then ask first until it answers.  True: it
        counts against the source."""
        if not why.startswith(PEER_FAILED):
            return False
        self._failing[address] = (self.clock() + FAILED_S, why)
        self._failing.move_to_end(address)
        while len(self._failing) > self.max_entries:
            self._failing.popitem(last=False)
        return True

    def down(self, address: str) -> bool:
        """``address`` failed a pull within FAILED_S because it could not be reached at all (no handshake, its
        session closed): a request that would ask it first recomputes at once instead of waiting for it again."""
        why = self.failing(address)
        return why is not None and why.startswith(PEER_DOWN)

    def relinked(self, address: str) -> None:
        """Our worker linked to ``address`` again (PeerUp): reachable, so no longer ``down``; but a link says nothing
        of serving (a source that crash-loops links and dies again), so its pulls ask first (nothing allocated) until
        it answers.  Other failures (timed out, too busy) stand."""
        entry = self._failing.get(address)
        if entry is not None and entry[1].startswith(PEER_DOWN):
            self._failing[address] = (entry[0], f"{RELINKED}{entry[1]}")

    def answered(self, address: str) -> None:
        """``address`` answered a lookup or brought a load: it serves again."""
        self._failing.pop(address, None)

    def lacked(self, address: str, keys: Iterable[bytes]) -> None:
        """``address`` did not bring or hold ``keys`` (a load that fell short, a lookup answered False)."""
        until = self.clock() + self.hint_s
        missing = self._missing
        for k in keys:
            missing[(address, k)] = until
            missing.move_to_end((address, k))
        while len(missing) > self.max_entries:
            missing.popitem(last=False)

    def held(self, address: str, keys: Iterable[bytes]) -> None:
        """``address`` brought or holds ``keys``."""
        missing = self._missing
        for k in keys:
            missing.pop((address, k), None)
