"""What a checkpoint carries of its training, and the evaluation settings that follow from it.

Every model folder the trainer saves (each checkpoint and the final one) holds :data:`RECIPE_FILE`, the recipe it was
trained with as JSON (transformers' ``training_args.bin`` beside it is a pickle a reader would have to trust).
:func:`policy_as_trained` turns the recipes of the checkpoints being evaluated into the settings of the policy:
the recipe's env, rollout and per-turn fields (``max_turns``, ``topk``, ``restate_question``, ...), where a flag
given on the command line overrides a recorded value and a default fills what no checkpoint records. Checkpoints
that were trained otherwise cannot share one evaluation: their traces would not be comparable.
"""

from __future__ import annotations

import json
import logging
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

RECIPE_FILE = "searchr1_recipe.json"

# Where this machine's retriever answers is no setting of the policy: a recorded URL is the training run's.
NOT_RECORDED = frozenset({"search_url"})


def save_recipe(args, folder: str | Path) -> None:
    """Write the recipe ``args`` (a :class:`~searchr1_trl.training.recipe.SearchR1Config`) into ``folder``."""
    record = {**args.to_dict(), "recipe": getattr(args, "recipe", None)}  # to_dict() redacts tokens
    Path(folder, RECIPE_FILE).write_text(json.dumps(record, indent=2, default=str))


def recorded_recipe(checkpoint: str) -> dict[str, Any] | None:
    """The recipe a local checkpoint folder or a Hub model was trained with; None when it records none (a base
    model, or a checkpoint saved before checkpoints recorded it)."""
    if Path(checkpoint).is_dir():
        path = Path(checkpoint, RECIPE_FILE)
        return json.loads(path.read_text()) if path.is_file() else None
    import huggingface_hub
    from huggingface_hub.errors import (
        EntryNotFoundError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
    )

    try:
        return json.loads(Path(huggingface_hub.hf_hub_download(checkpoint, RECIPE_FILE)).read_text())
    except (EntryNotFoundError, LocalEntryNotFoundError, RepositoryNotFoundError, HFValidationError) as error:
        # no record (or no such model: the generator check names it): the defaults and flags are the settings
        logger.info("%s records no recipe (%s): %s", checkpoint, RECIPE_FILE, type(error).__name__)
        return None


def policy_as_trained(checkpoints: list[str], policy, given: set[str]) -> tuple[Any, dict[str, dict[str, Any]]]:
    """``policy`` (parsed: defaults and flags) with every field the ``checkpoints`` recorded and no flag in ``given``
    set, and where each setting that is not its default came from: ``{"trained": {field: value}, "flags": {field:
    (value, trained value or None)}}``. ValueError when two checkpoints recorded different values of a field that no
    flag sets."""
    names = {f.name for f in fields(policy)} - NOT_RECORDED
    recorded = {c: r for c in checkpoints if (r := recorded_recipe(c)) is not None}
    trained: dict[str, Any] = {}
    for name in sorted(names):
        values = {c: r[name] for c, r in recorded.items() if name in r}
        if len({json.dumps(v) for v in values.values()}) > 1 and name not in given:
            described = ", ".join(f"{c}: {v!r}" for c, v in values.items())
            raise ValueError(f"the checkpoints were trained with different {name} ({described}); evaluate them "
                             f"apart or set --{name}")
        if values:
            trained[name] = next(iter(values.values()))
    defaults = {f.name: f.default for f in fields(policy)}
    source = {"trained": {k: v for k, v in trained.items() if k not in given and v != defaults[k]},
              "flags": {k: (getattr(policy, k), trained.get(k)) for k in sorted(given & set(defaults) - NOT_RECORDED)}}
    return replace(policy, **{k: v for k, v in trained.items() if k not in given}), source


def given_fields(argv: list[str]) -> set[str]:
    """The fields a command line (``--max_turns 3``, ``--max-turns=3``) or its ``--config`` YAML sets."""
    given = {token[2:].split("=")[0].replace("-", "_") for token in argv if token.startswith("--")}
    if "--config" in argv:
        import yaml

        given |= set(yaml.safe_load(Path(argv[argv.index("--config") + 1]).read_text()) or {})
    return given


def describe(source: dict[str, dict]) -> list[str]:
    """The lines a table says its settings with: those as trained that are not the defaults, those flags set."""
    lines = []
    if source.get("trained"):
        lines.append("As trained (the checkpoints' recipes): "
                     + ", ".join(f"{k}={v!r}" for k, v in source["trained"].items()) + ".")
    if source.get("flags"):
        lines.append("Set by flags: " + ", ".join(f"{k}={v!r}" + (f" (trained: {t!r})" if t is not None else "")
                                                  for k, (v, t) in source["flags"].items()) + ".")
    return lines
