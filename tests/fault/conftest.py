"""Fault suite fixtures: the nodes a test makes (closed at its end, their data path checked) and the figures it
measured (written for scripts/reliability_table.py).  The harness itself: tests/helpers/fault.py."""

from __future__ import annotations

import json
import os

import pytest

from tests.helpers.fault import Node

try:  # test_adapter_faults.py needs vLLM (it runs in the vLLM venvs, see scripts/test.sh)
    import vllm  # noqa: F401
except ImportError:
    collect_ignore = ["test_adapter_faults.py"]


@pytest.fixture
def data_path(request) -> str:
    """The data path the test's nodes use: "same_host" (the default: every node runs on this host) or "nixl"
    (parametrize with indirect=True to run a test on both)."""
    return getattr(request, "param", "same_host")


@pytest.fixture
def nodes(shm_prefix, tmp_path, data_path):
    made: list[Node] = []

    def make(name: str, **kw) -> Node:
        kw.setdefault("data_path", data_path)
        n = Node(name, shm_prefix, tmp_path, **kw)
        made.append(n)
        return n

    yield make
    try:
        for n in made:  # the test ran on the path it says (sessions still up at its end)
            if n.client is not None and n.client.alive():
                n.check_data_path(require=False)
    finally:  # a failed check must not leave the workers running (they would load every later test)
        for n in made:
            try:
                n.close()
            finally:
                n.region.close()


@pytest.fixture(scope="session")
def figures():
    """Measured figures; written to $P2PWORKER_FIGURES (JSON lines) for scripts/reliability_table.py."""
    rows: list[dict] = []
    yield rows
    path = os.environ.get("P2PWORKER_FIGURES")
    if path:
        with open(path, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
