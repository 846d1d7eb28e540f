"""Worker config files: the shipped examples load; values are typed and range-checked; errors name file and path."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from p2pworker.config import ConfigError, load_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.mark.parametrize("name", ["prefill", "decode"])
def test_shipped_configs_load(name):
    cfg = load_config(str(CONFIGS / f"{name}.toml"), {"rings": "x"})
    assert cfg.name == name and cfg.rings == "x"
    assert cfg.control.heartbeat_interval_s * cfg.control.heartbeat_liveness == 3.0
    assert cfg.data.backend == "auto"


def test_overrides_win_and_unknown_keys_are_named(tmp_path):
    p = tmp_path / "w.toml"
    p.write_text("[control]\nport = 7000\n[data]\nbackend = 'zmq'\n")
    cfg = load_config(str(p), {"control": {"port": 0}})
    assert cfg.control.port == 0 and cfg.data.backend == "zmq"
    p.write_text("[control]\nprot = 7000\n")
    with pytest.raises(ConfigError, match=re.escape(f"{p}: $.control.prot: unknown key")):
        load_config(str(p))
    p.write_text("[worker]\nnmae = 'x'\n")
    with pytest.raises(ConfigError, match=re.escape("$.worker.nmae: unknown key")):
        load_config(str(p))


@pytest.mark.parametrize("text,path,what", [
    ("[control]\nport = '5710'\n", "$.control.port", "Expected `int | null`, got `str`"),
    ("[control]\nport = 70000\n", "$.control.port", "<= 65535"),
    ("[control]\nheartbeat_interval_s = -1\n", "$.control.heartbeat_interval_s", "> 0.0"),
    ("[data]\nbackend = 'nixxl'\n", "$.data.backend", "Invalid enum value 'nixxl'"),
    ("[worker]\nprefault = 'yes'\n", "$.worker.prefault", "Expected `bool`"),
    ("[session]\nload_timeout_s = 7200\n", "$.session.load_timeout_s", "<= 3600"),
    ("[control]\nmax_frame_bytes = 1024\n", "$.control.max_frame_bytes", ">= 4194304"),
    ("[data]\ncopy_threads = -1\n", "$.data.copy_threads", ">= 0"),
    ("session = 3\n", "$.session", "Expected `object`, got `int`"),
])
def test_types_ranges_and_enums_are_checked_naming_file_and_path(tmp_path, text, path, what):
    p = tmp_path / "w.toml"
    p.write_text(text)
    with pytest.raises(ConfigError) as ei:
        load_config(str(p))
    msg = str(ei.value)
    assert msg.startswith(f"{p}: {path}: ") and what in msg, msg


def test_bad_toml_and_bad_overrides_name_their_source(tmp_path):
    p = tmp_path / "w.toml"
    p.write_text("[control\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(str(p))
    with pytest.raises(ConfigError, match=re.escape("command line: $.control.dp_index")):
        load_config(None, {"control": {"dp_index": -1}})


def test_tier_settings_inline_over_file_and_address_precedence(tmp_path):
    """The tier's JSON: worker_config, then worker_settings (the same document shape), then the tier's own
    host/port/backend; host and port follow vLLM's p2p environment convention before the settings."""
    from p2pworker.config import tier_entries, tier_settings

    p = tmp_path / "w.toml"
    p.write_text("[worker]\nrole = 'decode'\n[control]\nhost = '10.0.0.5'\nport = 7000\n[data]\nbackend = 'zmq'\n")
    inline = {"worker": {"metrics_port": 9100}, "data": {"backend": "nixl"}}
    entry = {"worker_config": str(p), "worker_settings": inline}
    s, cfg = tier_settings(entry, env={})
    assert (cfg.role, cfg.metrics_port, cfg.data.backend) == ("decode", 9100, "nixl")  # inline over the file
    assert (cfg.control.host, cfg.control.port) == ("10.0.0.5", 7000)  # the settings, nothing above them
    _, cfg = tier_settings(entry, env={"VLLM_P2P_SIDE_CHANNEL_HOST": "10.1.1.1", "VLLM_P2P_SIDE_CHANNEL_PORT": "6000"})
    assert (cfg.control.host, cfg.control.port) == ("10.1.1.1", 6000)
    _, cfg = tier_settings({**entry, "host": "10.2.2.2", "port": 5000, "backend": "auto"},
                           env={"VLLM_P2P_SIDE_CHANNEL_HOST": "10.1.1.1", "VLLM_P2P_SIDE_CHANNEL_PORT": "6000"})
    assert (cfg.control.host, cfg.control.port, cfg.data.backend) == ("10.2.2.2", 5000, "auto")
    _, cfg = tier_settings({}, env={})
    assert (cfg.control.host, cfg.control.port) == ("127.0.0.1", 5710)
    with pytest.raises(ConfigError, match=re.escape("secondary_tiers[P2PWorkerTier].worker_settings: $.worker.role")):
        tier_settings({"worker_settings": {"worker": {"role": "prefil"}}}, env={})
    with pytest.raises(ConfigError, match=re.escape("got `array` - at `$.worker_settings`")):
        tier_settings({"worker_settings": [1]}, env={})
    doc = {"kv_connector_extra_config": {"secondary_tiers": [{"type": "Other"}, {"type": "P2PWorkerTier", "port": 1,
                                                                                 "module_path": "m"}]}}
    assert tier_entries(doc) == [{"port": 1}]


@pytest.mark.parametrize("inline,what", [
    ({"control": {"secret": "s3cret"}}, "$.control.secret: not here"),  # would be on the worker's command line
    ({"worker": {"control": {"secret": "s3cret"}}}, "$.control.secret: not here"),  # a table under [worker]
    ({"worker": {"name": "x"}}, "$.worker.name: set by the tier"),
    ({"rings": "x"}, "$.worker.rings: set by the tier"),
    ({"worker": {"control": {"dp_index": 1}}}, "$.control.dp_index: set by the tier"),
    ({"control": {"dp_index": 1}}, "$.control.dp_index: set by the tier"),
])
def test_tier_settings_refuse_what_the_tier_owns_or_must_not_pass(inline, what):
    from p2pworker.config import tier_settings

    with pytest.raises(ConfigError, match=re.escape(what)) as ei:
        tier_settings({"worker_settings": inline}, env={})
    assert "s3cret" not in str(ei.value)


@pytest.mark.parametrize("value", ["abc", "70000", "-1"])
def test_a_bad_port_in_the_environment_names_the_variable(value):
    from p2pworker.config import tier_settings

    with pytest.raises(ConfigError, match=re.escape(f"$VLLM_P2P_SIDE_CHANNEL_PORT={value!r}: not a port")):
        tier_settings({}, env={"VLLM_P2P_SIDE_CHANNEL_PORT": value})


def test_loading_changes_no_caller_dict():
    inline = {"control": {"hwm": 5}}
    cfg = load_config(None, {"control": {"port": 1}}, inline=inline)
    assert (cfg.control.hwm, cfg.control.port) == (5, 1)
    assert inline == {"control": {"hwm": 5}}
