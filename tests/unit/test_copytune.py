"""The worker runs with glibc's non-temporal threshold lowered (p2pworker.copytune): set by WorkerClient, or by
``p2pworker launch`` exec'ing itself once; an operator's own setting is kept."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from p2pworker import copytune

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.skipif(not copytune.applies(), reason="x86-64 glibc only (elsewhere nothing is set)")]

SETTING = f"{copytune.TUNABLE}={copytune.THRESHOLD:#x}"


def test_the_threshold_is_added_and_other_tunables_are_kept():
    assert copytune.worker_env({"PATH": "/bin"}) == {"PATH": "/bin", "GLIBC_TUNABLES": SETTING}
    got = copytune.worker_env({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"})
    assert got["GLIBC_TUNABLES"] == f"glibc.malloc.arena_max=2:{SETTING}"


def test_an_operators_own_threshold_is_kept():
    mine = {"GLIBC_TUNABLES": f"{copytune.TUNABLE}=0xffffffffff"}
    assert copytune.worker_env(mine) is None


def test_launch_without_it_execs_itself_once_with_it_and_keeps_its_pid():
    code = ("import os, sys; from p2pworker.copytune import reexec_if_untuned; "
            "print('start', os.getpid(), flush=True); reexec_if_untuned(); "
            "print('tuned', os.getpid(), os.environ.get('GLIBC_TUNABLES', ''), flush=True)")
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", copytune.REEXEC_MARK)}
    # "launch" as its argument: the command line of a worker (the console script's, or -m p2pworker.cli's)
    out = subprocess.run([sys.executable, "-c", code, "launch"], env=env, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.split("\n")
    starts = [ln for ln in lines if ln.startswith("start")]
    (tuned,) = [ln for ln in lines if ln.startswith("tuned")]
    assert len(starts) == 2, "exec'd exactly once"  # the command line ran again, once
    pid = starts[0].split()[1]
    assert starts[1].split()[1] == pid and tuned.split()[1] == pid  # exec keeps the pid: a supervisor sees one process
    assert tuned.split()[2] == SETTING


def test_only_a_launch_command_line_is_executed_again():
    """Inside another program (pytest here, as under click's CliRunner) nothing is exec'd: its command line is not
    a worker's."""
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", copytune.REEXEC_MARK)}
    code = ("import os; from p2pworker.copytune import reexec_if_untuned; print('start', flush=True); "
            "reexec_if_untuned(); print('after', os.environ.get('GLIBC_TUNABLES', ''), flush=True)")
    out = subprocess.run([sys.executable, "-c", code, "serve"], env=env, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == ["start", "after "]  # not exec'd: ran once, untuned


def test_a_launch_that_cannot_exec_runs_untuned(monkeypatch, caplog):
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    monkeypatch.delenv(copytune.REEXEC_MARK, raising=False)
    monkeypatch.setattr(sys, "argv", ["p2pworker", "launch"])
    monkeypatch.setattr(sys, "orig_argv", ["/gone/python", "/gone/p2pworker", "launch"])

    def refused(*a):
        raise FileNotFoundError(2, "No such file or directory", a[0])

    monkeypatch.setattr(os, "execve", refused)
    copytune.reexec_if_untuned()  # returns: the worker starts without the setting
    assert "copies will not stream" in caplog.text


def test_a_spawned_worker_runs_with_it(shm_prefix, tmp_path):
    from p2pworker import admin
    from p2pworker.client import WorkerClient
    from p2pworker.shm import KVRegion

    reg = KVRegion.create(f"{shm_prefix}tune", 8, 4096)
    c = WorkerClient("tune", args=["--port", "0", "--admin", str(tmp_path / "tune.admin")],
                     env={"GLIBC_TUNABLES": "", "P2PWORKER_SECRET": "copytune-test"})
    try:
        c.attach(reg.handle, {"model": "test"})  # Ready: the worker is up and serving (not an early exit)
        with open(f"/proc/{c.proc.pid}/environ", "rb") as f:
            environ = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        assert environ[b"GLIBC_TUNABLES"] == SETTING.encode()
        assert copytune.REEXEC_MARK.encode() not in environ  # set by the client: launch did not need to exec
        assert admin.query(str(tmp_path / "tune.admin"))["glibc_tunables"] == SETTING  # what inspect shows
    finally:
        assert c.close() == 0
        reg.close()
