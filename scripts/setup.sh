#!/usr/bin/env bash
# Create .venv and install everything PGVI needs (torch from the local wheel cache, Flower 1.39, test tools).
# Idempotent: a second run only checks.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
if ! .venv/bin/python -c "import torch, torchvision" 2>/dev/null; then
  .venv/bin/pip install -q torch==2.14.1 torchvision==0.29.1
fi
.venv/bin/pip install -q -e ".[simulation,data,dev]"
