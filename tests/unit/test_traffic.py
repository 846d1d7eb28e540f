"""benchmarks/traffic.py without engines: the seeded workload (same seed, same prompts; each turn extends the last;
each turn on another engine than the last, naming it as the source), arrivals, percentiles, a run's summary, the
answer check, the TTFT target, the rate sustained and the goodput, the verdict, and how a turn's request is shaped
per arm."""

from __future__ import annotations

import random
import statistics

import pytest

from benchmarks.traffic_load import SOURCE_HEADER, Endpoint, Fleet, Snapshot, snapshot_delta, tier_counters
from benchmarks.traffic_plan import (Arm, RatePoint, Record, Shares, Span, Sustained, Workload, answer_problem,
                                     arrivals, build, percentile, request_goodput, route, summarize, sustained,
                                     ttft_target_ms, verdict)
from p2pworker.calibrate import CachedTokens

pytestmark = pytest.mark.timeout(30)

W = Workload(conversations=6, turns=4, system_prompts=2, system_tokens=64, user_tokens=Span(20, 40),
             answer_tokens=Span(10, 20), output_tokens=8, think_s=0.5, engines=2, check_every=3, seed=5)


def test_the_same_seed_and_salt_give_the_same_prompts_at_any_rate():
    a, b, c = build(W, 1.0, salt=1), build(W, 4.0, salt=1), build(W, 1.0, salt=2)
    prompts = [[t.prompt for t in conv.turns] for conv in a]
    assert prompts == [[t.prompt for t in conv.turns] for conv in b]  # arms at other rates: the same history
    assert prompts != [[t.prompt for t in conv.turns] for conv in c]  # another rate's run: fresh prompts
    assert [conv.start_s for conv in a] != [conv.start_s for conv in b]
    assert a == build(W, 1.0, salt=1)


def test_each_turn_extends_the_last_and_conversations_share_system_prompts():
    convs = build(W, 2.0, salt=0)
    for conv in convs:
        for prev, turn in zip(conv.turns, conv.turns[1:]):
            assert turn.prompt[:len(prev.prompt)] == prev.prompt
            grown = len(turn.prompt) - len(prev.prompt)
            assert W.answer_tokens.lo + W.user_tokens.lo <= grown <= W.answer_tokens.hi + W.user_tokens.hi
        assert len(conv.turns[0].prompt) <= W.system_tokens + W.user_tokens.hi
        assert max(len(t.prompt) for t in conv.turns) <= W.longest_prompt()
    sys0 = [c.turns[0].prompt[:W.system_tokens] for c in convs]
    assert sys0[0] == sys0[2] == sys0[4] and sys0[1] == sys0[3] and sys0[0] != sys0[1]
    assert convs[0].turns[0].prompt[W.system_tokens:] != convs[2].turns[0].prompt[W.system_tokens:]


def test_each_turn_goes_to_another_engine_than_the_last_and_names_it_as_its_source():
    for engines in (2, 3):
        for c in range(5):
            last = None
            for t in range(6):
                engine, source = route(c, t, engines)
                assert source == last and engine != last
                last = engine
    convs = build(W, 1.0, salt=0)
    assert {c.turns[0].engine for c in convs} == {0, 1}  # first turns spread over the engines
    assert all(t.think_s == 0 for c in convs for t in c.turns[:1])
    assert all(t.think_s > 0 for c in convs for t in c.turns[1:])
    checked = [t.key for c in convs for t in c.turns if t.check]
    assert len(checked) == W.conversations * W.turns // W.check_every


def test_arrivals_are_poisson_at_the_rate():
    starts = arrivals(4000, 2.0, random.Random(1))
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    assert starts[0] == 0 and all(g >= 0 for g in gaps)
    assert statistics.mean(gaps) == pytest.approx(0.5, rel=0.06)
    assert statistics.stdev(gaps) == pytest.approx(0.5, rel=0.1)  # exponential: stdev = mean


def test_a_workload_refuses_what_it_cannot_route():
    with pytest.raises(ValueError):
        build(Workload(engines=1), 1.0, 0)
    with pytest.raises(ValueError):
        build(W, 0.0, 0)


def test_percentile_is_linear_between_ranks():
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile(list(range(101)), 90) == 90
    assert percentile([10, 0], 100) == 10


def _rec(key, ttft, gaps=(), tokens=4, error=None):
    return Record(key, 0, 0.0, ttft, 1.0, list(gaps), 100, tokens, error=error)


def test_summary_counts_failures_and_leaves_them_out_of_the_percentiles():
    recs = [_rec("a", 0.010, [0.001, 0.003]), _rec("b", 0.030, [0.002]), _rec("c", None, error="HTTP 500: x")]
    s = summarize(recs, wall_s=2.0)
    assert s["requests"] == 3 and s["failed"] == 1
    assert s["ttft_ms"]["p50"] == 20.0 and s["ttft_ms"]["p99"] == pytest.approx(29.8)
    assert s["itl_ms"]["p50"] == 2.0
    assert s["output_tokens"] == 8 and s["output_tokens_per_s"] == 4.0 and s["requests_per_s"] == 1.0
    assert s["ttft_ms_sorted"] == [10.0, 30.0] and s["latency_ms"]["p50"] == 1000.0  # failed: in neither


def test_answer_problem():
    got = Record("c0t1", 0, 0.0, 0.01, tokens=["a", "b"], logprobs=[-1.0, -2.0])
    assert answer_problem(got, ["a", "b"], [-1.0, -2.00001], 1e-4) is None
    assert "tokens differ" in answer_problem(got, ["a", "c"], [-1.0, -2.0], 1e-4)
    assert "logprobs differ" in answer_problem(got, ["a", "b"], [-1.0, -2.1], 1e-4)


def test_shares_of_prompt_tokens():
    s = Shares(prompt=1000, pulled=300, local=500).to_json()
    assert s["recomputed_tokens"] == 200 and s["pulled_share"] == 0.3 and s["recomputed_share"] == 0.2
    assert Shares(100, 0, 120).recomputed == 0  # counters read at slightly different moments: never negative


def test_the_target_comes_from_no_sharing_at_its_lowest_rate():
    pts = [RatePoint(4, 90.0), RatePoint(1, 40.0), RatePoint(2, 55.0)]
    assert ttft_target_ms(pts, 2.0) == 80.0
    assert ttft_target_ms([RatePoint(1, None), RatePoint(2, 30.0)], 2.0) == 60.0
    assert ttft_target_ms([], 2.0) is None


@pytest.mark.parametrize("p90s, want", [
    ((40, 60, 79), Sustained(4, 4)),  # within at every swept rate: the highest rate
    ((40, 60, 100), Sustained(2, 3.0)),  # crosses 80 halfway from 2 to 4 req/s
    ((40, 90, 70), Sustained(1, 1.8)),  # a later dip under the target does not count
    ((90, 60, 70), Sustained(None, None)),  # over it at the lowest rate
    ((40, None, 50), Sustained(1, 1)),  # a rate that failed requests is never within
])
def test_the_rate_sustained(p90s, want):
    assert sustained([RatePoint(r, p) for r, p in zip((1, 2, 4), p90s)], 80.0) == want


def test_goodput_counts_the_requests_that_met_the_target_per_second():
    assert request_goodput([10.0, 50.0, 80.0, 80.1, 200.0], 80.0, wall_s=2.0) == 1.5  # 3 within, over 2 s
    assert request_goodput([], 80.0, wall_s=2.0) == 0.0 and request_goodput([1.0], 80.0, wall_s=0) is None


def test_verdict_reads_the_goals():
    gps = {"ours": Sustained(4, 3.0), "none": Sustained(2, 2.0), "intree": Sustained(1, 1.5)}
    pts = {"ours": [RatePoint(1, 10, 20), RatePoint(2, 10, 50)], "none": [RatePoint(1, 10, 30), RatePoint(2, 10, 40)]}
    v = verdict(gps, pts)
    assert v["sustained_ours_over_none"] == 1.5 and v["sustained_ours_over_intree"] == 2.0
    assert v["p99_ours_above_none_at_rates"] == [2]


def test_a_turn_names_its_source_per_arm_and_shape():
    eps = [Endpoint("http://127.0.0.1:1", "127.0.0.1", 11), Endpoint("http://127.0.0.2:2", "127.0.0.2", 22)]
    turn = build(W, 1.0, 0)[0].turns[1]
    assert turn.source is not None and turn.engine != turn.source
    url, body, headers = Fleet(eps, Arm.OURS).request(turn)
    assert url == eps[turn.engine].url
    src = body["kv_transfer_params"]["remote_kv_source"]
    assert (src["remote_host"], src["remote_port"]) == (eps[turn.source].p2p_host, eps[turn.source].p2p_port)
    assert body["ignore_eos"] and body["stream"] and body["max_tokens"] == W.output_tokens
    _, body, _ = Fleet(eps, Arm.NONE).request(turn)
    assert "kv_transfer_params" not in body
    _, body, _ = Fleet(eps, Arm.OURS).request(build(W, 1.0, 0)[0].turns[0])
    assert "kv_transfer_params" not in body  # a first turn has no source
    url, body, headers = Fleet(eps, Arm.OURS, router="http://r:9", decode_worker="127.0.0.2:22").request(turn)
    assert url == "http://r:9" and headers[SOURCE_HEADER] == "127.0.0.2:22" and "kv_transfer_params" not in body


def test_snapshot_delta_attributes_tokens_and_worker_cpu_per_pulled_token():
    a = Snapshot(1000, CachedTokens(100, 0, 0), {"loads.ok": 2}, 10.0, 1.0)
    b = Snapshot(3000, CachedTokens(600, 100, 1000), {"loads.ok": 7, "loads.failed": 1}, 14.0, 1.5)
    d = snapshot_delta(a, b)
    assert d["tokens"]["pulled_tokens"] == 1000 and d["tokens"]["local_tokens"] == 600
    assert d["tokens"]["recomputed_tokens"] == 400
    assert d["tier_counters"] == {"loads.ok": 5, "loads.failed": 1}
    assert d["cpu"] == {"engines_s": 4.0, "workers_s": 0.5, "worker_us_per_pulled_token": 500.0}


def test_tier_counters_are_read_by_pattern_summed_over_workers():
    text = """# TYPE vllm:kv_offload_p2pworker_loads_total counter
vllm:kv_offload_p2pworker_loads_total{engine="0",outcome="ok",worker="a"} 3.0
vllm:kv_offload_p2pworker_loads_total{engine="0",outcome="ok",worker="b"} 2.0
vllm:kv_offload_p2pworker_pull_keys_total{engine="0",outcome="missed",worker="a"} 7.0
vllm:kv_offload_p2pworker_pulls_total{engine="0",path="one_trip",worker="a"} 1.0
vllm:kv_offload_p2pworker_worker_deaths_total{engine="0",worker="a"} 0.0
vllm:kv_offload_p2pworker_jobs_in_flight{engine="0",worker="a"} 4.0
vllm:prompt_tokens_total{engine="0"} 99.0
"""
    assert tier_counters(text) == {"loads.ok": 5.0, "pull_keys.missed": 7.0, "pulls.one_trip": 1.0,
                                   "worker_deaths": 0.0}


RACE = ('(APIServer pid=1) ERROR 12-06 04:28:40 [async_llm.py:906] AsyncLLM output_handler failed.\n'
        '(APIServer pid=1) ERROR 12-06 04:28:40 [async_llm.py:906] Traceback (most recent call last):\n'
        '(APIServer pid=1) ERROR 12-06 04:28:40 [async_llm.py:906] vllm.v1.engine.exceptions.EngineDeadError: x\n')
STOP = "(APIServer pid=1) INFO 12-06 04:28:31 [launcher.py:254] [shutdown] API server: shutdown triggered\n"


@pytest.mark.parametrize("text, errors, race", [
    ("INFO fine\n" + STOP + "INFO done\n", 0, 0),
    ("INFO fine\n" + STOP + RACE, 0, 3),  # vLLM's own shutdown race: apart
    ("INFO fine\n" + RACE + STOP, 3, 0),  # the same lines before the stop: the engine died
    (STOP + RACE.replace("EngineDeadError", "ValueError"), 3, 0),  # another exception there: an error
    ("(EngineCore pid=2) ERROR 12-06 [core.py:1] boom\n" + STOP + RACE, 1, 3),
    ("Traceback (most recent call last):\n" + STOP, 1, 0),
])
def test_log_errors_keep_vllms_shutdown_race_apart(tmp_path, text, errors, race):
    from benchmarks.engines import log_errors

    log = tmp_path / "engine.log"
    log.write_text(text)
    found = log_errors(str(log))
    assert (len(found.errors), len(found.shutdown_race)) == (errors, race), found
    assert log_errors(str(log), offset=len(text)).errors == []
    assert log_errors(str(tmp_path / "missing.log")).errors == []


def _report(p90s: dict[str, list[float]], failed: dict[str, int] | None = None) -> dict:
    arms = {}
    for arm, vals in p90s.items():
        rates = {}
        for rate, p90 in zip((1.0, 2.0, 4.0), vals):
            f = (failed or {}).get(f"{arm}@{rate}", 0)
            rates[str(rate)] = {"client": {"requests": 10, "failed": f, "requests_per_s": rate,
                                           "output_tokens_per_s": 10.0, "wall_s": 2.0,
                                           "ttft_ms": {"p50": p90 / 2, "p90": p90, "p99": p90 * 1.5},
                                           "ttft_ms_sorted": [p90 / 2, p90], "itl_ms": {"p50": 1.0, "p99": 2.0},
                                           "latency_ms": {"p50": 100.0, "p90": 200.0}},
                                "tokens": Shares(100, 20, 30).to_json(),
                                "cpu": {"engines_s": 1.0, "workers_s": 0.1}}
        arms[arm] = {"rates": rates}
    return {"arms": arms}


def test_the_run_is_judged_from_its_rates():
    from benchmarks.traffic import judge, table

    report = _report({"ours": [40, 60, 100], "none": [40, 90, 200], "intree": [90, 150, 300]},
                     failed={"ours@4.0": 1})
    j = judge(report, 2.0)
    assert j["ttft_target_ms"] == 80.0
    assert j["sustained"]["none"] == {"highest_rate_rps": 1.0, "interpolated_rps": 1.8}
    assert j["sustained"]["ours"] == {"highest_rate_rps": 2.0, "interpolated_rps": 2.0}  # 4 req/s failed a request
    assert j["sustained"]["intree"] == {"highest_rate_rps": None, "interpolated_rps": None}
    assert j["sustained_ours_over_none"] == 1.11 and j["sustained_ours_over_intree"] is None
    # goodput per rate: of each rate's two requests (p90/2, p90 ms over 2 s), those within 80 ms
    assert j["request_goodput_rps"]["ours"] == {"1.0": 1.0, "2.0": 1.0, "4.0": 0.5}
    assert j["p99_ours_above_none_at_rates"] == [4.0]  # a rate with a failed request never counts as within
    report["judgement"] = j
    lines = table(report).splitlines()
    assert len(lines) == 1 + 9 and "TTFT p50" in lines[0] and "goodput/s" in lines[0]
    assert judge(_report({"ours": [1, 2, 3]}), 2.0)["ttft_target_ms"] is None


def test_an_unclean_stop_is_named_and_vllms_shutdown_race_is_not():
    from benchmarks.traffic import unclean

    clean = {"rc": 0, "sigkill": False, "left_processes": [], "error_lines": [], "vllm_shutdown_race": ["x"]}
    assert unclean(Arm.OURS, {"ours-0": clean}) == {}
    assert unclean(Arm.OURS, {"ours-0": {**clean, "sigkill": True}}) == {"ours-0": ["SIGKILL"]}
    assert "log" in unclean(Arm.NONE, {"none-0": {**clean, "error_lines": ["ERROR x"]}})["none-0"][0]
    assert unclean(Arm.INTREE, {"intree-0": {**clean, "sigkill": True}}) == {}  # its tier never idles
    assert unclean(Arm.INTREE, {"intree-0": {**clean, "left_processes": [7]}}) == {"intree-0": ["left [7]"]}
