"""Worker configuration: one schema of msgspec Structs, from a TOML file, inline JSON and command-line flags.

``WorkerConfig`` holds the [worker] keys and the ``ControlConfig``, ``DataConfig`` and ``SessionConfig`` tables
(each a Struct next to the code it configures; the constrained types are p2pworker/schema.py).  Each source (the
file, the tier's ``worker_settings``, the flags) is checked alone against the schema, so an error names the source
and the path (``configs/prefill.toml: $.control.port: Expected `int | null`, got `str` (got '5710')``); unknown
keys are errors too.  Then the sources are merged, later over earlier.  The tier's own keys are ``TierSettings``.
``p2pworker config check FILE`` prints the effective settings or the errors.
"""

from __future__ import annotations

import copy
import os
import re
import tomllib
from typing import Annotated, Any, Literal, Mapping

import msgspec
from msgspec import Meta

from p2pworker.control.base import DEFAULT_PORT, HOST_ENV, PORT_ENV
from p2pworker.control.zmq_control import ControlConfig
from p2pworker.schema import NonNeg, NonNegInt, Port, Pos, PosInt
from p2pworker.session.session import SessionConfig

Backend = Literal["auto", "nixl", "zmq"]
Role = Literal["", "prefill", "decode", "both"]


class DataConfig(msgspec.Struct, forbid_unknown_fields=True):
    """[data] settings."""

    backend: Backend = "auto"
    max_piece_bytes: PosInt = 8 << 20
    post_budget_bytes: PosInt = 16 << 20
    # a peer on this host whose region file we provably see (boot id, its worker's pid, the file's identity):
    # copy its rows ourselves out of a read-only map of that file; false: never (and do not offer ours)
    same_host: bool = True
    # threads (this one included) for a same-host copy of >= 4 MiB; 0: samehost.auto_copy_threads (1 on fewer than
    # 4 CPUs, where a helper thread only waits for a core the schedulers and the peer's worker need, else 2)
    copy_threads: NonNegInt = 0
    # with same_host: map a peer's region into our page tables on a background thread once it is mapped, so the
    # first copies out of it do not fault page by page (its pages in memory only; p2pworker.shm.prefault)
    prefault_peers: bool = True
    # with same_host: a session we dial to a peer on this host moves its messages to a local socket once both ends
    # proved the session's key (p2pworker.control.lane); false: they stay on the control link
    lane: bool = True


class WorkerConfig(msgspec.Struct, forbid_unknown_fields=True):
    """[worker] settings and the other tables."""

    name: str = "p2pworker"
    rings: str = ""  # ring name prefix; the adapter creates <rings>.cmd and <rings>.evt
    admin_path: str = ""  # default: /tmp/p2pworker-<name>-<pid>.admin
    role: Role = ""  # a label on every metric: which engine this worker serves
    metrics_port: Port = 0  # 0: no Prometheus endpoint; else the base port: bound port = metrics_port + dp_index
    metrics_host: str = "127.0.0.1"  # 0.0.0.0 (or the pod IP) for a Prometheus in another pod
    tick_s: Pos = 0.05  # session/lot timers
    idle_poll_s: Pos = 0.1  # longest sleep when idle
    busy_poll_s: Pos = 0.001  # poll period while our own reads are in flight (drives NIXL progress)
    passive_poll_s: Pos = 0.001  # poll period while we hold leases: a passive NIXL target over TCP must progress
    # for this long after each offer (the consumer's READ is then in flight) poll every passive_burst_poll_s
    passive_burst_s: NonNeg = 1.0
    passive_burst_poll_s: Pos = 0.0002
    shutdown_timeout_s: Pos = 10.0  # bound on draining in-flight transfers at shutdown
    prefault: bool = True  # pre-fault the region's page tables at attach (MAP_POPULATE)
    wait_rings_s: NonNeg = 0.0  # operator-launched worker: wait this long for the adapter to create the rings
    control: ControlConfig = msgspec.field(default_factory=ControlConfig)
    data: DataConfig = msgspec.field(default_factory=DataConfig)
    session: SessionConfig = msgspec.field(default_factory=SessionConfig)


class ConfigError(ValueError):
    """A config value or key that cannot be used; the message names the source and the path."""


_AT = re.compile(r"^(?P<what>.*?)(?: - at `(?P<path>\$[^`]*)`)?$", re.S)
_UNKNOWN = re.compile(r"^Object contains unknown field `(?P<key>[^`]*)`$")


def _lookup(doc: Any, path: str) -> tuple[bool, Any]:
    for part in path.split(".")[1:]:
        if not isinstance(doc, dict) or part not in doc:
            return False, None
        doc = doc[part]
    return True, doc


def _known(path: str) -> list[str]:
    """The keys the schema has at ``path`` ($ or $.control, ...)."""
    typ: Any = WorkerConfig
    for part in path.split(".")[1:]:
        typ = {f.name: f.type for f in msgspec.structs.fields(typ)}.get(part)
    return sorted(f.name for f in msgspec.structs.fields(typ)) if typ is not None else []


def _check(doc: Any, source: str) -> dict[str, Any]:
    """One source's settings (the TOML file's shape: [worker] keys, which may also stand at the top, and the
    [control], [data], [session] tables) checked alone against the schema; returns them flattened."""
    if not isinstance(doc, dict):
        raise ConfigError(f"{source}: $: must be a table of settings, got {type(doc).__name__}")
    doc = dict(doc)
    worker = doc.pop("worker", {})
    if not isinstance(worker, dict):
        raise ConfigError(f"{source}: $.worker: must be a table, got {type(worker).__name__}")
    for key in worker.keys() & doc.keys():
        raise ConfigError(f"{source}: $.worker.{key}: given twice (in [worker] and at the top)")
    flat = {**doc, **worker}
    try:
        msgspec.convert(flat, WorkerConfig, strict=True)
    except msgspec.ValidationError as e:
        m = _AT.match(str(e))
        what, path = m.group("what"), m.group("path") or "$"
        unknown = _UNKNOWN.match(what)
        if unknown:
            path, what = f"{path}.{unknown.group('key')}", f"unknown key; known: {_known(path)}"
        else:
            found, value = _lookup(flat, path)
            what += f" (got {value!r})" if found else ""
        first = path.split(".")[1] if path.count(".") else ""
        shown = f"$.worker{path[1:]}" if first in worker else path  # where the user wrote it
        raise ConfigError(f"{source}: {shown}: {what}") from None
    return flat


def _merge(into: dict[str, Any], over: dict[str, Any]) -> None:
    """``over`` into ``into``, nested tables key by key; copies, so no caller's dict is changed or shared."""
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = copy.deepcopy(value)


def load_config(path: str | None = None, overrides: dict[str, Any] | None = None,
                inline: dict[str, Any] | None = None, inline_source: str = "inline settings") -> WorkerConfig:
    """Defaults, then the TOML file, then ``inline`` (the same document shape, e.g. from vLLM's JSON), then
    overrides (command-line flags); each checked alone, so an error names where it came from."""
    merged: dict[str, Any] = {}
    if path:
        try:
            with open(path, "rb") as f:
                doc = tomllib.load(f)
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path}: not valid TOML: {e}") from None
        _merge(merged, _check(doc, path))
    if inline is not None:
        _merge(merged, _check(inline, inline_source))
    if overrides:
        _merge(merged, _check(overrides, "command line"))
    return msgspec.convert(merged, WorkerConfig, strict=True)


# host:port, the port a number (an IPv6 literal is not supported: see docs/configuration.md)
PeerAddress = Annotated[str, Meta(pattern=r"^[^:\s]+:[0-9]{1,5}$")]


class TierSettings(msgspec.Struct, forbid_unknown_fields=True):
    """The tier's keys in vLLM's ``kv_connector_extra_config["secondary_tiers"][i]`` (besides type/module_path).

    Here, not in vllm_adapter, so ``p2pworker config check`` reads a vLLM JSON without importing vLLM."""

    locality: str | None = None
    host: str | None = None  # where the worker binds; default: $VLLM_P2P_SIDE_CHANNEL_HOST, else 127.0.0.1
    advertise_host: str | None = None  # where peers reach it, if not the bound host (see ControlConfig)
    port: Annotated[int, Meta(ge=0, le=65535)] | None = None  # base; the worker binds port + DP index
    worker_config: str | None = None  # the worker's TOML (a path; relative to vLLM's working directory)
    # the worker's settings inline, the TOML's shape ({"worker": {...}, "control": {...}, ...}); over worker_config
    worker_settings: dict[str, Any] | None = None
    backend: Backend | None = None  # set: overrides the settings' [data] backend
    rings: str | None = None  # attach to an operator-launched worker instead of spawning one
    start_timeout_s: Annotated[float, Meta(gt=0)] = 120.0
    worker_stall_s: Annotated[float, Meta(gt=0)] = 5.0  # no event (heartbeats every 0.5 s) from a live pid: wedged
    # peer workers ("host:port", as the requests' remote_host/remote_port name them) to connect at start and keep
    # connected: the first request to one of them finds its session (and data path) ready
    peers: list[PeerAddress] = []
    # how a symmetric pull (remote_kv_source) runs (vllm_adapter/hints.py): "one_trip" answers its lookups HIT at
    # once and lets the load ask the source (the two-step path still runs while a source lately lacked a request's
    # first key); "ask_first" always asks the source before answering, as releases before protocol 8 did
    pull_path: Literal["one_trip", "ask_first"] = "one_trip"


TIER_SOURCE = "kv_connector_extra_config.secondary_tiers[P2PWorkerTier]"

# Settings the tier decides for the worker it spawns (command-line flags): refused in worker_settings, where they
# would be silently overridden.  ("worker.<key>": the [worker] table.)
TIER_OWNED = {
    "worker.name": "vllm-<engine id>", "worker.rings": "the rings it creates", "worker.admin_path": "per worker",
    "control.dp_index": "vLLM's data-parallel index",
}


def _check_tier_worker_settings(doc: dict[str, Any], inline_source: str) -> None:
    """Refuse what a tier's worker_settings must not hold: a secret, and the settings the tier decides itself."""
    # as the loader will read it: [worker] keys (tables too) may also stand at the top, and the other way round
    flat = {**doc, **doc["worker"]} if isinstance(doc.get("worker"), dict) else dict(doc)
    control = flat.get("control")
    if isinstance(control, dict) and "secret" in control:
        # the settings reach the worker on its command line, which every local user can read (ps, /proc)
        raise ConfigError(f"{inline_source}: $.control.secret: not here: a secret in the JSON would be on the "
                          "worker's command line; set $P2PWORKER_SECRET (or [control] secret in worker_config)")
    for path, owner in TIER_OWNED.items():
        section, key = path.split(".")
        table = flat if section == "worker" else flat.get(section)
        if isinstance(table, dict) and key in table:
            raise ConfigError(f"{inline_source}: $.{path}: set by the tier ({owner}), not by its settings")


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
        _check_tier_worker_settings(s.worker_settings, inline_source)
    try:
        cfg = load_config(s.worker_config, inline=s.worker_settings, inline_source=inline_source)
    except OSError as e:
        raise ConfigError(f"{TIER_SOURCE}.worker_config: {e}") from None
    cfg.control.host = s.host or env.get(HOST_ENV) or cfg.control.host
    if s.advertise_host is not None:
        cfg.control.advertise_host = s.advertise_host
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
    out = msgspec.to_builtins(cfg)
    if out["control"].get("secret"):
        out["control"]["secret"] = "***"
    return out
