"""``p2pworker calibrate``'s logic against fake engines (tests/helpers/fakes/openai_engine.py): the refusals, the
attribution of each leg, the crossover it recommends; and the pure pieces (classification, lengths, crossover).

The fakes' legs differ by tens of milliseconds of sleep at every tested length, so which one wins never depends on
the machine's load; settle is 0 (the fakes store at once)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from p2pworker import calibrate as cal
from p2pworker.cli import main
from tests.helpers.fakes.openai_engine import FakeEngine, Script
from tests.helpers.ports import free_port

pytestmark = pytest.mark.timeout(60)

# recompute 1 ms/token: 16 tokens ~16 ms, 256 tokens ~256 ms; a pull ~100 ms at any length
FAST_PULL = dict(recompute_s_per_token=0.001, pull_s=0.1)
LENGTHS = "16,256"


@pytest.fixture
def pair():
    made = []

    def make(source: dict | None = None, puller: dict | None = None):
        src = FakeEngine(Script(**{"recompute_s_per_token": 0.0, **(source or {})}))
        pul = FakeEngine(Script(**{**FAST_PULL, **(puller or {})}), source=src)
        made.extend([src, pul])
        return src, pul

    yield make
    for e in made:
        e.close()


def _run(src, pul, *extra: str, p2p: str | None = "127.0.0.1:5710", fingerprints=None, monkeypatch=None):
    if monkeypatch is not None:
        monkeypatch.setattr("p2pworker.cli.worker_fingerprint",
                            lambda address, timeout_s=5.0: (fingerprints or {}).get(address, ("d0", {"x": 1})))
    args = ["calibrate", "--source", src.url, "--puller", pul.url, "--lengths", LENGTHS, "--reps", "3",
            "--settle", "0", "--timeout", "10", "--seed", "1", *extra]
    if p2p:
        args += ["--source-p2p", p2p]
    return CliRunner().invoke(main, args)


def test_a_ladder_where_the_pull_wins_at_the_long_length(pair, monkeypatch, tmp_path):
    src, pul = pair()
    out = tmp_path / "cal.json"
    r = _run(src, pul, "--json", str(out), monkeypatch=monkeypatch)
    assert r.exit_code == 0, r.output
    assert "MIN_CACHED_TOKEN_DELTA=256" in r.output
    assert "minCachedTokenDelta: 256" in r.output
    doc = json.loads(out.read_text())
    assert doc["min_cached_token_delta"] == 256
    assert [p["length"] for p in doc["points"]] == [16, 256]
    assert [p["pulled_tokens"] for p in doc["points"]] == [[16] * 3, [256] * 3]
    # every timed leg is attributed: the control recomputed, the pull pulled every full block
    legs = {(s["leg"], s["served"]) for s in doc["samples"]}
    assert legs == {("recompute", "recomputed"), ("pull", "p2p pull")}
    # the pulls asked the fake's source worker, each under its own request id
    pulls = [b for b in pul.requests if b.get("kv_transfer_params")]
    ids = {b["kv_transfer_params"]["remote_kv_source"]["kv_request_id"] for b in pulls}
    assert len(ids) == len(pulls) == 1 + 2 * 3  # the warm-up's and 3 per length
    assert {b["kv_transfer_params"]["remote_kv_source"]["remote_port"] for b in pulls} == {5710}
    assert all(len(b["prompt"]) in (17, 257) for b in pul.requests)  # one token past the cached ones


def test_no_crossover_exits_1_with_the_table(pair, monkeypatch):
    src, pul = pair(puller={"recompute_s_per_token": 0.0, "pull_s": 0.1})
    r = _run(src, pul, monkeypatch=monkeypatch)
    assert r.exit_code == 1
    assert "NO CROSSOVER" in r.output and "MIN_CACHED_TOKEN_DELTA" not in r.output
    assert "recompute ms" in r.output  # the table still printed


def test_a_contaminated_control_leg_is_refused(pair, monkeypatch):
    src, pul = pair(puller={"contaminate": True})
    r = _run(src, pul, monkeypatch=monkeypatch)
    assert r.exit_code == 1
    assert "refused (contaminated)" in r.output and "host hit" in r.output


def test_a_pull_that_never_fires_is_refused(pair, monkeypatch):
    src, pul = pair(puller={"pulls_fail": True})
    r = _run(src, pul, monkeypatch=monkeypatch)
    assert r.exit_code == 1
    assert "refused (no pull)" in r.output and "recomputed" in r.output and "p2pworker ping" in r.output


def test_an_unreachable_engine_is_refused(pair, monkeypatch):
    src, _ = pair()
    r = CliRunner().invoke(main, ["calibrate", "--source", src.url, "--puller", f"http://127.0.0.1:{free_port()}",
                                  "--source-p2p", "127.0.0.1:5710", "--timeout", "5"])
    assert r.exit_code == 1
    assert "refused (unreachable)" in r.output and "Connection refused" in r.output


@pytest.mark.parametrize("role", ["source", "puller"])
def test_an_engine_without_the_tier_is_refused(pair, monkeypatch, role):
    src, pul = pair(**{role: {"tier": False}})
    r = _run(src, pul, monkeypatch=monkeypatch)
    assert r.exit_code == 1
    assert "refused (no tier)" in r.output and f"the {role} engine" in r.output


def test_a_source_without_a_known_worker_address_is_refused(pair, monkeypatch):
    src, pul = pair()
    r = _run(src, pul, p2p=None, monkeypatch=monkeypatch)
    assert r.exit_code == 1
    assert "refused (no tier)" in r.output and "--source-p2p" in r.output


def test_the_published_worker_address_is_used(pair, monkeypatch):
    src, pul = pair(source={"p2p_address": "127.0.0.1:7777"})
    r = _run(src, pul, p2p=None, monkeypatch=monkeypatch)
    assert r.exit_code == 0, r.output
    ports = {b["kv_transfer_params"]["remote_kv_source"]["remote_port"] for b in pul.requests
             if b.get("kv_transfer_params")}
    assert ports == {7777}


def test_different_models_are_a_fingerprint_refusal(pair, monkeypatch):
    src, pul = pair(puller={"root": "/models/other"})
    r = _run(src, pul, monkeypatch=monkeypatch)
    assert r.exit_code == 1
    assert "refused (fingerprint mismatch)" in r.output and "/models/other" in r.output


def test_the_workers_fingerprints_must_match(pair, monkeypatch):
    src, pul = pair()
    prints = {"127.0.0.1:5710": ("aaaa", {"model.dtype": "float32", "block_bytes": 1}),
              "127.0.0.1:5711": ("bbbb", {"model.dtype": "bfloat16", "block_bytes": 1})}
    r = _run(src, pul, "--puller-p2p", "127.0.0.1:5711", fingerprints=prints, monkeypatch=monkeypatch)
    assert r.exit_code == 1
    assert "refused (fingerprint mismatch)" in r.output
    assert "model.dtype: source 'float32', puller 'bfloat16'" in r.output
    assert not pul.requests  # refused before any request


def test_a_worker_that_does_not_answer_is_refused(pair):
    src, pul = pair()
    r = _run(src, pul, "--timeout", "2", p2p=f"127.0.0.1:{free_port()}")
    assert r.exit_code == 1
    assert "refused (unreachable)" in r.output and "did not answer a handshake" in r.output


# ---------------------------------------------------------------------------------------------------- pure pieces
@pytest.mark.parametrize("delta,served", [
    (cal.CachedTokens(), cal.Served.RECOMPUTED),
    (cal.CachedTokens(host=512), cal.Served.HOST_HIT),
    (cal.CachedTokens(p2p=512), cal.Served.P2P_PULL),
    (cal.CachedTokens(device=512), cal.Served.DEVICE_HIT),
    (cal.CachedTokens(p2p=256), cal.Served.PARTIAL),
    (cal.CachedTokens(host=256, p2p=256), cal.Served.MIXED),
])
def test_classify(delta, served):
    assert cal.classify(delta, 512) is served


def test_expected_hit_tokens_never_counts_the_last_token():
    assert cal.expected_hit_tokens(520, 128) == 512
    assert cal.expected_hit_tokens(512, 128) == 384  # exactly 4 blocks: vLLM computes the last token itself
    assert cal.expected_hit_tokens(5, 128) == 0


def test_cached_tokens_read_sums_every_engine_of_the_source():
    text = ('vllm:prompt_tokens_cached_by_source_total{engine="0",source="p2p"} 128.0\n'
            'vllm:prompt_tokens_cached_by_source_total{engine="1",source="p2p"} 256.0\n'
            'vllm:prompt_tokens_cached_by_source_total{engine="0",source="host"} 5.0\n')
    assert cal.CachedTokens.read(text) == cal.CachedTokens(device=0, host=5, p2p=384)


def test_plan_lengths():
    assert cal.plan_lengths([], 128, 2046) == ([128, 256, 512, 1024], [])  # llm-d's ladder does not fit
    assert cal.plan_lengths([], 16, 40000) == ([2048, 4096, 8192, 16384, 32768], [])
    assert cal.plan_lengths([100, 2048], 128, 2046) == ([128], [2048])  # rounded up to a block; too long dropped


def _pt(length, recompute, pull):
    return cal.Point(length, recompute_s=[recompute], pull_s=[pull])


def test_crossover_needs_the_pull_to_keep_winning():
    assert cal.crossover([_pt(1, 1, 2), _pt(2, 2, 1), _pt(4, 4, 1)]) == 2
    assert cal.crossover([_pt(1, 1, 0.5), _pt(2, 2, 3), _pt(4, 4, 1)]) == 4  # a noisy win below does not count
    assert cal.crossover([_pt(1, 1, 2), _pt(2, 2, 3)]) is None
