"""The parts a recipe configures, how a flat recipe field reaches them, and the one function that builds them.

:data:`PARTS` holds each part's config with its defaults, written once beside the code it configures. A recipe field
declared with :func:`knob` takes that knob's default and help text (``search_timeout_s`` is
:class:`~searchr1_trl.tasks.common.search.SearchR1EnvConfig`'s ``timeout_s``); :func:`part_config` gives a part's
config as a recipe sets it. :func:`build_task` is the only place that turns a recipe into parts (torchtitan's
``rollouter.py`` is the model): the task the ``task`` field names (:func:`~searchr1_trl.tasks.get_task`), its
question streams, environments and rubric, the rollout budgets, the sampling of training turns and the generator. The
task parts' knobs (questions, search, exact match) are those every task here shares (:mod:`searchr1_trl.tasks.common`);
a task ignores the ones it has no use for (the calculator has no retriever).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import Field, asdict, dataclass, field, fields, replace
from typing import Any

from searchr1_trl.engine.generation import (
    Generator,
    SamplingParams,
    VLLMServerGenerator,
    VLLMServerGeneratorConfig,
    end_token_ids,
)
from searchr1_trl.engine.in_process import TransformersGenerator, TransformersGeneratorConfig
from searchr1_trl.engine.rollout import EnvFactory, RolloutConfig
from searchr1_trl.serving.launch import LaunchConfig
from searchr1_trl.tasks import Task, get_task
from searchr1_trl.tasks.common.data import SearchR1Dataset, SearchR1DatasetConfig
from searchr1_trl.tasks.common.rubric import RewardExactMatch, RewardExactMatchConfig, Rubric, RubricConfig
from searchr1_trl.tasks.common.search import SearchR1EnvConfig
from searchr1_trl.training.callbacks import CollapseGuardConfig
from searchr1_trl.training.experimental.async_rollouts import AsyncRolloutsConfig
from searchr1_trl.training.warm_start import WarmStartConfig

# The parts a recipe configures, with their defaults.
PARTS: dict[str, Any] = {
    "train_stream": SearchR1DatasetConfig(),  # train.parquet, shuffled with seed 42, a new order every epoch
    # The NQ split of the test file, in file order, so every validation draws the same questions.
    "eval_stream": SearchR1DatasetConfig(filename="test.parquet", data_source="nq", shuffle=False),
    "env": SearchR1EnvConfig(),
    "rollout": RolloutConfig(),
    "sampling": SamplingParams(),
    "exact_match": RewardExactMatchConfig(),
    "rubric": RubricConfig(),
    "vllm_generator": VLLMServerGeneratorConfig(),
    "transformers_generator": TransformersGeneratorConfig(),
    "warm_start": WarmStartConfig(),  # off: no traces
    "collapse_guard": CollapseGuardConfig(),  # on wherever training validates
    "async_rollouts": AsyncRolloutsConfig(),  # off: lock-step rollouts
    "launch": LaunchConfig(),  # searchr1-launch's plan: one machine, every process on the CPU
}

# Knobs of the parts that are no recipe field, because build_task derives them.
WIRED: dict[str, dict[str, str]] = {
    "train_stream": {"shuffle": "training always draws a fresh permutation per epoch"},
    "eval_stream": {"seed": "eval_sample_seed", "shuffle": "eval_sample_seed is set"},
    "sampling": {"temperature": "GRPOConfig's temperature", "top_p": "GRPOConfig's top_p",
                 "stop": "the task's transcript (a tag protocol's closing tags)"},
}

_KNOB_FIELDS: dict[Field, tuple[str, str]] = {}


def knob(part: str, name: str) -> Any:
    """A recipe field setting ``name`` of ``part`` (a key of :data:`PARTS`), with that knob's default and help."""
    spec = {f.name: f for f in fields(PARTS[part])}[name]
    flat = field(default=getattr(PARTS[part], name), metadata={"help": spec.metadata["help"]})
    _KNOB_FIELDS[flat] = (part, name)
    return flat


def owned(source: str) -> Any:
    """A GRPOConfig field the trainer sets itself (``recipe.TRAINER_OWNED``); None means unset."""
    return field(default=None, metadata={"help": f"Set by SearchR1Trainer ({source}); leave it unset."})


def knobs(config: type) -> dict[str, tuple[str, str]]:
    """``{recipe field: (part, knob of that part)}`` of a config class: every field declared with :func:`knob`."""
    return {f.name: _KNOB_FIELDS[f] for f in fields(config) if f in _KNOB_FIELDS}


def part_config(args, part: str) -> Any:
    """The config of ``part`` as the recipe ``args`` sets it: the defaults with every knob's recipe value."""
    return replace(PARTS[part], **{name: getattr(args, flat) for flat, (p, name) in knobs(type(args)).items()
                                   if p == part})


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
