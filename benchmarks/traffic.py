"""Multi-turn chat traffic on real `vllm serve` engines: TTFT percentiles, inter-token latency, throughput, where the
prompt tokens came from and the engines' CPU, per arm and request rate; the rate each arm sustains within a TTFT
target, and its goodput there.

    .venv-vllmcpu034/bin/python benchmarks/traffic.py --venv .venv-vllmcpu034 [--arms ours,intree,none]
        [--rates 1,2,4] [--conversations 16] [--turns 4] [--think-s 1] [--cpu-mib 64] [--shape p2p|pd]
        [--autogroup off] [--scenario NAME] [--json F] [--plot F.png]
    .venv/bin/python benchmarks/traffic.py --replot benchmarks/results/traffic.json

The results file (p2pworker/bench/results.py) is ``benchmarks/results/traffic[-SCENARIO].json`` by default (the scenario
defaults to the shape when it is not p2p), the plot beside it.

The workload (benchmarks/traffic_plan.py): N conversations of T turns, arriving as a Poisson process at rate / T
conversations per second, each turn after an exponential think time, every history replayed from the seed (so every
arm gets the same prompts at a rate, and each rate fresh ones), a few system prompts shared between conversations.

Shapes.  ``p2p`` (llm-d's P2P guide): two engines, each turn on the other engine than the last, with
``kv_transfer_params.remote_kv_source`` naming the last turn's engine, whose CPU tier holds that turn's prompt.
``pd``: one prefill and one decode engine behind `p2pworker router` (PD mode), each turn after the first with
``x-kv-cache-source-host-port`` naming the decode's worker (ours only; the none arm there is the router in aggregated
mode over both engines, turns alternating).

Arms (one pair of engines at a time, the same CPU offloading spec and CPU tier each): ``ours`` (P2PWorkerTier),
``intree`` (vLLM's p2p tier; needs scripts/setup.sh --bench), ``none`` (no secondary tier, no transfer params: the
other engine recomputes what its own caches do not hold).  Per rate, around the run: each engine's
``vllm:prompt_tokens_total`` and ``vllm:prompt_tokens_cached_by_source_total{source}`` (pulled = p2p, local =
device + host, recomputed = the rest), our tier's load outcomes, and the CPU time of each engine's processes (our
workers apart).  After the run, every k-th turn's answer is asked again of the engine that served it with a
``cache_salt`` (a plain engine: no cache answers it) and must be the same.  The TTFT target is ``--target-factor`` ×
the none arm's p90 TTFT at the lowest rate.  An arm *sustains* the highest swept rate whose p90 stays under it (and
every lower one's too); its *goodput* at a rate is the requests per second whose own TTFT met the target (the
DistServe definition, as `vllm bench serve --goodput ttft:MS` and inference-perf's ``request_goodput`` count it).

Exit status 1 when a request failed, an answer differed, or a stop of ours or none was not clean (a SIGKILL, a
process or file left, an ERROR or Traceback line in an engine's log).  vLLM's in-tree tier never lets its engines
idle, so their stop is always a SIGKILL after --shutdown-timeout: reported, not counted.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import asdict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from benchmarks import engines  # noqa: E402
from p2pworker.bench import results  # noqa: E402
from benchmarks.traffic_load import Endpoint, Fleet, run_rate  # noqa: E402
from benchmarks.traffic_plan import (Arm, RatePoint, Shape, Span, Sustained, Workload, request_goodput,  # noqa: E402
                                     sustained, ttft_target_ms, verdict)
from tests.helpers.ports import free_ports  # noqa: E402

PERCENTILES = ("p50", "p90", "p99")
BENCHMARK = "traffic"


# ---------------------------------------------------------------------------------------------------- engines
class Pair:
    """Two engines (and for the PD shape the router) for one arm; stopped with every check of a clean stop."""

    def __init__(self, arm: Arm, a: argparse.Namespace, log_dir: str):
        self.arm, self.a, self.log_dir = arm, a, log_dir
        secret = uuid.uuid4().hex + uuid.uuid4().hex
        https, p2ps = free_ports(2), free_ports(2)
        py = os.path.join(a.venv, "bin", "python")
        self.engines: list[engines.Engine] = []
        self.router = None
        try:
            for i, role in enumerate(("prefill", "decode")):
                tiers = {Arm.OURS: [engines.ours_tier(p2ps[i], role)], Arm.INTREE: [engines.intree_tier(p2ps[i])],
                         Arm.NONE: []}[arm]
                kv = engines.kv_transfer_config(engines.new_engine_id(f"traffic-{arm.value}-{i}"), tiers,
                                                a.cpu_mib << 20)
                self.engines.append(engines.Engine(f"{arm.value}-{i}", python=py, model=a.model, kv=kv,
                                                   http=https[i], bind=str(i), log_dir=log_dir, secret=secret,
                                                   max_model_len=a.max_model_len, args=("--block-size", "128")))
            self.p2p = p2ps
            if Shape(a.shape) is Shape.PD:
                self.router = Router(a, log_dir, self.engines, p2ps, aggregated=arm is Arm.NONE)
        except BaseException:
            self.stop()
            raise

    def up(self) -> None:
        for e in self.engines:
            e.wait_healthy(self.a.health_timeout_s)
        if self.router:
            self.router.wait_ready(self.a.health_timeout_s)

    def fleet(self) -> Fleet:
        eps = [Endpoint(e.url(), "127.0.0.1", self.p2p[i] if self.arm.shares else None, e.pid)
               for i, e in enumerate(self.engines)]
        if self.router:
            return Fleet(eps, self.arm, router=self.router.url, decode_worker=f"127.0.0.1:{self.p2p[1]}")
        return Fleet(eps, self.arm)

    def stop(self) -> dict:
        out: dict = {}
        if self.router:
            out["router"] = self.router.stop()
        for e in self.engines:
            offset = os.path.getsize(e.log_path) if os.path.exists(e.log_path) else 0
            try:
                s = e.stop(self.a.stop_timeout_s)
            except Exception as err:  # noqa: BLE001 - an unclean stop, reported; never hides the other engine
                s = {"error": repr(err), "left_processes": ["unknown: the stop raised"], "sigkill": True}
            logged, at_stop = engines.log_errors(e.log_path), engines.log_errors(e.log_path, offset)
            s.update(error_lines=logged.errors, error_lines_at_stop=at_stop.errors,
                     vllm_shutdown_race=at_stop.shutdown_race)
            out[e.name] = s
        return out


class Router:
    """`p2pworker router` over the pair: PD (engine 0 prefills, engine 1 decodes) or aggregated over both."""

    def __init__(self, a: argparse.Namespace, log_dir: str, eng: list[engines.Engine], p2p: list[int],
                 aggregated: bool):
        (port,) = free_ports(1)
        self.url = f"http://127.0.0.1:{port}"
        argv = [os.path.join(a.venv, "bin", "p2pworker"), "router", "--host", "127.0.0.1", "--port", str(port)]
        if aggregated:
            argv += ["--mode", "aggregated", "--decode", eng[0].url(), "--decode", eng[1].url()]
        else:
            argv += ["--prefill", f"{eng[0].url()},worker=127.0.0.1:{p2p[0]}", "--decode", eng[1].url()]
        self.log = open(os.path.join(log_dir, "router.log"), "wb")
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True)

    def wait_ready(self, timeout_s: float) -> None:
        import urllib.request

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    h = json.loads(r.read())
                    if all(i["state"] == "up" for i in h.get("prefill", []) + h.get("decode", [])):
                        return
            except OSError:
                pass
            time.sleep(1)
        raise RuntimeError(f"the router has not every instance up within {timeout_s} s")

    def stop(self) -> dict:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(20)
            killed = False
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
            killed = True
        self.log.close()
        return {"rc": self.proc.returncode, "sigkill": killed, "left_processes": []}


def unclean(arm: Arm, stop: dict) -> dict:
    """What of a stop is not clean; the in-tree tier's engines are always SIGKILLed (its tier never idles), so only
    processes left count for it.  vLLM's own shutdown race (engines.VLLM_SHUTDOWN_RACE) is reported, not counted."""
    out = {}
    for name, s in stop.items():
        why = []
        if s.get("left_processes"):
            why.append(f"left {s['left_processes']}")
        if arm is not Arm.INTREE:
            if s.get("sigkill"):
                why.append("SIGKILL")
            if s.get("error_lines"):
                why.append(f"log: {s['error_lines'][:3]}")
        if why:
            out[name] = why
    return out


# ---------------------------------------------------------------------------------------------------- the run
def run_arm(arm: Arm, a: argparse.Namespace, w: Workload, log_dir: str, report: dict) -> None:
    out = report["arms"].setdefault(arm.value, {"rates": {}})
    pair = Pair(arm, a, log_dir)
    try:
        pair.up()
        out["startup_s"] = [e.startup_s for e in pair.engines]
        fleet = pair.fleet()
        fleet.warm(w, salt=990_000 + list(Arm).index(arm))
        for k, rate in enumerate(a.rate_list):
            res = run_rate(fleet, w, rate, salt=a.seed * 1000 + k, timeout_s=a.timeout_s,
                           deadline_s=a.deadline_s, tol=a.logprob_tol)
            out["rates"][str(rate)] = res
            s = res["client"]
            print(f"{arm.value:<6} {rate:5.2f} req/s  TTFT p50/p90/p99 {s['ttft_ms']['p50']}/{s['ttft_ms']['p90']}/"
                  f"{s['ttft_ms']['p99']} ms  ITL p50 {s['itl_ms']['p50']} ms  {s['output_tokens_per_s']} tok/s  "
                  f"pulled {res['tokens']['pulled_share']:.0%} local {res['tokens']['local_share']:.0%}  "
                  f"failed {s['failed']}  answers differ {len(res['answer_problems'])}", flush=True)
    finally:
        out["stop"] = pair.stop()
        out["unclean_stop"] = unclean(arm, out["stop"])
        out["loadavg_after"] = engines.loadavg()


def points(report: dict, arm: str) -> list[RatePoint]:
    pts = []
    for rate, r in report["arms"].get(arm, {}).get("rates", {}).items():
        c = r["client"]
        bad = c["failed"] > 0
        pts.append(RatePoint(float(rate), None if bad else c["ttft_ms"]["p90"], None if bad else c["ttft_ms"]["p99"]))
    return sorted(pts, key=lambda p: p.rate_rps)


def judge(report: dict, factor: float) -> dict:
    """The TTFT target, then per arm the highest rate it sustains within it and, per rate, its goodput (requests
    per second that met the target, as `vllm bench serve --goodput` and inference-perf count it)."""
    pts = {arm: points(report, arm) for arm in report["arms"]}
    target = ttft_target_ms(pts.get(Arm.NONE.value, []), factor)
    if target is None:
        return {"ttft_target_ms": None, "why": "no none arm with a figure at the lowest rate"}
    rates: dict[str, Sustained] = {arm: sustained(p, target) for arm, p in pts.items()}
    good = {arm: {rate: request_goodput(x["client"].get("ttft_ms_sorted", []), target, x["client"]["wall_s"])
                  for rate, x in r["rates"].items() if "wall_s" in x["client"]}
            for arm, r in report["arms"].items()}
    return {"ttft_target_ms": target, "target_rule": f"{factor} x the none arm's p90 TTFT at its lowest rate",
            "sustained": {arm: g.to_json() for arm, g in rates.items()}, "request_goodput_rps": good,
            **verdict(rates, pts)}


def table(report: dict) -> str:
    """One row per arm and offered rate, in the terms of llm-d's and inference-perf's reports (offered and achieved
    rate, OK/fail, TTFT and ITL percentiles, request latency, goodput at the TTFT target)."""
    good = report.get("judgement", {}).get("request_goodput_rps", {})
    head = ["arm", "offered/s", "achieved/s", "OK/fail", "TTFT p50", "p90", "p99", "ITL p50", "p99", "latency p50",
            "p90", "out tok/s", "goodput/s", "pulled", "local", "recomp", "eng CPU s", "worker CPU s"]
    rows = [head]
    for arm, r in report["arms"].items():
        for rate, x in r["rates"].items():
            c, t, cpu = x["client"], x["tokens"], x["cpu"]
            lat = c.get("latency_ms", {})
            g = good.get(arm, {}).get(rate)
            rows.append([arm, rate, str(c["requests_per_s"]), f"{c['requests'] - c['failed']}/{c['failed']}",
                         *(str(c["ttft_ms"][p]) for p in PERCENTILES), str(c["itl_ms"]["p50"]),
                         str(c["itl_ms"]["p99"]), str(lat.get("p50", "-")), str(lat.get("p90", "-")),
                         str(c["output_tokens_per_s"]), "-" if g is None else str(g),
                         f"{t['pulled_share']:.0%}", f"{t['local_share']:.0%}", f"{t['recomputed_share']:.0%}",
                         str(cpu["engines_s"]), str(cpu["workers_s"])])
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    return "\n".join("  ".join(c.rjust(wd) for c, wd in zip(r, widths)) for r in rows)


def plot(report: dict, path: str) -> str | None:
    """TTFT p50/p90/p99 by request rate, one colour per arm, one line style per percentile, the target dashed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no plot (scripts/setup.sh --bench installs it)"
    fig, ax = plt.subplots(figsize=(8, 5))
    styles = {"p50": ":", "p90": "-", "p99": "--"}
    swept: set[float] = set()
    for i, (arm, r) in enumerate(report["arms"].items()):
        rates = sorted(r["rates"], key=float)
        swept.update(float(x) for x in rates)
        for p, ls in styles.items():
            ys = [r["rates"][x]["client"]["ttft_ms"][p] for x in rates]
            ax.plot([float(x) for x in rates], ys, ls, color=f"C{i}", marker="o", label=f"{arm} {p}")
    target = report.get("judgement", {}).get("ttft_target_ms")
    if target:
        ax.axhline(target, color="grey", lw=1, ls="-.", label=f"target {target} ms (p90)")
    ax.set_yscale("log")
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted(swept), [f"{x:g}" for x in sorted(swept)])
    ax.minorticks_off()
    ax.set_xlabel("offered request rate, requests/s (Poisson conversation arrivals)")
    ax.set_ylabel("time to first token, ms")
    cfg = report["config"]
    ax.set_title(f"multi-turn chat, {cfg['shape']}: {cfg['conversations']} conversations x {cfg['turns']} turns")
    ax.grid(True, alpha=0.3, which="both")
    ax.legend(fontsize=7, ncol=3)
    engines.save_plot(fig, path)
    return None


# ---------------------------------------------------------------------------------------------------- main
def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arms", default="ours,intree,none")
    ap.add_argument("--shape", default=Shape.P2P.value, choices=[s.value for s in Shape])
    ap.add_argument("--rates", default="1,2,4", help="offered request rates, requests/s")
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--system-prompts", type=int, default=2)
    ap.add_argument("--system-tokens", type=int, default=256)
    ap.add_argument("--user-tokens", default="150-300")
    ap.add_argument("--answer-tokens", default="40-100")
    ap.add_argument("--output-tokens", type=int, default=16)
    ap.add_argument("--think-s", type=float, default=1.0)
    ap.add_argument("--check-every", type=int, default=4, help="every k-th turn's answer is checked")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--target-factor", type=float, default=2.0, help="TTFT target: this x none's p90 at low load")
    ap.add_argument("--cpu-mib", type=int, default=64, help="each engine's CPU tier (small: eviction)")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--logprob-tol", type=float, default=1e-4)
    ap.add_argument("--timeout-s", type=float, default=120.0, help="every request")
    ap.add_argument("--deadline-s", type=float, default=300.0, help="one rate's run: turns not sent by then fail")
    ap.add_argument("--autogroup", default="keep", choices=["keep", "off"],
                    help="off: kernel.sched_autogroup_enabled = 0 for the run, restored after (root)")
    ap.add_argument("--model", default=None)
    ap.add_argument("--venv", default=sys.prefix)
    ap.add_argument("--health-timeout-s", type=float, default=300.0)
    ap.add_argument("--stop-timeout-s", type=float, default=40.0)
    ap.add_argument("--scenario", default=None, help="names the results file (default: the shape, none for p2p)")
    ap.add_argument("--json", default=None, help="the results file (default: benchmarks/results/traffic"
                    "[-SCENARIO].json)")
    ap.add_argument("--plot", default=None, help="default: the results file with .png ('' for none)")
    ap.add_argument("--replot", default=None, help="draw --plot from this results file; start nothing")
    ap.add_argument("--log-dir", default=None)
    a = ap.parse_args(argv)
    a.rate_list = [float(x) for x in a.rates.split(",") if x.strip()]
    if a.scenario is None:
        a.scenario = "" if a.shape == "p2p" else a.shape
    a.json = a.json or results.default_path(BENCHMARK, a.scenario)
    return a


def workload(a: argparse.Namespace) -> Workload:
    w = Workload(conversations=a.conversations, turns=a.turns, system_prompts=a.system_prompts,
                 system_tokens=a.system_tokens, user_tokens=Span.parse(a.user_tokens),
                 answer_tokens=Span.parse(a.answer_tokens), output_tokens=a.output_tokens, think_s=a.think_s,
                 check_every=a.check_every, seed=a.seed)
    if w.longest_prompt() + w.output_tokens > a.max_model_len:
        sys.exit(f"traffic: the longest prompt ({w.longest_prompt()}) + output exceeds --max-model-len")
    return w


def _interrupted(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def _set_autogroup(value: str) -> None:
    with open(engines.AUTOGROUP, "w") as f:
        f.write(value)


def _finish(a: argparse.Namespace, run: results.Run, report: dict) -> int:
    report["judgement"] = judge(report, a.target_factor)
    failed = {f"{arm}@{rate}": r["client"]["failed"] for arm, x in report["arms"].items()
              for rate, r in x["rates"].items() if r["client"]["failed"]}
    differ = {f"{arm}@{rate}": r["answer_problems"] for arm, x in report["arms"].items()
              for rate, r in x["rates"].items() if r["answer_problems"]}
    stops = {arm: x["unclean_stop"] for arm, x in report["arms"].items() if x.get("unclean_stop")}
    report.update(failed=failed, answers_differ=differ, unclean_stops=stops, loadavg_after=engines.loadavg())
    print()
    print(table(report))
    print(json.dumps(report["judgement"]))
    path = a.plot if a.plot is not None else os.path.splitext(a.json)[0] + ".png"
    if path:
        why = plot(report, path)
        print(f"plot: {path}" if why is None else f"plot: {why}")
    print(f"results: {run.save(a.json, report)}")
    for what, x in (("FAILED requests", failed), ("ANSWERS DIFFER", differ), ("NOT CLEAN", stops)):
        if x:
            print(f"{what}: {x}", file=sys.stderr)
    return 1 if failed or differ or stops or report.get("error") else 0


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.replot:  # the table again, and the plot unless --plot ''
        doc = results.load(a.replot, BENCHMARK)
        print(f"{doc['date']}, {doc['revision']}, vLLM {doc['vllm']}")
        print(table(doc["result"]))
        path = a.plot if a.plot is not None else os.path.splitext(a.replot)[0] + ".png"
        why = plot(doc["result"], path) if path else None
        print(why or (f"plot: {path}" if path else ""))
        return 1 if why else 0
    run = results.Run(BENCHMARK, a.scenario, python=os.path.join(a.venv, "bin", "python"))
    w = workload(a)
    arms = [Arm(x) for x in a.arms.split(",")]
    if Arm.INTREE in arms:
        from benchmarks.pull_vs_recompute import check_intree_nixl

        if why := check_intree_nixl(os.path.join(a.venv, "bin", "python")):
            sys.exit(f"traffic: {why}")
    signal.signal(signal.SIGTERM, _interrupted)
    model_tmp = None
    if not a.model:
        from tests.helpers.tiny_model import build

        model_tmp = a.model = tempfile.mkdtemp(prefix="p2pw-traffic-model.")
        build(a.model, seed=0, max_position_embeddings=max(2048, a.max_model_len))
    log_dir = a.log_dir or tempfile.mkdtemp(prefix="p2pw-traffic-logs.")
    os.makedirs(log_dir, exist_ok=True)
    report: dict = {"config": {**{k: v for k, v in vars(a).items() if k != "replot"}, "workload": asdict(w)},
                    "date": time.strftime("%Y-%m-%d %H:%M"), "cores": os.cpu_count(),
                    "loadavg_before": engines.loadavg(), "arms": {}}
    restore = None
    try:
        if a.autogroup == "off" and engines.autogroup():
            _set_autogroup("0")
            restore = "1"
        report["autogroup"] = engines.autogroup()
        for arm in arms:  # one pair at a time: two would share two cores
            run_arm(arm, a, w, log_dir, report)
    except (RuntimeError, KeyboardInterrupt, OSError) as e:
        report["error"] = repr(e)
        print(f"traffic: stopped: {e!r}; engine logs in {log_dir}", file=sys.stderr)
    finally:
        if restore:
            _set_autogroup(restore)
        if model_tmp:
            shutil.rmtree(model_tmp, ignore_errors=True)
    rc = _finish(a, run, report)
    print(f"engine logs: {log_dir}" if rc or a.log_dir else "")
    if rc == 0 and not a.log_dir:
        shutil.rmtree(log_dir, ignore_errors=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
