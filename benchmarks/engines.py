"""Real `vllm serve` engines for the benchmarks, started as scripts/pd.sh starts them and stopped with everything of
theirs removed.

The argv and environment are pd.sh's (vLLM's CPU backend, the tiny test model of tests/helpers/tiny_model.py,
``--enforce-eager --dtype float32 --max-num-seqs 8 --shutdown-timeout 10``, VLLM_CPU_KVCACHE_SPACE=1, HTTP on
127.0.0.1, OMP threads bound to one core, vLLM's ipc sockets in a directory of their own), the offloading spec is
vllm_adapter.cpu_spec.CPUTieringOffloadingSpec (vLLM's own CPUOffloadingSpec refuses the CPU platform) and the
secondary tiers are the caller's: ours (:func:`ours_tier`), vLLM's in-tree one (:func:`intree_tier`) or none.

:meth:`Engine.stop` sends SIGTERM, waits, then kills the process group; then it removes what a killed engine
leaves: the CPU tier's ``/dev/shm/vllm_offload_<engine_id>*`` (vLLM's in-tree p2p tier never lets its engine idle,
so vLLM always force-kills that engine core after --shutdown-timeout), our worker's rings and admin socket, and the
ipc directory.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---------------------------------------------------------------------------------------------------- /proc
def proc_stat(path: str) -> tuple[int, int, str] | None:
    """(ppid, utime+stime ticks, comm) of /proc/<pid>[/task/<tid>]/stat."""
    try:
        with open(path + "/stat") as f:
            s = f.read()
    except OSError:
        return None
    comm = s[s.index("(") + 1:s.rindex(")")]
    rest = s[s.rindex(")") + 2:].split()  # fields from 3 (state) on
    return int(rest[1]), int(rest[11]) + int(rest[12]), comm


def pgid_of(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None


def tree(root: int) -> list[int]:
    """root and its descendants (scan of /proc)."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            st = proc_stat(f"/proc/{d}")
            if st:
                children.setdefault(st[0], []).append(int(d))
    out, todo = [], [root]
    while todo:
        p = todo.pop()
        if os.path.exists(f"/proc/{p}"):
            out.append(p)
            todo.extend(children.get(p, []))
    return out


def loadavg() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


AUTOGROUP = "/proc/sys/kernel/sched_autogroup_enabled"


def autogroup() -> bool | None:
    """The kernel's autogroup scheduling (one scheduling group per session) is on; None where it is not built in.
    On this 2-CPU box it made every process of a pull wait 50 ms to seconds for a core (benchmarks/README.md)."""
    try:
        with open(AUTOGROUP) as f:
            return f.read().strip() == "1"
    except OSError:
        return None


# ---------------------------------------------------------------------------------------------------- logs
SHUTDOWN_MARK = "[shutdown]"  # vLLM 0.32 prefixes every line of its stop with it
# vLLM 0.32's AsyncLLM.shutdown tears the engine core client down before it cancels its output_handler task; the
# client's output-queue task, cancelled, hands that handler an EngineDeadError, which it logs at ERROR with a
# traceback whenever the event loop runs it before the cancel lands (vllm-project/vllm#48745, a race independent of
# any KV connector: it is seen on engines without a secondary tier too; benchmarks/README.md, "Traffic").
# The logging site's tag (file:line]); the line moves between releases (906 in 0.32, 957 in 0.34).
VLLM_SHUTDOWN_RACE = re.compile(r"async_llm\.py:\d+\]")


@dataclass(frozen=True)
class LogErrors:
    errors: list[str]  # ERROR or Traceback lines
    shutdown_race: list[str]  # lines of vLLM's own shutdown race only (VLLM_SHUTDOWN_RACE), logged during the stop


def log_errors(path: str, offset: int = 0, limit: int = 20) -> LogErrors:
    """ERROR and Traceback lines of an engine's log from ``offset`` on, with the lines of vLLM's shutdown race apart
    when they are all that is logged after its stop began and they end in EngineDeadError."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return LogErrors([], [])
    stop = next((i for i, ln in enumerate(lines) if SHUTDOWN_MARK in ln), len(lines))
    bad = [(i, ln[:300]) for i, ln in enumerate(lines) if "ERROR" in ln or "Traceback" in ln]
    race = [ln for i, ln in bad if i > stop and VLLM_SHUTDOWN_RACE.search(ln)]
    if not race or not any("EngineDeadError" in ln for ln in race):
        race = []
    return LogErrors([ln for _, ln in bad if ln not in race][:limit], race[:limit])


def save_plot(fig, path: str) -> None:
    """Lay out, write (110 dpi) and close a matplotlib figure: every benchmark's plot the same way."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------------- configs
def ours_tier(port: int, worker_config: str = "prefill", host: str = "127.0.0.1") -> dict:
    """The P2PWorkerTier entry, with configs/<worker_config>.toml (pd.sh's)."""
    return {"type": "P2PWorkerTier", "module_path": "vllm_adapter.tier", "host": host, "port": port,
            "worker_config": os.path.join(ROOT, "configs", f"{worker_config}.toml")}


def intree_tier(port: int, host: str = "127.0.0.1") -> dict:
    """vLLM's own p2p tier (NIXL over UCX; its consumers name a peer by the literal host:port it binds)."""
    return {"type": "p2p", "host": host, "port": port}


def kv_transfer_config(engine_id: str, tiers: list[dict], cpu_bytes: int = 64 << 20) -> dict:
    return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "engine_id": engine_id,
            "kv_connector_extra_config": {"spec_name": "CPUTieringOffloadingSpec",
                                          "spec_module_path": "vllm_adapter.cpu_spec", "cpu_bytes_to_use": cpu_bytes,
                                          "offload_prompt_only": True, "secondary_tiers": tiers}}


def venv_env(python: str) -> dict[str, str]:
    """What a venv asks for to serve (its p2pw-env.sh, as scripts/pd.sh sources it: scripts/vllm_cpu034.sh writes
    one naming the kernel library of its CPU build of vLLM 0.34); {} for a venv without one."""
    path = os.path.join(os.path.dirname(os.path.dirname(python)), "p2pw-env.sh")
    if not os.path.exists(path):
        return {}
    out = {}
    for line in open(path).read().splitlines():
        if line.startswith("export ") and "=" in line:
            k, v = line[len("export "):].split("=", 1)
            out[k.strip()] = v.strip().strip("'\"")
    return out


def new_engine_id(tag: str) -> str:
    return f"p2pw-{tag}-{os.getpid()}-{secrets.token_hex(3)}"


# ---------------------------------------------------------------------------------------------------- engines
class Engine:
    """One `vllm serve` process (its own session and process group) with the given --kv-transfer-config."""

    def __init__(self, name: str, *, python: str, model: str, kv: dict, http: int, bind: str, log_dir: str,
                 secret: str, max_model_len: int = 2048, env: dict | None = None, args: tuple[str, ...] = (),
                 host: str = "127.0.0.1", inside: Callable[[list[str]], list[str]] | None = None):
        """``inside``: an argv run inside another host (tests/helpers/hosts/emulate.py's ``TwoHosts.enter`` for one
        host), with ``host`` that host's address; None: here, on loopback."""
        self.name, self.kv, self.http, self.host, self.inside = name, kv, http, host, inside
        self.engine_id = kv["engine_id"]
        self.log_path = os.path.join(log_dir, f"{name}.log")
        self.log = open(self.log_path, "wb")  # first: a log dir that is not there fails before anything exists
        self.rpc = tempfile.mkdtemp(prefix=f"p2pw-{name}.", dir="/tmp")  # vLLM's ZMQ ipc sockets
        argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--served-model-name", "tiny",
                "--host", host, "--port", str(http), "--kv-transfer-config", json.dumps(kv),
                "--shutdown-timeout", "10", "--enforce-eager", "--dtype", "float32", "--max-model-len",
                str(max_model_len), "--max-num-seqs", "8", *args]
        full_env = {**os.environ, **venv_env(python), "HF_HUB_OFFLINE": "1", "P2PWORKER_SECRET": secret,
                    "VLLM_RPC_BASE_PATH": self.rpc, "VLLM_CPU_OMP_THREADS_BIND": bind, "VLLM_CPU_KVCACHE_SPACE": "1",
                    **(env or {})}
        # inside a host nsenter starts the command at that host's root (its own mount namespace): env -C puts it
        # back where cwd= puts it here
        run = inside(["env", "-C", ROOT, *argv]) if inside else argv
        self.proc = subprocess.Popen(run, env=full_env, stdout=self.log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True, cwd=ROOT)
        self.pid = self.proc.pid
        self.t_start = time.monotonic()
        self.startup_s: float | None = None
        self.stopped: dict | None = None

    def url(self, path: str = "") -> str:
        return f"http://{self.host}:{self.http}{path}"

    def wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode} before healthy; "
                                   f"log {self.log_path}:\n{self.tail()}")
            try:
                with urllib.request.urlopen(self.url("/health"), timeout=2) as r:
                    if r.status == 200:
                        self.startup_s = round(time.monotonic() - self.t_start, 1)
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(1)
        raise RuntimeError(f"{self.name} not healthy within {timeout_s} s; log {self.log_path}:\n{self.tail()}")

    def complete(self, prompt: str = "alpha bravo charlie delta echo foxtrot golf hotel", max_tokens: int = 8) -> str:
        body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}).encode()
        req = urllib.request.Request(self.url("/v1/completions"), body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            return json.loads(r.read())["choices"][0]["text"]

    def tail(self, n: int = 30) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return ""

    def admins(self) -> list[str]:
        return sorted(glob.glob(f"/tmp/p2pworker-vllm-{self.engine_id}-*.admin"))

    def server_pid(self) -> int | None:
        """The API server's pid: the process started, or inside another host nsenter's one child (nsenter forwards
        no signal, so SIGTERM must reach the server itself).  None once it is gone."""
        if self.inside is None:
            return self.pid if self.proc.poll() is None else None
        try:
            with open(f"/proc/{self.pid}/task/{self.pid}/children") as f:
                kids = f.read().split()
        except OSError:
            return None
        return int(kids[0]) if kids else None

    def _shm_files(self) -> list[str]:
        patterns = (f"/dev/shm/vllm_offload_{self.engine_id}*", f"/dev/shm/p2pw_*{self.engine_id}*")
        if self.inside is None:
            return [f for p in patterns for f in glob.glob(p)]
        # that host's /dev/shm is its own tmpfs: looked at from inside (it goes with the host in any case)
        try:
            p = subprocess.run(self.inside(["sh", "-c", "ls -d " + " ".join(patterns) + " 2>/dev/null; true"]),
                               capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.SubprocessError) as e:
            return [f"(/dev/shm inside the host not listed: {e})"]
        return p.stdout.split()

    def _remove_shm(self, files: list[str]) -> None:
        if self.inside is None:
            _unlink(files)
        elif files:
            with contextlib.suppress(OSError, subprocess.SubprocessError):  # reported as left in any case
                subprocess.run(self.inside(["rm", "-f", *files]), capture_output=True, timeout=30)

    def stop(self, timeout_s: float) -> dict:
        """SIGTERM the API server (vLLM stops its engine core, our tier its worker), wait; past timeout_s SIGKILL the
        process group; then report what of ours is left (and remove leftover files).  Idempotent."""
        if self.stopped is not None:
            return self.stopped
        t0 = time.monotonic()
        pgid = self.pid
        killed = False
        if self.proc.poll() is None:
            server = self.server_pid()
            try:
                if server is None:  # nsenter has no child (yet): nothing to ask to stop
                    raise ProcessLookupError(f"{self.name}: no API server process to signal")
                os.kill(server, signal.SIGTERM)
                self.proc.wait(timeout_s)
            except (subprocess.TimeoutExpired, ProcessLookupError):
                killed = True
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pgid, signal.SIGKILL)
                self.proc.wait(10)
        left = self._wait_group_gone(pgid, timeout_s)
        if left:
            killed = True
            try:
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.log.close()
        shm, admins = self._shm_files(), self.admins()
        self._remove_shm(shm)
        _unlink(admins)  # /tmp is this host's in either case
        files = shm + admins
        rpc_left = os.listdir(self.rpc) if os.path.isdir(self.rpc) else []
        shutil.rmtree(self.rpc, ignore_errors=True)
        self.stopped = {"stop_s": round(time.monotonic() - t0, 1), "rc": self.proc.returncode, "sigkill": killed,
                        "left_processes": left, "left_files": files, "left_in_rpc_dir": rpc_left}
        return self.stopped

    @staticmethod
    def _wait_group_gone(pgid: int, timeout_s: float) -> list[int]:
        """Children follow their parent (the engine core, our worker): the same bound.  What is still there."""
        deadline = time.monotonic() + timeout_s
        left: list[int] = []
        while time.monotonic() < deadline:
            left = sorted(int(d) for d in os.listdir("/proc") if d.isdigit() and pgid_of(int(d)) == pgid)
            if not left:
                break
            time.sleep(0.5)
        return left


def _unlink(paths: list[str]) -> None:
    for f in paths:
        with contextlib.suppress(OSError):
            os.unlink(f)
