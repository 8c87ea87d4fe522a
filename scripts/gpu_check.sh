#!/usr/bin/env bash
# Check a CUDA machine end to end, with specserve installed there (`pip install '.[worker,gpu]'`,
# ideally after `specserve kernels flashinfer --arch <this GPU> --head-dims 64 128 256` so that
# nothing compiles during the check):
#   1. the FlashInfer backend against the torch backend (tests/worker/test_flashinfer_gpu.py);
#   2. the decode benchmark with its profile (bench/gpu.py; docs/benchmarks.md has results);
#   3. a GPU start as a user does it (scripts/gpu_start_check.py): `specserve up --device cuda:0`
#      on a random checkpoint, greedy requests through the SDK with FlashInfer and with torch,
#      which must agree up to near ties.
#   PYTHON=python3 bash scripts/gpu_check.sh        (default PYTHON: .venv/bin/python)
set -u
PY=${PYTHON:-.venv/bin/python}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
status=0

echo "== 1. FlashInfer against torch"
(cd "$ROOT" && $PY -m pytest -q -rs tests/worker/test_flashinfer_gpu.py) || status=1

echo "== 2. decode benchmark"
(cd "$ROOT" && $PY bench/gpu.py --models llama3-8b --profile) || status=1

echo "== 3. GPU start"
(cd "$ROOT" && $PY scripts/gpu_start_check.py) || status=1
exit $status
