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
    with pytest.raises(ConfigError, match=re.escape("$.nmae: unknown key")):
        load_config(str(p))


@pytest.mark.parametrize("text,path,what", [
    ("[control]\nport = '5710'\n", "$.control.port", "Expected `int | null`, got `str`"),
    ("[control]\nport = 70000\n", "$.control.port", "<= 65535"),
    ("[control]\nheartbeat_interval_s = -1\n", "$.control.heartbeat_interval_s", "> 0.0"),
    ("[data]\nbackend = 'nixxl'\n", "$.data.backend", "Invalid enum value 'nixxl'"),
    ("[worker]\nprefault = 'yes'\n", "$.prefault", "Expected `bool`"),
    ("[session]\nload_timeout_s = 7200\n", "$.session.load_timeout_s", "<= 3600"),
    ("[control]\nmax_frame_bytes = 1024\n", "$.control.max_frame_bytes", ">= 4194304"),
    ("session = 3\n", "$.session", "must be a table"),
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
