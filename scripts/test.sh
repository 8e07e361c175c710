#!/usr/bin/env bash
# The README's test command: set up the CPU profile (idempotent), lint, then run the whole suite. The tests start every
# server they need (vLLM on CPU, the retrieval server). Extra arguments go to pytest, e.g. -m "not slow".
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1
.venv/bin/ruff check .
exec .venv/bin/python -m pytest -q -ra --durations=15 "$@"
