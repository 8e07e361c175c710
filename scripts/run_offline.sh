#!/usr/bin/env bash
# The README's main-job command: set up the CPU profile (idempotent), then run the offline default end to end.
# Extra arguments go to scripts/train.py (e.g. --max_steps 2).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1
exec .venv/bin/python scripts/offline_job.py "$@"
