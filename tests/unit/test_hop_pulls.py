"""benchmarks/hops/pulls.py on a trace written here: a pull's hops chain from the request sent to its first token
(they add up to its TTFT), the puller engine's rows split ``finish`` into parts that add up to it, a local hit is
split from the request sent, and a trace without engine rows keeps ``finish`` whole."""

from __future__ import annotations

import pytest

from benchmarks.hops.pulls import FINISH, HOPS, LOCAL, ONE_TRIP, pulls

pytestmark = pytest.mark.timeout(30)

RID = "pvr-0123456789abcdef"
MS = 1_000_000


def write(tmp_path, engine: bool) -> None:
    # one pull at t=10 ms..70 ms, then one local hit at 100 ms..130 ms; cpu= grows with each row
    source = [(13, "dec Lookup " + RID), (15, "cmd AnswerLookup 7")]
    puller = [(12, "cmd LookupKeys " + RID), (16, "dec LookupResp 7"), (20, "cmd LoadJob 3 " + RID),
              (23, "evt_put load 3")]
    rows = {"worker_p2pw-source.txt": source, "worker_p2pw-puller.txt": puller}
    if engine:
        rows["engine_ours_puller_42.txt"] = [
            (11, "match cmpl-1 0 0"),  # the first pass: nothing in the CPU tier yet, the tier is asked
            (22, "match cmpl-1 None 0"),  # asked again while the pull is in flight
            (25, "fin 1 9"),  # another job (a store) collected first: not this load's
            (27, "fin 1 3"), (30, "match cmpl-1 1024 1"), (40, f"step 1 1 t0={36 * MS} empty_before=5"),
            (108, "match cmpl-2 1024 1"), (118, f"step 1 1 t0={112 * MS} empty_before=2"),
            (430, "match cmpl-9 1024 1"), (440, f"step 1 1 t0={432 * MS} empty_before=0")]  # past 420: the next request
    for name, rs in rows.items():
        (tmp_path / name).write_text("".join(f"{t * MS} {r} cpu={i}\n" for i, (t, r) in enumerate(rs)))
    (tmp_path / "ttft.txt").write_text(f"{10 * MS} {70 * MS} {RID} pull_idle ours\n{100 * MS} {130 * MS} - local ours\n"
                                       f"{200 * MS} {220 * MS} - recompute ours\n"
                                       f"{300 * MS} {320 * MS} - local intree\n"  # not ours: skipped
                                       f"{400 * MS} {420 * MS} - local ours\n")  # recomputed: no hit in its window


def test_a_pull_splits_into_hops_that_add_up_to_its_ttft_and_finish_into_the_engines_parts(tmp_path):
    write(tmp_path, engine=True)
    pull, local = pulls(str(tmp_path))
    assert pull["rid"] == RID and pull["arm"] == "pull_idle" and pull["ttft_ms"] == 60
    h = pull["hops_ms"]
    assert [h[k] for k in HOPS] == [2, 1, 2, 1, 4, 3, 47]
    assert sum(h[k] for k in HOPS) == pull["ttft_ms"]
    assert [h[k] for k in FINISH] == [4, 3, 6, 4, 30]
    assert sum(h[k] for k in FINISH) == h["finish"]
    assert local["arm"] == "local" and [local["hops_ms"][k] for k in LOCAL] == [8, 4, 6, 12]
    assert sum(local["hops_ms"].values()) == local["ttft_ms"] == 30


def test_without_engine_rows_finish_stays_whole_and_no_local_hit_is_split(tmp_path):
    write(tmp_path, engine=False)
    (pull,) = pulls(str(tmp_path))
    assert set(pull["hops_ms"]) == set(HOPS)
    assert pull["hops_ms"]["finish"] == 47


def test_a_log_without_arm_and_tier_columns_reads_as_pulls_of_ours(tmp_path):
    write(tmp_path, engine=False)
    (tmp_path / "ttft.txt").write_text(f"{10 * MS} {70 * MS} {RID}\n")  # the log's first format
    (pull,) = pulls(str(tmp_path))
    assert pull["rid"] == RID and pull["arm"] == "pull" and pull["ttft_ms"] == 60


def test_a_one_trip_pull_chains_from_its_load_to_the_sources_answer_and_adds_up_to_its_ttft(tmp_path):
    source = [(14, "dec Fetch " + RID), (17, "cmd StoreJob 5 " + RID), (18, "cmd AnswerLookup -8")]
    puller = [(12, "cmd LoadJob 3 " + RID), (19, "evt_put load 2"), (21, "evt_put load 3")]  # 2: another job
    for name, rs in {"worker_p2pw-source.txt": source, "worker_p2pw-puller.txt": puller}.items():
        (tmp_path / name).write_text("".join(f"{t * MS} {r} cpu={i}\n" for i, (t, r) in enumerate(rs)))
    (tmp_path / "ttft.txt").write_text(f"{10 * MS} {40 * MS} {RID} pull_idle ours\n")
    (pull,) = pulls(str(tmp_path))
    h = pull["hops_ms"]
    assert [h[k] for k in ONE_TRIP] == [2, 2, 3, 4, 19] and sum(h.values()) == pull["ttft_ms"] == 30
