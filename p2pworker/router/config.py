"""What a router is told at its start (`p2pworker router`'s options, docs/router.md)."""

from __future__ import annotations

from dataclasses import dataclass

from p2pworker.control.base import DEFAULT_PORT
from p2pworker.router.pool import Policy
from p2pworker.router.routing import Mode

COMPLETION_PATHS = ("/v1/completions", "/v1/chat/completions")


@dataclass(frozen=True)
class RouterConfig:
    prefill: tuple[str, ...]  # URL or URL,worker=HOST:PORT; none in aggregated mode
    decode: tuple[str, ...]  # URL
    mode: Mode = Mode.PD
    host: str = "127.0.0.1"
    port: int = 8000
    policy: Policy = Policy.LEAST_IN_FLIGHT
    connect_timeout_s: float = 5.0  # TCP connect to an instance (then the next one is tried)
    read_timeout_s: float = 600.0  # longest silence of an instance (a long prefill sends nothing), and longest
    #                                wait for a client to take the next piece of its answer
    health_interval_s: float = 5.0
    # a DOWN instance is probed again this soon, then at doubling delays up to health_interval_s: an instance that
    # blinked (a restart, one refused connection) is back within a second, not a health round later
    reprobe_first_s: float = 0.2
    health_timeout_s: float = 2.0  # one instance's /health, one worker's TCP connect
    # far above any valid vLLM job (a 1M-token prompt as token ids is ~7 MiB of JSON), low enough that one client
    # cannot take the router's memory; 0: no limit
    max_body_bytes: int = 256 << 20
    default_worker_port: int = DEFAULT_PORT
    keepalive_s: float = 4.0  # idle pooled connections are closed before uvicorn's 5 s (vLLM's default) closes them
    shutdown_delay_s: float = 0.0  # on SIGTERM: /health says 503 and requests are still served this long
    shutdown_timeout_s: float = 30.0  # then the listener closes and requests in flight get this long to finish


def check_roles(cfg: RouterConfig) -> None:
    if not cfg.decode:
        raise ValueError("the router needs at least one --decode instance")
    if cfg.mode is Mode.PD and not cfg.prefill:
        # never aggregated by omission: an operator who forgot --prefill would get every prompt recomputed
        raise ValueError("PD mode needs at least one --prefill instance (or --mode aggregated)")
    if cfg.mode is Mode.AGGREGATED and cfg.prefill:
        raise ValueError("aggregated mode takes no --prefill instance (the --decode instances serve whole requests)")


@dataclass
class Lifecycle:
    """Where the router is in its life; the handlers, the relay and the health checks read it."""

    draining: bool = False  # SIGTERM came: /health says 503 so that a load balancer stops sending
    stopped: bool = False  # cleanup began: no new re-probe loop (it would outlive the event loop)
