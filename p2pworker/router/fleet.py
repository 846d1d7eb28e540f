"""The instances a router sends to: the configured prefill and decode pools, and the prefill instances requests
named that were not configured (ad hoc)."""

from __future__ import annotations

import collections
import logging
import urllib.parse

from p2pworker.router.config import RouterConfig
from p2pworker.router.metrics import RouterMetrics
from p2pworker.router.pool import Instance, Pool, Role, parse_instance
from p2pworker.router.routing import HostPort, Mode

log = logging.getLogger("p2pworker.router")

# ad-hoc prefill instances remembered (their state, their series); the least recently named is forgotten first, so
# that clients naming ever new addresses cannot grow the router's memory or its /metrics without bound
AD_HOC_MAX = 64


class Fleet:
    def __init__(self, cfg: RouterConfig, metrics: RouterMetrics):
        self.cfg = cfg
        self.metrics = metrics
        self.prefill = Pool([parse_instance(Role.PREFILL, s, cfg.default_worker_port) for s in cfg.prefill],
                            cfg.policy)
        self.decode = Pool([parse_instance(Role.DECODE, s, cfg.default_worker_port) for s in cfg.decode], cfg.policy)
        names = [i.url for i in self.instances]
        if len(set(names)) != len(names):
            raise ValueError(f"an instance is listed twice: {names}")
        self.ad_hoc: collections.OrderedDict[str, Instance] = collections.OrderedDict()  # by host:port, LRU first

    @property
    def instances(self) -> list[Instance]:
        """The configured instances (not the ad-hoc ones)."""
        return self.prefill.instances + self.decode.instances

    def roles(self) -> list[tuple[Role, Pool]]:
        """The roles this mode needs an instance up of."""
        return [(Role.PREFILL, self.prefill), (Role.DECODE, self.decode)] if self.cfg.mode is Mode.PD \
            else [(Role.DECODE, self.decode)]

    def named_prefill(self, hp: HostPort) -> Instance:
        """The prefill instance a routing header names: a configured one with that host:port, else an ad-hoc one
        (its worker where parse_instance puts it: the default port on its host), remembered and logged once."""
        for inst in self.prefill.instances:
            if host_port(inst) == hp:
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


def host_port(inst: Instance) -> HostPort:
    u = urllib.parse.urlsplit(inst.url)
    return HostPort(u.hostname or "", u.port or 80)
