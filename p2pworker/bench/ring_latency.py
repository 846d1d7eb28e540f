"""Round-trip latency of a small command, adapter -> worker -> adapter, between two processes.

Contenders, measured side by side in one run:

- ``p2pworker_ring``: two p2pworker shared-memory rings (commands, events);
  the echo side is the worker (bounded spin, then sleep on the bell).
- ``p2pworker_ring_wake``: the same, with a pause longer than the spin window
  before every command, so the worker is asleep and must be woken.
- ``mp_queue``: two ``multiprocessing.Queue``.
- ``zmq_ipc_pair``: one ZMQ PAIR socket pair over ``ipc://``.

Each prints one JSON line: contender, n, p50_us, p99_us, mean_us.  Run by ``p2pworker bench-ring``.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import tempfile
import time
import uuid

import msgspec


class Ping(msgspec.Struct, tag="ping"):
    seq: int
    job_id: int
    rows: list[int]


STOP = -1


def _ring_echo(cmd_name: str, evt_name: str) -> None:
    from p2pworker.shm import Ring, Role

    cmd = Ring.attach(cmd_name, Role.CONSUMER, msg_type=Ping)
    evt = Ring.attach(evt_name, Role.PRODUCER, msg_type=Ping)
    try:
        while True:
            msg = cmd.get(timeout_s=30)
            evt.put(msg, timeout_s=30)
            if msg.seq == STOP:
                break
    finally:
        cmd.close()
        evt.close()


def _queue_echo(q_in: "mp.Queue[Ping | None]", q_out: "mp.Queue[Ping | None]") -> None:
    while True:
        msg = q_in.get(timeout=30)
        q_out.put(msg)
        if msg is None:
            break


def _zmq_echo(addr: str) -> None:
    import zmq

    ctx = zmq.Context()
    s = ctx.socket(zmq.PAIR)
    s.connect(addr)
    try:
        while True:
            data = s.recv()
            s.send(data)
            if data == b"stop":
                break
    finally:
        s.close(linger=0)
        ctx.term()


def _summary(contender: str, samples_ns: list[int]) -> dict:
    us = sorted(x / 1000 for x in samples_ns)
    n = len(us)
    return {
        "contender": contender,
        "n": n,
        "p50_us": round(us[n // 2], 2),
        "p99_us": round(us[min(n - 1, int(n * 0.99))], 2),
        "mean_us": round(statistics.fmean(us), 2),
    }


def _pause(gap_s: float) -> None:
    if gap_s:
        time.sleep(gap_s)


def bench_ring(n: int, warmup: int, gap_s: float = 0.0) -> list[int]:
    from p2pworker.shm import Ring, Role

    tag = f"p2pw_bench_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    cmd = Ring.create(f"{tag}_cmd", Role.PRODUCER, nslots=64, slot_bytes=512, msg_type=Ping)
    evt = Ring.create(f"{tag}_evt", Role.CONSUMER, nslots=64, slot_bytes=512, msg_type=Ping)
    ctx = mp.get_context("spawn")
    proc = ctx.Process(target=_ring_echo, args=(cmd.name, evt.name), daemon=True)
    proc.start()
    samples = []
    try:
        msg = Ping(seq=0, job_id=7, rows=list(range(8)))
        for i in range(warmup + n):
            _pause(gap_s)
            msg.seq = i
            t0 = time.perf_counter_ns()
            cmd.put(msg, timeout_s=10)
            evt.get(timeout_s=10)
            if i >= warmup:
                samples.append(time.perf_counter_ns() - t0)
        cmd.put(Ping(seq=STOP, job_id=0, rows=[]), timeout_s=10)
        evt.get(timeout_s=10)
        proc.join(10)
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join()
        cmd.close()
        evt.close()
    if proc.exitcode != 0:
        raise RuntimeError(f"ring echo process exited with {proc.exitcode}")
    return samples


def bench_queue(n: int, warmup: int) -> list[int]:
    ctx = mp.get_context("spawn")
    q_in, q_out = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_queue_echo, args=(q_in, q_out), daemon=True)
    proc.start()
    samples = []
    try:
        msg = Ping(seq=0, job_id=7, rows=list(range(8)))
        for i in range(warmup + n):
            msg.seq = i
            t0 = time.perf_counter_ns()
            q_in.put(msg)
            q_out.get(timeout=10)
            if i >= warmup:
                samples.append(time.perf_counter_ns() - t0)
        q_in.put(None)
        q_out.get(timeout=10)
        proc.join(10)
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join()
    return samples


def bench_zmq(n: int, warmup: int) -> list[int]:
    import zmq

    enc = msgspec.msgpack.Encoder()
    dec = msgspec.msgpack.Decoder(Ping)
    with tempfile.TemporaryDirectory(prefix="p2pw_bench_") as d:
        addr = f"ipc://{d}/pair"
        ctx = zmq.Context()
        s = ctx.socket(zmq.PAIR)
        s.bind(addr)
        proc = mp.get_context("spawn").Process(target=_zmq_echo, args=(addr,), daemon=True)
        proc.start()
        samples = []
        try:
            msg = Ping(seq=0, job_id=7, rows=list(range(8)))
            for i in range(warmup + n):
                msg.seq = i
                t0 = time.perf_counter_ns()
                s.send(enc.encode(msg))
                dec.decode(s.recv())
                if i >= warmup:
                    samples.append(time.perf_counter_ns() - t0)
            s.send(b"stop")
            s.recv()
            proc.join(10)
        finally:
            if proc.is_alive():
                proc.kill()
                proc.join()
            s.close(linger=0)
            ctx.term()
    return samples


def run(n: int = 20000, warmup: int = 2000, wake_n: int = 500, wake_gap_s: float = 0.002) -> list[dict]:
    """All contenders in one run; returns one summary dict per contender."""
    return [
        _summary("p2pworker_ring", bench_ring(n, warmup)),
        _summary("p2pworker_ring_wake", bench_ring(wake_n, 20, gap_s=wake_gap_s)),
        _summary("mp_queue", bench_queue(n, warmup)),
        _summary("zmq_ipc_pair", bench_zmq(n, warmup)),
    ]
