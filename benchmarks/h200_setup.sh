#!/usr/bin/env bash
# On a bare H200 machine (no package index): unpack the bundle that was carried over in 60 MB chunks (offline
# assets' GGUF, MiniLM, SQuAD-open files, and wheels of what the image lacks), install the wheels, build the
# offline model. Run from the repo root; prints the environment to source afterwards.
set -euo pipefail
cat /root/up/chunk* | tar xz -C /
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site /whl_nopa/*.whl
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1
python3 -m searchr1_trl.assets
