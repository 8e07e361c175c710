"""The report page: one or two folders (:mod:`~searchr1_trl.report.folders`) rendered into one HTML file that opens
offline, with plotly.js, the traces and the page's script inside it (no network, no server).

What it shows, top to bottom: each folder's charts (:mod:`~searchr1_trl.report.figures`) and, for a run, the
training turns the parser refused; a table of the trace sets; the comparison of two sets; and every trace, browsable
with filters (set, data source, status, correct or not, number of searches, text). The comparison is of a folder's
first and last set (a run's first and last validation, an evaluation's first and last checkpoint), or, given two
folders, of the last set of each (:meth:`~searchr1_trl.report.folders.Folder.last_set`): the questions whose outcome
flipped side by side, and how searches and statuses changed.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import jinja2
import plotly.offline

from searchr1_trl.report.figures import eval_figures, run_figures
from searchr1_trl.report.folders import Folder, TraceSet, read_folder
from searchr1_trl.report.traces import compare, page_trace

REPORT_FILE = "report.html"
PARSE_FAILURES_SHOWN = 100  # the newest ones; the chart counts them all
_TEMPLATES = Path(__file__).resolve().parent  # report.html.j2, report.css, report.js


def default_output(folders: Sequence[str | Path]) -> Path:
    """``<folder>/report.html`` for one folder, ``<first>/report_vs_<second's name>.html`` for two (so a
    comparison does not overwrite the report training or ``searchr1-eval`` wrote)."""
    first = Path(folders[0])
    return first / (REPORT_FILE if len(folders) == 1 else f"report_vs_{Path(folders[1]).resolve().name}.html")


def write_report(folders: Sequence[str | Path], output: str | Path | None = None) -> Path:
    """Render the report of one folder, or of two compared, into ``output`` (default :func:`default_output`);
    returns its path. ValueError naming the folder when one is neither a run's nor an evaluation's."""
    if not 1 <= len(folders) <= 2:
        raise ValueError(f"expected one folder, or two to compare; got {len(folders)}: {', '.join(map(str, folders))}")
    read = [read_folder(folder) for folder in folders]
    output = Path(output) if output is not None else default_output(folders)
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.with_name(f".{output.name}.tmp")  # a reader never opens half a page
    tmp.write_text(render(read))
    tmp.replace(output)
    return output


def render(folders: Sequence[Folder]) -> str:
    """The page's HTML."""
    sets = [(folder, trace_set) for folder in folders for trace_set in folder.sets]
    traces, indices = [], {}
    for number, (_, trace_set) in enumerate(sets):
        start = len(traces)
        traces += [page_trace(record, number) for record in trace_set.records]
        indices[id(trace_set)] = range(start, len(traces))
    a, b = _compared(folders)
    comparison = None
    if a is not None and b is not None and a is not b:
        comparison = {"a": _set_name(folders, a), "b": _set_name(folders, b),
                      **compare(traces, indices[id(a)], indices[id(b)])}
    data = {"sets": [{"label": s.label, "folder": f.name} for f, s in sets], "traces": traces,
            "comparison": comparison}
    environment = jinja2.Environment(loader=jinja2.FileSystemLoader(_TEMPLATES), autoescape=True,
                                     undefined=jinja2.StrictUndefined)
    return environment.get_template("report.html.j2").render(
        title=" vs ".join(folder.name for folder in folders),
        folders=[_folder_view(folder) for folder in folders],
        sets=[_set_view(folder, trace_set) for folder, trace_set in sets],
        comparison=comparison,
        plotly_js=plotly.offline.get_plotlyjs(),
        style=(_TEMPLATES / "report.css").read_text(),
        script=(_TEMPLATES / "report.js").read_text(),
        # Inside <script>, "</script>" in a model's text would end the element: JSON's own escape keeps it text.
        data=json.dumps(data, ensure_ascii=False, separators=(",", ":")).replace("<", "\\u003c"),
    )


def _compared(folders: Sequence[Folder]) -> tuple[TraceSet | None, TraceSet | None]:
    """The two sets the comparison shows: a folder's first and last, or the last of each of two folders."""
    if len(folders) == 2:
        return folders[0].last_set(), folders[1].last_set()
    return folders[0].first_set(), folders[0].last_set()


def _set_name(folders: Sequence[Folder], trace_set: TraceSet) -> str:
    """A set's label, with its folder's name when two folders are shown."""
    if len(folders) == 1:
        return trace_set.label
    return next(f"{f.name}: {trace_set.label}" for f in folders if any(s is trace_set for s in f.sets))


def _folder_view(folder: Folder) -> dict:
    """What the template shows of a folder: its charts and, for a run, the newest refused training turns."""
    if folder.kind == "run":
        figures = run_figures(folder.history, folder.parse_failures)
        what = "training run" + (f", ended on step {folder.best_step}" if folder.best_step is not None else "")
    else:
        figures = eval_figures([s.label for s in folder.sets], [s.summary for s in folder.sets])
        what = "searchr1-eval"
    return {"name": folder.name, "path": str(folder.path), "what": what, "figures": figures,
            "parse_failures": folder.parse_failures[-PARSE_FAILURES_SHOWN:][::-1],
            "num_parse_failures": len(folder.parse_failures)}


def _set_view(folder: Folder, trace_set: TraceSet) -> dict:
    """A row of the sets table: EM, per source when there are several, searches, turns and the done fraction."""
    summary = trace_set.summary
    per_source = {k.removeprefix("em/"): v for k, v in summary.items() if k.startswith("em/")}
    return {"folder": folder.name, "label": trace_set.label, "n": int(summary["num_samples"]), "em": summary["em"],
            "per_source": per_source if len(per_source) > 1 else {},
            "searches": summary["searches_per_rollout"], "turns": summary["turns_per_rollout"],
            "done": summary["status_done"], "failed": int(summary["search_failed"])}
