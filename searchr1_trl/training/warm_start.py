"""Supervised warm start: the task's tool protocol taught on scripted traces before GRPO.

A small model that has never used the tool searches the same query again and again or answers at length (the
untrained 0.5B agent answers 22% of validation questions, RAG with the same model scores 0.31 EM more), so GRPO
spends its first steps finding the format instead of learning to read. The task writes the traces a teacher would
(``Task.warm_start``; Search-R1's: search the question, answer with a golden answer the passages contain,
:mod:`searchr1_trl.tasks.search_r1.warm_start`) through the training rollout engine, so prompt, tokens and
environment mask are exactly those of training, and says which to learn from. The policy is then fine-tuned on
its own turns only (TRL's ``SFTTrainer``, ``assistant_masks`` = the rollout's env mask; with ``answer_traces`` most
traces teach the search calls alone, so that GRPO has the reading left to learn) and saved to
``<output_dir>/warm_start``, the model GRPO starts from (``searchr1-train`` hands it to a ``reload`` generator;
``nccl`` and ``ipc`` push it before the first rollouts anyway).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field, replace
from pathlib import Path

from searchr1_trl.engine.generation import end_token_ids
from searchr1_trl.engine.rollout import Rollout
from searchr1_trl.tasks.common.data import SearchR1Dataset
from searchr1_trl.training.update import with_fp32_master_weights

logger = logging.getLogger(__name__)


@dataclass
class WarmStartConfig:
    """How many scripted traces, and how the policy is fine-tuned on them."""

    num_traces: int = field(
        default=0,
        metadata={"help": "Scripted search -> answer traces to fine-tune on before GRPO; 0: no warm start. Questions "
                          "are a seeded draw of the training file (data_seed + 1); those whose passages lack every "
                          "golden answer are dropped, so fewer traces remain (the log says how many)."},
    )
    second_search: bool = field(
        default=False,
        metadata={"help": "Where the question's own search holds no golden answer, the teacher searches again with the "
                          "question's content words and answers if that finds one: traces that show a second query, "
                          "which GRPO alone never discovers (0 of 3,000 rollouts after the one-search warm start). "
                          "Needs max_turns >= 3."},
    )
    second_search_repeats: int = field(
        default=1,
        metadata={"help": "How many times each trace with a second search is fine-tuned on: once each, they were too "
                          "few for the tuned policy to search again (offline_gpu, 3 seeds: 0 second queries in 1,500 "
                          "greedy rollouts of the report sample after the warm start)."},
    )
    answer_traces: int | None = field(
        default=None,
        metadata={"help": "How many of the kept traces teach their answer turn too; None: all. The rest teach only "
                          "the search calls, the tool protocol, and leave the reading of the passages to GRPO (with "
                          "every answer taught, offline_gpu's warm start reads at 0.38 EM and GRPO adds +0.03: the "
                          "ceiling of one search read well)."},
    )
    learning_rate: float = field(default=1e-5, metadata={"help": "AdamW learning rate of the warm start."})
    epochs: float = field(default=1.0, metadata={"help": "Passes over the warm-start traces."})
    batch_size: int = field(default=8, metadata={"help": "Traces per optimizer step (per device)."})

    def __post_init__(self):
        if self.num_traces < 0 or self.learning_rate <= 0 or self.epochs <= 0 or self.batch_size < 1:
            raise ValueError(
                f"expected num_traces >= 0, learning_rate > 0, epochs > 0 and batch_size >= 1, got {self.num_traces}, "
                f"{self.learning_rate}, {self.epochs}, {self.batch_size}"
            )
        if self.answer_traces is not None and self.answer_traces < 0:
            raise ValueError(f"answer_traces={self.answer_traces}: expected >= 0 (0: no answer turn is taught), or "
                             "None for all")
        if self.second_search_repeats < 1 or (self.second_search_repeats > 1 and not self.second_search):
            raise ValueError(f"second_search_repeats={self.second_search_repeats}: expected >= 1, and > 1 only with "
                             "second_search=True (without it no trace has a second search to repeat)")


def search_turns_mask(env_mask: list[int]) -> list[int]:
    """``env_mask`` (1: a token the model wrote) without the final answer turn, its last run of model tokens: the loss
    of a trace that teaches the search calls alone."""
    end = len(env_mask)
    while end and not env_mask[end - 1]:
        end -= 1
    start = end
    while start and env_mask[start - 1]:
        start -= 1
    return env_mask[:start] + [0] * (len(env_mask) - start)


def fine_tuning_rows(kept: list[Rollout], config: WarmStartConfig) -> list[dict]:
    """The warm start's fine-tuning set: each kept trace's tokens and its loss mask over the model's own turns. The
    first ``config.answer_traces`` teach the whole trace, the rest only its search calls; two-search traces are
    repeated ``config.second_search_repeats`` times."""
    answers = len(kept) if config.answer_traces is None else config.answer_traces
    taught = [r if i < answers else replace(r, env_mask=search_turns_mask(r.env_mask)) for i, r in enumerate(kept)]
    return [{"input_ids": r.prompt_ids + r.completion_ids, "assistant_masks": [0] * len(r.prompt_ids) + r.env_mask}
            for r in with_second_searches_repeated(taught, config.second_search_repeats)]


def with_second_searches_repeated(traces: list[Rollout], repeats: int) -> list[Rollout]:
    """``traces`` (those the task kept) as the warm start fine-tunes on them: each with a second search
    ``repeats`` times, the others once."""
    return [r for r in traces for _ in range(repeats if r.num_tool_calls == 2 else 1)]


def scripted_warm_start_traces(args, model_path: str, tokenizer, parts) -> tuple[list[Rollout], list[Rollout]]:
    """The task's teacher traces of the warm start's questions (the training stream reseeded: seed + 1, so GRPO does
    not start on the questions it was fine-tuned on), and those to learn from. ``parts``: the recipe's
    :class:`~searchr1_trl.training.parts.TaskParts`."""
    from transformers import GenerationConfig

    config = parts.warm_start
    if parts.task.warm_start is None:
        raise ValueError(f"warm_start_traces={config.num_traces}, but task {parts.task.name} writes no warm-start "
                         "traces: set warm_start_traces 0")
    stream = parts.train_stream.config
    samples = SearchR1Dataset(replace(stream, seed=stream.seed + 1)).take(config.num_traces)
    try:
        generation_config = GenerationConfig.from_pretrained(model_path)
    except OSError:  # a checkpoint without generation_config.json: the tokenizer's end tokens
        generation_config = None
    end_ids = set(end_token_ids(tokenizer, generation_config))
    return asyncio.run(parts.task.warm_start(tokenizer, parts.envs, parts.rollout, samples, end_ids, config))


def warm_start(args, model_args, parts) -> str:
    """Write the traces, fine-tune the recipe's model on them, save it; the folder GRPO starts from. ``parts`` is the
    recipe's :class:`~searchr1_trl.training.parts.TaskParts` (its task, environment, budgets, question stream and
    warm-start config)."""
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import SFTConfig, SFTTrainer, get_peft_config

    config = parts.warm_start
    tokenizer = AutoTokenizer.from_pretrained(model_args.model_name_or_path)
    rollouts, kept = scripted_warm_start_traces(args, model_args.model_name_or_path, tokenizer, parts)
    logger.info("warm start: %d of %d scripted traces kept (%d with a second tool call, each fine-tuned on %d "
                "times); %s teach the answer turn", len(kept), len(rollouts),
                sum(r.num_tool_calls == 2 for r in kept), config.second_search_repeats,
                "all" if config.answer_traces is None else min(config.answer_traces, len(kept)))
    if not kept:
        raise RuntimeError(f"none of {len(rollouts)} scripted traces of task {parts.task.name} is one to learn from "
                           f"(a search task's: a golden answer in its passages): is the retriever at {args.search_url} "
                           f"serving the corpus of {args.train_data_path}?")
    dataset = Dataset.from_list(fine_tuning_rows(kept, config))
    output_dir = Path(args.output_dir) / "warm_start"
    sft_args = SFTConfig(
        output_dir=str(output_dir), learning_rate=config.learning_rate, num_train_epochs=config.epochs,
        per_device_train_batch_size=config.batch_size, gradient_accumulation_steps=1,
        lr_scheduler_type="constant", warmup_steps=0, max_length=None, bf16=args.bf16, seed=args.seed,
        logging_steps=args.logging_steps, save_strategy="no", report_to=args.report_to, run_name=args.run_name,
        model_init_kwargs=args.model_init_kwargs, activation_checkpointing=args.activation_checkpointing,
        deepspeed=args.deepspeed,
    )
    trainer = SFTTrainer(model=model_args.model_name_or_path, args=sft_args, train_dataset=dataset,
                         processing_class=tokenizer, peft_config=get_peft_config(model_args))
    if args.fp32_master_weights:  # bf16 weights: the warm start's steps need the masters too
        with_fp32_master_weights(trainer.create_optimizer(), deepspeed=trainer.is_deepspeed_enabled)
    trainer.train()
    if hasattr(trainer.model, "merge_and_unload"):  # PEFT: GRPO starts from the merged weights (its own adapter)
        trainer.model = trainer.model.merge_and_unload()
    trainer.save_model(str(output_dir))  # with the tokenizer and the model's generation config
    trainer.accelerator.wait_for_everyone()
    del trainer
    return str(output_dir)


