"""The report's charts, drawn with plotly: a run's curves by optimizer step, an evaluation's bars by method x
checkpoint.

Both read the metric names the trainer logs (``searchr1_trl/training/trainer.py``: ``rollout/*`` for training
rollouts, ``eval_*`` and ``report_*`` for the two validation samples) and that
:func:`~searchr1_trl.training.evaluation.summarize` returns for an evaluation (the same names without a prefix), so
one list of charts (:func:`_charts`) serves both: EM per data source, reward, searches and turns per rollout, how
rollouts ended, the calls the engine closed, and what the search policy learned.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence

import plotly.graph_objects as go
import plotly.io as pio

from searchr1_trl.engine.rollout import RolloutStatus
from searchr1_trl.report.traces import SAMPLE_NAMES
from searchr1_trl.training.evaluation import SEARCH_FAILED

STATUSES = (*(status.value for status in RolloutStatus), SEARCH_FAILED)
# Done green, budgets run out in yellows and oranges, errors in reds and purples: one colour per status everywhere.
STATUS_COLORS = {"done": "#2da44e", "truncated_max_turns": "#d4a72c", "truncated_prompt_too_long": "#bc4c00",
                 "truncated_length": "#fb8f44", "error_parse": "#cf222e", "error_timeout": "#a40e26",
                 "error_tool": "#8250df", SEARCH_FAILED: "#6e7781"}
# The run's validation samples by the prefix the trainer logs them with (SearchR1Trainer.evaluate).
RUN_SAMPLES = {f"{sample}_": name for sample, name in SAMPLE_NAMES.items()}
_SOURCE = re.compile(r"^(?:eval_|report_)?em/(.+)$")
_CONFIG = {"displaylogo": False, "responsive": True, "modeBarButtonsToRemove": ["select2d", "lasso2d"]}


def run_figures(history: Sequence[dict], parse_failures: Sequence[dict]) -> list[str]:
    """A training run's charts (HTML ``div``s for a page that loads plotly.js once), x the optimizer step; charts
    without any of their metrics in ``history`` are left out."""
    rows = [entry for entry in history if "step" in entry]
    charts = _charts(RUN_SAMPLES, _sources(rows), training=True)
    figures = [_figure(title, [row["step"] for row in rows], rows, series, stacked, bars=False)
               for title, series, stacked in charts]
    if parse_failures:
        per_step = sorted(Counter(failure.get("step", 0) for failure in parse_failures).items())
        figure = go.Figure(go.Bar(x=[s for s, _ in per_step], y=[n for _, n in per_step], name="refused turns"))
        figures.append(_layout(figure, "Training turns the parser refused (parse_failures.jsonl)", "turns"))
    last = max((row["step"] for row in rows), default=0)
    for figure in figures:
        if figure is not None:  # steps are whole: a short run gets a tick per step, not 0.5s
            figure.update_xaxes(title_text="step", dtick=1 if last < 10 else None)
    return [_html(figure, f"chart-{i}") for i, figure in enumerate(f for f in figures if f is not None)]


def eval_figures(labels: Sequence[str], summaries: Sequence[dict]) -> list[str]:
    """An evaluation's charts: one bar per trace set (``labels[i]`` for ``summaries[i]``)."""
    charts = _charts({"": ""}, _sources(summaries), training=False)
    figures = [_figure(title, list(labels), summaries, series, stacked, bars=True) for title, series, stacked in charts]
    return [_html(figure, f"chart-{i}") for i, figure in enumerate(f for f in figures if f is not None)]


def _sources(rows: Sequence[dict]) -> list[str]:
    """The data sources with an EM column: ``eval_em/nq`` -> ``nq``."""
    return sorted({match.group(1) for row in rows for key in row if (match := _SOURCE.match(key))})


def _charts(samples: dict[str, str], sources: Sequence[str], training: bool) -> list[tuple[str, list, bool]]:
    """``(title, [(metric, legend name)], stacked)`` per chart. ``samples`` maps a logged prefix to the sample's name
    (``{"": ""}``: an evaluation's unprefixed summary); ``training`` adds the training rollouts' metrics."""

    def named(prefix: str, what: str = "") -> str:
        return " ".join(part for part in (samples[prefix], what) if part) or "EM"

    groups = {**({"rollout/": "training"} if training else {}), **samples}
    em = [(f"{p}em", named(p)) for p in samples]
    em += [(f"{p}em/{source}", named(p, source)) for p in samples for source in sources if len(sources) > 1]
    train = [("rubric/correct", "training rollouts")] if training else []
    per_rollout = [(f"{p}{what}_per_rollout", " ".join(filter(None, (groups[p], what))))
                   for p in groups for what in ("searches", "turns")]
    learned = [(f"{p}{key}", named(p, what)) for p in samples for key, what in (
        ("second_query_rate", "second query"), ("first_search_missed", "first search missed the gold"),
        ("em_first_search_missed", "EM when it missed"))]
    charts = [
        ("Exact match", em + train, False),
        ("Reward (training rollouts)", [("reward", "reward"), ("reward_std", "std")] if training else [], False),
        ("Searches and turns per rollout", per_rollout, False),
        *[(f"How {name or 'the'} rollouts ended", [(f"{p}status_{s}", s) for s in STATUSES], True)
          for p, name in groups.items()],
        ("Calls the engine closed, per rollout",
         [(f"{p}closed_turns_per_rollout", groups[p] or "closed calls") for p in groups], False),
        ("What the search policy learned", learned, False),
    ]
    return [(title, series, stacked) for title, series, stacked in charts if series]


def _figure(title: str, x: Sequence, rows: Sequence[dict], series: Sequence[tuple[str, str]], stacked: bool,
            bars: bool) -> go.Figure | None:
    """One chart of ``series`` over ``rows`` (``x[i]`` places ``rows[i]``); None when no row has any of them.
    Stacked charts (statuses) leave out series that are 0 throughout."""
    traces = []
    for key, name in series:
        points = [(x[i], row[key]) for i, row in enumerate(rows) if row.get(key) is not None]
        if not points or (stacked and not any(value for _, value in points)):
            continue
        xs, ys = zip(*points, strict=True)
        color = STATUS_COLORS.get(name) if stacked else None
        if bars:
            traces.append(go.Bar(x=list(xs), y=list(ys), name=name, marker_color=color))
        else:
            traces.append(go.Scatter(x=list(xs), y=list(ys), name=name, mode="lines+markers", line_color=color,
                                     stackgroup="status" if stacked else None))
    if not traces:
        return None
    figure = go.Figure(traces)
    if bars:
        figure.update_layout(barmode="stack" if stacked else "group")
    return _layout(figure, title, "fraction" if stacked else None)


def _layout(figure: go.Figure, title: str, yaxis: str | None) -> go.Figure:
    figure.update_layout(title={"text": title, "font": {"size": 14}}, template="plotly_white", height=300,
                         margin={"l": 50, "r": 10, "t": 40, "b": 30}, legend={"font": {"size": 10}},
                         yaxis={"title": yaxis, "rangemode": "tozero"})
    return figure


def _html(figure: go.Figure, div_id: str) -> str:
    return pio.to_html(figure, include_plotlyjs=False, full_html=False, config=_CONFIG, div_id=div_id)
