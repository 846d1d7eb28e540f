"""CPU of an IDLE `vllm serve` engine with the P2P tier versus the same engine without it, side by side.

    .venv-vllmcpu034/bin/python benchmarks/idle_cpu.py --venv .venv-vllmcpu034 [--seconds 30] [--rounds 3]
        [--mode together|sequential] [--model DIR] [--wait-others-s 1200] [--json F]

Checks the claim "idle CPU of an engine with the tier stays < 2 % of a core above vLLM's own".

Two engines, as scripts/pd.sh starts them (vLLM's CPU backend, the tiny test model of tests/helpers/tiny_model.py,
``--enforce-eager --dtype float32 --max-model-len 2048 --max-num-seqs 8 --shutdown-timeout 10``,
VLLM_CPU_KVCACHE_SPACE=1, HTTP on 127.0.0.1):

* ``tier``: OffloadingConnector + vllm_adapter.cpu_spec.CPUTieringOffloadingSpec (64 MiB) with the P2PWorkerTier
  secondary tier (configs/prefill.toml): the engine core runs the IdleWaker thread and spawns a p2pworker.
* ``no_tier``: the same connector and spec with ``secondary_tiers: []``.

Each engine, once /health answers 200, serves one small completion, then sits idle ``--settle`` s.  Then the CPU
time (utime + stime of /proc/<pid>/stat) of every process of its tree (API server, EngineCore, their children: for
``tier`` the p2pworker) is sampled over ``--seconds`` s windows: % of one core per process and in total.
``--mode together`` (default): both engines run at once (OMP threads bound to core 0 / core 1, as the e2e tests
do); each round samples one engine's window then the other's (order alternates by round), so the two share the
box but each window sees the same neighbour (the other engine, idle).  ``--mode sequential``: one engine at a time
(both on core 0), all rounds of one, then the other.

The IdleWaker's wake count lives in the engine core's memory only (engine_hook.IdleWaker.wakes): not readable
from outside.  As a proxy the tier's worker's admin socket is asked, after the windows, for its event ring's depth
(unread events are what the waker wakes the engine for; heartbeats it skips) and counters.

Prints a table (median, min, max over rounds), then one JSON line; the results file (p2pworker/bench/results.py) is
``benchmarks/results/idle_cpu.json`` by default.  Stops every engine with SIGTERM (then SIGKILL
of its process group past --stop-timeout-s) and reports anything of ours left: processes, /dev/shm files, admin
sockets, ipc dirs.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from benchmarks import engines  # noqa: E402
from p2pworker.bench import results as results_file  # noqa: E402
from benchmarks.engines import loadavg, proc_stat, tree  # noqa: E402
from tests.helpers.ports import free_ports  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")
CONFIGS = ("tier", "no_tier")


# ---------------------------------------------------------------------------------------------------- /proc
def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def label(pid: int, root: int) -> str:
    if pid == root:
        return "api_server"
    cmd, st = _cmdline(pid), proc_stat(f"/proc/{pid}")
    comm = st[2] if st else "?"
    if "p2pworker.cli launch" in cmd or "p2pworker launch" in cmd:
        return "p2pworker"
    if "EngineCore" in comm or "EngineCore" in cmd:
        return "engine_core"
    if "resource_tracker" in cmd:
        return "resource_tracker"
    return comm or "?"


def _ctxt(path: str) -> int:
    try:
        with open(path + "/status") as f:
            return sum(int(line.split()[1]) for line in f if "ctxt_switches" in line)
    except OSError:
        return 0


def snapshot(pids: list[int]) -> dict:
    """Per pid: process ticks, per-thread ticks and comm, context switches (summed over its threads)."""
    out = {}
    for pid in pids:
        st = proc_stat(f"/proc/{pid}")
        if st is None:
            continue
        threads, ctxt = {}, 0
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            tids = []
        for tid in tids:
            tst = proc_stat(f"/proc/{pid}/task/{tid}")
            if tst:
                threads[int(tid)] = (tst[1], tst[2])
            ctxt += _ctxt(f"/proc/{pid}/task/{tid}")
        out[pid] = {"ticks": st[1], "threads": threads, "ctxt": ctxt}
    return out


def system_busy() -> tuple[int, int]:
    """(busy, total) jiffies of the whole box (/proc/stat)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    idle = v[3] + v[4]  # idle + iowait
    return sum(v[:8]) - idle, sum(v[:8])


def other_vllm(ours: set[int]) -> list[int]:
    r = subprocess.run(["pgrep", "-f", "vllm.entrypoints"], capture_output=True, text=True)
    me = os.getpid()
    return [int(p) for p in r.stdout.split() if int(p) not in ours and int(p) != me]


# ---------------------------------------------------------------------------------------------------- engines
class Engine(engines.Engine):
    """``tier`` or ``no_tier`` (module docstring), launched by benchmarks/engines.py."""

    def __init__(self, name: str, args, model: str, bind: str, log_dir: str, secret: str):
        http, self.p2p = free_ports(2)
        tiers = [engines.ours_tier(self.p2p)] if name == "tier" else []
        kv = engines.kv_transfer_config(engines.new_engine_id(f"idle-{name.replace('_', '')}"), tiers)
        super().__init__(name, python=os.path.join(args.venv, "bin", "python"), model=model, kv=kv, http=http,
                         bind=bind, log_dir=log_dir, secret=secret)
        self.args = args

    def worker_status(self) -> list[dict]:
        """The tier's worker(s), from its admin socket: event ring depth and counters (cheap: one REQ/REP)."""
        out = []
        for path in self.admins():
            try:
                from p2pworker.admin import query

                st = query(path, timeout_s=3.0)
                out.append({"admin": os.path.basename(path), "ring_depth": st.get("ring_depth"),
                            "counters": st.get("counters"), "control": st.get("control"),
                            "state": st.get("state"), "uptime_s": st.get("uptime_s")})
            except Exception as e:  # noqa: BLE001 - a proxy only
                out.append({"admin": os.path.basename(path), "error": repr(e)})
        return out


# ---------------------------------------------------------------------------------------------------- measuring
def all_ticks() -> dict[int, tuple[int, str]]:
    out = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            st = proc_stat(f"/proc/{d}")
            if st:
                out[int(d)] = (st[1], st[2])
    return out


def window(eng: Engine, seconds: float, ours: set[int]) -> dict:
    """One sampling window of eng's tree; also the busiest processes outside ``ours`` (both engines' trees)."""
    pids = tree(eng.pid)
    labels = {p: label(p, eng.pid) for p in pids}
    sys0, t0 = system_busy(), time.monotonic()
    everyone0 = all_ticks()
    a = snapshot(pids)
    time.sleep(seconds)
    b = snapshot(tree(eng.pid))
    everyone1 = all_ticks()
    t1, sys1 = time.monotonic(), system_busy()
    dt = t1 - t0
    procs, threads = {}, []
    for pid, s0 in a.items():
        s1 = b.get(pid)
        if s1 is None:
            continue
        name = labels[pid]
        while name in procs:
            name += "'"
        procs[name] = {"pid": pid, "pct": 100.0 * (s1["ticks"] - s0["ticks"]) / TICK / dt,
                       "ctxt_per_s": (s1["ctxt"] - s0["ctxt"]) / dt, "threads": len(s1["threads"])}
        for tid, (ticks1, comm) in s1["threads"].items():
            ticks0 = s0["threads"].get(tid, (ticks1, comm))[0]
            if ticks1 > ticks0:
                threads.append({"proc": name, "tid": tid, "comm": comm,
                                "pct": round(100.0 * (ticks1 - ticks0) / TICK / dt, 2)})
    new = sorted(set(b) - set(a))
    gone = sorted(set(a) - set(b))
    total = sum(p["pct"] for p in procs.values())
    sys_pct = 100.0 * (sys1[0] - sys0[0]) / TICK / dt  # % of one core, whole box
    threads.sort(key=lambda t: -t["pct"])
    others = []
    for pid, (ticks1, comm) in everyone1.items():
        if pid in ours or pid == os.getpid():
            continue
        ticks0 = everyone0.get(pid, (0, comm))[0]  # a process born in the window: all its time
        pct = 100.0 * (ticks1 - ticks0) / TICK / dt
        if pct >= 1.0:
            others.append({"pid": pid, "comm": comm, "cmd": _cmdline(pid)[:80], "pct": round(pct, 1)})
    others.sort(key=lambda o: -o["pct"])
    return {"seconds": round(dt, 2), "procs": procs, "total": total, "box_pct": sys_pct, "new_pids": new,
            "gone_pids": gone, "top_threads": threads[:8], "loadavg": loadavg(), "others": others[:5],
            "tree": [{"pid": p, "ppid": (proc_stat(f"/proc/{p}") or (0,))[0], "label": labels[p],
                      "cmd": _cmdline(p)[:100]} for p in pids]}


def fmt(vals: list[float]) -> str:
    if not vals:
        return "-"
    return f"{statistics.median(vals):6.2f} [{min(vals):5.2f}..{max(vals):5.2f}]"


def _args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=30.0, help="length of one sampling window")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--settle", type=float, default=5.0, help="idle time after the completion before sampling")
    ap.add_argument("--mode", choices=("together", "sequential"), default="together")
    ap.add_argument("--model", default=None, help="tiny model dir (default: built into a temp dir, removed)")
    ap.add_argument("--venv", default=os.path.join(ROOT, ".venv-vllmcpu032"))
    ap.add_argument("--wait-others-s", type=float, default=1200.0,
                    help="wait this long for other vllm.entrypoints processes to end before starting ours")
    ap.add_argument("--poll-others-s", type=float, default=20.0)
    ap.add_argument("--health-timeout-s", type=float, default=300.0)
    ap.add_argument("--stop-timeout-s", type=float, default=60.0)
    ap.add_argument("--log-dir", default=None, help="engine logs (default: a temp dir, kept on failure only)")
    ap.add_argument("--json", default=None, help="the results file (default: benchmarks/results/idle_cpu.json)")
    ap.add_argument("--replot", default=None, metavar="FILE", help="print this results file's table; start nothing")
    return ap.parse_args()


def _ensure_model(args: argparse.Namespace, py: str) -> str | None:
    """Point ``args.model`` at the tiny model, built if it is not there; returns the temp dir to remove, if any."""
    model_tmp = None
    if args.model is None:
        model_tmp = tempfile.mkdtemp(prefix="p2pw-idle-cpu-model.")
        args.model = model_tmp
    if not os.path.exists(os.path.join(args.model, "config.json")):
        t0 = time.monotonic()
        subprocess.run([py, "-m", "tests.helpers.tiny_model", args.model], cwd=ROOT, check=True,
                       stdout=subprocess.DEVNULL)
        print(f"built the tiny model in {args.model} ({time.monotonic() - t0:.0f} s)", flush=True)
    return model_tmp


def _wait_for_others(args: argparse.Namespace) -> float | None:
    """Seconds waited until no other vllm.entrypoints process runs; None when they still run after
    ``--wait-others-s``."""
    # another engineer's e2e engines: two pairs at once overload a 2-core box
    waited, t0 = 0.0, time.monotonic()
    while True:
        others = other_vllm(set())
        if not others:
            return waited
        waited = time.monotonic() - t0
        if waited >= args.wait_others_s:
            print(f"other vllm.entrypoints processes still running after {waited:.0f} s: {others}; giving up",
                  file=sys.stderr)
            return None
        print(f"waiting: other vllm.entrypoints processes {others} (load {loadavg()})", flush=True)
        time.sleep(args.poll_others_s)


class IdleRun:
    """Both engines of one run, their sampling windows in the order ``--mode`` gives, and their stop."""

    def __init__(self, args: argparse.Namespace, report: dict, log_dir: str):
        self.args, self.report, self.log_dir = args, report, log_dir
        self.secret = secrets.token_hex(32)
        self.binds = {"tier": "0", "no_tier": "1"} if args.mode == "together" else {"tier": "0", "no_tier": "0"}
        self.engines: dict[str, Engine] = {}
        self.results: dict[str, list[dict]] = {c: [] for c in CONFIGS}
        self.order_log: list[str] = []
        self.others_during: set[int] = set()

    def bring_up(self, names) -> None:
        args, engines = self.args, self.engines
        for n in names:
            engines[n] = Engine(n, args, args.model, self.binds[n], self.log_dir, self.secret)
            print(f"started {n}: pid {engines[n].pid}, http {engines[n].http}, engine_id "
                  f"{engines[n].engine_id}", flush=True)
        for n in names:
            engines[n].wait_healthy(args.health_timeout_s)
            text = engines[n].complete()
            print(f"{n}: healthy after {engines[n].startup_s} s; completion {text!r}", flush=True)
        time.sleep(args.settle)

    def measure(self, n: str, r: int) -> None:
        ours = {p for e in self.engines.values() for p in tree(e.pid)}
        self.others_during.update(other_vllm(ours))
        w = window(self.engines[n], self.args.seconds, ours)
        self.results[n].append(w)
        self.order_log.append(f"r{r}:{n}")
        print(f"round {r} {n}: total {w['total']:.2f} % of a core ("
              + ", ".join(f"{k} {v['pct']:.2f}" for k, v in w["procs"].items())
              + f"); box {w['box_pct']:.1f} %; load {w['loadavg']}; others "
              + (", ".join(f"{o['pid']} {o['comm']} {o['pct']}" for o in w["others"]) or "none"), flush=True)

    def rounds(self) -> None:
        args, report, engines = self.args, self.report, self.engines
        if args.mode == "together":
            self.bring_up(list(CONFIGS))
            for r in range(args.rounds):
                for n in (CONFIGS if r % 2 == 0 else CONFIGS[::-1]):
                    self.measure(n, r)
        else:
            for n in CONFIGS:
                self.bring_up([n])
                for r in range(args.rounds):
                    self.measure(n, r)
                if n == "tier":
                    report["worker_status"] = engines[n].worker_status()
                report.setdefault("stop", {})[n] = engines[n].stop(args.stop_timeout_s)
        if "tier" in engines and "worker_status" not in report:
            report["worker_status"] = engines["tier"].worker_status()

    def stop(self) -> None:
        """Stop every engine not stopped yet; what was left of each, into the report."""
        report, engines = self.report, self.engines
        for n, e in engines.items():
            if n not in report.get("stop", {}):
                report.setdefault("stop", {})[n] = e.stop(self.args.stop_timeout_s)
        report["startup_s"] = {n: e.startup_s for n, e in engines.items()}
        report["engine_ids"] = {n: e.engine_id for n, e in engines.items()}
        report["kv_transfer_config"] = {n: e.kv for n, e in engines.items()}
        report["loadavg_after"] = loadavg()
        report["other_vllm_during"] = sorted(self.others_during)
        leftover = [p for e in engines.values() for p in tree(e.pid) if e.proc.returncode is None]
        report["leftover_processes"] = leftover


def _stats(v: list[float]) -> dict:
    return {"median": round(statistics.median(v), 3), "min": round(min(v), 3), "max": round(max(v), 3),
            "rounds": [round(x, 3) for x in v]}


def _print_table(args: argparse.Namespace, rows: dict[str, dict[str, list[float]]], diffs: list[float]) -> None:
    names = sorted({k for c in CONFIGS for k in rows[c]} - {"TOTAL"},
                   key=lambda k: ("api_server", "engine_core", "p2pworker").index(k)
                   if k in ("api_server", "engine_core", "p2pworker") else 9) + ["TOTAL"]
    print()
    print(f"idle CPU, % of one core: median [min..max] over {args.rounds} rounds of {args.seconds:.0f} s "
          f"(mode {args.mode}{': both engines up at once, sharing the box' if args.mode == 'together' else ''})")
    print(f"{'process':<18}{'tier':>26}{'no_tier':>26}")
    for k in names:
        print(f"{k:<18}{fmt(rows['tier'].get(k, [])):>26}{fmt(rows['no_tier'].get(k, [])):>26}")
    print(f"{'tier - no_tier':<18}{fmt(diffs):>26}   (per-round paired difference of TOTAL)")


def _report(args: argparse.Namespace, saving: results_file.Run, report: dict, results: dict[str, list[dict]],
            order_log: list[str]) -> int:
    """The table and the JSON line; 1 when an engine's stop left something behind."""
    rows: dict[str, dict[str, list[float]]] = {c: {} for c in CONFIGS}
    for c in CONFIGS:
        for w in results[c]:
            for name, p in w["procs"].items():
                rows[c].setdefault(name, []).append(p["pct"])
            rows[c].setdefault("TOTAL", []).append(w["total"])
    diffs = [t["total"] - n["total"] for t, n in zip(results["tier"], results["no_tier"])]
    _print_table(args, rows, diffs)
    ctx = {c: {k: statistics.median([w["procs"][k]["ctxt_per_s"] for w in results[c] if k in w["procs"]])
               for k in rows[c] if k != "TOTAL"} for c in CONFIGS if results[c]}
    print("context switches/s (median): " + "; ".join(
        f"{c}: " + ", ".join(f"{k} {v:.0f}" for k, v in d.items()) for c, d in ctx.items()))
    print(f"load average before {report['loadavg_before']}, after {report['loadavg_after']}; other vllm during: "
          f"{report['other_vllm_during'] or 'none'}")
    summary = {
        **report,
        "order": order_log,
        "pct_of_core": {c: {k: _stats(v) for k, v in rows[c].items()} for c in CONFIGS},
        "diff_total": _stats(diffs) if diffs else None,
        "ctxt_per_s": ctx,
        "box_pct_of_core": {c: [round(w["box_pct"], 2) for w in results[c]] for c in CONFIGS},
        "top_threads": {c: [w["top_threads"] for w in results[c]] for c in CONFIGS},
        "others": {c: [w["others"] for w in results[c]] for c in CONFIGS},
        "tree": {c: results[c][0]["tree"] for c in CONFIGS if results[c]},
        "idle_waker_wakes": "not readable from outside (engine_hook.IdleWaker.wakes lives in the engine core)",
        "claim_lt_2pct": (statistics.median(diffs) < 2.0) if diffs else None,
    }
    print(json.dumps(summary))
    print(f"results: {saving.save(args.json, summary)}")
    bad = [n for n, s in report["stop"].items() if s["left_processes"] or s["left_files"] or s["sigkill"]]
    if bad:
        print(f"NOT CLEAN: {bad}: {json.dumps({n: report['stop'][n] for n in bad})}", file=sys.stderr)
    return 1 if bad else 0


def _replot(path: str) -> int:
    doc = results_file.load(path, "idle_cpu")
    r = doc["result"]
    rows = {c: {k: st["rounds"] for k, st in r["pct_of_core"][c].items()} for c in CONFIGS}
    print(f"{doc['date']}, {doc['revision']}, vLLM {doc['vllm']}")
    _print_table(argparse.Namespace(rounds=r["rounds"], seconds=r["seconds"], mode=r["mode"]), rows,
                 r["diff_total"]["rounds"] if r["diff_total"] else [])
    return 0


def main() -> int:
    args = _args()
    if args.replot:
        return _replot(args.replot)
    py = os.path.join(args.venv, "bin", "python")
    saving = results_file.Run("idle_cpu", python=py)
    report: dict = {"mode": args.mode, "seconds": args.seconds, "rounds": args.rounds, "settle_s": args.settle,
                    "cores": os.cpu_count()}
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="p2pw-idle-cpu-logs.")
    os.makedirs(log_dir, exist_ok=True)
    model_tmp = _ensure_model(args, py)
    waited = _wait_for_others(args)
    if waited is None:
        return 2
    report["waited_for_others_s"] = round(waited)
    report["loadavg_before"] = loadavg()
    print(f"load average before: {report['loadavg_before']}", flush=True)

    run = IdleRun(args, report, log_dir)
    ok = False
    try:
        run.rounds()
        ok = True
    finally:
        run.stop()
        if model_tmp:
            shutil.rmtree(model_tmp, ignore_errors=True)
        if ok and not args.log_dir:
            shutil.rmtree(log_dir, ignore_errors=True)
        elif not ok:
            print(f"logs kept in {log_dir}", file=sys.stderr)
    return _report(args, saving, report, run.results, run.order_log)


if __name__ == "__main__":
    sys.exit(main())
