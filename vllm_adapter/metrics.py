"""The tier's counts and its own series on vLLM's /metrics (docs/configuration.md "Metrics"; dashboards/p2pworker.json
queries them).  vLLM imports stay inside the two hooks that build its types."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class MetricKind(enum.Enum):
    COUNTER = "counter"
    GAUGE = "gauge"


M_LOADS = "vllm:kv_offload_p2pworker_loads"
M_STORES = "vllm:kv_offload_p2pworker_stores"
M_DEATHS = "vllm:kv_offload_p2pworker_worker_deaths"
M_RESTARTS = "vllm:kv_offload_p2pworker_worker_restarts"
M_IN_FLIGHT = "vllm:kv_offload_p2pworker_jobs_in_flight"
M_PULLS = "vllm:kv_offload_p2pworker_pulls"
M_PULL_KEYS = "vllm:kv_offload_p2pworker_pull_keys"
# Every series also carries `worker`: the worker's name (vllm-<engine id>), the value of the `engine` label on
# that worker's own series, so the two join (vLLM's own `engine` label is the engine index, 0 on every instance).
@dataclass(frozen=True)
class Metric:
    kind: MetricKind
    labels: tuple[str, ...]
    doc: str


TIER_METRICS: dict[str, Metric] = {
    M_LOADS: Metric(MetricKind.COUNTER, ("worker", "outcome"),
                    "Load jobs (peer -> this engine's CPU tier), by outcome: ok, failed, or short (a one-trip load "
                    "that brought less than it promised; vLLM recomputed the rest)"),
    M_STORES: Metric(MetricKind.COUNTER, ("worker", "outcome"), "Store jobs (rows offered to peers), by outcome"),
    M_DEATHS: Metric(MetricKind.COUNTER, ("worker",), "p2pworker processes of this engine that died or were killed"),
    M_RESTARTS: Metric(MetricKind.COUNTER, ("worker",),
                       "Attempts to start a new p2pworker after one died (each counts, failed or not)"),
    M_IN_FLIGHT: Metric(MetricKind.GAUGE, ("worker",), "Jobs submitted to the worker and not yet reported"),
    M_PULLS: Metric(MetricKind.COUNTER, ("worker", "path"),
                    "Symmetric (remote_kv_source) requests, by path: one_trip (the load asks the source) or "
                    "ask_first (the lookups ask it first)"),
    M_PULL_KEYS: Metric(MetricKind.COUNTER, ("worker", "outcome"),
                        "Keys one-trip loads promised, by outcome: landed, or missed (the source did not bring "
                        "them; vLLM recomputed from the first one)"),
}

Series = dict[tuple[str, tuple[str, ...]], int]


@dataclass
class Counts:
    """What the rooms count: job outcomes (the job book), worker deaths and restarts (the supervisor)."""

    loads_ok: int = 0
    loads_failed: int = 0
    loads_short: int = 0  # one-trip loads that brought less than promised (the source lacked the rest)
    stores_ok: int = 0
    stores_failed: int = 0
    worker_deaths: int = 0
    restarts: int = 0
    pulls_one_trip: int = 0  # symmetric requests whose lookups answered HIT at once (the load asks the source)
    pulls_ask_first: int = 0  # symmetric requests that asked the source before answering (vllm_adapter/hints.py)
    pull_keys_landed: int = 0  # keys a one-trip load promised and brought
    pull_keys_missed: int = 0  # keys a one-trip load promised and the source did not bring: vLLM recomputed them


class TierMetrics:
    """The counts as vLLM's metric hooks hand them on, each change once."""

    def __init__(self, worker: str):
        self.counts = Counts()
        self._worker = worker
        self._reported: Series = {}  # what get_stats has handed vLLM so far

    @staticmethod
    def definitions() -> dict:
        """vLLM's metric hook (0.32 and 0.33): the series this tier reports through ``get_stats``.  vLLM adds its
        own engine/model labels and serves them on the engine's /metrics (counters with ``_total``)."""
        from vllm.v1.kv_offload.base import OffloadingCounterMetadata, OffloadingGaugeMetadata

        return {name: (OffloadingCounterMetadata if m.kind is MetricKind.COUNTER else OffloadingGaugeMetadata)(
                    documentation=m.doc, labelnames=m.labels)
                for name, m in TIER_METRICS.items()}

    def stats(self, jobs_in_flight: int):
        """vLLM's metric hook: what changed since the last call (vLLM sums counter increments and keeps the last
        gauge value).  The first call reports every series, zeros included, so each exists from the start and a
        dashboard query never meets a missing series."""
        now = self.series(jobs_in_flight)
        changed = {k: v for k, v in now.items() if self._reported.get(k) != v}
        if not changed:
            return None
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats

        stats = OffloadingConnectorStats()
        for (name, labels), value in changed.items():
            if TIER_METRICS[name].kind is MetricKind.COUNTER:
                stats.increase_counter(name, value - self._reported.get((name, labels), 0), labels)
            else:
                stats.set_gauge(name, value, labels)
        self._reported.update(changed)
        return stats

    def series(self, jobs_in_flight: int) -> Series:
        c, w = self.counts, self._worker
        return {
            (M_LOADS, (w, "ok")): c.loads_ok, (M_LOADS, (w, "failed")): c.loads_failed,
            (M_LOADS, (w, "short")): c.loads_short,
            (M_STORES, (w, "ok")): c.stores_ok, (M_STORES, (w, "failed")): c.stores_failed,
            (M_DEATHS, (w,)): c.worker_deaths, (M_RESTARTS, (w,)): c.restarts,
            (M_IN_FLIGHT, (w,)): jobs_in_flight,
            (M_PULLS, (w, "one_trip")): c.pulls_one_trip, (M_PULLS, (w, "ask_first")): c.pulls_ask_first,
            (M_PULL_KEYS, (w, "landed")): c.pull_keys_landed, (M_PULL_KEYS, (w, "missed")): c.pull_keys_missed,
        }

    def counters(self, jobs_in_flight: int) -> dict:
        """Jobs and worker restarts seen by this tier (also what ``p2pworker inspect`` shows worker-side)."""
        c = self.counts
        return {"loads_ok": c.loads_ok, "loads_failed": c.loads_failed, "loads_short": c.loads_short,
                "stores_ok": c.stores_ok,
                "stores_failed": c.stores_failed, "worker_deaths": c.worker_deaths,
                "jobs_in_flight": jobs_in_flight, "restarts": c.restarts, "pulls_one_trip": c.pulls_one_trip,
                "pulls_ask_first": c.pulls_ask_first, "pull_keys_landed": c.pull_keys_landed,
                "pull_keys_missed": c.pull_keys_missed}
