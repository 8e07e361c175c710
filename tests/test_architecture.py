"""The import graph: no cycles, nothing imports a layer above it, and the retriever stands alone.

Read from the source (every ``import``, also inside functions), so a lazy import cannot hide an edge.
"""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Lower layers never import higher ones. A unit is a folder of the package (a layer): modules of one folder may import
# each other (the cycle test still applies), two folders only downwards.
LAYERS = [
    "assets",  # what a run reads that is not code: offline assets, published model shapes
    "serving",  # the processes beside the trainer: reaper, vLLM server, weight sync
    "engine",  # the generic multi-turn tool engine: rollout loop, parsing, generation backends
    "tasks",  # the tasks on the engine, one folder each, chosen by name; what they share in tasks/common
    "training",  # the recipe, its checks, the TRL trainer, its guards, warm start and validation
    "report",  # the trace report: a run's or an evaluation's folder as one HTML page
    "cli",  # the console scripts
]


def imported(path: Path) -> set[str]:
    """Every module name ``path`` imports (``from a.b import c`` gives ``a.b`` and ``a.b.c``)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return names


def modules(package: str) -> dict[str, Path]:
    """``{dotted name inside package: source}`` for every module of ``package``, sub-packages included;
    ``searchr1_trl/engine/rollout.py`` -> ``"engine.rollout"``, a sub-package's ``__init__.py`` -> ``"engine"``."""
    found = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        parts = path.relative_to(ROOT / package).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" and len(parts) > 1 else parts)] = path
    return found


def imports(package: str) -> dict[str, set[str]]:
    """``{module: modules of the same package it imports}`` for every module of ``package``, by dotted name inside
    it (``from searchr1_trl.engine import rollout`` is an edge to ``engine.rollout``, not to ``engine``)."""
    names = modules(package)
    graph = {}
    for name, path in names.items():
        inside = {n.removeprefix(f"{package}.") for n in imported(path) if n.startswith(f"{package}.")}
        # The deepest known module each import names: "engine.rollout.Rollout" -> "engine.rollout".
        targets = {max((m for m in names if t == m or t.startswith(f"{m}.")), key=len, default=t) for t in inside}
        graph[name] = targets - {name}
    return graph


def unit(module: str) -> str:
    """The top-level module or folder ``module`` belongs to: ``"engine.rollout"`` -> ``"engine"``."""
    return module.split(".")[0]


def layer(module: str) -> int:
    if module == "__init__":
        return len(LAYERS)  # the front door re-exports everything
    return LAYERS.index(unit(module))


def test_the_layers_are_the_folders_of_the_package():
    folders = {p.name for p in (ROOT / "searchr1_trl").iterdir() if (p / "__init__.py").is_file()}
    assert folders == set(LAYERS)
    assert {unit(m) for m in imports("searchr1_trl")} - {"__init__"} == set(LAYERS)


def task_folders() -> set[str]:
    """The task folders: every sub-package of ``searchr1_trl/tasks`` but ``common``, what the tasks share."""
    tasks = ROOT / "searchr1_trl" / "tasks"
    return {p.name for p in tasks.iterdir() if (p / "__init__.py").is_file()} - {"common"}


def test_the_engine_and_the_tasks_live_in_their_folders():
    # "A new task is a folder" is visible in the tree: the generic engine, what the tasks share, each task apart.
    found = set(modules("searchr1_trl"))
    assert {"engine.rollout", "engine.parsing", "engine.generation"} <= found
    assert {"tasks.common.data", "tasks.common.rubric", "tasks.common.retrieval", "tasks.common.search"} <= found
    assert {"tasks.search_r1", "tasks.search_r1.env"} <= found


def test_every_task_is_registered_by_name_and_registered_tasks_are_the_task_folders():
    from searchr1_trl.tasks import TASKS, get_task

    assert {module.rsplit(".", 1)[1] for module in TASKS.values()} == task_folders()
    assert all(get_task(name).name == name for name in TASKS)


def test_no_module_outside_a_tasks_folder_imports_it():
    # The trainer, recipe, evaluation, warm start, plan checks and CLIs reach a task through tasks.get_task only, which
    # imports it by its module path: a task is a plugin, added or removed without touching them.
    reaching = [
        (module, target)
        for module, targets in imports("searchr1_trl").items()
        for target in targets
        for task in task_folders()
        if target.split(".")[:2] == ["tasks", task] and module.split(".")[:2] != ["tasks", task]
    ]
    assert reaching == []
    assert task_folders() >= {"search_r1"}


def test_no_module_imports_a_higher_layer():
    upward = [
        (module, target)
        for module, targets in imports("searchr1_trl").items()
        for target in targets
        if layer(target) > layer(module)
    ]
    assert upward == []


def test_every_sub_package_is_in_the_wheel():
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    folders = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "searchr1_trl").rglob("__init__.py")}
    assert folders - listed == set()


def reaches(graph: dict[str, set[str]], start: str, goal: str, seen: frozenset[str] = frozenset()) -> bool:
    """Whether ``goal`` can be reached from ``start`` along the import edges of ``graph``."""
    return any(t == goal or (t not in seen and reaches(graph, t, goal, seen | {t})) for t in graph.get(start, ()))


def test_there_are_no_import_cycles():
    for package in ("searchr1_trl", "retriever_server"):
        graph = imports(package)
        assert [m for m in graph if reaches(graph, m, m)] == [], package


def test_the_retrieval_server_does_not_import_the_trainer_package():
    # It is deployed on its own (often on other machines), with its own dependencies.
    sources = sorted((ROOT / "retriever_server").rglob("*.py"))
    assert [p.name for p in sources if any(n.split(".")[0] == "searchr1_trl" for n in imported(p))] == []


NOTEBOOK = "experiments"  # the lab notebook: benchmarks, variants, history; it may change without a release


def names_the_notebook(path: Path) -> bool:
    """Whether ``path`` imports the notebook or names one of its modules to run (``python -m experiments.x``)."""
    strings = [n.value for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Constant)
               and isinstance(n.value, str)]
    return (any(name.split(".")[0] == NOTEBOOK for name in imported(path))
            or any(text.startswith(f"{NOTEBOOK}.") for text in strings))


def test_nothing_in_the_product_or_its_tests_imports_the_lab_notebook():
    # The notebook imports the package, never the other way round: the product runs and is tested without it.
    folders = ("searchr1_trl", "retriever_server", "scripts", "tests")
    sources = sorted(p for folder in folders for p in (ROOT / folder).rglob("*.py"))
    assert [str(p.relative_to(ROOT)) for p in sources if names_the_notebook(p)] == []
    # the check sees both ways in: the notebook's own test imports a benchmark and launches it with -m
    assert names_the_notebook(ROOT / NOTEBOOK / "tests" / "test_zero3_update.py")


def test_the_front_door_exports_every_public_name_from_its_module():
    import searchr1_trl

    for name in searchr1_trl.__all__:
        module = importlib.import_module(f"searchr1_trl.{searchr1_trl._EXPORTS[name]}")
        assert getattr(searchr1_trl, name) is getattr(module, name)


def test_importing_a_light_module_does_not_import_trl():
    # The asset command and the parser stay quick to import: the front door imports lazily. The launcher (also the
    # main job's, scripts/offline_job.py) lives as long as the run and plans in a child: with trl it held 0.2 GiB more.
    code = ("import sys, searchr1_trl.assets.offline, searchr1_trl.engine.parsing, searchr1_trl.engine.generation, "
            "searchr1_trl.serving.vllm_server, searchr1_trl.serving.launch, searchr1_trl.cli.launch, "
            "retriever_server.launch; print('trl' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "False"


def test_no_module_is_over_400_lines():
    # A module that grows past this holds more than one job: split it by job (torchtitan's task files are 60-170
    # lines; TRL's one 3,500-line trainer is what our subclass keeps thin against).
    lines = {str(p.relative_to(ROOT)): len(p.read_text().splitlines())
             for package in ("searchr1_trl", "retriever_server") for p in (ROOT / package).rglob("*.py")}
    assert {path: n for path, n in lines.items() if n > 400} == {}
    assert lines["searchr1_trl/training/trainer.py"] <= 450  # the bound on the trainer, within the above
