"""The router's rooms without a server: the fleet, what outcomes do to instances and /health, each leg's body."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from p2pworker.router.config import Lifecycle, RouterConfig, check_roles
from p2pworker.router.fleet import Fleet
from p2pworker.router.health import Health
from p2pworker.router.legs import aggregated_body, decode_body, prefill_body, source_id, tries_next
from p2pworker.router.metrics import RouterMetrics
from p2pworker.router.pool import InstanceState, Role
from p2pworker.router.routing import HostPort, Mode, Routing
from p2pworker.router.upstream import Reason, UpstreamError

CFG = RouterConfig(prefill=("http://pre:8100,worker=pre:5711",), decode=("http://dec:8200", "http://dec:8201"))


def test_the_roles_a_mode_needs_are_checked_and_an_instance_is_listed_once():
    check_roles(CFG)
    for bad, why in [(RouterConfig(prefill=("http://p:1",), decode=()), "at least one --decode"),
                     (RouterConfig(prefill=(), decode=("http://d:1",)), "PD mode needs"),
                     (RouterConfig(prefill=("http://p:1",), decode=("http://d:1",), mode=Mode.AGGREGATED),
                      "aggregated mode takes no")]:
        with pytest.raises(ValueError, match=why):
            check_roles(bad)
    with pytest.raises(ValueError, match="listed twice"):
        Fleet(RouterConfig(prefill=(), decode=("http://d:1", "http://d:1/")), RouterMetrics())
    fleet = Fleet(CFG, RouterMetrics())
    assert [r for r, _ in fleet.roles()] == [Role.PREFILL, Role.DECODE]
    agg = Fleet(RouterConfig(prefill=(), decode=("http://d:1",), mode=Mode.AGGREGATED), RouterMetrics())
    assert [r for r, _ in agg.roles()] == [Role.DECODE]
    assert fleet.named_prefill(HostPort("pre", 8100)) is fleet.prefill.instances[0]
    assert fleet.named_prefill(HostPort("10.0.0.9", 8100)).ad_hoc and list(fleet.ad_hoc) == ["10.0.0.9:8100"]


def test_outcomes_move_instances_and_health_says_which_role_has_none_up():
    async def scenario():
        metrics, life = RouterMetrics(), Lifecycle()
        fleet = Fleet(CFG, metrics)
        health = Health(CFG, fleet, metrics, life, clock=lambda: 10.0)
        pre, dec = fleet.prefill.instances[0], fleet.decode.instances[0]
        assert health.view()[1] == 200 and health.view()[0]["status"] == "ok"
        health.failed(dec, UpstreamError(Reason.LOCAL, "EMFILE"))  # ours, not the instance's
        assert dec.state is InstanceState.UP
        health.failed(pre, UpstreamError(Reason.UNREACHABLE, "refused"))
        assert pre.state is InstanceState.DOWN and pre.failed_at == 10.0
        view, status = health.view()
        assert (status, view["status"], view["no_instance_up"]) == (503, "unavailable", ["prefill"])
        assert view["prefill"][0] == {"url": "http://pre:8100", "state": "down", "in_flight": 0,
                                      "last_error": "unreachable: refused", "worker": "pre:5711",
                                      "worker_reachable": None}
        up = {"role": "prefill", "instance": "pre:8100"}
        assert metrics.registry.get_sample_value("p2pworker_router_instance_up", up) == 0
        health.ok(pre)
        assert pre.state is InstanceState.UP and health.view()[0]["status"] == "ok"
        life.stopped = True
        await health.stop_tasks()  # the re-probe loop the DOWN instance got
        life.draining = True
        assert health.view()[1] == 503 and health.view()[0]["status"] == "draining"

    asyncio.run(scenario())


def test_each_leg_sends_its_own_transfer_params_and_never_the_clients():
    req = {"prompt": "hi", "max_tokens": 50, "min_tokens": 5, "stream": True, "stream_options": {},
           "max_completion_tokens": 50, "kv_transfer_params": {"client": "x"}}
    src = Routing(kv_source=HostPort("peer", 5711))
    pre = msgspec.json.decode(prefill_body(req, "k", src))
    assert {k: pre[k] for k in ("max_tokens", "stream", "max_completion_tokens")} == \
        {"max_tokens": 1, "stream": False, "max_completion_tokens": 1}
    assert "min_tokens" not in pre and "stream_options" not in pre
    assert pre["kv_transfer_params"] == {"remote_decoder": {"kv_request_id": "k"}, "remote_kv_source":
                                         {"kv_request_id": "k-src", "remote_host": "peer", "remote_port": 5711}}
    fleet = Fleet(CFG, RouterMetrics())
    by = fleet.prefill.instances[0]
    dec = msgspec.json.decode(decode_body(req, "k", src, by))
    assert dec["kv_transfer_params"] == {"remote_prefiller": {"kv_request_id": "k", "remote_host": "pre",
                                                              "remote_port": 5711}}
    assert dec["max_tokens"] == 50 and dec["stream"] is True
    alone = msgspec.json.decode(decode_body(req, "k", src, None))
    assert alone["kv_transfer_params"]["remote_kv_source"]["kv_request_id"] == source_id("k", "decode") == \
        "k-decodesrc"
    assert "kv_transfer_params" not in msgspec.json.decode(decode_body(req, "k", Routing(), None))
    assert aggregated_body(b"as-sent", req, Routing(), "k") == b"as-sent"  # not re-encoded
    assert msgspec.json.decode(aggregated_body(b"", req, src, "k"))["kv_transfer_params"] == \
        {"remote_kv_source": {"kv_request_id": "k-src", "remote_host": "peer", "remote_port": 5711}}


def test_after_a_failed_prefill_the_next_is_tried_only_when_nothing_was_sent_or_little_was_expected():
    table = {(reason, was_up): tries_next(UpstreamError(reason, ""), was_up) for reason in Reason
             for was_up in (True, False)}
    assert {k for k, v in table.items() if v} == {(Reason.UNREACHABLE, True)} | {
        (r, False) for r in Reason if r is not Reason.HTTP_4XX}
