#!/usr/bin/env bash
# One prepared GPU benchmark call (fits one device call of under 8 minutes on an H200):
#   bash benchmarks/gpu.sh            Transformer-base, bf16 autocast, eager and torch.compile, beam-4 decoding
#   bash benchmarks/gpu.sh --tiny     the same logic with a tiny model, e.g. on a CPU, to check the script
# Installs the project into a fresh venv if mtcli is not importable (the device machine starts bare).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! $PY -c "import mtcli.train" 2>/dev/null; then
  if [ -x .venv/bin/python ] && .venv/bin/python -c "import mtcli.train" 2>/dev/null; then
    PY=.venv/bin/python
  else
    $PY -m pip install --quiet -e . || { echo "gpu.sh: could not install mtcli"; exit 1; }
  fi
fi
$PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count())"
out=${OUT:-benchmarks}
PYTHONUNBUFFERED=1 timeout 450 $PY benchmarks/gpu_bench.py --out "$out/gpu_results.json" "$@"
