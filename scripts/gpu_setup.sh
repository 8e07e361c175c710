#!/usr/bin/env bash
# On a GPU machine with no package index (run from the repo root): unpack what scripts/gpu_bundle.sh packed, build
# the offline model from its GGUF (when the bundle has assets; the 1.5B sibling too when BUNDLE_SIBLING=1 packed its
# GGUF), and write the environment to source ($SEARCHR1_ENV_FILE, default ~/searchr1_env.sh).
#   bash scripts/gpu_setup.sh <folder holding site.tar.xz.NN and assets.tar.NN> && source ~/searchr1_env.sh
set -euo pipefail
UP=${1:?folder with the bundle pieces}
SITE=${SEARCHR1_SITE:-/opt/searchr1_site}
CACHE=${SEARCHR1_CACHE:-$HOME/.cache/searchr1_trl}
ENV_FILE=${SEARCHR1_ENV_FILE:-$HOME/searchr1_env.sh}
REPO=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$SITE" "$CACHE/wheels"
cat "$UP"/site.tar.xz.* | xz -dc -T0 | tar x -C "$SITE"
ASSETS=$(find "$UP" -maxdepth 1 -name 'assets.tar.*' | wc -l)
[ "$ASSETS" = 0 ] || cat "$UP"/assets.tar.* | tar x -C "$CACHE"
cat > "$ENV_FILE" <<ENV
export PYTHONPATH=$SITE:$REPO HF_HUB_OFFLINE=1 SEARCHR1_CACHE=$CACHE PATH=$SITE/bin:\$PATH
export VLLM_HOST_IP=127.0.0.1  # keeps TRL's NCCL weight-transfer rendezvous on loopback
ENV
source "$ENV_FILE"
[ "$ASSETS" = 0 ] || python3 -m searchr1_trl.assets.offline
echo "installed in $SITE:" $(ls "$SITE" | grep '\.dist-info$' | sed 's/\.dist-info$//')
echo "environment: source $ENV_FILE"
