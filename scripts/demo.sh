#!/usr/bin/env bash
# Bootstraps .venv and answers a question over the bundled sample documents with the embedded model.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
.venv/bin/ragsnap ask \
  --question "Where is the Rosetta Stone kept?" \
  --docs ragsnap/samples/*.md \
  --budget 128 "$@"
