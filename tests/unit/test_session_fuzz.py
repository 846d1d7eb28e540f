"""Fuzz: random and mutated frames into live sessions.  Nothing escapes ``receive``: a bad frame closes the
session cleanly (reason and counter set), and every job it held is reported failed, once."""

from __future__ import annotations

import random
import time

import msgspec
import pytest

from p2pworker.protocol import messages as m
from p2pworker.session import JobDone, SessionClosed, State
from tests.helpers.session import Pair, sample_messages

N_FRAMES = 100_000


def _seeds() -> list[bytes]:
    msgs = list(sample_messages().values()) + [
        m.Fetch("req", 1, [b"k0", b"k1"], 30_000),
        m.Fetch("req", 5, [b"k0"], 1),
        m.Offer("req", 1, [b"k0"], [3]),
        m.Offer("req", 1, [b"k0", b"k1"], [4, 5], True, "partial"),
        m.Release("req", 1, [b"k0"]),
        m.LookupResp(1, [True, False]),
        m.Lookup(9, "req", [b"a", b"b"]),
    ]
    return [m.encode(x) for x in msgs]


def _random_value(rng: random.Random, depth: int = 0):
    r = rng.random()
    if depth > 2 or r < 0.3:
        return rng.choice([0, -1, 2**63, 1.5, "", "x" * rng.randint(0, 300), b"\x00" * rng.randint(0, 200), None, True])
    if r < 0.6:
        return [_random_value(rng, depth + 1) for _ in range(rng.randint(0, 5))]
    names = ["type", "keys", "rows", "round", "request_id", "read", "final", "lease_ms", "lookup_id", "x"]
    return {rng.choice(names): _random_value(rng, depth + 1)
            for _ in range(rng.randint(0, 5))}


def _mutate(rng: random.Random, seeds: list[bytes]) -> bytes:
    kind = rng.randrange(6)
    base = bytearray(rng.choice(seeds))
    if kind == 0:  # random bytes
        return bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 64)))
    if kind == 1:  # flip some bytes
        for _ in range(rng.randint(1, 4)):
            if base:
                base[rng.randrange(len(base))] = rng.getrandbits(8)
        return bytes(base)
    if kind == 2:  # truncate or extend
        if rng.random() < 0.5:
            return bytes(base[: rng.randint(0, len(base))])
        return bytes(base) + rng.randbytes(rng.randint(1, 8))
    if kind == 3:  # a well-formed message whose fields hold junk
        tag = rng.choice(["hello", "hello_ack", "fetch", "offer", "release", "lookup", "lookup_resp", "bye", "nope"])
        body = _random_value(rng)
        body = body if isinstance(body, dict) else {"x": body}
        body["type"] = tag
        return msgspec.msgpack.encode(body)
    if kind == 4:  # a valid message, unchanged (legal or illegal in the current state)
        return bytes(base)
    # splice two seeds
    other = rng.choice(seeds)
    cut = rng.randint(0, len(base))
    return bytes(base[:cut]) + other[rng.randint(0, len(other)) :]


def _fresh(rng: random.Random):
    p = Pair().handshake()
    p.b.store(1, "req", [b"k0", b"k1"], [10, 11])
    p.a.load(100, "req", [b"k0", b"k1"], [0, 1])
    p.a.lookup(1, [b"a", b"b"], "req")
    p.deliver()
    if rng.random() < 0.5:
        p.pull_all()
    return p


@pytest.mark.timeout(300)
def test_100k_random_and_mutated_frames():
    rng = random.Random(20261129)
    seeds = _seeds()
    p = _fresh(rng)
    errors = closes = 0
    t0 = time.monotonic()
    for i in range(N_FRAMES):
        frame = _mutate(rng, seeds)
        target, side = (p.sa, p.a) if i % 2 else (p.sb, p.b)
        before = target.counters.protocol_errors
        side.run(target, target.receive(frame))
        if target.counters.protocol_errors > before:
            errors += 1
            assert target.state is State.CLOSED and target.close_reason.startswith("protocol error: ")
        if target.state is State.CLOSED:
            closes += 1
            # closing cleanly: the session told its host, and every job it held was reported once
            p.a.close("fuzz reset")
            p.b.close("fuzz reset")
            for tid in list(p.a.data.reads):
                p.a.settle(tid, False, "cancelled")
            p.advance(1000)
            p.a.tick()
            p.b.tick()
            for s in (p.a, p.b):
                evs = s.events()
                ids = [e.job_id for e in evs if isinstance(e, JobDone)]
                assert len(ids) == len(set(ids)), "a job reported twice"
                assert s.reporter.open_jobs == 0, "a job left unreported"
                assert any(isinstance(e, SessionClosed) for e in evs)
            p = _fresh(rng)
    elapsed = time.monotonic() - t0
    print(f"{N_FRAMES} frames in {elapsed:.1f} s: {errors} protocol errors, {closes} sessions closed")
    assert errors > N_FRAMES // 2  # the fuzzer mostly produced invalid frames, as intended
