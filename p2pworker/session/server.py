"""A session's server role (the producer): the peer's Fetch leases parked rows and is answered with Offers as
stores arrive; its Release (or the lease's end, in the parking lot) unpins them; its lookups are served through the
host (ServeLookup, then :meth:`ServerRole.answer_lookup`).  The lease phases are the parking lot's table
(:data:`~p2pworker.session.parking.LEASE_MOVES`).

A Fetch that asks (``Fetch.ask``, a symmetric pull in one round trip) is served through the host too: once its last
part is in, the keys not parked yet go to our engine as a ServeLookup under the round's own id (``ask_id``: negative,
so it never meets a peer's lookup id); the engine pins its hits and parks them under the request id (store jobs,
offered as they arrive, as for any Fetch) and then answers, which ends the round's offers: a key it did not hold is
never offered, and the consumer's load fails it."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from p2pworker.errors import LocalProtocolError, RemoteProtocolError
from p2pworker.limits import MAX_JOB_KEYS
from p2pworker.protocol import messages as m
from p2pworker.session.core import LEASE_DRIFT, LEASE_MARGIN_S, Action, SessionCore, State, parts
from p2pworker.session.moves import move
from p2pworker.session.parking import LEASE_MOVES, Ask, Lease, LeaseEvent, LeasePhase, Parcel
from p2pworker.session.reporter import ServeLookup

log = logging.getLogger(__name__)


@dataclass(eq=False)
class _Inbound:
    """A peer's lookup whose parts are still arriving."""

    request_id: str
    refused: bool  # too many lookups served already: answered all-False at the end, keys not kept
    keys: list[bytes] = field(default_factory=list)
    n: int = 0
    parts: int = 0


@dataclass(frozen=True, slots=True)
class AskedRound:
    """An asking round whose engine was asked (ServeLookup) and has not answered yet."""

    parcel: Parcel
    lease: Lease
    keys: tuple[bytes, ...]  # what the engine was asked for


@dataclass(frozen=True, slots=True)
class Answered:
    """What :meth:`ServerRole.answer_lookup` did: ``served`` is False when this session does not serve the lookup
    (the host tries its next session for that peer); ``actions`` are the answer's to perform."""

    served: bool
    actions: list[Action]


class ServerRole(SessionCore):
    """The producer's half of a session: the peer's Fetch, Release, Done and Lookup; offers as stores arrive
    (``pump``); the offers' time-outs."""

    def __init__(self, ctx, **kw) -> None:
        super().__init__(ctx, **kw)
        self._inbound: dict[int, _Inbound] = {}  # a peer's lookups whose parts are still arriving
        self._serving: dict[int, int] = {}  # inbound lookup id -> keys asked (waiting for answer_lookup)
        self._parcels: set[Parcel] = set()  # parcels whose lease this session serves
        self._fetch_open: Lease | None = None  # the lease whose Fetch parts are still arriving
        self._asks: dict[int, AskedRound] = {}  # ask_id -> the asking round, waiting for answer_lookup

    # ------------------------------------------------------------ lookups
    def _on_lookup(self, msg: m.Lookup) -> None:
        limit = self.ctx.config.max_inbound_lookups
        inb = self._inbound.get(msg.lookup_id)
        if msg.part == 0:
            if inb is not None or msg.lookup_id in self._serving:
                raise RemoteProtocolError(f"lookup {msg.lookup_id} asked again while the first is open")
            if self._inbound:
                # A peer sends all parts of a lookup back to back (lookup() emits them at once), so at most one is
                # ever unfinished: a second one is abuse that would hold up to MAX_JOB_KEYS keys each, forever.
                raise RemoteProtocolError(f"lookup {msg.lookup_id} started before lookup {next(iter(self._inbound))} "
                                          f"sent its last part")
            inb = self._inbound[msg.lookup_id] = _Inbound(msg.request_id, refused=len(self._serving) >= limit)
        elif inb is None or msg.part != inb.parts or msg.request_id != inb.request_id:
            raise RemoteProtocolError(f"lookup {msg.lookup_id}: part {msg.part} out of order")
        inb.parts += 1
        inb.n += len(msg.keys)
        if inb.n > MAX_JOB_KEYS:
            raise RemoteProtocolError(f"lookup {msg.lookup_id} of more than {MAX_JOB_KEYS} keys")
        if not inb.refused:
            inb.keys += msg.keys
        if msg.more:
            return
        del self._inbound[msg.lookup_id]
        if inb.refused:
            self._answer_parts(msg.lookup_id, [False] * inb.n)
            return
        self._serving[msg.lookup_id] = inb.n
        self.ctx.reporter.emit(ServeLookup(self.peer_id, msg.lookup_id, inb.request_id, tuple(inb.keys)))

    def _answer_parts(self, lookup_id: int, present: list[bool]) -> None:
        for _, part, more in parts(present):
            self._emit(m.LookupResp(lookup_id, part, more))

    def answer_lookup(self, lookup_id: int, present: list[bool]) -> Answered:
        """Answer a peer's lookup; not ``served`` (and nothing to do) when this session is not serving ``lookup_id``.
        For an asking round (``ask_id``) the answer ends its offers: the engine's hits are parked by now (the
        adapter sends their store jobs before the answer, on the same ring)."""
        asked = self._asks.pop(lookup_id, None)
        if asked is not None:
            p, lease = asked.parcel, asked.lease
            if p.lease is lease and lease.owner is self and lease.ask is Ask.ASKED:
                lease.ask = Ask.ANSWERED
                self._offer(p)
            return Answered(True, self._take())
        n = self._serving.pop(lookup_id, None)
        if n is None or self.state is not State.ACTIVE:
            return Answered(False, [])
        if len(present) != n:
            raise LocalProtocolError(f"lookup {lookup_id}: {len(present)} answers for {n} keys")
        self._answer_parts(lookup_id, list(present))
        return Answered(True, self._take())

    # ------------------------------------------------------------ fetch and offers
    def _on_fetch(self, msg: m.Fetch) -> None:
        ctx = self.ctx
        now = ctx.clock()
        if len(set(msg.keys)) != len(msg.keys):
            raise RemoteProtocolError(f"fetch {msg.request_id!r}: duplicate keys")
        if msg.part:
            self._on_fetch_part(msg)
            return
        if self._fetch_open is not None and self._fetch_open.more and self._fetch_open.owner is self:
            # Parts of one Fetch go back to back (load() emits them at once): a new round before the last part of
            # the previous one is abuse (each unfinished round could hold up to MAX_JOB_KEYS keys).
            raise RemoteProtocolError(f"fetch {msg.request_id!r} round {msg.round} started before round "
                                      f"{self._fetch_open.round} sent its last part")
        lease_s = msg.lease_ms / 1000
        if lease_s > ctx.config.max_lease_s:
            self._emit(m.Offer(msg.request_id, msg.round, [], [], True,
                               f"lease of {lease_s:g} s exceeds this producer's "
                               f"max_lease_s={ctx.config.max_lease_s:g}"))
            return
        lot = ctx.lot
        p = lot.parcel(msg.request_id)
        if p.lease is not None:
            self._emit(m.Offer(msg.request_id, msg.round, [], [], True,
                               f"request is leased to another fetch (round {p.lease.round}) until it is released"))
            return
        # offer_until: later offers would arrive too close to the consumer's deadline to be read in time.
        # offer_until: later offers would arrive too close to the consumer's deadline to be read in time; a round
        # that asks our engine waits for its answer no longer than a lookup would.
        offer_s = min(ctx.config.fetch_timeout_s, 0.9 * lease_s)
        if msg.ask:
            offer_s = min(offer_s, ctx.config.lookup_timeout_s)
        lease = Lease(msg.round, self, dict.fromkeys(msg.keys), now + offer_s,
                      now + lease_s * (1 + LEASE_DRIFT) + LEASE_MARGIN_S, more=msg.more, parts=1,
                      ask=Ask.ASKED if msg.ask else Ask.NONE)
        lot.bind(p, lease)
        self._parcels.add(p)
        self._fetch_open = lease if msg.more else None
        self._offer(p)
        if not msg.more:
            self._ask(p, lease)

    def _on_fetch_part(self, msg: m.Fetch) -> None:
        """A later part of a round's Fetch: its keys join the lease (the hold still counts from part 0)."""
        p = self.ctx.lot.parcels.get(msg.request_id)
        lease = p.lease if p is not None else None
        if lease is None or lease.owner is not self or lease.round != msg.round or lease.phase is LeasePhase.HELD:
            # Part 0 was refused, or the round's offers already ended (fetch_timeout_s) or its lease did: the
            # consumer has (or will have) its final Offer; these keys were never offered.  Nothing to add to.
            self.counters.stale_fetch_parts += 1
            return
        if not lease.more or msg.part != lease.parts:
            raise RemoteProtocolError(f"fetch {msg.request_id!r} round {msg.round}: part {msg.part} out of order")
        if lease.parts * m.MAX_KEYS + len(msg.keys) > MAX_JOB_KEYS:
            raise RemoteProtocolError(f"fetch {msg.request_id!r} of more than {MAX_JOB_KEYS} keys")
        pending, offered = lease.pending, lease.offered
        for k in msg.keys:
            if k in pending or k in offered:
                raise RemoteProtocolError(f"fetch {msg.request_id!r}: duplicate keys")
            pending[k] = None
        lease.parts += 1
        lease.more = msg.more
        self._offer(p, msg.keys)
        if not msg.more:
            self._ask(p, lease)

    def _ask(self, p: Parcel, lease: Lease) -> None:
        """An asking round's Fetch is complete: ask our engine for the keys not parked yet (what was, is offered)."""
        if lease.ask is not Ask.ASKED or lease.phase is not LeasePhase.OFFERING:
            return
        if not lease.pending or len(self._serving) + len(self._asks) >= self.ctx.config.max_inbound_lookups:
            # all offered already, or too many lookups in flight: the engine is not asked, the offers end now
            lease.ask = Ask.ANSWERED if not lease.pending else Ask.REFUSED
            self._offer(p)
            return
        ask_id = m.ask_id(lease.round)
        if ask_id in self._asks:
            raise RemoteProtocolError(f"fetch {p.request_id!r}: round {lease.round} asked again while it is open")
        # Invariant 7: asking adds no writer.  The engine pins its hits (store jobs) before they are parked; they are
        # offered under this lease like any parked row, read only into the consumer's own rows, and reported only at
        # the Release or the lease's end.  Invariant 8: up to MAX_JOB_KEYS keys (one ring message of the adapter's).
        keys = tuple(lease.pending)
        self._asks[ask_id] = AskedRound(p, lease, keys)
        self.ctx.reporter.emit(ServeLookup(self.peer_id, ask_id, p.request_id, keys))

    def pump(self, p: Parcel, new_keys: list[bytes] | None = None) -> list[Action]:
        """New stores (``new_keys``: only those are looked at, so a request fed one key at a time costs
        linear time), or the request finished (``None``): offer what can be offered."""
        self._offer(p, new_keys)
        return self._take()

    def _offer(self, p: Parcel, candidates: list[bytes] | None = None) -> None:
        lease = p.lease
        if lease is None or lease.owner is not self or lease.phase is not LeasePhase.OFFERING:
            return
        pending, parked = lease.pending, p.rows
        keys = ([k for k in pending if k in parked] if candidates is None
                else [k for k in candidates if k in pending and k in parked])
        rows = list(map(parked.__getitem__, keys))
        now = self.ctx.clock()
        if keys:
            self.ctx.lot.offering_starts(lease, now)
            if len(keys) == len(pending):  # keys are distinct members of pending: all of it
                pending.clear()
            else:
                for k in keys:
                    del pending[k]
            lease.offered.update(zip(keys, rows))
        # While Fetch parts are still coming, "nothing pending" or "request finished" says nothing about their keys;
        # nor does an earlier end of the request while our engine is still asked for this round's.
        ended = lease.ask in (Ask.ANSWERED, Ask.REFUSED, Ask.RESET) or (lease.ask is Ask.NONE and p.finished)
        final = (not lease.more and (not lease.pending or ended)) or now >= lease.offer_until
        if not keys and not final:
            return
        reason = self._end_offers(p, lease) if final else ""
        for part, part_keys, more in parts(keys):  # pieces of MAX_KEYS; only the last one may be final
            i = part * m.MAX_KEYS
            self._emit(m.Offer(p.request_id, lease.round, part_keys, rows[i:i + m.MAX_KEYS], final and not more,
                               "" if more else reason))

    def _end_offers(self, p: Parcel, lease: Lease) -> str:
        """The final Offer goes out now: the lease holds what it offered.  Returns why keys were not offered."""
        reason = ""
        if lease.pending:
            reason = (m.NOT_HELD if lease.ask is Ask.ANSWERED
                      else m.TOO_MANY_LOOKUPS if lease.ask is Ask.REFUSED
                      else "the producer's vLLM reset its cache before its engine answered" if lease.ask is Ask.RESET
                      else "request finished before every key was stored" if p.finished and lease.ask is Ask.NONE
                      else m.FETCH_TIMED_OUT)
            log.info("fetch %r round %d from %s: %d of %d keys offered: %s", p.request_id, lease.round,
                     self.peer_id, len(lease.offered), len(lease.offered) + len(lease.pending), reason)
            lease.pending.clear()
        lease.phase = move(LEASE_MOVES, lease.phase, LeaseEvent.FINAL_OFFER)
        lease.more = False  # parts still to come are ignored: the consumer has its final offer
        asked = self._asks.get(m.ask_id(lease.round))
        if asked is not None and asked.lease is lease:
            # The offers end before the engine answered (offer_until, a reset): what it pins for this round later
            # is never offered, so a tombstone (as the consumer's Done leaves) ends those stores at once.
            self.ctx.lot.consumer_done(p.request_id)
        return reason

    # ------------------------------------------------------------ the consumer's end of it
    def _on_done(self, msg: m.Done) -> None:
        self.ctx.lot.consumer_done(msg.request_id)

    def _on_release(self, msg: m.Release) -> None:
        p = self.ctx.lot.parcels.get(msg.request_id)
        lease = p.lease if p is not None else None
        if lease is None or lease.owner is not self or lease.round != msg.round:
            self.counters.stale_releases += 1  # the lease ran out first
            return
        if not lease.offered.keys() >= set(msg.read):
            raise RemoteProtocolError(f"release for {msg.request_id!r} names keys that were not offered")
        lease.read += msg.read
        if len(lease.read) > len(lease.offered):
            raise RemoteProtocolError(f"release for {msg.request_id!r} names more keys than were offered")
        if msg.more:
            return  # the rows stay pinned until the last part
        self._parcels.discard(p)
        self.ctx.lot.release(p, lease.read, f"consumer {self.peer_id} did not read it")

    def _close_server(self, reason: str) -> None:
        """The session closed: forget the peer's lookups; hand leased parcels to their lease's end."""
        self._inbound.clear()
        self._serving.clear()
        self._asks.clear()  # a late answer finds nothing (answer_lookup); the engine's stores end with the parcel
        lot = self.ctx.lot
        for p in list(self._parcels):
            if p.lease is not None and p.lease.owner is self:
                asking = p.lease.ask is Ask.ASKED
                lot.abandon(p, f"consumer {self.peer_id} lost: {reason}")
                if asking and p.lease is None:
                    # Nothing was offered, and the engine may still pin and park for this round: leave a tombstone
                    # (as the consumer's Done does) so those late stores end at once instead of at park_timeout_s.
                    lot.consumer_done(p.request_id)
        self._parcels.clear()

    # ------------------------------------------------------------ time
    def _tick_leases(self, now: float) -> None:
        """Rounds whose offers must end (offer_until); parcels the lot released (their lease ran out) forgotten."""
        for p in list(self._parcels):
            if p.lease is None or p.lease.owner is not self:
                self._parcels.discard(p)  # released by the lot (lease ran out)
            elif p.lease.phase is LeasePhase.OFFERING and now >= p.lease.offer_until:
                self._offer(p)
        for ask_id, asked in list(self._asks.items()):  # at most max_inbound_lookups
            if asked.parcel.lease is not asked.lease or asked.lease.phase is not LeasePhase.OFFERING:
                del self._asks[ask_id]  # the round ended first (offer_until, its lease): a late answer finds nothing

    @property
    def leases(self) -> int:
        return len(self._parcels)

    def serving(self) -> dict[int, int]:
        """The peer's lookups waiting for ``answer_lookup``: lookup id -> how many keys it asked (a copy)."""
        return dict(self._serving)

    def asking(self) -> dict[int, ServeLookup]:
        """The asking rounds waiting for ``answer_lookup``: ask id -> what our engine was asked (a copy)."""
        return {i: ServeLookup(self.peer_id, i, a.parcel.request_id, a.keys) for i, a in self._asks.items()}
