"""Two hosts emulated for real on one machine, for tests of what crosses a network.

Each host is a network namespace with its own veth end and address (10.77.<n>.1 and .2), its own PID and IPC
namespaces and its own /dev/shm (a private tmpfs in its own mount namespace).  Both are needed for the data to
cross the veth: UCX decides "same node" from the kernel's boot id, which no namespace changes, and then uses
cross-memory attach between the two processes; in a separate PID namespace it treats the peer as another node
and goes over TCP on the veth.  A host runs tests/helpers/hosts/agent.py (its KV region and its spawned worker).

Where the machine refuses namespaces, both agents run on loopback with UCX forced onto TCP (``UCX_TLS=tcp,self``)
and :attr:`TwoHosts.mode` says so; the tests print which one ran.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import secrets
import select
import signal
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
NETNS, LOOPBACK_TCP = "netns+veth", "loopback, UCX_TLS=tcp,self"
SAME_HOST = "one host, loopback, UCX's own transport choice (cma)"  # benchmarks' same-host baseline
# one host, but b in its own mount namespace with a private /dev/shm (a container that does not share the host's):
# b cannot open a's region file, so the same-host copy path must not be taken
PRIVATE_SHM = "one host, loopback, b with a private /dev/shm"
# one host, b in its own PID namespace but sharing this host's /dev/shm (containers that mount the host's /dev/shm
# but not --pid=host): b opens a's files, yet a's pid means nothing there, so its death could not be seen
PRIVATE_PID = "one host, loopback, b in its own PID namespace, /dev/shm shared"
_CLONE_NEWNET = 0x40000000  # <sched.h>: setns(2) into a network namespace


class Host:
    def __init__(self, name: str, ip: str, argv: list[str], env: dict[str, str], log_path: Path) -> None:
        self.name, self.ip, self.log_path = name, ip, log_path
        with open(log_path, "w") as log:  # the agent's and its worker's logs: shown when a test fails
            self.proc = subprocess.Popen(argv, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                                         text=True, bufsize=1)
        self.address = ""
        self.backend = ""

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def call(self, wait_s: float = 60.0, **req) -> dict:
        """One request to the agent, its answer within ``wait_s`` (an error answer raises)."""
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], wait_s)
        if not ready:
            raise TimeoutError(f"host {self.name}: no answer to {req['op']} within {wait_s} s")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"host {self.name}: agent exited (code {self.proc.poll()}) during {req['op']}")
        out = json.loads(line)
        if not out.pop("ok"):
            raise RuntimeError(f"host {self.name}: {req['op']} failed: {out['error']}\n{self.log_tail()}")
        return out

    def stop(self) -> int | None:
        code = None
        if self.proc.poll() is None:
            try:
                code = self.call(op="stop", wait_s=30).get("exit_code")
            except Exception:  # noqa: BLE001 - a late or odd answer must not keep the namespaces from going
                pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        return code


# a host's pid 1: it must reap, or every process orphaned there (an engine whose starter exited) stays a zombie when
# it ends, and `kill -0` (pd.sh's "alive") still finds it
_REAPER = """
import os, sys, time
print("ready", flush=True)
while True:
    try:
        os.wait()
    except ChildProcessError:
        time.sleep(0.2)
"""


def _run(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True, text=True, timeout=30)


class TwoHosts:
    """``a`` and ``b``: started agents; ``link(up)`` cuts or restores the wire (netns mode only)."""

    def __init__(self, tag: str, log_dir: Path) -> None:
        uid = secrets.token_hex(3)  # unique per run: never another run's namespaces, created or deleted
        n = secrets.randbelow(200) + 20
        self.ns = (f"p2pw-{tag}-{uid}-a", f"p2pw-{tag}-{uid}-b")
        self.dev = (f"p2w{uid}a", f"p2w{uid}b")  # interface names: at most 15 characters
        self.ips = (f"10.77.{n}.1", f"10.77.{n}.2")
        self.log_dir = log_dir
        self.mode = NETNS
        self.why = ""
        self.hosts: list[Host] = []
        self.died: set[str] = set()  # hosts whose worker a test saw die on purpose (their exit code is not 0)
        self.holders: list[subprocess.Popen] = []  # hold(): each host's namespaces, without an agent
        self.init_pids: list[int] = []

    # ------------------------------------------------------------ namespaces
    def _make(self) -> None:
        (na, nb), (da, db), (ia, ib) = self.ns, self.dev, self.ips
        _run("ip", "netns", "add", na)
        _run("ip", "netns", "add", nb)
        _run("ip", "link", "add", da, "type", "veth", "peer", "name", db)
        for ns, dev, ip in ((na, da, ia), (nb, db, ib)):
            _run("ip", "link", "set", dev, "netns", ns)
            _run("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", dev)
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            _run("ip", "-n", ns, "link", "set", dev, "up")

    def _unmake(self) -> list[str]:
        left = []
        for ns in self.ns:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
        left += [ns for ns in self.ns if ns in listed.split()]
        links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, timeout=30).stdout
        left += [d for d in self.dev if f" {d}@" in links or f" {d}:" in links]
        return left

    def wire_bytes(self) -> int:
        """Bytes host a has sent on its veth (KV bytes read by b leave a this way); on the loopback fallback, every
        byte sent on this machine's loopback (a lower bound check still holds: TCP, not cross-memory attach)."""
        if self.mode != NETNS:
            return int(Path("/sys/class/net/lo/statistics/tx_bytes").read_text())
        out = subprocess.run(["ip", "netns", "exec", self.ns[0], "cat",
                              f"/sys/class/net/{self.dev[0]}/statistics/tx_bytes"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
        return int(out)

    def link(self, up: bool) -> None:
        """Cut (``up=False``) or restore the wire between the hosts, as `ip link set ... down` on host a."""
        assert self.mode == NETNS, "only emulated hosts have a wire to cut"
        _run("ip", "-n", self.ns[0], "link", "set", self.dev[0], "up" if up else "down")

    # ------------------------------------------------------------ agents
    def _argv(self, i: int) -> list[str]:
        agent = [sys.executable, "-m", "tests.helpers.hosts.agent"]
        if self.mode == PRIVATE_SHM and i == 1:
            return ["unshare", "--mount", "--propagation", "private", "sh", "-c",
                    "mount -t tmpfs -o size=512m tmpfs /dev/shm && exec " + " ".join(agent)]
        if self.mode == PRIVATE_PID and i == 1:  # --mount-proc: its own /proc (and mount namespace), same /dev/shm
            return ["unshare", "--pid", "--fork", "--kill-child", "--mount-proc", *agent]
        if self.mode != NETNS:
            return agent
        script = ("mount -t tmpfs -o size=512m tmpfs /dev/shm && exec env UCX_NET_DEVICES=" + self.dev[i] + " "
                  + " ".join(agent))
        return ["ip", "netns", "exec", self.ns[i], "unshare", "--pid", "--ipc", "--fork", "--kill-child",
                "--mount-proc", "sh", "-c", script]

    def start(self, blocks: int, block_bytes: int, port: int = 5710, settings: dict | None = None,
              env: dict[str, str] | None = None, bind_any: bool = False, same_host: bool = False,
              private_shm: bool = False, private_pid: bool = False) -> None:
        if same_host or private_shm or private_pid:  # not emulated at all: both on this host's loopback
            mode = PRIVATE_SHM if private_shm else PRIVATE_PID if private_pid else SAME_HOST
            self.mode, self.ips = mode, ("127.0.0.1", "127.0.0.1")
        else:
            self.make()
            if self.mode == LOOPBACK_TCP:
                warnings.warn(f"emulated hosts unavailable ({self.why}): running on loopback with UCX_TLS=tcp,self")
        env = {**os.environ, "PYTHONPATH": str(ROOT), "P2PWORKER_SECRET": "emulated-hosts", **(env or {})}
        if self.mode == LOOPBACK_TCP:
            env["UCX_TLS"] = "tcp,self"
            # both hosts' workers run here, seeing each other's region files: keep them off the same-host copy path,
            # so that the bytes still cross TCP as between two machines
            settings = {**(settings or {}), "data": {**(settings or {}).get("data", {}), "same_host": False}}
        for i, name in enumerate(("a", "b")):
            host = Host(name, self.ips[i], self._argv(i), env, self.log_dir / f"host-{name}.log")
            self.hosts.append(host)
            out = host.call(op="start", name=f"host{name}", blocks=blocks, block_bytes=block_bytes,
                            host="0.0.0.0" if bind_any else self.ips[i], port=port if self.mode == NETNS else 0,
                            seed=i, settings=settings, advertise=self.ips[i] if bind_any else None)
            host.address = out["address"]
            host.backend = out["backend"]
            host.region = out["region"]

    # ------------------------------------------------------------ any command inside a host
    def hold(self, shm_size: str = "2g") -> None:
        """Namespaces only (no agents): start each host's idle init process (its own PID, IPC and mount namespaces,
        a private /dev/shm of ``shm_size``), so that any command can run inside with :meth:`enter`.  Netns mode
        only; the caller makes the namespaces with :meth:`make` first."""
        assert self.mode == NETNS
        for i in range(2):
            script = (f"mount -t tmpfs -o size={shm_size} tmpfs /dev/shm && "
                      f"exec {sys.executable} -c '{_REAPER}'")
            holder = subprocess.Popen(
                ["ip", "netns", "exec", self.ns[i], "unshare", "--pid", "--ipc", "--fork", "--kill-child",
                 "--mount-proc", "sh", "-c", script],
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            self.holders.append(holder)
            ready, _, _ = select.select([holder.stdout], [], [], 10)
            if not ready or holder.stdout.readline().strip() != "ready":
                raise RuntimeError(f"host {i}: namespace holder did not start (exit {holder.poll()})")
            # unshare's child: the namespace's pid 1 (the reaper), in our numbering
            self.init_pids.append(int(Path(f"/proc/{holder.pid}/task/{holder.pid}/children").read_text().split()[0]))

    def enter(self, i: int, argv: list[str]) -> list[str]:
        """``argv`` run inside host ``i`` (its network, mount, PID and IPC namespaces; nsenter forks, so the
        command's children live in the host's PID namespace and die with it); on the loopback fallback, here."""
        if self.mode != NETNS:
            return argv
        return ["nsenter", "-t", str(self.init_pids[i]), "-n", "-m", "-p", "-i", "--", *argv]

    @contextlib.contextmanager
    def client_in(self, i: int):
        """This thread's new sockets open inside host ``i``'s network (where a client of that host would be), as
        `ip netns exec` puts a command there; back in this thread's own network on exit.  Netns mode only, after
        :meth:`hold`.  Only this thread moves (setns(2) acts on the calling thread), and sockets opened before
        stay where they were."""
        assert self.mode == NETNS and self.init_pids, "hold() the namespaces first"
        libc = ctypes.CDLL(None, use_errno=True)

        def setns(path: str) -> None:
            fd = os.open(path, os.O_RDONLY)
            try:
                if libc.setns(fd, _CLONE_NEWNET) != 0:
                    err = ctypes.get_errno()
                    raise OSError(err, f"setns({path}): {os.strerror(err)}")
            finally:
                os.close(fd)

        home = f"/proc/self/task/{threading.get_native_id()}/ns/net"
        back = os.open(home, os.O_RDONLY)  # held open: the way back, whatever happens to the host meanwhile
        try:
            try:
                setns(f"/proc/{self.init_pids[i]}/ns/net")
                yield
            finally:  # also when interrupted right after the move in (moving back home is then a no-op at worst)
                if libc.setns(back, _CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), "setns back to this thread's own network failed")
        finally:
            os.close(back)

    def make(self) -> None:
        """The namespaces and the wire, for :meth:`hold`; where refused (or $P2PW_HOSTS_LOOPBACK is set), mode
        becomes the loopback fallback and the caller runs both hosts' commands here with UCX_TLS=tcp,self."""
        try:
            if os.environ.get("P2PW_HOSTS_LOOPBACK"):  # to exercise the fallback where namespaces work
                raise OSError("$P2PW_HOSTS_LOOPBACK is set")
            self._make()
        except (OSError, subprocess.SubprocessError) as e:
            self._unmake()  # only our own names: they are unique to this run
            self.mode, self.why = LOOPBACK_TCP, (getattr(e, "stderr", "") or str(e)).strip()
            self.ips = ("127.0.0.1", "127.0.0.2")  # two loopback addresses: each role still binds its own

    def release(self) -> list[str]:
        """End the holders (every process left in a host's PID namespace dies with its pid 1), then the
        namespaces; returns what was left behind."""
        for holder, pid in zip(self.holders, self.init_pids):
            # a host's pid 1 (the reaper) ignores SIGTERM as every pid 1 does, and unshare passes no signal on: only
            # SIGKILL ends it (and with it every process left in its PID namespace); then unshare exits.  Only while
            # its unshare lives: then that pid is still the reaper, never a recycled one.
            if holder.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        for holder in self.holders:
            try:
                holder.wait(timeout=30)
            except subprocess.TimeoutExpired:
                holder.kill()
                holder.wait(timeout=10)
        return self._unmake() if self.mode == NETNS else []

    @property
    def a(self) -> Host:
        return self.hosts[0]

    @property
    def b(self) -> Host:
        return self.hosts[1]

    def close(self) -> tuple[list, list[str]]:
        codes: list = []
        try:
            for h in self.hosts:
                codes.append(h.stop())
        finally:  # whatever the agents did: the namespaces and the wire go
            left = self._unmake() if self.mode == NETNS else []
        return codes, left


@contextlib.contextmanager
def two_hosts(tag: str, log_dir: Path, blocks: int, block_bytes: int, settings: dict | None = None,
              env: dict[str, str] | None = None, bind_any: bool = False, same_host: bool = False,
              private_shm: bool = False, private_pid: bool = False):
    """Two emulated hosts with agents started; both workers must exit 0 (unless the test took a death into
    account: ``hosts.died``) and nothing may be left behind."""
    hosts = TwoHosts(tag, log_dir)
    t0 = time.monotonic()
    try:
        hosts.start(blocks, block_bytes, settings=settings, env=env, bind_any=bind_any, same_host=same_host,
                    private_shm=private_shm, private_pid=private_pid)
        print(f"emulated hosts: {hosts.mode}{' (' + hosts.why.strip() + ')' if hosts.why else ''}; "
              f"up in {time.monotonic() - t0:.1f} s; data backend {hosts.a.backend}")
        yield hosts
    finally:
        codes, left = hosts.close()
    assert not left, f"namespaces or links left behind: {left}"
    expected = [None if h.name in hosts.died else 0 for h in hosts.hosts]
    assert [None if h.name in hosts.died else c for h, c in zip(hosts.hosts, codes)] == expected, \
        f"worker exit codes {codes}"
