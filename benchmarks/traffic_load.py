"""The client half of benchmarks/traffic.py: sending a workload's turns to running engines (one thread per
conversation, streamed completions), reading the engines' counters and CPU around a run, and checking sampled
answers against a plain engine.  It needs only engines that answer HTTP, so tests/e2e/test_traffic.py drives the e2e
suite's own pair with it."""

from __future__ import annotations

import http.client
import json
import os
import re
import threading
import time
import urllib.parse
import uuid
from dataclasses import dataclass, replace

from benchmarks import engines
from benchmarks.traffic_plan import Arm, Conversation, Record, Shares, Turn, Workload, answer_problem, build, summarize
from p2pworker.calibrate import CachedTokens, Http, total

PROMPT_TOKENS = "vllm:prompt_tokens_total"
_TIER_SAMPLE = re.compile(r'^vllm:kv_offload_p2pworker_(\w+)_total\{([^}]*)\} (\S+)$', re.M)
_KIND_LABEL = re.compile(r'(?:outcome|path)="([^"]*)"')
SOURCE_HEADER = "x-kv-cache-source-host-port"


@dataclass(frozen=True)
class Endpoint:
    """One engine: its OpenAI server, the address its tier takes remote_kv_source pulls on (None: it has no tier
    to pull through), and its API server's pid (its process tree is the engine's CPU)."""

    url: str
    p2p_host: str = "127.0.0.1"
    p2p_port: int | None = None
    pid: int | None = None


@dataclass(frozen=True)
class Snapshot:
    prompt: float
    cached: CachedTokens
    tier: dict[str, float]  # our tier's counters summed over the engines: "loads.failed", "pull_keys.missed", ...
    engine_cpu_s: float
    worker_cpu_s: float


def tier_counters(text: str) -> dict[str, float]:
    """Every counter our tier exports on an engine's /metrics, by name and outcome (or path), over its workers:
    ``{"loads.ok": 3, "loads.failed": 1, ...}``.  Read by pattern, so a counter the tier adds is reported too."""
    out: dict[str, float] = {}
    for name, labels, value in _TIER_SAMPLE.findall(text):
        kind = _KIND_LABEL.search(labels)
        key = f"{name}.{kind.group(1)}" if kind else name
        out[key] = out.get(key, 0.0) + float(value)
    return out


def _cpu_s(pid: int | None) -> tuple[float, float]:
    """CPU seconds (user + system) of an engine's processes so far: (all but our workers, our workers)."""
    if pid is None:
        return 0.0, 0.0
    tick = os.sysconf("SC_CLK_TCK")
    rest = work = 0
    for p in engines.tree(pid):
        st = engines.proc_stat(f"/proc/{p}")
        if st is None:
            continue
        try:
            with open(f"/proc/{p}/cmdline", "rb") as f:
                worker = b"p2pworker" in f.read() and st[2] != "vllm"
        except OSError:
            worker = False
        if worker:
            work += st[1]
        else:
            rest += st[1]
    return rest / tick, work / tick


class Fleet:
    """The engines of one arm and how a turn reaches them: straight to its engine (the P2P shape, a shared turn
    naming its source's tier), or through a router (the PD shape, the decode's worker named as the KV source)."""

    def __init__(self, endpoints: list[Endpoint], arm: Arm, router: str | None = None,
                 decode_worker: str | None = None, model: str = "tiny"):
        self.endpoints, self.arm, self.router, self.decode_worker, self.model = (endpoints, arm, router,
                                                                                 decode_worker, model)

    def request(self, turn: Turn) -> tuple[str, dict, dict]:
        """(url, body, headers) of a turn."""
        body = {"model": self.model, "prompt": list(turn.prompt), "max_tokens": turn.max_tokens, "temperature": 0,
                "ignore_eos": True, "logprobs": 1, "stream": True, "stream_options": {"include_usage": True}}
        headers = {"Content-Type": "application/json"}
        if self.router:
            if self.arm.shares and turn.source is not None and self.decode_worker:
                headers[SOURCE_HEADER] = self.decode_worker
            return self.router, body, headers
        src = None if turn.source is None else self.endpoints[turn.source]
        if self.arm.shares and src is not None and src.p2p_port is not None:
            body["kv_transfer_params"] = {"remote_kv_source": {
                "kv_request_id": f"traffic-{uuid.uuid4().hex}", "remote_host": src.p2p_host,
                "remote_port": src.p2p_port}}
        return self.endpoints[turn.engine].url, body, headers

    def snapshot(self) -> Snapshot:
        prompt = eng = work = 0.0
        cached = CachedTokens()
        tier: dict[str, float] = {}
        for e in self.endpoints:
            text = Http(e.url, 30).metrics()
            prompt += total(text, PROMPT_TOKENS)
            c = CachedTokens.read(text)
            cached = CachedTokens(cached.device + c.device, cached.host + c.host, cached.p2p + c.p2p)
            for k, v in tier_counters(text).items():
                tier[k] = tier.get(k, 0.0) + v
            r, w = _cpu_s(e.pid)
            eng, work = eng + r, work + w
        return Snapshot(prompt, cached, tier, eng, work)

    def baseline(self, turn: Turn, timeout_s: float) -> tuple[list[str], list]:
        """A plain engine's answer to a turn: the engine that served it, with a cache_salt no cache holds."""
        body = {"model": self.model, "prompt": list(turn.prompt), "max_tokens": turn.max_tokens, "temperature": 0,
                "ignore_eos": True, "logprobs": 1, "cache_salt": f"plain-{uuid.uuid4().hex}"}
        c = Http(self.endpoints[turn.engine % len(self.endpoints)].url, timeout_s).post("/v1/completions",
                                                                                       body)["choices"][0]
        return c["logprobs"]["tokens"], c["logprobs"]["token_logprobs"]

    def warm(self, w: Workload, salt: int, timeout_s: float = 120.0) -> None:
        """One conversation of two turns, one after the other, unmeasured: sessions between the tiers set up, each
        engine's first-request costs paid."""
        conv = build(replace(w, conversations=2, turns=2, think_s=0.0), 1.0, salt)
        for c in conv:
            for t in c.turns:
                r = send(self, t, time.monotonic(), timeout_s)
                if not r.ok:
                    raise RuntimeError(f"warm-up request {t.key} failed: {r.error}")
                time.sleep(0.5)


def _read_stream(resp, rec: Record, t0: float) -> None:
    last = None
    for raw in resp:
        if not raw.startswith(b"data: "):
            continue
        data = raw[6:].strip()
        if data == b"[DONE]":
            break
        obj = json.loads(data)
        now = time.monotonic() - t0
        choices = obj.get("choices") or []
        lp = (choices[0].get("logprobs") or {}) if choices else {}
        if lp.get("tokens"):
            if rec.ttft_s is None:
                rec.ttft_s = now - rec.sent_s
            else:
                rec.gaps_s.append(now - last)
            last = now
            rec.tokens += lp["tokens"]
            rec.logprobs += lp.get("token_logprobs") or [None] * len(lp["tokens"])
        if obj.get("usage"):
            rec.prompt_tokens = obj["usage"].get("prompt_tokens", 0)
            rec.output_tokens = obj["usage"].get("completion_tokens", 0)


def send(fleet: Fleet, turn: Turn, t0: float, timeout_s: float) -> Record:
    """One streamed turn; every failure is the record's error, never raised."""
    url, body, headers = fleet.request(turn)
    u = urllib.parse.urlsplit(url)
    rec = Record(turn.key, turn.engine, time.monotonic() - t0)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout_s)
    try:
        conn.request("POST", "/v1/completions", json.dumps(body), headers)
        resp = conn.getresponse()
        if resp.status != 200:
            rec.error = f"HTTP {resp.status}: {resp.read()[:300].decode(errors='replace')}"
            return rec
        _read_stream(resp, rec, t0)
        rec.done_s = time.monotonic() - t0
        if rec.ttft_s is None or rec.output_tokens != turn.max_tokens:
            rec.error = f"short answer: {rec.output_tokens} of {turn.max_tokens} tokens"
    except (OSError, http.client.HTTPException, ValueError) as e:
        rec.error = repr(e)
    finally:
        conn.close()
    return rec


def _conversation(fleet: Fleet, conv: Conversation, t0: float, deadline: float, timeout_s: float,
                  out: list[Record], lock: threading.Lock) -> None:
    mine: list[Record] = []
    wait = t0 + conv.start_s - time.monotonic()
    if wait > 0:
        time.sleep(min(wait, max(deadline - time.monotonic(), 0)))
    for turn in conv.turns:
        if turn.think_s:
            time.sleep(min(turn.think_s, max(deadline - time.monotonic(), 0)))
        if time.monotonic() >= deadline:
            mine.append(Record(turn.key, turn.engine, time.monotonic() - t0, error="not sent: the run's deadline"))
            continue
        mine.append(send(fleet, turn, t0, timeout_s))
    with lock:
        out.extend(mine)


def run_load(fleet: Fleet, convs: list[Conversation], timeout_s: float, deadline_s: float) -> tuple[list[Record],
                                                                                                    float]:
    """Every conversation's turns in order, conversations at their arrival times; returns the records and the run's
    wall time (first send to last answer).  Bounded: no turn starts after ``deadline_s``, each request within
    ``timeout_s``."""
    out: list[Record] = []
    lock = threading.Lock()
    t0 = time.monotonic()
    deadline = t0 + deadline_s
    threads = [threading.Thread(target=_conversation, args=(fleet, c, t0, deadline, timeout_s, out, lock),
                                daemon=True, name=f"conv-{c.index}") for c in convs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(deadline + timeout_s + 10 - time.monotonic(), 0.1))
    stuck = [t.name for t in threads if t.is_alive()]
    if stuck:
        raise RuntimeError(f"conversations still running past the run's bound: {stuck}")
    wall = max((r.done_s or r.sent_s for r in out), default=0.0)
    return out, wall


def check_answers(fleet: Fleet, convs: list[Conversation], records: list[Record], tol: float,
                  timeout_s: float) -> tuple[int, list[str]]:
    """Sampled turns that were answered: each against a plain engine.  (checked, problems)."""
    by_key = {r.key: r for r in records if r.ok}
    problems, checked = [], 0
    for c in convs:
        for t in c.turns:
            if t.check and t.key in by_key:
                want = fleet.baseline(t, timeout_s)
                checked += 1
                if p := answer_problem(by_key[t.key], *want, tol):
                    problems.append(p)
    return checked, problems


def snapshot_delta(a: Snapshot, b: Snapshot) -> dict:
    d = b.cached - a.cached
    shares = Shares(b.prompt - a.prompt, d.p2p, d.device + d.host)
    work = round(b.worker_cpu_s - a.worker_cpu_s, 2)
    return {"tokens": shares.to_json(),
            "tier_counters": {k: v - a.tier.get(k, 0.0) for k, v in sorted(b.tier.items())},
            "cpu": {"engines_s": round(b.engine_cpu_s - a.engine_cpu_s, 2), "workers_s": work,
                    "worker_us_per_pulled_token": round(work / d.p2p * 1e6, 2) if d.p2p and work else None}}


def run_rate(fleet: Fleet, w: Workload, rate: float, salt: int, timeout_s: float, deadline_s: float,
             tol: float) -> dict:
    """One rate's run: the workload, the counters and CPU around it, then the sampled answers checked."""
    convs = build(w, rate, salt)
    before = fleet.snapshot()
    records, wall = run_load(fleet, convs, timeout_s, deadline_s)
    after = fleet.snapshot()
    checked, problems = check_answers(fleet, convs, records, tol, timeout_s)
    errors = sorted({r.error for r in records if r.error})[:10]
    return {"offered_rps": rate, "salt": salt, "client": summarize(records, wall), **snapshot_delta(before, after),
            "answers_checked": checked, "answer_problems": problems, "errors": errors}
