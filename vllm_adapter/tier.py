"""P2PWorkerTier: vLLM's out-of-tree secondary tier that drives a p2pworker process.

Loaded by vLLM 0.32/0.33/0.34's TieringOffloadingSpec from
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

This class is the facade of vLLM's contract; the work is done in its rooms:
roles.py (what a request is to the tier, from ``kv_transfer_params``),
supervisor.py (the worker's life: start, backoff, kill, give up, reap),
outbox.py (commands on their way to the ring), jobs.py (open jobs, each
reported once), lookups.py (symmetric lookups, both sides), finished.py (the
finished-request replay to a new worker), metrics.py (counts and vLLM's
metric hooks).
"""

from __future__ import annotations

import ctypes
import json
import logging
import math
import os
import sys
import threading
import time
from typing import Any, Callable, ClassVar, Iterable

from vllm.v1.kv_offload.base import (
    CacheHitSource,
    Locality,
    LookupResult,
    OffloadPolicy,
    RequestOffloadingContext,
)
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

from p2pworker import api
from p2pworker.client import WorkerClient
from p2pworker.config import ConfigError, TierSettings, WorkerConfig
from p2pworker.config import tier_settings as _tier_settings
from p2pworker.errors import P2PError
from p2pworker.session.session import longest_hold_s
from p2pworker.shm.maps import handle_for_range
from vllm_adapter.contract import VLLM
from vllm_adapter.engine_hook import EngineCore, IdleWaker, find_engine_core
from vllm_adapter.hints import PullPath, SourceHints
from vllm_adapter.finished import RECENT_FINISHED_MAX, RECENT_FINISHED_S, REPLAY_IN_RING_MAX, FinishedReplay
from vllm_adapter.instruments import TierInstruments
from vllm_adapter.jobs import STOP_RESET_S, JobBook, JobKind, OpenJob, load_state
from vllm_adapter.lookups import AskedLookups, PeerLookups
from vllm_adapter.metrics import M_DEATHS, M_IN_FLIGHT, M_LOADS, M_RESTARTS, M_STORES, TIER_METRICS, TierMetrics
from vllm_adapter.outbox import OPEN_AHEAD_MAX, OPEN_AHEAD_S, OpenAhead, Outbox
from vllm_adapter.siblings import Siblings
from vllm_adapter.roles import PDRole, RoleKind, parse_role, role_of
from vllm_adapter.supervisor import (
    DRAIN_LOG_S,
    KILL_RETRY_S,
    LIVENESS_CHECK_S,
    RESTART_MAX_S,
    RESTART_MIN_S,
    SupervisorState,
    WorkerHooks,
    WorkerSupervisor,
)

__all__ = [
    "P2PWorkerTier", "tier_settings", "fingerprint_identity", "PDRole", "RoleKind", "parse_role", "JobKind", "OpenJob",
    "SupervisorState", "TIER_METRICS", "M_LOADS", "M_STORES", "M_DEATHS", "M_RESTARTS", "M_IN_FLIGHT",
    "RESTART_MIN_S", "RESTART_MAX_S", "LIVENESS_CHECK_S", "KILL_RETRY_S", "POLL_THREAD_GONE_S", "RECENT_FINISHED_S",
    "RECENT_FINISHED_MAX", "REPLAY_IN_RING_MAX", "OPEN_AHEAD_S", "OPEN_AHEAD_MAX", "DRAIN_SLACK_S",
    "DRAIN_LOG_S", "STOP_RESET_S",
]

log = logging.getLogger("vllm_adapter.tier")

POLL_THREAD_GONE_S = 0.1  # no off-thread poll for this long: on_schedule_end flushes commands itself
DRAIN_SLACK_S = 5.0  # drain_jobs: slack past the longest lease


def tier_settings(config: dict) -> tuple[TierSettings, WorkerConfig]:
    """Typed, range-checked tier keys and the worker settings they give; an unknown or invalid one fails vLLM's
    start naming it (p2pworker.config.TierSettings)."""
    try:
        return _tier_settings(config)
    except ConfigError as e:
        raise P2PError(f"P2PWorkerTier config: {e}") from None


class P2PWorkerTier(SecondaryTierManager):
    tolerates_off_thread_polling: ClassVar[bool] = True  # 0.33+ read it; 0.32 ignores it
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
        self._peers = list(s.peers)
        if s.locality is not None:
            self.locality = Locality(str(s.locality).upper())
        cfg = offloading_spec.config
        dp = int(getattr(cfg.parallel, "data_parallel_index", 0) or 0)
        self.host = wcfg.control.host  # the tier's keys, vLLM's environment convention, the worker's settings
        self.port = wcfg.control.port + dp  # what peers dial: base + DP index, like vLLM's own p2p tier
        self.num_blocks = int(primary_kv_view.shape[0])
        self.block_bytes = int(primary_kv_view.strides[0])
        address = ctypes.addressof(ctypes.c_char.from_buffer(primary_kv_view))
        self.region = handle_for_range(address, self.num_blocks * self.block_bytes, self.num_blocks, self.block_bytes)
        self.worker_name = f"vllm-{cfg.engine_id}"[:60].replace("/", "_")
        self.metrics = TierMetrics(self.worker_name)
        self.supervisor = WorkerSupervisor(
            self.worker_name, _spawner(self.worker_name, s, wcfg, dp),
            api.AttachRegion(self.region, fingerprint_identity(offloading_spec), api.RING_API,
                             deferred_release=VLLM.deferred_release),
            WorkerHooks(watch=self._watch, spawned=self._on_spawned, ready=self._on_ready, gone=self._on_gone,
                        # rows of a deferred release are the worker's until it is gone, like an open job's
                        jobs_open=lambda: len(self.jobs.open) + len(self.jobs.deferred)),
            self.metrics.counts, rings=bool(s.rings), start_s=s.start_timeout_s, stall_s=s.worker_stall_s)
        self.outbox = Outbox(self.supervisor, self._refuse)
        self.hints = SourceHints()  # which keys a source lately lacked: the pull path a request takes
        self.jobs = JobBook(self.worker_name, self.outbox, self.metrics.counts, hints=self.hints)
        self.lookups = AskedLookups(self.outbox, self.hints, self.metrics.counts,
                                    one_trip=_one_trip(s.pull_path, offloading_spec, self.worker_name))
        self.peer_lookups = PeerLookups(self.jobs, self.outbox)
        self.finished = FinishedReplay(self.worker_name, self.supervisor, self.outbox)
        self.siblings = Siblings()  # live consumer requests per peer and id: the last one's end gives up the id
        self.opened_ahead = OpenAhead(self.outbox)
        self._scheduler_thread = threading.get_ident()  # vLLM builds tiers on the scheduler thread
        self._off_thread_poll_at = -1e9  # last get_finished_jobs from vLLM's tier-poll thread (0.33)
        # drain_jobs: the longest a job of a live worker can stay open (a lease the worker grants, or our load and
        # the settling of its reads), plus slack; then the worker is killed.  Its Ready replaces this with the bound
        # from the worker's own settings (an operator-launched worker's come from its config, not ours).
        self.drain_s = longest_hold_s(wcfg.session) + DRAIN_SLACK_S
        # The engine core constructing us (vllm_adapter.engine_hook): read for its shutdown, and on vLLM 0.32 (no
        # tier-poll thread) woken when our worker has something for us while it idles.
        self.engine: EngineCore | None = find_engine_core(sys._getframe(1))
        self._last_call = time.monotonic()  # when vLLM last called _pump (the waker's notion of idle)
        self.instruments = TierInstruments()  # named points for benchmark/test code (vllm_adapter/instruments.py)
        poll_s = float(getattr(offloading_spec, "tier_poll_interval_s", 0.0) or 0.0)  # 0.33's poll thread
        self.waker: IdleWaker | None = _waker(self.engine, poll_s, lambda: self._last_call, self.worker_name)
        self.supervisor.start()
        self._await_ready(s.start_timeout_s)
        self.supervisor.started = True  # vLLM serves from here on (see WorkerSupervisor.config_error)
        ready = self.supervisor.client.ready
        log.info("P2PWorkerTier: worker %s ready at %s (data %s, fingerprint %s)", self.worker_name,
                 ready.address, ready.backend, ready.fingerprint)

    def _await_ready(self, start_timeout_s: float) -> None:
        deadline = time.monotonic() + start_timeout_s
        while not self.supervisor.ready:  # start-up only: the engine is not serving yet
            self._pump()
            if self.supervisor.fatal is not None:  # a configuration error: say it now, not after start_timeout_s
                self.shutdown()  # the refused worker (killed, not waited for in worker_died) reaped, bounded
                raise P2PError(f"p2pworker for {self.worker_name} cannot start: {self.supervisor.fatal}")
            if time.monotonic() > deadline:
                # other attach errors may heal (a port still held by a predecessor): retried until here
                why = self.supervisor.attach_error
                last = f"; last error: {why}" if why else ""
                self.shutdown()  # no orphan worker left behind by a failed engine start
                raise P2PError(f"p2pworker for {self.worker_name} did not become ready within {start_timeout_s} s"
                               f"{last}")
            time.sleep(0.01)

    # ------------------------------------------------------------ the supervisor's hooks
    def _watch(self, ring) -> None:
        if self.waker is not None:
            self.waker.retarget(ring)

    def _on_spawned(self) -> None:
        self.finished.replay()

    def _on_ready(self, ev: api.Ready) -> None:
        if math.isfinite(ev.hold_s) and ev.hold_s > 0:
            self.drain_s = ev.hold_s + DRAIN_SLACK_S
        else:  # never wait forever (inf) nor kill a live worker at once (0, NaN) on a bad value
            log.warning("p2pworker %s sent hold_s=%r; drain_jobs keeps the bound it had, %.1f s",
                        self.worker_name, ev.hold_s, self.drain_s)
        self.finished.on_ready()
        self.opened_ahead.clear()  # a new worker has no session yet
        for peer in self._peers:  # kept connected by the worker from now on (re-opened if a session ends)
            if not self.outbox.send(api.OpenSession(peer)):
                log.warning("could not ask the worker to connect to %s: command ring full", peer)

    def _on_gone(self) -> None:
        self.jobs.fail_all()
        self.jobs.release_deferred()  # the process is gone: none of its reads can land any more
        self.lookups.miss_all()
        self.peer_lookups.queue.clear()
        self.outbox.clear()  # their jobs were failed above

    def _refuse(self, cmd: api.Command, why: str) -> None:
        """A command the ring cannot carry: its job or lookup ends now, through the normal failure path."""
        log.error("p2pworker %s: %s refused: %s", self.worker_name, type(cmd).__name__, why)
        if not self.jobs.refuse(cmd, why):
            self.lookups.refuse(cmd)

    # ------------------------------------------------------------ the pump
    def _pump(self) -> None:
        """Collect worker events; notice a dead or wedged worker; restart one when due.  Never blocks."""
        self.instruments.on_pump()
        self._last_call = time.monotonic()
        if self.engine is not None and self.jobs.open and self.engine.stopping():
            self.jobs.end_parked_for_stop(self.engine)
        if not self.supervisor.tend():
            return
        for ev in self.supervisor.poll():
            if self._on_event(ev):
                return
        if self.supervisor.check(time.monotonic()):
            return
        self.outbox.flush()
        self.lookups.send_asks()
        self.outbox.flush()

    def _on_event(self, ev: api.Event) -> bool:
        """One event from the worker.  True: the worker was ended (the rest of its events are moot)."""
        if isinstance(ev, api.JobFinished):
            self.jobs.report(ev)
        elif isinstance(ev, api.RowsSettled):
            self.jobs.rows_settled(ev.job_id)
        elif isinstance(ev, api.LookupResult):
            self.lookups.on_result(ev)
        elif isinstance(ev, api.PeerLookup):
            self.peer_lookups.queue.append(ev)
        elif isinstance(ev, api.Ready):
            return self.supervisor.on_ready(ev)
        elif isinstance(ev, api.WorkerError):
            return self.supervisor.on_error(ev)
        elif isinstance(ev, api.PeerDown):
            log.info("p2pworker peer %s down: %s", ev.peer_id, ev.reason)
        elif isinstance(ev, api.PeerUp) and ev.address:  # a session to a source we named: reachable (again)
            self.hints.relinked(ev.address)
        return False

    def _stopping(self) -> bool:
        return self.engine is not None and self.engine.stopping()

    def on_schedule_end(self, context) -> None:
        # The manager calls this after it flushed the step's promotions (submit_load): hand those commands to the
        # worker now, not at the tier-poll thread's next round (82 us median, 276 us p90 later, measured in
        # pd_tier).  A non-blocking ring put under the manager lock, which the poll thread's own flush
        # also holds, so the ring keeps one writer at a time.  Without a poll thread (0.32): the once-per-step flush.
        if self.supervisor.serving:
            # The step's symmetric lookups, asked now: the next pump is the next step's first lookup on 0.32, one
            # scheduler step later (3-4 ms of a pull's TTFT in pull_vs_recompute's traces).
            self.lookups.send_asks()
        if self.outbox.pending or time.monotonic() - self._off_thread_poll_at > POLL_THREAD_GONE_S:
            self.outbox.flush()

    # ------------------------------------------------------------ SecondaryTierManager
    def on_new_request(self, req_context) -> RequestOffloadingContext:
        role = parse_role(req_context.kv_transfer_params)
        req_context.set_state(role)
        if role.kind.loads and self.instruments.on_open_ahead(role.address) and self.supervisor.serving:
            self.opened_ahead.open(role.address)
        self.siblings.started(role, req_context.req_id)
        if role.kind.produces:  # every block of the request, pulled or cached ones too, is cascaded to us
            return RequestOffloadingContext(policy=OffloadPolicy.REQUEST_LEVEL)
        return RequestOffloadingContext()

    def lookup(self, key, req_context) -> LookupResult:
        role = role_of(req_context)
        # a load of this request went out already (or failed): MISS, vLLM recomputes the rest (jobs.LoadState)
        if not role.kind.loads or not self.supervisor.serving or load_state(req_context).loaded:
            return LookupResult.MISS
        if not role.kind.asks:
            return LookupResult.HIT  # the producer has (or will have) it; a failed load turns the request to MISS
        if self.lookups.path(req_context, role.address, key) is PullPath.ONE_TRIP:
            return LookupResult.HIT  # promised: the load asks the source, and what it lacks fails (then MISS)
        if self.hints.down(role.address):  # unreachable lately: recompute now, not after another handshake timeout
            return LookupResult.MISS
        return self.lookups.lookup(role.address, role.kv_request_id, key)

    def submit_store(self, job: TransferJob) -> None:
        role = role_of(job.req_context)
        if not role.kind.produces:
            self.jobs.skip(job.job_id)  # nothing to keep for peers
            return
        self.jobs.submit(JobKind.STORE, job, role.park_id, "worker not ready or command ring full")

    def submit_load(self, job: TransferJob) -> None:
        role = role_of(job.req_context)
        # promised without asking (one trip): the load asks (an asking Fetch also offers what was parked at once)
        ask = role.kind.asks and job.req_context.get_state(PullPath) is not PullPath.ASK_FIRST
        self.jobs.submit(JobKind.LOAD, job, role.kv_request_id, "not a PD consumer, or worker not ready",
                         address=role.address, send=role.kind.loads, ask=ask)

    def get_finished_jobs(self) -> Iterable[JobResult]:
        if threading.get_ident() != self._scheduler_thread:
            self._off_thread_poll_at = time.monotonic()
        self._pump()
        return self.jobs.take_results()

    def on_request_finished(self, req_context) -> None:
        role = role_of(req_context)
        if role.kind.produces:
            self.finished.finished(role.park_id)
        if role.kind.loads and self.siblings.ended(role, req_context.req_id):  # the last of this id at this peer
            if role.kind.asks:
                self.lookups.forget(role.address, role.kv_request_id)
            # Loaded all, some or none (it held a shared prefix; it recomputed; it was aborted): the peer releases
            # what it parked for us and we did not fetch now, not park_timeout_s after its own request's end.
            self.outbox.send(api.ConsumerDone(role.address, role.kv_request_id))

    def serve_external_requests(self, parent) -> None:
        """Answer peers' lookups: pin our hits through vLLM and park them under the asker's request id."""
        if self.peer_lookups.pending:
            self.peer_lookups.serve(parent, stopping=self._stopping())

    def has_pending_work(self) -> bool:
        # vLLM 0.32 (no tier-poll thread) calls the tier only while this is True: each room says what it waits for
        pending = (self.jobs.pending or self.lookups.pending or self.peer_lookups.pending or self.outbox.pending
                   or self.supervisor.wants_steps(self._stopping(), woken=self.waker is not None))
        if not pending and self.waker is not None:
            self.waker.said_idle()  # it blocks on its input queue next: our next event wakes it without delay
        return pending

    def drain_jobs(self) -> None:
        """vLLM's reset_cache (sleep, weight update), under its manager lock: when this returns every job is reported
        and nothing of ours touches vLLM's rows, which it then reuses. Our store jobs would stay open while parked for a
        consumer (until park_timeout_s after their request's end) and our loads until their lease, so the worker is told
        to end them (ResetCache): parked stores no consumer can be reading fail at once, leased ones end with their
        lease, loads are cancelled and reported once their reads settled (on vLLM 0.34 at once, with a deferred
        release that is set here once they settled). A job still open past the longest lease the
        worker grants is never failed while the worker lives (a consumer could still read those rows, or our read land
        in them): the worker is killed, and its jobs fail once it is gone; vLLM waits meanwhile, as its own tiers do."""
        if self.jobs.open and self.outbox.send(api.ResetCache()):
            self.outbox.flush()
        deadline = time.monotonic() + self.drain_s
        # vLLM 0.34: a load cancelled here is reported at once with a deferred release, whose event must be set
        # before we return (its rows go back to vLLM's free pool after the reset)
        while (self.jobs.open or self.jobs.deferred) and time.monotonic() < deadline:
            self._pump()
            time.sleep(0.001)
        if not self.jobs.open and not self.jobs.deferred:
            return
        log.error("drain: %d job(s) of p2pworker %s open, %d load(s) settling after %.0f s (past the longest lease): "
                  "killing it", len(self.jobs.open), self.worker_name, len(self.jobs.deferred), self.drain_s)
        self.supervisor.kill_and_wait()
        if self.jobs.open or self.jobs.deferred:
            self.supervisor.worker_died("killed: a job outlived the longest lease while vLLM drained the tier")

    def shutdown(self) -> None:
        if self.waker is not None:
            self.waker.close()
            self.waker = None
        self.supervisor.close()
        self._primary_kv_view = None  # do not keep vLLM's mapping exported

    # ------------------------------------------------------------ metrics
    @classmethod
    def build_metric_definitions(cls, tier_config: dict) -> dict:
        return TierMetrics.definitions()

    def get_stats(self):
        return self.metrics.stats(len(self.jobs.open))

    def counters(self) -> dict:
        """Jobs and worker restarts seen by this tier (also what ``p2pworker inspect`` shows worker-side)."""
        return self.metrics.counters(len(self.jobs.open))

    restarts = property(lambda self: self.metrics.counts.restarts)  # attempts to start a worker after one died

    @classmethod
    def config_info_keys(cls, tier_config: dict) -> tuple[str, ...]:
        """0.33 info-metric labels of this tier (vLLM adds the tier label itself)."""
        return ("p2p_address", "p2p_backend")

    def config_info(self) -> dict:
        client = self.supervisor.client
        ready = client.ready if client is not None else None
        return {"p2p_address": self.worker_address or f"{self.host}:{self.port}",  # what peers dial, once known
                "p2p_backend": getattr(ready, "backend", None) or "starting"}

    @property
    def worker_address(self) -> str | None:
        """host:port peers dial to reach this engine's worker."""
        client = self.supervisor.client
        if client is None or client.ready is None:
            return None
        return client.ready.address.removeprefix("tcp://")


def _spawner(name: str, s: TierSettings, wcfg: WorkerConfig, dp: int) -> Callable[[], WorkerClient]:
    """How the supervisor gets a worker: one spawned with the tier's settings, or the rings an operator's
    ``p2pworker launch --rings <rings>`` attaches to."""
    if s.rings:
        return lambda: WorkerClient(name, spawn=False, prefix=s.rings)
    args = ["--host", wcfg.control.host, "--port", str(wcfg.control.port), "--dp-index", str(dp),
            "--backend", wcfg.data.backend]
    if s.advertise_host is not None:  # else the worker settings' own (worker_settings / worker_config)
        args += ["--advertise-host", s.advertise_host]
    if s.worker_settings is not None:
        args += ["--settings-json", json.dumps(s.worker_settings)]
    return lambda: WorkerClient(name, config_path=s.worker_config, args=args)


def _waker(engine: EngineCore | None, poll_s: float, last_call: Callable[[], float], name: str) -> IdleWaker | None:
    """The IdleWaker for an engine that idles without a tier-poll thread (vLLM 0.32, or 0.33 with the thread off);
    what the engine core found means, said.  Never where a poll thread runs, and never on 0.34: there an engine
    without the thread never idles (its manager answers has_pending_work True for our tier), so a wake is moot."""
    if engine is not None and poll_s <= 0 and VLLM.idle_needs_poll_thread:
        log.info("P2PWorkerTier %s: no tier-poll thread (tier_poll_interval_s <= 0): this vLLM steps the engine "
                 "without pause while our tier is loaded; the default poll thread lets it idle", name)
        return None
    waker = IdleWaker(engine, last_call, name) if engine is not None and poll_s <= 0 else None
    if engine is None:  # a warning: vLLM shows only its own loggers' INFO lines
        log.warning("P2PWorkerTier %s: no vLLM engine core found on the stack that built the tier: %s",
                    name, "parked stores are not ended at vLLM's shutdown drain" if poll_s > 0 else
                    "an idle engine serves peers' pulls only at its next request (the puller waits out its "
                    "lookup_timeout_s), and parked stores are not ended at vLLM's shutdown drain"
                    if not VLLM.idle_needs_poll_thread else "parked stores are not ended at vLLM's shutdown drain")
    else:
        log.info("P2PWorkerTier %s: %s", name, f"vLLM's tier-poll thread serves peers every {poll_s:g} s"
                 if poll_s > 0 else "an idle engine is woken for peers' pulls (no tier-poll thread in this vLLM)")
    return waker


def _one_trip(pull_path: str, spec: Any, name: str) -> bool:
    """Whether symmetric pulls may take one round trip.  Not for a model with sliding-window (or several) KV groups:
    vLLM looks such a group up from the end of the prompt, so after a short one-trip load the window below the
    loaded prefix was never promoted, every key of it answers MISS, and the whole prompt is recomputed; asking first
    finds that window.  vLLM 0.33 says which groups slide (sliding_window_size_in_chunks); 0.32 does not, so there any
    second group counts as one."""
    if pull_path != "one_trip":
        return False
    groups = tuple(getattr(spec.config, "groups", ()) or ())
    windowed = len(groups) > 1 or any(getattr(g, "sliding_window_size_in_chunks", None) for g in groups)
    if windowed:
        log.info("P2PWorkerTier %s: the model has sliding-window or several KV groups: symmetric pulls ask the "
                 "source first (pull_path one_trip applies to full-attention models)", name)
    return not windowed


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
