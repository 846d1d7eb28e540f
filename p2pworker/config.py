"""Worker configuration: a TOML file (see configs/) plus command-line overrides, typed and range-checked.

The settings are the dataclasses below (and ``ControlConfig``, ``SessionConfig`` of their modules); every value a
file or an override sets is converted with msgspec against the field's type, narrowed by :data:`CONSTRAINTS`
where a type alone allows nonsense (a negative interval, a port above 65535, a backend nobody has).  Any error
names the file and the path (``configs/prefill.toml: $.control.port: Expected `int`, got `str```); unknown keys
are errors too.  ``p2pworker config check FILE`` prints the effective settings or the errors.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
import typing
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, Mapping

import msgspec
from msgspec import Meta

from p2pworker.control.base import DEFAULT_PORT, HOST_ENV, PORT_ENV
from p2pworker.control.zmq_control import ControlConfig
from p2pworker.limits import MAX_FRAME_BYTES
from p2pworker.session.session import SessionConfig

Backend = Literal["auto", "nixl", "zmq"]


@dataclass
class DataConfig:
    backend: Backend = "auto"
    max_piece_bytes: int = 8 << 20
    post_budget_bytes: int = 16 << 20


@dataclass
class WorkerConfig:
    name: str = "p2pworker"
    rings: str = ""  # ring name prefix; the adapter creates <rings>.cmd and <rings>.evt
    admin_path: str = ""  # default: /tmp/p2pworker-<name>-<pid>.admin
    role: str = ""  # a label on every metric (prefill, decode, ...): which engine this worker serves
    metrics_port: int = 0  # 0: no Prometheus endpoint; else the base port: bound port = metrics_port + dp_index
    metrics_host: str = "127.0.0.1"  # 0.0.0.0 (or the pod IP) for a Prometheus in another pod
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


class ConfigError(ValueError):
    """A config value or key that cannot be used; the message names the source and the path."""


_Pos = Annotated[float, Meta(gt=0)]
_NonNeg = Annotated[float, Meta(ge=0)]
_PosInt = Annotated[int, Meta(ge=1)]
_Port = Annotated[int, Meta(ge=0, le=65535)]

# Narrower types than the fields' own, by path: what each setting may be.
CONSTRAINTS: dict[str, Any] = {
    "metrics_port": _Port,
    "role": Literal["", "prefill", "decode", "both"],
    "tick_s": _Pos, "idle_poll_s": _Pos, "busy_poll_s": _Pos, "passive_poll_s": _Pos, "shutdown_timeout_s": _Pos,
    "wait_rings_s": _NonNeg,
    "control.port": _Port | None,
    "control.secret": str | None,  # the field also takes bytes (from code); a file gives a string
    "control.dp_index": Annotated[int, Meta(ge=0, le=4095)],
    "control.heartbeat_interval_s": _Pos, "control.heartbeat_liveness": _PosInt,
    "control.reconnect_min_s": _Pos, "control.reconnect_max_s": _Pos,
    "control.hwm": _PosInt, "control.max_pending_auth": _PosInt, "control.max_batch": _PosInt,
    # a frame must hold MAX_MSG_KEYS keys (limits.py): below the default, long key lists would be refused
    "control.max_frame_bytes": Annotated[int, Meta(ge=MAX_FRAME_BYTES, le=64 * MAX_FRAME_BYTES)],
    "data.max_piece_bytes": _PosInt, "data.post_budget_bytes": _PosInt,
    "session.load_timeout_s": Annotated[float, Meta(gt=0, le=3600)],  # a lease a producer may grant (MAX_LEASE_MS)
    "session.fetch_timeout_s": _Pos, "session.lookup_timeout_s": _Pos, "session.park_timeout_s": _Pos,
    "session.settle_timeout_s": _Pos, "session.handshake_timeout_s": _Pos,
    "session.max_lease_s": Annotated[float, Meta(gt=0, le=3600)],
    "session.max_queued": _PosInt, "session.max_inbound_lookups": _PosInt,
}


def _apply(obj: Any, values: Any, path: str, source: str, shown: str = "") -> None:
    """Set ``values`` on ``obj`` at ``path`` (the CONSTRAINTS key); errors show ``$<shown><path>``, e.g.
    ``$.worker.role`` for a key of the file's [worker] table."""
    if not isinstance(values, dict):
        raise ConfigError(f"{source}: ${shown}{path}: must be a table")
    names = {f.name for f in dataclasses.fields(obj)}
    hints = typing.get_type_hints(type(obj), include_extras=True)
    for key, value in values.items():
        where = f"{path}.{key}"
        if key not in names:
            raise ConfigError(f"{source}: ${shown}{where}: unknown key; known: {sorted(names)}")
        current = getattr(obj, key)
        if dataclasses.is_dataclass(current):
            _apply(current, value, where, source, shown)
            continue
        typ = CONSTRAINTS.get(where[1:], hints[key])
        try:
            setattr(obj, key, msgspec.convert(value, typ, strict=True))
        except msgspec.ValidationError as e:
            raise ConfigError(f"{source}: ${shown}{where}: {e} (got {value!r})") from None


def _apply_doc(cfg: WorkerConfig, doc: Any, source: str) -> None:
    """One settings document: the TOML file's shape ([worker] plus [control], [data], [session]), from a file or
    inline (the tier's ``worker_settings``, the CLI's ``--settings-json``)."""
    if not isinstance(doc, dict):
        raise ConfigError(f"{source}: $: must be a table of settings, got {type(doc).__name__}")
    doc = dict(doc)
    _apply(cfg, doc.pop("worker", {}), "", source, shown=".worker")
    _apply(cfg, doc, "", source)


def load_config(path: str | None = None, overrides: dict[str, Any] | None = None,
                inline: dict[str, Any] | None = None, inline_source: str = "inline settings") -> WorkerConfig:
    """Defaults, then the TOML file, then ``inline`` (the same document shape, e.g. from vLLM's JSON), then
    overrides (command-line flags)."""
    cfg = WorkerConfig()
    if path:
        try:
            with open(path, "rb") as f:
                doc = tomllib.load(f)
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path}: not valid TOML: {e}") from None
        _apply_doc(cfg, doc, path)
    if inline is not None:
        _apply_doc(cfg, inline, inline_source)
    if overrides:
        _apply(cfg, overrides, "", "command line")
    return cfg


class TierSettings(msgspec.Struct, forbid_unknown_fields=True):
    """The tier's keys in vLLM's ``kv_connector_extra_config["secondary_tiers"][i]`` (besides type/module_path).

    Here, not in vllm_adapter, so ``p2pworker config check`` reads a vLLM JSON without importing vLLM."""

    locality: str | None = None
    host: str | None = None  # default: $VLLM_P2P_SIDE_CHANNEL_HOST, else 127.0.0.1
    port: Annotated[int, Meta(ge=0, le=65535)] | None = None  # base; the worker binds port + DP index
    worker_config: str | None = None  # the worker's TOML (a path; relative to vLLM's working directory)
    # the worker's settings inline, the TOML's shape ({"worker": {...}, "control": {...}, ...}); over worker_config
    worker_settings: dict[str, Any] | None = None
    backend: Backend | None = None  # set: overrides the settings' [data] backend
    rings: str | None = None  # attach to an operator-launched worker instead of spawning one
    start_timeout_s: Annotated[float, Meta(gt=0)] = 120.0
    worker_stall_s: Annotated[float, Meta(gt=0)] = 5.0  # no event (heartbeats every 0.5 s) from a live pid: wedged


TIER_SOURCE = "kv_connector_extra_config.secondary_tiers[P2PWorkerTier]"

# Settings the tier decides for the worker it spawns (command-line flags): refused in worker_settings, where they
# would be silently overridden.  ("worker.<key>": the [worker] table.)
TIER_OWNED = {
    "worker.name": "vllm-<engine id>", "worker.rings": "the rings it creates", "worker.admin_path": "per worker",
    "control.dp_index": "vLLM's data-parallel index",
}


def tier_settings(config: dict[str, Any], env: Mapping[str, str] = os.environ) -> tuple[TierSettings, WorkerConfig]:
    """The tier's keys typed and range-checked, and the settings its worker will run with: worker_config, then
    worker_settings, then the tier's own host/port/backend.  Checked now, so vLLM's start fails naming the key,
    not when the worker starts.

    Host: the tier's ``host``, else $VLLM_P2P_SIDE_CHANNEL_HOST, else the settings' control.host.  Port (the
    base; the worker binds base + DP index): the tier's ``port``, else $VLLM_P2P_SIDE_CHANNEL_PORT, else the
    settings' control.port, else 5710: vLLM's own p2p tier's convention first."""
    try:
        s = msgspec.convert(config, TierSettings, strict=True)
    except msgspec.ValidationError as e:
        raise ConfigError(f"{TIER_SOURCE}: {e}") from None
    inline_source = f"{TIER_SOURCE}.worker_settings"
    if s.worker_settings is not None:
        control = s.worker_settings.get("control")
        if isinstance(control, dict) and "secret" in control:
            # the settings reach the worker on its command line, which every local user can read (ps, /proc)
            raise ConfigError(f"{inline_source}: $.control.secret: not here: a secret in the JSON would be on the "
                              "worker's command line; set $P2PWORKER_SECRET (or [control] secret in worker_config)")
        for path, owner in TIER_OWNED.items():
            section, key = path.split(".")
            tables = [(f"$.{section}.{key}", s.worker_settings.get(section))]
            if section == "worker":  # the [worker] keys may also stand at the top, as in a TOML file
                tables.append((f"$.{key}", s.worker_settings))
            for where, table in tables:
                if isinstance(table, dict) and key in table:
                    raise ConfigError(f"{inline_source}: {where}: set by the tier ({owner}), not by its settings")
    try:
        cfg = load_config(s.worker_config, inline=s.worker_settings, inline_source=inline_source)
    except OSError as e:
        raise ConfigError(f"{TIER_SOURCE}.worker_config: {e}") from None
    cfg.control.host = s.host or env.get(HOST_ENV) or cfg.control.host
    if s.port is not None:
        cfg.control.port = s.port
    elif PORT_ENV in env:
        try:
            cfg.control.port = msgspec.convert(int(env[PORT_ENV]), Annotated[int, Meta(ge=0, le=65535)])
        except (ValueError, msgspec.ValidationError):
            raise ConfigError(f"${PORT_ENV}={env[PORT_ENV]!r}: not a port (0-65535)") from None
    elif cfg.control.port is None:
        cfg.control.port = DEFAULT_PORT
    if s.backend is not None:
        cfg.data.backend = s.backend
    return s, cfg


def tier_entries(doc: Any) -> list[dict[str, Any]]:
    """The P2PWorkerTier entries of a vLLM JSON: a --kv-transfer-config, its kv_connector_extra_config, or one
    secondary tier's entry."""
    if isinstance(doc, dict) and "kv_connector_extra_config" in doc:
        doc = doc["kv_connector_extra_config"]
    if isinstance(doc, dict) and "secondary_tiers" in doc:
        doc = doc["secondary_tiers"]
    entries = doc if isinstance(doc, list) else [doc]
    return [{k: v for k, v in e.items() if k not in ("type", "module_path")}
            for e in entries if isinstance(e, dict) and e.get("type") == "P2PWorkerTier"]


def effective(cfg: WorkerConfig) -> dict[str, Any]:
    """The settings as plain values (the secret masked), for ``p2pworker config check``."""
    out = dataclasses.asdict(cfg)
    if out["control"].get("secret"):
        out["control"]["secret"] = "***"
    return out
