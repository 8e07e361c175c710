"""The learning batches' named variants (``experiments/variants.yaml``): the recipe flags each lays over
``offline_gpu``. A variant's ``extends`` lists variants whose flags come first; ``$VARS`` in flags (``$SIBLING``)
expand from the environment.

    python -m experiments.variants async_guard   # its flags on one line; an unknown name stops, naming them all
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import yaml

VARIANTS = Path(__file__).with_name("variants.yaml")


def load() -> dict[str, dict]:
    return yaml.safe_load(VARIANTS.read_text())


def flags(name: str, variants: dict[str, dict] | None = None) -> list[str]:
    """The flags of ``name``: those of each variant it extends, in order, then its own."""
    variants = load() if variants is None else variants
    if name not in variants:
        raise KeyError(f"variant {name!r}; expected one of {', '.join(variants)}")
    entry = variants[name]
    inherited = [flag for parent in entry.get("extends", []) for flag in flags(parent, variants)]
    return inherited + os.path.expandvars(entry.get("flags", "")).split()


def main(argv: list[str] | None = None) -> None:
    [name] = sys.argv[1:] if argv is None else argv
    try:
        print(" ".join(flags(name)))
    except KeyError as error:
        sys.exit(error.args[0])


if __name__ == "__main__":
    main()
