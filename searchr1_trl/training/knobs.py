"""The parts a recipe configures and how a flat recipe field reaches one.

:data:`PARTS` holds each part's config with its defaults, written once beside the code it configures. A recipe field
declared with :func:`knob` takes that knob's default and help text (``search_timeout_s`` is
:class:`~searchr1_trl.tasks.common.search.SearchR1EnvConfig`'s ``timeout_s``); :data:`WIRED` names the knobs no
field sets because :func:`~searchr1_trl.training.parts.build_task` derives them. The task parts' knobs (questions,
search, exact match) are those every task here shares (:mod:`searchr1_trl.tasks.common`); a task ignores the ones it
has no use for (the calculator has no retriever).
"""

from __future__ import annotations

from dataclasses import Field, field, fields
from typing import Any

from searchr1_trl.engine.generation import SamplingParams, VLLMServerGeneratorConfig
from searchr1_trl.engine.in_process import TransformersGeneratorConfig
from searchr1_trl.engine.rollout import RolloutConfig
from searchr1_trl.serving.launch import LaunchConfig
from searchr1_trl.tasks.common.data import SearchR1DatasetConfig
from searchr1_trl.tasks.common.rubric import RewardExactMatchConfig, RubricConfig
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
