"""The tier's rooms (jobs, lookups, finished replay, outbox, roles) on their own: no worker, no ring, no vLLM engine.

The supervisor and the ring client are small stand-ins that record what reaches them; vLLM's own dataclasses
(TransferJob, JobResult, ReqContext, LookupResult) are real, so a field that differs between 0.32 and 0.33 shows
here."""

from __future__ import annotations

import hashlib
import logging
import time

import numpy as np
import pytest
from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key
from vllm.v1.kv_offload.tiering.base import JobResult, TransferJob

from p2pworker import api
from p2pworker.errors import MessageTooLarge, P2PError
from p2pworker.session.client import UNREACHABLE
from vllm_adapter.finished import RECENT_FINISHED_MAX, RECENT_FINISHED_S, REPLAY_IN_RING_MAX, FinishedReplay
from vllm_adapter.hints import FAILED_S, PullPath, SourceHints
from vllm_adapter.jobs import STOP_RESET_S, JobBook, JobKind, LoadState, load_state
from vllm_adapter.lookups import AskedLookups, PeerLookups
from vllm_adapter.metrics import Counts
from vllm_adapter.outbox import Outbox
from vllm_adapter.roles import PDRole, RoleKind, parse_role, role_of
from vllm_adapter.siblings import Siblings

pytestmark = pytest.mark.timeout(10)

READY = api.Ready(node_id="n1", address="tcp://127.0.0.1:5710", backend="tcp", fingerprint="fp", admin="adm")


# ------------------------------------------------------------ stand-ins and builders
class FakeClient:
    """The ring client: records what the outbox or the replay puts on the command ring.

    ``room``: how many more commands the ring takes (None: unbounded); ``takes``: per send, whether the ring takes
    it (consumed first; a ring that frees slots between sends); ``too_large``: commands whose send raises
    MessageTooLarge; ``flush_error``: what client.flush raises; ``send_error``: what every send raises."""

    def __init__(self, ready: api.Ready | None = READY, room: int | None = None):
        self.ready = ready
        self.room = room
        self.takes: list[bool] = []
        self.sent: list[api.Command] = []
        self.flushes = 0
        self.too_large: list[api.Command] = []
        self.flush_error: Exception | None = None
        self.send_error: Exception | None = None

    def send(self, cmd: api.Command) -> bool:
        if self.send_error is not None:
            raise self.send_error
        if any(cmd is c for c in self.too_large):
            raise MessageTooLarge(1 << 30, 1 << 20, "cmd")
        if self.takes and not self.takes.pop(0):
            return False
        if self.room is not None:
            if self.room <= 0:
                return False
            self.room -= 1
        self.sent.append(cmd)
        return True

    def flush(self) -> bool:
        self.flushes += 1
        if self.flush_error is not None:
            raise self.flush_error
        return True


class FakeSupervisor:
    """The three things the rooms read of WorkerSupervisor: client, ready, serving."""

    def __init__(self, client: FakeClient | None = None, serving: bool = True):
        self.client = client
        self.serving = serving

    @property
    def ready(self) -> bool:
        return self.client is not None and self.client.ready is not None


class FakeEngine:
    """engine_hook.EngineCore as JobBook.end_parked_for_stop uses it."""

    def __init__(self, aborting: bool):
        self._aborting = aborting

    def aborting(self) -> bool:
        return self._aborting


class Refusals:
    """The outbox's refuse callback: records (command, why)."""

    def __init__(self):
        self.calls: list[tuple[api.Command, str]] = []

    def __call__(self, cmd: api.Command, why: str) -> None:
        self.calls.append((cmd, why))


def key(i: int) -> bytes:
    return make_offload_key(hashlib.sha256(b"room%d" % i).digest(), 0)


def ctx(req_id: str = "r", params: dict | None = None) -> ReqContext:
    return ReqContext(req_id=req_id, kv_transfer_params=params)


def tjob(job_id: int, keys: list[bytes], rows: list[int] | None = None, load: bool = False) -> TransferJob:
    rows = list(range(len(keys))) if rows is None else rows
    return TransferJob(job_id=job_id, keys=keys, chunk_ids=np.asarray(rows, dtype=np.int64), is_promotion=load,
                       req_context=ctx(f"req-{job_id}"))


NO_CLIENT = object()  # outbox(client=NO_CLIENT): the supervisor has no worker at all


def outbox(serving: bool = True, client=None) -> tuple[Outbox, FakeSupervisor, Refusals]:
    """An Outbox over a FakeSupervisor; ``client`` None: a ready FakeClient."""
    client = FakeClient() if client is None else None if client is NO_CLIENT else client
    sup = FakeSupervisor(client, serving)
    refusals = Refusals()
    return Outbox(sup, refusals), sup, refusals


def book(serving: bool = True) -> tuple[JobBook, Outbox, Counts]:
    box, _, _ = outbox(serving)
    counts = Counts()
    return JobBook("w", box, counts), box, counts


def job_finished(job_id: int, kind: str = "store", keys: list[bytes] | None = None, success: bool = True,
                reason: str = "") -> api.JobFinished:
    return api.JobFinished(job_id=job_id, kind=kind, success=success, keys=keys or [], nbytes=4096, seconds=0.25,
                           reason=reason)


# ------------------------------------------------------------ roles.py
PEER = {"kv_request_id": "kv-p", "remote_host": "10.0.0.2", "remote_port": 5710}
SOURCE = {"kv_request_id": "kv-s", "remote_host": "10.0.0.3", "remote_port": "5711"}  # a port may come as a string


@pytest.mark.parametrize(("params", "want"), [
    ({"remote_decoder": {"kv_request_id": "kv-d"}}, PDRole(RoleKind.PRODUCER, park_id="kv-d")),
    ({"remote_prefiller": PEER}, PDRole(RoleKind.CONSUMER, "kv-p", "10.0.0.2:5710")),
    ({"remote_kv_source": SOURCE}, PDRole(RoleKind.SYMMETRIC, "kv-s", "10.0.0.3:5711")),
    ({"remote_decoder": {"kv_request_id": "kv-d"}, "remote_kv_source": SOURCE},
     PDRole(RoleKind.PRODUCER_PULLING, "kv-s", "10.0.0.3:5711", park_id="kv-d")),
    # both a PD consumer and a symmetric one: the PD peer wins (it is looked for first)
    ({"remote_prefiller": PEER, "remote_kv_source": SOURCE}, PDRole(RoleKind.CONSUMER, "kv-p", "10.0.0.2:5710")),
    (None, PDRole(RoleKind.NONE)),
    ({}, PDRole(RoleKind.NONE)),
    ({"do_remote_prefill": True}, PDRole(RoleKind.NONE)),
    ("remote_decoder", PDRole(RoleKind.NONE)),
], ids=["producer", "consumer", "symmetric", "producer-pulling", "consumer-first", "none", "empty", "other-keys",
        "not-a-dict"])
def test_parse_role_reads_each_role_from_kv_transfer_params(params, want):
    assert parse_role(params) == want


@pytest.mark.parametrize(("params", "field"), [
    ({"remote_decoder": {}}, "remote_decoder"),
    ({"remote_decoder": {"kv_request_id": ""}}, "remote_decoder"),
    ({"remote_decoder": "kv-d"}, "remote_decoder"),
    ({"remote_prefiller": {**PEER, "remote_host": ""}}, "remote_prefiller"),
    ({"remote_prefiller": {**PEER, "remote_port": 0}}, "remote_prefiller"),
    ({"remote_prefiller": {**PEER, "remote_port": 65536}}, "remote_prefiller"),
    ({"remote_prefiller": {**PEER, "remote_port": "http"}}, "remote_prefiller"),
    ({"remote_prefiller": {**PEER, "kv_request_id": 7}}, "remote_prefiller"),
    ({"remote_kv_source": ["kv-s", "10.0.0.3", 5711]}, "remote_kv_source"),
])
def test_unusable_params_give_role_none_and_an_error_naming_the_field(params, field, caplog):
    with caplog.at_level(logging.ERROR, logger="vllm_adapter.tier"):
        role = parse_role(params)
    assert role == PDRole(RoleKind.NONE)
    assert any(field in r.getMessage() for r in caplog.records if r.levelno == logging.ERROR), caplog.text


def test_a_producer_with_an_unusable_source_stays_a_plain_producer(caplog):
    with caplog.at_level(logging.ERROR, logger="vllm_adapter.tier"):
        role = parse_role({"remote_decoder": {"kv_request_id": "kv-d"}, "remote_kv_source": {"kv_request_id": "x"}})
    assert role == PDRole(RoleKind.PRODUCER, park_id="kv-d")
    assert "remote_kv_source" in caplog.text


@pytest.mark.parametrize(("kind", "loads", "produces", "asks"), [
    (RoleKind.PRODUCER, False, True, False),
    (RoleKind.CONSUMER, True, False, False),
    (RoleKind.SYMMETRIC, True, False, True),
    (RoleKind.PRODUCER_PULLING, True, True, True),
    (RoleKind.NONE, False, False, False),
])
def test_role_kinds_say_what_the_tier_does_for_them(kind, loads, produces, asks):
    assert (kind.loads, kind.produces, kind.asks) == (loads, produces, asks)


def test_role_of_parses_once_and_keeps_the_role_in_the_request_context():
    c = ctx("r1", {"remote_prefiller": PEER})
    first = role_of(c)
    c.kv_transfer_params = {"remote_decoder": {"kv_request_id": "other"}}  # not read again: the role is kept
    assert role_of(c) is first and first.kind is RoleKind.CONSUMER
    assert c.get_state(PDRole) is first


# ------------------------------------------------------------ outbox.py
def test_outbox_queues_while_serving_and_refuses_otherwise():
    box, sup, _ = outbox()
    assert box.send(api.RequestFinished("a")) is True
    sup.serving = False
    assert box.send(api.RequestFinished("b")) is False  # no serving worker: the caller fails its job now
    assert box.commands == [api.RequestFinished("a")] and box.pending
    assert sup.client.sent == []  # send never touches the ring


@pytest.mark.parametrize("has_client", [False, True], ids=["no-client", "not-ready"])
def test_outbox_flush_keeps_commands_until_a_ready_worker(has_client):
    client = FakeClient(ready=None)
    box, sup, refusals = outbox(client=client if has_client else NO_CLIENT)
    assert sup.ready is False
    box.send(api.RequestFinished("a"))
    box.flush()
    assert box.commands == [api.RequestFinished("a")] and refusals.calls == []
    assert client.sent == [] and client.flushes == 0  # the ring of a worker not ready yet is not written


def test_outbox_flush_hands_commands_over_in_order_and_empties():
    box, sup, _ = outbox()
    cmds = [api.RequestFinished("a"), api.ConsumerDone("h:1", "b"), api.ResetCache()]
    for c in cmds:
        box.send(c)
    box.flush()
    assert sup.client.sent == cmds and sup.client.flushes == 1
    assert box.commands == [] and not box.pending


def test_a_full_ring_keeps_the_rest_in_order_for_the_next_flush():
    box, sup, _ = outbox(client=FakeClient(room=1))
    cmds = [api.RequestFinished(str(i)) for i in range(3)]
    for c in cmds:
        box.send(c)
    box.flush()
    assert sup.client.sent == cmds[:1] and box.commands == cmds[1:]
    sup.client.room = 5
    box.flush()
    assert sup.client.sent == cmds and box.commands == []


def test_a_refused_command_holds_back_later_ones_even_if_the_ring_would_take_them():
    # commands reach the worker in order: one the ring did not take is not overtaken by the next
    box, sup, _ = outbox()
    sup.client.takes = [True, False, True]
    cmds = [api.RequestFinished(str(i)) for i in range(3)]
    for c in cmds:
        box.send(c)
    box.flush()
    assert sup.client.sent == cmds[:1] and box.commands == cmds[1:]


def test_a_command_too_large_for_the_ring_is_refused_and_the_rest_go_on():
    box, sup, refusals = outbox()
    big = api.StoreJob(9, "kv", [key(0)], [0])
    sup.client.too_large.append(big)
    before, after = api.RequestFinished("a"), api.RequestFinished("b")
    for c in (before, big, after):
        box.send(c)
    box.flush()
    assert sup.client.sent == [before, after] and box.commands == []
    assert len(refusals.calls) == 1 and refusals.calls[0][0] is big
    assert "exceeds the hard limit" in refusals.calls[0][1]


def test_a_broken_ring_on_flush_is_logged_and_nothing_is_lost(caplog):
    box, sup, refusals = outbox()
    sup.client.flush_error = P2PError("ring torn")
    box.send(api.RequestFinished("a"))
    with caplog.at_level(logging.ERROR, logger="vllm_adapter.tier"):
        box.flush()  # never raises into vLLM
    assert sup.client.sent == [] and box.commands == [api.RequestFinished("a")] and refusals.calls == []
    assert "ring torn" in caplog.text


def test_outbox_flush_delivers_what_was_queued_before_serving_stopped():
    # serving gates new commands only; what is queued goes to a ready ring until the gone hook clears it
    box, sup, _ = outbox()
    box.send(api.RequestFinished("a"))
    sup.serving = False
    box.flush()
    assert sup.client.sent == [api.RequestFinished("a")] and box.commands == []


def test_outbox_clear_drops_queued_commands():
    box, sup, _ = outbox()
    box.send(api.RequestFinished("a"))
    box.clear()
    box.flush()
    assert box.commands == [] and not box.pending and sup.client.sent == []


# ------------------------------------------------------------ jobs.py
def test_a_store_is_queued_then_reported_exactly_once(caplog):
    jobs, box, counts = book()
    keys = [key(1), key(2)]
    assert jobs.submit(JobKind.STORE, tjob(5, keys, [7, 3]), "kv-d", "refused") is True
    assert box.commands == [api.StoreJob(5, "kv-d", keys, [7, 3])]
    assert list(jobs.open) == [5] and jobs.open[5].kind is JobKind.STORE and jobs.pending
    assert jobs.take_results() == []  # open, not reported yet
    jobs.report(job_finished(5))
    with caplog.at_level(logging.ERROR, logger="vllm_adapter.tier"):
        jobs.report(job_finished(5))  # a second report of the same job: ignored
    assert jobs.take_results() == [JobResult(5, True, transfer_time=0.25, transfer_bytes=4096)]
    assert jobs.take_results() == [] and not jobs.pending and jobs.open == {}
    assert (counts.stores_ok, counts.stores_failed) == (1, 0)
    assert "unknown job 5" in caplog.text


def test_a_load_is_queued_with_its_peer_and_lands_every_key():
    jobs, box, counts = book()
    keys = [key(1), key(2), key(3)]
    job = tjob(6, keys, load=True)
    assert jobs.submit(JobKind.LOAD, job, "kv-p", "refused", address="10.0.0.2:5710")
    assert box.commands == [api.LoadJob(6, "10.0.0.2:5710", "kv-p", keys, [0, 1, 2])]
    jobs.report(job_finished(6, "load"))  # success: the worker does not echo the keys
    assert jobs.take_results() == [JobResult(6, True, successful_keys=keys, transfer_time=0.25, transfer_bytes=4096)]
    assert (counts.loads_ok, counts.loads_failed) == (1, 0) and not load_state(job.req_context).failed


def test_a_partly_failed_load_reports_only_its_own_landed_keys_and_marks_the_request():
    jobs, _, counts = book()
    keys = [key(1), key(2), key(3)]
    job = tjob(6, keys, load=True)
    jobs.submit(JobKind.LOAD, job, "kv-p", "refused", address="h:1")
    # the worker's list may name a key this job never asked for: vLLM requires a subset of the job's keys
    jobs.report(job_finished(6, "load", keys=[key(3), key(99)], success=False, reason="peer gone"))
    (res,) = jobs.take_results()
    assert (res.job_id, res.success, list(res.successful_keys)) == (6, False, [key(3)])
    assert load_state(job.req_context).failed and (counts.loads_ok, counts.loads_failed) == (0, 1)


@pytest.mark.parametrize("kind", [JobKind.STORE, JobKind.LOAD])
def test_a_job_without_a_serving_worker_fails_at_once(kind, caplog):
    jobs, box, counts = book(serving=False)
    job = tjob(3, [key(1)])
    with caplog.at_level(logging.WARNING, logger="vllm_adapter.tier"):
        assert jobs.submit(kind, job, "kv-x", "worker not ready", address="h:1") is False
    assert box.commands == [] and jobs.open == {}
    (res,) = jobs.take_results()
    assert (res.job_id, res.success) == (3, False)
    if kind is JobKind.LOAD:
        assert list(res.successful_keys) == [] and load_state(job.req_context).failed
        assert "worker not ready" in caplog.text and counts.loads_failed == 1
    else:
        assert counts.stores_failed == 1 and job.req_context.get_state(LoadState) is None


def test_a_load_not_to_be_sent_fails_at_once_even_with_a_serving_worker(caplog):
    jobs, box, counts = book()
    with caplog.at_level(logging.WARNING, logger="vllm_adapter.tier"):
        assert jobs.submit(JobKind.LOAD, tjob(4, [key(1)]), "", "not a PD consumer", send=False) is False
    assert box.commands == [] and jobs.open == {} and counts.loads_failed == 1
    assert [r.success for r in jobs.take_results()] == [False] and "not a PD consumer" in caplog.text


def test_a_job_past_the_key_limit_fails_without_reaching_the_ring(caplog):
    jobs, box, counts = book()
    keys = [key(0)] * (api.MAX_JOB_KEYS + 1)  # one shared bytes object: cheap at a million entries
    with caplog.at_level(logging.WARNING, logger="vllm_adapter.tier"):
        assert jobs.submit(JobKind.LOAD, tjob(8, keys, rows=[0]), "kv-big", "refused", address="h:1") is False
    assert box.commands == [] and jobs.open == {} and counts.loads_failed == 1
    assert [(r.job_id, r.success) for r in jobs.take_results()] == [(8, False)]
    assert "MAX_JOB_KEYS" in caplog.text


def test_a_skipped_store_is_reported_done_without_the_worker():
    jobs, box, counts = book()
    jobs.skip(11)
    assert jobs.take_results() == [JobResult(11, True)]
    assert box.commands == [] and jobs.open == {} and counts == Counts()


def test_fail_all_fails_only_open_jobs_and_only_once():
    jobs, _, counts = book()
    jobs.submit(JobKind.STORE, tjob(1, [key(1)]), "kv-a", "refused")
    t0 = time.monotonic() - 10.0  # open for ten seconds
    load = tjob(2, [key(2)])
    jobs.submit(JobKind.LOAD, load, "kv-b", "refused", address="h:1", now=t0)
    jobs.submit(JobKind.STORE, tjob(3, [key(3)]), "kv-c", "refused")
    jobs.report(job_finished(3))  # reported before the worker went: not failed again
    jobs.fail_all()
    jobs.fail_all()
    results = {r.job_id: r for r in jobs.take_results()}
    assert sorted(results) == [1, 2, 3] and jobs.open == {}
    assert (results[1].success, results[2].success, results[3].success) == (False, False, True)
    assert results[2].transfer_time >= 10.0  # its age, from the submit time given
    assert (counts.stores_ok, counts.stores_failed, counts.loads_failed) == (1, 1, 1)
    assert load_state(load.req_context).failed


def test_refuse_ends_an_open_jobs_command_once_and_leaves_other_commands():
    jobs, box, counts = book()
    jobs.submit(JobKind.STORE, tjob(1, [key(1)]), "kv-a", "refused")
    (cmd,) = box.commands
    assert jobs.refuse(cmd, "too large") is True
    assert jobs.refuse(cmd, "too large") is False  # its job already ended
    assert jobs.refuse(api.StoreJob(99, "kv", [key(1)], [0]), "x") is False  # not ours
    assert jobs.refuse(api.LookupKeys(1, "h:1", "kv", [key(1)]), "x") is False  # a lookup: not the book's
    assert [(r.job_id, r.success) for r in jobs.take_results()] == [(1, False)] and counts.stores_failed == 1


def test_an_outbox_refusal_fails_its_job_through_the_book():
    # wired as the tier wires them: the ring's MessageTooLarge reaches the book through the outbox's callback
    client = FakeClient()
    sup = FakeSupervisor(client)
    counts = Counts()
    box = Outbox(sup, lambda cmd, why: jobs.refuse(cmd, why))
    jobs = JobBook("w", box, counts)
    load = tjob(1, [key(1)])
    jobs.submit(JobKind.LOAD, load, "kv-a", "refused", address="h:1")
    client.too_large.append(box.commands[0])
    box.flush()
    assert client.sent == [] and jobs.open == {} and load_state(load.req_context).failed
    assert [(r.job_id, r.success) for r in jobs.take_results()] == [(1, False)] and counts.loads_failed == 1


@pytest.mark.parametrize("aborting", [False, True])
def test_shutdown_drain_ends_parked_stores_once_per_interval(aborting):
    client = FakeClient()
    box = Outbox(FakeSupervisor(client), Refusals())
    jobs = JobBook("w", box, Counts())
    jobs.submit(JobKind.STORE, tjob(1, [key(1)]), "kv-a", "refused")
    box.flush()
    jobs.end_parked_for_stop(FakeEngine(aborting))
    # on the ring at once (not left for a later poll); loads are cancelled only in abort mode
    assert client.sent[1:] == [api.ResetCache("vLLM is shutting down", loads=aborting)] and box.commands == []
    jobs.end_parked_for_stop(FakeEngine(aborting))  # well within STOP_RESET_S: not asked again
    assert len(client.sent) == 2 and box.commands == [] and list(jobs.open) == [1]


def test_shutdown_drain_asks_again_once_stop_reset_s_has_passed():
    # a request still finishing in the drain parks afresh: asked again every STOP_RESET_S while jobs are open
    client, now = FakeClient(), [100.0]
    box = Outbox(FakeSupervisor(client), Refusals())
    jobs = JobBook("w", box, Counts(), clock=lambda: now[0])
    jobs.submit(JobKind.STORE, tjob(1, [key(1)]), "kv-a", "refused")
    box.flush()
    jobs.end_parked_for_stop(FakeEngine(False))
    now[0] += STOP_RESET_S * 0.9
    jobs.end_parked_for_stop(FakeEngine(False))
    assert len(client.sent) == 2
    now[0] += STOP_RESET_S * 0.2
    jobs.end_parked_for_stop(FakeEngine(False))
    assert client.sent[1:] == [api.ResetCache("vLLM is shutting down", loads=False)] * 2


def test_shutdown_drain_without_a_serving_worker_queues_nothing():
    client = FakeClient()
    sup = FakeSupervisor(client, serving=False)
    box = Outbox(sup, Refusals())
    jobs = JobBook("w", box, Counts())
    jobs.end_parked_for_stop(FakeEngine(False))
    assert client.sent == [] and client.flushes == 0 and box.commands == []


# ------------------------------------------------------------ lookups.py: the asker
def ask_first(box: Outbox) -> AskedLookups:
    """An asker on the two-step path for every request (tier key pull_path = "ask_first")."""
    return AskedLookups(box, SourceHints(), Counts(), one_trip=False)


def test_a_requests_path_is_chosen_once_and_kept_in_its_own_context():
    box, _, _ = outbox()
    counts = Counts()
    asked = AskedLookups(box, SourceHints(), counts)
    a, b = ctx("a"), ctx("b")
    assert [asked.path(a, "h:1", key(i)) for i in range(3)] == [PullPath.ONE_TRIP] * 3
    assert a.get_state(PullPath) is PullPath.ONE_TRIP and b.get_state(PullPath) is None  # per request, not per id
    asked.send_asks()
    assert box.commands == [] and not asked.pending  # a one-trip request asks nothing until its load
    assert (counts.pulls_one_trip, counts.pulls_ask_first) == (1, 0)  # per request, not per key
    assert ask_first(box).path(b, "h:1", key(0)) is PullPath.ASK_FIRST  # pull_path = "ask_first"


def test_a_first_key_the_source_lately_lacked_takes_the_two_step_path_until_the_hint_ends():
    now = [100.0]
    hints = SourceHints(lambda: now[0], hint_s=10.0)
    box, _, _ = outbox()
    counts = Counts()
    asked = AskedLookups(box, hints, counts)
    hints.lacked("h:1", [key(1)])
    a = ctx("a")
    assert asked.path(a, "h:1", key(1)) is PullPath.ASK_FIRST
    assert asked.path(a, "h:1", key(2)) is PullPath.ASK_FIRST  # the whole request keeps its path
    assert asked.path(ctx("b"), "h:2", key(1)) is PullPath.ONE_TRIP  # another source: nothing known
    assert asked.lookup("h:1", "kv-a", key(1)) is LookupResult.RETRY  # asked first
    assert asked.lookup("h:1", "kv-a", key(2)) is LookupResult.RETRY
    asked.send_asks()
    (cmd,) = box.commands
    asked.on_result(api.LookupResult(cmd.lookup_id, [True, False]))  # the source holds key 1 now
    assert asked.lookup("h:1", "kv-a", key(1)) is LookupResult.HIT
    assert not hints.missing("h:1", key(1)) and hints.missing("h:1", key(2))
    now[0] += 10.0
    assert not hints.missing("h:1", key(2)) and len(hints) == 0  # the hint ended
    assert (counts.pulls_one_trip, counts.pulls_ask_first) == (1, 1)


def test_hints_are_bounded_oldest_first():
    hints = SourceHints(lambda: 0.0, max_entries=3)
    hints.lacked("h:1", [key(i) for i in range(5)])
    assert len(hints) == 3 and not hints.missing("h:1", key(0)) and hints.missing("h:1", key(4))


def test_a_one_trip_load_that_falls_short_reports_what_landed_counts_and_hints_the_rest():
    box, _, _ = outbox()
    counts = Counts()
    hints = SourceHints()
    jobs = JobBook("w", box, counts, hints=hints)
    job = TransferJob(job_id=7, keys=[key(1), key(2), key(3)], chunk_ids=np.array([4, 5, 6]), is_promotion=True,
                      req_context=ctx())
    assert jobs.submit(JobKind.LOAD, job, "kv-a", "refused", address="h:1", ask=True)
    (cmd,) = box.commands
    assert isinstance(cmd, api.LoadJob) and cmd.ask and cmd.rows == [4, 5, 6]
    jobs.report(api.JobFinished(7, "load", False, [key(1)], 4096, 0.01, "the producer's engine does not hold them"))
    (res,) = jobs.take_results()
    assert res.success is False and list(res.successful_keys) == [key(1)]  # vLLM keeps key 1, recomputes from 2
    assert load_state(job.req_context).failed  # the request's later lookups MISS
    assert (counts.pull_keys_landed, counts.pull_keys_missed, counts.loads_short, counts.loads_failed) == (1, 2, 1, 0)
    assert hints.path("h:1", key(2)) is PullPath.ASK_FIRST and hints.path("h:1", key(1)) is PullPath.ONE_TRIP
    # only the first key it did not bring is known missing: the source asks its engine for the prefix only
    assert hints.path("h:1", key(3)) is PullPath.ONE_TRIP


def test_a_one_trip_load_that_fails_for_another_reason_is_a_failure_and_makes_the_source_ask_first():
    """Timed out, refused, its peer lost: not the source's answer, so nothing is learnt of what it holds; but the
    source itself failed, so its next pulls ask first (they allocate nothing) until it answers again."""
    box, _, _ = outbox()
    counts, hints = Counts(), SourceHints()
    jobs = JobBook("w", box, counts, hints=hints)
    job = TransferJob(job_id=7, keys=[key(1), key(2)], chunk_ids=np.array([4, 5]), is_promotion=True,
                      req_context=ctx())
    jobs.submit(JobKind.LOAD, job, "kv-a", "refused", address="h:1", ask=True)
    jobs.report(api.JobFinished(7, "load", False, [], 0, 0.01, "fetch timed out on the producer"))
    assert (counts.loads_short, counts.loads_failed, counts.pull_keys_missed) == (0, 1, 2)
    assert len(hints) == 0 and load_state(job.req_context).failed
    assert hints.failing("h:1") == "fetch timed out on the producer" and not hints.down("h:1")  # reached: asked
    assert hints.path("h:1", key(9)) is PullPath.ASK_FIRST and hints.path("h:2", key(9)) is PullPath.ONE_TRIP
    hints.answered("h:1")  # it answered a lookup: one trip again
    assert hints.path("h:1", key(9)) is PullPath.ONE_TRIP


@pytest.mark.parametrize("reason", ["vLLM reset its cache", "vLLM is shutting down", ""])
def test_a_one_trip_load_we_cancelled_or_whose_worker_went_does_not_blame_the_source(reason):
    box, _, _ = outbox()
    hints = SourceHints()
    jobs = JobBook("w", box, Counts(), hints=hints)
    job = TransferJob(job_id=7, keys=[key(1)], chunk_ids=np.array([4]), is_promotion=True, req_context=ctx())
    jobs.submit(JobKind.LOAD, job, "kv-a", "refused", address="h:1", ask=True)
    if reason:
        jobs.report(api.JobFinished(7, "load", False, [], 0, 0.01, reason))
    else:
        jobs.fail_all()  # our worker died
    assert hints.failing("h:1") is None and hints.path("h:1", key(1)) is PullPath.ONE_TRIP


@pytest.mark.parametrize("why", [
    f"{UNREACHABLE}h:1: control link down (connection closed: tcp://h:1: the peer's process exited or restarted)",
    f"{UNREACHABLE}h:1: connection refused; retrying in 0.4 s",
    "no handshake with the peer within 3 s",
])
def test_a_source_the_worker_has_no_usable_link_to_is_down_until_relinked_then_asked_first(why):
    """A source that died after it served (its link is down, redialling) is as down as one never reached: the worker
    says so with UNREACHABLE, and those pulls recompute at once instead of promising in one trip (a row each) again.
    Linked again (PeerUp): no longer down, but asked first (a link is not an answer) until it answers."""
    hints = SourceHints()
    assert hints.failed("h:1", why) and hints.down("h:1")
    hints.relinked("h:1")
    assert not hints.down("h:1") and hints.path("h:1", key(1)) is PullPath.ASK_FIRST
    hints.answered("h:1")
    assert hints.path("h:1", key(1)) is PullPath.ONE_TRIP


def test_a_relink_does_not_clear_a_source_that_failed_while_reachable():
    hints = SourceHints()
    assert hints.failed("h:1", "fetch timed out on the producer") and not hints.down("h:1")
    hints.relinked("h:1")
    assert hints.failing("h:1") == "fetch timed out on the producer"


def test_an_unreachable_source_is_down_for_failed_s_then_asked_first_until_it_answers():
    """Down (MISS at once) for FAILED_S, then asked first: a lookup allocates nothing, so a source still dead then
    costs the puller's cache nothing either; its first answer brings back the one-trip path."""
    now = [0.0]
    hints = SourceHints(lambda: now[0])
    assert hints.failed("h:1", "session to  closed: peer h:1 unreachable: connection refused")
    assert hints.down("h:1") and hints.path("h:1", key(1)) is PullPath.ASK_FIRST
    now[0] = FAILED_S + 0.001
    assert not hints.down("h:1") and hints.failing("h:1") is None
    assert hints.path("h:1", key(1)) is PullPath.ASK_FIRST  # still: it has not answered since
    hints.answered("h:1")
    assert hints.path("h:1", key(1)) is PullPath.ONE_TRIP


@pytest.mark.parametrize("why", [
    "vLLM reset its cache", "worker shutting down (exit)", "worker has no region attached yet",
    "worker is draining or shutting down", "worker not ready", "not a PD consumer, or worker not ready",
    "request is leased to another fetch (round 4) until it is released",
    "request finished before every key was stored", "read from w2 failed: injected", ""])
def test_failures_that_are_not_the_sources_blame_nobody(why):
    hints = SourceHints()
    assert not hints.failed("h:1", why)
    assert hints.path("h:1", key(1)) is PullPath.ONE_TRIP and not hints.down("h:1")


def test_two_live_requests_under_one_kv_request_id_keep_their_own_failure():
    """Sampling with n > 1, or an orchestrator that reuses kv_request_id: one request's failed load never turns the
    other's lookups into MISS (the mark lives in each request's own context, not under the shared id)."""
    box, _, _ = outbox()
    jobs = JobBook("w", box, Counts())
    a, b = ctx("req-a"), ctx("req-b")
    job_a = TransferJob(job_id=8, keys=[key(1)], chunk_ids=np.array([4]), is_promotion=True, req_context=a)
    job_b = TransferJob(job_id=9, keys=[key(1)], chunk_ids=np.array([5]), is_promotion=True, req_context=b)
    jobs.submit(JobKind.LOAD, job_a, "kv-same", "refused", address="h:1", ask=True)
    jobs.submit(JobKind.LOAD, job_b, "kv-same", "refused", address="h:1", ask=True)
    jobs.report(api.JobFinished(8, "load", False, [], 0, 0.01, "the producer's engine does not hold them"))
    assert load_state(a).failed and not load_state(b).failed
    jobs.report(api.JobFinished(9, "load", True, [], 4096, 0.01, ""))
    assert load_state(a).failed and not load_state(b).failed
    assert load_state(a).loaded and load_state(b).loaded  # one load each


def one_sent_ask() -> tuple[AskedLookups, Outbox, api.LookupKeys]:
    """An asker with one key of request kv-a asked of h:1 and sent: (the asker, its outbox, the command)."""
    box, _, _ = outbox()
    asked = ask_first(box)
    asked.lookup("h:1", "kv-a", key(1))
    asked.send_asks()
    (cmd,) = box.commands
    return asked, box, cmd


def test_asked_lookups_batch_per_request_and_peer_then_answer_hit_or_miss():
    box, _, _ = outbox()
    asked = ask_first(box)
    k1, k2, k3 = key(1), key(2), key(3)
    assert asked.lookup("h:1", "kv-a", k1) is LookupResult.RETRY
    assert asked.lookup("h:1", "kv-a", k2) is LookupResult.RETRY
    assert asked.lookup("h:1", "kv-a", k1) is LookupResult.RETRY  # asked once, however often vLLM looks
    assert asked.lookup("h:2", "kv-b", k3) is LookupResult.RETRY
    assert asked.pending and box.commands == []  # batched at the next poll, not per lookup
    asked.send_asks()
    by_rid = {c.request_id: c for c in box.commands}
    assert len(box.commands) == 2 and all(isinstance(c, api.LookupKeys) for c in box.commands)
    a, b = by_rid["kv-a"], by_rid["kv-b"]
    assert (a.address, a.keys, b.address, b.keys) == ("h:1", [k1, k2], "h:2", [k3]) and a.lookup_id != b.lookup_id
    asked.send_asks()  # nothing new to ask
    assert len(box.commands) == 2
    asked.on_result(api.LookupResult(a.lookup_id, [True, False]))
    assert asked.lookup("h:1", "kv-a", k1) is LookupResult.HIT
    assert asked.lookup("h:1", "kv-a", k2) is LookupResult.MISS
    assert asked.lookup("h:2", "kv-b", k3) is LookupResult.RETRY and asked.pending
    asked.on_result(api.LookupResult(b.lookup_id, None, reason="peer down"))  # could not answer: MISS
    assert asked.lookup("h:2", "kv-b", k3) is LookupResult.MISS and not asked.pending


def test_asks_past_the_key_limit_go_out_as_several_lookups(monkeypatch):
    # the limit is a million keys; a small one shows the split without a million lookups
    monkeypatch.setattr(api, "MAX_JOB_KEYS", 2)
    box, _, _ = outbox()
    asked = ask_first(box)
    keys = [key(i) for i in range(5)]
    for k in keys:
        asked.lookup("h:1", "kv-a", k)
    asked.send_asks()
    assert [c.keys for c in box.commands] == [keys[0:2], keys[2:4], keys[4:5]]
    assert len({c.lookup_id for c in box.commands}) == 3


def test_asks_without_a_serving_worker_answer_miss_at_once():
    box, _, _ = outbox(serving=False)
    asked = ask_first(box)
    assert asked.lookup("h:1", "kv-a", key(1)) is LookupResult.RETRY
    asked.send_asks()
    assert box.commands == [] and not asked.pending
    assert asked.lookup("h:1", "kv-a", key(1)) is LookupResult.MISS


def test_a_late_answer_for_a_finished_request_is_dropped():
    asked, box, cmd = one_sent_ask()
    asked.forget("h:1", "kv-a")
    asked.on_result(api.LookupResult(cmd.lookup_id, [True]))
    # a new request under the same id starts afresh: asked again, not answered from the dropped answer
    assert asked.lookup("h:1", "kv-a", key(1)) is LookupResult.RETRY
    asked.send_asks()
    assert len(box.commands) == 2 and box.commands[1].keys == [key(1)]


def test_one_request_id_at_two_peers_is_asked_and_answered_at_each_and_forgotten_at_each():
    """An orchestrator's reused kv_request_id names requests pulling from two peers: what one peer answered says
    nothing of the other (each is asked), and the end of the last request at one peer forgets only its answers."""
    box, _, _ = outbox()
    asked = ask_first(box)
    assert asked.lookup("h:1", "kv-a", key(1)) is LookupResult.RETRY
    asked.send_asks()
    asked.on_result(api.LookupResult(box.commands[0].lookup_id, [True]))
    assert asked.lookup("h:1", "kv-a", key(1)) is LookupResult.HIT
    assert asked.lookup("h:2", "kv-a", key(1)) is LookupResult.RETRY  # not h:1's answer
    asked.send_asks()
    assert [(c.address, c.request_id, c.keys) for c in box.commands[1:]] == [("h:2", "kv-a", [key(1)])]
    asked.on_result(api.LookupResult(box.commands[1].lookup_id, [False]))
    assert asked.lookup("h:2", "kv-a", key(1)) is LookupResult.MISS
    asked.forget("h:2", "kv-a")
    assert asked.lookup("h:1", "kv-a", key(1)) is LookupResult.HIT  # h:1's request still lives: kept
    assert asked.lookup("h:2", "kv-a", key(1)) is LookupResult.RETRY  # forgotten: asked afresh


def test_an_answer_with_too_few_flags_is_a_miss_for_every_key_not_a_retry_forever():
    box, _, _ = outbox()
    asked = ask_first(box)
    asked.lookup("h:1", "kv-a", key(1))
    asked.lookup("h:1", "kv-a", key(2))
    asked.send_asks()
    (cmd,) = box.commands
    asked.on_result(api.LookupResult(cmd.lookup_id, [True]))  # one flag for two keys: the answer means nothing
    assert [asked.lookup("h:1", "kv-a", k) for k in (key(1), key(2))] == [LookupResult.MISS] * 2
    assert not asked.pending


def test_an_answer_for_an_unknown_lookup_changes_nothing():
    box, _, _ = outbox()
    asked = ask_first(box)
    asked.lookup("h:1", "kv-a", key(1))
    asked.send_asks()
    asked.on_result(api.LookupResult(12345, [True]))
    assert asked.lookup("h:1", "kv-a", key(1)) is LookupResult.RETRY and asked.pending


def test_miss_all_answers_sent_and_unsent_asks_miss():
    box, _, _ = outbox()
    asked = ask_first(box)
    asked.lookup("h:1", "kv-a", key(1))
    asked.send_asks()  # sent, no answer yet
    asked.lookup("h:1", "kv-b", key(2))  # asked, not sent yet
    asked.miss_all()
    assert not asked.pending
    assert asked.lookup("h:1", "kv-a", key(1)) is LookupResult.MISS
    assert asked.lookup("h:1", "kv-b", key(2)) is LookupResult.MISS
    asked.send_asks()
    assert len(box.commands) == 1  # the unsent ask was not sent after all


def test_a_refused_lookup_command_answers_miss_once():
    asked, box, cmd = one_sent_ask()
    assert asked.refuse(api.StoreJob(cmd.lookup_id, "kv-a", [key(1)], [0])) is False  # a job: not the lookups'
    assert asked.refuse(cmd) is True
    assert asked.refuse(cmd) is False
    assert asked.lookup("h:1", "kv-a", key(1)) is LookupResult.MISS and not asked.pending


# ------------------------------------------------------------ lookups.py: the source
class FakeParent:
    """vLLM's parent API as PeerLookups.serve calls it: ``hits`` are what vLLM holds."""

    def __init__(self, hits: set[bytes], fail_lookup: bool = False):
        self.hits, self.fail_lookup = hits, fail_lookup
        self.calls: list[tuple] = []
        self.next_job = 100

    def on_new_request(self, c: ReqContext) -> None:
        self.calls.append(("new", c.req_id, c.kv_transfer_params))

    def lookup(self, k: bytes, c: ReqContext) -> LookupResult:
        if self.fail_lookup:
            raise RuntimeError("vLLM lookup failed")
        return LookupResult.HIT if k in self.hits else LookupResult.MISS

    def create_store_job(self, keys: list[bytes], c: ReqContext) -> TransferJob:
        self.calls.append(("store", c.req_id, list(keys)))
        self.next_job += 1
        return TransferJob(job_id=self.next_job, keys=keys, chunk_ids=np.arange(len(keys)), is_promotion=False,
                           req_context=c)

    def on_request_finished(self, c: ReqContext) -> None:
        self.calls.append(("finished", c.req_id))


def peer_rooms(book_serving: bool = True) -> tuple[PeerLookups, JobBook, Outbox]:
    box, _, _ = outbox()
    jobs_box = box if book_serving else outbox(serving=False)[0]
    jobs = JobBook("w", jobs_box, Counts())
    return PeerLookups(jobs, box), jobs, box


def test_a_peer_lookup_pins_our_hits_parks_them_and_answers():
    rooms, jobs, box = peer_rooms()
    k1, k2, k3 = key(1), key(2), key(3)
    rooms.queue.append(api.PeerLookup("peer-a", 7, "kv-9", [k1, k2, k3]))
    assert rooms.pending
    parent = FakeParent({k1, k3})
    rooms.serve(parent, stopping=False)
    rid = "p2pw:peer-a:kv-9:7"  # one vLLM request per peer lookup, without P2P params of its own
    assert parent.calls == [("new", rid, None), ("store", rid, [k1, k3]), ("finished", rid)]
    assert box.commands == [api.StoreJob(101, "kv-9", [k1, k3], [0, 1]), api.RequestFinished("kv-9"),
                            api.AnswerLookup("peer-a", 7, [True, False, True])]
    assert list(jobs.open) == [101] and jobs.open[101].kv_request_id == "kv-9" and not rooms.pending


def test_a_one_trip_loads_ask_pins_only_the_prefix_it_can_use():
    """An asking round's lookup (a negative id: protocol Fetch.ask) stops at the first key vLLM does not hold: its
    request uses the prefix only, so nothing past the gap is pinned; the answer still has a flag per key."""
    rooms, jobs, box = peer_rooms()
    k1, k2, k3 = key(1), key(2), key(3)
    rooms.queue.append(api.PeerLookup("peer-a", -8, "kv-9", [k1, k2, k3]))
    parent = FakeParent({k1, k3})
    rooms.serve(parent, stopping=False)
    assert box.commands == [api.StoreJob(101, "kv-9", [k1], [0]), api.RequestFinished("kv-9"),
                            api.AnswerLookup("peer-a", -8, [True, False, False])]


def test_a_peer_lookup_without_hits_answers_all_false_and_pins_nothing():
    rooms, jobs, box = peer_rooms()
    parent = FakeParent(set())
    rooms.queue.append(api.PeerLookup("peer-a", 8, "kv-9", [key(1), key(2)]))
    rooms.serve(parent, stopping=False)
    assert [c[0] for c in parent.calls] == ["new", "finished"]
    assert box.commands == [api.AnswerLookup("peer-a", 8, [False, False])] and jobs.open == {}


def test_a_pinned_store_the_worker_cannot_take_is_failed_and_answered_false():
    # the book's outbox refuses the StoreJob: its pin is released through a failed result, the peer told MISS
    rooms, jobs, box = peer_rooms(book_serving=False)
    parent = FakeParent({key(1)})
    rooms.queue.append(api.PeerLookup("peer-a", 9, "kv-9", [key(1)]))
    rooms.serve(parent, stopping=False)
    assert box.commands == [api.AnswerLookup("peer-a", 9, [False])]  # no RequestFinished: nothing was parked
    assert jobs.open == {} and [(r.job_id, r.success) for r in jobs.take_results()] == [(101, False)]


def test_peer_lookups_while_vllm_stops_answer_false_without_asking_vllm():
    rooms, jobs, box = peer_rooms()
    parent = FakeParent({key(1)})
    rooms.queue += [api.PeerLookup("peer-a", 1, "kv-1", [key(1)]), api.PeerLookup("peer-b", 2, "kv-2", [key(1)] * 2)]
    rooms.serve(parent, stopping=True)
    assert parent.calls == [] and jobs.open == {} and not rooms.pending
    assert box.commands == [api.AnswerLookup("peer-a", 1, [False]), api.AnswerLookup("peer-b", 2, [False, False])]


def test_a_failing_vllm_lookup_still_ends_the_lookups_request():
    rooms, _, _ = peer_rooms()
    parent = FakeParent({key(1)}, fail_lookup=True)
    rooms.queue.append(api.PeerLookup("peer-a", 1, "kv-1", [key(1)]))
    with pytest.raises(RuntimeError):
        rooms.serve(parent, stopping=False)
    assert parent.calls[-1] == ("finished", "p2pw:peer-a:kv-1:1")  # vLLM does not keep a request we opened


# ------------------------------------------------------------ finished.py
def replay_rooms(client: FakeClient | None = None) -> tuple[FinishedReplay, FakeSupervisor, Outbox]:
    sup = FakeSupervisor(client)
    box = Outbox(sup, Refusals())
    return FinishedReplay("w", sup, box), sup, box


def test_a_finished_request_goes_through_the_outbox_to_a_ready_worker():
    replay, sup, box = replay_rooms(FakeClient())
    replay.finished("kv-1")
    assert box.commands == [api.RequestFinished("kv-1")] and sup.client.sent == []


def test_before_ready_a_finished_request_goes_straight_into_the_ring_and_is_not_told_twice():
    client = FakeClient(ready=None, room=1)
    replay, _, box = replay_rooms(client)
    replay.finished("kv-1")  # into the ring, behind the AttachRegion
    replay.finished("kv-2")  # the ring is full: waits for the Ready
    assert client.sent == [api.RequestFinished("kv-1")] and box.commands == []
    client.ready = READY
    replay.on_ready()
    assert box.commands == [api.RequestFinished("kv-2")]


def test_with_no_worker_finished_requests_wait_for_the_next_one_newest_first():
    replay, sup, box = replay_rooms(None)
    n = REPLAY_IN_RING_MAX + 3
    rids = [f"kv-{i}" for i in range(n)]
    for rid in rids:
        replay.finished(rid)
    assert box.commands == []
    sup.client = FakeClient(ready=None)
    replay.replay()
    # the newest (a consumer is about to fetch them) into the ring, at most half of it; the rest on Ready
    assert sup.client.sent == [api.RequestFinished(r) for r in reversed(rids[3:])]
    sup.client.ready = READY
    replay.on_ready()
    assert box.commands == [api.RequestFinished(r) for r in rids[:3]]


def test_replay_stops_at_a_full_ring_and_the_ready_sends_the_rest():
    replay, sup, box = replay_rooms(None)
    for rid in ("a", "b", "c", "d"):
        replay.finished(rid)
    sup.client = FakeClient(ready=None, room=2)
    replay.replay()
    assert sup.client.sent == [api.RequestFinished("d"), api.RequestFinished("c")]
    sup.client.ready = READY
    replay.on_ready()
    assert box.commands == [api.RequestFinished("a"), api.RequestFinished("b")]


def test_each_new_worker_is_told_again():
    replay, sup, box = replay_rooms(FakeClient(ready=None))
    replay.finished("kv-1")
    first = sup.client
    sup.client = FakeClient(ready=None)  # the first worker died before its Ready; a new one was spawned
    replay.replay()
    assert first.sent == [api.RequestFinished("kv-1")] and sup.client.sent == [api.RequestFinished("kv-1")]
    sup.client.ready = READY
    replay.on_ready()
    assert box.commands == []  # already in this worker's ring


def test_a_new_worker_whose_ring_is_full_gets_the_earlier_workers_requests_on_ready():
    # what was in a dead worker's ring counts for nothing with the next one
    replay, sup, box = replay_rooms(FakeClient(ready=None))
    replay.finished("kv-1")
    sup.client = FakeClient(ready=None, room=0)
    replay.replay()
    assert sup.client.sent == []
    sup.client.ready = READY
    replay.on_ready()
    assert box.commands == [api.RequestFinished("kv-1")]


def test_a_ring_error_before_ready_is_logged_and_the_request_waits_for_the_ready(caplog):
    client = FakeClient(ready=None)
    client.send_error = MessageTooLarge(1 << 30, 1 << 20, "cmd")
    replay, _, box = replay_rooms(client)
    with caplog.at_level(logging.ERROR, logger="vllm_adapter.tier"):
        replay.finished("kv-1")  # never raises into vLLM's on_request_finished
    assert client.sent == [] and "RequestFinished not sent" in caplog.text
    client.send_error, client.ready = None, READY
    replay.on_ready()
    assert box.commands == [api.RequestFinished("kv-1")]


def test_the_replay_is_bounded_to_the_newest_recent_requests():
    replay, sup, box = replay_rooms(None)
    for i in range(RECENT_FINISHED_MAX + 1):
        replay.finished(f"kv-{i}")
    sup.client = FakeClient(ready=None)
    replay.replay()
    sup.client.ready = READY
    replay.on_ready()
    told = [c.request_id for c in sup.client.sent] + [c.request_id for c in box.commands]
    assert len(told) == len(set(told)) == RECENT_FINISHED_MAX and "kv-0" not in told
    assert f"kv-{RECENT_FINISHED_MAX}" in told


def test_a_request_finished_twice_is_replayed_once():
    replay, sup, box = replay_rooms(None)
    for rid in ("a", "b", "a"):
        replay.finished(rid)
    sup.client = FakeClient(ready=None)
    replay.replay()
    assert sup.client.sent == [api.RequestFinished("a"), api.RequestFinished("b")]  # "a" is the newest now


def test_requests_finished_longer_ago_than_recent_finished_s_are_not_replayed():
    now = [1000.0]
    sup = FakeSupervisor(None)
    replay = FinishedReplay("w", sup, Outbox(sup, Refusals()), clock=lambda: now[0])
    replay.finished("old")
    now[0] += RECENT_FINISHED_S * 0.5
    replay.finished("new")
    now[0] += RECENT_FINISHED_S * 0.6  # "old" is past the window now, "new" is not
    sup.client = FakeClient(ready=None)
    replay.replay()
    assert sup.client.sent == [api.RequestFinished("new")]


def test_siblings_give_up_an_id_at_the_last_live_requests_end():
    s = Siblings()
    a = parse_role({"remote_kv_source": {"kv_request_id": "kv-1", "remote_host": "h", "remote_port": 1}})
    other_peer = parse_role({"remote_kv_source": {"kv_request_id": "kv-1", "remote_host": "g", "remote_port": 1}})
    producer = parse_role({"remote_decoder": {"kv_request_id": "kv-1"}})
    for role, req in ((a, "r1"), (a, "r2"), (other_peer, "r3"), (producer, "r4")):
        s.started(role, req)
    assert len(s) == 3  # a producer gives up nothing at its peer
    assert s.ended(a, "r1") is False and s.ended(a, "r2") is True  # the second of two is the last
    assert s.ended(other_peer, "r3") is True and len(s) == 0
    assert s.ended(a, "r9") is True  # an end this tier never saw start (a restart between): given up at once
    s.started(a, "r5")
    s.started(a, "r5")  # vLLM rebuilt the request's context: still one request
    assert s.ended(a, "r5") is True and len(s) == 0
