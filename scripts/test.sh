#!/usr/bin/env bash
# The README's test command: set up the CPU profile (idempotent), lint, then run the whole suite. The tests start every
# server they need (vLLM on CPU, the retrieval server). Extra arguments go to pytest, e.g. -m "not slow".
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1
# glibc keeps freed blocks below its adaptive mmap threshold (up to 32 MiB) in the heap: a test process that freed a
# model still holds it. Mapped blocks of 1 MiB and more go back at once (the suite's peak: tests/suite_memory.py).
export MALLOC_MMAP_THRESHOLD_=${MALLOC_MMAP_THRESHOLD_:-1048576}
# A run whose processes together exceed 13 GiB (14 GB) fails, naming the test that ran at the peak.
export SEARCHR1_SUITE_MEMORY_GIB=${SEARCHR1_SUITE_MEMORY_GIB:-13}
.venv/bin/ruff check .
exec .venv/bin/python -m pytest -q -ra --durations=15 "$@"
