"""SearchR1Trainer: TRL's GRPOTrainer with the Search-R1 question stream, multi-turn rollouts and EM rubric plugged in.

What this subclass decides, and nothing more:
- **The task** is the recipe's (``task``, :func:`~searchr1_trl.tasks.get_task`), reached only through its
  :class:`~searchr1_trl.tasks.Task`: its samples, environments and answer reader.
- **Questions** come from the endless, seeded :class:`~searchr1_trl.tasks.common.data.SearchR1Dataset`, drawn one
  optimizer step at a time (:class:`~searchr1_trl.tasks.common.data.QuestionBatches`), not a sampler over a map-style
  dataset, so a resumed run continues the exact question sequence (its state is saved in every checkpoint next to the
  optimizer's).
- **A checkpoint is complete or ignored**: the stream state is written (atomically) first, a
  :data:`CHECKPOINT_COMPLETE_FILE` marker last, and older checkpoints are rotated away only after the marker, so a
  kill at any moment leaves a complete checkpoint; ``resume_from_checkpoint=True`` (``latest``) takes the newest one
  whose files are whole (:func:`~searchr1_trl.training.checkpoints.resume_checkpoint`).
- **Rollouts** go through TRL's ``rollout_func`` hook: the generic :class:`~searchr1_trl.engine.rollout.RolloutEngine`
  drives one of the task's environments per rollout, built for that row's sample; the
  returned
  ``env_mask`` keeps tool tokens out of the loss.
- **Rewards** are the :class:`~searchr1_trl.tasks.common.rubric.Rubric`, a plain TRL reward function that scores each
  rollout (handed on by ``rollout_func``) from its own sample.
- **Generator weights** are pushed once per optimizer step, before its rollouts or a validation, by the
  :mod:`searchr1_trl.serving.weight_sync` push the recipe names (TRL's NCCL path, a safetensors folder the vLLM server
  reloads, or CUDA IPC to a server on the same GPU). The in-process generator (``generator="transformers"``) uses
  the live model, no sync.
- **Validation** is greedy rollouts over a fixed held-out slice, logged as EM overall and per data source.
- **Asynchronous rollouts** (``async_rollouts``, experimental, off by default;
:mod:`searchr1_trl.training.experimental.async_rollouts`): the next
  ``max_staleness`` steps' rollouts generate on the rollout loop, run in a background thread, while the trainer
  updates; each is tagged with its policy version, bounded in staleness and weighted by ``pi_current / pi_behaviour``;
  with ``max_behaviour_kl`` a step the policy has moved too far from is skipped
  (:class:`~searchr1_trl.training.callbacks.DivergentStepGuard`).
- **Three throughput levers of the policy update** (:mod:`searchr1_trl.training.update`, all off by default):
  ``fp32_master_weights`` (bf16 weights, fp32 copies in the optimizer), ``padding_free`` (rollouts packed without
  padding for the log-prob forward) and ``compile_layers`` (each decoder layer ``torch.compile``-d in place); the
  loss, tool tokens masked, is TRL's either way.
- **The saved model is the newest validated checkpoint within noise of the best**
  (:class:`~searchr1_trl.training.callbacks.CollapseGuard`): without a collapse the last step, unless an earlier
  checkpoint beats it by more than the validation sample's noise; a collapse stops training, step 0 is a candidate;
  ``report_num_samples`` questions disjoint from the validation sample are evaluated beside it, as the figure to report.
- **DAPO's dynamic sampling** (``drop_equal_reward_groups``): groups without reward spread leave the loss.
- **An optimizer step with NaN/inf gradients is skipped**, not applied
  (:class:`~searchr1_trl.training.callbacks.NonFiniteGradientGuard`).
- **Connections are closed**: the event loop rollouts run on, the generator's and the retriever's pooled clients are
  opened by ``train()`` (or a standalone ``evaluate()``) and closed when it returns, also on an error.

The recipe (:class:`~searchr1_trl.training.recipe.SearchR1Config`) and the parts it builds live in
:mod:`searchr1_trl.training.recipe`.

The private surface of TRL 1.16.0 and transformers 5.24.0 this module relies on (``tests/test_trl_surface.py``
fails, naming the entry, when the installed versions are not the pinned ones or an entry is gone):

- ``trl.GRPOTrainer._compute_loss``: overridden, with ``padding_free`` hands the loss's token positions and old
  log-probs to the forward below, so the LM head skips tool tokens; with async rollouts and KL, runs without its KL
  term and adds the KL weighted by the staleness correction (its dapo/cispo normalisation and ``kl`` metric repeated).
- ``trl.GRPOTrainer.beta``: set to 0 while TRL's loss runs without its KL term (above).
- ``trl.GRPOTrainer._get_per_token_logps_and_entropies``: overridden, packs the rows for ``padding_free``.
- ``trl.GRPOTrainer._generate``: overridden, pushes the weights first, so TRL's own NCCL push finds them loaded.
- ``trl.GRPOTrainer._generate_and_score_completions``: overridden, reads each row's sample for ``rollout_func``,
  drops groups without reward spread (``drop_equal_reward_groups``) from the loss mask and the token count it
  returns, and weights rollouts of older weights (``async_rollouts``).
- ``transformers.Trainer._save_checkpoint``: overridden, stream state first, completeness marker last, rotation after.
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
import json
import logging
import os
import time
from collections import Counter
from dataclasses import asdict, replace
from pathlib import Path

import datasets
import torch
from accelerate.utils import gather_object
from tqdm.auto import tqdm
from transformers.trainer import rotate_checkpoints
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from trl import GRPOTrainer
from trl.models import unwrap_model_for_generation

from searchr1_trl.engine.rollout import Rollout, RolloutEngine, RolloutStatus
from searchr1_trl.serving.weight_sync import PausedPush, ReloadPush, warn_stale_tied_head, weight_push
from searchr1_trl.tasks.common.data import QuestionBatches, training_row
from searchr1_trl.training import evaluation
from searchr1_trl.training.as_trained import save_recipe
from searchr1_trl.training.callbacks import CollapseGuard, DivergentStepGuard, NonFiniteGradientGuard
from searchr1_trl.training.checkpoints import (
    CHECKPOINT_COMPLETE_FILE,
    STREAM_STATE_FILE,
    resume_checkpoint,
    save_failure,
)
from searchr1_trl.training.experimental import async_rollouts
from searchr1_trl.training.recipe import SearchR1Config, TaskParts, build_task, part_config
from searchr1_trl.training.rows import with_placeholder_completion
from searchr1_trl.training.update import compile_decoder_layers, loss_mask, packed_forward, with_fp32_master_weights

logger = logging.getLogger(__name__)

class SearchOutage(RuntimeError):
    """More of a step's searches failed than the recipe allows (``max_failed_search_fraction``)."""




class SearchR1Trainer(GRPOTrainer):
    """GRPO on multi-turn tool rollouts of the recipe's task.

    The task's parts come from ``args`` through :func:`~searchr1_trl.training.recipe.build_task` unless ``parts`` are
    passed; ``reward_funcs`` defaults to the task's rubric (pass it with extra TRL reward functions to add them).
    """

    def __init__(self, model, args: SearchR1Config, processing_class=None, peft_config=None,
                 parts: TaskParts | None = None, reward_funcs: list | None = None, **kwargs):
        self.parts = parts or build_task(args)
        self.train_stream, self.eval_samples, self.envs = (self.parts.train_stream, self.parts.eval_samples,
                                                           self.parts.envs)
        self._batch_samples: list = []  # the task's samples of the rows being rolled out, in order
        self._loop: asyncio.AbstractEventLoop | None = None
        self._synced_step = -1
        self._loss_positions: tuple[torch.Tensor, torch.Tensor | None] | None = None  # set by _compute_loss
        self._loss_logps: list[torch.Tensor] | None = None  # collected by _compute_loss for the weighted KL
        self._in_loss_weights: async_rollouts.InLossWeights | None = None  # a step weighted in its loss (async)
        self._weigh: dict | None = None  # the micro-batch whose loss forward gives its weights
        # TRL requires a dataset object; this one describes the stream, the real batches come from QuestionBatches.
        train_dataset = datasets.IterableDataset.from_generator(lambda: iter(()))
        eval_dataset = datasets.Dataset.from_list([training_row(s, self.envs) for s in self.eval_samples]) or None
        super().__init__(
            model=model, reward_funcs=reward_funcs or [self.parts.rubric], args=args, train_dataset=train_dataset,
            eval_dataset=eval_dataset if len(self.eval_samples) else None, processing_class=processing_class,
            peft_config=peft_config, rollout_func=self._rollout_func, **kwargs,
        )
        self.add_callback(NonFiniteGradientGuard(self._metrics["train"]))
        if args.compile_layers:
            if self.is_deepspeed_enabled and self.accelerator.state.deepspeed_plugin.zero_stage == 3:
                raise ValueError("compile_layers=True under DeepSpeed ZeRO-3: torch.compile traces into ZeRO-3's "
                                 "parameter-gathering hooks and recompiles until its limit, then runs the layers "
                                 "eager; drop compile_layers, or train without ZeRO-3 (ZeRO-1/2 compile as one GPU)")
            compile_decoder_layers(self.model)
            if self.ref_model is not None:  # its forward (beta > 0) is a third of the update's work, in series
                compile_decoder_layers(self.ref_model)
        self.collapse_guard = None
        if args.collapse_guard and args.eval_strategy != "no":
            self.collapse_guard = CollapseGuard(part_config(args, "collapse_guard"))
            self.add_callback(self.collapse_guard)
        self.engine = RolloutEngine(self.processing_class, self.parts.generator(self.model, self.processing_class),
                                    self.envs, self.parts.rollout)
        if args.generator == "vllm" and args.weight_sync == "ipc":
            if self.accelerator.device.type != "cuda":  # else the first push fails, in the server's words
                raise ValueError(f"weight_sync='ipc' shares CUDA memory with a server on the trainer's GPU; this "
                                 f"trainer runs on {self.accelerator.device.type}: use weight_sync='reload'")
            if self.accelerator.num_processes > 1 or self.is_deepspeed_enabled:
                raise ValueError("weight_sync='ipc' pushes from one trainer process without DeepSpeed to a server on "
                                 f"its GPU (here {self.accelerator.num_processes} processes, DeepSpeed "
                                 f"{self.is_deepspeed_enabled}); use weight_sync='nccl'")
        self.weight_push = (weight_push(args, self.accelerator, getattr(self, "vllm_generation", None))
                            if args.generator == "vllm" else None)
        if isinstance(self.weight_push, ReloadPush):
            warn_stale_tied_head(self.model)
        self.pipeline: async_rollouts.RolloutPipeline | None = None  # made with the dataloader, under async_rollouts
        self.divergence_guard: DivergentStepGuard | None = None
        if args.async_rollouts:
            bound = async_rollouts.check_recipe(args, self.is_deepspeed_enabled)
            if bound is not None:
                self.divergence_guard = DivergentStepGuard(bound, args.max_staleness,
                                                           self._metrics["train"])
                self.add_callback(self.divergence_guard)
            if args.generator == "transformers":
                self.weight_push = async_rollouts.SnapshotPush(self.accelerator.unwrap_model(self.model))
                self.engine.generator.model = self.weight_push.model
            elif args.in_flight_rollouts == "pause":
                self.weight_push = PausedPush(self.weight_push, self.accelerator, args.generator_url)

    # ---- policy update -----------------------------------------------------------------------------------------

    def create_optimizer(self, model=None):
        optimizer = super().create_optimizer(model)
        if self.args.fp32_master_weights:
            with_fp32_master_weights(optimizer, deepspeed=self.is_deepspeed_enabled)
        return optimizer

    def _compute_loss(self, model, inputs):
        # Extends GRPOTrainer._compute_loss (TRL 1.16), which scores every completion position and masks tool tokens
        # afterwards: with padding_free the LM head scores only the loss's positions (a search rollout's passages are
        # most of its completion). A skipped position takes its old log-prob where there is one, so its ratio is 1
        # (as TRL's on-policy case) and none overflows before the mask. With async rollouts and KL, TRL's loss runs
        # without its KL term and the weighted one is added here (async_rollouts.weighted_kl).
        mask = loss_mask(inputs)
        self._weigh = inputs if self._in_loss_weights is not None else None  # set by a training step only
        weighted = self.beta != 0.0 and (async_rollouts.WEIGHTS in inputs or self._weigh is not None)
        self._loss_positions = (mask.bool(), inputs.get("old_per_token_logps")) if self.args.padding_free else None
        self._loss_logps = [] if weighted else None
        beta, self.beta = self.beta, 0.0 if weighted else self.beta
        try:
            loss = super()._compute_loss(model, inputs)
            logps = self._loss_logps
        finally:
            self.beta, self._loss_positions, self._loss_logps, self._weigh = beta, None, None, None
        if not weighted:
            return loss
        kl, weighted_kl = async_rollouts.weighted_kl(torch.cat(logps), inputs, mask, self.args)
        # TRL's normalisation of dapo and cispo (the only losses async KL runs with: async_rollouts.check_recipe)
        mode = "train" if self.model.training else "eval"
        normalizer = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
        if mode == "train":
            normalizer = normalizer * self.current_gradient_accumulation_steps / self.args.steps_per_generation
        totals = self.accelerator.reduce(torch.stack([(kl * mask).sum().detach(), mask.sum().float()]), "sum")
        self._metrics[mode]["kl"].append((totals[0] / totals[1].clamp(min=1.0)).item())
        return loss + beta * (weighted_kl * mask).sum() / normalizer

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           compute_entropy=False, compute_aux_loss=False, **multimodal):
        # Extends GRPOTrainer._get_per_token_logps_and_entropies (TRL 1.16): with padding_free, each chunk of rows is
        # packed (searchr1_trl.training.update.packed_forward); the fused LM head and what it returns are TRL's. Called
        # from
        # _compute_loss it scores the loss's positions only, and hands its log-probs to the weighted KL (above).
        if self.args.padding_free:
            result = self._packed_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep, batch_size,
                                                      compute_entropy, compute_aux_loss, **multimodal)
        else:
            result = super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size,
                compute_entropy=compute_entropy, compute_aux_loss=compute_aux_loss, **multimodal)
        if self._loss_logps is not None:
            self._loss_logps.append(result[0])
        if self._weigh is not None:  # the loss's forward: TRL reads the micro-batch's advantages after it
            micro_batch, self._weigh = self._weigh, None
            gap = self._in_loss_weights.fold(micro_batch, result[0].detach(), self.args, self._metrics["train"])
            if gap is not None:  # the step's last micro-batch
                self._in_loss_weights = None
                self._hand_gap_to_guard(gap)
        return result

    def _packed_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size,
                                    compute_entropy, compute_aux_loss, **multimodal):
        given = sorted(name for name, value in multimodal.items() if value is not None)
        if given:
            raise ValueError(f"padding_free=True packs text rollouts only; this batch has {', '.join(given)}")
        batch_size = batch_size or input_ids.size(0)
        scored, old = self._loss_positions or (None, None)
        if scored is not None and scored.shape != (input_ids.size(0), logits_to_keep):
            raise ValueError(f"loss positions {tuple(scored.shape)} do not match the batch's "
                             f"{(input_ids.size(0), logits_to_keep)} completion positions")
        logps, entropies, aux_losses = [], [], []
        for start in range(0, input_ids.size(0), batch_size):
            rows = slice(start, start + batch_size)
            outputs = packed_forward(
                model, input_ids[rows], attention_mask[rows], logits_to_keep, self.accelerator.autocast,
                scored_columns=None if scored is None else scored[rows], one_graph=self.args.compile_layers,
                **({"output_router_logits": True} if compute_aux_loss else {}))
            if scored is not None and old is not None:
                outputs.log_probs = torch.where(scored[rows], outputs.log_probs, old[rows].to(outputs.log_probs))
            logps.append(outputs.log_probs)
            entropies.append(outputs.entropy)
            aux_losses.append(outputs.aux_loss)
        return (torch.cat(logps), torch.cat(entropies) if compute_entropy else None,
                torch.stack(aux_losses).mean() if compute_aux_loss else None)

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
                output = self._drop_equal_reward_groups(output)
            if self.pipeline is not None:
                output = self._weight_stale_rollouts(output)
            self._metrics["train"]["generate_and_score/time_s"].append(time.perf_counter() - start)
            if torch.cuda.is_available() and self.accelerator.device.type == "cuda":
                # since the last step's scoring: its update, then this step's rollouts and scoring (the trainer
                # process only; a vLLM server on the same GPU holds its own)
                self._metrics["train"]["train/peak_memory_gib"].append(torch.cuda.max_memory_allocated() / 2**30)
                torch.cuda.reset_peak_memory_stats()
        return output

    def _drop_equal_reward_groups(self, output: dict) -> dict:
        """A group whose advantages are all ~0 (equal rewards; TRL divides by std + 1e-4, so float noise stays far
        below 0.01 while a group with spread has |advantage| ~1) leaves the loss mask and the DAPO token count."""
        advantages = output["advantages"]
        if advantages.numel() % self.num_generations:
            raise ValueError(f"drop_equal_reward_groups: this process holds {advantages.numel()} rollouts, not whole "
                             f"groups of num_generations={self.num_generations}")
        keep = (advantages.view(-1, self.num_generations).abs() > 0.01).any(dim=1)
        self._metrics["train"]["train/dropped_groups"].append(1.0 - keep.float().mean().item())
        output["completion_mask"] = output["completion_mask"] * keep.repeat_interleave(self.num_generations)[:, None]
        output["num_items_in_batch"] = self.accelerator.gather(loss_mask(output).sum()).sum()
        return output

    def _weight_stale_rollouts(self, output: dict) -> dict:
        """With async_rollouts, the advantages weighted by pi_current / pi_behaviour where TRL did not weight the loss
        (:func:`~searchr1_trl.training.experimental.async_rollouts.weight_by_behaviour`): now from TRL's
        current-weights log-probs, or in
        the loss from its forward's where TRL computed none
        (:class:`~searchr1_trl.training.experimental.async_rollouts.InLossWeights`)."""
        if not self.args.vllm_importance_sampling_correction:
            return output
        proximal = output.get("old_per_token_logps")
        if proximal is None:
            self._in_loss_weights = async_rollouts.InLossWeights(output["advantages"].size(0))
            return output
        advantages = output["advantages"]
        output = async_rollouts.weight_by_behaviour(output, proximal, self.args)
        self._hand_gap_to_guard(async_rollouts.log_behaviour(output, advantages, proximal, self.args,
                                                             self._metrics["train"]))
        return output

    def _hand_gap_to_guard(self, gap: float) -> None:
        """The step's behaviour gap, averaged over processes (every replica must skip alike), to the divergent step
        guard."""
        if self.divergence_guard is not None:
            gap = torch.tensor(gap, device=self.accelerator.device)
            self.divergence_guard.gap = self.accelerator.reduce(gap, "mean").item()

    # ---- rollouts ----------------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _event_loop(self):
        """The loop rollouts run on. The outermost caller (``train()``, a standalone ``evaluate()`` or rollout)
        opens it and closes it when done, with the generator's and the retriever's connections. Under
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
        metrics = self._metrics[mode]
        statuses = Counter(r.status for r in rollouts)
        for status in RolloutStatus:
            metrics[f"rollout/status_{status.value}"].append(statuses[status] / len(rollouts))
        metrics["rollout/searches_per_rollout"].append(sum(r.num_tool_calls for r in rollouts) / len(rollouts))
        metrics["rollout/turns_per_rollout"].append(sum(r.num_turns for r in rollouts) / len(rollouts))
        metrics["rollout/closed_turns_per_rollout"].append(sum(r.closed_turns for r in rollouts) / len(rollouts))
        metrics["rollout/generated_tokens"].append(sum(sum(r.env_mask) for r in rollouts))
        metrics["rollout/time_s"].append(seconds)
        env_metrics = self.envs.metrics()
        for key, value in env_metrics.items():
            metrics[key].append(value)
        if mode == "train" and "search/searches" in env_metrics:  # a task that searches
            self._stop_on_search_outage(env_metrics["search/failures"], env_metrics["search/searches"])
            if self.args.save_parse_failures:
                self._write_parse_failures([r for r in rollouts if r.status == RolloutStatus.ERROR_PARSE])

    def _process_file(self, name: str) -> Path:
        """``output_dir/name``, suffixed ``-rank<i>`` under several processes: each writes what it generated."""
        path = Path(self.args.output_dir) / name
        if self.accelerator.num_processes > 1:
            path = path.with_name(f"{path.stem}-rank{self.accelerator.process_index}{path.suffix}")
        return path

    def _write_parse_failures(self, failed: list[Rollout]) -> None:
        """Append this process's unparsed training turns to ``parse_failures.jsonl``: the rates say how often the
        parser refuses a turn, only the texts say which slip it was."""
        if not failed:
            return
        path = self._process_file("parse_failures.jsonl")
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as f:
            for rollout in failed:
                f.write(json.dumps({"step": self.state.global_step, "question": rollout.sample.question,
                                    "turn": rollout.num_turns, "text": rollout.messages[-1].get("content")}) + "\n")

    def _stop_on_search_outage(self, failures: float, searches: float) -> None:
        """:class:`SearchOutage` when more than ``max_failed_search_fraction`` of this step's searches, over every
        process (each sees the same count, so all stop together), failed with every retry spent."""
        failures, searches = map(sum, zip(*gather_object([(failures, searches)]), strict=True))
        if searches and failures / searches > self.args.max_failed_search_fraction:
            raise SearchOutage(
                f"{failures:.0f} of {searches:.0f} searches of step {self.state.global_step + 1} failed, more than "
                f"max_failed_search_fraction={self.args.max_failed_search_fraction}: the retriever at "
                f"{self.args.search_url} does not answer; training stopped (resume from the last checkpoint once it "
                "serves again)")

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
        """The ``agent`` method of :mod:`searchr1_trl.training.evaluation` over the validation slice and, beside it in
        the same
        pass, the report slice: greedy rollouts, EM overall and per data source, searches and turns per rollout,
        status fractions and what the search policy learned, as ``<prefix>_*`` and ``report_*`` via the trainer's log.
        Training's step-0 validation is saved as a best-checkpoint candidate when the collapse guard is on."""
        if self.pipeline is not None:
            self.pipeline.drain()  # validation runs alone
        self._sync_generator_weights()
        held_out = [(metric_key_prefix, s) for s in self.eval_samples]
        held_out += [("report", s) for s in self.parts.report_samples]
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
        if self.args.save_validation_traces:
            self._write_validation_traces([(name, trace) for (name, _), trace in zip(local, traces, strict=True)])
        # Only what the summary needs crosses processes; the conversations stay where they were generated.
        named = gather_object([(name, replace(trace, messages=[])) for (name, _), trace in zip(local, traces,
                                                                                                strict=True)])
        metrics = {}
        for name in dict.fromkeys(name for name, _ in held_out):
            summary = evaluation.summarize([trace for n, trace in named if n == name])
            metrics.update({f"{name}_{key}": value for key, value in summary.items()})
        metrics[f"{metric_key_prefix}_runtime"] = time.perf_counter() - start
        self.log(metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        if self.args.load_best_model_at_end and self.collapse_guard is not None and \
                self.collapse_guard.wants_start_checkpoint(self.state):
            # transformers saves (and ranks) checkpoints only after optimizer steps; the start can be the best.
            self._determine_best_metric(metrics=metrics, trial=None)
            self._save_checkpoint(self.model_wrapped, trial=None)
            # transformers 5.24 reads best_global_step 0 as "none" and would not record this checkpoint as the best
            run_dir = Path(self._get_output_dir(trial=None))
            self.state.best_model_checkpoint = str(run_dir / f"{PREFIX_CHECKPOINT_DIR}-0")
        return metrics

    def _write_validation_traces(self, named: list[tuple[str, evaluation.Trace]]) -> None:
        """This process's validation rollouts, whole, one JSON line each: the only record of what the policy wrote
        when validation EM fell (a guard stop keeps the best checkpoint, not the one that collapsed)."""
        path = self._process_file(f"validation_traces/step-{self.state.global_step}.jsonl")
        _write_atomically(path, "".join(json.dumps({"sample": name, "step": self.state.global_step, **asdict(trace)})
                                        + "\n" for name, trace in named))

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
        # Extends Trainer/GRPOTrainer._save_checkpoint (transformers 5.24, TRL 1.16): the stream position first, the
        # completeness marker after everything, and the rotation of older checkpoints (which transformers does at the
        # end of its own save) only after the marker.
        run_dir = Path(self._get_output_dir(trial=trial))
        folder = run_dir / f"checkpoint-{self.state.global_step}"
        if self.args.should_save:
            (folder / CHECKPOINT_COMPLETE_FILE).unlink(missing_ok=True)  # a folder saved again is incomplete meanwhile
            # under async_rollouts the questions drawn ahead are served again after a resume
            stream = self.pipeline.lookahead if self.pipeline is not None else self.train_stream
            _write_atomically(folder / STREAM_STATE_FILE, json.dumps(stream.state_dict()))
        limit, self.args.save_total_limit = self.args.save_total_limit, None
        try:
            super()._save_checkpoint(model, trial)
        except (OSError, RuntimeError) as error:  # a full disk, in torch's words "unexpected pos": say it
            raise save_failure(folder, error) from error
        finally:
            self.args.save_total_limit = limit
        self.accelerator.wait_for_everyone()  # every rank's shards are written
        if self.args.should_save:
            _write_atomically(folder / CHECKPOINT_COMPLETE_FILE, "")
            rotate_checkpoints(output_dir=str(run_dir), save_total_limit=limit,
                               best_model_checkpoint=self.state.best_model_checkpoint, use_mtime=True)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False):
        """Trainer's save (every checkpoint goes through it too), plus the recipe beside the weights, so a checkpoint
        is evaluated as it was trained (``searchr1-eval``)."""
        super().save_model(output_dir, _internal_call)
        if self.args.should_save:
            save_recipe(self.args, output_dir or self.args.output_dir)

    def train(self, resume_from_checkpoint: str | bool | None = None, **kwargs):
        resume_from_checkpoint = resume_checkpoint(self.args.output_dir, resume_from_checkpoint)  # verified
        if resume_from_checkpoint:
            state_file = Path(resume_from_checkpoint) / STREAM_STATE_FILE
            self.train_stream.load_state_dict(json.loads(state_file.read_text()))
        with self._event_loop():
            output = super().train(resume_from_checkpoint=resume_from_checkpoint, **kwargs)
        kept = self.state.best_global_step
        if self.args.load_best_model_at_end and kept is not None and kept != self.state.global_step:
            logger.warning("training ends on the step-%d checkpoint (validation EM %.3f), not the last step %d: %s",
                           kept, self._validation_em(kept), self.state.global_step,
                           "a collapse stopped it" if self.collapse_guard.collapse else
                           "it beats the last validated step by more than the validation sample's noise")
            self._synced_step = -1  # the server holds the last step's weights: push the restored ones next time
        return output

    def _validation_em(self, step: int) -> float:
        """The validation EM logged at ``step``."""
        return next(e["eval_em"] for e in self.state.log_history if e.get("step") == step and "eval_em" in e)

    def create_model_card(self, model_name=None, dataset_name=None, tags=None):
        """TRL's card plus what a Search-R1 checkpoint needs to be reproduced: recipe, data, retriever, final EM."""
        super().create_model_card(model_name=model_name, dataset_name=dataset_name,
                                  tags=["search-r1", "searchr1-trl", *(tags or [])])
        if not self.is_world_process_zero():
            return
        evals = [entry for entry in self.state.log_history if "eval_em" in entry]
        final_em = f"{evals[-1]['eval_em']:.3f} at step {evals[-1]['step']}" if evals else "not evaluated"
        kept = self.state.best_global_step
        if self.args.load_best_model_at_end and evals and kept is not None and kept != evals[-1]["step"]:
            final_em = (f"{self._validation_em(kept):.3f} at step {kept} (the checkpoint the collapse guard kept, "
                        f"which this model is; last validation: {final_em})")
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
            "- warm start: " + (f"{args.warm_start_traces} scripted search -> answer traces (warm_start.py), "
                                f"lr={args.warm_start_learning_rate}, epochs={args.warm_start_epochs}"
                                if args.warm_start_traces else "none"),
            f"- loss: {args.loss_type}, epsilon={args.epsilon}, epsilon_high={args.epsilon_high}, beta={args.beta}, "
            f"lr={args.learning_rate}",
            f"- final validation EM: {final_em}", "",
        ])
        with open(os.path.join(args.output_dir, "README.md"), "a") as f:
            f.write(section)


def _write_atomically(path: Path, text: str) -> None:
    """``path`` holds ``text`` or what it held before, never a part of it (a kill mid-write leaves a stray .tmp)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
