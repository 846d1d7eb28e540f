"""Time to first token with a prefix pulled from a peer over P2P versus recomputed, on real `vllm serve` engines.

    .venv-vllmcpu034/bin/python benchmarks/pull_vs_recompute.py --venv .venv-vllmcpu034 [--chunks 1,2,4,8,15]
        [--reps 5] [--tiers ours,intree] [--hosts one|two] [--hops DIR] [--json F] [--plot F.png] [--model DIR]
    .venv/bin/python benchmarks/pull_vs_recompute.py --replot benchmarks/results/pull_vs_recompute.json

Per tier (``ours``: the P2PWorkerTier; ``intree``: vLLM's own ``p2p`` tier, NIXL over UCX) one pair of engines on
vLLM's CPU backend (benchmarks/engines.py; the tiny test model unless --model): a *source* on core 0 and a
*puller* on core 1 (VLLM_SERVER_DEV_MODE=1 for /reset_prefix_cache), on this host or (``--hosts two``) each on its
own emulated host (tests/helpers/hosts/emulate.py), this script a client on the puller's, where every pull must
also have sent its KV bytes on the source host's veth.  Only one pair runs at a time.  Per prefix
length (``--chunks`` offload blocks of ``--block-size`` tokens, plus a few tokens past the last block) and rep, each
arm gets a fresh random token-ID prompt, arms in an order that rotates per rep:

* ``recompute``: the puller computes the whole prompt;
* ``local``: the puller's own CPU tier holds the prefix (computed once, device prefix cache reset): the floor a pull
  cannot beat;
* ``pull_idle``: the source computed the prompt and sits idle; the puller pulls it (``remote_kv_source``);
* ``pull_busy``: the same while the source generates for another request (a streamed one, closed after the pull);
* ``pull_miss``: the puller asks an idle source that does not hold the prompt (it never computed it): what a miss
  costs over a plain recompute (ours: the one-trip load asks the source, fails, and vLLM recomputes).

TTFT is the first streamed chunk of a ``max_tokens: 1`` request.  Each timed request is attributed by the puller's
``vllm:prompt_tokens_cached_by_source_total{source}`` read around it: recompute must show no cached token, local
only ``host`` tokens, a pull only ``p2p`` tokens, every full block each time; anything else fails the cell (an arm
that silently recomputed is never timed as a pull).  Each cell's answer (12 greedy tokens with logprobs, asked right
after the timed request) must equal a plain engine's, asked first with a ``cache_salt`` (no cache can answer it).

Output: a table per tier (median [min..max] ms), the crossover (the shortest prefix from which the pull beats
recompute at every longer tested length, as ``p2pworker calibrate`` recommends it), one JSON line, the results file
(p2pworker/bench/results.py; default ``benchmarks/results/pull_vs_recompute[-two_hosts].json``) and the plot beside it
(matplotlib; scripts/setup.sh --bench installs it).  ``--hops DIR`` also traces both workers and the engine cores
(benchmarks/hops) and splits each pull of ours into its hops, kept in the results file under ``hops``.  Exit
status 1 when a cell failed or an engine's stop left anything behind.  On the tiny model recompute is very cheap
(a few hundred FLOP per KV byte where a real model does ~10^5), so "no crossover" is an honest outcome there,
printed as such.
"""

from __future__ import annotations

import argparse
import contextlib
import enum
import functools
import glob
import json
import os
import random
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from benchmarks import engines  # noqa: E402
from p2pworker.bench import results  # noqa: E402
from benchmarks.hops import pulls as hop_pulls  # noqa: E402
from p2pworker.calibrate import (CachedTokens, Http, Point, Served, classify, crossover,  # noqa: E402
                                 expected_hit_tokens, total)
from tests.helpers.hosts.emulate import NETNS, TwoHosts  # noqa: E402
from tests.helpers.ports import free_ports  # noqa: E402

TAIL = 8  # prompt tokens past the last full block: every block is then cacheable (vLLM computes the last token)
ANSWER_TOKENS = 12
LOGPROB_TOL = 1e-4  # KV from another engine or tier: same floats up to summation order
RUNNING = "vllm:num_requests_running"
BENCHMARK = "pull_vs_recompute"


class Tier(enum.Enum):
    OURS = "ours"
    INTREE = "intree"


class Hosts(enum.Enum):
    ONE = "one"  # both engines here, on loopback: the same-host copy (ours) or cma (UCX)
    TWO = "two"  # source and puller on two emulated hosts (tests/helpers/hosts/emulate.py): UCX over TCP on a veth


@dataclass(frozen=True)
class Place:
    """Where an engine runs: its address, and how an argv gets inside its host (None: here)."""
    host: str = "127.0.0.1"
    inside: Callable[[list[str]], list[str]] | None = None


class Arm(enum.Enum):
    RECOMPUTE = "recompute"
    LOCAL = "local"
    PULL_IDLE = "pull_idle"
    PULL_BUSY = "pull_busy"
    PULL_MISS = "pull_miss"  # the source does not hold the prompt: the request recomputes

    @property
    def expected(self) -> Served:
        return {Arm.RECOMPUTE: Served.RECOMPUTED, Arm.LOCAL: Served.HOST_HIT,
                Arm.PULL_MISS: Served.RECOMPUTED}.get(self, Served.P2P_PULL)

    @property
    def pulls(self) -> bool:
        """Its request names the source (remote_kv_source)."""
        return self in (Arm.PULL_IDLE, Arm.PULL_BUSY, Arm.PULL_MISS)

    @property
    def source_holds(self) -> bool:
        """The source computed the prompt first."""
        return self in (Arm.PULL_IDLE, Arm.PULL_BUSY)


def arm_problem(arm: Arm, delta: CachedTokens, hit_tokens: int) -> str | None:
    """Why the puller's counter deltas around an arm's timed request do not show what the arm claims to time: a
    recompute with nothing cached, a local hit of every full block from its own CPU tier, a pull of every full block
    over P2P.  None when they do."""
    served = classify(delta, hit_tokens)
    if served is arm.expected:
        return None
    return (f"{arm.value}: {served.value} (cached {asdict(delta)}), want {arm.expected.value}"
            + (f" of {hit_tokens} tokens" if arm is not Arm.RECOMPUTE else ""))


@dataclass
class Cell:
    tier: Tier
    arm: Arm
    chunks: int
    tokens: int
    rep: int
    ttft_s: float
    served: Served
    cached: CachedTokens
    problem: str | None

    def to_json(self) -> dict:
        return {"tier": self.tier.value, "arm": self.arm.value, "chunks": self.chunks, "tokens": self.tokens,
                "rep": self.rep, "ttft_ms": round(self.ttft_s * 1e3, 3), "served": self.served.value,
                "cached": asdict(self.cached), "problem": self.problem}


# ---------------------------------------------------------------------------------------------------- one pair
class Pair:
    """A source and a puller engine with one tier, and the requests of every arm against them."""

    def __init__(self, tier: Tier, a: argparse.Namespace, log_dir: str,
                 places: tuple[Place, Place] = (Place(), Place()), wire: Callable[[], int] | None = None):
        """``wire``: bytes the source's host has sent on its network interface so far (two hosts): a pull must have
        sent at least its KV that way, or it did not cross the wire."""
        self.tier, self.a, self.places, self.wire = tier, a, places, wire
        self.kv_bytes_per_token = kv_bytes_per_token(a.model)
        secret = secrets.token_hex(32)
        (src_http, pul_http, self.src_p2p, pul_p2p) = free_ports(4)
        py = os.path.join(a.venv, "bin", "python")
        extra = ("--block-size", str(a.block_size))
        common = dict(python=py, model=a.model, log_dir=log_dir, secret=secret, max_model_len=a.max_model_len,
                      args=extra)
        self.engines: list[engines.Engine] = []
        try:
            for name, http, p2p, bind, env, place in (
                    ("source", src_http, self.src_p2p, "0", {"HOPTRACE_ROLE": f"{tier.value}_source"}, places[0]),
                    ("puller", pul_http, pul_p2p, "1",
                     {"VLLM_SERVER_DEV_MODE": "1", "HOPTRACE_ROLE": f"{tier.value}_puller"}, places[1])):
                entry = (engines.ours_tier(p2p, "prefill" if name == "source" else "decode", place.host)
                         if tier is Tier.OURS else engines.intree_tier(p2p, place.host))
                kv = engines.kv_transfer_config(engines.new_engine_id(f"pvr-{tier.value}-{name}"), [entry],
                                                a.cpu_mib << 20)
                self.engines.append(engines.Engine(f"{tier.value}-{name}", kv=kv, http=http, bind=bind, env=env,
                                                   host=place.host, inside=place.inside, **common))
        except BaseException:
            self.stop()  # the source started, the puller did not: never leave the source running
            raise
        self.source = Http(self.engines[0].url(), a.timeout_s)
        self.puller = Http(self.engines[1].url(), a.timeout_s)

    def up(self) -> None:
        for e in self.engines:
            e.wait_healthy(self.a.health_timeout_s)
        for i, http in enumerate((self.source, self.puller)):  # a fresh engine's first request pays one-time costs
            self.complete(http, ids(1000, 3 + i, 300), 4)

    def stop(self) -> dict:
        out = {}
        for e in self.engines:  # each one stopped, whatever the other's stop did
            try:
                out[e.name] = e.stop(self.a.stop_timeout_s)
            except Exception as err:  # noqa: BLE001 - reported as an unclean stop, never hides the other engine
                out[e.name] = {"error": repr(err), "left_processes": ["unknown: the stop raised"]}
        return out

    # ------------------------------------------------------------ requests
    @staticmethod
    def complete(http: Http, prompt: list[int], max_tokens: int = ANSWER_TOKENS, **extra) -> tuple[list, list]:
        c = http.post("/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens,
                                          "temperature": 0, "logprobs": 1, **extra})["choices"][0]
        return c["logprobs"]["tokens"], c["logprobs"]["token_logprobs"]

    def remote_source(self) -> dict:
        return {"remote_kv_source": {"kv_request_id": f"pvr-{uuid.uuid4().hex}", "remote_host": self.places[0].host,
                                     "remote_port": self.src_p2p}}

    def reset_device_cache(self) -> None:
        """The puller's device prefix cache only (its CPU tier keeps the prefix); refused while a request holds
        blocks, so retried."""
        deadline = time.monotonic() + 30
        while not self.puller.post("/reset_prefix_cache").get("success"):
            if time.monotonic() > deadline:
                raise RuntimeError("the puller's /reset_prefix_cache kept answering success: false")
            time.sleep(0.2)

    @contextlib.contextmanager
    def busy_source(self):
        """The source generating for another request: a streamed one, entered at its first token, closed after."""
        room = self.a.max_model_len - 200 - 1
        body = json.dumps({"model": "tiny", "prompt": ids(2000, random.getrandbits(32), 200),
                           "max_tokens": min(room, 600), "ignore_eos": True, "temperature": 0,
                           "stream": True}).encode()
        import urllib.request

        req = urllib.request.Request(self.engines[0].url("/v1/completions"), body,
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=self.a.timeout_s) as r:
            for line in r:
                if line.startswith(b"data: {"):
                    break
            yield
        self._wait_source_idle()  # vLLM aborts a streamed request whose client went away

    def _wait_source_idle(self) -> None:
        deadline = time.monotonic() + self.a.timeout_s
        while total(self.source.metrics(), RUNNING) > 0:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the source still runs a request {self.a.timeout_s} s after the busy stream "
                                   "closed")
            time.sleep(0.2)

    # ------------------------------------------------------------ one arm
    def prepare(self, arm: Arm, prompt: list[int]) -> None:
        if arm is Arm.LOCAL:
            self.complete(self.puller, prompt, 1)
            time.sleep(self.a.settle_s)  # its CPU tier stores a step later
            self.reset_device_cache()
        elif arm.source_holds:
            self.complete(self.source, prompt, 1)
            time.sleep(self.a.settle_s)
        elif arm.pulls:
            time.sleep(self.a.settle_s)  # the miss too starts from an idle source

    def timed(self, arm: Arm, prompt: list[int]) -> tuple[float, CachedTokens, int | None]:
        """TTFT, the puller's cached-token deltas, and (two hosts) the bytes the source's host sent meanwhile."""
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0}
        if arm.pulls:
            body["kv_transfer_params"] = self.remote_source()
        with self.busy_source() if arm is Arm.PULL_BUSY else contextlib.nullcontext():
            wire0 = self.wire() if self.wire else None  # outside the timed window: a subprocess each
            before = self.puller.cached()
            sent = time.monotonic_ns()
            took = self.puller.ttft(body)
            delta = self.puller.cached() - before
            wired = self.wire() - wire0 if self.wire else None
        if self.a.ttft_log:  # on the workers' trace clock: benchmarks/hops/pulls.py aligns the two
            rid = body.get("kv_transfer_params", {}).get("remote_kv_source", {}).get("kv_request_id", "-")
            with open(self.a.ttft_log, "a") as f:
                f.write(f"{sent} {sent + int(took * 1e9)} {rid} {arm.value} {self.tier.value}\n")
        return took, delta, wired

    def cell(self, arm: Arm, chunks: int, rep: int, seed: int) -> Cell:
        tokens = chunks * self.a.block_size + TAIL
        prompt = ids(0, seed, tokens)
        want = self.complete(self.puller, prompt, cache_salt=f"baseline-{uuid.uuid4().hex}")
        self.prepare(arm, prompt)
        took, delta, wired = self.timed(arm, prompt)
        hit = expected_hit_tokens(tokens, self.a.block_size)
        problem = (arm_problem(arm, delta, hit) or wire_problem(arm, delta, wired, self.kv_bytes_per_token)
                   or answer_problem(self.complete(self.puller, prompt), want))
        return Cell(self.tier, arm, chunks, tokens, rep, took, classify(delta, hit), delta, problem)


def kv_bytes_per_token(model: str) -> int:
    """What one token's K and V weigh at least, every layer, float32 (the engines' --dtype): from the model's
    config.json."""
    with open(os.path.join(model, "config.json")) as f:
        c = json.load(f)
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    return c["num_hidden_layers"] * 2 * c.get("num_key_value_heads", c["num_attention_heads"]) * head_dim * 4


def wire_problem(arm: Arm, delta: CachedTokens, wired: int | None, per_token: int) -> str | None:
    """Two hosts: a pull whose source host sent fewer bytes on its interface than the KV it served did not cross
    the wire (a same-host path or shared memory would leave the interface quiet).  None when it did, or when no
    wire is watched."""
    if wired is None or not arm.source_holds:
        return None
    need = int(delta.p2p) * per_token
    return None if wired >= need else f"{arm.value}: the source host sent {wired} B, less than {need} B of KV pulled"


def ids(salt: int, seed: int, n: int) -> list[int]:
    """``n`` random token ids inside any vocabulary of 1000+ (the tiny model has 1024); distinct seeds, distinct
    prompts, so no cache of any engine holds one before its arm."""
    rng = random.Random(salt * 1_000_003 + seed)
    return [rng.randrange(100, 1000) for _ in range(n)]


def answer_problem(got: tuple[list, list], want: tuple[list, list]) -> str | None:
    (gt, gl), (wt, wl) = got, want
    if gt != wt:
        return f"answer differs from a plain engine's: {gt} vs {wt}"
    worst = max((abs(x - y) for x, y in zip(gl, wl) if x is not None and y is not None), default=0.0)
    return None if worst <= LOGPROB_TOL else f"logprobs differ from a plain engine's by {worst}"


# ---------------------------------------------------------------------------------------------------- the run
def run_tier(tier: Tier, a: argparse.Namespace, log_dir: str, report: dict) -> list[Cell]:
    if Hosts(a.hosts) is Hosts.ONE:
        return run_pair(tier, a, log_dir, report)
    hosts = TwoHosts("pvr", Path(log_dir))
    out: dict = report.setdefault("tiers", {}).setdefault(tier.value, {})
    try:
        hosts.make()
        if hosts.mode != NETNS:
            raise RuntimeError(f"--hosts two needs network namespaces (root, `ip netns`): {hosts.why}")
        hosts.hold(shm_size="2g")  # each host's own /dev/shm: its engine's CPU tier, rings, our region
        out["hosts"] = {"mode": hosts.mode, "source": hosts.ips[0], "puller": hosts.ips[1]}
        places = tuple(Place(hosts.ips[i], functools.partial(hosts.enter, i)) for i in range(2))
        with hosts.client_in(1):  # this script is a client on the puller's host; the source is across the veth
            return run_pair(tier, a, log_dir, report, places, wire=hosts.wire_bytes)
    finally:
        left = hosts.release()  # every process still inside a host dies with it
        if left:
            out["left_namespaces"] = left


WARMUPS = 3


def run_pair(tier: Tier, a: argparse.Namespace, log_dir: str, report: dict,
             places: tuple[Place, Place] = (Place(), Place()), wire: Callable[[], int] | None = None) -> list[Cell]:
    pair = Pair(tier, a, log_dir, places, wire)
    out: dict = report.setdefault("tiers", {}).setdefault(tier.value, {})
    cells: list[Cell] = []
    try:
        pair.up()
        out["startup_s"] = {e.name: e.startup_s for e in pair.engines}
        # session setup, discarded.  Up to WARMUPS tries: vLLM 0.34's in-tree tier answers MISS while its session's
        # handshake is not acknowledged, so its first contact recomputes by design
        for n in range(1, WARMUPS + 1):
            warm = pair.cell(Arm.PULL_IDLE, 1, -n, seed=7_000_000 + list(Tier).index(tier) * 10 + n)
            if not warm.problem:
                break
        out["warmups"] = n
        if warm.problem:
            raise RuntimeError(f"{tier.value}: {WARMUPS} warm-up pulls failed ({warm.problem}); logs in {log_dir}")
        arms = [Arm(x) for x in a.arms.split(",")]
        for chunks in a.chunk_list:
            for rep in range(a.reps):
                order = arms[rep % len(arms):] + arms[:rep % len(arms)]
                for arm in order:
                    seed = (list(Tier).index(tier) * 100 + chunks) * 10_000 + rep * 10 + list(Arm).index(arm)
                    c = pair.cell(arm, chunks, rep, seed + a.seed * 10_000_000)
                    cells.append(c)
                    print(f"{tier.value} {chunks:>3} chunks rep {rep} {arm.value:<10} {c.ttft_s * 1e3:8.1f} ms  "
                          f"{c.served.value}" + (f"  FAIL: {c.problem}" if c.problem else ""), flush=True)
    finally:
        out["stop"] = pair.stop()
        out["loadavg_after"] = engines.loadavg()
    return cells


def summarize(cells: list[Cell]) -> dict:
    """Per tier, arm and prefix: TTFT stats (ms) over the cells that passed; the crossovers per pull arm."""
    out: dict = {}
    for tier in sorted({c.tier for c in cells}, key=lambda t: t.value):
        arms: dict = {}
        for c in cells:
            if c.tier is tier and c.problem is None:
                arms.setdefault(c.arm.value, {}).setdefault(c.tokens, []).append(c.ttft_s)
        stats = {arm: {str(n): _stats(v) for n, v in sorted(by.items())} for arm, by in arms.items()}
        cross = {}
        for pull in (Arm.PULL_IDLE, Arm.PULL_BUSY):
            shared = sorted(set(arms.get(pull.value, {})) & set(arms.get(Arm.RECOMPUTE.value, {})))
            pts = [Point(n, arms[Arm.RECOMPUTE.value][n], arms[pull.value][n]) for n in shared]
            cross[pull.value] = crossover(pts) if pts else None
        out[tier.value] = {"ttft_ms": stats, "crossover_tokens": cross}
    return out


def _stats(v: list[float]) -> dict:
    return {"median": round(statistics.median(v) * 1e3, 3), "min": round(min(v) * 1e3, 3),
            "max": round(max(v) * 1e3, 3), "n": len(v)}


def table(summary: dict) -> str:
    lines = []
    for tier, s in summary.items():
        arms = [a.value for a in Arm if a.value in s["ttft_ms"]]
        lengths = sorted({int(n) for a in arms for n in s["ttft_ms"][a]})
        lines.append(f"{tier}: TTFT ms, median [min..max]")
        head = ["tokens"] + arms
        rows = [head] + [[str(n)] + [_cell(s["ttft_ms"][a].get(str(n))) for a in arms] for n in lengths]
        widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
        lines += ["  " + "  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
        for pull, n in s["crossover_tokens"].items():
            lines.append(f"  crossover ({pull} vs recompute): " + (f"{n} tokens" if n else
                         "none: recompute is as fast or faster up to the longest prefix tested"))
    return "\n".join(lines)


def _cell(st: dict | None) -> str:
    return "-" if st is None else f"{st['median']:.1f} [{st['min']:.1f}..{st['max']:.1f}]"


def plot(summary: dict, path: str, title: str) -> str | None:
    """TTFT over prefix length, one line per tier and arm; None when written, else why not."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return ("matplotlib is not installed: no plot (scripts/setup.sh --bench installs it, or pip install "
                "matplotlib; --replot JSON draws it later from this run's --json)")
    fig, ax = plt.subplots(figsize=(8, 5))
    styles = {Tier.OURS.value: "-", Tier.INTREE.value: "--"}  # one colour per arm, one line style per tier
    colours = {arm.value: f"C{i}" for i, arm in enumerate(Arm)}
    lengths: set[int] = set()
    for tier, s in summary.items():
        for arm, by in s["ttft_ms"].items():
            xs = [int(n) for n in by]
            lengths.update(xs)
            ax.plot(xs, [by[n]["median"] for n in by], styles.get(tier, ":"), color=colours.get(arm), marker="o",
                    label=f"{tier}: {arm.replace('_', ' ')}")
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted(lengths), [str(n) for n in sorted(lengths)])
    ax.minorticks_off()
    ax.set_xlabel("prompt tokens (prefix in full offload blocks + a few)")
    ax.set_ylabel("time to first token, ms (median)")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    engines.save_plot(fig, path)
    return None


# ---------------------------------------------------------------------------------------------------- main
def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiers", default="ours,intree", help="comma-separated: ours, intree")
    ap.add_argument("--hosts", default=Hosts.ONE.value, choices=[h.value for h in Hosts],
                    help="one: both engines on this host; two: source and puller on two emulated hosts (network "
                         "namespaces and a veth; needs root), this script a client on the puller's")
    ap.add_argument("--arms", default=",".join(a.value for a in Arm), help="comma-separated subset of the arms")
    ap.add_argument("--chunks", default="", help="prefix lengths in offload blocks (default: 1,2,4,... and the "
                                                 "longest that fits --max-model-len)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--block-size", type=int, default=128, help="vLLM's block (the CPU backend's default: 128)")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--cpu-mib", type=int, default=128, help="each engine's CPU tier")
    ap.add_argument("--settle-s", type=float, default=2.0, help="after computing a prefix, before using it")
    ap.add_argument("--timeout-s", type=float, default=120.0, help="every HTTP call")
    ap.add_argument("--seed", type=int, default=0, help="prompt seeds (change it for prompts no run used)")
    ap.add_argument("--model", default=None, help="model dir (default: the tiny test model, built into a temp dir)")
    ap.add_argument("--venv", default=sys.prefix, help="the vLLM venv the engines run in")
    ap.add_argument("--health-timeout-s", type=float, default=300.0)
    ap.add_argument("--stop-timeout-s", type=float, default=40.0)
    ap.add_argument("--scenario", default=None, help="names the results file (default: two_hosts with --hosts two, "
                    "else none)")
    ap.add_argument("--json", default=None, help="the results file (default: benchmarks/results/"
                    "pull_vs_recompute[-SCENARIO].json)")
    ap.add_argument("--plot", default=None, help="the TTFT plot (default: the results file with .png; '' for none)")
    ap.add_argument("--replot", default=None, help="draw --plot from this results file; start nothing")
    ap.add_argument("--hops", default=None, metavar="DIR", help="trace both workers (P2PWORKER_HOOK) and the engine "
                    "cores (benchmarks/hops/engine_site) into DIR and split each pull of ours into hops")
    ap.add_argument("--ttft-log", default=None, help="append each timed request's send and first-token "
                    "CLOCK_MONOTONIC ns, its pull id and its arm here (benchmarks/hops/pulls.py; --hops sets it)")
    ap.add_argument("--log-dir", default=None, help="engine logs (default: a temp dir, kept on failure only)")
    a = ap.parse_args(argv)
    if a.replot:
        a.plot = a.plot if a.plot is not None else os.path.splitext(a.replot)[0] + ".png"
        return a
    if a.scenario is None:
        a.scenario = "two_hosts" if a.hosts == Hosts.TWO.value else ""
    a.json = a.json or results.default_path(BENCHMARK, a.scenario)
    a.plot = a.plot if a.plot is not None else os.path.splitext(a.json)[0] + ".png"
    if a.hops:
        a.ttft_log = os.path.join(a.hops, "ttft.txt")
    longest = (a.max_model_len - TAIL - ANSWER_TOKENS) // a.block_size
    a.chunk_list = ([int(x) for x in a.chunks.split(",") if x.strip()] if a.chunks else
                    sorted({1 << k for k in range(16) if 1 << k <= longest} | {longest}))
    too_long = [k for k in a.chunk_list if k > longest]
    if too_long:
        ap.error(f"--chunks {too_long}: longer than --max-model-len {a.max_model_len} takes ({longest} blocks)")
    return a


def check_intree_nixl(python: str) -> str | None:
    """vLLM's in-tree tier imports NIXL as ``nixl._api`` (the ``nixl`` meta package) and, without it, starts anyway
    and misses every fetch: asked in the engines' interpreter, with their environment.  None when it imports."""
    p = subprocess.run([python, "-c", "import nixl._api"], capture_output=True, text=True, timeout=120)
    if p.returncode == 0:
        return None
    return (f"the in-tree tier needs NIXL's meta package (`import nixl._api` fails in {python}: "
            f"{p.stderr.strip().splitlines()[-1] if p.stderr.strip() else p.returncode}); scripts/setup.sh --bench "
            f"installs it, or: {python} -m pip install --no-deps 'nixl==V' with V the version of the nixl-cu13 there")


def _ensure_model(a: argparse.Namespace) -> str | None:
    """Point ``a.model`` at the tiny model (built if needed, positions up to --max-model-len); the temp dir to
    remove, if one was made."""
    if a.model and os.path.exists(os.path.join(a.model, "config.json")):
        return None
    made = None
    if not a.model:
        made = a.model = tempfile.mkdtemp(prefix="p2pw-pvr-model.")
    from tests.helpers.tiny_model import build

    build(a.model, seed=0, max_position_embeddings=max(2048, a.max_model_len))
    return made


def _trace_into(trace_dir: str) -> None:
    """--hops: every process started from here on traces into ``trace_dir`` (benchmarks/hops/README.md): our
    workers through their test hook, the engine cores through engine_site's sitecustomize."""
    os.makedirs(trace_dir, exist_ok=True)
    for stale in glob.glob(os.path.join(trace_dir, "*.txt")):
        os.unlink(stale)  # rows of an earlier run would be aligned with this one's
    os.environ.update(HOPTRACE_DIR=os.path.abspath(trace_dir), P2PWORKER_HOOK="benchmarks.hops.trace_hook:install",
                      PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "benchmarks", "hops", "engine_site"), ROOT,
                                                  *filter(None, [os.environ.get("PYTHONPATH")])]))


def _interrupted(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")  # `timeout` sends SIGTERM: unwind, so every engine is stopped


def _finish(a: argparse.Namespace, run: results.Run, report: dict, cells: list[Cell]) -> int:
    summary = summarize(cells)
    report.update(summary=summary, cells=[c.to_json() for c in cells], loadavg_after=engines.loadavg())
    failed = [c.to_json() for c in cells if c.problem]
    # files a stop leaves (the in-tree tier's engines are always force-killed and leak their CPU tier's file; vLLM
    # leaves its ipc sockets) are removed and only reported; a process left behind is a failure
    unclean = {f"{t}/{n}": s for t, r in report.get("tiers", {}).items() for n, s in r.get("stop", {}).items()
               if s["left_processes"]}
    unclean.update({f"{t}/namespaces": r["left_namespaces"] for t, r in report.get("tiers", {}).items()
                    if r.get("left_namespaces")})
    report.update(failed=failed, unclean_stops=unclean)
    print()
    print(table(summary))
    print(f"load average before {report['loadavg_before']}, after {report['loadavg_after']}")
    if a.plot:
        why = plot(summary, a.plot, f"TTFT: pull vs recompute ({a.reps} reps, block {a.block_size})")
        print(f"plot: {a.plot}" if why is None else f"plot: {why}")
    if a.hops:
        report["hops"] = hop_pulls.medians(a.hops)
        hop_pulls.main([a.hops])
    print(f"results: {run.save(a.json, report)}")
    print(json.dumps({k: v for k, v in report.items() if k != "cells"}))
    for f in failed:
        print(f"FAILED cell: {f}", file=sys.stderr)
    if unclean:
        print(f"NOT CLEAN: {unclean}", file=sys.stderr)
    return 1 if failed or unclean or report.get("error") else 0


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.replot:  # the table again, and the plot unless --plot ''
        doc = results.load(a.replot, BENCHMARK)
        print(f"{doc['date']}, {doc['revision']}, vLLM {doc['vllm']}")
        print(table(doc["result"]["summary"]))
        why = plot(doc["result"]["summary"], a.plot, "TTFT: pull vs recompute") if a.plot else None
        print(why or (f"plot: {a.plot}" if a.plot else ""))
        return 1 if why else 0
    run = results.Run(BENCHMARK, a.scenario,
                      python=os.path.join(a.venv, "bin", "python"))
    if a.hops:
        _trace_into(a.hops)
    tiers = [Tier(t) for t in a.tiers.split(",")]
    if Tier.INTREE in tiers and (why := check_intree_nixl(os.path.join(a.venv, "bin", "python"))):
        sys.exit(f"pull_vs_recompute: {why}")
    signal.signal(signal.SIGTERM, _interrupted)
    model_tmp = _ensure_model(a)
    log_dir = a.log_dir or tempfile.mkdtemp(prefix="p2pw-pvr-logs.")
    os.makedirs(log_dir, exist_ok=True)
    report: dict = {"config": {k: v for k, v in vars(a).items() if k not in ("replot",)},
                    "loadavg_before": engines.loadavg(), "cores": os.cpu_count(), "autogroup": engines.autogroup()}
    if report["autogroup"]:
        print(f"pull_vs_recompute: {engines.AUTOGROUP} is 1: on a host with few cores the engines' and workers' "
              f"processes wait for a core 50 ms to seconds at a time, and the pulls' figures measure that "
              f"(benchmarks/README.md, 'Pull or recompute')", file=sys.stderr)
    cells: list[Cell] = []
    try:
        for tier in tiers:  # one pair at a time: two would share two cores
            cells += run_tier(tier, a, log_dir, report)
    except (RuntimeError, KeyboardInterrupt, OSError) as e:
        report["error"] = repr(e)
        print(f"pull_vs_recompute: stopped: {e!r}; engine logs in {log_dir}", file=sys.stderr)
    finally:
        if model_tmp:
            shutil.rmtree(model_tmp, ignore_errors=True)
    rc = _finish(a, run, report, cells)
    if rc == 0 and not a.log_dir:
        shutil.rmtree(log_dir, ignore_errors=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
