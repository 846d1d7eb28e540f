"""End to end across emulated hosts: the prefill engine on host A, the decode engine and the router on host B
(tests/helpers/hosts/emulate.py: network namespaces joined by a veth, each host with its own PID and IPC namespaces and
a private /dev/shm), each role started by `scripts/pd.sh start ROLE...` inside its host as on two machines.  The KV
must cross the veth over TCP: neither shared memory nor cross-memory attach can reach the other host.

This file runs before test_long_prompt.py and test_pd.py (file order), so the main pair is not up meanwhile.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid

import pytest

from tests.helpers.e2e import BLOCK, PD, ROOT
from tests.helpers.tiny_model import CONFIG, prompt
from tests.helpers.hosts.emulate import NETNS, TwoHosts

pytestmark = pytest.mark.timeout(900)

LOGPROB_TOL = 1e-4
# float32 K and V of every layer, per token: what one token's KV weighs on the wire at least
KV_BYTES_PER_TOKEN = (CONFIG["num_hidden_layers"] * 2 * CONFIG["num_key_value_heads"]
                      * CONFIG["hidden_size"] // CONFIG["num_attention_heads"] * 4)

# run inside a host: one HTTP call, its answer on stdout (JSON or text)
CLIENT = """
import json, sys, urllib.request
url, body = sys.argv[1], sys.argv[2]
data = body.encode() if body else None
req = urllib.request.Request(url, data, {"Content-Type": "application/json"} if data else {})
with urllib.request.urlopen(req, timeout=120) as r:
    sys.stdout.write(r.read().decode())
"""


def test_pd_pair_on_two_emulated_hosts_answers_like_one_engine_with_kv_over_the_wire(tiny_model, tmp_path):
    hosts = TwoHosts("e2e", tmp_path)
    hosts.make()  # where namespaces are refused: both roles here, on 127.0.0.1 and 127.0.0.2, UCX forced onto TCP
    print(f"emulated hosts: {hosts.mode}" + (f" ({hosts.why})" if hosts.why else ""))
    stops: list[subprocess.CompletedProcess] = []
    pair = PD(tiny_model, str(tmp_path / "run"))
    # one RUN_DIR per host, as on two machines: a host's pid files hold pids of its own PID namespace
    run_dirs = [os.path.join(pair.run_dir, h) for h in ("a", "b")]
    for d in run_dirs:
        os.makedirs(d)
    pair.role_dirs.update(prefill=run_dirs[0], decode=run_dirs[1])
    try:
        if hosts.mode == NETNS:
            hosts.hold(shm_size="2g")
        ia, ib = hosts.ips
        # UCX_NET_DEVICES unset: UCX picks the host's devices itself (lo and the veth here), as in deploy/k8s
        pair.env.update(PREFILL_HOST=ia, DECODE_HOST=ib, ROUTER_HOST=ib, P2PWORKER_SECRET="e2e-two-hosts")
        if hosts.mode != NETNS:
            pair.env["PREFILL_ENV"] += " UCX_TLS=tcp,self"
            pair.env["DECODE_ENV"] += " UCX_TLS=tcp,self"
            pair.env["SAME_HOST"] = "0"  # both engines here would otherwise copy out of each other's region file
        script = os.path.join(ROOT, "scripts", "pd.sh")
        starts = [subprocess.Popen(hosts.enter(i, [script, "start", *roles]), env={**pair.env, "RUN_DIR": run_dirs[i]},
                                   text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
                  for i, roles in ((0, ["prefill"]), (1, ["decode", "router"]))]
        for p in starts:
            out, err = p.communicate(timeout=420)
            assert p.returncode == 0, f"pd.sh start inside a host failed:\n{out}\n{err}"

        def call(url: str, body: dict | None = None) -> str:  # from host B, where a client of the router would be
            p = subprocess.run(hosts.enter(1, [sys.executable, "-c", CLIENT, url, json.dumps(body) if body else ""]),
                               capture_output=True, text=True, timeout=180)
            assert p.returncode == 0, p.stderr
            return p.stdout

        def complete(url: str, text: str, **extra) -> tuple[list, list]:
            body = {"model": "tiny", "prompt": text, "max_tokens": 12, "temperature": 0, "logprobs": 1, **extra}
            c = json.loads(call(url + "/v1/completions", body))["choices"][0]
            return c["logprobs"]["tokens"], c["logprobs"]["token_logprobs"]

        def p2p_tokens() -> float:
            text = call(f"http://{ib}:{pair.decode_http}/metrics")
            return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                       if line.startswith("vllm:prompt_tokens_cached_by_source_total{") and 'source="p2p"' in line)

        router, prefill = f"http://{ib}:{pair.router_port}", f"http://{ia}:{pair.prefill_http}"
        deadline = time.monotonic() + 20  # the hosts started in parallel: the next health round (5 s) sees both
        while (health := json.loads(call(router + "/health")))["status"] != "ok":
            assert time.monotonic() < deadline, health
            time.sleep(1)
        assert health["prefill"][0]["worker"] == f"{ia}:{pair.prefill_p2p}", health
        for n, seed in ((520, 7100), (1500, 7200)):
            text = prompt(n, seed)
            want = complete(prefill, text, cache_salt=f"baseline-{uuid.uuid4().hex}")
            before_tokens, before_wire = p2p_tokens(), hosts.wire_bytes()
            got = complete(router, text)
            served, wire = p2p_tokens() - before_tokens, hosts.wire_bytes() - before_wire
            assert got[0] == want[0], f"{n} tokens: output differs\n got  {got[0]}\n want {want[0]}"
            worst = max(abs(a - b) for a, b in zip(got[1], want[1]))
            assert worst <= LOGPROB_TOL, f"{n} tokens: logprobs differ by {worst}"
            assert served == n // BLOCK * BLOCK, f"{n} tokens: decode took {served} from P2P"
            # the KV crossed a network interface: host A's veth (its other traffic is small), or on the fallback the
            # loopback (UCX_TLS=tcp: not cross-memory attach)
            assert wire >= served * KV_BYTES_PER_TOKEN, (n, wire, served * KV_BYTES_PER_TOKEN)
            sent = f"{wire} B sent by host A's veth" if hosts.mode == NETNS else f"{wire} B sent on lo"
            print(f"{n} tokens: {served:.0f} from P2P, {sent}, KV >= {served * KV_BYTES_PER_TOKEN:.0f} B, "
                  f"logprob diff {worst:.1e}")
    finally:
        for i in range(len(hosts.init_pids) if hosts.mode == NETNS else 2):
            stops.append(subprocess.run(hosts.enter(i, [os.path.join(ROOT, "scripts", "pd.sh"), "stop"]),
                                        env={**pair.env, "RUN_DIR": run_dirs[i]}, capture_output=True, text=True,
                                        timeout=150))
        left = hosts.release()
    assert not left, f"namespaces or links left behind: {left}"
    for p in stops:
        assert p.returncode == 0 and "killing" not in p.stderr, f"pd.sh stop inside a host: {p.stderr}"
    assert not pair.leftovers(), pair.leftovers()  # workers, admin sockets (/tmp is shared), root /dev/shm
