#!/usr/bin/env bash
# Installing p2pworker into an image whose torch is newer than any release we know must leave that torch alone.
# The two vLLM venvs cannot show it (both ship a torch the former `torch>=2.13,<2.15` accepted), so this plants a
# stand-in `torch 9.9.0` (a bare .dist-info) in a scratch venv and asks pip what `pip install p2pworker[EXTRA]`
# would do there (--dry-run --report): torch must not be among what it installs.  scripts/test.sh runs it as a
# suite; with the former requirement it fails ("would replace the installed torch with torch==2.14.1").
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
EXTRA=${NIXL_EXTRA:-cu13}
d=$(mktemp -d)
trap 'rm -rf "$d"' EXIT
"$PY" -m venv "$d/venv" || exit 1
"$d/venv/bin/python" scripts/pip_delta.py --fake-dist "$d/venv" torch 9.9.0 || exit 1
# A machine-wide cap on torch (these machines' /etc/xdg/pip caps it at 2.14.1) is not what we test: pip's own
# settings, minus `constraint`, into a config file pip loads instead (PIP_CONSTRAINT="" does not lift it).
"$d/venv/bin/python" scripts/pip_delta.py --pip-conf-without-constraint "$d/pip.conf" || exit 1
if ! PIP_CONFIG_FILE="$d/pip.conf" "$d/venv/bin/python" -m pip install -q --dry-run --report "$d/report.json" \
     -e ".[$EXTRA]"; then
  echo "check_install: pip could not resolve p2pworker[$EXTRA] beside a stand-in torch 9.9.0 (see above)" >&2
  exit 1
fi
"$d/venv/bin/python" scripts/pip_delta.py --would-install "$d/report.json" torch
