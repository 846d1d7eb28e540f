"""Calls to the instances: one pooled aiohttp session, each call counted in flight, and an answer relayed to the
client as it comes (status, headers, body)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import AsyncIterator, Callable

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

from p2pworker.router.access import Trace
from p2pworker.router.config import Lifecycle, RouterConfig
from p2pworker.router.health import Health
from p2pworker.router.metrics import RouterMetrics
from p2pworker.router.pool import Instance, Pool
from p2pworker.router.upstream import NOT_FORWARDED_DOWN, Reason, UpstreamError, classify, forwarded

log = logging.getLogger("p2pworker.router")


class Upstream:
    def __init__(self, cfg: RouterConfig, health: Health, metrics: RouterMetrics, life: Lifecycle,
                 clock: Callable[[], float]):
        self.cfg = cfg
        self.health = health
        self.metrics = metrics
        self.life = life
        self._clock = clock
        self._session: aiohttp.ClientSession | None = None

    def start(self) -> None:
        self._session = aiohttp.ClientSession(
            # no pool limit: a request never waits for a free connection (aiohttp counts that wait in its connect
            # timeout, so a busy pool would look like dead instances); each client holds at most two connections
            connector=aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=self.cfg.keepalive_s),
            # connect: name lookup + TCP connect (no pool wait: no pool limit); sock_read: silence mid-answer
            timeout=aiohttp.ClientTimeout(total=None, connect=self.cfg.connect_timeout_s,
                                          sock_connect=self.cfg.connect_timeout_s, sock_read=self.cfg.read_timeout_s),
            auto_decompress=False,  # bytes are relayed as the engine sent them, Content-Encoding included
        )

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    @contextlib.asynccontextmanager
    async def call(self, inst: Instance, method: str, path: str, data: bytes | None,
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

    async def relay(self, request: web.Request, pool: Pool, method: str, path: str, data: bytes | None,
                    headers: CIMultiDict[str]) -> web.StreamResponse:
        """Send to one instance of `pool` and stream its answer back as it comes (status, headers, body).

        Only an unreachable instance is tried again elsewhere (nothing was sent).  If the instance breaks after its
        headers went out, the client's response is cut (connection closed, no final chunk): the client sees a
        broken response, never a short one that looks complete.  Errors on the client's side of the relay (it
        reset, or stopped reading for read_timeout_s) end the relay without counting against the instance."""
        trace: Trace = request["trace"]
        tried: tuple[Instance, ...] = ()
        errors: list[str] = []
        while (inst := pool.pick(exclude=tried)) is not None:
            tried += (inst,)
            trace.decode = inst.name
            try:
                async with self.call(inst, method, path, data, headers) as up:
                    return await self._answer(request, inst, up)
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:  # before any byte went to the client
                err = classify(e)
                self.health.failed(inst, err)
                errors.append(f"{inst.name}: {err}")
                if err.reason is not Reason.UNREACHABLE:
                    status = {Reason.TIMEOUT: 504, Reason.LOCAL: 503}.get(err.reason, 502)
                    return web.json_response({"error": f"{inst.role.value} instance failed: {inst.name}: {err}"},
                                             status=status)
        return web.json_response({"error": "no instance reachable: " + "; ".join(errors)}, status=502)

    async def _answer(self, request: web.Request, inst: Instance,
                      up: aiohttp.ClientResponse) -> web.StreamResponse:
        """Relay one instance's answer, its headers received: status and headers, then the body as it comes."""
        if up.status >= 500:
            self.health.failed(inst, UpstreamError(Reason.HTTP_5XX, f"HTTP {up.status}"))
        else:
            self.health.ok(inst)
        resp = web.StreamResponse(status=up.status, reason=up.reason,
                                  headers=forwarded(up.headers, NOT_FORWARDED_DOWN))
        if self.life.draining:
            resp.force_close()  # Connection: close: the client's next request goes to another router
        if not await self.to_client(request, resp.prepare(request)):
            return resp
        while True:
            try:
                chunk = await up.content.readany()
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:  # the instance broke mid-answer
                self._cut(request, inst, classify(e))
                return resp
            if not chunk:
                break
            if not await self.to_client(request, resp.write(chunk)):
                return resp
        await self.to_client(request, resp.write_eof())
        return resp

    def _cut(self, request: web.Request, inst: Instance, err: UpstreamError) -> None:
        """The instance broke after its headers went to the client: cut the client's response."""
        trace: Trace = request["trace"]
        role = inst.role.value
        self.health.failed(inst, err)
        self.metrics.cut.labels(role, inst.name).inc()
        trace.note = f"cut: upstream {err}"
        log.warning("%s %s broke mid-answer (%s) for %s: client's response cut", role,
                    inst.name, err, trace.request_id)
        transport = request.transport
        if transport is not None:
            transport.close()  # no final chunk: the client sees the break
            # what the client has not taken yet gets read_timeout_s, like any write
            asyncio.get_running_loop().call_later(self.cfg.read_timeout_s, transport.abort)

    async def to_client(self, request: web.Request, write) -> bool:
        """One write to the client, within read_timeout_s; False (and the connection dropped) if the client reset
        or stopped reading: the instance is not at fault, and leaving the relay closes its connection (vLLM
        aborts the request)."""
        trace: Trace = request["trace"]
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
