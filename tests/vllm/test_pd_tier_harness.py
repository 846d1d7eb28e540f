"""benchmarks/pd_tier.py's harness ends with a clear error, bounded, and leaves nothing behind when a scheduler
fails to start or dies mid-run (it used to wait out its 180 s start timeout, then exit leaving the other
scheduler's region file in /dev/shm)."""

from __future__ import annotations

import glob
import os
import signal
import socket
import time

import pytest

from benchmarks.pd_tier import HarnessError, Pair, region_path

ROW, N = 16384, 4


def _footprint() -> tuple[set[str], set[int]]:
    """What pd_tier's schedulers own: every name carries their engine id ``pdbench<kind><role><pid>`` (vLLM's
    region file, our worker's rings and admin socket, our worker's ``--name``).  Other tests' files and workers
    (another suite may run beside this one) are not counted."""
    files = {n for n in os.listdir("/dev/shm") if "pdbench" in n} | set(glob.glob("/tmp/p2pworker-*pdbench*.admin"))
    workers = set()
    for d in glob.glob("/proc/[0-9]*"):
        try:
            with open(f"{d}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if b"launch" in argv and any(b"pdbench" in x for x in argv):
            workers.add(int(d[6:]))
    return files, workers


def _assert_nothing_left(before: tuple[set[str], set[int]], within_s: float = 20.0) -> None:
    """Our worker notices its adapter gone within seconds and then removes its rings and admin socket."""
    deadline = time.monotonic() + within_s
    while True:
        files, workers = _footprint()
        new_files, new_workers = files - before[0], workers - before[1]
        if not new_files and not new_workers:
            return
        if time.monotonic() > deadline:
            pytest.fail(f"left behind: files {sorted(new_files)}, worker pids {sorted(new_workers)}")
        time.sleep(0.2)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["ours", "intree"])
def test_a_scheduler_that_cannot_bind_its_port_ends_the_pair_with_its_traceback(kind, free_port):
    before = _footprint()
    with socket.socket() as squatter:  # D's port is taken before D starts
        squatter.bind(("127.0.0.1", free_port()))
        squatter.listen()
        t0 = time.monotonic()
        with pytest.raises(HarnessError) as err:
            # ours retries a port that may still be held by a predecessor until start_timeout_s (120 s by default)
            Pair(kind, ROW, N, ports=(free_port(), squatter.getsockname()[1]),
                 tier_extra={"start_timeout_s": 5} if kind == "ours" else None)
        took = time.monotonic() - t0
    assert "scheduler D failed while starting" in str(err.value)
    assert "Traceback" in str(err.value)  # D's own traceback, not only an exit code
    assert took < Pair.START_S / 2, f"the harness took {took:.0f} s to notice"
    _assert_nothing_left(before)


@pytest.mark.timeout(300)
def test_a_scheduler_killed_mid_run_ends_the_next_request_and_its_region_file_is_removed():
    before = _footprint()
    pair = Pair("ours", ROW, N)
    try:
        first = pair.request("r-before", N)
        assert first["ok"] and first["results"] == ["HIT"]  # the harness works before the kill
        d = pair.procs["D"]
        assert region_path("ours", "D", d.pid).exists()
        os.kill(d.pid, signal.SIGKILL)  # no shutdown runs: its region file stays unless the harness removes it
        t0 = time.monotonic()
        with pytest.raises(HarnessError, match=r"scheduler\(s\) exited while fetching r-after: D \(pid \d+\) with -9"):
            pair.request("r-after", N)
        assert time.monotonic() - t0 < 30  # not the fetch's 120 s bound
    finally:
        pair.close()
    assert pair.procs["P"].exitcode == 0  # the survivor shut down cleanly
    assert not region_path("ours", "D", d.pid).exists()
    _assert_nothing_left(before)
