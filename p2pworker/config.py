"""Worker configuration: a TOML file (see configs/) plus command-line overrides."""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass, field
from typing import Any

from p2pworker.control.zmq_control import ControlConfig
from p2pworker.session.session import SessionConfig


@dataclass
class DataConfig:
    backend: str = "auto"  # auto | nixl | zmq
    max_piece_bytes: int = 8 << 20
    post_budget_bytes: int = 16 << 20


@dataclass
class WorkerConfig:
    name: str = "p2pworker"
    rings: str = ""  # ring name prefix; the adapter creates <rings>.cmd and <rings>.evt
    admin_path: str = ""  # default: /tmp/p2pworker-<name>-<pid>.admin
    metrics_port: int = 0  # 0: no Prometheus endpoint
    tick_s: float = 0.05  # session/lot timers
    idle_poll_s: float = 0.1  # longest sleep when idle
    busy_poll_s: float = 0.001  # poll period while our own reads are in flight (drives NIXL progress)
    passive_poll_s: float = 0.005  # poll period while we hold leases: a passive NIXL target over TCP must progress
    shutdown_timeout_s: float = 10.0  # bound on draining in-flight transfers at shutdown
    prefault: bool = True  # pre-fault the region's page tables at attach (MAP_POPULATE)
    wait_rings_s: float = 0.0  # operator-launched worker: wait this long for the adapter to create the rings
    control: ControlConfig = field(default_factory=ControlConfig)
    data: DataConfig = field(default_factory=DataConfig)
    session: SessionConfig = field(default_factory=SessionConfig)


def _apply(obj: Any, values: dict[str, Any], where: str) -> None:
    names = {f.name: f for f in dataclasses.fields(obj)}
    for key, value in values.items():
        if key not in names:
            raise ValueError(f"unknown config key {where}{key!r}; known: {sorted(names)}")
        current = getattr(obj, key)
        if dataclasses.is_dataclass(current):
            if not isinstance(value, dict):
                raise ValueError(f"config key {where}{key!r} must be a table")
            _apply(current, value, f"{where}{key}.")
        else:
            setattr(obj, key, value)


def load_config(path: str | None = None, overrides: dict[str, Any] | None = None) -> WorkerConfig:
    """Defaults, then the TOML file's [worker] (and [control], [data], [session]) tables, then overrides."""
    cfg = WorkerConfig()
    if path:
        with open(path, "rb") as f:
            doc = tomllib.load(f)
        worker = dict(doc.pop("worker", {}))
        _apply(cfg, worker, "worker.")
        _apply(cfg, doc, "")
    if overrides:
        _apply(cfg, overrides, "override ")
    return cfg
