"""P2PWorkerTier: vLLM's out-of-tree secondary tier that drives a p2pworker process.

Loaded by vLLM 0.32/0.33's TieringOffloadingSpec from
``kv_connector_extra_config["secondary_tiers"]``::

    {"type": "P2PWorkerTier", "module_path": "vllm_adapter.tier",
     "host": "127.0.0.1", "port": 5710, "worker_config": "configs/prefill.toml"}

Every method runs in vLLM's scheduler process under the tiering manager's
lock and never blocks: commands go to the worker with ``try_put`` on a
shared-memory ring, results come back with ``try_get``.  The only waits are in
``__init__`` (the worker starting, at engine start-up) and ``drain_jobs`` /
``shutdown`` (whose contracts are to wait).

``tolerates_off_thread_polling = True`` (0.33): ``get_finished_jobs`` only
touches the two rings (it reads events and puts the commands other calls
queued) and this object's own dictionaries, which the manager's lock already
serialises, so letting vLLM's tier-poll thread call it between engine steps
is safe; it reports finished loads sooner (lower TTFT) and takes the ring
writes off the scheduler thread (without a poll thread, 0.32, they happen once
per step in ``on_schedule_end``).

Roles, from ``kv_transfer_params`` (vLLM's keys):

- ``remote_decoder: {kv_request_id}``: producer (prefill).  Stores are parked in
  the worker under ``kv_request_id`` until the consumer's fetch binds them;
  ``on_new_request`` asks for REQUEST_LEVEL offloading so prefix hits cascade too.
- ``remote_prefiller: {kv_request_id, remote_host, remote_port}``: PD consumer
  (decode).  Lookups answer HIT (the producer has or will have the blocks);
  ``submit_load`` asks the producer's worker to write them into our rows.  After
  a failed load the request's lookups answer MISS, so vLLM recomputes.
- ``remote_kv_source: {kv_request_id, remote_host, remote_port}``: symmetric
  consumer.  Lookups are batched to the peer (RETRY until its answer arrives,
  then HIT or MISS); the peer's tier pins its hits through vLLM's parent API in
  ``serve_external_requests`` and parks them under our ``kv_request_id``;
  ``submit_load`` then fetches them like a PD load.

Worker supervision: a dead worker fails every job in flight exactly once,
lookups answer MISS, and a new worker is started after a bounded backoff
without blocking the scheduler.  With ``rings`` set the tier spawns nothing: it
creates the rings and an operator's ``p2pworker launch --rings <rings>``
attaches; after a death the rings are re-created for its restart.
"""

from __future__ import annotations

import collections
import ctypes
import enum
import json
import logging
import math
import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, ClassVar, Iterable

import numpy as np

from vllm.v1.kv_offload.base import (
    CacheHitSource,
    Locality,
    LookupResult,
    OffloadPolicy,
    ReqContext,
    RequestOffloadingContext,
)
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

from p2pworker import api
from p2pworker.client import KILL_WAIT_S, WorkerClient
from p2pworker.config import ConfigError, TierSettings, WorkerConfig
from p2pworker.config import tier_settings as _tier_settings
from p2pworker.errors import MessageTooLarge, P2PError
from p2pworker.session.session import longest_hold_s
from p2pworker.shm.maps import handle_for_range
from p2pworker.shm.ring import PeerStatus
from vllm_adapter.engine_hook import EngineCore, IdleWaker, find_engine_core

log = logging.getLogger("vllm_adapter.tier")

RESTART_MIN_S, RESTART_MAX_S = 1.0, 30.0
LIVENESS_CHECK_S = 0.05
POLL_THREAD_GONE_S = 0.1  # no off-thread poll for this long: on_schedule_end flushes commands itself
RECENT_FINISHED_S, RECENT_FINISHED_MAX = 60.0, 4096  # the worker's default park_timeout_s
# A new worker's ring holds api.RING_NSLOTS commands until the worker reads it (an operator may relaunch it much
# later): the replay takes at most half, the newest, and leaves the rest to requests that finish meanwhile.
REPLAY_IN_RING_MAX = api.RING_NSLOTS // 2
# A request that will load from a peer asks the worker to open the session at once (OpenSession keep=False), at most
# once per peer per this many seconds: for an open session it is a dict lookup in the worker, but not one per request.
OPEN_AHEAD_S, OPEN_AHEAD_MAX = 5.0, 4096
DRAIN_SLACK_S, DRAIN_LOG_S = 5.0, 10.0  # drain_jobs: slack past the longest lease; how often it says it waits
# A worker still alive this long after our SIGKILL (not ours to kill: an operator's run as another user; or stuck in
# the kernel): one with jobs is killed again and said in the log, every time (its jobs end once it is gone); one
# without (it never said Ready, or its jobs ended) is given up then: its rings closed, the next worker started.
KILL_RETRY_S = 10.0
# vLLM drains for shutdown (its engine core's shutdown_state): parked stores no consumer is reading end at once, and
# again this often while jobs are open (a request still finishing in the drain parks afresh; its consumer had this
# long to fetch it).  Without it every stop waits out --shutdown-timeout and ends in a kill (invariant 6).
STOP_RESET_S = 2.0


class _Kind(enum.Enum):
    COUNTER = "counter"
    GAUGE = "gauge"


# The tier's own series on vLLM's /metrics (docs/configuration.md "Metrics"; dashboards/p2pworker.json queries them).
M_LOADS = "vllm:kv_offload_p2pworker_loads"
M_STORES = "vllm:kv_offload_p2pworker_stores"
M_DEATHS = "vllm:kv_offload_p2pworker_worker_deaths"
M_RESTARTS = "vllm:kv_offload_p2pworker_worker_restarts"
M_IN_FLIGHT = "vllm:kv_offload_p2pworker_jobs_in_flight"
# Every series also carries `worker`: the worker's name (vllm-<engine id>), the value of the `engine` label on
# that worker's own series, so the two join (vLLM's own `engine` label is the engine index, 0 on every instance).
@dataclass(frozen=True)
class _Metric:
    kind: _Kind
    labels: tuple[str, ...]
    doc: str


TIER_METRICS: dict[str, _Metric] = {
    M_LOADS: _Metric(_Kind.COUNTER, ("worker", "outcome"), "Load jobs (peer -> this engine's CPU tier), by outcome"),
    M_STORES: _Metric(_Kind.COUNTER, ("worker", "outcome"), "Store jobs (rows offered to peers), by outcome"),
    M_DEATHS: _Metric(_Kind.COUNTER, ("worker",), "p2pworker processes of this engine that died or were killed"),
    M_RESTARTS: _Metric(_Kind.COUNTER, ("worker",),
                        "Attempts to start a new p2pworker after one died (each counts, failed or not)"),
    M_IN_FLIGHT: _Metric(_Kind.GAUGE, ("worker",), "Jobs submitted to the worker and not yet reported"),
}


def tier_settings(config: dict) -> tuple[TierSettings, WorkerConfig]:
    """Typed, range-checked tier keys and the worker settings they give; an unknown or invalid one fails vLLM's
    start naming it (p2pworker.config.TierSettings)."""
    try:
        return _tier_settings(config)
    except ConfigError as e:
        raise P2PError(f"P2PWorkerTier config: {e}") from None


class RoleKind(enum.Enum):
    PRODUCER = "producer"  # remote_decoder: our blocks are offered to the decode engine's worker
    CONSUMER = "consumer"  # remote_prefiller: a PD decode; every lookup is answered by that producer
    SYMMETRIC = "symmetric"  # remote_kv_source: look up what a peer engine holds, load the hits
    # remote_decoder + remote_kv_source (llm-d's P/D + P2P prefill leg, multi-turn P/D): the prefix is pulled from
    # the source as SYMMETRIC does, the rest computed, and every block (pulled and computed) parked for the decode
    PRODUCER_PULLING = "producer+pull"
    NONE = "none"  # no (usable) P2P params: MISS, recompute

    @property
    def loads(self) -> bool:
        """Its lookups go to a peer and its hits are loaded from there."""
        return self in (RoleKind.CONSUMER, RoleKind.SYMMETRIC, RoleKind.PRODUCER_PULLING)

    @property
    def produces(self) -> bool:
        """Its stores are parked for a decode engine's fetch."""
        return self in (RoleKind.PRODUCER, RoleKind.PRODUCER_PULLING)

    @property
    def asks(self) -> bool:
        """Its lookups are asked of the peer key by key (a PD consumer's are HIT: the producer will have them)."""
        return self in (RoleKind.SYMMETRIC, RoleKind.PRODUCER_PULLING)


class _JobKind(enum.Enum):
    LOAD = "load"  # peer -> our rows (a PD or symmetric consumer)
    STORE = "store"  # our rows offered to peers (a producer, or serving a symmetric lookup)


@dataclass(frozen=True)
class _OpenJob:
    """A job vLLM submitted that the worker has not reported yet."""

    kind: _JobKind
    keys: list[bytes]
    kv_request_id: str
    t0: float  # monotonic, at submit


@dataclass(frozen=True)
class PDRole:
    """What a request is to this tier, parsed once from kv_transfer_params."""

    kind: RoleKind
    kv_request_id: str = ""  # a loading role's id at its peer (what it fetches and looks up under)
    address: str = ""  # a loading role: the peer's worker, host:port
    park_id: str = ""  # a producing role: the decode's kv_request_id, which our stores are parked under


def _peer(field_name: str, pre: Any) -> tuple[str, str] | None:
    """(kv_request_id, host:port) of a remote_prefiller / remote_kv_source entry, or None (logged) if unusable."""
    if isinstance(pre, dict):
        rid, host, port = pre.get("kv_request_id"), pre.get("remote_host"), pre.get("remote_port")
        try:
            port = int(port)
        except (TypeError, ValueError):
            port = -1
        if isinstance(rid, str) and rid and isinstance(host, str) and host and 0 < port < 65536:
            return rid, f"{host}:{port}"
    log.error("invalid %s %r (need kv_request_id, remote_host, remote_port); recomputing", field_name, pre)
    return None


def parse_role(params: Any) -> PDRole:
    """vLLM's kv_transfer_params -> PDRole; invalid params are logged and give role none (MISS).

    ``remote_decoder`` with ``remote_kv_source`` is the one legal pair (vLLM's p2p protocol): a prefill engine that
    pulls its prefix from the source and serves the decode.  An unusable source there leaves a plain producer."""
    if not isinstance(params, dict):
        return PDRole(RoleKind.NONE)
    dec = params.get("remote_decoder")
    if dec is not None:
        rid = dec.get("kv_request_id") if isinstance(dec, dict) else None
        if not (isinstance(rid, str) and rid):
            log.error("remote_decoder without a usable kv_request_id: %r; not offloading to peers", dec)
            return PDRole(RoleKind.NONE)
        src = params.get("remote_kv_source")
        pull = _peer("remote_kv_source", src) if src is not None else None
        if pull is None:
            return PDRole(RoleKind.PRODUCER, park_id=rid)
        return PDRole(RoleKind.PRODUCER_PULLING, pull[0], pull[1], park_id=rid)
    for field_name, kind in (("remote_prefiller", RoleKind.CONSUMER), ("remote_kv_source", RoleKind.SYMMETRIC)):
        pre = params.get(field_name)
        if pre is None:
            continue
        peer = _peer(field_name, pre)
        return PDRole(kind, peer[0], peer[1]) if peer is not None else PDRole(RoleKind.NONE)
    return PDRole(RoleKind.NONE)


class P2PWorkerTier(SecondaryTierManager):
    tolerates_off_thread_polling: ClassVar[bool] = True  # 0.33 reads it; 0.32 ignores it
    cache_hit_source: ClassVar[Any] = CacheHitSource.P2P

    def __init__(
        self,
        offloading_spec: Any,
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: Any = None,
        **tier_config: Any,
    ):
        super().__init__(offloading_spec=offloading_spec, primary_kv_view=primary_kv_view,
                         tier_type=tier_type, backpressure_detector=backpressure_detector)
        s, wcfg = tier_settings(tier_config)
        locality, rings = s.locality, s.rings
        start_timeout_s, worker_stall_s = s.start_timeout_s, s.worker_stall_s
        self._peers = list(s.peers)
        if locality is not None:
            self.locality = Locality(str(locality).upper())
        cfg = offloading_spec.config
        dp = int(getattr(cfg.parallel, "data_parallel_index", 0) or 0)
        self.host = wcfg.control.host  # the tier's keys, vLLM's environment convention, the worker's settings
        base = wcfg.control.port
        self.port = base + dp  # what peers dial: base + DP index, like vLLM's own p2p tier
        self.num_blocks = int(primary_kv_view.shape[0])
        self.block_bytes = int(primary_kv_view.strides[0])
        address = ctypes.addressof(ctypes.c_char.from_buffer(primary_kv_view))
        self._handle = handle_for_range(address, self.num_blocks * self.block_bytes, self.num_blocks, self.block_bytes)
        self._identity = fingerprint_identity(offloading_spec)
        self._name = f"vllm-{cfg.engine_id}"[:60].replace("/", "_")
        self._worker_args = ["--host", self.host, "--port", str(base), "--dp-index", str(dp),
                             "--backend", wcfg.data.backend]
        if s.advertise_host is not None:  # else the worker settings' own (worker_settings / worker_config)
            self._worker_args += ["--advertise-host", s.advertise_host]
        if s.worker_settings is not None:
            self._worker_args += ["--settings-json", json.dumps(s.worker_settings)]
        self._worker_config = s.worker_config
        self._rings = rings  # set: attach to an operator-launched worker (p2pworker launch --rings <rings>)
        self._jobs: dict[int, _OpenJob] = {}  # submitted to the worker, not yet reported to vLLM
        self._results: list[JobResult] = []
        self._failed_req_ids: set[str] = set()
        # symmetric, per kv_request_id (so a finished request is forgotten in time linear in its own keys):
        self._answers: dict[str, dict[bytes, bool]] = {}  # key -> the peer holds it
        self._asked: dict[str, set[bytes]] = {}  # keys asked, no answer yet (present while the request lives)
        self._asking: dict[tuple[str, str], list[bytes]] = {}  # (address, kv_request_id) -> keys to ask
        self._lookups: dict[int, tuple[str, list[bytes]]] = {}  # lookup id -> (kv_request_id, keys)
        self._next_lookup = 1
        self._to_serve: list[api.PeerLookup] = []
        # producer requests finished lately (kv_request_id -> when): replayed to a restarted worker so a
        # consumer's fetch for them is answered "nothing here" at once instead of after fetch_timeout_s
        self._recent_finished: collections.OrderedDict[str, float] = collections.OrderedDict()
        # ids in the current worker's command ring before its Ready was read; on Ready the rest of _recent_finished
        # goes out.  Bounded by what the worker took off its ring before the tier's next poll read that Ready.
        self._told_finished: set[str] = set()
        # workers given up alive (_kill_failed; an attach or configuration error): reaped once they die
        self._abandoned: list[WorkerClient] = []
        self._client: WorkerClient | None = None
        self._ready = False
        self._restart_at = 0.0
        self._next_liveness = 0.0
        self._outbox: list[api.Command] = []  # commands not yet on the command ring (see _send)
        self._opened_ahead: dict[str, float] = {}  # peer address -> when a request last asked to open its session
        self._scheduler_thread = threading.get_ident()  # vLLM builds tiers on the scheduler thread
        self._off_thread_poll_at = -1e9  # last get_finished_jobs from vLLM's tier-poll thread (0.33)
        self._backoff_s = RESTART_MIN_S
        self._stall_s = float(worker_stall_s)
        self._start_s = float(start_timeout_s)  # also bounds a restarted worker's way to Ready (see _pump)
        self._starting_since: float | None = None  # a worker process exists, its Ready not read yet, since then
        # drain_jobs: the longest a job of a live worker can stay open (a lease the worker grants, or our load and
        # the settling of its reads), plus slack; then the worker is killed.  Its Ready replaces this with the bound
        # from the worker's own settings (an operator-launched worker's come from its config, not ours).
        self._drain_s = longest_hold_s(wcfg.session) + DRAIN_SLACK_S
        self._last_event = time.monotonic()
        self._killing_since: float | None = None  # a wedged worker was SIGKILLed at this time; not gone yet
        self._kill_retry_at = 0.0  # ... and is killed again (and logged) from then on, every KILL_RETRY_S
        self._kill_reason = ""  # why, for the log line once it is gone
        self._fatal: str | None = None  # the worker reported a configuration error: no restarts
        self._attach_error: str | None = None
        self._started = False  # the engine's start (this __init__) is over
        self.restarts = 0
        self._stats = {"loads_ok": 0, "loads_failed": 0, "stores_ok": 0, "stores_failed": 0, "worker_deaths": 0}
        self._reported: dict[tuple[str, tuple[str, ...]], int] = {}  # what get_stats has handed vLLM so far
        # The engine core constructing us (vllm_adapter.engine_hook): read for its shutdown, and on vLLM 0.32 (no
        # tier-poll thread) woken when our worker has something for us while it idles.
        self._engine: EngineCore | None = find_engine_core(sys._getframe(1))
        self._last_call = time.monotonic()  # when vLLM last called _pump (the waker's notion of idle)
        self._stop_reset_at: float | None = None  # vLLM is draining for shutdown: the next ResetCache then
        poll_s = float(getattr(offloading_spec, "tier_poll_interval_s", 0.0) or 0.0)  # 0.33's poll thread
        self._waker: IdleWaker | None = None
        if self._engine is not None and poll_s <= 0:
            self._waker = IdleWaker(self._engine, lambda: self._last_call, self._name)
        if self._engine is None:  # a warning: vLLM shows only its own loggers' INFO lines
            log.warning("P2PWorkerTier %s: no vLLM engine core found on the stack that built the tier: %s",
                        self._name, "parked stores are not ended at vLLM's shutdown drain" if poll_s > 0 else
                        "an idle engine serves peers' pulls only at its next request (the puller waits out its "
                        "lookup_timeout_s), and parked stores are not ended at vLLM's shutdown drain")
        else:
            log.info("P2PWorkerTier %s: %s", self._name, f"vLLM's tier-poll thread serves peers every {poll_s:g} s"
                     if poll_s > 0 else "an idle engine is woken for peers' pulls (no tier-poll thread in this vLLM)")
        self._start_worker()
        deadline = time.monotonic() + start_timeout_s
        while not self._ready:  # start-up only: the engine is not serving yet
            self._pump()
            if self._fatal is not None:  # a configuration error: say it now, not after start_timeout_s
                self.shutdown()  # the refused worker (killed, not waited for in _worker_died) reaped, bounded
                raise P2PError(f"p2pworker for {self._name} cannot start: {self._fatal}")
            if time.monotonic() > deadline:
                # other attach errors may heal (a port still held by a predecessor): retried until here
                last = f"; last error: {self._attach_error}" if self._attach_error else ""
                self.shutdown()  # no orphan worker left behind by a failed engine start
                raise P2PError(f"p2pworker for {self._name} did not become ready within {start_timeout_s} s{last}")
            time.sleep(0.01)
        self._started = True  # vLLM serves from here on (see _config_error)
        log.info("P2PWorkerTier: worker %s ready at %s (data %s, fingerprint %s)", self._name,
                 self._client.ready.address, self._client.ready.backend, self._client.ready.fingerprint)

    # ------------------------------------------------------------ worker lifecycle
    def _start_worker(self) -> None:
        try:
            if self._rings:
                self._client = WorkerClient(self._name, spawn=False, prefix=self._rings)
            else:
                self._client = WorkerClient(self._name, config_path=self._worker_config, args=self._worker_args)
            self._ready = False
            if self._waker is not None:
                self._waker.retarget(self._client.evt)
            if not self._client.send(api.AttachRegion(self._handle, self._identity, api.RING_API)):
                raise P2PError("command ring full at start")
            # Right behind the AttachRegion, not on Ready: the worker serves its port from the AttachRegion on, and
            # reads these before it reads its sockets again, whether or not vLLM calls us to read its Ready (an idle
            # vLLM 0.32 engine does not while an operator relaunches the worker).
            self._told_finished.clear()
            self._replay_finished()
        except (P2PError, OSError) as e:
            log.error("starting p2pworker failed: %s", e)
            self._client = None
            if self._waker is not None:
                self._waker.retarget(None)
            self._schedule_restart()

    def _schedule_restart(self) -> None:
        self._restart_at = time.monotonic() + self._backoff_s
        self._backoff_s = min(self._backoff_s * 2, RESTART_MAX_S)

    def _config_error(self, why: str) -> None:
        """The worker cannot serve as configured.  A spawned worker's configuration is ours (the tier's settings,
        this install): restarting it would fail the same way, so the tier stops restarting (at start-up vLLM's start
        fails with the cause).  An operator-launched worker (`rings`) that fails this way after start-up is fixed by
        the operator relaunching it (the right release, its config): its rings are re-created after the backoff, as
        for a worker that died, and this cause is logged again on every try until one attaches."""
        if self._rings and self._started:
            self._attach_error = why
            self._worker_died(f"configuration error of the operator-launched worker ({why}); the rings are "
                              f"re-created for the operator to relaunch it")
        else:
            self._fatal = why
            self._worker_died(f"configuration error: {why}")

    def _worker_died(self, why: str, gone: bool = True) -> None:
        """Every job and lookup of the worker ends (failed, MISS) and the next worker is started after the backoff.
        ``gone=False``: a worker given up alive, holding no job: its rings are closed without waiting for it (it is
        reaped once it dies: _pump).  Never waits for a process, and never fails a job while its worker may run."""
        client = self._client
        if gone and self._jobs and client is not None and client.alive():
            # A worker ended for what it said (a configuration error) while jobs of ours are with it: one that runs
            # on could still copy into, or let a consumer read, rows vLLM reuses once they are reported failed
            # (invariant 7).  Killed; they fail once it is gone (_pump), as a wedged worker's do.  The worker sends
            # such errors only before its Ready (and jobs come only after), so this keeps the rule, not the case.
            log.error("p2pworker %s: %s, with %d job(s) open: killing it; they fail once it is gone", self._name,
                      why, len(self._jobs))
            if self._killing_since is None:
                self._kill(client, time.monotonic(), why)
            return
        if not gone:
            nxt = ("NOT restarting (configuration error)" if self._fatal is not None else
                   f"re-creating the rings for the operator's next worker in {self._backoff_s:.0f} s" if self._rings
                   else f"starting the next one in {self._backoff_s:.0f} s")
            log.error("p2pworker %s given up (%s): %s", self._name, why, nxt)
        elif self._fatal is not None:
            log.error("p2pworker %s cannot serve (%s): failing %d job(s); NOT restarting it: fix the configuration "
                      "and restart vLLM (until then every transfer through this tier fails at once)",
                      self._name, why, len(self._jobs))
        else:
            log.error("p2pworker %s died (%s): failing %d job(s), restarting in %.0f s",
                      self._name, why, len(self._jobs), self._backoff_s)
        self._killing_since = None
        self._starting_since = None
        if gone:
            self._stats["worker_deaths"] += 1
        now = time.monotonic()
        for job_id, job in list(self._jobs.items()):
            self._finish(job_id, False, None, now - job.t0, None)
        for rid, keys in self._lookups.values():
            self._answer(rid, keys, None)
        self._lookups.clear()
        for (_, rid), keys in self._asking.items():  # asked, not sent yet: MISS as well (a tier that stops
            self._answer(rid, keys, None)           # restarting would otherwise hold them, and vLLM step, forever)
        self._asking.clear()
        self._to_serve.clear()
        self._outbox.clear()  # their jobs were failed above
        self._client, self._ready = None, False
        if self._waker is not None:
            self._waker.retarget(None)  # before its rings close under it
        if client is not None:
            try:
                if gone and client.proc is not None and client.alive():
                    # A spawned worker that reported an attach or configuration error: it lives on, waiting for a
                    # Shutdown.  No job of ours is with it (checked above), so nothing needs its death; vLLM's
                    # scheduler thread must not wait for it either: one stuck in the kernel does not die of SIGKILL
                    # (close() waited for it, unbounded).
                    client.kill()
                    gone = False
                if gone:
                    client.close(timeout_s=0)  # gone already, or an operator's worker (it stops on its rings closing)
                else:
                    client.abandon()  # close() would wait for a process that does not die
                    self._abandoned.append(client)
            except Exception as e:  # the rings are ours; closing them must not take vLLM down
                log.warning("closing the dead worker's rings: %s", e)
        self._schedule_restart()

    def _pump(self) -> None:
        """Collect worker events; notice a dead or wedged worker; restart one when due.  Never blocks."""
        self._last_call = time.monotonic()
        if self._engine is not None and self._jobs and self._engine.stopping():
            self._end_parked_for_stop()
        if self._abandoned:  # ~2 us (waitpid) each, only while one is left: reaped even while no worker runs
            self._reap_abandoned()
        client = self._client
        if client is None:
            if self._fatal is None and time.monotonic() >= self._restart_at:
                self.restarts += 1
                self._start_worker()
            return
        try:
            events = client.poll()
        except P2PError as e:
            events = []
            log.error("event ring: %s", e)
        if events:
            self._last_event = time.monotonic()  # read before judging liveness: a slow poller is not a wedge
        for ev in events:
            if isinstance(ev, api.JobFinished):
                entry = self._jobs.get(ev.job_id)
                if entry is None:
                    log.error("worker reported unknown job %d; ignored", ev.job_id)
                    continue
                self._finish(ev.job_id, ev.success, ev.keys, ev.seconds, ev.nbytes, ev.reason)
            elif isinstance(ev, api.LookupResult):
                rid, keys = self._lookups.pop(ev.lookup_id, ("", []))
                self._answer(rid, keys, ev.present)
            elif isinstance(ev, api.PeerLookup):
                self._to_serve.append(ev)
            elif isinstance(ev, api.Ready):
                if self._killing_since is not None:  # too late: no job goes to a worker we decided to kill
                    log.warning("p2pworker %s said Ready after our SIGKILL (%s): ignored", self._name,
                                self._kill_reason)
                    continue
                why = api.ring_api_mismatch(ev.api, f"p2pworker {self._name} (control {ev.address})")
                if why is not None:  # another release: it would drop commands it cannot decode
                    log.error("p2pworker: %s", why)
                    self._config_error(why)
                    return
                if math.isfinite(ev.hold_s) and ev.hold_s > 0:
                    self._drain_s = ev.hold_s + DRAIN_SLACK_S
                else:  # never wait forever (inf) nor kill a live worker at once (0, NaN) on a bad value
                    log.warning("p2pworker %s sent hold_s=%r; drain_jobs keeps the bound it had, %.1f s",
                                self._name, ev.hold_s, self._drain_s)
                self._ready = True
                self._starting_since = None
                self._attach_error = None
                self._last_event = time.monotonic()
                self._backoff_s = RESTART_MIN_S
                client.ready = ev
                client.cmd.unlink()
                client.evt.unlink()
                self._trim_recent_finished()
                told, self._told_finished = self._told_finished, set()
                for rid in self._recent_finished:  # what the ring did not take before (_replay_finished)
                    if rid not in told:
                        self._send(api.RequestFinished(rid))
                self._opened_ahead.clear()  # a new worker has no session yet
                for peer in self._peers:  # kept connected by the worker from now on (re-opened if a session ends)
                    if not self._send(api.OpenSession(peer)):
                        log.warning("could not ask the worker to connect to %s: command ring full", peer)
            elif isinstance(ev, api.WorkerError):
                log.error("p2pworker: %s", ev.message)
                if ev.fatal:
                    self._config_error(ev.message)
                    return
                if ev.attach:  # this worker cannot serve; a new one may (a port freed, memory available)
                    self._attach_error = ev.message
                    self._worker_died(f"could not attach the region: {ev.message}")
                    return
            elif isinstance(ev, api.PeerDown):
                log.info("p2pworker peer %s down: %s", ev.peer_id, ev.reason)
        # A dead worker is noticed within LIVENESS_CHECK_S (its jobs then fail at once).
        now = time.monotonic()
        if now >= self._next_liveness:  # ~2 us (waitpid) + ~15 us (/proc): not on every poll
            self._next_liveness = now + LIVENESS_CHECK_S
            if not client.alive():
                if self._killing_since is not None:
                    self._worker_died(f"{self._kill_reason}; killed")
                else:
                    self._worker_died(f"exit code {client.proc.poll() if client.proc else '?'}")
                return
            if self._killing_since is not None:
                if now >= self._kill_retry_at and self._kill_failed(client, now):
                    return
            elif self._ready and now - self._last_event > self._stall_s:
                # The pid lives but the loop does not (SIGSTOP, a deadlock, a stuck syscall).  Its jobs are failed
                # only once it is really gone: a stopped worker that resumed could still copy into our rows.
                log.error("p2pworker %s sent nothing for %.1f s (heartbeat every %g s): killing it",
                          self._name, now - self._last_event, api.HEARTBEAT_S)
                self._kill(client, now, f"wedged (no heartbeat for {self._stall_s:g} s while its pid lived)")
            elif self._started and self._starting():
                # A restarted worker that never says Ready (stuck importing, attaching, SIGSTOPped) is killed after
                # the bound vLLM's start gives the first one; has_pending_work keeps vLLM stepping until then.
                if self._starting_since is None:
                    self._starting_since = now
                elif now - self._starting_since > self._start_s:
                    log.error("p2pworker %s not ready %.0f s after it started (start_timeout_s): killing it",
                              self._name, now - self._starting_since)
                    self._kill(client, now, f"not ready within start_timeout_s = {self._start_s:g} s")
        self._flush()
        for (address, rid), asking in list(self._asking.items()):  # one batched lookup per request and peer
            del self._asking[(address, rid)]
            for i in range(0, len(asking), api.MAX_JOB_KEYS):  # more than the hard limit: several lookups
                keys = asking[i:i + api.MAX_JOB_KEYS]
                lookup_id = self._next_lookup
                self._next_lookup += 1
                self._lookups[lookup_id] = (rid, keys)
                if not self._send(api.LookupKeys(lookup_id, address, rid, keys)):
                    del self._lookups[lookup_id]
                    self._answer(rid, keys, None)
        self._flush()

    def _end_parked_for_stop(self) -> None:
        """vLLM drains for shutdown: our open jobs keep it stepping until --shutdown-timeout, then it kills the engine
        and leaves the region file behind.  The worker ends the parked stores no consumer is reading (a lease holds
        its rows until the consumer's Release or the lease's end: invariant 7), now and every STOP_RESET_S while
        jobs are open; loads go on (their requests finish in the drain)."""
        now = time.monotonic()
        if self._stop_reset_at is not None and now < self._stop_reset_at:
            return
        if self._stop_reset_at is None:
            log.info("vLLM is shutting down: ending the %d parked store(s) of p2pworker %s that no consumer is "
                     "reading", sum(j.kind is _JobKind.STORE for j in self._jobs.values()), self._name)
        self._stop_reset_at = now + STOP_RESET_S
        # loads go on in a drain (their requests still finish); in abort mode (--shutdown-timeout 0) vLLM aborted
        # every request, so they are cancelled too
        if self._send(api.ResetCache("vLLM is shutting down", loads=self._engine.aborting())):
            self._flush()

    def _kill(self, client: WorkerClient, now: float, why: str) -> None:
        """SIGKILL a worker whose pid lives but that does not serve; its jobs fail once it is gone (_pump)."""
        self._killing_since, self._kill_reason = now, why
        self._kill_retry_at = now + KILL_RETRY_S
        client.kill()

    def _kill_failed(self, client: WorkerClient, now: float) -> bool:
        """The worker outlived our SIGKILL by KILL_RETRY_S.  True when it was given up (its rings are closed)."""
        self._kill_retry_at = now + KILL_RETRY_S
        pid = client.proc.pid if client.proc is not None else client.evt.peer_pid
        alive_s = now - self._killing_since
        if not self._jobs:
            # No job of ours is with it (one that never said Ready never got one, nor one past our kill: see
            # _serving), so no row of ours is being read or written by it and nothing waits for its death; while it
            # lived, has_pending_work would keep vLLM stepping for it.  If it ever runs on, it finds its command ring
            # closed and stops by itself.
            self._worker_died(f"{self._kill_reason}; pid {pid} still alive {alive_s:.0f} s after SIGKILL (not ours "
                              f"to kill, or stuck in the kernel): stop it by hand; it may hold the port "
                              f"the next worker needs", gone=False)
            return True
        log.error("p2pworker %s (pid %d) still alive %.0f s after SIGKILL (%s): its %d job(s) stay open until it "
                  "is gone (a job failed while it lives could let it write into rows vLLM reused); killing it again",
                  self._name, pid, alive_s, self._kill_reason, len(self._jobs))
        client.kill()
        return False

    def _reap_abandoned(self) -> None:
        """Forget the given-up workers that are gone (each reaped: no zombie)."""
        self._abandoned = [c for c in self._abandoned if not c.reap()]

    def _starting(self) -> bool:
        """A worker process exists and its Ready has not been read: one we spawned, or an operator's that attached
        the rings (not one the operator has yet to launch: its AttachRegion waits in the ring, for as long as it
        takes)."""
        client = self._client
        return client is not None and not self._ready and (
            client.proc is not None or client.evt.peer_status() is not PeerStatus.PENDING)

    def _answer(self, rid: str, keys: list[bytes], present: list[bool] | None) -> None:
        """Record a peer's answer (None: it could not answer, so MISS).  Late answers for a finished request
        are dropped (nothing would ever forget them)."""
        asked = self._asked.get(rid)
        if asked is None:
            return
        answers = self._answers.setdefault(rid, {})
        for k, p in zip(keys, present if present is not None else [False] * len(keys)):
            answers[k] = bool(p)
            asked.discard(k)

    def _finish(self, job_id: int, success: bool, keys, seconds, nbytes, reason: str = "") -> None:
        job = self._jobs.pop(job_id)
        job_keys, rid = job.keys, job.kv_request_id
        if job.kind is _JobKind.LOAD:
            if success:
                landed = job_keys  # success: every key moved (the worker does not echo them)
            else:
                asked = set(job_keys)
                landed = [k for k in (keys or []) if k in asked]
            self._results.append(JobResult(job_id, success, successful_keys=landed, transfer_time=seconds,
                                           transfer_bytes=nbytes))
            if not success:
                self._failed_req_ids.add(rid)  # later lookups MISS: vLLM recomputes, no re-promotion loop
                log.warning("load for %s failed (%s); recomputing", rid, reason or "worker gone")
            self._stats["loads_ok" if success else "loads_failed"] += 1
        else:
            self._results.append(JobResult(job_id, success, transfer_time=seconds, transfer_bytes=nbytes))
            self._stats["stores_ok" if success else "stores_failed"] += 1

    def _serving(self) -> bool:
        """A ready worker we have not decided to kill: new work goes to it, else fails (MISS) at once.  A worker
        that outlives our SIGKILL would otherwise take every new job into a ring it never reads, each one open
        (its rows pinned) until it is gone."""
        return self._client is not None and self._ready and self._killing_since is None

    def _send(self, cmd: api.Command) -> bool:
        """Queue a command for the worker (False: no serving worker).  The queue is flushed to the command
        ring by whichever comes first: vLLM 0.33's tier-poll thread (get_finished_jobs, off the scheduler
        thread) or, when no poll thread runs (0.32), this step's on_schedule_end, once per step."""
        if not self._serving():
            return False
        self._outbox.append(cmd)
        return True

    def _flush(self) -> None:
        client, box = self._client, self._outbox
        if client is None or not self._ready:
            return
        try:
            client.flush()  # the tail of a command that spans slots goes first (never blocks)
        except P2PError as e:
            log.error("command ring: %s", e)
            return
        sent = 0
        for cmd in box:
            try:
                taken = client.send(cmd)  # a command larger than a slot: taken once its first slot is out
            except MessageTooLarge as e:  # past limits.RING_MAX_MESSAGE_BYTES: fail it, never raise into vLLM
                self._refuse(cmd, str(e))
                taken = True
            if not taken:  # ring full (or a long command still going out): the rest waits, in order
                break
            sent += 1
        del box[:sent]

    def _refuse(self, cmd: api.Command, why: str) -> None:
        """A command the ring cannot carry: its job or lookup ends now, through the normal failure path."""
        log.error("p2pworker %s: %s refused: %s", self._name, type(cmd).__name__, why)
        if isinstance(cmd, (api.StoreJob, api.LoadJob)) and cmd.job_id in self._jobs:
            self._finish(cmd.job_id, False, None, 0.0, None, why)
        elif isinstance(cmd, api.LookupKeys) and cmd.lookup_id in self._lookups:
            rid, keys = self._lookups.pop(cmd.lookup_id)
            self._answer(rid, keys, None)

    def on_schedule_end(self, context) -> None:
        # The manager calls this after it flushed the step's promotions (submit_load): hand those commands to the
        # worker now, not at the tier-poll thread's next round (82 us median, 276 us p90 later, measured in
        # pd_tier).  A non-blocking ring put under the manager lock, which the poll thread's own flush
        # also holds, so the ring keeps one writer at a time.  Without a poll thread (0.32): the once-per-step flush.
        if self._outbox or time.monotonic() - self._off_thread_poll_at > POLL_THREAD_GONE_S:
            self._flush()

    # ------------------------------------------------------------ SecondaryTierManager
    def on_new_request(self, req_context) -> RequestOffloadingContext:
        role = parse_role(req_context.kv_transfer_params)
        req_context.set_state(role)
        if role.kind.loads:
            self._open_ahead(role.address)
        if role.kind.produces:  # every block of the request, pulled or cached ones too, is cascaded to us
            return RequestOffloadingContext(policy=OffloadPolicy.REQUEST_LEVEL)
        return RequestOffloadingContext()

    def _open_ahead(self, address: str) -> None:
        """A request that will look up and load from ``address`` arrived: have the worker open that session now, so
        the handshake (and on one host the handover and lane) runs while vLLM schedules the request instead of
        after its first load is submitted (first contact).  Not a listed peer: opened once, not kept."""
        now = time.monotonic()
        if now - self._opened_ahead.get(address, -OPEN_AHEAD_S) < OPEN_AHEAD_S or not self._serving():
            return
        if len(self._opened_ahead) >= OPEN_AHEAD_MAX:
            self._opened_ahead.clear()  # bounded: at worst a peer is asked once more
        self._opened_ahead[address] = now
        if self._send(api.OpenSession(address, keep=False)):
            # Now, not at the step's end: the point is to start before the lookups.  A non-blocking ring put; vLLM
            # calls on_new_request under the manager lock (0.33), which the poll thread's flush holds too.
            self._flush()

    def _role(self, req_context) -> PDRole:
        role = req_context.get_state(PDRole)
        if role is None:
            role = parse_role(req_context.kv_transfer_params)
            req_context.set_state(role)
        return role

    def lookup(self, key, req_context) -> LookupResult:
        role = self._role(req_context)
        if not role.kind.loads or role.kv_request_id in self._failed_req_ids or not self._serving():
            return LookupResult.MISS
        if not role.kind.asks:
            return LookupResult.HIT  # the producer has (or will have) it; a failed load turns the request to MISS
        rid, k = role.kv_request_id, bytes(key)
        answers = self._answers.get(rid)
        answer = answers.get(k) if answers is not None else None
        if answer is None:
            asked = self._asked.get(rid)
            if asked is None:
                asked = self._asked[rid] = set()
            if k not in asked:
                asked.add(k)
                self._asking.setdefault((role.address, rid), []).append(k)
            return LookupResult.RETRY  # asked (batched at the next poll); HIT or MISS once the peer answers
        return LookupResult.HIT if answer else LookupResult.MISS

    def submit_store(self, job: TransferJob) -> None:
        role = self._role(job.req_context)
        now = time.monotonic()
        if not role.kind.produces:
            self._results.append(JobResult(job.job_id, True))  # nothing to keep for peers
            return
        keys = list(job.keys)  # OffloadKey is bytes
        self._jobs[job.job_id] = _OpenJob(_JobKind.STORE, keys, role.park_id, now)
        if len(keys) > api.MAX_JOB_KEYS:
            self._finish(job.job_id, False, None, 0.0, None, _too_many(len(keys)))
        elif not self._send(api.StoreJob(job.job_id, role.park_id, keys, _rows(job.chunk_ids))):
            self._finish(job.job_id, False, None, 0.0, None, "worker not ready or command ring full")

    def submit_load(self, job: TransferJob) -> None:
        role = self._role(job.req_context)
        keys = list(job.keys)  # OffloadKey is bytes
        self._jobs[job.job_id] = _OpenJob(_JobKind.LOAD, keys, role.kv_request_id, time.monotonic())
        if len(keys) > api.MAX_JOB_KEYS:
            self._finish(job.job_id, False, None, 0.0, None, _too_many(len(keys)))
        elif not role.kind.loads or not self._send(
            api.LoadJob(job.job_id, role.address, role.kv_request_id, keys, _rows(job.chunk_ids))
        ):
            self._finish(job.job_id, False, None, 0.0, None, "not a PD consumer, or worker not ready")

    def get_finished_jobs(self) -> Iterable[JobResult]:
        if threading.get_ident() != self._scheduler_thread:
            self._off_thread_poll_at = time.monotonic()
        self._pump()
        out, self._results = self._results, []
        return out

    def _trim_recent_finished(self) -> None:
        now = time.monotonic()
        while self._recent_finished and next(iter(self._recent_finished.values())) < now - RECENT_FINISHED_S:
            self._recent_finished.popitem(last=False)

    def _replay_finished(self) -> None:
        """A new worker's rings exist: tell it the producer requests that finished lately (a consumer that got one
        from the router may ask this worker for it).  The newest REPLAY_IN_RING_MAX (those a consumer is about to
        fetch) go into the ring now, the rest on Ready."""
        self._trim_recent_finished()
        for n, rid in enumerate(reversed(self._recent_finished)):
            if n >= REPLAY_IN_RING_MAX or not self._tell_finished(rid):
                break

    def _tell_finished(self, rid: str) -> bool:
        """RequestFinished, once per worker.  Before its Ready is read it goes straight into the command ring (the
        outbox is for a ready worker), where a worker still starting, or one an operator has yet to launch, finds it
        right behind its AttachRegion; with no worker, or the ring full, it waits in _recent_finished for the next
        worker or the Ready.  False: not in the ring."""
        client = self._client
        if client is None:
            return False
        if self._ready:
            return self._send(api.RequestFinished(rid))
        try:
            sent = client.send(api.RequestFinished(rid))
        except P2PError as e:  # an id past the ring's limit, or a broken ring (the next worker gets the replay)
            log.error("p2pworker %s: RequestFinished not sent: %s", self._name, e)
            return False
        if sent:
            self._told_finished.add(rid)
        return sent

    def on_request_finished(self, req_context) -> None:
        role = self._role(req_context)
        if role.kind.produces:
            rid = role.park_id
            self._recent_finished[rid] = time.monotonic()
            self._recent_finished.move_to_end(rid)
            if len(self._recent_finished) > RECENT_FINISHED_MAX:
                self._recent_finished.popitem(last=False)
            self._tell_finished(rid)
        if role.kind.asks:
            self._answers.pop(role.kv_request_id, None)
            self._asked.pop(role.kv_request_id, None)
        if role.kind.loads:
            # Loaded all, some or none (it held a shared prefix; it recomputed; it was aborted): the peer releases
            # what it parked for us and we did not fetch now, not park_timeout_s after its own request's end.
            self._send(api.ConsumerDone(role.address, role.kv_request_id))
            self._failed_req_ids.discard(role.kv_request_id)

    def serve_external_requests(self, parent) -> None:
        """Answer peers' lookups: pin our hits through vLLM and park them under the asker's request id."""
        if not self._to_serve:
            return
        queue, self._to_serve = self._to_serve, []
        if self._engine is not None and self._engine.stopping():
            # vLLM drains for shutdown: a store pinned now for a peer would hold the drain up (and a source is
            # asked all the time in llm-d's aggregated sharing); the peer recomputes instead
            for ev in queue:
                self._send(api.AnswerLookup(ev.peer_id, ev.lookup_id, [False] * len(ev.keys)))
            return
        for ev in queue:
            ctx = ReqContext(req_id=f"p2pw:{ev.peer_id}:{ev.request_id}:{ev.lookup_id}", kv_transfer_params=None)
            parent.on_new_request(ctx)
            try:
                hits = [k for k in ev.keys if parent.lookup(k, ctx) is LookupResult.HIT]
                if hits:
                    job = parent.create_store_job(hits, ctx)  # pins the rows; reported by our get_finished_jobs
                    keys = list(job.keys)  # OffloadKey is bytes
                    self._jobs[job.job_id] = _OpenJob(_JobKind.STORE, keys, ev.request_id, time.monotonic())
                    if self._send(api.StoreJob(job.job_id, ev.request_id, keys, _rows(job.chunk_ids))):
                        self._send(api.RequestFinished(ev.request_id))  # nothing more for this lookup
                    else:
                        self._finish(job.job_id, False, None, 0.0, None, "worker not ready")
                        hits = []
                held = set(hits)
                self._send(api.AnswerLookup(ev.peer_id, ev.lookup_id, [k in held for k in ev.keys]))
            finally:
                parent.on_request_finished(ctx)

    def has_pending_work(self) -> bool:
        # no worker: pending until one is restarted (vLLM keeps calling us meanwhile), but not for a tier that stopped
        # restarting after a configuration error (vLLM would step for nothing forever)
        # A worker that started and has not said Ready: its Ready is read only when vLLM calls us, and vLLM 0.32 (no
        # tier-poll thread) calls only while this is True.  Until it is read every job fails ("worker not ready"),
        # listed peers are not connected, and a worker stuck before it is never killed.  (The finished requests a
        # consumer may fetch no longer wait for it: they are in the ring behind the AttachRegion, _tell_finished.)
        # Bounded: such a worker is killed after start_timeout_s (_pump).
        # A worker we SIGKILLed: until vLLM calls us nobody sees it gone (and restarts one) or gives it up; bounded,
        # without jobs, by KILL_RETRY_S (_kill_failed).  A given-up one is not waited for (it may never die).
        # Events unread on the ring: vLLM 0.32's idle engine steps once when the waker woke it, and reads them.
        # While vLLM stops, a worker to (re)start is not work: its drain would wait for it, then kill the engine.
        client = self._client
        stopping = self._engine is not None and self._engine.stopping()
        return bool(self._jobs or self._results or self._asking or self._lookups or self._to_serve
                    or self._outbox) or (client is None and self._fatal is None and not stopping) or (
                        self._starting() and not stopping) or (
                        client is not None and (client.cmd.pending_bytes > 0 or (
                            self._waker is not None and client.evt.depth() > 0))) or (
                        self._killing_since is not None)

    def drain_jobs(self) -> None:
        """vLLM's reset_cache (sleep, weight update), under its manager lock: when this returns every job is reported
        and nothing of ours touches vLLM's rows, which it then reuses. Our store jobs would stay open while parked for a
        consumer (until park_timeout_s after their request's end) and our loads until their lease, so the worker is told
        to end them (ResetCache): parked stores no consumer can be reading fail at once, leased ones end with their
        lease, loads are cancelled and reported once their reads settled. A job still open past the longest lease the
        worker grants is never failed while the worker lives (a consumer could still read those rows, or our read land
        in them): the worker is killed, and its jobs fail once it is gone; vLLM waits meanwhile, as its own tiers do."""
        if self._jobs and self._send(api.ResetCache()):
            self._flush()
        deadline = time.monotonic() + self._drain_s
        while self._jobs and time.monotonic() < deadline:
            self._pump()
            time.sleep(0.001)
        if not self._jobs:
            return
        client = self._client
        log.error("drain: %d job(s) of p2pworker %s still open after %.0f s (past the longest lease): killing it",
                  len(self._jobs), self._name, self._drain_s)
        if client is not None:
            client.kill()
            next_log = time.monotonic() + DRAIN_LOG_S
            while client.alive():  # a blocked reset is visible; a job failed while the worker lives is not safe
                if time.monotonic() >= next_log:
                    next_log += DRAIN_LOG_S
                    log.error("drain: p2pworker %s still alive after SIGKILL; vLLM's reset waits for it", self._name)
                    client.kill()
                time.sleep(0.01)
        if self._jobs:
            self._worker_died("killed: a job outlived the longest lease while vLLM drained the tier")

    def shutdown(self) -> None:
        if self._waker is not None:
            self._waker.close()
            self._waker = None
        client, self._client, self._ready = self._client, None, False
        if client is not None:
            code = client.close()
            log.info("p2pworker %s exited with %s", self._name, code)
        # bounded: vLLM's shutdown must not hang on a process that does not die (as close() waits after its SIGKILL)
        deadline = time.monotonic() + KILL_WAIT_S
        while True:
            self._reap_abandoned()
            if not self._abandoned or time.monotonic() > deadline:
                break
            time.sleep(0.01)
        for c in self._abandoned:
            log.error("p2pworker %s: a worker given up earlier (pid %d) is still alive; stop it by hand", self._name,
                      c.proc.pid)
        self._primary_kv_view = None  # do not keep vLLM's mapping exported

    @classmethod
    def build_metric_definitions(cls, tier_config: dict) -> dict:
        """vLLM's metric hook (0.32 and 0.33): the series this tier reports through ``get_stats``.  vLLM adds its
        own engine/model labels and serves them on the engine's /metrics (counters with ``_total``)."""
        from vllm.v1.kv_offload.base import OffloadingCounterMetadata, OffloadingGaugeMetadata

        return {name: (OffloadingCounterMetadata if m.kind is _Kind.COUNTER else OffloadingGaugeMetadata)(
                    documentation=m.doc, labelnames=m.labels)
                for name, m in TIER_METRICS.items()}

    def get_stats(self):
        """vLLM's metric hook: what changed since the last call (vLLM sums counter increments and keeps the last
        gauge value).  The first call reports every series, zeros included, so each exists from the start and a
        dashboard query never meets a missing series."""
        now = self._series()
        changed = {k: v for k, v in now.items() if self._reported.get(k) != v}
        if not changed:
            return None
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats

        stats = OffloadingConnectorStats()
        for (name, labels), value in changed.items():
            if TIER_METRICS[name].kind is _Kind.COUNTER:
                stats.increase_counter(name, value - self._reported.get((name, labels), 0), labels)
            else:
                stats.set_gauge(name, value, labels)
        self._reported.update(changed)
        return stats

    def _series(self) -> dict[tuple[str, tuple[str, ...]], int]:
        st, w = self._stats, self._name
        return {
            (M_LOADS, (w, "ok")): st["loads_ok"], (M_LOADS, (w, "failed")): st["loads_failed"],
            (M_STORES, (w, "ok")): st["stores_ok"], (M_STORES, (w, "failed")): st["stores_failed"],
            (M_DEATHS, (w,)): st["worker_deaths"], (M_RESTARTS, (w,)): self.restarts,
            (M_IN_FLIGHT, (w,)): len(self._jobs),
        }

    def counters(self) -> dict:
        """Jobs and worker restarts seen by this tier (also what ``p2pworker inspect`` shows worker-side)."""
        return dict(self._stats, jobs_in_flight=len(self._jobs), restarts=self.restarts)

    @classmethod
    def config_info_keys(cls, tier_config: dict) -> tuple[str, ...]:
        """0.33 info-metric labels of this tier (vLLM adds the tier label itself)."""
        return ("p2p_address", "p2p_backend")

    def config_info(self) -> dict:
        ready = self._client.ready if self._client is not None else None
        return {"p2p_address": self.worker_address or f"{self.host}:{self.port}",  # what peers dial, once known
                "p2p_backend": getattr(ready, "backend", None) or "starting"}

    @property
    def worker_address(self) -> str | None:
        """host:port peers dial to reach this engine's worker."""
        if self._client is None or self._client.ready is None:
            return None
        return self._client.ready.address.removeprefix("tcp://")


def _too_many(n: int) -> str:
    return (f"job of {n} keys exceeds p2pworker's hard limit of {api.MAX_JOB_KEYS} keys per job "
            f"(p2pworker.limits.MAX_JOB_KEYS)")


def _rows(chunk_ids) -> list[int]:
    return np.asarray(chunk_ids).tolist()  # one C call (vs ~0.2 us per row in a comprehension)


def fingerprint_identity(spec: Any) -> dict:
    """vLLM's notion of KV compatibility: model, dtype, chunk geometry, hash seed, layout."""
    cfg = spec.config
    ident: dict[str, Any] = {
        "model": getattr(cfg.model, "name", None),
        "dtype": str(getattr(cfg.model, "dtype", None)),
        "blocks_per_chunk": int(getattr(spec, "blocks_per_chunk", 0) or 0),
        "tokens_per_block": ",".join(str(t) for t in (getattr(spec, "tokens_per_block", ()) or ())),
        "kv_bytes_per_chunk": int(getattr(spec, "kv_bytes_per_chunk", 0) or 0),
        "world_size": int(getattr(cfg.parallel, "world_size", 1) or 1),
    }
    try:
        from vllm.v1.core.kv_cache_utils import get_none_hash_seed

        ident["none_hash_seed"] = str(get_none_hash_seed())
    except Exception:  # not every version exposes it
        ident["none_hash_seed"] = os.environ.get("PYTHONHASHSEED", "")
    return ident
