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

The hint is only that expectation: the first key of a request was missing at that source within ``HINT_S``.  It
picks the path, never an answer, so a stale hint costs time, not correctness.  Bounded (``HINT_MAX`` entries,
oldest dropped first), per (source, key), fed by the loads' and the lookups' outcomes.
"""

from __future__ import annotations

import enum
import time
from collections import OrderedDict
from typing import Callable, Iterable

HINT_S = 10.0  # a key a source lacked is expected missing there this long
HINT_MAX = 65_536  # (source, key) entries kept at most: ~10 MB at vLLM's 32-byte keys


class PullPath(enum.Enum):
    ONE_TRIP = "one_trip"  # HIT at once; the load asks the source
    ASK_FIRST = "ask_first"  # RETRY until the source answered; the load fetches what it parked


class SourceHints:
    def __init__(self, clock: Callable[[], float] = time.monotonic, *, hint_s: float = HINT_S,
                 max_entries: int = HINT_MAX):
        self.clock = clock
        self.hint_s, self.max_entries = hint_s, max_entries
        self._missing: OrderedDict[tuple[str, bytes], float] = OrderedDict()  # (source, key) -> until

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

    def path(self, address: str, first_key: bytes) -> PullPath:
        """How a request whose first looked-up key is ``first_key`` pulls from ``address``."""
        return PullPath.ASK_FIRST if self.missing(address, first_key) else PullPath.ONE_TRIP

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
