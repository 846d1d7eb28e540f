"""benchmarks/pd_tier.py's harness ends with a clear error, bounded, and leaves nothing behind when a scheduler
fails to start or dies mid-run (it used to wait out its 180 s start timeout, then exit leaving the other
scheduler's region file in /dev/shm), and refuses to report a contender that did not deliver; and its floor
contenders end all HIT (``ideal-nocopy`` in two passes, ``ideal``, which copies, in two or three)."""

from __future__ import annotations

import glob
import importlib
import multiprocessing as mp
import os
import re
import signal
import socket
import time

import pytest

from benchmarks import pd_tier
from benchmarks.pd_tier import HarnessError, Pair, engine_id, region_path

ROW, N = 16384, 4


@pytest.fixture
def pair_pids(monkeypatch):
    """(kind, role, pid) of every scheduler a Pair closed in this test, also when its __init__ raised."""
    seen: list[tuple[str, str, int]] = []
    close = Pair.close

    def recording_close(self):
        seen.extend((self.kind, r, p.pid) for r, p in self.procs.items() if p.pid is not None)
        close(self)

    monkeypatch.setattr(Pair, "close", recording_close)
    return seen


def _footprint(ids: list[str]) -> tuple[set[str], set[int]]:
    """What those schedulers own: every name carries the engine id (vLLM's region file, our worker's rings and
    admin socket, our worker's ``--name``); nothing else (a benchmark or suite running beside this test) counts.
    The id ends in the scheduler's pid, so it must not be followed by another digit (pid 123 is not pid 1234)."""
    own = re.compile("|".join(re.escape(i) + r"(?!\d)" for i in ids))
    files = {n for n in os.listdir("/dev/shm") if own.search(n)}
    files |= {f for f in glob.glob("/tmp/p2pworker-*.admin") if own.search(f)}
    workers = set()
    for d in glob.glob("/proc/[0-9]*"):
        try:
            with open(f"{d}/cmdline", "rb") as f:
                argv = f.read().decode(errors="replace").split("\0")
        except OSError:
            continue
        if "launch" in argv and any(own.search(x) for x in argv):
            workers.add(int(d[6:]))
    return files, workers


def _assert_nothing_left(pids: list[tuple[str, str, int]], within_s: float = 20.0) -> None:
    """Our worker notices its adapter gone within seconds and then removes its rings and admin socket."""
    assert pids, "no scheduler was started: the test checked nothing"
    ids = [engine_id(k, r, p) for k, r, p in pids]
    deadline = time.monotonic() + within_s
    while True:
        files, workers = _footprint(ids)
        if not files and not workers:
            return
        if time.monotonic() > deadline:
            pytest.fail(f"left behind: files {sorted(files)}, worker pids {sorted(workers)}")
        time.sleep(0.2)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["ours", "intree"])
def test_a_scheduler_that_cannot_bind_its_port_ends_the_pair_with_its_traceback(kind, free_port, pair_pids):
    with socket.socket() as squatter:  # D's port is taken before D starts
        squatter.bind(("127.0.0.1", free_port()))
        squatter.listen()
        t0 = time.monotonic()
        with pytest.raises(HarnessError) as err:
            # ours retries a port that may still be held by a predecessor until start_timeout_s (120 s by default)
            Pair(kind, ROW, N, ports=(free_port(), squatter.getsockname()[1]),
                 # long enough for D's worker to start and report the bind error (what the message names)
                 tier_extra={"D": {"start_timeout_s": 30}} if kind == "ours" else None)
        took = time.monotonic() - t0
    # D's own traceback, also when D exited while the harness was still waiting for P's "ready"
    assert "scheduler D failed" in str(err.value)
    assert "Traceback" in str(err.value)
    assert "Address already in use" in str(err.value)
    assert took < Pair.START_S * 0.75, f"the harness took {took:.0f} s to notice"
    _assert_nothing_left(pair_pids)


@pytest.mark.timeout(300)
def test_a_scheduler_killed_mid_run_ends_the_next_request_and_its_region_file_is_removed(pair_pids):
    pair = Pair("ours", ROW, N)
    try:
        first = pair.request("r-before", N)
        assert first["ok"] and first["results"] == ["HIT"]  # the harness works before the kill
        d = pair.procs["D"]
        assert region_path("ours", "D", d.pid).exists()
        os.kill(d.pid, signal.SIGKILL)  # no shutdown runs: its region file stays unless the harness removes it
        d.join(10)
        t0 = time.monotonic()
        with pytest.raises(HarnessError, match=r"D \(pid \d+\) with -9|scheduler D is gone while fetching r-after"):
            pair.request("r-after", N)
        assert time.monotonic() - t0 < 30  # not the fetch's 120 s bound
    finally:
        pair.close()
    assert pair.procs["P"].exitcode == 0  # the survivor shut down cleanly
    assert not region_path("ours", "D", d.pid).exists()
    _assert_nothing_left(pair_pids)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["ideal", "ideal-nocopy"])
def test_the_floors_end_all_hit_in_the_fewest_passes(kind, pair_pids):
    pair = Pair(kind, ROW, N)
    try:
        outs = [pair.request(f"r-{kind}-{i}", N) for i in range(3)]
    finally:
        pair.close()
    for out in outs:
        # ideal: the consumer compared every row's bytes (ideal-nocopy moves none: HIT is all it shows)
        assert out["ok"] and out["results"] == ["HIT"], out
        # promote, then HIT: no secondary tier can take fewer (ideal's copy thread may end after the next pass)
        assert (out["passes"] == 2) if kind == "ideal-nocopy" else (2 <= out["passes"] <= 3), out
    _assert_nothing_left(pair_pids)


class _Alive:
    """Stands in for a scheduler process that is running (no process: the answers come from the test)."""

    pid = 1
    exitcode = None


def test_a_fetch_that_does_not_end_all_hit_ends_the_run():
    pair = Pair.__new__(Pair)  # the request protocol alone: the test plays both schedulers
    pair.kind, pair.pport = "intree", 1
    (p_conn, p_end), (d_conn, d_end) = mp.Pipe(), mp.Pipe()
    pair.conns = {"P": p_conn, "D": d_conn}
    pair.procs = {"P": _Alive(), "D": _Alive()}
    p_end.send("stored")
    d_end.send({"s": 0.003, "ok": False, "results": ["MISS"], "passes": 1})
    try:
        with pytest.raises(HarnessError, match=r"request r: the consumer's lookups ended \['MISS'\]"):
            pair.request("r", N)
        assert p_end.recv() == ("store", "r", N) and d_end.recv() == ("fetch", "r", N, 1)
        assert not p_end.poll(0)  # no drain was asked: the run ends at the miss
    finally:
        for c in (p_conn, d_conn, p_end, d_end):
            c.close()


def test_the_intree_contender_without_nixls_meta_package_stops_the_run_at_once(monkeypatch):
    real = importlib.import_module

    def no_meta(name, *a, **k):
        if name == "nixl" or name.startswith("nixl."):
            raise ImportError("No module named 'nixl'")
        return real(name, *a, **k)

    monkeypatch.setattr("importlib.import_module", no_meta)
    with pytest.raises(SystemExit, match=r"in-tree p2p tier needs NIXL's meta package .* scripts/setup.sh --bench"):
        pd_tier.check_intree_nixl()
