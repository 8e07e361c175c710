#!/usr/bin/env bash
# On a GPU machine with no package index (run from the repo root): unpack what scripts/gpu_bundle.sh packed, build
# the offline model from its GGUF, and write the environment to source: /root/searchr1_env.sh.
#   bash scripts/gpu_setup.sh <folder holding site.tar.xz.NN and assets.tar.NN> && source /root/searchr1_env.sh
set -euo pipefail
UP=${1:?folder with the bundle pieces}
SITE=${SEARCHR1_SITE:-/opt/searchr1_site}
CACHE=${SEARCHR1_CACHE:-$HOME/.cache/searchr1_trl}
mkdir -p "$SITE" "$CACHE/wheels"
cat "$UP"/site.tar.xz.* | xz -dc -T0 | tar x -C "$SITE"
cat "$UP"/assets.tar.* | tar x -C "$CACHE"
cat > /root/searchr1_env.sh <<ENV
export PYTHONPATH=$SITE:$PWD HF_HUB_OFFLINE=1 SEARCHR1_CACHE=$CACHE PATH=$SITE/bin:\$PATH
export VLLM_HOST_IP=127.0.0.1  # keeps TRL's NCCL weight-transfer rendezvous on loopback
ENV
source /root/searchr1_env.sh
python3 -m searchr1_trl.assets
python3 -c "import vllm, trl, transformers, torch; print('vllm', vllm.__version__, 'trl', trl.__version__, \
'transformers', transformers.__version__, 'torch', torch.__version__, 'gpus', torch.cuda.device_count())"
