"""searchr1-ask: a question in, each search with its passage titles and the answer out, as text or JSON."""

from __future__ import annotations

import json

from searchr1_trl.cli import ask
from searchr1_trl.training import evaluation


def test_the_text_shows_each_query_with_its_passage_titles_then_the_answer():
    trace = evaluation.Trace("Who won Super Bowl 50?", [""], "all", "agent", "Denver Broncos", False,
                             [{"query": "Super Bowl 50 winner", "titles": ["Super Bowl 50", "Denver Broncos"]}],
                             2, "done")
    assert ask.render(trace) == (
        "question: Who won Super Bowl 50?\n"
        "search 1: Super Bowl 50 winner\n"
        "  - Super Bowl 50\n"
        "  - Denver Broncos\n"
        "answer: Denver Broncos   [done, 2 turn(s)]"
    )


def test_json_prints_one_trace_per_question_without_gold_fields(tiny_model_dir, retriever_url, capsys):
    ask.main(["--checkpoint", str(tiny_model_dir), "--question", "Who won Super Bowl 50?", "--json",
              "--generator", "transformers", "--search_url", retriever_url, "--max_tokens_per_turn", "8"])
    [line] = capsys.readouterr().out.splitlines()
    record = json.loads(line)
    assert record["question"] == "Who won Super Bowl 50?" and record["method"] == "agent"
    assert set(record) == {"question", "method", "answer", "searches", "num_turns", "status", "messages",
                           "closed_turns"}
