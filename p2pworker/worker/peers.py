"""The worker's book of outbound peers: which control link serves an address, which links came up once, and the
backoff of addresses that failed.

    address key --add--> link --(LinkUp)--> was_up --(LinkDown)--> down_since[link] --(LinkUp)--> out of it
    forget(link): the one way a link leaves the book (the transport gave up, it never came up, the adapter closed
        it, its session closed on a live link, or it stayed in down_since for [control] forget_down_s and its
        address is not kept: then the address goes to ``gone`` until a link to it comes up again)
    backoff(key): no new link before Backoff.not_before (doubling per failure, forgotten RETRY_FORGET_S after it ends)

No I/O: the worker disconnects the link and closes its session; this only keeps the records, so each is written in
one place.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

RECONNECT_MIN_S = 0.2  # after a session closed on a live outbound link: first retry delay, doubled per failure
RECONNECT_MAX_S = 5.0
RETRY_FORGET_S = 60.0  # an address that has not failed for this long after its backoff starts afresh
UNREACHABLE_LOGGED_MAX = 1024  # addresses whose first failure was logged (then the set starts afresh)
GONE_MAX = 4096  # addresses whose link was dropped, remembered (oldest forgotten: a pull to one waits its handshake)


def addr_key(address: str) -> str:
    """An address as the book keys it: the adapter's host:port, without a tcp:// scheme."""
    return address[len("tcp://"):] if address.startswith("tcp://") else address


@dataclass
class Backoff:
    """No new link to an address before ``not_before``; the delay after its next failure; why it failed."""

    not_before: float
    next_delay_s: float
    why: str


@dataclass
class PeerBook:
    links: dict[str, str] = field(default_factory=dict)  # address key -> outbound link id
    addr_of: dict[str, str] = field(default_factory=dict)  # outbound link id -> the address key it was opened for
    was_up: set[str] = field(default_factory=set)  # links that were up once (a reconnect is not a first contact)
    retry: dict[str, Backoff] = field(default_factory=dict)
    kept: set[str] = field(default_factory=set)  # addresses the adapter asked to keep connected (the tier's peers)
    unreachable_logged: set[str] = field(default_factory=set)
    # outbound links down after they were up (the transport redials them), by when they went down: oldest first
    down_since: dict[str, float] = field(default_factory=dict)
    # addresses whose link was dropped after forget_down_s down: a command for one fails at once (as on the link that
    # was redialled) and dials it afresh; out once a link to it comes up
    gone: OrderedDict[str, None] = field(default_factory=OrderedDict)
    gone_max: int = GONE_MAX

    def add(self, key: str, link: str) -> None:
        self.links[key] = link
        self.addr_of[link] = key

    def forget(self, link: str) -> str | None:
        """Drop every record of outbound ``link``; returns the address it served (None: not one of ours)."""
        key = self.addr_of.pop(link, None)
        if key is not None and self.links.get(key) == link:
            del self.links[key]
        self.was_up.discard(link)
        self.down_since.pop(link, None)
        return key

    def went_down(self, link: str, now: float) -> None:
        """Outbound ``link``, once up, went down (its first LinkDown since it was up counts)."""
        self.down_since.setdefault(link, now)

    def came_up(self, link: str) -> None:
        """Outbound ``link`` is UP (again): a later down is a reconnect, not a first contact; its address is no longer
        down or gone."""
        self.was_up.add(link)
        self.down_since.pop(link, None)
        key = self.addr_of.get(link)
        if key is not None:
            self.gone.pop(key, None)

    def dropped(self, key: str) -> None:
        """The link to ``key`` was dropped after forget_down_s down (forget it first)."""
        self.gone[key] = None
        self.gone.move_to_end(key)
        while len(self.gone) > self.gone_max:
            self.gone.popitem(last=False)

    def long_down(self, now: float, after_s: float) -> list[tuple[str, str]]:
        """(link, address key) of the links down for ``after_s`` or longer whose address is not kept: to drop.
        Oldest first, and the scan stops at the first link down for less (a tick costs O(links to drop + kept))."""
        out = []
        for link, since in self.down_since.items():
            if now - since < after_s:
                break
            key = self.addr_of.get(link)
            if key is not None and key not in self.kept:
                out.append((link, key))
        return out

    def backoff(self, key: str, why: str, now: float) -> Backoff:
        """No new link to ``key`` before a delay that doubles per failure (up to RECONNECT_MAX_S), starting afresh
        once the address has not failed for RETRY_FORGET_S.  Not reset by a handshake: a peer that accepts and
        then breaks every session would otherwise be redialled every RECONNECT_MIN_S."""
        for k in [k for k, b in self.retry.items() if now - b.not_before > RETRY_FORGET_S]:
            del self.retry[k]  # bounded: entries of addresses that stopped failing go
        old = self.retry.get(key)
        delay = old.next_delay_s if old is not None else RECONNECT_MIN_S
        b = self.retry[key] = Backoff(now + delay, min(2 * delay, RECONNECT_MAX_S), why)
        return b

    def blocked(self, key: str, now: float) -> Backoff | None:
        """The backoff ``key`` is in now, if any."""
        b = self.retry.get(key)
        return b if b is not None and now < b.not_before else None

    def first_failure(self, key: str) -> bool:
        """True the first time ``key`` is reported unreachable (log it), bounded to UNREACHABLE_LOGGED_MAX keys."""
        if key in self.unreachable_logged:
            return False
        if len(self.unreachable_logged) >= UNREACHABLE_LOGGED_MAX:
            self.unreachable_logged.clear()
        self.unreachable_logged.add(key)
        return True
