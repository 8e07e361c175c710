"""searchr1-trl: train LLMs to answer questions by calling a ``search`` tool (Search-R1) with TRL.

The names a user needs, importable from the package itself::

    from searchr1_trl import SearchR1Config, SearchR1Trainer, load_recipe

    args, model_args = load_recipe(["--config", "offline"])
    SearchR1Trainer(model=model_args.model_name_or_path, args=args).train()

Each name is imported from its module on first use, so ``import searchr1_trl.assets.offline`` (the asset command) or
``searchr1_trl.engine.parsing`` does not pay for importing TRL and torch.
"""

from __future__ import annotations

import importlib

# name -> the module defining it; the data flow, top to bottom (README "Where things are").
_EXPORTS = {
    "Task": "tasks", "get_task": "tasks", "register_task": "tasks",
    "SearchR1Dataset": "tasks.common.data", "SearchR1DatasetConfig": "tasks.common.data",
    "SearchR1Sample": "tasks.common.data",
    "SearchR1Env": "tasks.search_r1.env", "SearchR1EnvConfig": "tasks.common.search",
    "SearchR1EnvFactory": "tasks.search_r1.env",
    "EnvFactory": "engine.rollout", "EnvStep": "engine.rollout", "MessageEnv": "engine.rollout",
    "Rollout": "engine.rollout",
    "RolloutConfig": "engine.rollout", "RolloutEngine": "engine.rollout", "RolloutStatus": "engine.rollout",
    "response_parser": "engine.parsing",
    "Generation": "engine.generation", "Generator": "engine.generation", "SamplingParams": "engine.generation",
    "TransformersGenerator": "engine.in_process", "VLLMServerGenerator": "engine.generation",
    "RewardExactMatch": "tasks.common.rubric", "RewardExactMatchConfig": "tasks.common.rubric",
    "Rubric": "tasks.common.rubric", "RubricConfig": "tasks.common.rubric",
    "SearchR1Config": "training.recipe", "TaskParts": "training.parts", "build_task": "training.parts",
    "load_recipe": "training.loading",
    "SearchR1Trainer": "training.trainer",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'searchr1_trl' has no attribute {name!r}")
    return getattr(importlib.import_module(f"searchr1_trl.{_EXPORTS[name]}"), name)


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
