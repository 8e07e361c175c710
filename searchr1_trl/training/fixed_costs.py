"""A run's fixed costs: what it spends outside its optimizer steps, measured, and the report sample rolled out only
where its figure is read.

- **Start-up** (:class:`StartupClock`): the seconds from the process's start to its first optimizer step
  (``time/startup_s``: imports, model load, the warm start, the step-0 validation) and the warm start's share of
  them (``time/warm_start_s``), logged once, with the first step's metrics. Each validation logs its own seconds
  (``eval_runtime``).
- **The report sample** (``report_num_samples``): its EM is the figure to report, read at the warm start, at the last
  step and on the model the run ends on; the collapse guard chooses on the validation sample and never reads it. With
  ``report_at: ends`` (:func:`report_due`) a validation rolls it out only at the run's first validation and at the
  step training stops at, and when training ends on an earlier checkpoint the trainer rolls it out once more on that
  model (:func:`saved_model_unreported`), logged as ``saved_report_*`` with ``saved_report_step`` the step whose
  weights they are. ``every_validation`` rolls it out at every validation, for a report-sample curve; each then takes
  about twice as long when the two samples are the same size.
"""

from __future__ import annotations

import time

import psutil
from transformers import TrainerCallback

REPORT_AT = ("ends", "every_validation")


def report_due(report_at: str, state, control, training: bool) -> bool:
    """Whether a validation rolls out the report sample: always outside training (a standalone evaluation) and with
    ``every_validation``; with ``ends``, at the run's first validation (none in its history has one yet, so a resumed
    run keeps its start's) and at the step training stops at (``control.should_training_stop``, set before the step's
    validation when it is the last)."""
    if report_at == "every_validation" or not training:
        return True
    return control.should_training_stop or not any("report_em" in entry for entry in state.log_history)


def saved_model_unreported(state, step: int) -> bool:
    """Whether no validation rolled out the report sample on the weights of ``step`` (with ``ends``, a checkpoint
    between the first and the last step)."""
    return not any(entry.get("step") == step and "report_em" in entry for entry in state.log_history)


class StartupClock(TrainerCallback):
    """Logs ``time/startup_s`` and, where set, ``time/warm_start_s`` into the trainer's ``metrics`` at the first
    optimizer step of this process (a resumed run's: its own start-up). ``warm_start_s`` is set by whoever ran the
    warm start before the trainer existed (``searchr1-train``)."""

    def __init__(self, metrics: dict[str, list[float]]):
        self.metrics = metrics
        self.warm_start_s: float | None = None
        self.logged = False

    def on_step_begin(self, args, state, control, **kwargs):
        if self.logged:
            return
        self.logged = True
        self.metrics["time/startup_s"].append(time.time() - psutil.Process().create_time())
        if self.warm_start_s is not None:
            self.metrics["time/warm_start_s"].append(self.warm_start_s)
