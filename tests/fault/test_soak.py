"""Fault suite, soak: mixed PD traffic with random faults for P2PWORKER_SOAK_S seconds (60 in CI; the
10-minute run is `P2PWORKER_SOAK_S=600 pytest tests/fault/test_soak.py`)."""

from __future__ import annotations

import os
import random
import signal
import time

import pytest

from p2pworker import api
from tests.helpers.fault import BLOCKS, fd_count, figure, keys_for, rss_anon_kib, rss_kib

SOAK_S = float(os.environ.get("P2PWORKER_SOAK_S", "60"))
WARMUP_S = max(15.0, 0.25 * SOAK_S)  # first-touch pages, allocator pools and the first heap trim settle by then
GROWTH_MIB_PER_MIN = 4.0  # heap growth after warm-up; a leak of 1 KiB per load grows ~9 MiB/min here
pytestmark = [pytest.mark.slow, pytest.mark.timeout(int(SOAK_S) + 240)]


def test_soak_mixed_traffic_with_random_faults(nodes, figures):
    """Mixed PD traffic from two producers into one consumer, with a producer SIGKILLed and restarted or
    SIGSTOPped for 2 s every ~8 s: every load is reported exactly once, the consumer's heap grows less than
    GROWTH_MIB_PER_MIN after warm-up, its open fds stay flat, and nothing is left in /dev/shm (the fixture)."""
    rng = random.Random(1234)
    prods = [nodes("pa"), nodes("pb", seed=1)]
    d = nodes("cd", seed=2)
    next_job, loads, done, reported = 0, {}, {}, set()
    free_rows = set(range(BLOCKS))
    faults = {"sigkill_restart": 0, "sigstop_2s": 0}
    t_start = time.monotonic()
    next_fault = t_start + 8
    samples = []
    req = 0

    def drain_events():
        for ev in d.client.poll():
            if isinstance(ev, api.JobFinished):
                assert ev.job_id not in reported, f"load {ev.job_id} reported twice"
                reported.add(ev.job_id)
                free_rows.update(loads[ev.job_id][1])
                done[ev.job_id] = ev.success
        for p in prods:
            if p.client is not None and p.client.alive():
                p.client.poll()  # store reports: drained (their workers may be killed, so not counted)

    while time.monotonic() - t_start < SOAK_S:
        now = time.monotonic()
        if now - t_start > WARMUP_S and not samples:
            samples.append((rss_kib(d.pid), fd_count(d.pid), rss_anon_kib(d.pid), now))
        if now >= next_fault:
            _random_fault(rng, prods, faults)
            next_fault = time.monotonic() + rng.uniform(6, 10)
        in_flight = len(loads) - len(reported)
        if in_flight < 4:
            n = rng.choice((4, 16, 32, 64))
            if len(free_rows) >= n:
                req += 1
                p = rng.choice(prods)
                name = f"soak-{req}"
                keys = keys_for(name, n)
                dst = rng.sample(sorted(free_rows), n)
                free_rows.difference_update(dst)
                src = rng.sample(range(BLOCKS), n)
                next_job += 2
                p.client.send(api.StoreJob(next_job - 1, name, keys, src))
                p.client.send(api.RequestFinished(name))
                assert d.client.send(api.LoadJob(next_job, p.address, name, keys, dst))
                loads[next_job] = (name, dst)
        drain_events()
        time.sleep(0.002)
    deadline = time.monotonic() + 45  # every load is reported within load_timeout_s (30 s)
    while len(reported) < len(loads):
        assert time.monotonic() < deadline, f"{len(loads) - len(reported)} load(s) never reported"
        drain_events()
        time.sleep(0.01)
    rss_end, fds_end, anon_end = rss_kib(d.pid), fd_count(d.pid), rss_anon_kib(d.pid)
    rss0, fds0, anon0, t0 = samples[0]
    per_min = (anon_end - anon0) / 1024 / ((time.monotonic() - t0) / 60)
    ok = sum(done.values())
    assert ok > 0.5 * len(loads), f"only {ok}/{len(loads)} loads succeeded"
    assert per_min < GROWTH_MIB_PER_MIN, f"consumer heap grew {per_min:.2f} MiB/min after warm-up"
    assert rss_end - rss0 < 32 * 1024, f"consumer RSS grew {(rss_end - rss0) / 1024:.1f} MiB"
    assert fds_end - fds0 <= 16, f"consumer fds {fds0} -> {fds_end}"
    figure(figures, f"soak {SOAK_S:.0f} s: loads reported exactly once",
           f"{len(loads)} loads ({ok} ok, {len(loads) - ok} failed by faults); faults {faults}", "every load once")
    figure(figures, f"soak {SOAK_S:.0f} s: consumer heap growth after {WARMUP_S:.0f} s warm-up / RSS / fds",
           f"{per_min:+.2f} MiB/min / {(rss_end - rss0) / 1024:+.1f} MiB / {fds0}->{fds_end}",
           f"< {GROWTH_MIB_PER_MIN:g} MiB/min / < 32 MiB / ≤ +16")


def _random_fault(rng: random.Random, prods: list, faults: dict[str, int]) -> None:
    """One producer, drawn at random, SIGKILLed and restarted or SIGSTOPped for 2 s; counted in ``faults``."""
    p = rng.choice(prods)
    if rng.random() < 0.5:
        p.kill()
        p.client.close(timeout_s=5)
        p.start()
        faults["sigkill_restart"] += 1
    else:
        p.kill(signal.SIGSTOP)
        time.sleep(2.0)
        p.kill(signal.SIGCONT)
        faults["sigstop_2s"] += 1
