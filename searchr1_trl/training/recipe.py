"""The recipe: one flat config a YAML file and the command line set.

:class:`SearchR1Config` is what ``TrlParser`` fills from a recipe (``configs/*.yaml``) plus ``--field value``
overrides (:mod:`searchr1_trl.training.loading`): TRL's ``GRPOConfig`` with the seed recipe's defaults (DAPO loss with
asymmetric clipping 0.2 / 0.28, no KL and no reference model, group std-normalised advantages, AdamW at lr 1e-6 with 2
warmup steps then constant, 8 prompts x 8 generations per optimizer step, temperature 1.0, top_p 1.0, 512 tokens per
turn), the task to train (``task``), plus one flat field per knob of the parts it configures, declared with
:func:`~searchr1_trl.training.knobs.knob` (:data:`KNOBS` says which part each sets; :mod:`searchr1_trl.training.parts`
builds them; :func:`part_config` gives one part's config as a recipe sets it).

Fields of ``GRPOConfig`` that :class:`~searchr1_trl.training.trainer.SearchR1Trainer` must set itself
(:data:`TRAINER_OWNED`) are left unset by a recipe; a recipe that sets one to another value than the trainer needs is
refused with an error naming the field to set instead, never silently overwritten.
"""

from __future__ import annotations

import logging
import typing
from collections.abc import Callable
from dataclasses import dataclass, field, fields, make_dataclass, replace
from typing import Any

from trl import GRPOConfig

from searchr1_trl.assets.offline import resolve_path
from searchr1_trl.engine.generation import resolve_generator
from searchr1_trl.serving.vllm_server import WEIGHT_SYNC_TIMEOUT_S
from searchr1_trl.tasks import TASKS, get_task
from searchr1_trl.training.callbacks import KEEP_METRIC
from searchr1_trl.training.experimental.staleness import IMPORTANCE_SAMPLING_MODES
from searchr1_trl.training.fixed_costs import REPORT_AT
from searchr1_trl.training.knobs import PARTS, knob, knobs, owned

logger = logging.getLogger(__name__)


@dataclass
class SearchR1Config(GRPOConfig):
    """GRPOConfig plus the Search-R1 task; every field can be set from the recipe YAML or the command line."""

    # --- seed-recipe defaults for inherited GRPO fields ---
    loss_type: str = field(default="dapo", metadata={"help": "GRPO loss; DAPO normalises over all tokens of a batch."})
    epsilon: float = field(default=0.2, metadata={"help": "Lower clipping bound of the policy ratio."})
    epsilon_high: float = field(default=0.28, metadata={"help": "Upper clipping bound (DAPO's clip-higher)."})
    beta: float = field(default=0.0, metadata={"help": "KL coefficient; 0 means no reference model is loaded."})
    learning_rate: float = field(default=1e-6, metadata={"help": "AdamW learning rate."})
    lr_scheduler_type: str = field(default="constant_with_warmup", metadata={"help": "Warmup, then constant."})
    warmup_steps: float = field(default=2, metadata={"help": "Optimizer steps of linear warmup."})
    num_generations: int = field(default=8, metadata={"help": "Rollouts per question (the GRPO group)."})
    per_device_train_batch_size: int = field(default=8, metadata={"help": "Rollouts per micro-batch per device."})
    gradient_accumulation_steps: int = field(default=8, metadata={"help": "Micro-batches per optimizer step."})
    temperature: float = field(default=1.0, metadata={"help": "Sampling temperature of training rollouts."})
    save_steps: float = field(default=50, metadata={"help": "Checkpoint every this many optimizer steps."})
    save_total_limit: int | None = field(default=3, metadata={"help": "Checkpoints kept on disk."})
    logging_steps: float = field(default=1, metadata={"help": "Log every this many optimizer steps."})

    # --- policy-update throughput (searchr1_trl/training/update.py); TRL's own: optim, bf16 ---
    fp32_master_weights: bool = field(
        default=False,
        metadata={"help": "With a model loaded in bfloat16 (dtype: bfloat16): the optimizer keeps fp32 copies of the "
                          "weights in its state and steps those, so small updates are not lost to bf16 rounding, "
                          "while forward and backward run on bf16 weights. Not under DeepSpeed (it does this itself)."},
    )
    drop_equal_reward_groups: bool = field(
        default=False,
        metadata={"help": "DAPO's dynamic sampling without the refill: a group whose rollouts all got the same reward "
                          "(zero advantage) is left out of the loss and of its token normaliser, so it does not dilute "
                          "the groups that carry signal; counted as train/dropped_groups."},
    )
    padding_free: bool = field(
        default=False,
        metadata={"help": "Pack each micro-batch's rollouts without padding (position ids restart per rollout) for the "
                          "log-prob forward/backward; needs an attention that reads packed position ids (sdpa, eager, "
                          "flex_attention, flash_attention_2). Same loss, less padding compute."},
    )
    compile_layers: bool = field(
        default=False,
        metadata={"help": "torch.compile each decoder layer (the policy's and the reference's) in place, for any "
                          "rollout length (searchr1_trl/training/update.py): same loss, the first step compiles. "
                          "H200, seq 2048: update MFU 0.38 -> 0.58 (Qwen3-1.7B), "
                          "0.55 -> 0.69 (8B), one GPU without DeepSpeed. Refused under ZeRO-3, whose parameter hooks "
                          "it would recompile around until it falls back to eager."},
    )

    # --- inherited GRPO fields the trainer owns ---
    use_vllm: bool | None = owned("from generator and weight_sync")
    vllm_mode: str | None = owned("server")
    max_completion_length: int | None = owned("from max_rollout_tokens")
    remove_unused_columns: bool | None = owned("False: the rubric reads golden_answers from each row")
    ignore_data_skip: bool | None = owned("True: the question stream restores its own position")
    num_generations_eval: int | None = owned("1: validation is one greedy rollout per question")

    # --- questions ---
    train_data_path: str | None = knob("train_stream", "data_path")
    train_repo_id: str = knob("train_stream", "repo_id")
    train_filename: str = knob("train_stream", "filename")
    train_data_source: str | None = knob("train_stream", "data_source")
    data_seed: int = knob("train_stream", "seed")
    eval_data_path: str | None = knob("eval_stream", "data_path")
    eval_repo_id: str = knob("eval_stream", "repo_id")
    eval_filename: str = knob("eval_stream", "filename")
    eval_data_source: str | None = knob("eval_stream", "data_source")
    eval_num_samples: int = field(default=500, metadata={"help": "Validation questions (see eval_sample_seed)."})
    report_num_samples: int = field(
        default=0,
        metadata={"help": "Questions of a second validation sample, disjoint from the first (the next rows of the same "
                          "order), evaluated beside it (at the validations report_at names) and logged as report_*: "
                          "the figure to report, since the best checkpoint is chosen on the first. 0: none."},
    )
    report_at: str = field(
        default="ends",
        metadata={"help": "Which validations roll out the report sample. `ends`: the first, the last step's and, when "
                          "training ends on an earlier checkpoint, that model once more after training "
                          "(saved_report_*): where its figure is read, since the guard chooses on the validation "
                          "sample. `every_validation`: each one, for a curve (each validation then rolls out both "
                          "samples: twice the rollouts where they are the same size)."},
    )
    save_validation_traces: bool = field(
        default=True,
        metadata={"help": "Write each validation's greedy rollouts (conversation, answer, EM, status, searches) to "
                          "output_dir/validation_traces/step-<step>.jsonl (a few KB a rollout): what a drop in EM or a "
                          "collapse the guard stopped looked like."},
    )
    save_parse_failures: bool = field(
        default=True,
        metadata={"help": "Append each training rollout that ended as error_parse (its question and the turn the "
                          "parser refused) to output_dir/parse_failures.jsonl: what 0.035-0.08 of the offline GPU "
                          "recipe's training rollouts lost their reward to before close_tool_calls, 0.003-0.02 with "
                          "it."},
    )
    trace_report: bool = field(
        default=True,
        metadata={"help": "Write output_dir/report.html when training ends (searchr1-report): the curves and the "
                          "validation traces, browsable offline, with the first validation set against the last."},
    )
    task: str = field(
        default="search_r1",
        metadata={"help": f"The task to train: {', '.join(TASKS)} (searchr1_trl/tasks/), or the module path of one "
                          "outside the package (docs/adding_a_task.md)."},
    )
    eval_sample_seed: int | None = field(
        default=None,
        metadata={"help": "None: the first eval_num_samples rows in file order (the seed's slice); a seed: a seeded "
                          "random sample of the file (files sorted by article put one article first)."},
    )

    # --- search environment ---
    search_url: str = knob("env", "search_url")
    topk: int = knob("env", "topk")
    search_timeout_s: float = knob("env", "timeout_s")
    search_max_retries: int = knob("env", "max_retries")
    search_retry_backoff_s: float = knob("env", "retry_backoff_s")
    search_max_backoff_s: float = knob("env", "max_backoff_s")
    search_deadline_s: float = knob("env", "deadline_s")
    search_max_response_bytes: int = knob("env", "max_response_bytes")
    search_max_passage_chars: int = knob("env", "max_passage_chars")
    search_max_request_queries: int = knob("env", "max_request_queries")
    search_max_request_documents: int = knob("env", "max_request_documents")
    restate_question: bool = knob("env", "restate_question")
    exclude_seen_passages: bool = knob("env", "exclude_seen_passages")
    max_failed_search_fraction: float = field(
        default=0.5,
        metadata={"help": "Training stops (one line, the last checkpoint kept) when more than this fraction of a "
                          "step's searches failed, every retry spent: a retriever that is down would otherwise turn "
                          "steps into training on outages. Rollouts whose searches failed are not trained on either "
                          "way (status error_tool)."},
    )

    # --- rollout budgets ---
    max_turns: int = knob("rollout", "max_turns")
    max_rollout_tokens: int = knob("rollout", "max_rollout_tokens")
    max_tokens_per_turn: int = knob("sampling", "max_tokens")
    step_timeout_s: float = knob("rollout", "step_timeout_s")
    enable_thinking: bool = knob("rollout", "enable_thinking")
    bare_json_tool_calls: bool = knob("rollout", "bare_json_tool_calls")
    repair_tool_calls: bool = knob("rollout", "repair_tool_calls")
    close_tool_calls: bool = knob("rollout", "close_tool_calls")

    # --- rubric ---
    exact_match_score: float = knob("exact_match", "score")
    no_search_penalty: float = knob("exact_match", "no_search_penalty")
    retrieval_score: float = knob("exact_match", "retrieval_score")
    answer_f1: float = knob("exact_match", "answer_f1")
    exact_match_weight: float = knob("exact_match", "weight")
    truncation_reward: float = knob("rubric", "truncation_reward")

    # --- supervised warm start (searchr1_trl/training/warm_start.py) ---
    warm_start_traces: int = knob("warm_start", "num_traces")
    warm_start_second_search: bool = knob("warm_start", "second_search")
    warm_start_second_search_repeats: int = knob("warm_start", "second_search_repeats")
    warm_start_answer_traces: int | None = knob("warm_start", "answer_traces")
    warm_start_learning_rate: float = knob("warm_start", "learning_rate")
    warm_start_epochs: float = knob("warm_start", "epochs")
    warm_start_batch_size: int = knob("warm_start", "batch_size")

    # --- collapse guard (searchr1_trl/training/callbacks.py) ---
    collapse_guard: bool = knob("collapse_guard", "enabled")
    collapse_em_drop: float = knob("collapse_guard", "em_drop")
    collapse_searches_drop: float = knob("collapse_guard", "searches_drop")
    collapse_entropy_drop: float = knob("collapse_guard", "entropy_drop")
    collapse_noise_z: float = knob("collapse_guard", "noise_z")

    # --- asynchronous rollouts, experimental (searchr1_trl/training/experimental/async_rollouts.py) ---
    async_rollouts: bool = knob("async_rollouts", "enabled")
    max_staleness: int = knob("async_rollouts", "max_staleness")
    in_flight_rollouts: str = knob("async_rollouts", "in_flight")
    max_behaviour_kl: float = knob("async_rollouts", "max_behaviour_kl")

    # --- generator ---
    generator: str = field(
        default="vllm",
        metadata={"help": "`vllm`: a `trl vllm-serve` server; `transformers`: the trained model, in-process; `auto`: "
                          "vllm where the vllm package is installed, else transformers."},
    )
    weight_sync: str = field(
        default="reload",
        metadata={"help": "`reload`: save safetensors, server reloads them (no CUDA needed); `nccl`: TRL's NCCL path "
                          "(server on other GPUs); `ipc`: CUDA IPC handles to a server on the trainer's own GPU, "
                          "started with --worker-extension-cls searchr1_trl.serving.weight_sync.IpcWeightLoader."},
    )
    weight_sync_dir: str | None = field(default=None, metadata={"help": "Folder for `reload` (shared with server)."})
    weight_sync_dtype: str | None = field(
        default=None,
        metadata={"help": "`reload` and `ipc`: push the weights in this dtype (e.g. bfloat16, what a GPU server "
                          "runs: half the bytes of fp32 master weights); None: the trainer's dtype for reload, "
                          "bfloat16 for ipc."},
    )
    weight_sync_timeout_s: float = field(
        default=WEIGHT_SYNC_TIMEOUT_S,
        metadata={"help": "How long each request of a weight push (reload, prefix-cache reset, pause, resume; an "
                          "NCCL push as a whole) waits for the vLLM server, in s; then training stops in one line "
                          "naming the server. 300 s: the "
                          "pushes measured on GPU take 0.1-3 s (experiments/results), the margin is for a large "
                          "model's weights read from a slow disk; it bounds how long a hung server holds the run."},
    )
    generator_max_concurrency: int = knob("vllm_generator", "max_concurrency")
    generator_timeout_s: float = knob("vllm_generator", "timeout_s")
    generator_max_batch_size: int = knob("transformers_generator", "max_batch_size")

    # --- the launch plan: machines, GPUs, what the retriever serves (searchr1_trl/serving/launch.py) ---
    nodes: int = knob("launch", "nodes")
    trainer_gpus: list[int] | None = knob("launch", "trainer_gpus")
    trainer_nodes: int = knob("launch", "trainer_nodes")
    accelerate_config: str | None = knob("launch", "accelerate_config")
    generator_gpus: list[int] | None = knob("launch", "generator_gpus")
    generator_node: int = knob("launch", "generator_node")
    generator_server: str = knob("launch", "generator_server")
    generator_enforce_eager: bool = knob("launch", "generator_enforce_eager")
    generator_kv_cache_gib: float | None = knob("launch", "generator_kv_cache_gib")
    generator_startup_overlap: bool = knob("launch", "generator_startup_overlap")
    retriever_gpus: list[int] | None = knob("launch", "retriever_gpus")
    retriever_node: int = knob("launch", "retriever_node")
    retriever_index_path: str | None = knob("launch", "retriever_index_path")
    retriever_corpus_path: str | None = knob("launch", "retriever_corpus_path")
    retriever_model: str | None = knob("launch", "retriever_model")
    retriever_name: str | None = knob("launch", "retriever_name")
    retriever_gpu_backend: str = knob("launch", "retriever_gpu_backend")

    def __post_init__(self):
        self.generator = resolve_generator(self.generator)
        get_task(self.task)  # ValueError naming the known tasks
        if not 0 <= self.max_failed_search_fraction <= 1:
            raise ValueError(f"max_failed_search_fraction={self.max_failed_search_fraction!r}; expected a fraction "
                             "in [0, 1]")
        if self.report_at not in REPORT_AT:
            raise ValueError(f"report_at={self.report_at!r}; expected {' or '.join(map(repr, REPORT_AT))}")
        if self.weight_sync not in ("reload", "nccl", "ipc"):
            raise ValueError(f"weight_sync={self.weight_sync!r}; expected 'reload', 'nccl' or 'ipc'")
        if not self.weight_sync_timeout_s > 0:
            raise ValueError(f"weight_sync_timeout_s={self.weight_sync_timeout_s!r}; expected seconds > 0")
        # TRL reads these two only in a step (an unknown mode fails there, a threshold <= 0 drops every rollout with
        # a negative advantage): checked here, before a warm start and a validation have run
        if self.vllm_importance_sampling_mode not in IMPORTANCE_SAMPLING_MODES:
            raise ValueError(f"vllm_importance_sampling_mode={self.vllm_importance_sampling_mode!r}; expected "
                             f"{', '.join(IMPORTANCE_SAMPLING_MODES)}")
        if self.off_policy_mask_threshold is not None and not self.off_policy_mask_threshold > 0:
            raise ValueError(f"off_policy_mask_threshold={self.off_policy_mask_threshold!r}; expected a mean per-token "
                             "log-probability gap > 0 (e.g. 0.02), or none to keep every rollout")
        if self.weight_sync_dtype not in (None, "bfloat16", "float16", "float32"):
            raise ValueError(f"weight_sync_dtype={self.weight_sync_dtype!r}; expected bfloat16, float16 or float32")
        if self.weight_sync_dtype and (self.generator != "vllm" or self.weight_sync == "nccl"):
            logger.warning("weight_sync_dtype=%s applies to reload and ipc pushes to a vLLM server only; with "
                           "generator=%s and "
                           "weight_sync=%s the generator gets the weights as the trainer holds them",
                           self.weight_sync_dtype, self.generator, self.weight_sync)
        for name, (needed, instead) in TRAINER_OWNED.items():
            value, wanted = getattr(self, name), needed(self)
            if value is not None and value != wanted:
                raise ValueError(f"{name}={value!r}: SearchR1Trainer sets {name} itself (to {wanted!r} here); "
                                 f"remove it from the recipe{instead}")
            setattr(self, name, wanted)
        if self.collapse_guard and self.eval_strategy != "no":
            if self.metric_for_best_model not in (None, KEEP_METRIC, f"eval_{KEEP_METRIC}"):
                raise ValueError(f"metric_for_best_model={self.metric_for_best_model!r}: the collapse guard chooses "
                                 "the checkpoint to keep by validation EM; remove it or set collapse_guard false")
            self.metric_for_best_model, self.greater_is_better = KEEP_METRIC, True
            if self.save_strategy != "no":
                # transformers' own best-checkpoint machinery; it refuses save_steps that are no multiple of eval_steps
                self.load_best_model_at_end = True
            else:
                logger.warning("collapse_guard with save_strategy 'no': training stops on a collapse but keeps no "
                               "checkpoint to end on the best one; set save_strategy steps to keep it")
        for name in ("train_data_path", "eval_data_path", "weight_sync_dir"):
            if getattr(self, name):
                setattr(self, name, resolve_path(getattr(self, name)))
        super().__post_init__()
        if self.accelerator_config.dispatch_batches:
            raise ValueError("accelerator_config.dispatch_batches=True: the question stream is iterable and each "
                             "process draws its own slice; remove it from the recipe")
        self.accelerator_config.dispatch_batches = False

    @property
    def generator_url(self) -> str:
        return self.vllm_server_base_url or f"http://{self.vllm_server_host}:{self.vllm_server_port}"


# GRPOConfig field -> (the value SearchR1Trainer needs, what to set instead).
TRAINER_OWNED: dict[str, tuple[Callable[[SearchR1Config], Any], str]] = {
    # TRL's own vLLM client only does the NCCL weight transfer; rollouts go through our generator.
    "use_vllm": (lambda c: c.generator == "vllm" and c.weight_sync == "nccl", "; set generator and weight_sync"),
    "vllm_mode": (lambda c: "server", ""),
    "max_completion_length": (lambda c: c.max_rollout_tokens, "; set max_rollout_tokens"),
    "remove_unused_columns": (lambda c: False, ""),
    "ignore_data_skip": (lambda c: True, ""),
    # Validation is SearchR1Trainer.evaluate's greedy rollouts, not TRL's eval loop: TRL's check that its eval batch
    # holds whole groups would otherwise refuse num_generations 16.
    "num_generations_eval": (lambda c: 1, ""),
}

# Recipe field -> (part, knob of that part); every field declared with knob().
KNOBS: dict[str, tuple[str, str]] = knobs(SearchR1Config)


def knob_fields(name: str, parts: tuple[str, ...]) -> type:
    """A dataclass of the recipe fields that set ``parts`` (same names, defaults and help), for commands that run a
    policy the way training does (``searchr1-eval``, ``searchr1-ask``); :func:`part_config` reads it like a recipe."""
    hints = typing.get_type_hints(SearchR1Config)
    return make_dataclass(name, [
        (f.name, hints[f.name], field(default=f.default, metadata=f.metadata))
        for f in fields(SearchR1Config) if f.name in KNOBS and KNOBS[f.name][0] in parts
    ])


def part_config(args, part: str) -> Any:
    """The config of ``part`` as the recipe ``args`` sets it (a :class:`SearchR1Config`, or anything with its field
    names): the part's defaults with every knob's recipe value."""
    return replace(PARTS[part], **{name: getattr(args, flat) for flat, (p, name) in KNOBS.items() if p == part})
