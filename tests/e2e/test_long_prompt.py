"""End to end, any prompt length: a real PD pair of `vllm serve` answering a prompt whose KV spans more
chunks than one ring slot could carry before (~1,500 keys per job): 52,000 tokens in blocks of 32 tokens (the
smallest block vLLM's CPU backend accepts; 16 is refused) is 1,625 chunks, loaded by the decode engine as one job.

Its own pair of engines (started after and stopped before the main e2e pair): a tiny model with 64k positions,
``--block-size 32 --max-model-len 53248``.  Each long prefill takes ~6-9 s on this CPU backend on a CPU with AVX-512,
~157-171 s on one with AVX2 only (2026-12-03: the first chunks' stores then waited far longer than park_timeout_s).
"""

from __future__ import annotations

import glob
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.e2e import PD, assert_same, baseline, running
from tests.helpers.tiny_model import prompt

pytestmark = pytest.mark.timeout(900)

BLOCK = 32
N_TOKENS = 52_000  # one word of tiny_model.WORDS (with its space) is one token
# One prefill of this prompt is all attention on one CPU thread: 157 s on a slow day of this 2-core box (an HTTP
# timeout of 120 s failed CI there); the PD request computes it again on the prefill engine.
REQUEST_TIMEOUT_S = 600.0
MAX_MODEL_LEN = 53_248


@pytest.fixture(scope="module")
def long_pd(tmp_path_factory):
    from tests.helpers.tiny_model import build

    model = build(str(tmp_path_factory.mktemp("tiny-llama-64k")), seed=0, max_position_embeddings=65_536)
    pair = PD(model, str(tmp_path_factory.mktemp("pd-long")))
    pair.env.update({
        "VLLM_ARGS": f"--enforce-eager --dtype float32 --block-size {BLOCK} --max-model-len {MAX_MODEL_LEN} "
                     f"--max-num-batched-tokens 16384 --max-num-seqs 4",
        "CPU_BYTES": str(256 << 20),  # 1,625 chunks of 64 KiB (2 layers x K,V x 4 heads x 32 dims x 32 tokens x fp32)
    })
    with running(pair):
        yield pair


def _largest_load(pd: PD) -> int:
    """The largest load job (keys) the decode engine's worker has seen, from `p2pworker inspect --json`."""
    (admin,) = glob.glob(f"/tmp/p2pworker-vllm-{pd.engine_id('decode')}*.admin")
    res = subprocess.run([str(Path(sys.executable).with_name("p2pworker")), "inspect", "--json", "--admin", admin],
                         capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stderr
    (st,) = json.loads(res.stdout)
    return int(st["counters"].get("largest_load_keys", 0))


def test_a_1625_chunk_prompt_through_pd_equals_the_single_engine(long_pd):
    pd = long_pd
    text = prompt(N_TOKENS, seed=7000)
    t0 = time.monotonic()
    want = baseline(pd, text, timeout_s=REQUEST_TIMEOUT_S)
    baseline_s = time.monotonic() - t0
    before = pd.p2p_cached()
    t0 = time.monotonic()
    got = pd.complete("router", text, timeout_s=REQUEST_TIMEOUT_S)
    pd_s = time.monotonic() - t0
    cached = pd.p2p_cached() - before
    assert_same(got, want, f"{N_TOKENS}-token prompt")
    chunks = cached // BLOCK
    assert chunks > 1600, f"decode served {cached} prompt tokens ({chunks} chunks) from P2P, want > 1,600 chunks"
    assert cached >= (N_TOKENS - 2 * BLOCK) // BLOCK * BLOCK, f"decode served only {cached} of {N_TOKENS} from P2P"
    largest = _largest_load(pd)
    assert largest > 1600, f"the decode worker's largest load job had {largest} keys: the prompt did not go as one"
    pd.report["long_prompt"] = {"prompt_tokens": N_TOKENS, "p2p_tokens": cached, "largest_load_keys": largest,
                                "baseline_request_s": round(baseline_s, 1), "pd_request_s": round(pd_s, 1)}
    print("\nlong prompt:", pd.report["long_prompt"])
