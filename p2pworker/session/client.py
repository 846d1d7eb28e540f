"""A session's client role (the consumer): loads pulled from the peer's parked rows, and lookups we ask.

Load phases (:data:`LOAD_MOVES` is the table, :func:`~p2pworker.session.moves.move` the only way a phase
changes)::

    WAITING --final Offer--> FINAL --no read pending--> REPORTED
    WAITING | FINAL --deadline, no handshake, session closed, cancelled--> SETTLING (CancelReads)
    SETTLING --no read pending--> REPORTED
    SETTLING --settle_timeout_s, reads still posted--> STUCK (Abort)  --they settle after all--> REPORTED

Where the adapter's vLLM takes a failed load before its reads settle (``SessionContext.deferred_release``, vLLM
0.34), a load that can no longer succeed is reported at once, *unsettled*, and settled later::

    SETTLING --reads still posted--> DEFERRED (JobDone settled=False)
    FINAL --the final offer said some keys are not held, and every read still posted is of keys past the first
            missing one (CancelReads: vLLM recomputes from that key, so they are useless)--> DEFERRED
    DEFERRED --no read pending--> REPORTED (JobSettled)
    DEFERRED --settle_timeout_s, reads still posted--> STUCK (Abort)

A read counts only while its load is WAITING or FINAL and before the deadline; a load is reported only once no read
it posted is pending (invariant 7), so a WAITING load is never reported, and a STUCK one waits for its reads (the
worker exits on the Abort first: its death ends them).  An unsettled report fails every key whose read had not
landed, and vLLM keeps those rows out of its free pool until the JobSettled: no byte lands in a row vLLM can reuse.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

from p2pworker.errors import RemoteProtocolError
from p2pworker.limits import MAX_JOB_KEYS
from p2pworker.protocol import messages as m
from p2pworker.session.core import Abort, CancelReads, PostRead, SessionCore, State, parts
from p2pworker.session.moves import move
from p2pworker.session.reporter import JobKind


# How a load or lookup that never reached its peer says so (the adapter reads these prefixes: such a source is down,
# and its pulls recompute at once for a while instead of waiting for it again; vllm_adapter/hints.py)
NO_HANDSHAKE = "no handshake with the peer"
SESSION_CLOSED = "session to "
UNREACHABLE = "peer unreachable: "  # the worker's: no usable link to the address (down, refused, in backoff)
PEER_DOWN = (NO_HANDSHAKE, SESSION_CLOSED, UNREACHABLE)
# ... and one the peer reached but could not serve in time or at all: with PEER_DOWN, the failures that are the peer's
# (not ours, not the request's: a reset, our worker stopping, a request leased to another fetch blame nobody)
LOAD_TIMED_OUT = "timed out after"
LOOKUP_TIMED_OUT = "lookup timed out after"
PEER_FAILED = PEER_DOWN + (LOAD_TIMED_OUT, LOOKUP_TIMED_OUT, m.TOO_MANY_LOOKUPS, m.FETCH_TIMED_OUT)


class LoadPhase(enum.Enum):
    WAITING = "waiting"  # offers arrive, reads are posted
    FINAL = "final"  # the final offer came: reads still count, nothing more will be offered
    SETTLING = "settling"  # past the deadline or the session closed: reads cancelled, waiting for them
    DEFERRED = "deferred"  # reported failed, unsettled: cancelled reads still posted (deferred release, vLLM 0.34)
    STUCK = "stuck"  # cancelled reads outlived settle_timeout_s: the worker was told to exit (Abort)
    REPORTED = "reported"  # the job was reported (and settled): the load is forgotten


class LoadEvent(enum.Enum):
    FINAL_OFFER = "final_offer"
    DEADLINE = "deadline"
    NO_HANDSHAKE = "no_handshake"  # the Fetch still waits for the first handshake after handshake_timeout_s
    CLOSED = "closed"
    CANCELLED = "cancelled"  # the worker is shutting down: the link still works, so the Release can go out
    SETTLE_TIMEOUT = "settle_timeout"
    REPORTED_EARLY = "reported_early"  # it cannot succeed and only cancelled reads are pending: reported unsettled
    SETTLED = "settled"  # no read of it is pending, and it is final or settling: report it (or settle it)


_W, _F, _S, _X, _D = LoadPhase.WAITING, LoadPhase.FINAL, LoadPhase.SETTLING, LoadPhase.STUCK, LoadPhase.DEFERRED
LOAD_MOVES: dict[tuple[LoadPhase, LoadEvent], LoadPhase] = {
    (_W, LoadEvent.FINAL_OFFER): _F,
    (_F, LoadEvent.FINAL_OFFER): _F,  # a second final offer changes nothing but the reason
    (_S, LoadEvent.FINAL_OFFER): _S,  # settling: what is offered now is not read
    (_X, LoadEvent.FINAL_OFFER): _X,
    (_W, LoadEvent.DEADLINE): _S,
    (_F, LoadEvent.DEADLINE): _S,
    (_W, LoadEvent.NO_HANDSHAKE): _S,  # only a load not offered anything yet waits for the handshake
    (_W, LoadEvent.CLOSED): _S,
    (_F, LoadEvent.CLOSED): _S,
    (_S, LoadEvent.CLOSED): _S,
    (_X, LoadEvent.CLOSED): _X,
    (_W, LoadEvent.CANCELLED): _S,
    (_F, LoadEvent.CANCELLED): _S,
    (_S, LoadEvent.CANCELLED): _S,
    (_X, LoadEvent.CANCELLED): _X,
    (_S, LoadEvent.SETTLE_TIMEOUT): _X,
    (_F, LoadEvent.SETTLED): LoadPhase.REPORTED,
    (_S, LoadEvent.SETTLED): LoadPhase.REPORTED,
    (_X, LoadEvent.SETTLED): LoadPhase.REPORTED,  # only where the worker did not exit (tests)
    (_S, LoadEvent.REPORTED_EARLY): _D,
    (_F, LoadEvent.REPORTED_EARLY): _D,  # short: what is still read lies past the first missing key
    (_D, LoadEvent.FINAL_OFFER): _D,
    (_D, LoadEvent.CLOSED): _D,
    (_D, LoadEvent.CANCELLED): _D,
    (_D, LoadEvent.SETTLE_TIMEOUT): _X,
    (_D, LoadEvent.SETTLED): LoadPhase.REPORTED,
}
_READING = frozenset({_W, _F})  # reads posted in these phases count (before the deadline)


@dataclass(eq=False)
class _Load:
    job_id: int
    request_id: str
    round: int
    rows: dict[bytes, int]  # asked key -> our granted row
    deadline: float  # the lease, on our clock: no read counts at or after it
    offered: set[bytes] = field(default_factory=set)
    reads: dict[int, list[bytes]] = field(default_factory=dict)  # pending read id -> keys
    read_ok: list[bytes] = field(default_factory=list)
    reason: str = ""
    phase: LoadPhase = LoadPhase.WAITING
    settle_by: float = math.inf
    fetches: list[m.Fetch] = field(default_factory=list)  # while they wait for the handshake: withdrawable
    handshake_by: float = math.inf  # a Fetch still queued then is withdrawn: whoever answers later on that
    # address (a restarted producer) never heard of the request and would make us wait out its fetch_timeout_s
    cancelled: set[int] = field(default_factory=set)  # pending read ids cancelled as useless (past a missing key)
    early: bool = False  # reported unsettled: its JobSettled is still owed


@dataclass(eq=False)
class _Asked:
    """A lookup we sent: its answers arrive in parts, in the order of the keys."""

    deadline: float
    n: int
    present: list[bool] = field(default_factory=list)


class ClientRole(SessionCore):
    """The consumer's half of a session: ``load``, ``lookup``, ``done``, the peer's Offers and LookupResps, our
    read results, and the loads' and lookups' time-outs."""

    def __init__(self, ctx, **kw) -> None:
        super().__init__(ctx, **kw)
        self._loads: dict[int, _Load] = {}  # round -> load
        self._reads: dict[int, _Load] = {}  # pending read id -> its load
        self._next_read = 0
        # Late offers (they crossed our Release, or came after our deadline) are ignored, not errors: any round at
        # or below the highest one this session issued and no longer open.  Rounds only grow (worker-wide), so one
        # number replaces a set of finished rounds (a 10,000-entry dict cost ~0.9 MB per session in the soak).
        self._max_round = 0
        self._lookups: dict[int, _Asked] = {}  # lookups we sent, not answered in full yet
        self._withdrawn: set[int] = set()  # rounds whose queued Fetch parts must not be sent (see _report)
        self._aborted = False  # an Abort went out: one is enough (the worker exits on it)

    # ------------------------------------------------------------ commands
    def _refusal(self, keys: list[bytes], rows: list[int], granted: dict[bytes, int]) -> str:
        """Why a load cannot start here ("" when it can)."""
        cfg = self.ctx.config
        if self.state is State.CLOSED:
            return f"{SESSION_CLOSED}{self.peer_id} closed: {self.close_reason}"
        if len(keys) > MAX_JOB_KEYS:
            return f"load of {len(keys)} keys exceeds the hard limit of {MAX_JOB_KEYS} keys per job (p2pworker.limits)"
        if not keys or len(keys) != len(rows) or len(granted) != len(keys) or len(set(granted.values())) != len(keys):
            return f"bad load: {len(keys)} keys, {len(rows)} rows (no duplicates allowed)"
        if not 1 <= math.ceil(cfg.load_timeout_s * 1000) <= m.MAX_LEASE_MS:
            return (f"load_timeout_s={cfg.load_timeout_s:g} is outside 0.001..{m.MAX_LEASE_MS // 1000} s "
                    f"(a lease no peer grants)")
        if self._queue_full():
            return f"{len(self._queue)} messages already wait for the handshake with {self.peer_id or 'the peer'}"
        return ""

    def load(self, job_id: int, request_id: str, keys: list[bytes], rows: list[int], *, ask: bool = False):
        """Pull ``keys`` of ``request_id`` from the peer into our granted ``rows``.  ``ask``: nothing was parked for
        us in advance; the peer asks its engine for the keys when the Fetch is in (protocol ``Fetch.ask``)."""
        ctx = self.ctx
        now = ctx.clock()
        ctx.reporter.open(job_id, JobKind.LOAD, now)
        granted = dict(zip(keys, map(int, rows)))
        refusal = self._refusal(keys, rows, granted)
        if refusal:
            ctx.reporter.done(job_id, False, (), 0, now, refusal)
            return []
        lease_s = ctx.config.load_timeout_s
        lease_ms = math.ceil(lease_s * 1000)
        rnd = self._max_round = next(ctx.rounds)
        # The deadline is taken BEFORE the Fetch is sent (or queued): the producer's hold starts later.
        load = self._loads[rnd] = _Load(job_id, request_id, rnd, granted, now + lease_s,
                                        handshake_by=now + ctx.config.handshake_timeout_s)
        load.fetches = [m.Fetch(request_id, rnd, part_keys, lease_ms, part, more, ask)
                        for part, part_keys, more in parts(list(keys))]
        for fetch in load.fetches:
            self._send(fetch)
        if self.state is State.ACTIVE:
            load.fetches = []  # sent: nothing to withdraw
        return self._take()

    def done(self, request_id: str):
        """Our request ``request_id`` ended: tell the producer it may release what we did not fetch (Done).  Queued
        while the handshake is pending; dropped when the session is closed or its queue is full (the producer's
        park_timeout_s still ends those rows: this only makes it sooner)."""
        if not self._queue_full():
            self._send(m.Done(request_id))
        return self._take()

    def lookup(self, lookup_id: int, keys: list[bytes], request_id: str):
        ctx = self.ctx
        ctx.reporter.open_lookup(lookup_id)
        if self.state is State.CLOSED or self._queue_full() or len(keys) > MAX_JOB_KEYS:
            ctx.reporter.lookup_done(lookup_id, None, f"session closed: {self.close_reason}" if self.state is
                                     State.CLOSED else "too many messages wait for the handshake"
                                     if self._queue_full() else f"lookup of {len(keys)} keys exceeds the hard "
                                     f"limit of {MAX_JOB_KEYS} (p2pworker.limits)")
            return []
        self._lookups[lookup_id] = _Asked(ctx.clock() + ctx.config.lookup_timeout_s, len(keys))
        for part, part_keys, more in parts(list(keys)):
            self._send(m.Lookup(lookup_id, request_id, part_keys, part, more))
        return self._take()

    def cancel_loads(self, reason: str):
        """Shutdown, first step: cancel every load's reads; each is reported (and its Release sent on the
        still-open link) once its reads settled."""
        for load in list(self._loads.values()):
            self._settle(load, LoadEvent.CANCELLED, reason)
        return self._take()

    # ------------------------------------------------------------ from the peer
    def _check_offer(self, load: _Load, msg: m.Offer) -> set[bytes]:
        """The offer's keys, once they proved new keys of ``load`` in rows the peer has."""
        keys, rows = msg.keys, msg.rows
        if len(keys) != len(rows):  # decode() refuses such a frame already; a row for every key, whoever built it
            raise RemoteProtocolError(f"offer {msg.request_id!r}: {len(keys)} keys but {len(rows)} rows")
        # Checked as sets (C loops: the per-key loop was the consumer's largest Python cost per request).
        new = set(keys)
        if not load.rows.keys() >= new:
            raise RemoteProtocolError(f"offer for {msg.request_id!r} names a key that was not requested")
        if len(new) != len(keys) or not load.offered.isdisjoint(new):
            raise RemoteProtocolError(f"offer for {msg.request_id!r} names a key twice")
        nb = self.peer_info.num_blocks
        top = max(rows, default=0)
        if top >= nb:
            raise RemoteProtocolError(f"offer for {msg.request_id!r}: row {top} outside the peer's 0..{nb - 1}")
        return new

    def _on_offer(self, msg: m.Offer) -> None:
        load = self._loads.get(msg.round)
        if load is None and 0 < msg.round <= self._max_round:
            self.counters.late_offers += 1  # crossed our Release, or came after our deadline
            return
        if load is None or load.request_id != msg.request_id:
            raise RemoteProtocolError(f"offer for {msg.request_id!r} round {msg.round} that was never fetched")
        load.offered |= self._check_offer(load, msg)
        if msg.final:
            load.phase = move(LOAD_MOVES, load.phase, LoadEvent.FINAL_OFFER)
            load.reason = msg.reason
        if load.phase not in _READING:
            return  # settling: post nothing new
        if msg.keys:
            self._next_read += 1
            rid = self._next_read
            load.reads[rid] = list(msg.keys)
            self._reads[rid] = load
            self._out.append(PostRead(rid, list(map(load.rows.__getitem__, msg.keys)), list(msg.rows)))
        if msg.final and self.ctx.deferred_release:
            self._cancel_past_gap(load)
        self._maybe_report(load)

    def _cancel_past_gap(self, load: _Load) -> None:
        """A final offer that left keys out: vLLM recomputes from the first key not loaded, so reads of keys past it
        are useless.  Cancel those (their rows' release is deferred, not waited for)."""
        missing = next((k for k in load.rows if k not in load.offered), None)
        if missing is None:
            return
        keys = list(load.rows)
        past = set(keys[keys.index(missing) + 1:])
        useless = tuple(r for r, ks in load.reads.items() if r not in load.cancelled and past.issuperset(ks))
        if useless:
            load.cancelled.update(useless)
            self._out.append(CancelReads(useless))

    def _on_lookup_resp(self, msg: m.LookupResp) -> None:
        asked = self._lookups.get(msg.lookup_id)
        if asked is None:
            self.counters.late_offers += 1
            return
        asked.present += msg.present
        if len(asked.present) > asked.n or (not msg.more and len(asked.present) != asked.n):
            # left in _lookups: the close this raises reports it failed
            raise RemoteProtocolError(f"lookup_resp {msg.lookup_id}: {len(asked.present)} answers for {asked.n} keys")
        if not msg.more:
            del self._lookups[msg.lookup_id]
            self.ctx.reporter.lookup_done(msg.lookup_id, asked.present)

    # ------------------------------------------------------------ from the data plane
    def on_read_result(self, read_id: int, ok: bool, reason: str = ""):
        """The data plane settled read ``read_id``: nothing of it can land any more."""
        load = self._reads.pop(read_id, None)
        if load is None:
            self.counters.late_reads += 1
            return []
        keys = load.reads.pop(read_id)
        load.cancelled.discard(read_id)
        now = self.ctx.clock()
        if ok and now < load.deadline and load.phase in _READING:
            load.read_ok.extend(keys)
        elif ok:
            # Seen done at or after our deadline: the producer may have released the rows before the copy
            # ran (a SIGSTOP between post and copy, say).  Never count it.
            self.counters.late_reads += 1
            load.reason = self._worse(load.reason, "a read completed after the load's deadline and was discarded")
        else:
            load.reason = self._worse(load.reason, f"read from {self.peer_id} failed: {reason}")
        self._maybe_report(load)
        return self._take()

    @staticmethod
    def _worse(reason: str, failure: str) -> str:
        """A read that failed or came late makes the load a failure even when the peer also said it lacks some keys
        (NOT_HELD alone makes it short: the adapter then learns those keys as lacked, which a failure must not)."""
        return failure if not reason or reason == m.NOT_HELD else reason

    # ------------------------------------------------------------ a load's end
    def _maybe_report(self, load: _Load) -> None:
        if load.phase is LoadPhase.WAITING:
            return
        if not load.reads:
            self._report(load)
        elif (self.ctx.deferred_release and not load.early and load.phase in (_F, _S)
              and load.cancelled.issuperset(load.reads)):
            self._report_early(load)

    def _failure_reason(self, load: _Load) -> str:
        n = len(load.rows)
        return load.reason or f"{n - len(load.read_ok)} of {n} keys did not arrive"

    def _report_early(self, load: _Load) -> None:
        """The load cannot succeed and only cancelled reads are pending: report it failed now, unsettled.  vLLM
        fails every key not read yet and keeps their rows out of its free pool until the JobSettled.  Invariant 7:
        those reads (this process's, into our region) may still land, only in rows vLLM cannot reuse yet; _report
        sends the JobSettled once the last one settled, or never (Abort: the adapter waits for the process's end)."""
        ctx = self.ctx
        load.phase = move(LOAD_MOVES, load.phase, LoadEvent.REPORTED_EARLY)
        load.early = True
        if load.settle_by == math.inf:  # from FINAL: the cancelled reads get the same bound as any cancellation
            load.settle_by = ctx.clock() + ctx.config.settle_timeout_s
        ctx.reporter.done(load.job_id, False, load.read_ok, len(load.read_ok) * ctx.data_info.block_bytes,
                          ctx.clock(), self._failure_reason(load), settled=False)

    def _report(self, load: _Load) -> None:
        """Report the job once (or settle one reported early), then release the producer's rows (the job is over:
        no read of it can run)."""
        ctx = self.ctx
        n = len(load.rows)
        ok = len(load.read_ok) == n and load.phase is LoadPhase.FINAL
        load.phase = move(LOAD_MOVES, load.phase, LoadEvent.SETTLED)
        del self._loads[load.round]
        if load.early:
            ctx.reporter.settled(load.job_id)
        else:
            ctx.reporter.done(load.job_id, ok, load.read_ok, len(load.read_ok) * ctx.data_info.block_bytes,
                              ctx.clock(), "" if ok else self._failure_reason(load))
        if self.state is not State.ACTIVE and load.fetches:
            self._withdrawn.add(load.round)  # never sent: nothing leased, nothing to release (O(1): skipped later)
            return
        for _, part_keys, more in parts(load.read_ok):
            self._send(m.Release(load.request_id, load.round, part_keys, more))

    def _settle(self, load: _Load, event: LoadEvent, reason: str) -> None:
        """Deadline, no handshake, close or shutdown: cancel the load's reads; report when none is pending."""
        load.phase = move(LOAD_MOVES, load.phase, event)
        if load.settle_by == math.inf:  # the first settle names the reason (a load reported early keeps its own)
            load.settle_by = self.ctx.clock() + self.ctx.config.settle_timeout_s
            load.reason = reason
        fresh = tuple(r for r in load.reads if r not in load.cancelled)
        if fresh:
            load.cancelled.update(fresh)
            self._out.append(CancelReads(fresh))
        self._maybe_report(load)

    def _stuck(self, load: _Load) -> Abort:
        """Reads still posted settle_timeout_s after their cancellation: NIXL cannot abort a posted READ, so
        reporting the load now would let the bytes land in rows vLLM reused.  Never report it: ask the worker to
        exit (its death ends every read it initiated); the adapter then fails the jobs."""
        load.phase = move(LOAD_MOVES, load.phase, LoadEvent.SETTLE_TIMEOUT)
        self.counters.unsettled_reads += len(load.reads)
        self._aborted = True
        return Abort(f"{len(load.reads)} read(s) from {self.peer_id} did not settle within "
                     f"{self.ctx.config.settle_timeout_s:g} s of their cancellation ({load.reason})")

    def _close_client(self, why: str) -> None:
        """The session closed: settle every load, fail every lookup still unanswered."""
        for load in list(self._loads.values()):
            self._settle(load, LoadEvent.CLOSED, why)
        for lookup_id in list(self._lookups):
            self.ctx.reporter.lookup_done(lookup_id, None, why)
        self._lookups.clear()

    # ------------------------------------------------------------ time
    def _tick_loads(self, now: float) -> Abort | None:
        """Loads past their deadline or the handshake's, then past settling; an Abort when reads will not settle."""
        cfg = self.ctx.config
        abort = None
        for load in list(self._loads.values()):
            if load.phase in _READING and now >= load.deadline:
                self._settle(load, LoadEvent.DEADLINE,
                             f"{LOAD_TIMED_OUT} {cfg.load_timeout_s:g} s waiting for {self.peer_id}")
            elif (load.phase is LoadPhase.WAITING and now >= load.handshake_by
                    and self.state in (State.IDLE, State.HELLO_SENT)):
                self._settle(load, LoadEvent.NO_HANDSHAKE,
                             f"{NO_HANDSHAKE} within {cfg.handshake_timeout_s:g} s")
            elif load.phase in (_S, _D) and now >= load.settle_by and not self._aborted:
                abort = self._stuck(load)
        return abort

    def _tick_lookups(self, now: float) -> None:
        for lookup_id, asked in list(self._lookups.items()):
            if now >= asked.deadline:
                del self._lookups[lookup_id]
                self.ctx.reporter.lookup_done(lookup_id, None,
                                              f"{LOOKUP_TIMED_OUT} {self.ctx.config.lookup_timeout_s:g} s")

    @property
    def open_loads(self) -> int:
        return len(self._loads)

    @property
    def last_round(self) -> int:
        """The highest round this session issued (rounds grow worker-wide)."""
        return self._max_round

    def open_rounds(self) -> frozenset[int]:
        """The rounds of this session's loads not reported yet."""
        return frozenset(self._loads)

    def load_phase(self, round_: int) -> LoadPhase | None:
        """Where this session's load of ``round_`` stands; None once it is reported (or was never ours)."""
        load = self._loads.get(round_)
        return None if load is None else load.phase
