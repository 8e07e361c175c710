"""The one function that turns a recipe into the parts the trainer plugs in (torchtitan's ``rollouter.py`` is the
model): the task the ``task`` field names (:func:`~searchr1_trl.tasks.get_task`), its question streams, environments
and rubric, the rollout budgets, the sampling of training turns and the generator."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from searchr1_trl.engine.generation import Generator, SamplingParams, VLLMServerGenerator, end_token_ids
from searchr1_trl.engine.in_process import TransformersGenerator
from searchr1_trl.engine.rollout import EnvFactory, RolloutConfig
from searchr1_trl.tasks import Task, get_task
from searchr1_trl.tasks.common.data import SearchR1Dataset
from searchr1_trl.tasks.common.rubric import RewardExactMatch, Rubric
from searchr1_trl.training.recipe import part_config
from searchr1_trl.training.warm_start import WarmStartConfig


@dataclass
class TaskParts:
    """Everything the trainer plugs into GRPOTrainer, built from one recipe by :func:`build_task`."""

    task: Task  # what the parts below were built for
    train_stream: SearchR1Dataset
    eval_samples: list  # the task's samples; [] when the recipe never validates
    envs: EnvFactory  # one env per rollout
    rollout: RolloutConfig
    sampling: SamplingParams  # of training turns; validation is greedy with the same max_tokens
    rubric: Rubric
    generator: Callable[[Any, Any], Generator]  # (model, tokenizer) -> generator: TRL loads the model first
    warm_start: WarmStartConfig  # num_traces 0: none
    report_samples: list = field(default_factory=list)  # disjoint from eval_samples


def build_task(args) -> TaskParts:
    """The task, question streams, environment, rollout budgets, sampling, rubric and generator of a recipe."""
    task = get_task(args.task)
    validates = args.eval_strategy != "no" or args.eval_on_start
    eval_stream = part_config(args, "eval_stream")
    if args.eval_sample_seed is not None:
        eval_stream = replace(eval_stream, shuffle=True, seed=args.eval_sample_seed)
    rubric = Rubric([RewardExactMatch(part_config(args, "exact_match"), answer=task.answer)],
                    **asdict(part_config(args, "rubric")))
    if args.generator == "vllm":
        vllm = part_config(args, "vllm_generator")

        def generator(model, tokenizer) -> Generator:
            stop_token_ids = end_token_ids(tokenizer, model.generation_config)
            return VLLMServerGenerator(args.generator_url, stop_token_ids=stop_token_ids, **asdict(vllm))
    else:
        in_process = part_config(args, "transformers_generator")

        def generator(model, tokenizer) -> Generator:
            return TransformersGenerator(model, tokenizer, **asdict(in_process))

    if args.report_num_samples and not validates:
        raise ValueError(f"report_num_samples={args.report_num_samples} is evaluated beside validation, which this "
                         "recipe never runs: set eval_strategy (or eval_on_start), or report_num_samples 0")
    held_out = SearchR1Dataset(eval_stream).take(args.eval_num_samples + args.report_num_samples) if validates else []
    if args.report_num_samples and len(held_out) < args.eval_num_samples + args.report_num_samples:
        raise ValueError(f"eval_num_samples={args.eval_num_samples} + report_num_samples={args.report_num_samples} "
                         f"asks for more questions than {eval_stream.data_path or eval_stream.filename} holds "
                         f"({len(held_out)})")
    return TaskParts(
        task=task,
        train_stream=SearchR1Dataset(part_config(args, "train_stream")),
        eval_samples=held_out[:args.eval_num_samples],
        report_samples=held_out[args.eval_num_samples:],
        envs=task.envs(part_config(args, "env")),
        rollout=part_config(args, "rollout"),
        sampling=replace(part_config(args, "sampling"), temperature=args.temperature, top_p=args.top_p),
        rubric=rubric,
        generator=generator,
        warm_start=part_config(args, "warm_start"),
    )
