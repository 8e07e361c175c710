"""What a training run writes down of its rollouts: each step's rollout metrics, the training turns the parser
refused (``parse_failures.jsonl``), each validation's rollouts whole (``validation_traces/step-<step>.jsonl``) and
their summary per sample, and the stop when the retriever does not answer (:class:`SearchOutage`).

Under several processes each writes what it generated to its own file (:func:`process_file`).
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict, replace
from pathlib import Path

from accelerate.utils import gather_object

from searchr1_trl.engine.rollout import Rollout, RolloutStatus
from searchr1_trl.training import evaluation
from searchr1_trl.training.resume import write_atomically


class SearchOutage(RuntimeError):
    """More of a step's searches failed than the recipe allows (``max_failed_search_fraction``)."""


def record_rollouts(mode: str, metrics: dict[str, list[float]], rollouts: list[Rollout], seconds: float,
                    env_metrics: dict[str, float], args, accelerator, step: int) -> None:
    """Everything a run keeps of a step's rollouts (``mode``: ``train`` or ``eval``): their metrics, and in training
    the stop on a search outage and the turns the parser refused."""
    log_rollouts(metrics, rollouts, seconds, env_metrics)
    if mode == "train":
        stop_on_search_outage(env_metrics, step, args)
        if args.save_parse_failures:
            refused = [r for r in rollouts if r.status == RolloutStatus.ERROR_PARSE]
            append_parse_failures(args, accelerator, step, refused)


def log_rollouts(metrics: dict[str, list[float]], rollouts: list[Rollout], seconds: float,
                 env_metrics: dict[str, float]) -> None:
    """A step's rollout metrics (``rollout/*``: how they ended, tool calls, turns, tokens, time) and its environments'
    counters, appended to the trainer's per-mode ``metrics``."""
    statuses = Counter(r.status for r in rollouts)
    for status in RolloutStatus:
        metrics[f"rollout/status_{status.value}"].append(statuses[status] / len(rollouts))
    metrics["rollout/searches_per_rollout"].append(sum(r.num_tool_calls for r in rollouts) / len(rollouts))
    metrics["rollout/turns_per_rollout"].append(sum(r.num_turns for r in rollouts) / len(rollouts))
    metrics["rollout/closed_turns_per_rollout"].append(sum(r.closed_turns for r in rollouts) / len(rollouts))
    metrics["rollout/generated_tokens"].append(sum(sum(r.env_mask) for r in rollouts))
    metrics["rollout/time_s"].append(seconds)
    for key, value in env_metrics.items():
        metrics[key].append(value)


def stop_on_search_outage(env_metrics: dict[str, float], step: int, args) -> None:
    """:class:`SearchOutage` when more than ``max_failed_search_fraction`` of this step's searches, over every
    process (each sees the same count, so all stop together), failed with every retry spent; a task that does not
    search has nothing to fail."""
    if "search/searches" not in env_metrics:
        return
    pairs = gather_object([(env_metrics["search/failures"], env_metrics["search/searches"])])
    failures, searches = map(sum, zip(*pairs, strict=True))
    if searches and failures / searches > args.max_failed_search_fraction:
        raise SearchOutage(
            f"{failures:.0f} of {searches:.0f} searches of step {step + 1} failed, more than "
            f"max_failed_search_fraction={args.max_failed_search_fraction}: the retriever at "
            f"{args.search_url} does not answer; training stopped (resume from the last checkpoint once it "
            "serves again)")


def process_file(output_dir: str, accelerator, name: str) -> Path:
    """``output_dir/name``, suffixed ``-rank<i>`` under several processes: each writes what it generated."""
    path = Path(output_dir) / name
    if accelerator.num_processes > 1:
        path = path.with_name(f"{path.stem}-rank{accelerator.process_index}{path.suffix}")
    return path


def append_parse_failures(args, accelerator, step: int, failed: list[Rollout]) -> None:
    """Append this process's unparsed training turns to ``parse_failures.jsonl``: the rates say how often the parser
    refuses a turn, only the texts say which slip it was."""
    if not failed:
        return
    path = process_file(args.output_dir, accelerator, "parse_failures.jsonl")
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        for rollout in failed:
            f.write(json.dumps({"step": step, "question": rollout.sample.question,
                                "turn": rollout.num_turns, "text": rollout.messages[-1].get("content")}) + "\n")


def write_validation_traces(args, accelerator, step: int, named: list) -> None:
    """This process's rollouts of a validation, whole, one JSON line each (``named``: ``(sample name, Trace)``): the
    only record of what the policy wrote when validation EM fell (a guard stop keeps the best checkpoint, not the one
    that collapsed). A step's file holds each sample's latest rollouts: a sample written again replaces its lines (a
    step validated again after a resume), the other samples' stay (the report sample rolled out on its own after
    the step's validation, ``report_at: ends``)."""
    path = process_file(args.output_dir, accelerator, f"validation_traces/step-{step}.jsonl")
    names = {name for name, _ in named}
    kept = [line + "\n" for line in (path.read_text().splitlines() if path.exists() else [])
            if json.loads(line)["sample"] not in names]
    write_atomically(path, "".join(kept) + "".join(json.dumps({"sample": name, "step": step, **asdict(trace)}) + "\n"
                                                   for name, trace in named))


def summaries(named: list) -> dict[str, float]:
    """:func:`~searchr1_trl.training.evaluation.summarize` of each sample's traces over every process (``named``:
    this process's ``(sample name, Trace)``), as ``<name>_<key>``. Only what the summary needs crosses processes; the
    conversations stay where they were generated."""
    gathered = gather_object([(name, replace(trace, messages=[])) for name, trace in named])
    metrics = {}
    for name in dict.fromkeys(name for name, _ in gathered):
        summary = evaluation.summarize([trace for n, trace in gathered if n == name])
        metrics.update({f"{name}_{key}": value for key, value in summary.items()})
    return metrics
