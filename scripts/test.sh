#!/usr/bin/env bash
# Bootstraps .venv (with test tools), installs what the tests need when it is missing
# (redis-server; Debian's chromium for the playground's browser test), runs the suite.
set -euo pipefail
cd "$(dirname "$0")/.."
missing=()
command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
command -v chromium >/dev/null 2>&1 || missing+=(chromium)
if [ ${#missing[@]} -gt 0 ]; then
  sudo_cmd=""
  [ "$(id -u)" -eq 0 ] || sudo_cmd="sudo"
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq "${missing[@]}" >/dev/null
fi
bash scripts/bootstrap.sh dev
.venv/bin/python -m pytest -q "$@"
