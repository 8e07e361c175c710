"""One trace as the page shows it (:func:`page_trace`), and two sets of traces compared question by question
(:func:`compare`).

A page trace keeps what a reader needs to see what the agent did: each turn's text and calls, each search's passages
with the golden answer marked where it appears, the answer with its EM and SQuAD token F1, and how the rollout ended.
It drops the prompt and cuts each passage to a snippet around the golden answer (or its start): about 2 KB a trace
(5,000 three-search traces make a 10 MB page). Keys are short because every trace repeats them; the page's script
reads them.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence

from searchr1_trl.tasks.common.rubric import normalize_answer, normalized_golds, passages_hold_gold, token_f1
from searchr1_trl.training.evaluation import SEARCH_FAILED

SNIPPET_CHARS = 240
# The trainer's validation samples by the name its trace lines give them (SearchR1Trainer.evaluate).
SAMPLE_NAMES = {"eval": "validation", "report": "report sample"}
# One passage of a search result, as retrieval.passages_text writes it: "Doc 1(Title: Paris) The capital ...".
_PASSAGE = re.compile(r"^Doc \d+\(Title: (.*?)\) (.*)$", re.MULTILINE)


def page_trace(record: dict, set_index: int) -> dict:
    """A trace line (:class:`~searchr1_trl.training.evaluation.Trace` fields) as the page's script reads it:
    ``s`` set, ``q`` question, ``g`` golden answers, ``src`` data source, ``smp`` the run's sample (validation or
    report), ``st`` status, ``em`` 0/1, ``f1``, ``a`` answer, ``ns`` searches, ``nt`` turns, ``ct`` calls the engine
    closed, ``turns`` the conversation after the prompt (:func:`_turns`)."""
    golds = record["golden_answers"]
    answer = record.get("answer")
    normalized = normalized_golds(golds)
    f1 = max((token_f1(normalize_answer(answer), gold) for gold in normalized), default=0.0) if answer else 0.0
    return {
        "s": set_index, "q": record["question"], "g": golds, "src": record.get("data_source") or "all",
        "smp": SAMPLE_NAMES.get(record.get("sample"), record.get("sample")), "st": record["status"],
        "em": int(bool(record.get("em"))), "f1": round(f1, 2),
        "a": answer, "ns": len(record.get("searches") or []), "nt": record.get("num_turns", 0),
        "ct": record.get("closed_turns", 0), "turns": _turns(record, golds, normalized),
    }


def _turns(record: dict, golds: Sequence[str], normalized: set[str]) -> list[dict]:
    """The conversation after the prompt: ``{"r": "a", "x": text, "c": [queries]}`` for a model turn,
    ``{"r": "t", "p": [passages]}`` for a search result (``"x"`` when it is not passages: an error, nothing). A
    prompt holding passages (``rag``) shows them as a result. A trace written without its conversation shows its
    searches: queries and passage titles."""
    messages = record.get("messages") or []
    if not messages:
        return [turn for search in record.get("searches") or [] for turn in (
            {"r": "a", "x": "", "c": [search.get("query") or ""]},
            {"r": "t", "p": [{"t": title, "gold": passages_hold_gold(title, normalized)} for title in search["titles"]]}
            if search.get("titles") else {"r": "t", "x": "(failed)" if search.get("failed") else "(no result)"},
        )]
    turns = []
    prompt_seen = False
    for message in messages:
        role, content = message.get("role"), message.get("content") or ""
        if role == "assistant":
            calls = [(call.get("function") or {}).get("arguments") for call in message.get("tool_calls") or []]
            turns.append({"r": "a", "x": content, "c": [_query(arguments) for arguments in calls]})
        elif role == "tool" or (role == "user" and prompt_seen):
            passages = [_passage(title, text, golds, normalized) for title, text in _PASSAGE.findall(content)]
            turns.append({"r": "t", "p": passages} if passages else {"r": "t", "x": content or "(no result)"})
        elif role == "user":
            prompt_seen = True
            passages = [_passage(title, text, golds, normalized) for title, text in _PASSAGE.findall(content)]
            if passages:  # rag: the retrieval is in the prompt
                turns.append({"r": "t", "p": passages})
    return turns


def _query(arguments) -> str:
    """A search call's query as the model wrote it: the ``query`` of its arguments, else the arguments as text."""
    if isinstance(arguments, dict):
        return str(arguments.get("query", arguments))
    return str(arguments or "")


def _passage(title: str, text: str, golds: Sequence[str], normalized: set[str]) -> dict:
    """``t`` title, ``gold`` whether the passage holds a golden answer (the rubric's whole-word test), ``x`` a
    snippet of the text around the first golden answer found verbatim (else its start), "…" where it was cut, ``h``
    the ``[start, end)`` spans of golden answers in the snippet."""
    spans = _gold_spans(text, golds)
    start = max(0, spans[0][0] - SNIPPET_CHARS // 3) if spans else 0
    if start:  # begin at a word, marked as cut
        start = text.find(" ", start, spans[0][0]) + 1 or start
    end = start + SNIPPET_CHARS
    snippet = ("…" if start else "") + text[start:end] + ("…" if end < len(text) else "")
    shift = start - (1 if start else 0)  # where the snippet's first character was in the text
    return {"t": title, "gold": passages_hold_gold(f"{title} {text}", normalized), "x": snippet,
            "h": [[s - shift, e - shift] for s, e in spans if s >= start and e <= end]}


def _gold_spans(text: str, golds: Sequence[str]) -> list[tuple[int, int]]:
    """Where a golden answer appears in ``text`` as whole words, ignoring case, in order:
    ``_gold_spans("In 1599 and 1600", ["1599"])`` -> ``[(3, 7)]``."""
    alternatives = "|".join(re.escape(gold) for gold in sorted(golds, key=len, reverse=True) if gold.strip())
    if not alternatives:
        return []
    return [m.span() for m in re.finditer(rf"(?<!\w)(?:{alternatives})(?!\w)", text, re.IGNORECASE)]


def compare(traces: Sequence[dict], a: Sequence[int], b: Sequence[int]) -> dict:
    """Two sets of page traces (``a`` and ``b`` index ``traces``) on the questions they share: EM of each, the
    questions whose outcome flipped (``gained``: wrong in ``a``, right in ``b``; ``lost``: the reverse; traces with a
    failed search are not scored, so they never flip), searches and turns per rollout, each status's fraction, how
    statuses changed (``transitions``: ``[status in a, status in b, questions]``, most frequent first) and how many
    questions searched how many times more or less (``search_changes``: ``[delta, questions]``)."""
    b_by_question = {traces[i]["q"]: i for i in b}
    pairs = [(i, b_by_question[traces[i]["q"]]) for i in a if traces[i]["q"] in b_by_question]
    if not pairs:
        return {"matched": 0}
    left, right = [traces[i] for i, _ in pairs], [traces[j] for _, j in pairs]
    scored = [(i, j) for i, j in pairs if SEARCH_FAILED not in (traces[i]["st"], traces[j]["st"])]
    statuses = sorted({t["st"] for t in left + right})
    transitions = Counter((x["st"], y["st"]) for x, y in zip(left, right, strict=True) if x["st"] != y["st"])
    return {
        "matched": len(pairs),
        "em": [_mean(t["em"] for t in left), _mean(t["em"] for t in right)],
        "gained": [[i, j] for i, j in scored if not traces[i]["em"] and traces[j]["em"]],
        "lost": [[i, j] for i, j in scored if traces[i]["em"] and not traces[j]["em"]],
        "searches": [_mean(t["ns"] for t in left), _mean(t["ns"] for t in right)],
        "turns": [_mean(t["nt"] for t in left), _mean(t["nt"] for t in right)],
        "status": [[s, _mean(t["st"] == s for t in left), _mean(t["st"] == s for t in right)] for s in statuses],
        "transitions": [[x, y, n] for (x, y), n in transitions.most_common()],
        "search_changes": sorted(Counter(y["ns"] - x["ns"] for x, y in zip(left, right, strict=True)).items()),
    }


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else 0.0
