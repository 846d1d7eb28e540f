"""Symmetric lookups, both sides.

``AskedLookups`` (the asker, ``remote_kv_source``): a request's path is chosen at its first lookup
(:class:`~vllm_adapter.hints.PullPath`).  ONE_TRIP: every lookup answers HIT at once and the load asks the source.
ASK_FIRST: the lookups are asked of the peer key by key, batched into one LookupKeys per request and peer at the
step's end or the next poll, whichever comes first; each answers RETRY until the peer's answer arrives, then HIT or
MISS.  Kept per kv_request_id, so a finished request is forgotten in time linear in its own keys.

``PeerLookups`` (the source): peers' lookups are answered in ``serve_external_requests``: vLLM is asked
(``parent.lookup``), the hits pinned (``parent.create_store_job``) and parked under the asker's ``kv_request_id``,
which its ``submit_load`` then fetches like a PD load.
"""

from __future__ import annotations

import logging

from vllm.v1.kv_offload.base import LookupResult, ReqContext

from p2pworker import api
from vllm_adapter.hints import PullPath, SourceHints
from vllm_adapter.jobs import JobBook, JobKind
from vllm_adapter.metrics import Counts
from vllm_adapter.outbox import Outbox

log = logging.getLogger("vllm_adapter.tier")


class AskedLookups:
    def __init__(self, outbox: Outbox, hints: SourceHints, counts: Counts, *, one_trip: bool = True):
        self._outbox, self._hints, self._counts, self._one_trip = outbox, hints, counts, one_trip
        # by (address, kv_request_id): one id may name requests at two peers (an orchestrator's reused id), whose
        # answers say nothing of each other
        self._answers: dict[tuple[str, str], dict[bytes, bool]] = {}  # key -> the peer holds it
        self._asked: dict[tuple[str, str], set[bytes]] = {}  # keys asked, no answer yet (while the request lives)
        self._asking: dict[tuple[str, str], list[bytes]] = {}  # (address, kv_request_id) -> keys to ask
        self._lookups: dict[int, tuple[str, str, list[bytes]]] = {}  # lookup id -> (address, kv_request_id, keys)
        self._next_lookup = 1

    @property
    def pending(self) -> bool:
        """Keys to ask, or asked and not answered."""
        return bool(self._asking or self._lookups)

    @property
    def unsent(self) -> bool:
        """Keys vLLM asked about that are not on their way to the worker yet."""
        return bool(self._asking)

    def path(self, req_context: ReqContext, address: str, key) -> PullPath:
        """The request's path, chosen at its first lookup and kept in its own context (not by kv_request_id: two live
        requests may share one, and vLLM 0.33 ends one before it submits the other's loads)."""
        path = req_context.get_state(PullPath)
        if path is None:
            path = self._hints.path(address, bytes(key)) if self._one_trip else PullPath.ASK_FIRST
            req_context.set_state(path)
            if path is PullPath.ONE_TRIP:
                self._counts.pulls_one_trip += 1
            else:
                self._counts.pulls_ask_first += 1
        return path

    def lookup(self, address: str, rid: str, key) -> LookupResult:
        """The two-step path: the peer's answer for ``key``; RETRY while it is asked (batched at the step's end or
        the next poll)."""
        k = bytes(key)
        answers = self._answers.get((address, rid))
        answer = answers.get(k) if answers is not None else None
        if answer is None:
            asked = self._asked.get((address, rid))
            if asked is None:
                asked = self._asked[(address, rid)] = set()
            if k not in asked:
                asked.add(k)
                self._asking.setdefault((address, rid), []).append(k)
            return LookupResult.RETRY  # asked (batched at the step's end); HIT or MISS once the peer answers
        return LookupResult.HIT if answer else LookupResult.MISS

    def forget(self, address: str, rid: str) -> None:
        """The last request of ``rid`` at ``address`` finished."""
        self._answers.pop((address, rid), None)
        self._asked.pop((address, rid), None)

    def send_asks(self) -> None:
        for (address, rid), asking in list(self._asking.items()):  # one batched lookup per request and peer
            del self._asking[(address, rid)]
            for i in range(0, len(asking), api.MAX_JOB_KEYS):  # more than the hard limit: several lookups
                keys = asking[i:i + api.MAX_JOB_KEYS]
                lookup_id = self._next_lookup
                self._next_lookup += 1
                self._lookups[lookup_id] = (address, rid, keys)
                if not self._outbox.send(api.LookupKeys(lookup_id, address, rid, keys)):
                    del self._lookups[lookup_id]
                    self._answer(address, rid, keys, None)

    def on_result(self, ev: api.LookupResult) -> None:
        address, rid, keys = self._lookups.pop(ev.lookup_id, ("", "", []))
        self._answer(address, rid, keys, ev.present, ev.reason)

    def miss_all(self) -> None:
        """The worker is gone: every lookup asked or still to ask answers MISS."""
        for address, rid, keys in self._lookups.values():
            self._answer(address, rid, keys, None)
        self._lookups.clear()
        for (address, rid), keys in self._asking.items():  # asked, not sent yet: MISS as well (a tier that stops
            self._answer(address, rid, keys, None)        # restarting would otherwise hold them, and vLLM step forever)
        self._asking.clear()

    def refuse(self, cmd: api.Command) -> bool:
        """A LookupKeys the ring cannot carry: MISS now.  False: not an open lookup's command."""
        if isinstance(cmd, api.LookupKeys) and cmd.lookup_id in self._lookups:
            address, rid, keys = self._lookups.pop(cmd.lookup_id)
            self._answer(address, rid, keys, None)
            return True
        return False

    def _answer(self, address: str, rid: str, keys: list[bytes], present: list[bool] | None,
                why: str = "") -> None:
        """Record a peer's answer (None: it could not answer, so MISS).  Late answers for a finished request
        are dropped (nothing would ever forget them)."""
        if present is not None and len(present) == len(keys):  # what the peer said it holds, for later requests
            self._hints.answered(address)
            self._hints.held(address, [k for k, p in zip(keys, present) if p])
            self._hints.lacked(address, [k for k, p in zip(keys, present) if not p])
        elif present is None and address:  # it could not answer: if the peer failed it, asked first a while
            self._hints.failed(address, why)
        asked = self._asked.get((address, rid))
        if asked is None:
            return
        answers = self._answers.setdefault((address, rid), {})
        if present is not None and len(present) != len(keys):
            # one flag per key asked, or the answer means nothing: MISS for all (zip would drop the tail, and those
            # keys would answer RETRY forever, never asked again)
            log.error("lookup answer for %s has %d flags for %d keys: MISS for all", rid, len(present), len(keys))
            present = None
        for k, p in zip(keys, present if present is not None else [False] * len(keys)):
            answers[k] = bool(p)
            asked.discard(k)


class PeerLookups:
    def __init__(self, book: JobBook, outbox: Outbox):
        self.queue: list[api.PeerLookup] = []
        self._book, self._outbox = book, outbox

    @property
    def pending(self) -> bool:
        return bool(self.queue)

    def serve(self, parent, stopping: bool) -> None:
        """Answer the queued lookups: pin our hits through vLLM and park them under the asker's request id."""
        queue, self.queue = self.queue, []
        if stopping:
            # vLLM drains for shutdown: a store pinned now for a peer would hold the drain up (and a source is
            # asked all the time in llm-d's aggregated sharing); the peer recomputes instead
            for ev in queue:
                self._outbox.send(api.AnswerLookup(ev.peer_id, ev.lookup_id, [False] * len(ev.keys)))
            return
        for ev in queue:
            self._serve(parent, ev)

    def _serve(self, parent, ev: api.PeerLookup) -> None:
        ctx = ReqContext(req_id=f"p2pw:{ev.peer_id}:{ev.request_id}:{ev.lookup_id}", kv_transfer_params=None)
        parent.on_new_request(ctx)
        try:
            hits = []
            for k in ev.keys:
                if parent.lookup(k, ctx) is LookupResult.HIT:
                    hits.append(k)
                elif api.is_ask(ev.lookup_id):  # a one-trip load's ask: its request uses only the prefix, so
                    break                       # keys past a gap are not pinned
            if hits:
                job = parent.create_store_job(hits, ctx)  # pins the rows; reported by our get_finished_jobs
                if self._book.submit(JobKind.STORE, job, ev.request_id, "worker not ready"):
                    self._outbox.send(api.RequestFinished(ev.request_id))  # nothing more for this lookup
                else:
                    hits = []
            held = set(hits)
            self._outbox.send(api.AnswerLookup(ev.peer_id, ev.lookup_id, [k in held for k in ev.keys]))
        finally:
            parent.on_request_finished(ctx)
