#!/usr/bin/env bash
# One prepared GPU benchmark call (fits one device call of under 8 minutes on an H200):
#   bash benchmarks/gpu.sh            Transformer-base, bf16 autocast, eager and torch.compile, beam-4 decoding
#   bash benchmarks/gpu.sh --tiny     the same logic with a tiny model, e.g. on a CPU, to check the script
# Runs from a plain checkout: mtcli itself is read from here (PYTHONPATH), never installed, so a device machine with
# torch and the dependencies but no network can run it; a missing dependency is named, not installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ] && PY=.venv/bin/python
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# from another folder: `python -c` would put this checkout on sys.path itself and hide a missing PYTHONPATH
if ! missing=$(cd / && $PY -c "import mtcli.train" 2>&1); then
  echo "gpu.sh: mtcli cannot be imported from this checkout with $PY: ${missing##*$'\n'}"
  exit 1
fi
$PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count())"
out=${OUT:-benchmarks}
PYTHONUNBUFFERED=1 timeout 450 $PY benchmarks/gpu_bench.py --out "$out/gpu_results.json" "$@"
