"""What a training run folder or a ``searchr1-eval`` folder holds, read into one shape: a metric history and sets of
traces (:class:`Folder`).

A **training run folder** (the trainer's ``output_dir``) holds:

- the metric history: ``trainer_state.json`` (written when training ends), else ``log_history.csv`` (the offline
  job's copy), else the newest ``checkpoint-*/trainer_state.json`` (a run still going, or killed);
- ``validation_traces/step-<step>[-rank<i>].jsonl``, each validation's greedy rollouts: the report keeps the first
  validated step, the best one (the checkpoint training ended on) and the last, one :class:`TraceSet` each, so the
  page of a long run holds three validations, not all;
- ``parse_failures[-rank<i>].jsonl``, the training turns the parser refused.

A **searchr1-eval folder** holds ``traces.jsonl``: one :class:`TraceSet` per method x checkpoint, methods in the
order of :data:`~searchr1_trl.training.evaluation.METHODS`, checkpoints as first written (the order of its table).
"""

from __future__ import annotations

import csv
import json
import logging
import math
import re
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from searchr1_trl.training import evaluation

logger = logging.getLogger(__name__)

EVAL_TRACES = "traces.jsonl"  # searchr1-eval's (searchr1_trl/cli/eval.py)
VALIDATION_TRACES = "validation_traces"  # the trainer's (SearchR1Trainer._write_validation_traces)
_STEP_FILE = re.compile(r"^step-(\d+)(?:-rank\d+)?\.jsonl$")


@dataclass
class TraceSet:
    """The traces of one policy on one sample of questions: a run's validation at one step, or one method x
    checkpoint of an evaluation. ``records`` are the JSON lines as written (a :class:`~searchr1_trl.training.
    evaluation.Trace`'s fields, plus ``sample``/``step`` or ``key``/``checkpoint``)."""

    label: str
    method: str
    records: list[dict]

    @cached_property
    def summary(self) -> dict[str, float]:
        """:func:`~searchr1_trl.training.evaluation.summarize` of these traces: the names the trainer logs them under,
        without its ``eval_`` prefix."""
        return evaluation.summarize([as_trace(record) for record in self.records])


@dataclass
class Folder:
    """A run or evaluation folder as the report reads it. ``history`` is the trainer's log (one dict per logged
    step; empty for an evaluation), ``best_step`` the checkpoint a run ended on (None: unknown or the last)."""

    path: Path
    kind: str  # "run" or "eval"
    history: list[dict] = field(default_factory=list)
    sets: list[TraceSet] = field(default_factory=list)
    parse_failures: list[dict] = field(default_factory=list)
    best_step: int | None = None

    @property
    def name(self) -> str:
        return self.path.name

    def first_set(self) -> TraceSet | None:
        """A run's first validated step; an evaluation's :meth:`last_set` method on its first checkpoint."""
        if self.kind == "run":
            return self.sets[0] if self.sets else None
        last = self.last_set()
        return next((s for s in self.sets if s.method == last.method), None) if last else None

    def last_set(self) -> TraceSet | None:
        """A run's last validated step; an evaluation's ``agent`` traces (else its last method) of its last
        checkpoint: what "this folder's policy" means when two folders are compared."""
        if not self.sets:
            return None
        agent = [s for s in self.sets if s.method == "agent"]
        return (agent or self.sets)[-1] if self.kind == "eval" else self.sets[-1]


def as_trace(record: dict) -> evaluation.Trace:
    """A JSON trace line as a :class:`~searchr1_trl.training.evaluation.Trace` (the fields of an older writer that
    are missing take their defaults)."""
    return evaluation.Trace(**{k: record[k] for k in evaluation.Trace.__dataclass_fields__ if k in record})


def read_folder(path: str | Path) -> Folder:
    """The folder at ``path``, a training run's or an evaluation's; ValueError when it is neither."""
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"{path} is not a folder; expected a training run's output_dir or a searchr1-eval "
                         "output_dir")
    if (path / EVAL_TRACES).is_file():
        return Folder(path, "eval", sets=_eval_sets(read_jsonl(path / EVAL_TRACES)))
    state = _trainer_state(path)
    history = state.get("log_history") or _csv_history(path / "log_history.csv")
    steps = _validation_steps(path / VALIDATION_TRACES)
    if not (history or steps):
        raise ValueError(f"{path} holds no {EVAL_TRACES} (a searchr1-eval folder) and no trainer_state.json, "
                         f"log_history.csv or {VALIDATION_TRACES}/ (a training run's output_dir)")
    best = state.get("best_global_step")
    if best is None and (path / "summary.json").is_file():  # the offline job's, beside its log_history.csv
        best = json.loads((path / "summary.json").read_text()).get("best_step")
    failures = [r for f in sorted(path.glob("parse_failures*.jsonl")) for r in read_jsonl(f)]
    return Folder(path, "run", history=history, sets=_run_sets(steps, best), parse_failures=failures, best_step=best)


def read_jsonl(path: Path) -> list[dict]:
    """The records of a JSONL file; a last line cut short (a writer killed mid-line) is skipped with a warning."""
    lines = path.read_text().splitlines()
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if number != len(lines):
                raise ValueError(f"{path}:{number} is not a JSON line: {line[:80]!r}") from None
            logger.warning("%s: skipping its incomplete last line (%d bytes)", path, len(line))
    return records


def _trainer_state(path: Path) -> dict:
    """``trainer_state.json`` of the run, else of its newest checkpoint; {} when there is none."""
    if (path / "trainer_state.json").is_file():
        return json.loads((path / "trainer_state.json").read_text())
    states = sorted(path.glob("checkpoint-*/trainer_state.json"), key=lambda f: _step_of(f.parent.name))
    return json.loads(states[-1].read_text()) if states else {}


def _step_of(name: str) -> int:
    """``"checkpoint-40"`` -> 40; -1 for a name without a step."""
    tail = name.rsplit("-", 1)[-1]
    return int(tail) if tail.isdigit() else -1


def _csv_history(path: Path) -> list[dict]:
    """``log_history.csv`` as log entries: each row's non-empty cells, numbers as numbers (``step`` an int)."""
    if not path.is_file():
        return []
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    history = []
    for row in rows:
        entry = {}
        for key, text in row.items():
            try:
                value = float(text)
            except (TypeError, ValueError):  # an empty cell (not logged at this step) or a text column
                continue
            if not math.isnan(value):
                entry[key] = int(value) if key == "step" else value
        if "step" in entry:
            history.append(entry)
    return history


def _validation_steps(folder: Path) -> dict[int, list[Path]]:
    """``{step: its files}`` of ``validation_traces/`` (one file per process under several processes)."""
    steps: dict[int, list[Path]] = {}
    for file in sorted(folder.glob("step-*.jsonl")) if folder.is_dir() else []:
        match = _STEP_FILE.match(file.name)
        if match:
            steps.setdefault(int(match.group(1)), []).append(file)
    return dict(sorted(steps.items()))


def _run_sets(steps: dict[int, list[Path]], best: int | None) -> list[TraceSet]:
    """The first, best and last validated steps, in step order."""
    kept = sorted({min(steps, default=None), best if best in steps else None, max(steps, default=None)} - {None})
    return [TraceSet(f"step {step}" + (" (best)" if step == best and len(steps) > 1 else ""), "agent",
                     [r for file in steps[step] for r in read_jsonl(file)]) for step in kept]


def short_checkpoint(checkpoint: str) -> str:
    """A checkpoint as a table names it: its folder name, with the run's for a ``checkpoint-<step>`` folder:
    ``"runs/a/checkpoint-50"`` -> ``"a/checkpoint-50"``, ``"Qwen/Qwen3-8B"`` -> ``"Qwen3-8B"``."""
    parts = Path(checkpoint.rstrip("/")).parts
    return "/".join(parts[-2:]) if parts and parts[-1].startswith("checkpoint-") else (parts[-1] if parts else "")


def _eval_sets(records: list[dict]) -> list[TraceSet]:
    """One set per method x checkpoint with traces, methods in table order, checkpoints as first written."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for record in records:
        groups.setdefault((record["method"], record["checkpoint"]), []).append(record)
    checkpoints = list(dict.fromkeys(checkpoint for _, checkpoint in groups))
    methods = sorted({method for method, _ in groups}, key=lambda m: evaluation.METHODS.index(m)
                     if m in evaluation.METHODS else len(evaluation.METHODS))
    return [TraceSet(f"{method} · {short_checkpoint(checkpoint)}", method, groups[(method, checkpoint)])
            for method in methods for checkpoint in checkpoints if (method, checkpoint) in groups]
