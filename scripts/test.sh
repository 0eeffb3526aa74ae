#!/usr/bin/env bash
# Bootstraps .venv (with test tools) and runs the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh dev
.venv/bin/python -m pytest -q "$@"
