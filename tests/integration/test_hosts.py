"""Across hosts: two workers on two emulated hosts (tests/helpers/hosts/emulate.py: network namespaces joined
by a veth, each with its own PID namespace and /dev/shm), so the KV bytes cross a network interface over UCX's TCP
transport, not cross-memory attach.  Byte-exact transfers, a peer host nobody answers on, and the wire cut under a
load and restored."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

from tests.helpers.hosts.emulate import NETNS, TwoHosts, two_hosts
from tests.helpers.ports import free_port

pytestmark = pytest.mark.timeout(180)

BLOCK = 256 * 1024
# the consumer's lease and the control heartbeat short enough that a cut wire is noticed within seconds
FAST = {"session": {"load_timeout_s": 3.0, "handshake_timeout_s": 3.0},
        "control": {"heartbeat_interval_s": 0.5, "heartbeat_liveness": 3}}


UCX_EXTRA = {k: v for k, v in (x.split("=", 1) for x in os.environ.get("P2PW_UCX_EXTRA", "").split()) }


def keys(req: str, n: int) -> list[str]:
    return [f"{req}-{i:05d}".encode().hex() for i in range(n)]


def transfer(hosts, req: str, src_rows: list[int], dst_rows: list[int], job: int, timeout_s: float = 60.0) -> dict:
    """Producer a stores ``req`` in ``src_rows``, consumer b loads it into ``dst_rows``; b's report."""
    ks = keys(req, len(src_rows))
    hosts.a.call(op="store", job=job, request=req, keys=ks, rows=src_rows)
    hosts.b.call(op="load", job=job + 1, address=hosts.a.address, request=req, keys=ks, rows=dst_rows)
    done = hosts.b.call(op="wait", jobs=[job + 1], timeout_s=timeout_s, wait_s=timeout_s + 10)["done"]
    assert str(job + 1) in done, f"load of {req} not reported within {timeout_s} s"
    return done[str(job + 1)]


def same_bytes(hosts, src_rows, dst_rows) -> bool:
    return (hosts.a.call(op="digest", rows=src_rows)["sha256"] == hosts.b.call(op="digest", rows=dst_rows)["sha256"])


def test_kv_blocks_cross_the_wire_byte_exact(tmp_path):
    with two_hosts("x", tmp_path, blocks=512, block_bytes=BLOCK) as hosts:
        assert not same_bytes(hosts, list(range(64)), list(range(256, 320))), "regions start equal: proves nothing"
        for n, req in ((4, "r-small"), (64, "r-16m"), (256, "r-64m")):
            wire0, t0 = hosts.wire_bytes(), time.monotonic()
            rep = transfer(hosts, req, list(range(n)), list(range(256, 256 + n)), job=10 * n)
            took, wire = time.monotonic() - t0, hosts.wire_bytes() - wire0
            assert rep["success"], rep
            assert same_bytes(hosts, list(range(n)), list(range(256, 256 + n))), f"{req}: bytes differ"
            # the bytes crossed the veth (on the fallback, the loopback: TCP), not cross-memory attach
            assert wire >= n * BLOCK, f"{req}: only {wire} bytes left host a ({hosts.mode}) for {n * BLOCK}"
            print(f"{hosts.mode}: {n} x 256 KiB in {took * 1e3:.0f} ms (store to report, "
                  f"{n * BLOCK / took / 1e9:.2f} GB/s)")


def test_a_peer_host_nobody_answers_on_fails_the_load_in_its_bound(tmp_path):
    with two_hosts("u", tmp_path, blocks=64, block_bytes=BLOCK, settings=FAST) as hosts:
        # on the wire's subnet, no such host (on the loopback fallback: a port nobody listens on)
        nobody = hosts.a.ip.rsplit(".", 1)[0] + ".99:5710" if hosts.mode == NETNS else f"127.0.0.1:{free_port()}"
        t0 = time.monotonic()
        hosts.b.call(op="load", job=1, address=nobody, request="r", keys=keys("r", 8), rows=list(range(8)))
        done = hosts.b.call(op="wait", jobs=[1], timeout_s=20, wait_s=30)["done"]
        took = time.monotonic() - t0
        assert "1" in done and not done["1"]["success"], done
        assert took < 3.0 + 1.5 + 5.0, f"reported after {took:.1f} s (handshake timeout 3 s, control deadline 1.5 s)"
        print(f"{hosts.mode}: load from an absent host failed after {took:.1f} s: {done['1']['reason']}")


def test_the_wire_cut_under_a_load_then_restored(tmp_path):
    """A load whose producer sits behind a cut wire fails once, within the consumer's lease (3 s) plus the settle
    bound, and writes nothing; a wire cut in the middle of a large transfer either completes byte-exact or fails
    once (never a success with wrong bytes); once the wire is back, the next load goes through."""
    with two_hosts("c", tmp_path, blocks=1024, block_bytes=BLOCK, settings=FAST, env=UCX_EXTRA) as hosts:
        if hosts.mode != NETNS:
            pytest.skip(f"no namespaces here ({hosts.why}): there is no wire to cut")
        assert transfer(hosts, "warm", list(range(4)), list(range(512, 516)), job=10)["success"]
        before = hosts.b.call(op="digest", rows=list(range(600, 608)))["sha256"]
        hosts.link(up=False)
        t0 = time.monotonic()
        rep = transfer(hosts, "cut", list(range(8)), list(range(600, 608)), job=20, timeout_s=30)
        took = time.monotonic() - t0
        assert not rep["success"], rep
        assert took < 3.0 + 15.0, f"the cut load was reported after {took:.1f} s"
        assert hosts.b.call(op="digest", rows=list(range(600, 608)))["sha256"] == before, "a failed load wrote rows"
        print(f"wire cut: load failed after {took:.1f} s: {rep['reason']}")
        hosts.link(up=True)
        t0, ok = time.monotonic(), False
        for attempt in range(40):  # loads to a peer just lost fail at once until its redial backoff has passed
            rep = transfer(hosts, f"back-{attempt}", list(range(16)), list(range(700, 716)), job=100 + 10 * attempt,
                           timeout_s=10)
            if rep["success"] or time.monotonic() - t0 > 30:
                ok = rep["success"]
                break
            time.sleep(0.5)
        assert ok, f"no load went through within {time.monotonic() - t0:.1f} s of the wire coming back: {rep}"
        assert same_bytes(hosts, list(range(16)), list(range(700, 716)))
        print(f"wire back: a load went through after {time.monotonic() - t0:.1f} s ({attempt + 1} attempt(s))")
        # mid-transfer: 64 MiB and the wire cut right after the load is sent
        ks = keys("big", 256)
        hosts.a.call(op="store", job=900, request="big", keys=ks, rows=list(range(256)))
        hosts.b.call(op="load", job=901, address=hosts.a.address, request="big", keys=ks, rows=list(range(768, 1024)))
        time.sleep(0.05)
        hosts.link(up=False)
        t0 = time.monotonic()
        out = hosts.b.call(op="wait", jobs=[901], timeout_s=40, wait_s=50)
        took = time.monotonic() - t0
        hosts.link(up=True)
        done = out["done"].get("901")
        if done is not None and done["success"]:
            assert same_bytes(hosts, list(range(256)), list(range(768, 1024))), "reported success with wrong bytes"
            outcome = "completed before the cut, byte-exact"
        elif done is not None:
            # reported failed: from then on nothing may land in those rows (invariant 7), wire back or not
            at_report = hosts.b.call(op="digest", rows=list(range(768, 1024)))["sha256"]
            time.sleep(FAST["session"]["load_timeout_s"] + 2.0)
            assert hosts.b.call(op="digest", rows=list(range(768, 1024)))["sha256"] == at_report, \
                "rows changed after their load was reported failed"
            outcome = f"failed once after {took:.1f} s: {done['reason']}"
        else:
            # Reads posted over TCP that the cut left hanging cannot be aborted (NIXL/UCX may still land them):
            # the worker exits once they have not settled within settle_timeout_s (10 s), rather than report the
            # load; the tier then fails it once and starts a new worker (tests/fault/test_adapter_faults.py).
            assert out["worker_exit"] is not None, "the load was neither reported nor its worker gone"
            assert took < 1.5 + 10.0 + 5.0, f"the worker took {took:.1f} s to give up on unsettled reads"
            hosts.died.add("b")
            # The same long cut with a READ in flight can also end the PRODUCER's worker: UCX over TCP aborts the
            # process when that endpoint times out ("ucp_request.inl ... Fatal: unexpected error: Endpoint timeout",
            # seen once in CI, 2026-12-02).  No row is written by anyone; its adapter fails its store jobs and starts
            # a new worker.  Left open: its exit code is not held to 0 here.
            hosts.died.add("a")
            outcome = f"consumer worker exited (code {out['worker_exit']}) after {took:.1f} s: reads did not settle"
        print(f"wire cut mid-transfer: {outcome}")


def test_a_worker_bound_on_every_interface_advertises_its_wire_address(tmp_path):
    """Bind 0.0.0.0, advertise the host's own address (--advertise-host): the consumer dials what was advertised."""
    with two_hosts("w", tmp_path, blocks=64, block_bytes=BLOCK, bind_any=True) as hosts:
        assert hosts.a.address.split(":")[0] == hosts.a.ip, hosts.a.address  # not 0.0.0.0
        rep = transfer(hosts, "adv", list(range(8)), list(range(32, 40)), job=10)
        assert rep["success"], rep
        assert same_bytes(hosts, list(range(8)), list(range(32, 40)))


def test_a_client_in_one_host_reaches_the_other_across_the_wire_and_comes_back(tmp_path):
    """TwoHosts.client_in: this thread's sockets open inside host b's network (as a benchmark's client on the puller's
    host), reach host a's address across the veth, and the thread is back in its own network afterwards, also when
    the body raised."""
    hosts = TwoHosts("cli", tmp_path)
    hosts.make()
    if hosts.mode != NETNS:
        pytest.skip(f"network namespaces refused here: {hosts.why}")
    listener = None
    try:
        hosts.hold(shm_size="16m")
        ia, ib = hosts.ips
        port = free_port()
        listener = subprocess.Popen(hosts.enter(0, [sys.executable, "-c", SERVE_ONE, ia, str(port)]),
                                    stdout=subprocess.PIPE, text=True)
        assert listener.stdout.readline().strip() == "ready"
        with pytest.raises(OSError):  # host b's address is not on this machine's own network
            socket.socket().bind((ib, 0))
        with hosts.client_in(1):
            with socket.socket() as s:
                s.bind((ib, 0))  # inside host b
            with socket.create_connection((ia, port), timeout=10) as s:
                assert s.recv(16) == b"host a"
        with pytest.raises(OSError):  # back home
            socket.socket().bind((ib, 0))
        with pytest.raises(ZeroDivisionError), hosts.client_in(1):  # an error inside: back home all the same
            1 / 0
        with pytest.raises(OSError):
            socket.socket().bind((ib, 0))
        assert listener.wait(timeout=10) == 0
    finally:
        if listener is not None and listener.poll() is None:
            listener.kill()
            listener.wait(timeout=10)
        left = hosts.release()
    assert not left, left


# inside host a: accept one connection on (argv[1], argv[2]), answer "host a"
SERVE_ONE = """
import socket, sys
s = socket.create_server((sys.argv[1], int(sys.argv[2])))
print("ready", flush=True)
c, _ = s.accept()
c.sendall(b"host a")
c.close()
"""
