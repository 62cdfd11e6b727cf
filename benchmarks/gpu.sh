#!/usr/bin/env bash
# `make gpu-check` (benchmarks/gpu_check.py): what a session lent a GPU for a few minutes should run first; under 10
# minutes, one JSON report (in $OUT when set, as on the device machines; else benchmarks/gpu_check.json). Arguments
# go to gpu_check.py (--only step,step ...; --device cuda:1).
# Runs from a plain checkout: mtcli itself is read from here (PYTHONPATH), never installed, so a device machine with
# torch and the dependencies but no network can run it; a missing dependency is named, not installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ] && PY=$PWD/.venv/bin/python
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# from another folder: `python -c` would put this checkout on sys.path itself and hide a missing PYTHONPATH
if ! missing=$(cd / && $PY -c "import mtcli.train" 2>&1); then
  echo "gpu-check: mtcli cannot be imported from this checkout with $PY: ${missing##*$'\n'}"
  exit 1
fi
PYTHONUNBUFFERED=1 exec $PY benchmarks/gpu_check.py "$@"
