"""Run the fault suite and write its measured figures into the reliability table of docs/reliability.md.

    python scripts/reliability_table.py [--print-only]

Runs ``pytest tests/fault`` in ``.venv`` and ``tests/fault/test_adapter_faults.py`` in ``.venv-vllm033``
(if present) with ``P2PWORKER_FIGURES`` pointing at a scratch file; every test records what it measured
(``tests/helpers/fault.py: figure``).  The table between the markers in docs/reliability.md is replaced.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # scripts/ is one level down too
BEGIN, END = "<!-- reliability-table:begin -->", "<!-- reliability-table:end -->"


def run(python: str, args: list[str], figures: str) -> int:
    env = {**os.environ, "P2PWORKER_FIGURES": figures}
    return subprocess.call([python, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args], cwd=ROOT, env=env)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--print-only", action="store_true", help="print the table only")
    a = ap.parse_args()
    with tempfile.NamedTemporaryFile("r", suffix=".jsonl", delete=False) as f:
        path = f.name
    try:
        codes = [run(os.path.join(ROOT, ".venv/bin/python"), ["tests/fault"], path)]
        v033 = os.path.join(ROOT, ".venv-vllm033/bin/python")
        if os.path.exists(v033):
            codes.append(run(v033, ["tests/fault/test_adapter_faults.py"], path))
        with open(path) as f:
            rows = [json.loads(line) for line in f if line.strip()]
    finally:
        os.unlink(path)
    lines = [f"Measured by `python scripts/reliability_table.py` on {time.strftime('%Y-%m-%d')} "
             f"(exit codes {codes}; 2-core VM):", "", "| promise | measured | bound |", "|---|---|---|"]
    lines += [f"| {r['promise']} | {r['measured'].replace('|', '/')} | {r['bound']} |" for r in rows]
    table = "\n".join(lines)
    print(table)
    if not a.print_only:
        page = os.path.join(ROOT, "docs", "reliability.md")
        text = open(page).read()
        if BEGIN not in text or END not in text:
            print(f"docs/reliability.md has no {BEGIN} ... {END} markers", file=sys.stderr)
            return 2
        head, rest = text.split(BEGIN, 1)
        _, tail = rest.split(END, 1)
        with open(page, "w") as f:
            f.write(f"{head}{BEGIN}\n{table}\n{END}{tail}")
    return max(codes)


if __name__ == "__main__":
    sys.exit(main())
