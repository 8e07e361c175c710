"""Reading a recipe: a shipped recipe by name or a YAML file, its values checked against the fields' types, the
command line on top (``TrlParser``), asset paths resolved for this machine, and each part's knobs checked.

Offline asset paths are written ``${SEARCHR1_CACHE}/...`` in recipes; :func:`~searchr1_trl.assets.offline.resolve_path`
turns them into paths on this machine when the recipe is loaded.
"""

from __future__ import annotations

import sys
import types
import typing
from pathlib import Path
from typing import Any

from trl import ModelConfig, TrlParser

from searchr1_trl.assets.offline import resolve_path
from searchr1_trl.training.knobs import PARTS
from searchr1_trl.training.recipe import SearchR1Config, part_config


def _recipes_dir() -> Path:
    """Where the shipped recipes are: ``searchr1_trl/recipes`` in an installed wheel (pyproject.toml maps
    ``configs/`` there), ``configs/`` in a repository checkout."""
    packaged = Path(__file__).resolve().parent.parent / "recipes"
    return packaged if packaged.is_dir() else Path(__file__).resolve().parents[2] / "configs"


CONFIGS = _recipes_dir()

def recipe_path(name: str) -> Path:
    """A recipe file: ``name`` itself when it is a file, else ``configs/<name>[.yaml]``; ValueError naming the
    known recipes otherwise."""
    if Path(name).is_file():
        return Path(name)
    candidate = CONFIGS / (name if name.endswith(".yaml") else f"{name}.yaml")
    if not candidate.is_file():
        known = ", ".join(sorted(p.stem for p in CONFIGS.glob("*.yaml")))
        raise ValueError(f"recipe {name!r} is neither a file nor one of the shipped recipes ({CONFIGS}): {known}")
    return candidate


def read_recipe(path: str | Path) -> dict[str, Any]:
    """The fields a recipe file sets, checked against their types: ValueError naming the file, the field (or the
    YAML line) and what is expected. TrlParser would pass a list on where a number belongs, to fail in a traceback
    somewhere inside the trainer, and raise its own traceback for YAML that is no mapping or no YAML."""
    import yaml

    try:
        values = yaml.safe_load(Path(path).read_text())
    except yaml.YAMLError as error:
        mark, context = getattr(error, "problem_mark", None), getattr(error, "context_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        since = f" ({error.context} at line {context.line + 1})" if context and error.context else ""
        raise ValueError(f"{path}: not valid YAML{where}: {getattr(error, 'problem', None) or error}{since}") \
            from None
    if values is None:
        return {}
    if not isinstance(values, dict):
        raise ValueError(f"{path}: a recipe is a mapping of field: value, got a YAML {type(values).__name__}")
    hints = {**typing.get_type_hints(ModelConfig), **typing.get_type_hints(SearchR1Config)}
    for name, value in values.items():
        accepted = _accepted_types(hints[name]) if name in hints else None
        # bool is an int in Python, but `true` is no count
        if accepted is not None and not (bool in accepted if isinstance(value, bool) else isinstance(value, accepted)):
            shown = [t for t in dict.fromkeys(accepted) if not (t is int and float in accepted)]  # a number: both
            expected = " or ".join(_TYPE_NAMES.get(t, t.__name__) for t in shown)
            raise ValueError(f"{path}: {name}: expected {expected}, got {_TYPE_NAMES.get(type(value), 'a value')} "
                             f"{value!r:.80}")
    return values


_TYPE_NAMES = {int: "an integer", float: "a number", str: "a string", bool: "true or false", list: "a list",
               dict: "a mapping", type(None): "null"}


def _accepted_types(hint: Any) -> tuple[type, ...] | None:
    """The YAML value types a field of type ``hint`` takes (``float`` takes integers too), or None for a type that is
    not checked here (enums, literals: TrlParser and the configs check those)."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        parts = [_accepted_types(arg) for arg in typing.get_args(hint)]
        return None if any(p is None for p in parts) else tuple(t for p in parts for t in p)
    hint = origin or hint
    if hint is type(None):
        return (type(None),)
    if hint is float:
        return (int, float)
    return (hint,) if hint in (int, str, bool, list, dict) else None


class RecipeParser(TrlParser):
    """TrlParser whose command-line errors (``--max_turns abc``) are a ValueError, so ``searchr1-train`` says them in
    one line instead of argparse's usage of every field (some 300 lines) and exit status 2."""

    def error(self, message: str):
        raise ValueError(f"command line: {message}")


def recipe_values(argv: list[str]) -> dict[str, Any]:
    """Every field ``--config <recipe> [--field value ...]`` sets, typed by :func:`load_recipe`'s parser but not yet a
    config: what the plan check reads first, since building the config runs ``TrainingArguments``' own checks (bf16
    without a GPU fails there in a traceback that names neither the recipe nor what to run instead)."""
    argv = list(argv)
    parser = RecipeParser((SearchR1Config, ModelConfig))
    if "--config" in argv:
        i = argv.index("--config")
        values = read_recipe(recipe_path(argv[i + 1]))
        values.pop("env", None)  # environment variables for the run, not fields
        parser.set_defaults_with_config(**values)
        del argv[i:i + 2]
    return vars(parser.parse_args(argv))  # an unknown field is an error (RecipeParser.error), as in training


def load_recipe(argv: list[str] | None = None) -> tuple[SearchR1Config, ModelConfig]:
    """``(args, model_args)`` from ``--config <recipe> [--field value ...]`` (``sys.argv`` when None), every asset
    path resolved for this machine."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--config" in argv:
        i = argv.index("--config") + 1
        argv[i] = str(recipe_path(argv[i]))
        read_recipe(argv[i])  # one line for a recipe TrlParser would turn into a traceback
    args, model_args = RecipeParser((SearchR1Config, ModelConfig)).parse_args_and_config(args=argv)
    if model_args.model_name_or_path:
        model_args.model_name_or_path = resolve_path(model_args.model_name_or_path)
    for part in PARTS:  # each part checks its own knobs (max_turns >= 1, ...): now, not when the trainer builds it
        part_config(args, part)
    return args, model_args
