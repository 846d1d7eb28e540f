"""The PD router: OpenAI-compatible HTTP in front of several prefill and several decode `vllm serve` instances
(docs/router.md).

PD mode, for each completion request: a fresh ``kv_request_id``; the request goes to a prefill instance with
``max_tokens=1`` and ``kv_transfer_params.remote_decoder`` (its KV is parked in that engine's p2pworker), then the
original request goes to a decode instance with ``kv_transfer_params.remote_prefiller`` naming that prefill
instance's worker, and the decode instance's answer (streamed or not) is relayed to the client as it comes.  When
no prefill instance serves the request, it still goes to decode, without the prefiller: decode recomputes the
prompt, and that is counted and logged, never silent.  Aggregated mode (no prefill instances configured): each
request goes to one instance as it came.

llm-d's routing sidecar headers are honoured (routing.py): ``x-prefiller-host-port`` names the prefill instance
(configured or not), ``x-kv-cache-source-host-port`` a peer worker that the leg computing the prompt pulls its
prefix from (``remote_kv_source``).  Neither reaches an engine.

Upstream connections are pooled (one aiohttp session).  Every client header is forwarded except hop-by-hop ones
(RFC 9110 7.6.1, plus those the client's ``Connection`` header names) and the routing headers, so
``Authorization`` (``vllm serve --api-key``) and ``X-Request-Id`` reach both engines; a request without
``X-Request-Id`` gets one, and the log line and both engines see the same id.  A client that disconnects cancels its
handler (aiohttp's ``handler_cancellation``), which closes the upstream connections it holds, and vLLM aborts a
request whose connection closed; a client that stops reading gets ``read_timeout_s`` per write, then its connection
is dropped.  A client going away never counts against an instance.

On SIGTERM: ``/health`` answers 503 ("draining") at once, requests are still served for ``shutdown_delay_s`` (a load
balancer takes the router out meanwhile), then the listener closes and requests in flight get
``shutdown_timeout_s`` to end.

The rooms: config.py (RouterConfig, the router's Lifecycle), fleet.py (the pools and the ad-hoc prefill
instances), health.py (what each call, health round and re-probe says of an instance; the /health view), relay.py
(calls to instances, answers relayed to the client), legs.py (the prefill leg, each leg's body), access.py (the
access log); :class:`Router` here wires them into the aiohttp application.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import signal
import time
import uuid
from typing import Callable

from aiohttp import web
import msgspec
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from p2pworker.router.access import AccessLog, Trace
from p2pworker.router.config import COMPLETION_PATHS, Lifecycle, RouterConfig, check_roles
from p2pworker.router.fleet import AD_HOC_MAX, Fleet
from p2pworker.router.health import Health, Probe
from p2pworker.router.legs import PrefillLeg, aggregated_body, decode_body
from p2pworker.router.metrics import RouterMetrics
from p2pworker.router.pool import Instance, Pool
from p2pworker.router.relay import Upstream
from p2pworker.router.routing import Mode, routing_of
from p2pworker.router.upstream import NOT_FORWARDED_UP, forwarded

__all__ = ["AD_HOC_MAX", "COMPLETION_PATHS", "Probe", "Router", "RouterConfig", "serve"]  # what it always offered

log = logging.getLogger("p2pworker.router")
# bodies: msgspec, several times faster than json on a 7 MiB prompt of token ids
_decode = msgspec.json.Decoder().decode


class Router:
    def __init__(self, cfg: RouterConfig, clock: Callable[[], float] = time.monotonic):
        check_roles(cfg)
        self.cfg = cfg
        self._clock = clock  # instances' failure times, health round age, latencies
        self.life = Lifecycle()
        self.metrics = RouterMetrics()
        self.fleet = Fleet(cfg, self.metrics)
        self.metrics.prime(self.instances)
        self.checks = Health(cfg, self.fleet, self.metrics, self.life, clock)
        self.upstream = Upstream(cfg, self.checks, self.metrics, self.life, clock)
        self.prefill_leg = PrefillLeg(self.fleet, self.upstream, self.checks, self.metrics)
        self.access = AccessLog(self.metrics, self.life, clock)

    @property
    def prefill(self) -> Pool:
        return self.fleet.prefill

    @property
    def decode(self) -> Pool:
        return self.fleet.decode

    @property
    def ad_hoc(self) -> collections.OrderedDict[str, Instance]:
        """The ad-hoc prefill instances by host:port, least recently named first."""
        return self.fleet.ad_hoc

    @property
    def instances(self) -> list[Instance]:
        """The configured instances (not the ad-hoc ones)."""
        return self.fleet.instances

    @property
    def health_round_at(self) -> float | None:
        return self.checks.round_at

    @property
    def draining(self) -> bool:
        """SIGTERM came: /health says 503 so that a load balancer stops sending."""
        return self.life.draining

    @draining.setter
    def draining(self, value: bool) -> None:
        self.life.draining = value

    # ---- application ----------------------------------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.cfg.max_body_bytes, middlewares=[self.access.middleware])
        for path in COMPLETION_PATHS:
            app.router.add_post(path, self.completion)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics_view)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, _app: web.Application) -> None:
        self.upstream.start()
        await self.checks.start()

    async def _stop(self, _app: web.Application) -> None:
        self.life.stopped = True
        await self.checks.stop_tasks()
        await self.upstream.close()
        await self.checks.close()

    # ---- handlers -------------------------------------------------------------------------------------------------

    async def completion(self, request: web.Request) -> web.StreamResponse:
        trace: Trace = request["trace"]
        body = await request.read()  # over max_body_bytes: aiohttp answers 413 itself
        try:
            req = _decode(body)
            if not isinstance(req, dict):
                raise ValueError("not a JSON object")
        except (ValueError, msgspec.DecodeError) as e:
            return web.json_response({"error": f"invalid JSON body: {e}"}, status=400)
        try:
            routing = routing_of(request.headers)
        except ValueError as e:
            return web.json_response({"error": f"invalid routing header: {e}"}, status=400)
        headers = forwarded(request.headers, NOT_FORWARDED_UP)
        headers["X-Request-Id"] = trace.request_id
        headers["Content-Type"] = "application/json"  # replaces the client's (CIMultiDict(h, **kw) would add one)
        kv_id = f"p2pw-{uuid.uuid4().hex}"
        named = [self.fleet.named_prefill(hp) for hp in routing.prefillers]
        if self.cfg.mode is Mode.AGGREGATED and not named:
            return await self.upstream.relay(request, self.decode, "POST", request.path_qs,
                                             aggregated_body(body, req, routing, kv_id), headers)
        by = await self.prefill_leg.run(request.path_qs, req, headers, kv_id, routing, named, trace)
        return await self.upstream.relay(request, self.decode, "POST", request.path_qs,
                                         decode_body(req, kv_id, routing, by), headers)

    async def models(self, request: web.Request) -> web.StreamResponse:
        headers = forwarded(request.headers, NOT_FORWARDED_UP)
        return await self.upstream.relay(request, self.decode, "GET", request.path_qs, None, headers)

    async def health(self, _request: web.Request) -> web.Response:
        """Each instance as the last probes and the requests since saw it (Health.view)."""
        view, status = self.checks.view()
        return web.json_response(view, status=status)

    async def metrics_view(self, _request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.metrics.registry),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})


async def _serve(cfg: RouterConfig) -> None:
    router = Router(cfg)
    # aiohttp's shutdown waits its timeout for handlers, then (having poisoned their request bodies) once more before
    # cancelling them: half of ours each, so that requests in flight are cut after shutdown_timeout_s in all
    runner = web.AppRunner(router.app(), handler_cancellation=True, access_log=None,
                           shutdown_timeout=cfg.shutdown_timeout_s / 2)
    await runner.setup()
    try:
        site = web.TCPSite(runner, cfg.host, cfg.port)
        await site.start()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()

        def on_signal(sig: signal.Signals) -> None:
            if stop.is_set():  # a second signal: the operator does not want to wait for the drain
                log.warning("%s during the drain: exiting now", sig.name)
                logging.shutdown()
                os._exit(1)
            stop.set()

        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, on_signal, sig)
        log.info("router on http://%s:%d (%s mode, %s): prefill %s, decode %s", cfg.host, cfg.port, cfg.mode.value,
                 cfg.policy.value,
                 ", ".join(f"{i.name} (worker {i.worker[0]}:{i.worker[1]})" for i in router.prefill.instances)
                 or "none", ", ".join(i.name for i in router.decode.instances))
        await stop.wait()
        router.draining = True  # /health 503 from now on: a load balancer stops sending while we still serve
        log.info("stopping: /health says draining; serving %.0f s more, then requests in flight get %.0f s",
                 cfg.shutdown_delay_s, cfg.shutdown_timeout_s)
        await asyncio.sleep(cfg.shutdown_delay_s)
    finally:
        await runner.cleanup()
        log.info("stopped")


def serve(cfg: RouterConfig) -> None:
    asyncio.run(_serve(cfg))
