"""What ``searchr1-eval`` keeps on disk and reports: ``traces.jsonl``, each finished trace flushed as it arrives, so a
rerun generates only the missing ones (:class:`TraceFile`), and the table of EM per method x checkpoint x data source
(:func:`results`, :func:`markdown_table`)."""

from __future__ import annotations

import json
import logging
import os
from collections import defaultdict
from pathlib import Path

from searchr1_trl.training import evaluation
from searchr1_trl.training.as_trained import describe

logger = logging.getLogger("searchr1-eval")


class TraceFile:
    """``traces.jsonl``: one JSON line per finished trace, flushed to disk as it arrives.

    Opening it drops a last line cut short by a crash (the only line a kill can damage), so a rerun appends after
    the traces that were complete.
    """

    def __init__(self, path: Path):
        self.path = path
        self.records: dict[tuple[str, str, str], dict] = {}
        if path.exists():
            text = path.read_text()
            complete = text[: text.rfind("\n") + 1]
            if len(complete) < len(text):
                logger.warning("%s: dropping an incomplete last line (%d bytes) left by a crash", path,
                               len(text) - len(complete))
                with path.open("r+") as f:
                    f.truncate(len(complete.encode()))
            for line in complete.splitlines():
                record = json.loads(line)
                self.records[(record["checkpoint"], record["method"], record["key"])] = record
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = path.open("a")

    def add(self, record: dict) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())
        self.records[(record["checkpoint"], record["method"], record["key"])] = record

    def close(self) -> None:
        self._file.close()


def results(records: list[dict], methods: list[str]) -> list[dict]:
    """One result per (method, checkpoint) that has traces, methods in the order given, checkpoints as first seen."""
    groups: dict[tuple[str, str], list[evaluation.Trace]] = defaultdict(list)
    for record in records:
        trace = evaluation.Trace(**{k: record[k] for k in evaluation.Trace.__dataclass_fields__ if k in record})
        groups[(record["method"], record["checkpoint"])].append(trace)
    checkpoints = list(dict.fromkeys(record["checkpoint"] for record in records))
    rows = []
    for method in methods:
        for checkpoint in checkpoints:
            if (method, checkpoint) not in groups:
                continue
            summary = evaluation.summarize(groups[(method, checkpoint)])
            rows.append({
                "method": method, "checkpoint": checkpoint,
                "em": {k.removeprefix("em/"): v for k, v in summary.items() if k.startswith("em/")},
                "f1": {k.removeprefix("f1/"): v for k, v in summary.items() if k.startswith("f1/")},
                "average": evaluation.macro_average(summary),
                "average_f1": evaluation.macro_average(summary, "f1"),
                "searches_per_rollout": summary["searches_per_rollout"],
                "turns_per_rollout": summary["turns_per_rollout"],
                "closed_turns_per_rollout": summary["closed_turns_per_rollout"],
                "status": {k.removeprefix("status_"): v for k, v in summary.items() if k.startswith("status_")},
                "num_samples": summary["num_samples"],
                "search_failed": summary["search_failed"],
            })
    return rows


def markdown_table(rows: list[dict], per_source: dict[str, int], source: dict[str, dict] | None = None) -> str:
    """Rows method x checkpoint, columns the data sources and their average (EM / token F1, 3 decimals), and the
    traces with a failed search, which the scores leave out (a rerun generates them again); below, the settings that
    came from the checkpoints' recipes and those a flag set (``source``, :func:`policy_as_trained`)."""
    sources = sorted(per_source)
    header = ["method", "checkpoint", *(f"{s} (n={per_source[s]})" for s in sources), "average",
              "searches / rollout", "failed searches"]
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    nan = float("nan")
    for row in rows:
        cells = [row["method"], f"`{row['checkpoint']}`",
                 *(f"{row['em'].get(s, nan):.3f} / {row['f1'].get(s, nan):.3f}" for s in sources),
                 f"**{row['average']:.3f}** / {row['average_f1']:.3f}", f"{row['searches_per_rollout']:.2f}",
                 str(row["search_failed"])]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join([*lines, "", "EM / token F1, greedy.", *describe(source or {})]) + "\n"
