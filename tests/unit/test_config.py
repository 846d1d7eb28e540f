"""Worker config files: the shipped examples load; unknown keys are refused with their names."""

from __future__ import annotations

from pathlib import Path

import pytest

from p2pworker.config import load_config

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
    with pytest.raises(ValueError, match="unknown config key control.'prot'"):
        load_config(str(p))
    p.write_text("[worker]\nnmae = 'x'\n")
    with pytest.raises(ValueError, match="worker.'nmae'"):
        load_config(str(p))
