"""Prometheus metrics of one worker, served on an optional port (its own registry)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server


class Metrics:
    def __init__(self, port: int, worker) -> None:
        self._worker = worker
        self.registry = reg = CollectorRegistry()
        self.bytes = Counter("p2pworker_bytes_total", "KV bytes moved", ["direction"], registry=reg)
        self.blocks = Counter("p2pworker_blocks_total", "KV blocks moved", ["direction"], registry=reg)
        self.jobs = Counter("p2pworker_jobs_total", "Jobs reported", ["kind", "outcome"], registry=reg)
        self.latency = Histogram(
            "p2pworker_job_seconds", "Job latency, submit to report", ["kind"], registry=reg,
            buckets=(0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30),
        )
        g = lambda name, doc, fn: Gauge(name, doc, registry=reg).set_function(fn)  # noqa: E731
        g("p2pworker_transfers_in_flight", "Data-plane transfers in flight",
          lambda: worker.data.in_flight() if worker.data else 0)
        g("p2pworker_sessions", "Sessions", lambda: len(worker.sessions))
        g("p2pworker_peer_deaths", "Control links declared down", lambda: worker.counters["peer_deaths"])
        g("p2pworker_protocol_errors", "Sessions closed on a protocol error",
          lambda: worker.counters["protocol_errors"])
        g("p2pworker_command_ring_depth", "Commands waiting", lambda: worker.cmd.depth())
        g("p2pworker_event_ring_depth", "Events waiting", lambda: worker.evt.depth())
        self._server, self._thread = start_http_server(port, addr="127.0.0.1", registry=reg)
        self.port = self._server.server_port

    def job(self, ev) -> None:
        direction = "in" if ev.kind == "load" else "out"
        self.jobs.labels(ev.kind, "ok" if ev.success else "failed").inc()
        self.latency.labels(ev.kind).observe(ev.seconds)
        self.bytes.labels(direction).inc(ev.nbytes)
        region = self._worker.region  # blocks from bytes: a successful job's keys are not echoed in its event
        if region is not None and region.block_bytes:
            self.blocks.labels(direction).inc(ev.nbytes // region.block_bytes)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
