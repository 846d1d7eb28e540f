"""benchmarks/pull_vs_recompute.py without engines: how it judges an arm by the puller's counter deltas (so an arm
that silently recomputed never passes as a pull, nor a hit as a recompute), the answer check, the summary and its
crossover, and the table."""

from __future__ import annotations

import json

import pytest

from benchmarks.pull_vs_recompute import (Arm, Cell, Tier, answer_problem, arm_problem, kv_bytes_per_token,
                                          parse_args, summarize, table, wire_problem)
from p2pworker.calibrate import CachedTokens, Served, classify
from tests.helpers.tiny_model import CONFIG

pytestmark = pytest.mark.timeout(30)

HIT = 512


@pytest.mark.parametrize("arm,delta,ok", [
    (Arm.RECOMPUTE, CachedTokens(), True),
    (Arm.RECOMPUTE, CachedTokens(host=HIT), False),  # a cache answered: not a recompute
    (Arm.RECOMPUTE, CachedTokens(device=128), False),
    (Arm.LOCAL, CachedTokens(host=HIT), True),
    (Arm.LOCAL, CachedTokens(), False),  # the CPU tier did not hold it: recomputed
    (Arm.LOCAL, CachedTokens(device=HIT), False),  # the device cache was not reset
    (Arm.LOCAL, CachedTokens(host=HIT, p2p=HIT), False),
    (Arm.PULL_IDLE, CachedTokens(p2p=HIT), True),
    (Arm.PULL_IDLE, CachedTokens(), False),  # the pull never fired: a silent recompute
    (Arm.PULL_BUSY, CachedTokens(p2p=HIT - 128), False),  # part of the prefix only
    (Arm.PULL_BUSY, CachedTokens(host=HIT), False),  # the puller held it already
    (Arm.PULL_BUSY, CachedTokens(p2p=HIT), True),
    (Arm.PULL_MISS, CachedTokens(), True),  # the source held nothing: recomputed
    (Arm.PULL_MISS, CachedTokens(p2p=HIT), False),  # it held the prompt after all: not a miss
])
def test_arm_problem(arm, delta, ok):
    problem = arm_problem(arm, delta, HIT)
    assert (problem is None) is ok, problem
    if not ok:
        assert arm.value in problem and classify(delta, HIT).value in problem


def test_each_arm_expects_its_own_source():
    assert [a.expected for a in Arm] == [Served.RECOMPUTED, Served.HOST_HIT, Served.P2P_PULL, Served.P2P_PULL,
                                         Served.RECOMPUTED]  # a miss recomputes


def test_answer_problem():
    want = (["a", "b"], [-0.5, -1.0])
    assert answer_problem((["a", "b"], [-0.50001, -1.0]), want) is None
    assert "answer differs" in answer_problem((["a", "c"], [-0.5, -1.0]), want)
    assert "logprobs differ" in answer_problem((["a", "b"], [-0.6, -1.0]), want)


def _cell(arm, tokens, ms, rep=0, problem=None):
    delta = {Arm.RECOMPUTE: CachedTokens(), Arm.LOCAL: CachedTokens(host=tokens - 8)}.get(
        arm, CachedTokens(p2p=tokens - 8))
    return Cell(Tier.OURS, arm, (tokens - 8) // 128, tokens, rep, ms / 1e3, classify(delta, tokens - 8), delta,
                problem)


def test_summary_crossover_and_table():
    cells = []
    for tokens, rec, pull in ((136, 10, 30), (264, 20, 25), (520, 40, 30), (1032, 80, 35)):
        for rep in range(3):
            cells += [_cell(Arm.RECOMPUTE, tokens, rec + rep), _cell(Arm.PULL_IDLE, tokens, pull + rep),
                      _cell(Arm.PULL_BUSY, tokens, 2 * pull + rep), _cell(Arm.LOCAL, tokens, 5)]
    cells.append(_cell(Arm.PULL_IDLE, 136, 1, rep=9, problem="pull_idle: recomputed"))  # failed: not counted
    s = summarize(cells)["ours"]
    assert s["crossover_tokens"] == {"pull_idle": 520, "pull_busy": 1032}
    assert s["ttft_ms"]["pull_idle"]["136"] == {"median": 31.0, "min": 30.0, "max": 32.0, "n": 3}
    text = table(summarize(cells))
    assert "crossover (pull_idle vs recompute): 520 tokens" in text
    assert "31.0 [30.0..32.0]" in text


def test_no_crossover_is_said_so():
    cells = [_cell(Arm.RECOMPUTE, 136, 5), _cell(Arm.PULL_IDLE, 136, 50)]
    s = summarize(cells)["ours"]
    assert s["crossover_tokens"]["pull_idle"] is None
    assert "none: recompute is as fast or faster" in table(summarize(cells))


def test_default_chunks_reach_the_longest_prefix_that_fits():
    a = parse_args(["--max-model-len", "2048"])
    assert a.chunk_list == [1, 2, 4, 8, 15]  # 15 * 128 + 8 tokens + 12 answer tokens <= 2048
    with pytest.raises(SystemExit):
        parse_args(["--chunks", "16"])


def test_a_pull_across_hosts_must_have_sent_its_kv_on_the_wire(tmp_path):
    """--hosts two: the source host's interface must have sent at least the KV of the pulled tokens (a pull through
    shared memory or a same-host copy leaves it quiet); other arms, and one host, are not judged by it."""
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    per_token = kv_bytes_per_token(str(tmp_path))
    assert per_token == (CONFIG["num_hidden_layers"] * 2 * CONFIG["num_key_value_heads"]
                         * CONFIG["hidden_size"] // CONFIG["num_attention_heads"] * 4)
    pulled = CachedTokens(p2p=HIT)
    assert wire_problem(Arm.PULL_IDLE, pulled, HIT * per_token, per_token) is None
    assert "less than" in wire_problem(Arm.PULL_BUSY, pulled, HIT * per_token - 1, per_token)
    assert wire_problem(Arm.PULL_IDLE, pulled, None, per_token) is None  # one host: no wire watched
    assert wire_problem(Arm.LOCAL, CachedTokens(host=HIT), 0, per_token) is None
