"""Tasks on the engine, chosen by name: each folder is one task, ``common`` what they share.

A task gives the framework a :class:`Task` and nothing more; the rollout loop, budgets, loss, validation and
checkpoints are the framework's. Everything outside a task's folder reaches it through :func:`get_task`, which
imports the task's module by its path (``tests/test_architecture.py`` asserts no other module imports a task folder),
so a task is added by a folder and a line in :data:`TASKS`, or from outside the package by passing its module path
(``--task my_package.my_task``): any module with a ``TASK`` attribute. ``docs/adding_a_task.md`` walks through one.

What every task here shares (``common``): the question stream (a parquet of ``question`` and ``golden_answers``,
optionally ``data_source``: :mod:`~searchr1_trl.tasks.common.data`), the exact-match rubric
(:mod:`~searchr1_trl.tasks.common.rubric`) and, for the tasks that search, the retrieval client and the search tool
(:mod:`~searchr1_trl.tasks.common.retrieval`, :mod:`~searchr1_trl.tasks.common.search`).
"""

from __future__ import annotations

import importlib
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

# Task name -> the module whose TASK it is.
TASKS: dict[str, str] = {
    "search_r1": "searchr1_trl.tasks.search_r1",
    "search_r1_tags": "searchr1_trl.tasks.search_r1_tags",
    "calculator": "searchr1_trl.tasks.calculator",
}


@dataclass(frozen=True)
class Task:
    """What a task provides. The prompt is its environments' (``MessageEnv.reset``); the data columns are the fields
    of ``sample``, the rows of the question stream."""

    name: str
    sample: type  # one row of the questions: ``from_row(row)``, ``as_row()``, ``.question``, ``.golden_answers``
    envs: Callable[[Any], Any]  # the recipe's env config (SearchR1EnvConfig) -> an EnvFactory (engine.rollout)
    answer: Callable[[Sequence[dict]], str | None]  # a finished conversation -> its final answer, what EM reads
    methods: tuple[str, ...]  # the evaluation methods it supports (training.evaluation.METHODS)
    needs_retriever: bool  # the plan check and searchr1-eval ask the retrieval server before starting
    # Scripted teacher rollouts for the supervised warm start, None: the task has none:
    # (tokenizer, envs, rollout config, samples, end ids, warm-start config) -> (rollouts, the ones to learn from)
    warm_start: Callable[..., Awaitable[tuple[list, list]]] | None = None


def get_task(name: str) -> Task:
    """The task registered as ``name`` in :data:`TASKS`, or the ``TASK`` of the module at dotted path ``name``;
    ValueError naming the known tasks otherwise."""
    path = TASKS.get(name, name if "." in name else None)
    try:
        task = getattr(importlib.import_module(path), "TASK", None) if path else None
    except ModuleNotFoundError as error:
        if not (path == error.name or path.startswith(f"{error.name}.")):
            raise  # the task's module is there; something it imports is not
        task = None
    if not isinstance(task, Task):
        raise ValueError(f"task={name!r}; expected one of {', '.join(TASKS)} or the path of a module with a TASK")
    return task


def register_task(name: str, module: str) -> None:
    """Make ``get_task(name)`` the ``TASK`` of ``module`` (a dotted path, imported on first use)."""
    TASKS[name] = module
