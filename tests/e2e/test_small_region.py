"""End to end, regions that differ: a puller whose CPU tier is smaller than one prompt asks a source that holds the
whole prompt (a 64 MiB CPU tier).  vLLM promotes what fits of the promised prefix, then its LRU evicts the
request's own landed chunks to promote the rest; the tier loads once per request and answers MISS after, so the
request is answered with a plain engine's answer in about a plain recompute's time instead of churning round after
round (2.6 s measured before, against 0.05 s for a recompute).

Its own pair (`pd.sh start prefill`, `start decode`, no router), the two engines' CPU tiers set apart with
PREFILL_CPU_BYTES / DECODE_CPU_BYTES."""

from __future__ import annotations

import time
import uuid

import pytest

from tests.helpers.e2e import BLOCK, PD, assert_same, baseline, running
from tests.helpers.tiny_model import prompt

pytestmark = pytest.mark.timeout(600)

CHUNK_BYTES = BLOCK * 2 * 2 * 4 * 32 * 4  # tokens x layers x (K, V) x heads x dims x fp32: 256 KiB
PULLER_CHUNKS = 8
N_WORDS = 1904  # 14 full blocks: more than the puller's CPU tier holds
BOUND_S = 1.0  # over a plain recompute of the same prompt on the puller
LOADS = "vllm:kv_offload_p2pworker_loads_total"  # the puller tier's load jobs, every outcome


@pytest.fixture(scope="module")
def uneven(tiny_model, tmp_path_factory):
    pair = PD(tiny_model, str(tmp_path_factory.mktemp("pd-uneven")))
    pair.env.update({"PREFILL_CPU_BYTES": str(64 << 20), "DECODE_CPU_BYTES": str(PULLER_CHUNKS * CHUNK_BYTES),
                     "P2PWORKER_SECRET": "e2e-small-region"})  # roles started one at a time share a given secret
    with running(pair, starts=(("start", "prefill"), ("start", "decode"))):
        yield pair


def _timed(fn, *args, **kw):
    t0 = time.monotonic()
    out = fn(*args, **kw)
    return out, time.monotonic() - t0


@pytest.mark.parametrize("seed", [9100, 9200])
def test_a_prompt_larger_than_the_pullers_cpu_tier_is_answered_as_a_plain_engine_would(uneven, seed):
    pd = uneven
    text = prompt(N_WORDS, seed=seed)
    want = baseline(pd, text)
    # a plain recompute of a prompt of that length on the puller (cache_salt: no cache can answer it)
    _, plain_s = _timed(pd.complete, "decode", prompt(N_WORDS, seed=seed + 1),
                            cache_salt=f"plain-{uuid.uuid4().hex}")
    pd.complete("prefill", text)  # the source computes the prompt and keeps it in its CPU tier
    time.sleep(1.0)  # its offload settles
    before, loads_before = pd.p2p_cached(), pd.metric("decode", LOADS)
    src = {"kv_request_id": f"pull-{uuid.uuid4().hex}", "remote_host": "127.0.0.1", "remote_port": pd.prefill_p2p}
    got, took = _timed(pd.complete, "decode", text, kv_transfer_params={"remote_kv_source": src})
    pulled = pd.p2p_cached() - before
    loads = pd.metric("decode", LOADS) - loads_before
    assert_same(got, want, f"a {N_WORDS}-token prompt pulled into a {PULLER_CHUNKS}-chunk CPU tier")
    assert loads == 1, f"{loads:g} loads for one request: the pull churned (or never went out)"
    assert took <= plain_s + BOUND_S, f"the pull took {took:.2f} s against {plain_s:.2f} s for a plain recompute"
    pd.report.setdefault("small_region", []).append(
        {"prompt_tokens": N_WORDS, "puller_chunks": PULLER_CHUNKS, "request_s": round(took, 3), "loads": loads,
         "plain_recompute_s": round(plain_s, 3), "p2p_tokens": pulled})
    print(f"\nsmall region: {took:.3f} s (plain recompute {plain_s:.3f} s), {pulled:g} tokens pulled")
