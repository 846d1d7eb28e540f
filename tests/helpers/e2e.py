"""What the end-to-end suite (tests/e2e) uses to run real `vllm serve` engines: a PD pair started and stopped by
scripts/pd.sh (:class:`PD`, :func:`running`), requests and metrics against it, and the answer checks."""

from __future__ import annotations

import contextlib
import glob
import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid

from tests.helpers.ports import free_ports

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MAX_MODEL_LEN = 2048
BLOCK = 128  # vLLM's CPU backend block size (one offloaded chunk)
LOGPROB_TOL = 1e-4  # decode continues from transferred KV; same floats up to summation order


def http_json(url: str, body: dict | None = None, timeout_s: float = 120.0):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data, {"Content-Type": "application/json"} if data else {})
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        raw = r.read()
    return json.loads(raw) if raw[:1] in (b"{", b"[") else raw.decode()


class PD:
    """Handles on the running pair: URLs, metrics, the scripts, the workers' processes."""

    def __init__(self, model: str, run_dir: str):
        self.model, self.run_dir = model, run_dir
        (self.prefill_http, self.decode_http, self.router_port, self.prefill_p2p, self.decode_p2p,
         self.prefill_worker_metrics, self.decode_worker_metrics) = free_ports(7)
        self.env = {
            **os.environ, "MODEL": model, "SERVED_NAME": "tiny", "RUN_DIR": run_dir, "VENV": sys.prefix,
            "PREFILL_HTTP": str(self.prefill_http), "DECODE_HTTP": str(self.decode_http),
            "ROUTER_PORT": str(self.router_port), "PREFILL_P2P": str(self.prefill_p2p),
            "DECODE_P2P": str(self.decode_p2p), "PREFILL_WORKER_METRICS": str(self.prefill_worker_metrics),
            "DECODE_WORKER_METRICS": str(self.decode_worker_metrics), "CPU_BYTES": str(64 << 20),
            "HEALTH_TIMEOUT_S": "300",
            "VLLM_ARGS": f"--enforce-eager --dtype float32 --max-model-len {MAX_MODEL_LEN} --max-num-seqs 8",
            # dev mode on the prefill engine: /reset_prefix_cache (a source that evicted its copy, test_orchestrators)
            "PREFILL_ENV": "VLLM_CPU_OMP_THREADS_BIND=0 VLLM_CPU_KVCACHE_SPACE=1 VLLM_SERVER_DEV_MODE=1",
            "DECODE_ENV": "VLLM_CPU_OMP_THREADS_BIND=1 VLLM_CPU_KVCACHE_SPACE=1",
        }
        self.env.pop("P2PWORKER_SECRET", None)  # pd.sh generates one into RUN_DIR
        self.report: dict = {}
        self.role_dirs: dict[str, str] = {}  # a role started with its own RUN_DIR (one per emulated host)

    # ---------------------------------------------------------------- scripts
    def script(self, *args: str, timeout_s: float = 400.0, **env: str) -> subprocess.CompletedProcess:
        t0 = time.monotonic()
        p = subprocess.run([os.path.join(ROOT, "scripts", "pd.sh"), *args], env={**self.env, **env},
                           capture_output=True, text=True, timeout=timeout_s)
        self.report.setdefault("script_s", {}).setdefault(args[0], []).append(round(time.monotonic() - t0, 1))
        return p

    # ---------------------------------------------------------------- requests
    def url(self, which: str) -> str:
        port = {"prefill": self.prefill_http, "decode": self.decode_http, "router": self.router_port,
                "prefill-worker": self.prefill_worker_metrics, "decode-worker": self.decode_worker_metrics}[which]
        host = self.env.get(f"{which.split('-')[0].upper()}_HOST", "127.0.0.1")
        if which.endswith("-worker"):
            host = "127.0.0.1"  # the workers' metrics endpoint binds metrics_host (default 127.0.0.1)
        return f"http://{host}:{port}"

    def complete(self, which: str, prompt: str, max_tokens: int = 12, timeout_s: float = 120.0,
                 **extra) -> tuple[list[str], list[float]]:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "logprobs": 1,
                **extra}
        c = http_json(self.url(which) + "/v1/completions", body, timeout_s)["choices"][0]
        return c["logprobs"]["tokens"], c["logprobs"]["token_logprobs"]

    def ttft(self, which: str, prompt: str, **extra) -> float:
        """Seconds from sending a streamed completion to its first token."""
        body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0, "stream": True,
                           **extra}).encode()
        req = urllib.request.Request(self.url(which) + "/v1/completions", body, {"Content-Type": "application/json"})
        t0 = time.perf_counter()
        with urllib.request.urlopen(req, timeout=120) as r:
            for line in r:
                if line.startswith(b"data: {"):
                    first = time.perf_counter() - t0
                    r.read()
                    return first
        raise AssertionError("stream ended without a token")

    def worker_status(self, which: str) -> dict:
        """What the engine's own worker says of itself (its admin endpoint: `p2pworker inspect --json`).  vLLM's
        /metrics is refreshed by engine steps, and an idle vLLM 0.34 engine takes none (its tier-poll thread serves
        peers), so a gauge there may be stale while the worker's own count is current."""
        from p2pworker.admin import query

        (admin,) = glob.glob(f"/tmp/p2pworker-vllm-{self.engine_id(which)}*.admin")
        return query(admin)

    def metric(self, which: str, name: str, **labels: str) -> float:
        text = http_json(self.url(which) + "/metrics")
        want = [f'{k}="{v}"' for k, v in labels.items()]
        total = 0.0
        for m in re.finditer(rf"^{re.escape(name)}\{{([^}}]*)\}} (\S+)$", text, re.M):
            if all(w in m.group(1) for w in want):
                total += float(m.group(2))
        return total

    def p2p_cached(self) -> float:
        """Prompt tokens the decode engine served from the P2P tier (vLLM's own metric)."""
        return self.metric("decode", "vllm:prompt_tokens_cached_by_source_total", source="p2p")

    # ---------------------------------------------------------------- processes
    def engine_id(self, role: str) -> str:
        with open(os.path.join(self.role_dirs.get(role, self.run_dir), f"{role}.engine_id")) as f:
            return f.read().strip()

    def rpc_dir(self, role: str) -> str | None:
        """The directory pd.sh gave that engine for vLLM's ZMQ ipc sockets (VLLM_RPC_BASE_PATH); None once stopped."""
        try:
            with open(os.path.join(self.role_dirs.get(role, self.run_dir), f"{role}.rpc_dir")) as f:
                return f.read().strip()
        except FileNotFoundError:
            return None

    def worker_pids(self, role: str) -> list[int]:
        """The p2pworker process(es) the given engine's tier spawned."""
        return worker_pids_of(self.engine_id(role))

    def log_path(self, role: str) -> str:
        return os.path.join(self.role_dirs.get(role, self.run_dir), f"{role}.log")

    def log_offsets(self) -> dict[str, int]:
        """How far each engine's log is written now (where a later :meth:`error_lines` starts reading)."""
        return {role: os.path.getsize(self.log_path(role)) for role in ("prefill", "decode")
                if os.path.exists(self.log_path(role))}

    def error_lines(self, offsets: dict[str, int]) -> list[str]:
        """Lines the engines logged since ``offsets`` that say ERROR or Traceback: a clean stop (and a run without
        faults) logs none.  vLLM 0.32's own shutdown race (benchmarks/engines.py ``VLLM_SHUTDOWN_RACE``) is kept
        apart, in the report under ``vllm_shutdown_race``."""
        from benchmarks.engines import log_errors

        out = []
        for role, offset in offsets.items():
            found = log_errors(self.log_path(role), offset)
            out += [f"{role}: {ln}" for ln in found.errors]
            if found.shutdown_race:
                self.report.setdefault("vllm_shutdown_race", {})[role] = found.shutdown_race[:2]
        return out

    def leftovers(self) -> list[str]:
        left = []
        for role in ("prefill", "decode"):
            eid = self.engine_id(role)
            left += glob.glob(f"/dev/shm/vllm_offload_{eid}*") + glob.glob(f"/dev/shm/p2pw_vllm-{eid}*")
            left += glob.glob(f"/tmp/p2pworker-vllm-{eid}*.admin")
            left += [f"pid {p} (p2pworker of {role})" for p in self.worker_pids(role)]
        return left


@contextlib.contextmanager
def running(pair: PD, on_stop=None, starts=(("start",),), before_stop=None):
    """`scripts/pd.sh start` ... `stop`; the first request through the router right after the start must be served
    over P2P, and the stop must leave nothing behind and stop every engine in its bound.
    ``starts``: the start invocations, e.g. one role at a time as on two machines.  ``before_stop(pair)`` runs right
    before the stop (traffic the stop must cope with); ``on_stop(pair)`` after it, before the checks (reports)."""
    try:
        for args in starts:
            p = pair.script(*args)
            assert p.returncode == 0, f"scripts/pd.sh {' '.join(args)} failed:\n{p.stdout}\n{p.stderr}"
    except BaseException:
        pair.script("stop", timeout_s=120)
        raise
    try:
        if any(len(args) == 1 or "router" in args for args in starts):
            first_request_over_p2p(pair)
        yield pair
        if before_stop is not None:
            before_stop(pair)
    finally:
        rpc = [d for role in ("prefill", "decode") if (d := pair.rpc_dir(role))]
        offsets = pair.log_offsets()
        p = pair.script("stop", timeout_s=120)
        if on_stop is not None:
            on_stop(pair)
        left = pair.leftovers() + [f"{d} (vLLM's ipc sockets)" for d in rpc if os.path.exists(d)]
        assert p.returncode == 0 and not left, f"pd.sh stop rc={p.returncode}, leftovers {left}:\n{p.stderr}"
        assert "killing" not in p.stderr, f"an engine did not stop within the bound:\n{p.stderr}"
        logged = pair.error_lines(offsets)
        assert not logged, f"the stop logged errors: {logged}"


def first_request_over_p2p(pair: PD) -> float:
    """Right after ``pd.sh start`` returned: the first request through the router is a PD request served over P2P
    (the decode engine counts P2P prompt tokens), not a silent recompute because the router had not yet taken an
    instance in (pd.sh start waits until its /health lists every configured instance up).  Returns the tokens."""
    from tests.helpers.tiny_model import prompt

    before = pair.p2p_cached()
    pair.complete("router", prompt(300, seed=8800))
    got = pair.p2p_cached() - before
    pair.report.setdefault("first_request_p2p_tokens", []).append(got)
    assert got > 0, "the first request after pd.sh start was recomputed: the router did not route it over P2P"
    return got


def worker_pids_of(engine_id: str) -> list[int]:
    """The p2pworker processes an engine's tiers spawned (every DP rank's: ``vllm-<engine_id>`` starts their names)."""
    tag = f"--name vllm-{engine_id}".encode()
    pids = []
    for d in glob.glob("/proc/[0-9]*/cmdline"):
        try:
            with open(d, "rb") as f:
                cmd = f.read().replace(b"\0", b" ")
        except OSError:
            continue
        if b"p2pworker.cli launch" in cmd and tag in cmd:
            pids.append(int(d.split("/")[2]))
    return pids


def baseline(pd, text: str, timeout_s: float = 120.0):
    return pd.complete("prefill", text, cache_salt=f"baseline-{uuid.uuid4().hex}", timeout_s=timeout_s)


def expected_p2p_tokens(n_tokens: int) -> int:
    return n_tokens // BLOCK * BLOCK  # every full block (vLLM then recomputes the last token itself)


def assert_same(got, want, what: str) -> None:
    (gt, gl), (wt, wl) = got, want
    assert gt == wt, f"{what}: tokens differ\n got  {gt}\n want {wt}"
    worst = max(abs(a - b) for a, b in zip(gl, wl))
    assert worst <= LOGPROB_TOL, f"{what}: logprobs differ by {worst}"


def leave_unfetched_stores(pair: PD) -> None:
    """Right before the session's stop: a prefill request whose decode never comes, so the prefill engine stops with
    stores parked for nobody (and a shared-prefix PD exchange before it).  The stop must still be clean and within
    vLLM's --shutdown-timeout (running's checks): the tier ends such stores once vLLM drains for shutdown."""
    from tests.helpers.tiny_model import prompt

    text = prompt(700, seed=9000)
    pair.complete("prefill", text, max_tokens=1, kv_transfer_params={"remote_decoder": {"kv_request_id": "nobody"}})
    deadline = time.monotonic() + 10  # the stores are submitted after the request's answer, reported at a step
    while (parked := pair.metric("prefill", "vllm:kv_offload_p2pworker_jobs_in_flight")) == 0:
        assert time.monotonic() < deadline, "the prefill engine has no parked store: the stop would not test the drain"
        time.sleep(0.1)
    pair.report["parked_at_stop"] = parked
