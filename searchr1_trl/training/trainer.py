"""SearchR1Trainer: TRL's GRPOTrainer with a task's question stream, multi-turn rollouts and rubric plugged in.

Its one job is the plugging; each part lives in a module of its own. The task (``task``) comes through its
:class:`~searchr1_trl.tasks.Task` and :func:`~searchr1_trl.training.parts.build_task`: questions drawn one optimizer
step at a time, so a resume continues the exact sequence (:mod:`~searchr1_trl.training.resume`). Rollouts go through
TRL's ``rollout_func``: the :class:`~searchr1_trl.engine.rollout.RolloutEngine` drives one of the task's environments
per row's sample (``env_mask`` keeps tool tokens out of the loss), the rubric scores each from its own sample, and
:mod:`~searchr1_trl.training.records` keeps what a run needs of them. The generator gets the weights once per
optimizer step (:mod:`searchr1_trl.serving.weight_sync`). Validation is greedy rollouts over a held-out slice
(:mod:`~searchr1_trl.training.evaluation`), guarded by :mod:`~searchr1_trl.training.callbacks`; the update's levers
are :mod:`~searchr1_trl.training.update`'s, asynchronous rollouts :mod:`searchr1_trl.training.experimental`'s. The
rollout loop and the generator's and environments' clients open with ``train()`` (or a standalone ``evaluate()``)
and close when it returns, also on an error.

The private surface of TRL 1.16.0 and transformers 5.24.0 this package relies on (``tests/test_trl_surface.py``
fails, naming the entry, when the installed versions are not the pinned ones or an entry is gone):

- ``trl.GRPOTrainer._compute_loss``: overridden, with ``padding_free`` hands the loss's token positions and old
  log-probs to the forward below, so the LM head skips tool tokens; with async rollouts and KL, runs without its KL
  term and adds the KL weighted by the staleness correction (its dapo/cispo normalisation and ``kl`` metric repeated).
- ``trl.GRPOTrainer.beta``: set to 0 while TRL's loss runs without its KL term (above).
- ``trl.GRPOTrainer._get_per_token_logps_and_entropies``: overridden, packs the rows for ``padding_free``; the loss's
  log-probs go to the staleness correction and, lock-step, to :mod:`~searchr1_trl.training.generator_gap`.
- ``trl.GRPOTrainer._generate``: overridden, pushes the weights first, so TRL's own NCCL push finds them loaded.
- ``trl.GRPOTrainer._generate_and_score_completions``: overridden, reads each row's sample for ``rollout_func``,
  drops groups without reward spread (``drop_equal_reward_groups``) from the loss mask and the token count it
  returns, and weights rollouts of older weights (``async_rollouts``).
- ``transformers.Trainer._save_checkpoint``: overridden, stream state first, completeness marker last, rotation after
  (:func:`~searchr1_trl.training.resume.complete_checkpoint`).
- ``transformers.Trainer._determine_best_metric``: called, ranks the step-0 validation as a best candidate.
- ``transformers.Trainer._get_output_dir``: called, the run folder a checkpoint goes to.
- ``transformers.trainer.rotate_checkpoints``: called, once the marker is written.
- ``trl.GRPOTrainer._metrics``: appended to, the per-mode metric lists TRL averages and logs.
- ``trl.GRPOTrainer._last_loaded_step``: written after our NCCL push, so TRL skips its own.
- ``trl.GRPOTrainer.vllm_generation``: TRL's vLLM client, whose ``sync_weights`` is the NCCL push.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from pathlib import Path

import datasets
import torch
from tqdm.auto import tqdm
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from trl import GRPOTrainer
from trl.models import unwrap_model_for_generation

from searchr1_trl.engine.rollout import Rollout, RolloutEngine
from searchr1_trl.serving.weight_sync import PausedPush, ReloadPush, warn_stale_tied_head, weight_push
from searchr1_trl.tasks.common.data import QuestionBatches, training_row
from searchr1_trl.training import evaluation, fixed_costs, records
from searchr1_trl.training.as_trained import save_recipe
from searchr1_trl.training.callbacks import CollapseGuard, DivergentStepGuard, NonFiniteGradientGuard
from searchr1_trl.training.experimental import async_rollouts
from searchr1_trl.training.experimental.staleness import StalenessCorrection
from searchr1_trl.training.generator_gap import GeneratorGap
from searchr1_trl.training.model_card import recipe_section, validation_em
from searchr1_trl.training.parts import TaskParts, build_task
from searchr1_trl.training.recipe import SearchR1Config, part_config
from searchr1_trl.training.resume import complete_checkpoint, resume_point
from searchr1_trl.training.rows import with_placeholder_completion
from searchr1_trl.training.update import (
    compile_for_training,
    drop_equal_reward_groups,
    loss_mask,
    packed_logps_and_entropies,
    with_fp32_master_weights,
)

logger = logging.getLogger(__name__)


class SearchR1Trainer(GRPOTrainer):
    """GRPO on multi-turn tool rollouts of the recipe's task.

    The task's parts come from ``args`` through :func:`~searchr1_trl.training.parts.build_task` unless ``parts`` are
    passed; ``reward_funcs`` defaults to the task's rubric (pass it with extra TRL reward functions to add them).
    """

    def __init__(self, model, args: SearchR1Config, processing_class=None, peft_config=None,
                 parts: TaskParts | None = None, reward_funcs: list | None = None, **kwargs):
        self.parts = parts = parts or build_task(args)
        self.train_stream, self.eval_samples, self.envs = parts.train_stream, parts.eval_samples, parts.envs
        self._batch_samples: list = []  # the task's samples of the rows being rolled out, in order
        self._loop: asyncio.AbstractEventLoop | None = None
        self._synced_step = -1
        self._loss_positions: tuple[torch.Tensor, torch.Tensor | None] | None = None  # set by _compute_loss
        # TRL requires a dataset object; this one describes the stream, the real batches come from QuestionBatches.
        train_dataset = datasets.IterableDataset.from_generator(lambda: iter(()))
        eval_dataset = datasets.Dataset.from_list([training_row(s, self.envs) for s in self.eval_samples]) or None
        super().__init__(
            model=model, reward_funcs=reward_funcs or [self.parts.rubric], args=args, train_dataset=train_dataset,
            eval_dataset=eval_dataset if len(self.eval_samples) else None, processing_class=processing_class,
            peft_config=peft_config, rollout_func=self._rollout_func, **kwargs,
        )
        self.add_callback(NonFiniteGradientGuard(self._metrics["train"]))
        self.startup = fixed_costs.StartupClock(self._metrics["train"])
        self.add_callback(self.startup)
        if args.compile_layers:
            compile_for_training(self.model, self.ref_model, self.accelerator)
        self.collapse_guard = None
        if args.collapse_guard and args.eval_strategy != "no":
            self.collapse_guard = CollapseGuard(part_config(args, "collapse_guard"))
            self.add_callback(self.collapse_guard)
        self.engine = RolloutEngine(self.processing_class, self.parts.generator(self.model, self.processing_class),
                                    self.envs, self.parts.rollout)
        self.weight_push = (weight_push(args, self.accelerator, getattr(self, "vllm_generation", None))
                            if args.generator == "vllm" else None)
        if isinstance(self.weight_push, ReloadPush):
            warn_stale_tied_head(self.model)
        self.pipeline: async_rollouts.RolloutPipeline | None = None  # made with the dataloader, under async_rollouts
        # Inert unless a step is weighted: a batch carrying behaviour weights, or a step weighted in its loss.
        self.correction = StalenessCorrection(args, self._metrics["train"], self.accelerator)
        self.generator_gap = GeneratorGap(self.accelerator, self._metrics["train"])  # lock-step, where TRL logs none
        if args.async_rollouts:
            self._plug_async_rollouts(args)

    def _plug_async_rollouts(self, args: SearchR1Config) -> None:
        """The experimental asynchronous mode: its checks, the staleness correction with the divergent step guard,
        and the weights the generator samples from (a snapshot in-process, a paused push with ``pause``)."""
        bound = async_rollouts.check_recipe(args, self.is_deepspeed_enabled)
        if bound is not None:
            self.correction.guard = DivergentStepGuard(bound, args.max_staleness, self._metrics["train"])
            self.add_callback(self.correction.guard)
        if args.generator == "transformers":
            self.weight_push = async_rollouts.SnapshotPush(self.accelerator.unwrap_model(self.model))
            self.engine.generator.model = self.weight_push.model
        elif args.in_flight_rollouts == "pause":
            self.weight_push = PausedPush(self.weight_push, self.accelerator, args.generator_url,
                                          args.weight_sync_timeout_s)

    # ---- policy update -----------------------------------------------------------------------------------------

    def create_optimizer(self, model=None):
        optimizer = super().create_optimizer(model)
        if self.args.fp32_master_weights:
            with_fp32_master_weights(optimizer, deepspeed=self.is_deepspeed_enabled)
        return optimizer

    def _compute_loss(self, model, inputs):
        # Extends GRPOTrainer._compute_loss (TRL 1.16), which scores every completion position and masks tool tokens
        # afterwards: with padding_free the LM head scores only the loss's positions (a search rollout's passages are
        # most of its completion). With async rollouts and KL, TRL's loss runs without its KL term and the weighted
        # one is added (StalenessCorrection.kl_term).
        mask = loss_mask(inputs)
        weighted = self.correction.begin_loss(inputs, self.beta)
        self.generator_gap.begin_loss(inputs)
        self._loss_positions = (mask.bool(), inputs.get("old_per_token_logps")) if self.args.padding_free else None
        beta, self.beta = self.beta, 0.0 if weighted else self.beta
        try:
            loss = super()._compute_loss(model, inputs)
            if weighted:
                loss = loss + self.correction.kl_term(inputs, mask, beta, self.model.training,
                                                      self.current_gradient_accumulation_steps,
                                                      self._metrics["train" if self.model.training else "eval"])
        finally:
            self.beta, self._loss_positions = beta, None
            self.correction.end_loss()
            self.generator_gap.end_loss()
        return loss

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           compute_entropy=False, compute_aux_loss=False, **multimodal):
        # Extends GRPOTrainer._get_per_token_logps_and_entropies (TRL 1.16): with padding_free, each chunk of rows is
        # packed (update.packed_logps_and_entropies); the fused LM head and what it returns are TRL's. Called from
        # _compute_loss it scores the loss's positions only, and hands its log-probs to the staleness correction.
        if self.args.padding_free:
            result = packed_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy, compute_aux_loss,
                self.accelerator.autocast, self._loss_positions, one_graph=self.args.compile_layers, **multimodal)
        else:
            result = super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size,
                compute_entropy=compute_entropy, compute_aux_loss=compute_aux_loss, **multimodal)
        self.correction.forward(result[0])
        self.generator_gap.forward(result[0])
        return result

    def _generate_and_score_completions(self, inputs):
        # Extends GRPOTrainer._generate_and_score_completions (TRL 1.16), which hands rollout_func only the prompts:
        # each rollout gets its own row's sample, as TRL's environment_factory gets reset(**row). Then it drops
        # equal-reward groups and weights rollouts sampled by older weights (async_rollouts).
        # Timed as ``generate_and_score/time_s`` (push, rollouts, rewards, TRL's old-log-prob forward): the rest of
        # TRL's step_time is the loss and the backward passes.
        start = time.perf_counter()
        self._batch_samples = [self.parts.task.sample.from_row(row) for row in inputs]
        output = super()._generate_and_score_completions(inputs)
        if self.model.training:
            if self.args.drop_equal_reward_groups:
                output = drop_equal_reward_groups(output, self.num_generations, self.accelerator,
                                                  self._metrics["train"])
            output = self.correction.weigh(output) if self.pipeline is not None else self.generator_gap.expect(output)
            self._metrics["train"]["generate_and_score/time_s"].append(time.perf_counter() - start)
            if torch.cuda.is_available() and self.accelerator.device.type == "cuda":
                # since the last step's scoring: its update, then this step's rollouts and scoring (the trainer
                # process only; a vLLM server on the same GPU holds its own)
                self._metrics["train"]["train/peak_memory_gib"].append(torch.cuda.max_memory_allocated() / 2**30)
                torch.cuda.reset_peak_memory_stats()
        return output

    # ---- rollouts ----------------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _event_loop(self):
        """The loop rollouts run on. The outermost caller (``train()``, a standalone ``evaluate()`` or rollout)
        opens it and closes it when done, with the generator's and the environments' connections. Under
        ``async_rollouts`` it runs in a thread of its own, so launched rollouts go on while the trainer updates."""
        if self._loop is not None:
            yield self._loop
            return
        self._loop = asyncio.new_event_loop()
        thread = async_rollouts.start_in_thread(self._loop) if self.args.async_rollouts else None
        try:
            yield self._loop
        finally:
            try:
                if self.pipeline is not None:
                    self.pipeline.cancel()
                async_rollouts.run_on(self._loop, self.engine.generator.aclose())
                async_rollouts.run_on(self._loop, self.envs.aclose())
            finally:
                if thread is not None:
                    async_rollouts.stop_thread(self._loop, thread)
                self._loop.close()
                self._loop = None

    def _run_on_generator(self, coroutine):
        """Run a coroutine that generates on the rollout loop; the in-process generator needs the full (ZeRO-3
        gathered) model."""
        with self._event_loop() as loop:
            if self.args.generator == "transformers" and not self.args.async_rollouts:  # async: the snapshot's
                with unwrap_model_for_generation(self.model_wrapped, self.accelerator) as unwrapped:
                    self.engine.generator.model = unwrapped
                    return loop.run_until_complete(coroutine)
            return async_rollouts.run_on(loop, coroutine)

    def _rollout_func(self, prompts: list[list[dict]], trainer) -> dict:
        """TRL's rollout hook: one multi-turn rollout per row of this process's batch, each in an env built for its
        sample, plus what the rubric and logs need."""
        if len(self._batch_samples) != len(prompts):
            raise ValueError(f"rollout_func got {len(prompts)} prompts for {len(self._batch_samples)} rows; TRL no "
                             f"longer hands it one prompt per row (SearchR1Trainer relies on TRL 1.16's layout)")
        mode = "train" if self.model.training else "eval"
        start = time.perf_counter()
        if self.pipeline is not None and mode == "train":
            rollouts = self.pipeline.take(self.state.global_step, self._batch_samples, self.state.max_steps)
        else:
            rollouts = self._run_on_generator(self.engine.run(self._batch_samples, self.parts.sampling))
        self._log_rollouts(mode, rollouts, time.perf_counter() - start)
        rollouts = with_placeholder_completion(rollouts, self.processing_class.eos_token_id)  # TRL needs a token
        return {
            "prompt_ids": [r.prompt_ids for r in rollouts],
            "completion_ids": [r.completion_ids for r in rollouts],
            "logprobs": [r.logprobs for r in rollouts],
            "env_mask": [r.env_mask for r in rollouts],
            "messages": [r.messages for r in rollouts],
            "status": [r.status.value for r in rollouts],
            "num_tool_calls": [r.num_tool_calls for r in rollouts],
            "rollout": rollouts,  # the rubric scores each from its own sample
        }

    def _log_rollouts(self, mode: str, rollouts: list[Rollout], seconds: float) -> None:
        records.record_rollouts(mode, self._metrics[mode], rollouts, seconds, self.envs.metrics(), self.args,
                                self.accelerator, self.state.global_step)

    def _generate(self, prompts):
        # Extends GRPOTrainer._generate (TRL 1.16): sync first, so TRL's own NCCL push finds the step loaded.
        self._sync_generator_weights()
        return super()._generate(prompts)

    # ---- weight sync -------------------------------------------------------------------------------------------

    def _sync_generator_weights(self) -> None:
        """Push the policy to the vLLM server once per optimizer step, before the step's rollouts or a validation.
        TRL 1.16 pushes over NCCL only before training rollouts (in ``GRPOTrainer._generate``), so a validation right
        after step N would sample from step N-1's weights; both paths go through here instead, timed as
        ``weight_sync/time_s``, and TRL's own check then sees the step as already loaded."""
        if self.weight_push is None or self._synced_step == self.state.global_step:
            return
        nccl = self.args.weight_sync == "nccl" and self.args.generator == "vllm"
        # A reload server holds step 0's weights already (the warm start reloads it itself); over NCCL or IPC the
        # first push is what gives it the warm-started ones.
        pushes_step_0 = self.args.weight_sync in ("nccl", "ipc") and self.args.generator == "vllm"
        if pushes_step_0 or self.state.global_step > 0 or self._synced_step >= 0:
            if self.pipeline is not None and self.args.in_flight_rollouts == "finish":
                self.pipeline.drain()  # in-flight rollouts finish on the weights they started with
            start = time.perf_counter()
            # The wrapped model: under ZeRO-3 only the DeepSpeed engine can gather the sharded weights.
            self.weight_push.push(self.model_wrapped)
            self._metrics["train"]["weight_sync/time_s"].append(time.perf_counter() - start)
        self._synced_step = self.state.global_step
        if self.pipeline is not None:
            self.pipeline.pushed(self.state.global_step)
        if nccl:
            self._last_loaded_step = self.state.global_step

    # ---- validation --------------------------------------------------------------------------------------------

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        """The ``agent`` method of :mod:`searchr1_trl.training.evaluation` over the validation slice, logged as
        ``<prefix>_*``, and over the report slice as ``report_*``: in the same pass where ``report_at`` asks
        (:func:`~searchr1_trl.training.fixed_costs.report_due`), after it where a stop is decided on this validation.
        Training's step-0 validation is saved as a best-checkpoint candidate when the collapse guard is on."""
        report = [("report", s) for s in self.parts.report_samples]
        due = fixed_costs.report_due(self.args.report_at, self.state, self.control, self.is_in_train)
        metrics = self._validate([(metric_key_prefix, s) for s in self.eval_samples] + (report if due else []),
                                 f"{metric_key_prefix}_runtime", self.state.global_step)
        self.log(metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        if report and not due and self.control.should_training_stop:  # a stop on this validation: the last step's
            self.log(self._validate(report, "report_runtime", self.state.global_step))
        if self.args.load_best_model_at_end and self.collapse_guard is not None and \
                self.collapse_guard.wants_start_checkpoint(self.state):
            # transformers saves (and ranks) checkpoints only after optimizer steps; the start can be the best.
            self._determine_best_metric(metrics=metrics, trial=None)
            self._save_checkpoint(self.model_wrapped, trial=None)
            # transformers 5.24 reads best_global_step 0 as "none" and would not record this checkpoint as the best
            run_dir = Path(self._get_output_dir(trial=None))
            self.state.best_model_checkpoint = str(run_dir / f"{PREFIX_CHECKPOINT_DIR}-0")
        return metrics

    def _validate(self, held_out: list[tuple], runtime_key: str, step: int) -> dict[str, float]:
        """Greedy rollouts of ``held_out`` (``(sample name, sample)`` pairs) by the weights of ``step`` (an earlier
        one's once training has ended on its checkpoint), written to ``validation_traces/step-<step>.jsonl``: each
        sample's :func:`~searchr1_trl.training.evaluation.summarize` as ``<name>_*``, the seconds as ``runtime_key``."""
        if self.pipeline is not None:
            self.pipeline.drain()  # validation runs alone
        self._sync_generator_weights()
        local = held_out[self.accelerator.process_index::self.accelerator.num_processes]
        start = time.perf_counter()
        progress = tqdm(total=len(local), desc="validation rollouts", unit="rollout", leave=False,
                        disable=not self.is_local_process_zero())
        traces = self._run_on_generator(evaluation.run(
            evaluation.Method("agent", self.engine, answer=self.parts.task.answer), [sample for _, sample in local],
            evaluation.greedy_params(self.parts.sampling.max_tokens),
            on_trace=lambda index, trace: progress.update(), max_concurrency=self.args.generator_max_concurrency,
        ))
        progress.close()
        named = [(name, trace) for (name, _), trace in zip(local, traces, strict=True)]
        if self.args.save_validation_traces:
            records.write_validation_traces(self.args, self.accelerator, step, named)
        return {**records.summaries(named), runtime_key: time.perf_counter() - start}

    # ---- data, checkpoint and resume ---------------------------------------------------------------------------

    def get_train_dataloader(self):
        batches = QuestionBatches(self.train_stream, self.envs, self.args, self.accelerator.process_index,
                                  self.accelerator.num_processes)
        if self.args.async_rollouts:
            batches.source = async_rollouts.Lookahead(batches.draw, self.train_stream.state_dict)
            self.pipeline = async_rollouts.RolloutPipeline(
                lambda samples: asyncio.run_coroutine_threadsafe(
                    self.engine.run(samples, self.parts.sampling), self._loop),
                batches.source, lambda rows: [self.parts.task.sample.from_row(row) for row in rows],
                self.args.max_staleness, self._metrics["train"])
        return batches

    def _save_checkpoint(self, model, trial):
        # Extends Trainer/GRPOTrainer._save_checkpoint (transformers 5.24, TRL 1.16): complete or ignored
        # (resume.complete_checkpoint). Under async_rollouts the questions drawn ahead are served again after a resume.
        stream = self.pipeline.lookahead if self.pipeline is not None else self.train_stream
        with complete_checkpoint(self, trial, stream):
            super()._save_checkpoint(model, trial)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False):
        """Trainer's save (every checkpoint goes through it too), plus the recipe beside the weights, so a checkpoint
        is evaluated as it was trained (``searchr1-eval``)."""
        super().save_model(output_dir, _internal_call)
        if self.args.should_save:
            save_recipe(self.args, output_dir or self.args.output_dir)

    def train(self, resume_from_checkpoint: str | bool | None = None, **kwargs):
        resume_from_checkpoint = resume_point(resume_from_checkpoint, self.args.output_dir, self.train_stream)
        with self._event_loop():
            output = super().train(resume_from_checkpoint=resume_from_checkpoint, **kwargs)
            kept = self.state.best_global_step
            if self.args.load_best_model_at_end and kept is not None and kept != self.state.global_step:
                logger.warning("training ends on the step-%d checkpoint (validation EM %.3f), not the last step %d: "
                               "%s", kept, validation_em(self.state, kept), self.state.global_step,
                               "a collapse stopped it" if self.collapse_guard.collapse else
                               "it beats the last validated step by more than the validation sample's noise")
                self._synced_step = -1  # the server holds the last step's weights: push the restored ones next time
                if self.parts.report_samples and fixed_costs.saved_model_unreported(self.state, kept):
                    saved = self._validate([("report", s) for s in self.parts.report_samples], "report_runtime", kept)
                    self.log({**{f"saved_{key}": value for key, value in saved.items()}, "saved_report_step": kept})
        return output

    def create_model_card(self, model_name=None, dataset_name=None, tags=None):
        """TRL's card plus what a checkpoint needs to be reproduced (:mod:`searchr1_trl.training.model_card`)."""
        super().create_model_card(model_name=model_name, dataset_name=dataset_name,
                                  tags=["search-r1", "searchr1-trl", *(tags or [])])
        if self.is_world_process_zero():
            with open(os.path.join(self.args.output_dir, "README.md"), "a") as f:
                f.write(recipe_section(self.args, self.state))
