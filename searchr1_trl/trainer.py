"""SearchR1Trainer: TRL's GRPOTrainer with the Search-R1 question stream, multi-turn rollouts and EM rubric plugged in.

What this subclass decides, and nothing more:
- **Questions** come from the endless, seeded :class:`~searchr1_trl.data.SearchR1Dataset`, not a sampler over a
  map-style dataset, so a resumed run continues the exact question sequence (its state is saved in every
  checkpoint next to the optimizer's).
- **Rollouts** go through TRL's ``rollout_func`` hook: the generic :class:`~searchr1_trl.rollout.RolloutEngine`
  drives :class:`~searchr1_trl.env.SearchR1Env`; the returned ``env_mask`` keeps tool tokens out of the loss.
- **Rewards** are the :class:`~searchr1_trl.rubric.Rubric`, a plain TRL reward function.
- **Generator weights** are pushed after every optimizer step: through TRL's NCCL path (``weight_sync="nccl"``,
  CUDA clusters) or by saving safetensors to a folder the vLLM server reloads in place (``weight_sync="reload"``,
  works without CUDA). The in-process generator (``generator="transformers"``) uses the live model, no sync.
- **Validation** is greedy rollouts over a fixed held-out slice, logged as EM overall and per data source.
- **An optimizer step with NaN/inf gradients is skipped** (:class:`NonFiniteGradientGuard`), not applied.

Defaults follow the seed recipe: DAPO loss with asymmetric clipping (0.2 / 0.28), no KL and no reference model,
group std-normalised advantages, AdamW at lr 1e-6 with 2 warmup steps then constant, 8 prompts x 8 generations per
optimizer step, temperature 1.0, top_p 1.0, 512 tokens per turn.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import datasets
import torch
from accelerate.utils import gather_object
from transformers import TrainerCallback
from transformers.trainer_utils import get_last_checkpoint
from trl import GRPOConfig, GRPOTrainer
from trl.models import unwrap_model_for_generation

from searchr1_trl.data import SearchR1Dataset, SearchR1DatasetConfig, SearchR1Sample
from searchr1_trl.env import SearchR1Env, SearchR1EnvConfig
from searchr1_trl.generation import SamplingParams, TransformersGenerator, VLLMServerGenerator
from searchr1_trl.rollout import Rollout, RolloutConfig, RolloutEngine
from searchr1_trl.rubric import RewardExactMatch, RewardExactMatchConfig, Rubric
from searchr1_trl.vllm_server import reload_weights

logger = logging.getLogger(__name__)

STREAM_STATE_FILE = "question_stream.json"
MAX_CONSECUTIVE_NONFINITE_STEPS = 3


@dataclass
class SearchR1Config(GRPOConfig):
    """GRPOConfig plus the Search-R1 task; every field can be set from the recipe YAML or the command line."""

    # --- seed-recipe defaults for inherited GRPO fields ---
    loss_type: str = field(default="dapo", metadata={"help": "GRPO loss; DAPO normalises over all tokens of the batch."})
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
    # The question stream restores its own position from the checkpoint; replaying batches would double-skip.
    ignore_data_skip: bool = field(default=True, metadata={"help": "Keep True: the stream resumes from its state."})

    # --- questions ---
    train_data_path: str | None = field(default=None, metadata={"help": "Local train parquet (else the Hub)."})
    train_repo_id: str = field(default="PeterJinGo/nq_hotpotqa_train", metadata={"help": "Hub dataset repo."})
    train_filename: str = field(default="train.parquet", metadata={"help": "Train file inside the repo."})
    train_data_source: str | None = field(default=None, metadata={"help": "Keep only this data_source in training."})
    data_seed: int = field(default=42, metadata={"help": "Seed of the training question order."})
    eval_data_path: str | None = field(default=None, metadata={"help": "Local validation parquet (else the Hub)."})
    eval_filename: str = field(default="test.parquet", metadata={"help": "Validation file inside the repo."})
    eval_data_source: str | None = field(default="nq", metadata={"help": "Validation data_source (None: all)."})
    eval_num_samples: int = field(default=500, metadata={"help": "Validation questions (see eval_sample_seed)."})
    eval_sample_seed: int | None = field(
        default=None,
        metadata={"help": "None: the first eval_num_samples rows in file order (the seed's slice); a seed: a seeded "
                          "random sample of the file (files sorted by article put one article first)."},
    )

    # --- search environment ---
    search_url: str = field(default="http://127.0.0.1:8000/retrieve", metadata={"help": "Retrieval server URL."})
    topk: int = field(default=3, metadata={"help": "Passages returned per search."})
    search_timeout_s: float = field(default=60.0, metadata={"help": "Timeout of one retrieval request."})
    restate_question: bool = field(
        default=False, metadata={"help": "End search results with the answer format and the question (small models)."}
    )

    # --- rollout budgets ---
    max_turns: int = field(default=4, metadata={"help": "Assistant turns per rollout."})
    max_rollout_tokens: int = field(default=3072, metadata={"help": "Prompt + completion tokens per rollout."})
    max_tokens_per_turn: int = field(default=512, metadata={"help": "Generated tokens per assistant turn."})
    enable_thinking: bool = field(default=False, metadata={"help": "Thinking mode of templates that have it."})
    bare_json_tool_calls: bool = field(
        default=False, metadata={"help": "Also read a turn that is only JSON tool calls as calls (small models)."}
    )

    # --- rubric ---
    no_search_penalty: float = field(default=0.0, metadata={"help": "Subtracted from correct answers w/o search."})
    retrieval_score: float = field(default=0.0, metadata={"help": "Reward when retrieval surfaced the gold answer."})
    answer_f1: float = field(default=0.0, metadata={"help": "Reward of a wrong answer per unit of its token F1."})
    truncation_reward: float = field(default=0.0, metadata={"help": "Reward of a truncated rollout."})

    # --- generator ---
    generator: str = field(
        default="vllm",
        metadata={"help": "`vllm`: a `trl vllm-serve` server; `transformers`: the trained model, in-process; `auto`: "
                          "vllm where the vllm package is installed, else transformers."},
    )
    weight_sync: str = field(
        default="reload",
        metadata={"help": "`reload`: save safetensors, server reloads them (no CUDA needed); `nccl`: TRL's NCCL path."},
    )
    weight_sync_dir: str | None = field(default=None, metadata={"help": "Folder for `reload` (shared with server)."})
    generator_max_concurrency: int = field(default=256, metadata={"help": "Generation requests in flight."})

    def __post_init__(self):
        self.generator = resolve_generator(self.generator)
        if self.weight_sync not in ("reload", "nccl"):
            raise ValueError(f"weight_sync={self.weight_sync!r}; expected 'reload' or 'nccl'")
        # TRL's own vLLM client is only needed for its NCCL weight transfer; rollouts use our generator.
        self.use_vllm = self.generator == "vllm" and self.weight_sync == "nccl"
        self.vllm_mode = "server"
        self.max_completion_length = self.max_rollout_tokens
        self.top_p = 1.0 if self.top_p is None else self.top_p
        self.remove_unused_columns = False
        for name in ("train_data_path", "eval_data_path", "weight_sync_dir"):
            if getattr(self, name):
                setattr(self, name, os.path.expanduser(os.path.expandvars(getattr(self, name))))
        super().__post_init__()
        # The question stream is iterable: batches must not be dispatched from the main process.
        self.accelerator_config.dispatch_batches = False

    @property
    def generator_url(self) -> str:
        return self.vllm_server_base_url or f"http://{self.vllm_server_host}:{self.vllm_server_port}"

    def train_stream_config(self) -> SearchR1DatasetConfig:
        return SearchR1DatasetConfig(
            filename=self.train_filename, repo_id=self.train_repo_id, data_path=self.train_data_path,
            seed=self.data_seed, data_source=self.train_data_source, shuffle=True,
        )

    def eval_stream_config(self) -> SearchR1DatasetConfig:
        return SearchR1DatasetConfig(
            filename=self.eval_filename, repo_id=self.train_repo_id, data_path=self.eval_data_path,
            data_source=self.eval_data_source, shuffle=self.eval_sample_seed is not None,
            seed=self.eval_sample_seed or 0,
        )

    def rubric(self) -> Rubric:
        exact_match = RewardExactMatch(
            RewardExactMatchConfig(no_search_penalty=self.no_search_penalty, retrieval_score=self.retrieval_score,
                                   answer_f1=self.answer_f1)
        )
        return Rubric([exact_match], truncation_reward=self.truncation_reward)


def resolve_generator(name: str) -> str:
    """``vllm`` or ``transformers``; ``auto`` picks vllm where it is installed (a GPU machine with the GPU profile)."""
    if name == "auto":
        return "vllm" if importlib.util.find_spec("vllm") is not None else "transformers"
    if name not in ("vllm", "transformers"):
        raise ValueError(f"generator={name!r}; expected 'vllm', 'transformers' or 'auto'")
    return name


def _row(sample: SearchR1Sample, env: SearchR1Env) -> dict:
    return {
        "prompt": env.initial_messages(sample),
        "question": sample.question,
        "golden_answers": list(sample.golden_answers),
        "data_source": sample.data_source,
    }


class QuestionBatches:
    """The training dataloader: generation batches drawn from the question stream, one draw per optimizer step.

    Reproduces TRL's ``RepeatSampler`` layout (each question ``num_generations`` times in a row, the same global
    batch repeated ``steps_per_generation * num_iterations`` times, each process taking its contiguous slice),
    but from a stream whose position is exactly the number of optimizer steps taken, so it can be checkpointed.
    """

    def __init__(self, stream: SearchR1Dataset, env: SearchR1Env, args: SearchR1Config, process_index: int,
                 num_processes: int):
        self.stream, self.env = stream, env
        self.questions_per_step = args.generation_batch_size // args.num_generations
        self.num_generations = args.num_generations
        self.repeats = args.steps_per_generation * args.num_iterations
        self.process_index, self.num_processes = process_index, num_processes

    def __iter__(self):
        while True:
            samples = [next(self.stream) for _ in range(self.questions_per_step)]
            rows = [_row(s, self.env) for s in samples for _ in range(self.num_generations)]
            per_process = len(rows) // self.num_processes
            local = rows[self.process_index * per_process:(self.process_index + 1) * per_process]
            for _ in range(self.repeats):
                yield local


class NonFiniteGradientGuard(TrainerCallback):
    """Skips an optimizer step whose gradients hold a NaN or inf, instead of writing them into the weights.

    One such step (seen on an H200: Qwen2.5-0.5B, bf16 autocast, lr 1e-5, step 5) turns every weight into NaN, and
    the run then dies at the next sampling with a CUDA assert that names nothing. Skipped steps are logged as
    ``train/skipped_nonfinite_step`` (the fraction of steps skipped per log) with a warning; after
    :data:`MAX_CONSECUTIVE_NONFINITE_STEPS` in a row training stops with an error, since the run is then broken, not
    unlucky. Under DeepSpeed ZeRO the gradients are partitioned away from ``param.grad`` and this guard sees none;
    there DeepSpeed's own ``bf16.check_grad_overflow`` (on by default in 0.19) skips such steps.
    """

    def __init__(self, metrics: dict[str, list[float]]):
        self.metrics = metrics
        self.consecutive = 0

    def on_pre_optimizer_step(self, args, state, control, model=None, optimizer=None, **kwargs):
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        if not grads or torch.stack([torch.isfinite(g).all() for g in grads]).all():
            self.consecutive = 0
            self.metrics["train/skipped_nonfinite_step"].append(0.0)
            return
        self.consecutive += 1
        if self.consecutive >= MAX_CONSECUTIVE_NONFINITE_STEPS:
            raise FloatingPointError(
                f"the gradients held NaN or inf at {self.consecutive} optimizer steps in a row (last: step "
                f"{state.global_step + 1}); lower learning_rate or train without bf16/fp16 autocast")
        logger.warning("optimizer step %d skipped: the gradients hold NaN or inf (the weights are left as they were)",
                       state.global_step + 1)
        optimizer.zero_grad(set_to_none=True)  # an optimizer skips parameters without a gradient
        self.metrics["train/skipped_nonfinite_step"].append(1.0)


class SearchR1Trainer(GRPOTrainer):
    """GRPO on multi-turn search rollouts.

    Everything comes from ``args`` unless passed: ``train_stream``/``eval_samples`` (questions), ``env`` (the search
    environment), ``reward_funcs`` (default: the rubric the config describes; extra TRL reward functions may be added).
    """

    def __init__(self, model, args: SearchR1Config, processing_class=None, peft_config=None,
                 train_stream: SearchR1Dataset | None = None, eval_samples: list[SearchR1Sample] | None = None,
                 env: SearchR1Env | None = None, reward_funcs: list | None = None, **kwargs):
        self.train_stream = train_stream or SearchR1Dataset(args.train_stream_config())
        self.eval_samples = eval_samples if eval_samples is not None else (
            SearchR1Dataset(args.eval_stream_config()).take(args.eval_num_samples)
            if args.eval_strategy != "no" or args.eval_on_start else []
        )
        self.env = env or SearchR1Env(
            SearchR1EnvConfig(search_url=args.search_url, topk=args.topk, timeout_s=args.search_timeout_s,
                              restate_question=args.restate_question)
        )
        self._loop = asyncio.new_event_loop()
        self._synced_step = -1
        # TRL requires a dataset object; this one describes the stream, the real batches come from QuestionBatches.
        train_dataset = datasets.IterableDataset.from_generator(lambda: iter(()))
        eval_dataset = datasets.Dataset.from_list([_row(s, self.env) for s in self.eval_samples]) or None
        super().__init__(
            model=model, reward_funcs=reward_funcs or [args.rubric()], args=args, train_dataset=train_dataset,
            eval_dataset=eval_dataset if len(self.eval_samples) else None, processing_class=processing_class,
            peft_config=peft_config, rollout_func=self._rollout_func, **kwargs,
        )
        self.add_callback(NonFiniteGradientGuard(self._metrics["train"]))
        self.engine = RolloutEngine(
            self.processing_class, self._make_generator(), self.env,
            RolloutConfig(max_turns=args.max_turns, max_rollout_tokens=args.max_rollout_tokens,
                          enable_thinking=args.enable_thinking, bare_json_tool_calls=args.bare_json_tool_calls),
        )

    # ---- rollouts ----------------------------------------------------------------------------------------------

    def _make_generator(self):
        if self.args.generator == "vllm":
            return VLLMServerGenerator(self.args.generator_url, max_concurrency=self.args.generator_max_concurrency)
        return TransformersGenerator(self.model, self.processing_class)

    def _run_rollouts(self, prompts: list[list[dict]], params: SamplingParams) -> list[Rollout]:
        """Roll out every prompt concurrently; the in-process generator needs the full (ZeRO-3 gathered) model."""
        coroutine = self.engine.run_messages(prompts, params)
        if self.args.generator == "transformers":
            with unwrap_model_for_generation(self.model_wrapped, self.accelerator) as unwrapped:
                self.engine.generator.model = unwrapped
                return self._loop.run_until_complete(coroutine)
        return self._loop.run_until_complete(coroutine)

    def _rollout_func(self, prompts: list[list[dict]], trainer) -> dict:
        """TRL's rollout hook: multi-turn rollouts for this process's prompts, plus what the rubric and logs need."""
        mode = "train" if self.model.training else "eval"
        params = SamplingParams(temperature=self.args.temperature, top_p=self.args.top_p,
                                max_tokens=self.args.max_tokens_per_turn)
        start = time.perf_counter()
        rollouts = self._run_rollouts(prompts, params)
        self._log_rollouts(mode, rollouts, time.perf_counter() - start)
        return {
            "prompt_ids": [r.prompt_ids for r in rollouts],
            "completion_ids": [r.completion_ids for r in rollouts],
            "logprobs": [r.logprobs for r in rollouts],
            "env_mask": [r.env_mask for r in rollouts],
            "messages": [r.messages for r in rollouts],
            "status": [r.status.value for r in rollouts],
            "num_tool_calls": [r.num_tool_calls for r in rollouts],
        }

    def _log_rollouts(self, mode: str, rollouts: list[Rollout], seconds: float) -> None:
        metrics = self._metrics[mode]
        statuses = Counter(r.status.value for r in rollouts)
        for status in ("done", "truncated_max_turns", "truncated_prompt_too_long", "truncated_length",
                       "error_parse", "error_timeout"):
            metrics[f"rollout/status_{status}"].append(statuses[status] / len(rollouts))
        metrics["rollout/searches_per_rollout"].append(sum(r.num_tool_calls for r in rollouts) / len(rollouts))
        metrics["rollout/turns_per_rollout"].append(sum(r.num_turns for r in rollouts) / len(rollouts))
        metrics["rollout/generated_tokens"].append(sum(sum(r.env_mask) for r in rollouts))
        metrics["rollout/time_s"].append(seconds)
        for key, value in self.env.metrics().items():
            metrics[key].append(value)

    def _generate(self, prompts):
        # Extends GRPOTrainer._generate (TRL 1.16): sync first, so TRL's own NCCL push finds the step loaded.
        self._sync_generator_weights()
        return super()._generate(prompts)

    # ---- weight sync -------------------------------------------------------------------------------------------

    def _sync_generator_weights(self) -> None:
        """Push the policy to the vLLM server once per optimizer step, before the step's rollouts or a validation.

        TRL 1.16 pushes over NCCL only before training rollouts (in ``GRPOTrainer._generate``), so a validation
        right after step N would sample from step N-1's weights; both paths go through here instead, timed as
        ``weight_sync/time_s``, and TRL's own check then sees the step as already loaded.
        """
        if self.args.generator != "vllm" or self._synced_step == self.state.global_step:
            return
        nccl = self.args.weight_sync == "nccl"
        if nccl or self.state.global_step > 0 or self._synced_step >= 0:  # the server starts with step 0's weights
            start = time.perf_counter()
            if nccl:
                self.vllm_generation.sync_weights()
            else:
                self.push_weights_to_generator()
            self._metrics["train"]["weight_sync/time_s"].append(time.perf_counter() - start)
        self._synced_step = self.state.global_step
        if nccl:
            self._last_loaded_step = self.state.global_step

    def push_weights_to_generator(self) -> None:
        """Save the full (merged, gathered) policy as safetensors and have the server reload it in place."""
        state_dict = self.accelerator.get_state_dict(self.model)
        if self.accelerator.is_main_process:
            model = self.accelerator.unwrap_model(self.model)
            if hasattr(model, "merge_and_unload"):  # PEFT: ship base weights with the adapter merged in
                state_dict = _merged_peft_state_dict(model)
                model = model.get_base_model()
            folder = Path(self.args.weight_sync_dir or Path(self.args.output_dir) / "generator_weights")
            tmp = Path(tempfile.mkdtemp(dir=folder.parent if folder.parent.exists() else None))
            model.save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)
            shutil.rmtree(folder, ignore_errors=True)
            tmp.rename(folder)
            reload_weights(self.args.generator_url, folder)
        self.accelerator.wait_for_everyone()

    # ---- validation --------------------------------------------------------------------------------------------

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        """Greedy rollouts over the fixed validation slice: EM overall and per data source, via the trainer's log."""
        self._sync_generator_weights()
        local = self.eval_samples[self.accelerator.process_index::self.accelerator.num_processes]
        params = SamplingParams.greedy(max_tokens=self.args.max_tokens_per_turn)
        start = time.perf_counter()
        rollouts = self._run_rollouts([self.env.initial_messages(s) for s in local], params)
        exact_match = RewardExactMatch()
        results = [(s.data_source or "all", exact_match.correct(r.messages, s.golden_answers), r.num_tool_calls,
                    r.num_turns, r.status.value) for s, r in zip(local, rollouts, strict=True)]
        results = gather_object(results)
        by_source: dict[str, list[float]] = defaultdict(list)
        for source, em, *_ in results:
            by_source[source].append(em)
        n = len(results)
        metrics = {
            f"{metric_key_prefix}_em": sum(r[1] for r in results) / n,
            f"{metric_key_prefix}_searches_per_rollout": sum(r[2] for r in results) / n,
            f"{metric_key_prefix}_turns_per_rollout": sum(r[3] for r in results) / n,
            f"{metric_key_prefix}_status_done": sum(r[4] == "done" for r in results) / n,
            f"{metric_key_prefix}_num_samples": n,
            f"{metric_key_prefix}_runtime": time.perf_counter() - start,
        }
        metrics.update({f"{metric_key_prefix}_em/{source}": sum(v) / len(v) for source, v in by_source.items()})
        self.log(metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        return metrics

    # ---- data, checkpoint and resume ---------------------------------------------------------------------------

    def get_train_dataloader(self):
        return QuestionBatches(self.train_stream, self.env, self.args, self.accelerator.process_index,
                               self.accelerator.num_processes)

    def _save_checkpoint(self, model, trial):
        # Extends Trainer/GRPOTrainer._save_checkpoint (transformers 5.24, TRL 1.16): also save the stream position.
        super()._save_checkpoint(model, trial)
        if self.args.should_save:
            folder = Path(self._get_output_dir(trial=trial)) / f"checkpoint-{self.state.global_step}"
            (folder / STREAM_STATE_FILE).write_text(json.dumps(self.train_stream.state_dict()))

    def train(self, resume_from_checkpoint: str | bool | None = None, **kwargs):
        if resume_from_checkpoint is True:
            resume_from_checkpoint = get_last_checkpoint(self.args.output_dir)
            if resume_from_checkpoint is None:
                raise ValueError(f"resume_from_checkpoint=True but {self.args.output_dir} has no checkpoint-* folder")
        if resume_from_checkpoint:
            state_file = Path(resume_from_checkpoint) / STREAM_STATE_FILE
            if not state_file.exists():
                raise FileNotFoundError(f"{state_file} is missing: cannot resume the question stream exactly")
            self.train_stream.load_state_dict(json.loads(state_file.read_text()))
        try:
            return super().train(resume_from_checkpoint=resume_from_checkpoint, **kwargs)
        finally:
            self._loop.run_until_complete(self.engine.generator.aclose())

    def create_model_card(self, model_name=None, dataset_name=None, tags=None):
        """TRL's card plus what a Search-R1 checkpoint needs to be reproduced: recipe, data, retriever, final EM."""
        super().create_model_card(model_name=model_name, dataset_name=dataset_name,
                                  tags=["search-r1", "searchr1-trl", *(tags or [])])
        if not self.is_world_process_zero():
            return
        evals = [entry for entry in self.state.log_history if "eval_em" in entry]
        final_em = f"{evals[-1]['eval_em']:.3f} at step {evals[-1]['step']}" if evals else "not evaluated"
        args = self.args
        section = "\n".join([
            "", "## Search-R1 recipe", "",
            f"- recipe: `{getattr(args, 'recipe', None) or 'custom'}`",
            f"- training questions: `{args.train_data_path or args.train_repo_id + '/' + args.train_filename}`"
            f" (data_source: {args.train_data_source or 'all'})",
            f"- validation: {'first' if args.eval_sample_seed is None else f'seed-{args.eval_sample_seed} sample of'} "
            f"{args.eval_num_samples} rows of "
            f"`{args.eval_data_path or args.train_repo_id + '/' + args.eval_filename}`"
            f" (data_source: {args.eval_data_source or 'all'}), greedy",
            f"- retriever: `{args.search_url}`, top-{args.topk} passages",
            f"- rollouts: {args.num_generations} per question, max_turns={args.max_turns}, "
            f"max_rollout_tokens={args.max_rollout_tokens}, max_tokens_per_turn={args.max_tokens_per_turn}",
            f"- loss: {args.loss_type}, epsilon={args.epsilon}, epsilon_high={args.epsilon_high}, beta={args.beta}, "
            f"lr={args.learning_rate}",
            f"- final validation EM: {final_em}", "",
        ])
        with open(os.path.join(args.output_dir, "README.md"), "a") as f:
            f.write(section)


def _merged_peft_state_dict(model) -> dict[str, torch.Tensor]:
    """Base-model state dict with the LoRA deltas merged in, under the base model's own parameter names."""
    model.merge_adapter()
    try:
        state = {}
        for name, tensor in model.state_dict().items():
            if "lora_" in name:
                continue
            name = name.removeprefix("base_model.model.").replace(".base_layer", "")
            state[name] = tensor.detach().clone()
        return state
    finally:
        model.unmerge_adapter()
