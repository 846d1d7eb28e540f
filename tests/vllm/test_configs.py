"""The shipped --kv-transfer-config snippets load in this vLLM: spec class, tier class, worker config."""

import glob
import importlib
import json
import os
import re

import pytest
from vllm.v1.kv_offload.factory import OffloadingSpecFactory
from vllm.v1.kv_offload.tiering.base import SecondaryTierManager

from p2pworker.config import load_config
from p2pworker.errors import P2PError
from vllm_adapter.tier import tier_settings

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SNIPPETS = sorted(glob.glob(os.path.join(ROOT, "configs", "vllm-*.json")))


def test_there_are_snippets():
    assert {os.path.basename(p) for p in SNIPPETS} >= {"vllm-prefill.json", "vllm-decode.json",
                                                       "vllm-cpu-prefill.json", "vllm-cpu-decode.json"}


@pytest.mark.parametrize("path", SNIPPETS, ids=os.path.basename)
def test_snippet_resolves(path):
    with open(path) as f:
        cfg = json.load(f)
    assert cfg["kv_connector"] == "OffloadingConnector"
    extra = cfg["kv_connector_extra_config"]
    spec_cls = OffloadingSpecFactory.get_spec_cls(extra)
    assert spec_cls.__name__ == extra["spec_name"]
    assert int(extra["cpu_bytes_to_use"]) > 0
    (tier,) = extra["secondary_tiers"]
    tier_cls = getattr(importlib.import_module(tier["module_path"]), tier["type"])
    assert issubclass(tier_cls, SecondaryTierManager)
    assert "worker_config" not in tier, "shipped snippets carry their worker settings inline (no relative path)"
    own = {k: v for k, v in tier.items() if k not in ("type", "module_path")}  # what vLLM passes the tier
    _, wc = tier_settings(own)  # typed and range-checked: raises on an unknown or invalid key
    role = "prefill" if "prefill" in os.path.basename(path) else "decode"
    assert wc.role == role and wc.control.port == tier["port"]
    assert wc == load_config(os.path.join(ROOT, "configs", f"{role}.toml"), {"name": "p2pworker"}), \
        "the inline settings of the JSON snippet and configs/<role>.toml say different things"


@pytest.mark.parametrize("bad,what", [
    ({"prot": 5710}, "unknown field `prot`"),
    ({"port": "5710"}, "$.port"),
    ({"backend": "nixxl"}, "$.backend"),
    ({"worker_stall_s": -1}, "$.worker_stall_s"),
    ({"worker_settings": {"control": {"port": "x"}}}, "worker_settings: $.control.port"),
    ({"worker_settings": {"sesion": {}}}, "worker_settings: $.sesion: unknown key"),
    ({"worker_config": "/no/such.toml"}, "worker_config: [Errno 2]"),
])
def test_tier_keys_are_typed_and_unknown_ones_refused(bad, what):
    with pytest.raises(P2PError, match=re.escape(what)) as ei:
        tier_settings(bad)
    assert "kv_connector_extra_config.secondary_tiers" in str(ei.value)
