"""Prometheus metrics of one worker, served on an optional port (its own registry).

Every series carries the worker's identity: ``engine`` (the worker's name: ``vllm-<engine id>`` when the adapter
spawned it), ``role`` (``[worker] role``), ``dp_rank`` and ``model`` (from the region's identity, once attached).
Counts that only rise are counters (``_total``); levels are gauges.  The endpoint binds ``metrics_host`` (default
127.0.0.1) on ``metrics_port + dp_index``, so every DP rank of an engine gets its own port, as the control port does.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

LABELS = ("engine", "role", "dp_rank", "model")


class Metrics:
    def __init__(self, worker, port: int, host: str = "127.0.0.1") -> None:
        self._worker = worker
        self.registry = reg = CollectorRegistry()
        self.bytes = Counter("p2pworker_bytes", "KV bytes moved", [*LABELS, "direction"], registry=reg)
        self.blocks = Counter("p2pworker_blocks", "KV blocks moved", [*LABELS, "direction"], registry=reg)
        self.jobs = Counter("p2pworker_jobs", "Jobs reported", [*LABELS, "kind", "outcome"], registry=reg)
        self.latency = Histogram(
            "p2pworker_job_seconds", "Job latency, submit to report", [*LABELS, "kind"], registry=reg,
            buckets=(0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30),
        )
        reg.register(_WorkerState(self))
        self._server, self._thread = start_http_server(port, addr=host, registry=reg)
        self.port = self._server.server_port

    def identity(self) -> tuple[str, str, str, str]:
        w = self._worker
        return (w.cfg.name, w.cfg.role, str(w.cfg.control.dp_index), str(w.identity.get("model") or ""))

    def prime(self) -> None:
        """Create every job series at 0 (Prometheus shows a labelled series only once it is touched): a dashboard's
        `outcome="failed"` query then reads 0 on a worker that never failed, not "no data"."""
        ident = self.identity()
        for kind in ("load", "store"):
            for outcome in ("ok", "failed"):
                self.jobs.labels(*ident, kind, outcome)
            self.latency.labels(*ident, kind)
        for direction in ("in", "out"):
            self.bytes.labels(*ident, direction)
            self.blocks.labels(*ident, direction)

    def job(self, ev) -> None:
        ident = self.identity()
        direction = "in" if ev.kind == "load" else "out"
        self.jobs.labels(*ident, ev.kind, "ok" if ev.success else "failed").inc()
        self.latency.labels(*ident, ev.kind).observe(ev.seconds)
        self.bytes.labels(*ident, direction).inc(ev.nbytes)
        region = self._worker.region  # blocks from bytes: a successful job's keys are not echoed in its event
        if region is not None and region.block_bytes:
            self.blocks.labels(*ident, direction).inc(ev.nbytes // region.block_bytes)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class _WorkerState:
    """Levels and counts read from the worker at scrape time (the scrape runs on the server's thread: it only
    reads ints and lengths, which the GIL keeps whole)."""

    def __init__(self, metrics: Metrics) -> None:
        self._m = metrics

    def collect(self):
        w, ident = self._m._worker, list(self._m.identity())
        for name, doc, value in (
            ("p2pworker_transfers_in_flight", "Data-plane transfers in flight", w.data.in_flight() if w.data else 0),
            ("p2pworker_sessions", "Sessions (one per control link)", len(w.sessions)),
            ("p2pworker_command_ring_depth", "Commands waiting", w.cmd.depth()),
            ("p2pworker_event_ring_depth", "Events waiting", w.evt.depth()),
            ("p2pworker_links_down", "Outbound control links down after they were up, not yet dropped",
             len(w.host.peers.down_since)),
        ):
            g = GaugeMetricFamily(name, doc, labels=LABELS)
            g.add_metric(ident, value)
            yield g
        for name, doc, key in (
            ("p2pworker_peer_deaths", "Control links declared down", "peer_deaths"),
            ("p2pworker_protocol_errors", "Sessions closed on a protocol error", "protocol_errors"),
            ("p2pworker_peers_unreachable", "Dials that never came up (refused, not a p2pworker, silent)",
             "peers_unreachable"),
            ("p2pworker_links_dropped_down", "Outbound links no longer redialled: down for [control] forget_down_s",
             "links_dropped_down"),
        ):
            c = CounterMetricFamily(name, doc, labels=LABELS)
            c.add_metric(ident, w.counters[key])
            yield c
