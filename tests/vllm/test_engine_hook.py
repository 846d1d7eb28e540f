"""The tier and the engine core it runs in (vllm_adapter/engine_hook.py), under the real tiering managers.

A stand-in for vLLM's EngineCoreProc constructs the engine, as the real one does: it holds an ``input_queue`` and a
``shutdown_state`` (vLLM's own enum) and the tier finds it on the stack.  The test plays the engine's idle loop: it
calls the tier only after a WAKEUP arrives on that queue, and steps while ``has_pending_work`` says so, as vLLM
0.32's ``_process_input_queue`` does (on 0.33 the same runs with ``tier_poll_interval_s: 0``: no tier-poll thread).
On 0.34 an engine idles only with its tier-poll thread (``IDLE_ENGINE``): the same tests then show that the thread
serves peers while the engine sleeps, without a step and without a waker.
"""

from __future__ import annotations

import queue
import time
from dataclasses import dataclass, field

import pytest
from vllm.v1.engine import EngineCoreRequestType
from vllm.v1.engine.core import EngineShutdownState

from tests.helpers.vllm_engines import IDLE_ENGINE, Engine, LookupResult, ReqContext, run_until


class FakeEngineCore:
    """What the tier reads of vLLM's engine core: its input queue and its shutdown state."""

    def __init__(self, name: str, port: int):
        self.input_queue: queue.Queue = queue.Queue()
        self.shutdown_state = EngineShutdownState.RUNNING
        self.engine = Engine(name, port, engine_extra=IDLE_ENGINE)  # the tier finds `self` on this stack
        self.steps = 0  # steps idle_loop took

    def idle_loop(self, until, timeout_s: float, on_block=None) -> float:
        """vLLM's idle loop: block on the input queue; on a wake, step while the manager has pending work.  Returns
        the seconds until ``until()`` held.  ``on_block`` runs once, right after vLLM heard "no work" and before it
        blocks: what it starts then can only be served by a wake (or the poll thread)."""
        t0 = time.monotonic()
        steps = 0
        # until() is asked once per check and never again once it held: it may step the peer (whose next step would
        # then go on past what the caller wants to look at)
        while not until():
            if self.engine.mgr.has_pending_work():  # vLLM's has_work(): step, or block on the queue
                self.engine.step()
                steps += 1
                self.steps += 1
                assert steps < 100_000, "has_pending_work never settled"
                time.sleep(0.001)  # vLLM 0.33 sleeps 1 ms between steps that run no model
                continue
            if on_block is not None:
                on_block, start = None, on_block
                start()
            left = t0 + timeout_s - time.monotonic()
            if left <= 0:
                raise TimeoutError("the idle engine was never woken for its peer")
            try:
                # blocked; with a tier-poll thread (0.34) the thread works meanwhile, so until() is asked again often
                kind, _ = self.input_queue.get(timeout=min(left, 0.005) if self.engine.poll_thread else left)
            except queue.Empty:
                continue
            assert kind is EngineCoreRequestType.WAKEUP
        return time.monotonic() - t0

    def assert_served_idle(self) -> None:
        """The peer was served while this engine idled: woken by our waker (no tier-poll thread), or by the thread
        alone, without a step of the engine and without a waker (0.34)."""
        if self.engine.poll_thread:
            assert self.engine.tier.waker is None, "a waker runs beside vLLM's tier-poll thread"
            assert self.steps == 0, f"the idle engine stepped {self.steps} time(s): its tier-poll thread should serve"
        else:
            assert self.engine.tier.waker.wakes >= 1


def start_pull(puller: Engine, owner: Engine, kv_request_id: str, ids: list[int], req_id: str = "pull") -> ReqContext:
    """A request on ``puller`` whose prefix lives on ``owner`` (llm-d's remote_kv_source), in one round trip: its
    lookups answer at once (promotions); the puller's next step (``Pull.submit``, run by the source's idle loop once
    vLLM heard "no work" there and is about to block) submits the load, which asks the source."""
    host, port = owner.tier.worker_address.split(":")
    ctx = ReqContext(req_id=req_id, kv_transfer_params={
        "remote_kv_source": {"kv_request_id": kv_request_id, "remote_host": host, "remote_port": int(port)}})
    with puller.lock:
        puller.mgr.on_new_request(ctx)
    assert puller.lookup(ctx, ids) == [LookupResult.HIT_PENDING] * len(ids)
    return ctx


@dataclass
class Pull:
    """A one-trip pull the puller drives from the source's idle loop: ``submit`` (its first step) as the source
    blocks, then ``loaded`` until every key landed."""

    puller: Engine
    ctx: ReqContext
    ids: list[int]
    t0: float = field(default_factory=time.monotonic)
    submitted: bool = False
    took_s: float | None = None  # request to every key in the puller's CPU tier

    def submit(self) -> None:
        """The puller's first step: it submits the load, whose ask goes to the source."""
        if not self.submitted:
            self.puller.step([self.ctx.req_id])
            self.submitted = True

    def loaded(self) -> bool:
        """Once submitted: step the puller; True (and ``took_s``) once its load ended and every key is in its CPU
        tier."""
        if not self.submitted:
            return False
        self.puller.step()
        if self.puller.idle() and self.puller.lookup(self.ctx, self.ids) == [LookupResult.HIT] * len(self.ids):
            self.took_s = time.monotonic() - self.t0
            return True
        return False


@pytest.fixture
def source(free_port):
    core = FakeEngineCore("hooksrc", free_port())
    yield core
    core.engine.close()


@pytest.fixture
def puller(free_port):
    eng = Engine("hookpull", free_port())
    yield eng
    eng.close()


def test_the_tier_finds_the_engine_core_constructing_it(source):
    tier = source.engine.tier
    assert tier.engine is not None and tier.engine.core is source
    # on where the engine idles without a tier-poll thread (0.32, 0.33 with it off); off beside the thread (0.34)
    assert (tier.waker is not None) == (not source.engine.poll_thread)


def test_an_idle_source_is_woken_for_a_peers_lookup_and_serves_it(source, puller):
    """The source stored a prefix, then nothing calls it (an idle 0.32 engine).  A peer's lookup wakes it through
    vLLM's WAKEUP sentinel; one or a few empty steps serve the lookup and the fetch; the peer loads every chunk well
    within its lookup_timeout_s (5 s).  Idle, with no peer traffic, the waker sends nothing (heartbeats do not wake
    it: the engine stays blocked)."""
    ids = [20, 21, 22]
    owner = source.engine
    owner.store("own", ids)
    run_until([owner], owner.idle)
    time.sleep(2.0)  # idle: heartbeats arrive, unread
    assert source.input_queue.empty(), "an idle engine was woken for nothing"
    assert owner.tier.waker is None or owner.tier.waker.wakes == 0, "an idle engine was woken for nothing"
    pull = Pull(puller, start_pull(puller, owner, "pull-1", ids), ids)
    ctx = pull.ctx
    # the load's ask (sent once the source blocked) wakes it, which pins and parks its hits; its worker offers them
    # in the same exchange
    source.idle_loop(pull.loaded, timeout_s=4.0, on_block=pull.submit)
    assert pull.took_s < 1.0, f"the pull from an idle source took {pull.took_s:.2f} s"
    # the source engine reports its store job once woken again by the consumer's Release
    source.idle_loop(lambda: puller.step() or owner.idle(), timeout_s=4.0)
    puller.check_loaded(ctx, ids)
    source.assert_served_idle()


def test_a_source_that_just_went_idle_is_woken_at_once_not_after_idle_s(source, puller, monkeypatch):
    """The source stepped a moment ago, then vLLM asked has_work() and got no: it blocks on its input queue.  A
    peer's lookup that comes now wakes it without waiting for the tier to go uncalled for IDLE_S (raised to a
    minute here: a wake that came only after it would miss every bound below)."""
    from vllm_adapter import engine_hook

    monkeypatch.setattr(engine_hook, "IDLE_S", 60.0)
    ids = [30, 31]
    owner = source.engine
    owner.store("own", ids)
    # vLLM 0.32 steps while has_work() (the tier's has_pending_work) says so; its last "no" is where it blocks
    run_until([owner], lambda: owner.idle() and not owner.mgr.has_pending_work())
    pull = Pull(puller, start_pull(puller, owner, "pull-2", ids), ids)
    ctx = pull.ctx
    source.idle_loop(pull.loaded, timeout_s=10.0, on_block=pull.submit)
    source.idle_loop(lambda: puller.step() or owner.idle(), timeout_s=10.0)
    puller.check_loaded(ctx, ids)
    source.assert_served_idle()


def test_a_drain_for_shutdown_ends_parked_stores_without_a_consumer(source):
    """vLLM stops in drain mode: it steps while any tier job is open, up to --shutdown-timeout, then kills the
    engine.  A store parked for a decode that never fetches it ends once the engine core's shutdown_state leaves
    RUNNING: the manager has no open job within a few steps, so vLLM's drain ends at once."""
    eng = source.engine
    eng.store("p", [30, 31], {"remote_decoder": {"kv_request_id": "never-fetched"}})
    for _ in range(50):
        eng.step()
    assert not eng.idle(), "the store should be parked, waiting for its consumer"
    source.shutdown_state = EngineShutdownState.REQUESTED
    t0 = time.monotonic()
    run_until([eng], eng.idle, timeout_s=5.0)
    assert time.monotonic() - t0 < 1.0
    assert not eng.mgr.has_pending_work()
    assert eng.tier.counters()["stores_failed"] >= 1


def test_consumer_done_releases_what_the_producer_parked_and_nobody_fetched(free_port):
    """A PD consumer whose request ends without fetching (it held the blocks already: a shared prefix) tells the
    producer (ConsumerDone -> Done): the producer's store job ends at once, not park_timeout_s later."""
    prefill, decode = Engine("donep", free_port()), Engine("doned", free_port())
    try:
        prefill.store("p", [40, 41], {"remote_decoder": {"kv_request_id": "shared"}})
        host, port = prefill.tier.worker_address.split(":")
        ctx = ReqContext(req_id="d", kv_transfer_params={
            "remote_prefiller": {"kv_request_id": "shared", "remote_host": host, "remote_port": int(port)}})
        with decode.lock:
            decode.mgr.on_new_request(ctx)
            decode.mgr.on_request_finished(ctx)  # nothing looked up, nothing loaded: the request ended
        t0 = time.monotonic()
        run_until([prefill, decode], prefill.idle, timeout_s=10.0)
        assert time.monotonic() - t0 < 2.0
        assert prefill.tier.counters()["stores_ok"] >= 1 and prefill.tier.counters()["jobs_in_flight"] == 0
    finally:
        prefill.close()
        decode.close()


def test_while_vllm_stops_a_source_answers_peers_all_miss_and_pins_nothing(source, puller):
    """A source draining for shutdown must not pin new stores for peers (each would hold the drain up; in llm-d's
    aggregated sharing a source is asked all the time): its peers' lookups are answered MISS, they recompute."""
    owner = source.engine
    owner.store("own", [50, 51])
    run_until([owner], owner.idle)
    source.shutdown_state = EngineShutdownState.REQUESTED
    host, port = owner.tier.worker_address.split(":")
    ctx = ReqContext(req_id="late", kv_transfer_params={
        "remote_kv_source": {"kv_request_id": "late-1", "remote_host": host, "remote_port": int(port)}})
    with puller.lock:
        puller.mgr.on_new_request(ctx)
    assert puller.lookup(ctx, [50, 51]) == [LookupResult.HIT_PENDING] * 2  # one trip: the load asks
    puller.step(["late"])
    run_until([puller, owner], puller.idle, timeout_s=10)
    assert puller.lookup(ctx, [50, 51]) == [LookupResult.MISS] * 2  # the load brought nothing: recomputed
    assert puller.tier.counters()["pull_keys_missed"] == 2
    assert owner.idle() and owner.tier.counters()["jobs_in_flight"] == 0
