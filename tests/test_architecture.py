"""The import graph: no cycles, nothing imports a layer above it, and the retriever stands alone.

Read from the source (every ``import``, also inside functions), so a lazy import cannot hide an edge.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Lower layers never import higher ones. Same-layer imports are allowed only where listed in SAME_LAYER.
LAYERS = [
    {"shapes", "assets", "generation", "parsing", "vllm_server"},  # leaves: no task, no loop
    {"rollout"},  # the generic multi-turn loop
    {"data", "env", "rubric"},  # the Search-R1 task
    {"recipe", "plan"},  # the flat config, its wiring and its checks
    {"trainer"},  # the TRL trainer
]
SAME_LAYER: set[tuple[str, str]] = set()


def imports(package: str) -> dict[str, set[str]]:
    """``{module: modules of the same package it imports}`` for every module of ``package``."""
    graph = {}
    for path in sorted((ROOT / package).glob("*.py")):
        module = path.stem
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            targets |= {n.split(".")[1] for n in names if n.startswith(f"{package}.")}
        graph[module] = targets - {module}
    return graph


def layer(module: str) -> int:
    if module == "__init__":
        return len(LAYERS)  # the front door re-exports everything
    return next(i for i, modules in enumerate(LAYERS) if module in modules)


def test_every_module_of_the_trainer_package_has_a_layer():
    assert set(imports("searchr1_trl")) - {"__init__"} == set().union(*LAYERS)


def test_no_module_imports_a_higher_layer_or_its_own_layer_unless_listed():
    upward = [
        (module, target)
        for module, targets in imports("searchr1_trl").items()
        for target in targets
        if layer(target) > layer(module) or (layer(target) == layer(module) and (module, target) not in SAME_LAYER)
    ]
    assert upward == []


def test_there_are_no_import_cycles():
    for package in ("searchr1_trl", "retriever_server"):
        graph = imports(package)

        def reaches(start: str, goal: str, seen: set[str]) -> bool:
            return any(t == goal or (t not in seen and reaches(t, goal, seen | {t})) for t in graph.get(start, ()))

        assert [m for m in graph if reaches(m, m, {m})] == [], package
