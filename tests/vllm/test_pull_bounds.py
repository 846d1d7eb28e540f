"""A symmetric pull that cannot land ends at once and costs the puller nothing, under the real tiering managers.

- A puller whose CPU tier has less room than the prompt: vLLM promotes what fits; its LRU then evicts the request's
  own landed chunks to promote the rest, and a tier that answered HIT again would start another asking round each
  pass (the pull churns).  At most one asking load per request: later passes MISS, vLLM recomputes the rest.
- A source that cannot be reached: the first one-trip pull allocates a row per promised key (evicting the puller's
  other ready chunks) and fails; while the source is known down, later pulls recompute at once and evict nothing.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from p2pworker.admin import query
from tests.helpers.vllm_engines import Engine, LookupResult, ReqContext, pull, run_until, until_answered
from vllm_adapter.hints import FAILED_S


def pair(free_port, pull_path: str = "one_trip"):
    """(a source with room for 16 chunks, a puller with room for 4 whose symmetric pulls take ``pull_path``)."""
    owner = Engine("bnown", free_port(), num_chunks=16)
    reader = Engine("bnrd", free_port(), num_chunks=4, pull_path=pull_path)
    yield owner, reader
    for e in (reader, owner):
        e.close()


@pytest.fixture(params=["one_trip", "ask_first"])
def small(free_port, request):
    yield from pair(free_port, request.param)


@pytest.fixture
def small_one_trip(free_port):
    yield from pair(free_port)


def passes(reader: Engine, owner: Engine | None, ctx: ReqContext, ids: list[int], n: int) -> list[list]:
    """``n`` scheduler passes over the request: its lookups, a step, until no job of the puller is open and no lookup
    it asked is unanswered."""
    seen = []
    for i in range(n):
        seen.append(reader.lookup(ctx, ids))
        reader.step([ctx.req_id] if i == 0 else [])
        run_until([reader] + ([owner] if owner is not None else []),
                  lambda: reader.idle() and not reader.tier.lookups.pending, timeout_s=20)
    return seen


def test_a_prompt_larger_than_the_pullers_cpu_tier_is_pulled_once_then_recomputed(small):
    owner, reader = small
    ids = list(range(100, 108))  # 8 chunks; the puller has room for 4
    owner.store("own", ids)
    run_until([owner], owner.idle)
    ctx = pull(reader, owner.tier.worker_address, "big", "big-1")
    t0 = time.monotonic()
    seen = passes(reader, owner, ctx, ids, 10)
    took = time.monotonic() - t0
    promoted = [i for i, p in enumerate(seen) if LookupResult.HIT_PENDING in p]
    assert len(promoted) == 1, f"promoted in passes {promoted}: {seen}"  # one load, not one per pass
    first = promoted[0]
    assert seen[first][:4] == [LookupResult.HIT_PENDING] * 4  # what fits is promoted and pulled
    assert seen[first + 1][:4] == [LookupResult.HIT] * 4  # and used: the pulled prefix is in the CPU tier
    assert seen[-1][4:] == [LookupResult.MISS] * 4  # the rest is recomputed
    c = reader.tier.counters()
    assert c["loads_ok"] + c["loads_short"] + c["loads_failed"] == 1, c
    assert c["pull_keys_landed"] == 4 or c["loads_ok"] == 1, c
    assert took < 10.0
    with reader.lock:
        reader.mgr.on_request_finished(ctx)


def test_a_pd_prompt_larger_than_the_decodes_cpu_tier_is_loaded_once(free_port):
    prefill, decode = Engine("bnpf", free_port(), num_chunks=16), Engine("bnpd", free_port(), num_chunks=4)
    try:
        ids = list(range(400, 408))
        prefill.store("p-big", ids, {"remote_decoder": {"kv_request_id": "kv-big"}})
        host, port = prefill.tier.worker_address.split(":")
        ctx = ReqContext(req_id="d-big", kv_transfer_params={
            "remote_prefiller": {"kv_request_id": "kv-big", "remote_host": host, "remote_port": int(port)}})
        with decode.lock:
            decode.mgr.on_new_request(ctx)
        seen = passes(decode, prefill, ctx, ids, 6)
        assert sum(LookupResult.HIT_PENDING in p for p in seen) == 1, seen
        assert seen[1][:4] == [LookupResult.HIT] * 4 and seen[-1][4:] == [LookupResult.MISS] * 4
        c = decode.tier.counters()
        assert c["loads_ok"] + c["loads_short"] + c["loads_failed"] == 1, c
        with decode.lock:
            decode.mgr.on_request_finished(ctx)
        run_until([prefill, decode], prefill.idle, timeout_s=20)  # the parked rest is released (ConsumerDone)
    finally:
        for e in (decode, prefill):
            e.close()


def test_a_dead_source_evicts_the_pullers_cache_once_and_then_nothing(small_one_trip, free_port):
    owner, reader = small_one_trip
    mine = list(range(200, 204))  # the puller's own ready chunks (another conversation): its whole CPU tier
    reader.store("mine", mine)
    run_until([reader], reader.idle)
    mine_ctx = ReqContext(req_id="mine-again", kv_transfer_params=None)

    def cached() -> int:
        with reader.lock:
            reader.mgr.on_new_request(mine_ctx)
        got = sum(r is LookupResult.HIT for r in reader.lookup(mine_ctx, mine))
        with reader.lock:
            reader.mgr.on_request_finished(mine_ctx)
        return got

    assert cached() == 4
    dead = f"127.0.0.1:{free_port()}"  # nothing listens there
    first = pull(reader, dead, "dead-0", "dead-0")
    t0 = time.monotonic()
    seen = passes(reader, None, first, [300, 301, 302, 303], 3)
    first_s = time.monotonic() - t0
    assert seen[0] == [LookupResult.HIT_PENDING] * 4  # promised in one trip: rows allocated, the puller's evicted
    assert seen[-1] == [LookupResult.MISS] * 4 and reader.tier.counters()["loads_failed"] == 1
    after_first = cached()
    assert reader.tier.hints.down(dead), "an unreachable source is not known down"
    times = []
    for i in range(1, 6):  # a burst naming the dead source: each answered MISS at once, nothing allocated
        ctx = pull(reader, dead, f"dead-{i}", f"dead-{i}")
        t0 = time.monotonic()
        assert passes(reader, None, ctx, [310 + i, 320 + i], 1) == [[LookupResult.MISS] * 2]
        times.append(time.monotonic() - t0)
        with reader.lock:
            reader.mgr.on_request_finished(ctx)
    assert cached() == after_first, "a pull to a source known dead evicted the puller's chunks"
    assert max(times) < 1.0, f"answering a pull to a dead source took {max(times):.2f} s"
    assert reader.tier.counters()["loads_failed"] == 1  # no more loads were sent
    print(f"first pull to the dead source: {first_s:.2f} s, {4 - after_first} of 4 chunks evicted; "
          f"the next 5: {max(times) * 1000:.1f} ms at most, nothing evicted")
    with reader.lock:
        reader.mgr.on_request_finished(first)


def served_then_killed(owner: Engine, reader: Engine, ids: list[int], rid: str) -> tuple[str, int]:
    """``reader`` pulls ``ids`` from ``owner`` (served: the chunks are the puller's now), then the owner's worker is
    SIGKILLed.  Returns (the owner's worker address, the killed worker's pid)."""
    address = owner.tier.worker_address
    owner.store(f"own-{rid}", ids)
    run_until([owner], owner.idle)
    ctx = pull(reader, address, rid)
    assert until_answered(reader, [owner], ctx, ids, timeout_s=30) == [LookupResult.HIT] * len(ids)
    reader.check_loaded(ctx, ids)
    old = owner.tier.supervisor.client.proc.pid
    os.kill(old, signal.SIGKILL)
    return address, old


RELINKED_S = 1.0 + 1.0  # the puller's link redials at most reconnect_max_s (1 s) apart; a handshake; slack


def test_a_source_that_died_is_known_down_then_pulled_from_again_as_soon_as_the_puller_relinked(free_port):
    """A source that served, then died (its worker SIGKILLed): its kernel closed the puller's link, so the next pull
    fails at once and the source is known down (later pulls recompute at once: no row allocated, no load sent).
    The source's tier restarts its worker on the same port; the puller's worker links to it again on its own and
    says so (PeerUp names the address): the source is no longer known down (asked first: a link is not an answer),
    and the next pull is served, not recomputed for FAILED_S (10 s) after the failure."""
    owner = Engine("rsown", free_port(), num_chunks=16)
    reader = Engine("rsrd", free_port(), num_chunks=8)
    try:
        address, old = served_then_killed(owner, reader, [610, 611, 612, 613], "rs-1")
        ctx = pull(reader, address, "rs-2")
        t0 = time.monotonic()
        assert until_answered(reader, [], ctx, [620, 621, 622, 623], timeout_s=10) == [LookupResult.MISS] * 4
        failed_at = time.monotonic()
        failed_s = failed_at - t0
        assert failed_s < 1.0, f"a pull from the killed source took {failed_s:.2f} s to fail"
        with reader.lock:
            reader.mgr.on_request_finished(ctx)
        assert reader.tier.hints.down(address), "a source whose link its death closed is not known down"
        loads = reader.tier.counters()["loads_failed"]
        ctx = pull(reader, address, "rs-3")  # known down: MISS at once, no row allocated, no load sent
        assert reader.lookup(ctx, [624, 625, 626, 627]) == [LookupResult.MISS] * 4
        with reader.lock:
            reader.mgr.on_request_finished(ctx)
        assert reader.tier.counters()["loads_failed"] == loads
        # the source's tier restarts its worker on its steps (and its tier-poll thread, 0.33+)
        run_until([owner], lambda: owner.tier.supervisor.serving and owner.tier.supervisor.client.proc.pid != old)
        back = time.monotonic()
        run_until([reader], lambda: not reader.tier.hints.down(address), timeout_s=RELINKED_S + 1.0)
        relinked_s = time.monotonic() - back
        assert time.monotonic() - failed_at < FAILED_S, "the hint ran out before the relink could be seen"
        owner.store("own-4", [640, 641, 642, 643])
        run_until([owner], owner.idle)
        ctx = pull(reader, address, "rs-4")
        assert until_answered(reader, [owner], ctx, [640, 641, 642, 643], timeout_s=30) == [LookupResult.HIT] * 4
        reader.check_loaded(ctx, [640, 641, 642, 643])
        assert relinked_s <= RELINKED_S, f"the puller knew the restarted source after {relinked_s:.2f} s"
        print(f"dead source: the pull failed after {failed_s:.3f} s; restarted: known up again {relinked_s:.2f} s "
              f"after its new worker served, and the next pull was served")
    finally:
        for e in (reader, owner):
            e.close()


FORGET_S = 2.0  # the puller's [control] forget_down_s in the next test (60 s by default)


def test_a_source_restarted_after_the_puller_stopped_redialling_it_is_pulled_from_again(free_port):
    """A source whose worker stays dead past the puller's [control] forget_down_s: the puller's worker stops
    redialling it.  Restarted on the same port, it is found again by the requests that name it, not by a redial: a
    request's open-ahead OpenSession (or its Done) makes the worker dial it, while each pull until that link is up
    recomputes at once (none waits); the link's PeerUp ends the hint's "down", and a later pull is served, within
    FAILED_S (the puller's hint, after which pulls ask again) of the restart."""
    # no tier-poll thread: the source's tier restarts its worker only when this test steps it
    owner = Engine("gnown", free_port(), num_chunks=16, engine_extra={"tier_poll_interval_s": 0})
    reader = Engine("gnrd", free_port(), num_chunks=8, worker_settings={"control": {"forget_down_s": FORGET_S}})
    try:
        address, old = served_then_killed(owner, reader, [710, 711, 712, 713], "gn-1")
        ctx = pull(reader, address, "gn-2")
        assert until_answered(reader, [], ctx, [720, 721, 722, 723], timeout_s=10) == [LookupResult.MISS] * 4
        with reader.lock:
            reader.mgr.on_request_finished(ctx)
        admin = reader.tier.supervisor.client.admin_path  # the puller's worker, as `p2pworker inspect` asks it
        deadline = time.monotonic() + FORGET_S + 3.0
        while query(admin)["counters"].get("links_dropped_down", 0) < 1:  # it stopped redialling the source
            assert time.monotonic() < deadline, "the puller's worker still redials the dead source"
            time.sleep(0.05)
        assert query(admin)["links_down"] == 0
        run_until([owner], lambda: owner.tier.supervisor.serving and owner.tier.supervisor.client.proc.pid != old)
        owner.store("own-3", [730, 731, 732, 733])
        run_until([owner], owner.idle)
        back, slowest, n = time.monotonic(), 0.0, 0
        while True:
            n += 1
            ctx = pull(reader, address, f"gn-3-{n}")
            t0 = time.monotonic()
            got = until_answered(reader, [owner], ctx, [730, 731, 732, 733], timeout_s=30)
            if got == [LookupResult.HIT] * 4:
                break
            slowest = max(slowest, time.monotonic() - t0)
            with reader.lock:
                reader.mgr.on_request_finished(ctx)
            assert time.monotonic() - back < FAILED_S + 2.0, f"not pulled from {FAILED_S:g} s after its restart"
            until = time.monotonic() + 0.25
            run_until([reader, owner], lambda: time.monotonic() > until)  # both step on (vLLM 0.32 reads the tier's
            # worker events on steps only), as engines computing their requests do
        served_s = time.monotonic() - back
        reader.check_loaded(ctx, [730, 731, 732, 733])
        assert slowest < 1.0, f"a pull to the restarted source recomputed after {slowest:.2f} s"
        print(f"source restarted after the puller dropped its link: served {served_s:.2f} s after the restart "
              f"({n - 1} pull(s) recomputed before, each within {slowest:.3f} s)")
    finally:
        for e in (reader, owner):
            e.close()


LOOKUP_TIMEOUT_S = 2.0  # both workers' [session] lookup_timeout_s here (5 s by default)


@pytest.mark.parametrize("pull_path", ["one_trip", "ask_first"])
def test_a_source_that_takes_the_link_but_never_answers_is_recomputed_within_lookup_timeout(free_port, pull_path):
    """The source's worker is up and its links too, but its engine never answers what the worker asks it (vLLM's
    scheduler wedged, or a tier-poll thread that stopped): the puller's request is answered MISS (vLLM recomputes)
    within lookup_timeout_s plus a tick, on the one-trip path (the source ends the asking round) and the two-step
    path (the puller's lookup times out) alike, instead of waiting out a load's 30 s lease."""
    settings = {"session": {"lookup_timeout_s": LOOKUP_TIMEOUT_S}}
    # no tier-poll thread and no steps after the store: the source's tier never reads its worker's question
    owner = Engine("mute", free_port(), num_chunks=16, engine_extra={"tier_poll_interval_s": 0},
                   worker_settings=settings)
    reader = Engine("mutrd", free_port(), num_chunks=16, pull_path=pull_path, worker_settings=settings)
    try:
        ids = list(range(500, 504))
        owner.store("own", ids)
        run_until([owner], owner.idle)
        ctx = pull(reader, owner.tier.worker_address, "mute-0", "mute-0")
        t0 = time.monotonic()
        seen = []
        while time.monotonic() - t0 < LOOKUP_TIMEOUT_S + 10:  # the puller alone steps, as its scheduler would
            seen.append(reader.lookup(ctx, ids))
            if seen[-1] == [LookupResult.MISS] * 4:
                break
            reader.step([ctx.req_id] if len(seen) == 1 else [])
            time.sleep(0.01)
        took = time.monotonic() - t0
        assert seen[-1] == [LookupResult.MISS] * 4, seen[-3:]
        assert took <= LOOKUP_TIMEOUT_S + 1.0, f"a source that never answers held the request {took:.2f} s"
        # and it was the timeout that ended it: the source's worker and link were up all along (no early refusal)
        assert took >= 0.8 * LOOKUP_TIMEOUT_S, f"answered after {took:.2f} s: not the source's silence that ended it"
        c = reader.tier.counters()
        assert c["loads_ok"] == 0 and c["pull_keys_landed"] == 0, c
        print(f"{pull_path}: answered MISS after {took:.2f} s (lookup_timeout_s {LOOKUP_TIMEOUT_S:g})")
        with reader.lock:
            reader.mgr.on_request_finished(ctx)
        run_until([reader], reader.idle, timeout_s=10)
    finally:
        for e in (reader, owner):
            e.close()


def _siblings_one_ended(prefill: Engine, decode: Engine, ids: list[int], tag: str) -> ReqContext:
    """The prefill parks ``ids`` for kv-<tag>; two decode requests of that id start, and the first ends (aborted)
    before it loads.  Returns the second, still live."""
    prefill.store(f"p-{tag}", ids, {"remote_decoder": {"kv_request_id": f"kv-{tag}"}})
    host, port = prefill.tier.worker_address.split(":")
    params = {"remote_prefiller": {"kv_request_id": f"kv-{tag}", "remote_host": host, "remote_port": int(port)}}
    first, second = (ReqContext(req_id=f"d-{tag}-{i}", kv_transfer_params=params) for i in (1, 2))
    with decode.lock:
        decode.mgr.on_new_request(first)
        decode.mgr.on_new_request(second)
        decode.mgr.on_request_finished(first)
    return second


def test_a_siblings_end_does_not_release_what_the_other_request_of_its_id_loads(free_port):
    """Two live decode requests share a kv_request_id (sampling with n > 1, or an orchestrator that reuses ids).
    The first ends before it loads: the prefill keeps what it parked for the id (no ConsumerDone yet), and the
    second still loads it all; the ConsumerDone goes when the last one ends."""
    prefill, decode = Engine("sbpf", free_port(), num_chunks=16), Engine("sbpd", free_port(), num_chunks=16)
    try:
        ids = list(range(600, 604))
        second = _siblings_one_ended(prefill, decode, ids, "sib")
        run_until([prefill, decode], lambda: decode.idle() and not decode.tier.outbox.pending, timeout_s=10)
        seen = passes(decode, prefill, second, ids, 3)
        assert LookupResult.HIT_PENDING in seen[0] and seen[-1] == [LookupResult.HIT] * 4, seen
        c = decode.tier.counters()
        assert c["loads_ok"] == 1 and c["loads_failed"] == 0, c
        with decode.lock:
            decode.mgr.on_request_finished(second)  # the last: the prefill now releases the id
        run_until([prefill, decode], prefill.idle, timeout_s=20)
    finally:
        for e in (decode, prefill):
            e.close()


def test_the_peer_releases_an_id_when_the_last_of_its_requests_ends(free_port):
    """Two live decode requests share a kv_request_id and neither loads (both aborted): the prefill keeps what it
    parked for the id while one of them lives, and releases it as soon as the last one ends (ConsumerDone), not
    park_timeout_s later."""
    prefill, decode = Engine("sbrpf", free_port(), num_chunks=16), Engine("sbrpd", free_port(), num_chunks=16)
    try:
        second = _siblings_one_ended(prefill, decode, list(range(650, 654)), "rel")
        t0 = time.monotonic()
        while time.monotonic() - t0 < 1.5:  # both engines step: a ConsumerDone, had one gone, is handled by now
            for e in (decode, prefill):
                e.step()
            time.sleep(0.01)
        assert not prefill.idle(), "the prefill released the id while a request of it still lived"
        with decode.lock:
            decode.mgr.on_request_finished(second)
        t0 = time.monotonic()
        run_until([prefill, decode], prefill.idle, timeout_s=10)
        released = time.monotonic() - t0
        assert released < 5.0, f"released {released:.2f} s after the last request ended"
        print(f"the id held 1.5 s while a sibling lived; released {released:.3f} s after the last one ended")
    finally:
        for e in (decode, prefill):
            e.close()
