#!/usr/bin/env bash
# The GPU runs behind experiments/results/, each step one command, as run on the lent H100/H200 machines after
# `bash scripts/gpu_setup.sh <pieces>` there (docs/gpu_machines.md). Each step writes under $RUNS (default ~/runs).
# EAGER=1: the jobs' vLLM servers without CUDA graphs. A learning step's variants are named in experiments/variants.yaml.
#   sync_checks                      vLLM on GPUs 0 and 1: NCCL, tmpfs reload and CUDA IPC pushes, log-prob checks
#   sync_checks_1gpu                 the reload and IPC checks on GPU 0 of a one-GPU host
#   learn_x2                         offline_gpu, generator GPU 0, trainer GPU 1 (accelerate), NCCL push
#   learn_1gpu                       offline_gpu as committed on GPU 0, and validated on the first 200 dev rows on GPU 1
#   journey_1gpu                     one GPU, ~8 min: the README's journey as written, searchr1-launch --config
#                                    offline_gpu (module form), in $RUNS/journey_1gpu
#   journey_seeds "<seeds>"          one GPU, ~6 min a seed, in series: the same launch with --seed each, in
#                                    $RUNS/journey_s<seed> (seed 42 is the recipe's default)
#   journey_overlap ["<rounds>"]     one GPU, ~8 min a launch, in series: the launch as is, then with
#                                    generator_startup_overlap, per round (default 2 rounds); wall times in
#                                    $RUNS/journey_overlap.txt
#   tags_pair ["<seeds>"]            one GPU, ~10 min + ~3 min an eval: the tag protocol and tool calls, one seed of
#                                    each side by side (default 0), then searchr1-eval of each checkpoint on the report
#                                    sample, one after the other, in $RUNS/tags_pair and $RUNS/eval_<run>
#   qwen3_1_7b                       the qwen3_1_7b recipe's mechanics with a random-weight Qwen3-1.7B
#   beat_rag <gpu> <seed> [flags]    offline_gpu on one GPU, warm start + GRPO
#   eval_table <gpu> <name> <ckpt>.. direct / rag / agent on 500 seeded questions
#   performance                      one GPU, ~10 min: the retriever against a one-request-at-a-time server, its
#                                    stages, and the policy update's MFU
#   update_0_5b                      one GPU, ~4 min: offline_gpu's update in fewer, larger, packed or compiled batches
#   trainer_compile ["<variants>"]   one GPU, ~3 min a variant, in series: 12 GRPO steps eager, compiled, packed, both
#   update_1_7b ["<flags>"]          one GPU, ~6 min: the qwen3_1_7b recipe's update, eager and compiled, with and
#                                    without its activation checkpointing
#   zero3_1gpu                       one GPU, ~2 min: Qwen3-1.7B's step through ZeRO-3 in one process, its MFU
#   e2e_alone ["<variants>"]         one GPU, in series: the recipe's first 30 GRPO steps, each variant alone on the
#                                    GPU (default "async_guard sync"); SEEDS="0 1 2" runs each seed in turn; then
#                                    `python -m experiments.learning report $RUNS/e2e_alone --baseline sync`
#   recipe_alone ["<variants>"]      one GPU, in series: the recipe's whole run (warm start, 50 steps, validations)
#                                    alone on the GPU, default "sync"; SEEDS="0 1 2" runs each seed in turn
#   rollouts_wiki ["<flags>"]        one GPU, ~4 min: our engine against TRL's tool loop over a 21M x 768 index
#   learning_sibling "<seeds>"       one GPU, ~18 min: the recipe on the 1.5B sibling, two seeds at most side by side
#                                    (bundle with BUNDLE_SIBLING=1)
#   eval_sibling                     one GPU: that model's closed-book and RAG on the report sample
#   learning_levers ["<variants>" [gpu]]  one GPU, ~22 min: 3 seeds of each variant side by side (default
#                                    "clip20 warmup10"); SEEDS="3 4 5" for others
#   async_e2e "<variants>" [gpu]     3 seeds of each variant side by side, one table, the speedup over the first
set -euo pipefail
cd "$(dirname "$0")/.."
source "${SEARCHR1_ENV_FILE:-$HOME/searchr1_env.sh}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
RUNS=${RUNS:-$HOME/runs}
CACHE=${SEARCHR1_CACHE:-$HOME/.cache/searchr1_trl}
MODEL=$CACHE/models/Qwen2.5-Coder-0.5B-Instruct
SIBLING=$CACHE/models/Qwen2.5-Coder-1.5B-Instruct  # searchr1-assets --sibling; bundled with BUNDLE_SIBLING=1
mkdir -p "$RUNS"

EAGER=${EAGER:+--generator_enforce_eager true}  # EAGER=1: no CUDA graphs in the jobs' vLLM servers
LIGHT_SAVES="--save_only_model true --save_total_limit 1"  # runs side by side: full checkpoints would fill the disk

# The flags a named variant lays over offline_gpu (experiments/variants.yaml); an unknown name fails, naming them all.
variant_flags() {
  python3 -m experiments.variants "$1"
}

# seeded_batch OUT "NAMES" [experiments.learning run flags]: the seeds $SEEDS (default 0 1 2) of each named variant side
# by side, one table; $BATCH_FLAGS go to every run before the variant's own.
seeded_batch() {
  local out=$1 names=$2 name flags variants=()
  shift 2
  for name in $names; do
    flags=$(variant_flags "$name") || exit 2
    variants+=(--variant "$name=$LIGHT_SAVES ${BATCH_FLAGS:-} $flags")
  done
  python3 -m experiments.learning run --out "$RUNS/$out" --seeds ${SEEDS:-0 1 2} ${EAGER:+--eager} "${variants[@]}" "$@"
}

# in_series OUT "NAMES" FLAGS: each seed of $SEEDS (default 0) of each named variant alone on the GPU, one after
# another (side by side each run times the others' share of the GPU), FLAGS to every run, the speedups over the
# first name.
in_series() {
  local out=$1 names=$2 name seed
  for name in $names; do variant_flags "$name" > /dev/null || exit 2; done  # every name checked before any run
  for seed in ${SEEDS:-0}; do
    for name in $names; do SEEDS=$seed BATCH_FLAGS=$3 seeded_batch "$out" "$name" --baseline "${names%% *}"; done
  done
}

# The qwen3_1_7b recipe's own update (packed ragged rollouts, one GPU without DeepSpeed), eager and compiled, without
# its activation checkpointing first (the MFU it leaves), then with it.
# $1: more flags, e.g. "--attn flex_attention" (packed rows through FlexAttention's block mask instead of SDPA's dense
# one).
update_1_7b() {
  for checkpointing in "" --activation_checkpointing; do
    for lever in "" --compile_layers; do
      python3 -m experiments.policy_update --model Qwen/Qwen3-1.7B --seq 2048 --batch 8 --dtype bfloat16 \
        --fp32_master_weights $checkpointing --ragged --padding_free $lever ${1:-} --out "$RUNS/policy_update.jsonl"
    done
  done
}

case "${1:?step}" in
  sync_checks)
    python3 -m experiments.sync_checks --model "$MODEL" --questions "$CACHE/data/squad_open/test.parquet" \
      --out "$RUNS/weight_sync.jsonl" --log_dir "$RUNS" ;;
  sync_checks_1gpu)
    python3 -m experiments.sync_checks --model "$MODEL" --questions "$CACHE/data/squad_open/test.parquet" \
      --out "$RUNS/weight_sync.jsonl" --log_dir "$RUNS" --checks reload ipc --trainer_gpu 0 ;;
  learn_x2)
    python3 scripts/offline_job.py --config offline_gpu --corpus full --output_dir "$RUNS/learn_x2" \
      --generator vllm --weight_sync nccl --generator_gpus 0 --trainer_gpus 1 --retriever_gpus 1 \
      $EAGER ;;
  journey_1gpu)  # the plan, the index build, the servers and the trainer exactly as a user's one-GPU launch
    python3 -m searchr1_trl.cli.launch --config offline_gpu --output_dir "$RUNS/journey_1gpu" \
      > "$RUNS/journey_1gpu.log" 2>&1 ;;
  journey_seeds)  # does the launch collapse on some seeds only? sampling/sampling_logp_difference/* says whose fault
    for seed in ${2:-42 0}; do
      python3 -m searchr1_trl.cli.launch --config offline_gpu --seed "$seed" --output_dir "$RUNS/journey_s$seed" \
        > "$RUNS/journey_s$seed.log" 2>&1 || echo "journey seed $seed exited $?" >> "$RUNS/journey_seeds.txt"
    done ;;
  tags_pair)  # issue 58's same-session pair. Not more runs side by side: a tool-call warm start beside three tag
    # trainers ran out of GPU memory, and so did one beside an in-process evaluation (40 GiB at concurrency 256 while
    # the in-process generator kept every step's scores; evaluations still run after training)
    for seed in ${2:-0}; do
      python3 -m experiments.learning run --out "$RUNS/tags_pair" --config offline_gpu_tags --seeds "$seed" --shared_gpu \
        --variant tags="$LIGHT_SAVES" &
      sleep 30  # the index builds and model loads overlap less
      python3 -m experiments.learning run --out "$RUNS/tags_pair" --config offline_gpu --seeds "$seed" --shared_gpu \
        --base_port 8400 --variant toolcall="$LIGHT_SAVES"
      wait
    done
    python3 -m experiments.learning report "$RUNS/tags_pair" > "$RUNS/tags_pair.md"
    for run in "$RUNS"/tags_pair/*_s*; do  # apart: searchr1-eval refuses checkpoints of two tasks in one table
      python3 scripts/eval_offline.py --checkpoints "$run" --corpus full --num_samples 500 --sample_offset 500 \
        --methods agent --generator transformers --max_concurrency 256 --index_path "$run/data/index.faiss" \
        --output_dir "$RUNS/eval_$(basename "$run")"
    done ;;
  journey_overlap)  # the launch as is and with generator_startup_overlap, alternating, warm caches after the first
    # pair: does starting the trainer beside vLLM cut the launch's wall time, and does the card hold both start-ups?
    for round in ${2:-1 2}; do
      for overlap in false true; do
        start=$(date +%s)
        python3 -m searchr1_trl.cli.launch --config offline_gpu --generator_startup_overlap "$overlap" \
          --output_dir "$RUNS/journey_overlap_${overlap}_$round" > "$RUNS/journey_overlap_${overlap}_$round.log" 2>&1
        echo "overlap=$overlap round=$round rc=$? wall_s=$(( $(date +%s) - start ))" >> "$RUNS/journey_overlap.txt"
      done
    done ;;
  learn_1gpu)
    sed '/^eval_sample_seed/d; s/^eval_num_samples: 500/eval_num_samples: 200/' configs/offline_gpu.yaml \
      > configs/offline_gpu_first200.yaml
    python3 scripts/offline_job.py --config offline_gpu --corpus full --output_dir "$RUNS/learn_1gpu" \
      --generator_gpus 0 --trainer_gpus 0 --retriever_gpus 0 $EAGER > "$RUNS/learn_1gpu.log" 2>&1 &
    python3 scripts/offline_job.py --config offline_gpu_first200 --corpus full --output_dir "$RUNS/learn_1gpu_first200" \
      --generator_gpus 1 --trainer_gpus 1 --retriever_gpus 1 --search_url http://127.0.0.1:8010/retrieve \
      --vllm_server_base_url http://127.0.0.1:8011 $EAGER \
      > "$RUNS/learn_1gpu_first200.log" 2>&1 &
    wait ;;
  qwen3_1_7b)
    python3 -m experiments.random_checkpoint --model Qwen/Qwen3-1.7B --out "$HOME/qwen3_1_7b"
    python3 scripts/offline_job.py --config qwen3_1_7b --model "$HOME/qwen3_1_7b" --corpus full \
      --output_dir "$RUNS/qwen3_1_7b" --generator_gpus 0 --trainer_gpus 1 --retriever_gpus 1 \
      --vllm_gpu_memory_utilization 0.5 --vllm_tensor_parallel_size 1 --max_steps 3 --eval_strategy no \
      --eval_on_start false --report_to none --save_strategy no ;;
  beat_rag)
    gpu=${2:?gpu} seed=${3:?seed}; shift 3
    python3 scripts/offline_job.py --config offline_gpu --corpus full --output_dir "$RUNS/beat_rag_s$seed" \
      --generator_gpus "$gpu" --trainer_gpus "$gpu" --retriever_gpus "$gpu" \
      --search_url http://127.0.0.1:$((8100 + 10 * seed))/retrieve \
      --vllm_server_base_url http://127.0.0.1:$((8101 + 10 * seed)) $EAGER \
      --seed "$seed" --data_seed "$seed" "$@" ;;
  async_e2e)  # the modes given ("sync_ipc async_ipc") side by side, 3 seeds each: one table in $RUNS/async_e2e
    modes=${2:?modes, e.g. "sync_ipc async_ipc"}
    seeded_batch async_e2e "$modes" --gpu "${3:-0}" --baseline "${modes%% *}" ;;
  learning_sibling)  # a run holds ~48 GB (trainer ~38, vLLM ~8, retriever ~1.5): two seeds at most fit one H200
    seeds=${2:?seeds, two at most: "0 2", then "1"}
    [ "$(wc -w <<< "$seeds")" -le 2 ] || { echo "learning_sibling: $seeds; two seeds at most fit one H200" >&2; exit 2; }
    [ -d "$SIBLING" ] || { echo "no $SIBLING: searchr1-assets --sibling, bundle with BUNDLE_SIBLING=1" >&2; exit 2; }
    SEEDS=$seeds seeded_batch learning_sibling q15 --kv_cache_gib 2 ;;
  eval_sibling)  # apart from the batch: upload, setup and the batch take ~26 of a session's 30 device minutes
    python3 scripts/eval_offline.py --checkpoints "$SIBLING" --corpus full --num_samples 500 --sample_offset 500 \
      --methods direct rag --generator transformers --max_concurrency 256 --retriever_port 8200 \
      --output_dir "$RUNS/eval_sibling_report" ;;
  learning_levers)  # levers over the recipe as committed, 3 seeds each side by side;
    # $3: the GPU (default 0): on a two-GPU host a second batch runs on GPU 1 beside the first, on ports of its own,
    # into learning_levers_gpu1
    gpu=${3:-0} out=learning_levers
    [ "$gpu" = 0 ] || out+=_gpu$gpu
    seeded_batch "$out" "${2:-clip20 warmup10}" --kv_cache_gib 2 --gpu "$gpu" --base_port $((8100 + 100 * gpu)) ;;
  eval_table)  # the retriever on that GPU's host, each checkpoint in-process on that GPU
    gpu=${2:?gpu} name=${3:?name}; shift 3
    CUDA_VISIBLE_DEVICES=$gpu python3 scripts/eval_offline.py --checkpoints "$@" --corpus full --num_samples 500 \
      --generator transformers --max_concurrency 256 --retriever_port 8200 --output_dir "$RUNS/eval_$name" ;;
  update_0_5b)  # what is left in series once rollouts overlap it and the push is fast
    for lever in "--batch 8 --accumulation 8" "--batch 16 --accumulation 4" "--batch 32 --accumulation 2" \
                 "--batch 8 --accumulation 8 --padding_free" "--batch 16 --accumulation 4 --padding_free" \
                 "--batch 8 --accumulation 8 --compile_layers"; do
      python3 -m experiments.policy_update --model "$MODEL" --seq 1024 --ragged $lever \
        --out "$RUNS/policy_update_0_5b.jsonl"
    done ;;
  trainer_compile)  # the trainer's own step: eager, compiled decoder layers, packed rows, both; 12 steps each from
    # the base model; $2: the variants, default all four
    EAGER=1 in_series trainer_compile_serial "${2:-eager compiled packed compiled_packed}" \
      "--warm_start_traces 0 --max_steps 12 --eval_steps 12 --save_steps 12 --report_num_samples 0 --eval_num_samples 200" ;;
  e2e_alone)  # end to end: the recipe's first 30 GRPO steps (warm start, evaluations every 10 steps
    # included as committed), each mode alone on the GPU with CUDA graphs; the speedups over the first mode
    in_series e2e_alone "${2:-async_guard sync}" "--max_steps 30" ;;
  recipe_alone)  # the recipe's whole run (warm start, 50 GRPO steps, every validation) alone on the GPU, each
    # variant and seed in turn (default "sync": the recipe as committed; "light" for its earlier update)
    in_series recipe_alone "${2:-sync}" "" ;;
  rollouts_wiki)  # our engine against TRL's tool loop, 512 rollouts, the index padded to wiki-18's 21M x 768;
    # $2: more retrieval server flags, e.g. "--device cpu" (its encoder on the host's cores)
    python3 -m experiments.rollout_throughput --num_questions 512 --backends vllm trl --repeats 2 --vllm_gpu 0 \
      --pad_index_rows 21000000 --pad_index_dim 768 --vllm_gpu_memory_utilization 0.5 --retriever_args="${2:-}" \
      --out "$RUNS/rollout_throughput_wiki.jsonl" ;;
  performance)
    for load in "64 1" "8 64"; do
      read -r clients queries <<<"$load"
      python3 -m experiments.retriever_load --clients "$clients" --processes 4 --queries_per_request "$queries" \
        --duration_s 20 --modes on,reference --search_threads 2 --out "$RUNS/retriever_load.jsonl"
    done
    for queries in 64 512; do
      OMP_WAIT_POLICY=PASSIVE python3 -m experiments.retriever_profile --queries_per_request "$queries" \
        --out "$RUNS/retriever_profile.jsonl"
    done
    for batch in 8 16; do
      python3 -m experiments.policy_update --model Qwen/Qwen3-1.7B --seq 2048 --batch "$batch" --dtype bfloat16 \
        --fp32_master_weights --out "$RUNS/policy_update.jsonl"
    done
    for lever in "" --compile_layers; do
      python3 -m experiments.policy_update --model Qwen/Qwen3-8B --seq 2048 --batch 4 --dtype bfloat16 $lever \
        --out "$RUNS/policy_update.jsonl"
    done
    python3 -m experiments.policy_update --model Qwen/Qwen3-1.7B --seq 2048 --batch 8 --dtype bfloat16 \
      --fp32_master_weights --compile_layers --out "$RUNS/policy_update.jsonl"
    update_1_7b ;;
  update_1_7b) update_1_7b "${2:-}" ;;
  zero3_1gpu)  # the trainer's own step through DeepSpeed ZeRO-3 in one process (compile_layers is refused there):
    # Qwen3-1.7B and its MFU, as the ZeRO-3 recipes' update runs on each GPU (needs the bundle's DeepSpeed)
    python3 -m accelerate.commands.launch --config_file accelerate_configs/zero3.yaml --num_processes 1 \
      -m experiments.zero3_update --model Qwen/Qwen3-1.7B --per_device_batch 8 --seq 2048 --steps 5 \
      --activation_checkpointing --out "$RUNS/zero3_update.jsonl" ;;
  *) echo "unknown step $1" >&2; exit 2 ;;
esac
