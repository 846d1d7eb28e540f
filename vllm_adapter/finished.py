"""FinishedReplay: producer requests that finished lately, told to each new worker.

A restarted worker does not know which producer requests ended before it: a consumer that got one from the router
and fetches it would wait out the worker's fetch_timeout_s.  So each producer request's end is remembered
(kv_request_id -> when, for RECENT_FINISHED_S, at most RECENT_FINISHED_MAX) and replayed to the next worker, which
then answers such a fetch "nothing here" at once."""

from __future__ import annotations

import collections
import logging
import time
from typing import Callable

from p2pworker import api
from p2pworker.errors import P2PError
from vllm_adapter.outbox import Outbox
from vllm_adapter.supervisor import WorkerSupervisor

log = logging.getLogger("vllm_adapter.tier")

RECENT_FINISHED_S, RECENT_FINISHED_MAX = 60.0, 4096  # the worker's default park_timeout_s
# A new worker's ring holds api.RING_NSLOTS commands until the worker reads it (an operator may relaunch it much
# later): the replay takes at most half, the newest, and leaves the rest to requests that finish meanwhile.
REPLAY_IN_RING_MAX = api.RING_NSLOTS // 2


class FinishedReplay:
    def __init__(self, name: str, supervisor: WorkerSupervisor, outbox: Outbox,
                 clock: Callable[[], float] = time.monotonic):
        self.clock = clock  # monotonic seconds; tests pass their own
        self._name, self._supervisor, self._outbox = name, supervisor, outbox
        # producer requests finished lately (kv_request_id -> when): replayed to a restarted worker so a
        # consumer's fetch for them is answered "nothing here" at once instead of after fetch_timeout_s
        self._recent: collections.OrderedDict[str, float] = collections.OrderedDict()
        # ids in the current worker's command ring before its Ready was read; on Ready the rest of _recent
        # goes out.  Bounded by what the worker took off its ring before the tier's next poll read that Ready.
        self._told: set[str] = set()

    def finished(self, rid: str) -> None:
        """A producer request ended: remembered, and told to the worker."""
        self._recent[rid] = self.clock()
        self._recent.move_to_end(rid)
        if len(self._recent) > RECENT_FINISHED_MAX:
            self._recent.popitem(last=False)
        self._tell(rid)

    def _trim(self) -> None:
        now = self.clock()
        while self._recent and next(iter(self._recent.values())) < now - RECENT_FINISHED_S:
            self._recent.popitem(last=False)

    def replay(self) -> None:
        """A new worker's rings exist: tell it the producer requests that finished lately (a consumer that got one
        from the router may ask this worker for it).  The newest REPLAY_IN_RING_MAX (those a consumer is about to
        fetch) go into the ring now, the rest on Ready."""
        self._told.clear()
        self._trim()
        for n, rid in enumerate(reversed(self._recent)):
            if n >= REPLAY_IN_RING_MAX or not self._tell(rid):
                break

    def on_ready(self) -> None:
        """The worker's Ready was read: what the ring did not take before (replay) goes out."""
        self._trim()
        told, self._told = self._told, set()
        for rid in self._recent:
            if rid not in told:
                self._outbox.send(api.RequestFinished(rid))

    def _tell(self, rid: str) -> bool:
        """RequestFinished, once per worker.  Before its Ready is read it goes straight into the command ring (the
        outbox is for a ready worker), where a worker still starting, or one an operator has yet to launch, finds it
        right behind its AttachRegion; with no worker, or the ring full, it waits in _recent for the next
        worker or the Ready.  False: not in the ring."""
        client = self._supervisor.client
        if client is None:
            return False
        if self._supervisor.ready:
            return self._outbox.send(api.RequestFinished(rid))
        try:
            sent = client.send(api.RequestFinished(rid))
        except P2PError as e:  # an id past the ring's limit, or a broken ring (the next worker gets the replay)
            log.error("p2pworker %s: RequestFinished not sent: %s", self._name, e)
            return False
        if sent:
            self._told.add(rid)
        return sent
