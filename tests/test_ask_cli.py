"""searchr1-ask: a question in, each search with its passage titles and the answer out, as text or JSON."""

from __future__ import annotations

import json
import re
import shutil

import pytest

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


def test_a_lora_checkpoint_answers_with_its_base_model(lora_checkpoint, tiny_model_dir, capsys):
    def answer(checkpoint) -> dict:
        ask.main(["--checkpoint", str(checkpoint), "--question", "Who won Super Bowl 50?", "--json", "--method",
                  "direct", "--generator", "transformers", "--max_tokens_per_turn", "8"])
        return json.loads(capsys.readouterr().out)

    adapted, base = answer(lora_checkpoint), answer(tiny_model_dir)
    assert adapted["status"] in ("done", "truncated_length") and adapted["answer"]
    assert adapted["answer"] != base["answer"], "the adapter is applied, not the base alone"


@pytest.mark.parametrize(("kind", "cause"), [
    ("empty", "is an empty folder; expected a model folder (config.json and weights), a LoRA adapter folder "
              "(adapter_config.json) or a Hub model id"),
    ("missing", "does not exist; expected a model folder"),
    ("file", "is a file; expected a model folder"),
    ("no model", "holds neither config.json nor adapter_config.json (found notes.txt); expected a model folder"),
], ids=["empty", "missing", "file", "no model"])
def test_a_path_that_holds_no_model_is_refused_in_one_line_naming_it(tmp_path, kind, cause):
    path = tmp_path / kind
    if kind == "empty":
        path.mkdir()
    elif kind == "file":
        path.write_text("not a model")
    elif kind == "no model":
        path.mkdir()
        (path / "notes.txt").write_text("")

    with pytest.raises(SystemExit) as stop:
        ask.main(["--checkpoint", str(path), "--question", "Who won Super Bowl 50?", "--generator", "transformers"])
    assert str(stop.value.code).startswith(f"error: checkpoint '{path}' {cause}") and "\n" not in stop.value.code


def test_a_lora_checkpoint_whose_adapter_weights_are_truncated_is_refused_in_one_line(lora_checkpoint, tmp_path):
    checkpoint = tmp_path / "cut"
    shutil.copytree(lora_checkpoint, checkpoint)
    weights = checkpoint / "adapter_model.safetensors"
    with weights.open("r+b") as f:
        f.truncate(weights.stat().st_size - 100)

    with pytest.raises(SystemExit, match="^" + re.escape(f"error: checkpoint '{checkpoint}': adapter_model.safetensors "
                                                         "is truncated (") + r".*\): a save cut short"):
        ask.main(["--checkpoint", str(checkpoint), "--question", "Who won Super Bowl 50?", "--generator",
                  "transformers"])
