"""What the router knows of each instance's health: the outcome of every call (pool.MOVES), the health rounds
every ``health_interval_s``, the re-probes of a DOWN instance at Backoff delays, and the /health view."""

from __future__ import annotations

import asyncio
import enum
import logging
from typing import Callable

import aiohttp

from p2pworker.router.config import Lifecycle, RouterConfig
from p2pworker.router.fleet import Fleet
from p2pworker.router.metrics import RouterMetrics
from p2pworker.router.pool import Backoff, Instance, InstanceState, Outcome
from p2pworker.router.upstream import UpstreamError, classify

log = logging.getLogger("p2pworker.router")


class Probe(enum.Enum):
    """What probed an instance (its log lines say)."""

    ROUND = "health round"  # every health_interval_s, every configured instance
    REPROBE = "re-probe"  # a DOWN instance, at Backoff delays


class Health:
    def __init__(self, cfg: RouterConfig, fleet: Fleet, metrics: RouterMetrics, life: Lifecycle,
                 clock: Callable[[], float]):
        self.cfg = cfg
        self.fleet = fleet
        self.metrics = metrics
        self.life = life
        self._clock = clock
        self.round_at: float | None = None
        self._probes: aiohttp.ClientSession | None = None
        self._loop_task: asyncio.Task | None = None
        self._reprobes: dict[str, asyncio.Task] = {}  # by URL: the re-probe loop of each DOWN configured instance

    # ---- outcomes -------------------------------------------------------------------------------------------------

    def failed(self, inst: Instance, err: UpstreamError) -> None:
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

    def ok(self, inst: Instance) -> None:
        if inst.record(Outcome.OK, self._clock()) is InstanceState.DOWN:
            log.info("%s %s back: it answered a request", inst.role.value, inst.name)
        self._state_seen(inst)

    def _state_seen(self, inst: Instance) -> None:
        """After an outcome: the up gauge, and a re-probe loop for a configured instance that is DOWN."""
        self.metrics.up.labels(inst.role.value, inst.name).set(1 if inst.state is InstanceState.UP else 0)
        if inst.state is InstanceState.DOWN and not inst.ad_hoc and not self.life.stopped \
                and inst.url not in self._reprobes:
            self._reprobes[inst.url] = asyncio.get_running_loop().create_task(self._reprobe(inst))

    # ---- rounds and re-probes -------------------------------------------------------------------------------------

    async def start(self) -> None:
        # health rounds on their own connections: busy request traffic cannot make a probe fail
        self._probes = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=True),
                                             timeout=aiohttp.ClientTimeout(total=self.cfg.health_timeout_s))
        await self.round()  # /health means something from the first request on
        self._loop_task = asyncio.create_task(self._loop())

    async def stop_tasks(self) -> None:
        """End the rounds and every re-probe loop (life.stopped is set: no new one starts)."""
        tasks = [t for t in (self._loop_task, *self._reprobes.values()) if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def close(self) -> None:
        if self._probes is not None:
            await self._probes.close()

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.health_interval_s)
            try:
                await self.round()
            except Exception:  # noqa: BLE001  a bug in a round must not end health checking for good
                log.exception("health round failed")

    async def round(self) -> None:
        await asyncio.gather(*(self._probe(i, Probe.ROUND) for i in self.fleet.instances))
        self.round_at = self._clock()

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
            worker_err = await self.worker_error(inst)
            err = err or worker_err
        before = inst.record(Outcome.FAILED if err else Outcome.OK, self._clock(), err)
        if before is not inst.state:
            if err:
                log.warning("%s %s taken out by the %s: %s", inst.role.value, inst.name, by.value, err)
            else:
                log.info("%s %s back: its %s passed", inst.role.value, inst.name, by.value)
        self._state_seen(inst)

    async def worker_error(self, inst: Instance) -> str:
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

    # ---- the /health view -----------------------------------------------------------------------------------------

    def view(self) -> tuple[dict, int]:
        """Each instance as the last probes and the requests since saw it; 200 while every role the mode needs
        has an instance up, else 503 naming the roles without one (PD with no prefill up would still answer, but
        by recomputing every prompt: a load balancer should know)."""
        fleet, draining = self.fleet, self.life.draining
        none_up = [role.value for role, pool in fleet.roles() if not pool.up()]
        all_up = all(i.state is InstanceState.UP for i in fleet.instances)
        status = ("draining" if draining else "unavailable" if none_up else "ok" if all_up else "degraded")
        age = None if self.round_at is None else round(self._clock() - self.round_at, 3)
        return ({"status": status, "mode": self.cfg.mode.value, "no_instance_up": none_up,
                 "health_round_age_s": age,
                 "prefill": [_instance_view(i) for i in fleet.prefill.instances],
                 "decode": [_instance_view(i) for i in fleet.decode.instances],
                 "ad_hoc_prefill": [_instance_view(i) for i in fleet.ad_hoc.values()]},
                503 if none_up or draining else 200)


def _instance_view(i: Instance) -> dict:
    d = {"url": i.url, "state": i.state.value, "in_flight": i.in_flight, "last_error": i.last_error}
    if i.worker is not None:
        d["worker"] = f"{i.worker[0]}:{i.worker[1]}"
        d["worker_reachable"] = i.worker_reachable
    return d
