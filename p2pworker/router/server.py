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
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import enum
import logging
import os
import signal
import time
import urllib.parse
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable, Iterator

import aiohttp
from aiohttp import web
import msgspec
from multidict import CIMultiDict
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from p2pworker.control.base import DEFAULT_PORT
from p2pworker.router.metrics import RouterMetrics
from p2pworker.router.pool import Backoff, Instance, InstanceState, Outcome, Policy, Pool, Role, parse_instance
from p2pworker.router.routing import HostPort, Mode, Routing, peer_params, routing_of
from p2pworker.router.upstream import (NOT_FORWARDED_DOWN, NOT_FORWARDED_UP, Reason, UpstreamError, classify,
                                       forwarded)

log = logging.getLogger("p2pworker.router")
access_log = logging.getLogger("p2pworker.router.access")
# bodies: msgspec, several times faster than json on a 7 MiB prompt of token ids
_decode, _encode = msgspec.json.Decoder().decode, msgspec.json.Encoder().encode

COMPLETION_PATHS = ("/v1/completions", "/v1/chat/completions")
# ad-hoc prefill instances remembered (their state, their series); the least recently named is forgotten first, so
# that clients naming ever new addresses cannot grow the router's memory or its /metrics without bound
AD_HOC_MAX = 64


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


class Probe(enum.Enum):
    """What probed an instance (its log lines say)."""

    ROUND = "health round"  # every health_interval_s, every configured instance
    REPROBE = "re-probe"  # a DOWN instance, at Backoff delays


@dataclass
class _Trace:
    """What the access log line says about one request."""

    request_id: str = ""
    prefill: str = "-"
    decode: str = "-"
    note: str = ""
    client_gone: bool = False  # the client went away (its write failed or stalled): logged as 499
    started: float = field(default_factory=time.monotonic)


def _check_roles(cfg: RouterConfig) -> None:
    if not cfg.decode:
        raise ValueError("the router needs at least one --decode instance")
    if cfg.mode is Mode.PD and not cfg.prefill:
        # never aggregated by omission: an operator who forgot --prefill would get every prompt recomputed
        raise ValueError("PD mode needs at least one --prefill instance (or --mode aggregated)")
    if cfg.mode is Mode.AGGREGATED and cfg.prefill:
        raise ValueError("aggregated mode takes no --prefill instance (the --decode instances serve whole requests)")


def _tries_next(err: UpstreamError, was_up: bool) -> bool:
    """After a failed prefill try, whether the next prefill instance is tried: when nothing was sent (unreachable),
    or when the instance was already down (little was expected of it) and the request is not at fault (a 4xx would
    be the same everywhere).  An up instance that failed after the request went out may have half done it, and
    the request itself may be at fault: once is enough, decode recomputes."""
    if err.reason is Reason.UNREACHABLE:
        return True
    return not was_up and err.reason is not Reason.HTTP_4XX


class Router:
    def __init__(self, cfg: RouterConfig, clock: Callable[[], float] = time.monotonic):
        _check_roles(cfg)
        self.cfg = cfg
        self._clock = clock  # instances' failure times, health round age, latencies
        self.prefill = Pool([parse_instance(Role.PREFILL, s, cfg.default_worker_port) for s in cfg.prefill],
                            cfg.policy)
        self.decode = Pool([parse_instance(Role.DECODE, s, cfg.default_worker_port) for s in cfg.decode], cfg.policy)
        names = [i.url for i in self.instances]
        if len(set(names)) != len(names):
            raise ValueError(f"an instance is listed twice: {names}")
        self.ad_hoc: collections.OrderedDict[str, Instance] = collections.OrderedDict()  # by host:port, LRU first
        self.metrics = RouterMetrics()
        self.metrics.prime(self.instances)
        self.health_round_at: float | None = None
        self.draining = False  # SIGTERM came: /health says 503 so that a load balancer stops sending
        self._session: aiohttp.ClientSession | None = None
        self._probes: aiohttp.ClientSession | None = None
        self._health_task: asyncio.Task | None = None
        self._reprobes: dict[str, asyncio.Task] = {}  # by URL: the re-probe loop of each DOWN configured instance
        self._stopped = False  # cleanup began: no new re-probe loop (it would outlive the event loop)

    @property
    def instances(self) -> list[Instance]:
        """The configured instances (not the ad-hoc ones)."""
        return self.prefill.instances + self.decode.instances

    def _roles(self) -> list[tuple[Role, Pool]]:
        """The roles this mode needs an instance up of."""
        return [(Role.PREFILL, self.prefill), (Role.DECODE, self.decode)] if self.cfg.mode is Mode.PD \
            else [(Role.DECODE, self.decode)]

    # ---- application ----------------------------------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.cfg.max_body_bytes, middlewares=[self._access])
        for path in COMPLETION_PATHS:
            app.router.add_post(path, self.completion)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics_view)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, _app: web.Application) -> None:
        self._session = aiohttp.ClientSession(
            # no pool limit: a request never waits for a free connection (aiohttp counts that wait in its connect
            # timeout, so a busy pool would look like dead instances); each client holds at most two connections
            connector=aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=self.cfg.keepalive_s),
            # connect: name lookup + TCP connect (no pool wait: no pool limit); sock_read: silence mid-answer
            timeout=aiohttp.ClientTimeout(total=None, connect=self.cfg.connect_timeout_s,
                                          sock_connect=self.cfg.connect_timeout_s, sock_read=self.cfg.read_timeout_s),
            auto_decompress=False,  # bytes are relayed as the engine sent them, Content-Encoding included
        )
        # health rounds on their own connections: busy request traffic cannot make a probe fail
        self._probes = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=True),
                                             timeout=aiohttp.ClientTimeout(total=self.cfg.health_timeout_s))
        await self._health_round()  # /health means something from the first request on
        self._health_task = asyncio.create_task(self._health_loop())

    async def _stop(self, _app: web.Application) -> None:
        self._stopped = True
        tasks = [t for t in (self._health_task, *self._reprobes.values()) if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for session in (self._session, self._probes):
            if session is not None:
                await session.close()

    @web.middleware
    async def _access(self, request: web.Request, handler) -> web.StreamResponse:
        trace = request["trace"] = _Trace(request_id=request.headers.get("X-Request-Id") or uuid.uuid4().hex,
                                          started=self._clock())
        status = 500
        try:
            resp = await handler(request)
            status = resp.status
            if self.draining and not resp.prepared:
                resp.force_close()  # Connection: close: the client's next request goes to another router
            return resp
        except web.HTTPException as e:
            status = e.status
            raise
        except asyncio.CancelledError:
            if self.draining:
                trace.note = "cut by the router's shutdown"
            elif not trace.client_gone:
                trace.client_gone, trace.note = True, "client disconnected"
                self.metrics.disconnects.inc()
            raise
        finally:
            if trace.client_gone:
                status = 499  # nginx's code for it; never sent, only logged
            route = request.match_info.route.resource.canonical if request.match_info.route.resource else "other"
            self.metrics.requests.labels(route, str(status)).inc()
            access_log.info("%s %s %s %d %.1f ms id=%s prefill=%s decode=%s%s", request.remote, request.method,
                            request.path, status, (self._clock() - trace.started) * 1e3, trace.request_id,
                            trace.prefill, trace.decode, f" ({trace.note})" if trace.note else "")

    # ---- handlers -------------------------------------------------------------------------------------------------

    async def completion(self, request: web.Request) -> web.StreamResponse:
        trace: _Trace = request["trace"]
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
        named = [self._named_prefill(hp) for hp in routing.prefillers]
        if self.cfg.mode is Mode.AGGREGATED and not named:
            return await self._relay(request, self.decode, "POST", request.path_qs,
                                     self._aggregated_body(body, req, routing, kv_id), headers)
        by = await self._prefill_leg(request.path_qs, req, headers, kv_id, routing, named, trace)
        dec = dict(req)
        dec.pop("kv_transfer_params", None)  # the router's transfer params, never the client's
        if by is not None:
            host, port = by.worker
            dec["kv_transfer_params"] = {"remote_prefiller": peer_params(kv_id, HostPort(host, port))}
        elif routing.kv_source is not None:  # decode computes the prompt now: it may still pull the prefix
            # its own id at the source: a prefill that failed after it began pulling under _source_id may still
            # hold (or later release, Done) what the source parked for it
            dec["kv_transfer_params"] = {"remote_kv_source": peer_params(_source_id(kv_id, "decode"),
                                                                         routing.kv_source)}
        return await self._relay(request, self.decode, "POST", request.path_qs, _encode(dec), headers)

    @staticmethod
    def _aggregated_body(body: bytes, req: dict, routing: Routing, kv_id: str) -> bytes:
        """Aggregated mode: the request as it came, or with the router's remote_kv_source (the only params then)."""
        if routing.kv_source is None:
            return body  # not re-encoded: the engine gets the client's bytes
        src = peer_params(_source_id(kv_id), routing.kv_source)
        return _encode(dict(req, kv_transfer_params={"remote_kv_source": src}))

    def _named_prefill(self, hp: HostPort) -> Instance:
        """The prefill instance a routing header names: a configured one with that host:port, else an ad-hoc one
        (its worker where parse_instance puts it: the default port on its host), remembered and logged once."""
        for inst in self.prefill.instances:
            if _host_port(inst) == hp:
                return inst
        name = str(hp)
        inst = self.ad_hoc.get(name)
        if inst is not None:
            self.ad_hoc.move_to_end(name)
            return inst
        inst = parse_instance(Role.PREFILL, f"http://{name}", self.cfg.default_worker_port)
        inst.ad_hoc = True
        self.ad_hoc[name] = inst
        self.metrics.prime([inst])
        log.info("prefill %s (named by a request, not configured) used ad hoc; its worker at %s:%d", name,
                 *inst.worker)
        if len(self.ad_hoc) > AD_HOC_MAX:
            _, old = self.ad_hoc.popitem(last=False)
            self.metrics.forget(old)
        return inst

    async def models(self, request: web.Request) -> web.StreamResponse:
        headers = forwarded(request.headers, NOT_FORWARDED_UP)
        return await self._relay(request, self.decode, "GET", request.path_qs, None, headers)

    async def health(self, _request: web.Request) -> web.Response:
        """Each instance as the last probes and the requests since saw it; 200 while every role the mode needs
        has an instance up, else 503 naming the roles without one (PD with no prefill up would still answer, but
        by recomputing every prompt: a load balancer should know)."""
        def view(i: Instance) -> dict:
            d = {"url": i.url, "state": i.state.value, "in_flight": i.in_flight, "last_error": i.last_error}
            if i.worker is not None:
                d["worker"] = f"{i.worker[0]}:{i.worker[1]}"
                d["worker_reachable"] = i.worker_reachable
            return d
        none_up = [role.value for role, pool in self._roles() if not pool.up()]
        all_up = all(i.state is InstanceState.UP for i in self.instances)
        status = ("draining" if self.draining else "unavailable" if none_up else "ok" if all_up else "degraded")
        age = None if self.health_round_at is None else round(self._clock() - self.health_round_at, 3)
        return web.json_response({"status": status, "mode": self.cfg.mode.value, "no_instance_up": none_up,
                                  "health_round_age_s": age,
                                  "prefill": [view(i) for i in self.prefill.instances],
                                  "decode": [view(i) for i in self.decode.instances],
                                  "ad_hoc_prefill": [view(i) for i in self.ad_hoc.values()]},
                                 status=503 if none_up or self.draining else 200)

    async def metrics_view(self, _request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.metrics.registry),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})

    # ---- upstream calls -------------------------------------------------------------------------------------------

    def _failed(self, inst: Instance, err: UpstreamError) -> None:
        """Count a failed call; what it does to the instance is the reason's outcome (pool.MOVES)."""
        self.metrics.upstream_errors.labels(inst.role.value, inst.name, err.reason.value).inc()
        if err.reason.outcome is None:
            log.warning("%s %s: %s (not held against it)", inst.role.value, inst.name, err)
            return
        before = inst.record(err.reason.outcome, self._clock(), str(err))
        if before is InstanceState.UP and inst.state is InstanceState.DOWN:
            log.warning("%s %s taken out: %s (%s)", inst.role.value, inst.name, err,
                        "a request that names it brings it back" if inst.ad_hoc else "re-probed from now on")
        self._state_seen(inst)

    def _ok(self, inst: Instance) -> None:
        if inst.record(Outcome.OK, self._clock()) is InstanceState.DOWN:
            log.info("%s %s back: it answered a request", inst.role.value, inst.name)
        self._state_seen(inst)

    def _state_seen(self, inst: Instance) -> None:
        """After an outcome: the up gauge, and a re-probe loop for a configured instance that is DOWN."""
        self.metrics.up.labels(inst.role.value, inst.name).set(1 if inst.state is InstanceState.UP else 0)
        if inst.state is InstanceState.DOWN and not inst.ad_hoc and not self._stopped \
                and inst.url not in self._reprobes:
            self._reprobes[inst.url] = asyncio.get_running_loop().create_task(self._reprobe(inst))

    @contextlib.asynccontextmanager
    async def _call(self, inst: Instance, method: str, path: str, data: bytes | None,
                    headers: CIMultiDict[str]) -> AsyncIterator[aiohttp.ClientResponse]:
        """One request to ``inst``: counted in flight until its response is released; the response from its
        headers on (their latency observed).  A pooled connection the instance closed while idle (a keep-alive
        ending as the request goes out) fails before any header: once more then, on another connection; an
        instance that is really gone refuses that one (unreachable)."""
        labels = (inst.role.value, inst.name)
        inst.in_flight += 1
        self.metrics.in_flight.labels(*labels).set(inst.in_flight)
        try:
            sent = self._clock()
            try:
                resp = await self._session.request(method, inst.url + path, data=data, headers=headers)
            except aiohttp.ServerDisconnectedError:
                log.debug("%s %s%s: pooled connection closed under the request; once more", method, inst.url, path)
                resp = await self._session.request(method, inst.url + path, data=data, headers=headers)
            async with resp:
                self.metrics.latency.labels(*labels).observe(self._clock() - sent)
                yield resp
        finally:
            inst.in_flight -= 1
            self.metrics.in_flight.labels(*labels).set(inst.in_flight)

    async def _prefill_leg(self, path: str, req: dict, headers: CIMultiDict[str], kv_id: str, routing: Routing,
                           named: list[Instance], trace: _Trace) -> Instance | None:
        """Prefill on one instance; that instance, or None (counted, logged) when none served it: decode
        recomputes.  Tried in turn, each once: the instances the request named, then the configured ones, up ones
        first, then down ones (a real attempt: the router's view may be stale); see _tries_next."""
        kv: dict = {"remote_decoder": {"kv_request_id": kv_id}}
        if routing.kv_source is not None:  # the legal pair: pull the prefix from the source, compute the rest
            kv["remote_kv_source"] = peer_params(_source_id(kv_id), routing.kv_source)
        pre = dict(req, max_tokens=1, stream=False, kv_transfer_params=kv)
        pre.pop("stream_options", None)  # only valid with stream=true
        pre.pop("min_tokens", None)  # vLLM refuses min_tokens > max_tokens (1 here)
        if "max_completion_tokens" in pre:
            pre["max_completion_tokens"] = 1
        data = _encode(pre)
        errors: list[UpstreamError] = []
        for inst in self._prefill_order(named):
            was_up = inst.state is InstanceState.UP
            trace.prefill = inst.name
            err = await self._try_prefill(inst, path, data, headers, check_worker=not was_up)
            if err is None:
                return inst
            errors.append(err)
            self.metrics.prefill_failures.labels(inst.name, err.reason.value).inc()
            self._failed(inst, err)
            log.info("prefill on %s (%s) failed for %s: %s", inst.name, "up" if was_up else "down",
                     trace.request_id, err)
            if not _tries_next(err, was_up):
                break
        self._recompute(errors, trace)
        return None

    def _prefill_order(self, named: list[Instance]) -> Iterator[Instance]:
        """The prefill instances one request tries, each once (see _prefill_leg)."""
        tried: list[Instance] = []
        for inst in named:
            if not any(inst is t for t in tried):
                tried.append(inst)
                yield inst
        while (inst := self.prefill.pick(exclude=tuple(tried))) is not None:
            tried.append(inst)
            yield inst

    async def _try_prefill(self, inst: Instance, path: str, data: bytes, headers: CIMultiDict[str],
                           check_worker: bool) -> UpstreamError | None:
        """One prefill call; None when it succeeded (the KV is parked in that engine's worker).  `check_worker`
        (a down instance): its worker must accept a connection first, else the engine would compute a KV that
        decode cannot fetch (decode would recompute all the same, uncounted here, and the engine's answer would
        bring the instance back for the requests after it)."""
        if check_worker and (why := await self._worker_error(inst)):
            return UpstreamError(Reason.UNREACHABLE, why)
        try:
            async with self._call(inst, "POST", path, data, headers) as r:
                detail = (await r.read())[:300].decode(errors="replace")
                if r.status == 200:
                    self._ok(inst)
                    return None
                return UpstreamError(Reason.HTTP_5XX if r.status >= 500 else Reason.HTTP_4XX,
                                     f"HTTP {r.status}: {detail}")
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            return classify(e)

    def _recompute(self, errors: list[UpstreamError], trace: _Trace) -> None:
        """Count and log a request that goes to decode without a prefill's KV.  The reason is the last failure
        that reached an instance; "unreachable" when none could be reached (or there was none to try)."""
        reached = [e for e in errors if e.reason is not Reason.UNREACHABLE]
        reason = reached[-1].reason if reached else Reason.UNREACHABLE
        self.metrics.recomputes.labels(reason.value).inc()
        why = (f"prefill failed ({reached[-1]})" if reached else
               f"no prefill instance reachable ({len(errors)} tried)")
        trace.note = f"recomputed: {why}"
        log.warning("decode recomputes the prompt of %s, reason %s: %s", trace.request_id, reason.value, why)

    async def _relay(self, request: web.Request, pool: Pool, method: str, path: str, data: bytes | None,
                     headers: CIMultiDict[str]) -> web.StreamResponse:
        """Send to one instance of `pool` and stream its answer back as it comes (status, headers, body).

        Only an unreachable instance is tried again elsewhere (nothing was sent).  If the instance breaks after its
        headers went out, the client's response is cut (connection closed, no final chunk): the client sees a
        broken response, never a short one that looks complete.  Errors on the client's side of the relay (it
        reset, or stopped reading for read_timeout_s) end the relay without counting against the instance."""
        trace: _Trace = request["trace"]
        tried: tuple[Instance, ...] = ()
        errors: list[str] = []
        while (inst := pool.pick(exclude=tried)) is not None:
            tried += (inst,)
            role = inst.role.value
            trace.decode = inst.name
            try:
                async with self._call(inst, method, path, data, headers) as up:
                    if up.status >= 500:
                        self._failed(inst, UpstreamError(Reason.HTTP_5XX, f"HTTP {up.status}"))
                    else:
                        self._ok(inst)
                    resp = web.StreamResponse(status=up.status, reason=up.reason,
                                              headers=forwarded(up.headers, NOT_FORWARDED_DOWN))
                    if self.draining:
                        resp.force_close()  # Connection: close: the client's next request goes to another router
                    if not await self._to_client(request, resp.prepare(request)):
                        return resp
                    while True:
                        try:
                            chunk = await up.content.readany()
                        except (aiohttp.ClientError, asyncio.TimeoutError) as e:  # the instance broke mid-answer
                            err = classify(e)
                            self._failed(inst, err)
                            self.metrics.cut.labels(role, inst.name).inc()
                            trace.note = f"cut: upstream {err}"
                            log.warning("%s %s broke mid-answer (%s) for %s: client's response cut", role,
                                        inst.name, err, trace.request_id)
                            transport = request.transport
                            if transport is not None:
                                transport.close()  # no final chunk: the client sees the break
                                # what the client has not taken yet gets read_timeout_s, like any write
                                asyncio.get_running_loop().call_later(self.cfg.read_timeout_s, transport.abort)
                            return resp
                        if not chunk:
                            break
                        if not await self._to_client(request, resp.write(chunk)):
                            return resp
                    await self._to_client(request, resp.write_eof())
                    return resp
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:  # before any byte went to the client
                err = classify(e)
                self._failed(inst, err)
                errors.append(f"{inst.name}: {err}")
                if err.reason is not Reason.UNREACHABLE:
                    status = {Reason.TIMEOUT: 504, Reason.LOCAL: 503}.get(err.reason, 502)
                    return web.json_response({"error": f"{role} instance failed: {inst.name}: {err}"},
                                             status=status)
        return web.json_response({"error": "no instance reachable: " + "; ".join(errors)}, status=502)

    async def _to_client(self, request: web.Request, write) -> bool:
        """One write to the client, within read_timeout_s; False (and the connection dropped) if the client reset
        or stopped reading: the instance is not at fault, and leaving the relay closes its connection (vLLM
        aborts the request)."""
        trace: _Trace = request["trace"]
        try:
            async with asyncio.timeout(self.cfg.read_timeout_s):  # no task per write, unlike wait_for on 3.11
                await write
            return True
        except (ConnectionResetError, asyncio.TimeoutError) as e:  # aiohttp's ClientConnectionResetError is one
            if not trace.client_gone:
                trace.client_gone = True
                trace.note = "client disconnected" if isinstance(e, ConnectionResetError) else "client stalled"
                self.metrics.disconnects.inc()
            if request.transport is not None:
                request.transport.abort()  # a stalled client's buffered bytes are not worth waiting for
            return False

    # ---- health ---------------------------------------------------------------------------------------------------

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.health_interval_s)
            try:
                await self._health_round()
            except Exception:  # noqa: BLE001  a bug in a round must not end health checking for good
                log.exception("health round failed")

    async def _health_round(self) -> None:
        await asyncio.gather(*(self._probe(i, Probe.ROUND) for i in self.instances))
        self.health_round_at = self._clock()

    async def _reprobe(self, inst: Instance) -> None:
        """Probe a DOWN instance at Backoff delays until it is UP (by this, a health round or a request)."""
        backoff = Backoff(self.cfg.reprobe_first_s, self.cfg.health_interval_s)
        try:
            while inst.state is InstanceState.DOWN:
                await asyncio.sleep(backoff.next())
                if inst.state is InstanceState.DOWN:
                    try:
                        await self._probe(inst, Probe.REPROBE)
                    except Exception:  # noqa: BLE001  a bug in one probe must not end re-probing for good
                        log.exception("re-probe of %s failed", inst.name)
        finally:
            self._reprobes.pop(inst.url, None)

    async def _probe(self, inst: Instance, by: Probe) -> None:
        """One instance's /health (200 within health_timeout_s) and, for prefill, its worker's control port
        (accepts a TCP connection: the decode worker must reach it to fetch this engine's KV).  Any error is that
        instance's (e.g. a host name that cannot be encoded), never the round's."""
        err = ""
        try:
            async with self._probes.get(inst.url + "/health") as r:
                await r.read()
                if r.status != 200:
                    err = f"/health answered HTTP {r.status}"
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            err = f"/health: {classify(e)}"
        except Exception as e:  # noqa: BLE001
            err = f"/health: {type(e).__name__}: {e}"
        if inst.worker is not None:
            worker_err = await self._worker_error(inst)
            err = err or worker_err
        before = inst.record(Outcome.FAILED if err else Outcome.OK, self._clock(), err)
        if before is not inst.state:
            if err:
                log.warning("%s %s taken out by the %s: %s", inst.role.value, inst.name, by.value, err)
            else:
                log.info("%s %s back: its %s passed", inst.role.value, inst.name, by.value)
        self._state_seen(inst)

    async def _worker_error(self, inst: Instance) -> str:
        """Why a prefill instance's worker does not accept a TCP connection within health_timeout_s ("" if it
        does); noted in worker_reachable."""
        try:
            _, w = await asyncio.wait_for(asyncio.open_connection(*inst.worker), self.cfg.health_timeout_s)
            w.close()
            inst.worker_reachable = True
            return ""
        except Exception as e:  # noqa: BLE001  OSError, TimeoutError, UnicodeError from a bad name, ...
            inst.worker_reachable = False
            return f"worker {inst.worker[0]}:{inst.worker[1]} unreachable: {e or type(e).__name__}"


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


def _source_id(kv_id: str, leg: str = "") -> str:
    """The kv_request_id of a request's pull from its KV source: its own, so that the source's parked rows and the
    prefill's (under kv_id) can never be taken for each other, even were the source the prefill's own worker; a
    decode leg that pulls because no prefill served the request gets another one (``leg``)."""
    return f"{kv_id}-{leg}src" if leg else f"{kv_id}-src"


def _host_port(inst: Instance) -> HostPort:
    u = urllib.parse.urlsplit(inst.url)
    return HostPort(u.hostname or "", u.port or 80)


def serve(cfg: RouterConfig) -> None:
    asyncio.run(_serve(cfg))
