"""The router's Prometheus series (docs/router.md)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from p2pworker.router.pool import Instance, InstanceState, Role
from p2pworker.router.upstream import Reason


class RouterMetrics:
    """Prometheus series of one router (its own registry: a test may run several routers in one process)."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        p = "p2pworker_router_"
        self.requests = Counter(p + "requests", "Client requests answered, by route and HTTP status",
                                ["route", "code"], registry=r)
        self.prefill_failures = Counter(p + "prefill_failures", "Prefill legs that failed (decode then recomputes)",
                                        ["instance", "reason"], registry=r)
        self.upstream_errors = Counter(p + "upstream_errors", "Failed upstream calls, prefill and decode",
                                       ["role", "instance", "reason"], registry=r)
        self.latency = Histogram(p + "upstream_latency_seconds",
                                 "Time from sending a request to an instance to its response headers",
                                 ["role", "instance"], registry=r,
                                 buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120))
        self.in_flight = Gauge(p + "in_flight", "Requests in flight to an instance", ["role", "instance"], registry=r)
        self.up = Gauge(p + "instance_up", "1 while an instance takes requests (health and failures)",
                        ["role", "instance"], registry=r)
        self.disconnects = Counter(p + "client_disconnects", "Clients that went away before their answer ended",
                                   registry=r)
        self.cut = Counter(p + "responses_cut", "Answers cut because the instance broke after its headers went out",
                           ["role", "instance"], registry=r)
        # reason: how the last prefill try failed; "unreachable": no prefill instance could be reached at all
        self.recomputes = Counter(p + "recomputes", "Requests whose prompt decode computed because no prefill "
                                  "served it", ["reason"], registry=r)
        for reason in Reason:
            self.recomputes.labels(reason.value)

    def prime(self, instances: list[Instance]) -> None:
        """Create every per-instance series at its start value, so a dashboard reads 0, not "no data"."""
        for i in instances:
            labels = (i.role.value, i.name)
            self.in_flight.labels(*labels).set(0)
            self.up.labels(*labels).set(1 if i.state is InstanceState.UP else 0)
            self.latency.labels(*labels)
            if i.role is Role.PREFILL:
                for reason in Reason:
                    self.prefill_failures.labels(i.name, reason.value)

    def forget(self, i: Instance) -> None:
        """Drop an instance's series (an ad-hoc prefill no longer remembered): their number stays bounded."""
        labels = (i.role.value, i.name)
        for series in (self.in_flight, self.up, self.latency, self.cut):
            series.remove(*labels)
        for reason in Reason:
            self.upstream_errors.remove(*labels, reason.value)
            self.prefill_failures.remove(i.name, reason.value)
