#!/usr/bin/env bash
# The GPU production path as run on an nvidia-h200-x2 machine (docs/results/history.md, "GPU production path"), after
# `bash scripts/gpu_setup.sh <pieces>` there. Each step writes under $RUNS (default ~/runs) and is one command:
# EAGER=1 bash benchmarks/gpu_path.sh learn_x2: servers without CUDA graphs.
#   bash benchmarks/gpu_path.sh sync_checks    # vLLM 0.26 on GPU 0 and 1; NCCL push (trainer GPU 1 -> server GPU 0),
#                                              # tmpfs reload and CUDA IPC pushes (trainer and server on GPU 1):
#                                              # logprob checks (benchmarks/sync_checks.py, which starts the servers)
#   bash benchmarks/gpu_path.sh sync_checks_1gpu  # the reload and IPC checks on GPU 0 of a one-GPU host
#   bash benchmarks/gpu_path.sh learn_x2       # offline_gpu, generator GPU 0, trainer GPU 1 (accelerate), NCCL
#   bash benchmarks/gpu_path.sh learn_1gpu     # offline_gpu as committed (vLLM beside the trainer, tmpfs reload) on
#                                              # GPU 0, and the same on GPU 1 validated on the first 200 dev rows
#   bash benchmarks/gpu_path.sh qwen3_1_7b     # the qwen3_1_7b recipe's mechanics with a random-weight Qwen3-1.7B
#   bash benchmarks/gpu_path.sh beat_rag <gpu> <seed> [recipe flags]  # offline_gpu on one GPU, warm start + GRPO
#   bash benchmarks/gpu_path.sh eval_table <gpu> <name> <checkpoint>...  # direct / rag / agent, 500 seeded questions
#   bash benchmarks/gpu_path.sh performance    # one GPU, ~10 min: the retriever vs the one-request-at-a-time reference
#                                              # on this host, its stages, and the policy update's MFU
#   bash benchmarks/gpu_path.sh update_0_5b    # one GPU, ~4 min: the offline_gpu recipe's update (64 rollouts, 0.5B)
#                                              # in 8 x 8 micro-batches as committed, fewer larger ones, packed, and
#                                              # with compiled layers (policy_update_0_5b.jsonl)
#   bash benchmarks/gpu_path.sh trainer_compile ["<variants>"]  # one GPU, ~3 min a variant, in series: 12 GRPO
#                                              # steps eager, compiled, packed, compiled_packed
#   bash benchmarks/gpu_path.sh update_1_7b ["<flags>"]  # one GPU, ~6 min: the qwen3_1_7b recipe's update, eager
#                                              # and compiled, with and without its activation checkpointing
#   bash benchmarks/gpu_path.sh zero3_1gpu     # one GPU, ~2 min: Qwen3-1.7B's step through ZeRO-3, one process, MFU
#   bash benchmarks/gpu_path.sh e2e_alone ["<variants>"]  # one GPU, in series: the recipe's first 30 GRPO steps
#                                              # alone on the GPU, CUDA graphs on; default async_guard (the async
#                                              # mode without checkpointing, a step the policy moved far from
#                                              # skipped; ~6 min on an H100 with its warm start) then sync (lock-step,
#                                              # the IPC push; ~8 min); `report ... --baseline sync` for the speedup.
#                                              # reload (lock-step through tmpfs, issue 23's baseline): 287 s and 275 s
#                                              # on two H100s, 228 s on an H200 (2026-12-05/06). SEEDS="0 1 2": each
#                                              # seed in turn, every run still alone
#   bash benchmarks/gpu_path.sh rollouts_wiki ["<flags>"]  # one GPU, ~4 min: engine vs TRL's tool loop, 21M x 768 index
#   bash benchmarks/gpu_path.sh learning_sibling "<seeds>"  # one GPU, ~18 min: the recipe on the 1.5B sibling,
#                                              # two seeds at most side by side (bundle with BUNDLE_SIBLING=1)
#   bash benchmarks/gpu_path.sh eval_sibling   # one GPU: that model's closed-book and RAG on the report sample (the
#                                              # bar: its RAG + 0.10; 0.438 measured on CPU)
#   bash benchmarks/gpu_path.sh learning_levers ["<levers>" [gpu]]  # one GPU, ~22 min: the recipe with each lever of
#                                              # top1 (top-1 retrieval), g16 (16 rollouts per question), nosearch (a
#                                              # no-search penalty of 0.1), clip20 (symmetric clipping), warmup10 (10
#                                              # warmup steps), steps80 (80 GRPO steps instead of 50; alone, 3 runs,
#                                              # 18 min), repair (tool-call blocks missing a brace repaired, not
#                                              # error_parse), close (a whole call left unclosed is closed by the
#                                              # engine), topp95 (top_p 0.95 for training rollouts), pages (a
#                                              # second search reads unseen passages),
#                                              # pages4 (pages, its second-search traces taught 4 times), sync_ipc
#                                              # (the recipe itself); default "clip20 warmup10": 3 seeds each side by
#                                              # side (two levers, six runs, fill one H200); SEEDS="3 4 5" for others
#   bash benchmarks/gpu_path.sh async_e2e "<modes>" [gpu]  # offline_gpu, 3 seeds of each mode side by side; modes
#                                              # of sync, async, async pausing in-flight rollouts for a push (pause),
#                                              # sync_ipc, async_ipc (the push through CUDA IPC), async_opm
#                                              # (async_ipc with TRL's off-policy sequence mask), async_trunc
#                                              # (weights clipped, not zeroed), async_safe (both), async_safe_guard
#                                              # (async_safe, a step the policy moved far from skipped; ~14 min for
#                                              # three seeds on an H200): one table in $RUNS/async_e2e, the speedup
#                                              # over the first mode
set -euo pipefail
cd "$(dirname "$0")/.."
source "${SEARCHR1_ENV_FILE:-$HOME/searchr1_env.sh}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
RUNS=${RUNS:-$HOME/runs}
CACHE=${SEARCHR1_CACHE:-$HOME/.cache/searchr1_trl}
MODEL=$CACHE/models/Qwen2.5-Coder-0.5B-Instruct
SIBLING=$CACHE/models/Qwen2.5-Coder-1.5B-Instruct  # searchr1-assets --sibling; bundled with BUNDLE_SIBLING=1
mkdir -p "$RUNS"

EAGER=${EAGER:+--generator_enforce_eager}  # EAGER=1: no CUDA graphs in the jobs' vLLM servers
LIGHT_SAVES="--save_only_model true --save_total_limit 1"  # runs side by side: full checkpoints would fill the disk

# A learning batch's named variants: the recipe flags each lays over offline_gpu.
variant_flags() {
  case "$1" in
    sync) echo "" ;;  # the recipe: lock-step, the IPC push since 2026-12-05
    reload) echo "--weight_sync reload" ;;  # lock-step through a tmpfs folder: the recipe's push until 2026-12-05
    async) echo "--async_rollouts true --max_staleness 1" ;;
    pause) echo "--async_rollouts true --max_staleness 1 --in_flight_rollouts pause" ;;
    sync_ipc|eager) echo "--weight_sync ipc" ;;  # the push through CUDA IPC (eager: no compile); = sync since 12-05
    compiled) echo "--compile_layers true --weight_sync ipc" ;;
    packed) echo "--padding_free true --weight_sync ipc" ;;
    compiled_packed) echo "--compile_layers true --padding_free true --weight_sync ipc" ;;
    nockpt) echo "--activation_checkpointing false" ;;  # the recipe keeps TRL's checkpointing (on): a second
      # forward per micro-batch, for activations of 4 rows of a 0.5B model. The update alone was 3.1 s a step where
      # benchmarks.policy_update's loop without it takes 1.04 s (docs/results/README.md, "Alone on the GPU")
    compiled_packed_nockpt) echo "$(variant_flags compiled_packed) $(variant_flags nockpt)" ;;  # every update lever
    async_ipc) echo "--async_rollouts true --max_staleness 1 --weight_sync ipc" ;;
    async_opm) echo "$(variant_flags async_ipc) --off_policy_mask_threshold 0.02" ;;
      # async_ipc with TRL's off-policy sequence mask: a negative-advantage rollout whose tokens lost more than 0.02
      # nats each, on average, since its weights sampled it leaves the loss. Normal steps' sequence weights of
      # 0.95-1.05 are gaps near 0.002; before the H100 collapse (docs/results/README.md) a mean weight of 0.61 over
      # ~33 tokens is ~0.015, at it 0.054 is ~0.09. The runs log async/behaviour_kl(_max) and off_policy_masked
    async_trunc) echo "$(variant_flags async_ipc) --vllm_importance_sampling_mode sequence_truncate" ;;  # weights
      # above 3 clipped to 3, not zeroed: in the committed async runs tokens were zeroed at 7 of 110 steps, every
      # one at or just after a jump (up to 17.5% at the step with 67% unparseable); what a mask zeroes is what the
      # drifting policy likes far more than the weights that sampled it, the errors it spreads among them
      # (async/negative_zeroed counts those)
    async_safe) echo "$(variant_flags async_opm) --vllm_importance_sampling_mode sequence_truncate" ;;  # both:
      # stale negatives the policy left dropped, those it now likes more kept, at weight 3 at most
    async_compiled_packed) echo "--async_rollouts true --max_staleness 1 --compile_layers true --padding_free true" \
      "--weight_sync ipc" ;;  # every speed lever at once
    async_safe_pause) echo "$(variant_flags async_safe) --in_flight_rollouts pause" ;;  # a push freezes the rollouts
      # in flight (vLLM's /pause) instead of waiting for them (alone on an H100 that wait was 3.1-4.7 s a push); alone
      # on an H200 it collapsed at step 13 (2026-12-05, docs/results/README.md)
    async_safe_nockpt) echo "$(variant_flags async_safe) $(variant_flags nockpt)" ;;  # the async mode with the
      # update's cheapest lever: nothing to compile, the same loss; alone on one GPU only the update stays in series
    async_safe_guard) echo "$(variant_flags async_safe) --max_behaviour_kl 0.01" ;;  # a step whose rollouts the
      # policy moved more than 0.01 nats a token from is skipped, so the next is on-policy. The committed async runs'
      # gaps: medians 0.0003-0.0015; the four that ran to the end peaked at 0.009-0.080; the H100 collapse of
      # async_safe_nockpt read 0.013 at step 7, then 0.245 (docs/results/README.md, "The update without checkpointing").
      # With the recipe's checkpointing: three seeds fit side by side over its 50 steps
    async_guard) echo "$(variant_flags async_safe_guard) $(variant_flags nockpt)" ;;  # the same loss without
      # checkpointing, for each run alone (a trainer peaked at 23.5 GiB a step, 34 GiB in its warm start, one H100)
    async_guard_compiled_packed) echo "$(variant_flags async_guard) --compile_layers true --padding_free true" ;;  # the
      # update's other levers: async_guard's 30 steps took 160-165 s on an H100, 2x the tmpfs lock-step's 287 s needs
      # ~144 s, and its update (2.2 s of a 3.5 s step) is what stays in series. On an H200 (2142228): median step 2.19
      # s, 2.73x the tmpfs lock-step's, 159.9 s end to end (1.43x), ~50 s of it compiling (docs/results/README.md)
    async_guard_compiled_packed_mb32) echo "$(variant_flags async_guard_compiled_packed)" \
      "--per_device_train_batch_size 32 --gradient_accumulation_steps 2" ;;  # the same 64 rollouts a step in 2
      # micro-batches, not 16: DAPO's loss is a sum over the step's tokens (TRL scales each micro-batch's by
      # steps_per_generation, = gradient_accumulation_steps), so the gradient is the same. On the H200 above, 4
      # rollouts pack ~1.2k tokens, whose matmuls need ~3 ms at an H200's bf16 peak, and took ~75 ms (update ~1.2
      # s of a ~2.0 s step): launch-bound. On an H100 (2026-12-06) the update took ~0.4 s, the step ~1.0 s, the 30
      # steps 91-129 s end to end (2.13-3.02x the tmpfs lock-step); the trainer peaks at 54-55 GiB, so run seeds
      # in series (SEEDS="0 1 2" e2e_alone) where two would not fit beside each other
    async_safe_compiled_packed) echo "$(variant_flags async_safe) --compile_layers true --padding_free true" ;;  # the
      # speed levers over async_safe: alone, async_safe can reach ~1.6x lock-step (the update stays in series);
      # 2x needs the compiled, packed update too
    top1) echo "--topk 1 --weight_sync ipc" ;;  # the levers, on the recipe as last measured (sync_ipc)
    g16) echo "--num_generations 16 --weight_sync ipc" ;;
    nosearch) echo "--no_search_penalty 0.1 --weight_sync ipc" ;;
    clip20) echo "--epsilon_high 0.2 --weight_sync ipc" ;;  # symmetric clipping: what DAPO's clip-higher (0.28) adds
    warmup10) echo "--warmup_steps 10 --weight_sync ipc" ;;  # 10 warmup steps instead of 2
    steps80) echo "--max_steps 80 --weight_sync ipc" ;;  # the recipe's six runs gained +0.034 / +0.041 / +0.045 at
      # steps 30 / 40 / 50: still rising
    repair) echo "--repair_tool_calls true --weight_sync ipc" ;;  # blocks missing a brace repaired: 0 of the 988
      # refused training turns of the g16 and repair runs were that slip (docs/results/learning.md)
    close) echo "--close_tool_calls true --weight_sync ipc" ;;  # 900 of those 988 turns hold a whole call that the
      # next sampled token fails to close; the engine cuts the turn after its JSON and closes it (+0.053 ± 0.022,
      # 2026-12-04: the recipes' default since)
    topp95) echo "--top_p 0.95 --weight_sync ipc" ;;  # the same slips are tokens of the vocabulary's tail at
      # temperature 1: nucleus sampling drops the tail everywhere, validation stays greedy
    pages) echo "--exclude_seen_passages true --warm_start_second_search true --weight_sync ipc" ;;  # searching
      # again reads the next passages, and the warm start shows it where the first search missed the gold
    pages4) echo "--exclude_seen_passages true --warm_start_second_search true --warm_start_second_search_repeats 4" \
      "--weight_sync ipc" ;;  # the same, each trace with a second search taught 4 times: `pages` (6% of traces)
      # left a greedy policy that never searched again (2026-12-04)
    q15) echo "--model $SIBLING --dtype bfloat16 --fp32_master_weights true --per_device_train_batch_size 2" \
      "--gradient_accumulation_steps 32 --weight_sync ipc" ;;  # the 1.5B sibling (learning_sibling says why)
    *) echo "variant $1; expected sync, reload, async, pause, sync_ipc, async_ipc, async_opm, async_trunc," \
         "async_safe, eager, compiled, packed, compiled_packed, nockpt, compiled_packed_nockpt," \
         "async_compiled_packed, async_safe_pause, async_safe_nockpt, async_guard, async_guard_compiled_packed," \
         "async_guard_compiled_packed_mb32," \
         "async_safe_guard, async_safe_compiled_packed, top1, g16, nosearch, clip20, warmup10, steps80, repair," \
         "close, topp95, pages, pages4 or q15" >&2
       return 2 ;;
  esac
}

# seeded_batch OUT "NAMES" [benchmarks.learning run flags]: the seeds $SEEDS (default 0 1 2) of each named variant side
# by side, one table; $BATCH_FLAGS go to every run before the variant's own.
seeded_batch() {
  local out=$1 names=$2 name flags variants=()
  shift 2
  for name in $names; do
    flags=$(variant_flags "$name") || exit 2
    variants+=(--variant "$name=$LIGHT_SAVES ${BATCH_FLAGS:-} $flags")
  done
  python3 -m benchmarks.learning run --out "$RUNS/$out" --seeds ${SEEDS:-0 1 2} ${EAGER:+--eager} "${variants[@]}" "$@"
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

# The qwen3_1_7b recipe's own update (packed ragged rollouts, one GPU without DeepSpeed), eager and compiled (1.42x
# with its checkpointing, 2026-12-04: the recipe compiles), without its activation checkpointing first (the MFU it
# leaves), then with it.
# $1: more flags, e.g. "--attn flex_attention" (packed rows through FlexAttention's block mask instead of SDPA's dense
# one: the packed step ran at MFU 0.35 where full rows reach 0.58).
update_1_7b() {
  for checkpointing in "" --activation_checkpointing; do
    for lever in "" --compile_layers; do
      python3 -m benchmarks.policy_update --model Qwen/Qwen3-1.7B --seq 2048 --batch 8 --dtype bfloat16 \
        --fp32_master_weights $checkpointing --ragged --padding_free $lever ${1:-} --out "$RUNS/policy_update.jsonl"
    done
  done
}

case "${1:?step}" in
  sync_checks)
    python3 -m benchmarks.sync_checks --model "$MODEL" --questions "$CACHE/data/squad_open/test.parquet" \
      --out "$RUNS/weight_sync.jsonl" --log_dir "$RUNS" ;;
  sync_checks_1gpu)
    python3 -m benchmarks.sync_checks --model "$MODEL" --questions "$CACHE/data/squad_open/test.parquet" \
      --out "$RUNS/weight_sync.jsonl" --log_dir "$RUNS" --checks reload ipc --trainer_gpu 0 ;;
  learn_x2)
    python3 scripts/offline_job.py --config offline_gpu --corpus full --output_dir "$RUNS/learn_x2" \
      --generator vllm --weight_sync nccl --generator_gpu 0 --trainer_gpu 1 --retriever_gpu 1 --launcher accelerate \
      $EAGER ;;
  learn_1gpu)
    sed '/^eval_sample_seed/d; s/^eval_num_samples: 500/eval_num_samples: 200/' configs/offline_gpu.yaml \
      > configs/offline_gpu_first200.yaml
    python3 scripts/offline_job.py --config offline_gpu --corpus full --output_dir "$RUNS/learn_1gpu" \
      --generator_gpu 0 --trainer_gpu 0 --retriever_gpu 0 $EAGER > "$RUNS/learn_1gpu.log" 2>&1 &
    python3 scripts/offline_job.py --config offline_gpu_first200 --corpus full --output_dir "$RUNS/learn_1gpu_first200" \
      --generator_gpu 1 --trainer_gpu 1 --retriever_gpu 1 --retriever_port 8010 --generator_port 8011 $EAGER \
      > "$RUNS/learn_1gpu_first200.log" 2>&1 &
    wait ;;
  qwen3_1_7b)
    python3 -m benchmarks.random_checkpoint --model Qwen/Qwen3-1.7B --out "$HOME/qwen3_1_7b"
    python3 scripts/offline_job.py --config qwen3_1_7b --model "$HOME/qwen3_1_7b" --corpus full \
      --output_dir "$RUNS/qwen3_1_7b" --generator_gpu 0 --trainer_gpu 1 --retriever_gpu 1 --launcher accelerate \
      --generator_gpu_memory_utilization 0.5 --vllm_tensor_parallel_size 1 --max_steps 3 --eval_strategy no \
      --eval_on_start false --report_to none --save_strategy no ;;
  beat_rag)
    gpu=${2:?gpu} seed=${3:?seed}; shift 3
    python3 scripts/offline_job.py --config offline_gpu --corpus full --output_dir "$RUNS/beat_rag_s$seed" \
      --generator_gpu "$gpu" --trainer_gpu "$gpu" --retriever_gpu "$gpu" \
      --retriever_port $((8100 + 10 * seed)) --generator_port $((8101 + 10 * seed)) $EAGER \
      --seed "$seed" --data_seed "$seed" "$@" ;;
  async_e2e)  # the modes given ("sync_ipc async_ipc") side by side, 3 seeds each: one table in $RUNS/async_e2e
    modes=${2:?modes, e.g. "sync_ipc async_ipc"}
    seeded_batch async_e2e "$modes" --gpu "${3:-0}" --baseline "${modes%% *}" ;;
  learning_sibling)  # a run holds ~48 GB: its trainer ~38 (bf16 weights and reference, fp32 masters and Adam,
    # micro-batches of 2), its vLLM server ~8 with a 2 GiB KV cache, its retriever ~1.5. Three side by side ran out of
    # the H200's 139.8 GiB at the third's first optimizer step (docs/results/learning.md), so seeds come two at a time.
    seeds=${2:?seeds, two at most: "0 2", then "1"}
    [ "$(wc -w <<< "$seeds")" -le 2 ] || { echo "learning_sibling: $seeds; two seeds at most fit one H200" >&2; exit 2; }
    [ -d "$SIBLING" ] || { echo "no $SIBLING: searchr1-assets --sibling, bundle with BUNDLE_SIBLING=1" >&2; exit 2; }
    SEEDS=$seeds seeded_batch learning_sibling q15 --kv_cache_gib 2 ;;
  eval_sibling)  # apart from the batch: upload, setup and the batch take ~26 of a session's 30 device minutes
    python3 scripts/eval_offline.py --checkpoints "$SIBLING" --corpus full --num_samples 500 --sample_offset 500 \
      --methods direct rag --generator transformers --max_concurrency 256 --retriever_port 8200 \
      --output_dir "$RUNS/eval_sibling_report" ;;
  learning_levers)  # levers not yet run on the 0.5B (docs/results/learning.md), the recipe's other flags as committed;
    # $3: the GPU (default 0): on a two-GPU host a second batch runs on GPU 1 beside the first, on ports of its own,
    # into learning_levers_gpu1
    gpu=${3:-0} out=learning_levers
    [ "$gpu" = 0 ] || out+=_gpu$gpu
    seeded_batch "$out" "${2:-clip20 warmup10}" --kv_cache_gib 2 --gpu "$gpu" --base_port $((8100 + 100 * gpu)) ;;
  eval_table)  # the retriever on that GPU's host, each checkpoint in-process on that GPU
    gpu=${2:?gpu} name=${3:?name}; shift 3
    CUDA_VISIBLE_DEVICES=$gpu python3 scripts/eval_offline.py --checkpoints "$@" --corpus full --num_samples 500 \
      --generator transformers --max_concurrency 256 --retriever_port 8200 --output_dir "$RUNS/eval_$name" ;;
  update_0_5b)  # what is left in series once rollouts overlap it and the push takes ~0.13 s (docs/results/README.md)
    for lever in "--batch 8 --accumulation 8" "--batch 16 --accumulation 4" "--batch 32 --accumulation 2" \
                 "--batch 8 --accumulation 8 --padding_free" "--batch 16 --accumulation 4 --padding_free" \
                 "--batch 8 --accumulation 8 --compile_layers"; do
      python3 -m benchmarks.policy_update --model "$MODEL" --seq 1024 --ragged $lever \
        --out "$RUNS/policy_update_0_5b.jsonl"
    done ;;
  trainer_compile)  # the trainer's own step: eager, compiled decoder layers, packed rows, both; 12 steps each from
    # the base model; $2: the variants, default all four
    EAGER=1 in_series trainer_compile_serial "${2:-eager compiled packed compiled_packed}" \
      "--warm_start_traces 0 --max_steps 12 --eval_steps 12 --save_steps 12 --report_num_samples 0 --eval_num_samples 200" ;;
  e2e_alone)  # issue 23's end to end: the recipe's first 30 GRPO steps (warm start, evaluations every 10 steps
    # included as committed), each mode alone on the GPU with CUDA graphs; the speedups over the first mode
    in_series e2e_alone "${2:-async_guard sync}" "--max_steps 30" ;;
  rollouts_wiki)  # our engine against TRL's tool loop, 512 rollouts, the index padded to wiki-18's 21M x 768;
    # $2: more retrieval server flags, e.g. "--device cpu" (its encoder on the host's cores)
    python3 -m benchmarks.rollout_throughput --num_questions 512 --backends vllm trl --repeats 2 --vllm_gpu 0 \
      --pad_index_rows 21000000 --pad_index_dim 768 --vllm_gpu_memory_utilization 0.5 --retriever_args="${2:-}" \
      --out "$RUNS/rollout_throughput_wiki.jsonl" ;;
  performance)
    for load in "64 1" "8 64"; do
      read -r clients queries <<<"$load"
      python3 -m benchmarks.retriever_load --clients "$clients" --processes 4 --queries_per_request "$queries" \
        --duration_s 20 --modes on,reference --search_threads 2 --out "$RUNS/retriever_load.jsonl"
    done
    for queries in 64 512; do
      OMP_WAIT_POLICY=PASSIVE python3 -m benchmarks.retriever_profile --queries_per_request "$queries" \
        --out "$RUNS/retriever_profile.jsonl"
    done
    for batch in 8 16; do
      python3 -m benchmarks.policy_update --model Qwen/Qwen3-1.7B --seq 2048 --batch "$batch" --dtype bfloat16 \
        --fp32_master_weights --out "$RUNS/policy_update.jsonl"
    done
    for lever in "" --compile_layers; do
      python3 -m benchmarks.policy_update --model Qwen/Qwen3-8B --seq 2048 --batch 4 --dtype bfloat16 $lever \
        --out "$RUNS/policy_update.jsonl"
    done
    python3 -m benchmarks.policy_update --model Qwen/Qwen3-1.7B --seq 2048 --batch 8 --dtype bfloat16 \
      --fp32_master_weights --compile_layers --out "$RUNS/policy_update.jsonl"
    update_1_7b ;;
  update_1_7b) update_1_7b "${2:-}" ;;
  zero3_1gpu)  # the trainer's own step through DeepSpeed ZeRO-3 in one process (compile_layers is refused there):
    # Qwen3-1.7B and its MFU, as the ZeRO-3 recipes' update runs on each GPU (needs the bundle's DeepSpeed)
    python3 -m accelerate.commands.launch --config_file accelerate_configs/zero3.yaml --num_processes 1 \
      -m benchmarks.zero3_update --model Qwen/Qwen3-1.7B --per_device_batch 8 --seq 2048 --steps 5 \
      --activation_checkpointing --out "$RUNS/zero3_update.jsonl" ;;
  *) echo "unknown step $1" >&2; exit 2 ;;
esac
