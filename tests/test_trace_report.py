"""searchr1-report: what it reads from a run or eval folder, what a trace shows, what a comparison finds, and the page
itself in a real headless Chromium (Debian's, installed by scripts/setup.sh): it loads offline without console
errors, its filters change the rows, a flipped question is shown side by side, and 5,000 traces load in seconds.

The traces are written in the real formats by the real writers' parts: the conversation as the Search-R1 env builds
it (prompt, search calls, passages_text's passages with the restatement), its searches, answer and EM as
searchr1_trl/training/evaluation.py derives them, the line as searchr1-eval (trace_record) or the trainer's
validation writes it.
"""

from __future__ import annotations

import json
import random
import shutil
import time
from dataclasses import asdict
from pathlib import Path

import pandas as pd
import pytest

from searchr1_trl.cli import eval as eval_cli
from searchr1_trl.cli import report as report_cli
from searchr1_trl.report.folders import read_folder
from searchr1_trl.report.page import render, write_report
from searchr1_trl.report.traces import compare, page_trace
from searchr1_trl.tasks.common.retrieval import passages_text
from searchr1_trl.tasks.common.rubric import final_answer
from searchr1_trl.tasks.common.search import QUESTION_SEPARATOR, RESTATEMENT
from searchr1_trl.tasks.search_r1.env import INSTRUCTION
from searchr1_trl.training import evaluation

SOURCES = ("nq", "hotpotqa", "squad")
STATUSES = ("done", "done", "done", "done", "truncated_max_turns", "error_parse", "truncated_length")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
LOAD_BUDGET_S = 15.0  # 5,000 traces on the 2-core CPU while other tests run: measured 2-4 s
FILTER_BUDGET_S = 2.0


def conversation(question: str, gold: str, queries: list[str], answer: str | None, status: str,
                 rng: random.Random) -> list[dict]:
    """A Search-R1 rollout's messages: the env's prompt, one search call per query answered with three passages
    (the first holding the gold when the dice say so), then the final answer, or the way ``status`` ended it."""
    messages = [{"role": "user", "content": f"{INSTRUCTION}{QUESTION_SEPARATOR}{question}"}]
    for query in queries:
        messages.append({"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "search", "arguments": {"query": query}}}]})
        docs = [{"contents": f"{query.title()}\nThe {query} is described here; in {1900 + rng.randrange(120)} "
                             f"it was recorded by {gold if rng.random() < 0.6 else 'someone else'} and others."}]
        docs += [{"contents": f"Distractor {k} of {question[:20]}\nUnrelated text about another topic, number {k}."}
                 for k in range(2)]
        messages.append({"role": "tool", "name": "search",
                         "content": f"{passages_text(docs)}\n\n{RESTATEMENT.format(question=question)}"})
    if status == "error_parse":
        messages.append({"role": "assistant", "content": '<tool_call>\n{"name": "search", "arguments": {"qu'})
    elif status == "done":
        messages.append({"role": "assistant", "content": answer})
    return messages


def make_trace(i: int, rng: random.Random, skill: float, source: str | None = None) -> evaluation.Trace:
    """Question ``i`` answered by a policy that is right with probability ``skill`` (when it ends done)."""
    gold = f"Entity {i}"
    question = f"Who recorded the event number {i} of the archive?"
    status = rng.choice(STATUSES)
    queries = [f"event number {i} archive"] + [f"archive {i} recorder"] * rng.randrange(0, 3)
    answer = (gold if rng.random() < skill else f"Entity {i + 1}") if status == "done" else None
    messages = conversation(question, gold, queries, answer, status, rng)
    return evaluation.Trace(
        question=question, golden_answers=[gold], data_source=source or SOURCES[i % len(SOURCES)], method="agent",
        answer=final_answer(messages), em=evaluation.exact_match(messages, [gold]),
        searches=evaluation._searches(messages), num_turns=len(queries) + (status != "truncated_max_turns"),
        status=status, messages=messages, closed_turns=int(rng.random() < 0.1))


def write_eval_folder(folder: Path, checkpoints: dict[str, float], n: int, seed: int = 0) -> Path:
    """A searchr1-eval output_dir: ``n`` questions answered by each checkpoint (name -> skill), as traces.jsonl."""
    folder.mkdir(parents=True, exist_ok=True)
    lines = []
    for checkpoint, skill in checkpoints.items():
        rng = random.Random(seed)  # each checkpoint sees the same statuses and searches; only the answers differ
        lines += [json.dumps(eval_cli.trace_record(f"test.parquet|src|{i}", checkpoint, make_trace(i, rng, skill)))
                  for i in range(n)]
    (folder / eval_cli.TRACES_FILE).write_text("\n".join(lines) + "\n")
    return folder


def write_run_folder(folder: Path, skills: dict[int, float], n: int, best: int | None = None) -> Path:
    """A training run's output_dir: a validation of ``n`` questions at each step (step -> skill), written as
    SearchR1Trainer._write_validation_traces writes them, and its trainer_state.json."""
    (folder / "validation_traces").mkdir(parents=True)
    history = []
    for step, skill in skills.items():
        rng = random.Random(0)
        traces = [make_trace(i, rng, skill) for i in range(n)]
        (folder / "validation_traces" / f"step-{step}.jsonl").write_text(
            "".join(json.dumps({"sample": "eval", "step": step, **asdict(t)}) + "\n" for t in traces))
        history.append({"step": step, **{f"eval_{k}": v for k, v in evaluation.summarize(traces).items()}})
        history.append({"step": step + 1, "reward": skill, "rollout/searches_per_rollout": 1.5,
                        "rollout/status_done": 0.9, "rollout/status_error_parse": 0.1, "rubric/correct": skill})
    (folder / "trainer_state.json").write_text(json.dumps({"log_history": history, "best_global_step": best}))
    (folder / "parse_failures.jsonl").write_text(json.dumps(
        {"step": 1, "question": "Who?", "turn": 1, "text": "<tool_call>\n</tool_call>"}) + "\n")
    return folder


# ---- reading folders ----------------------------------------------------------------------------------------


def test_a_run_folder_gives_its_first_best_and_last_validation_as_trace_sets(tmp_path):
    run = write_run_folder(tmp_path / "run", {0: 0.2, 10: 0.6, 20: 0.4, 30: 0.5}, n=6, best=10)
    folder = read_folder(run)
    assert (folder.kind, folder.best_step) == ("run", 10)
    assert [s.label for s in folder.sets] == ["step 0", "step 10 (best)", "step 30"]
    assert [len(s.records) for s in folder.sets] == [6, 6, 6]
    assert folder.first_set().label == "step 0" and folder.last_set().label == "step 30"
    assert folder.parse_failures == [{"step": 1, "question": "Who?", "turn": 1, "text": "<tool_call>\n</tool_call>"}]


def test_an_eval_folder_gives_one_set_per_method_and_checkpoint_and_compares_its_agents(tmp_path):
    out = write_eval_folder(tmp_path / "eval", {"runs/a/checkpoint-10": 0.2, "runs/a/checkpoint-20": 0.8}, n=4)
    with open(out / eval_cli.TRACES_FILE, "a") as f:  # a direct trace of the first checkpoint, written last
        f.write(json.dumps(eval_cli.trace_record("k", "runs/a/checkpoint-10", evaluation.Trace(
            "Who?", ["x"], "nq", "direct", "x", True, [], 1, "done"))) + "\n")
    folder = read_folder(out)
    assert [s.label for s in folder.sets] == ["direct · a/checkpoint-10", "agent · a/checkpoint-10",
                                              "agent · a/checkpoint-20"]
    assert (folder.first_set().label, folder.last_set().label) == ("agent · a/checkpoint-10", "agent · a/checkpoint-20")


def test_a_folder_that_is_neither_a_run_nor_an_evaluation_is_refused_naming_it(tmp_path, capsys):
    with pytest.raises(SystemExit, match=f"error: {tmp_path} holds no traces.jsonl"):
        report_cli.main([str(tmp_path)])


def test_the_history_is_read_from_the_offline_jobs_log_history_csv_when_training_left_no_state(tmp_path):
    run = write_run_folder(tmp_path / "run", {0: 0.25, 10: 0.5}, n=4)
    history = json.loads((run / "trainer_state.json").read_text())["log_history"]
    (run / "trainer_state.json").unlink()
    pd.DataFrame(history).to_csv(run / "log_history.csv", index=False)  # as scripts/offline_job.py writes it
    (run / "summary.json").write_text(json.dumps({"best_step": 10}))
    folder = read_folder(run)
    assert folder.history == [{k: v for k, v in entry.items() if v is not None} for entry in history]
    assert folder.best_step == 10 and [s.label for s in folder.sets] == ["step 0", "step 10 (best)"]
    page = render([folder])
    for title in ("Exact match", "Reward (training rollouts)", "How training rollouts ended",
                  "How validation rollouts ended", "What the search policy learned",
                  "Training turns the parser refused"):
        assert title in page


# ---- what a trace shows, what a comparison finds ------------------------------------------------------------


def test_a_page_trace_shows_each_query_and_marks_the_gold_in_the_passages_that_hold_it():
    docs = [{"contents": "Robert Curthose\nA castle was built in 1080 by robert curthose, the eldest son."},
            {"contents": "Newcastle\nA city in England."}]
    messages = [
        {"role": "user", "content": f"{INSTRUCTION}{QUESTION_SEPARATOR}Who built a castle in Newcastle in 1080?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "search", "arguments": {"query": "Newcastle castle 1080"}}}]},
        {"role": "tool", "name": "search", "content": passages_text(docs)},
        {"role": "assistant", "content": "Robert"},
    ]
    record = {"question": "Who built a castle in Newcastle in 1080?", "golden_answers": ["Robert Curthose"],
              "data_source": "squad", "status": "done", "em": False, "answer": "Robert", "num_turns": 2,
              "searches": evaluation._searches(messages), "messages": messages}
    shown = page_trace(record, 0)
    assert (shown["em"], shown["f1"], shown["ns"]) == (0, 0.67, 1)
    model, result, answer = shown["turns"]
    assert model == {"r": "a", "x": "", "c": ["Newcastle castle 1080"]} and answer["x"] == "Robert"
    hit, miss = result["p"]
    assert (hit["t"], hit["gold"], miss["t"], miss["gold"]) == ("Robert Curthose", True, "Newcastle", False)
    assert [hit["x"][s:e] for s, e in hit["h"]] == ["robert curthose"] and miss["h"] == []


def test_a_long_passage_is_cut_to_a_snippet_at_words_around_the_gold():
    text = "word " * 100 + "It was built by Robert Curthose in 1080. " + "more " * 100
    record = {"question": "Who?", "golden_answers": ["Robert Curthose"], "status": "done", "em": True,
              "answer": "Robert Curthose", "messages": [
                  {"role": "user", "content": "Who?"},
                  {"role": "tool", "name": "search", "content": passages_text([{"contents": f"Castle\n{text}"}])}]}
    passage = page_trace(record, 0)["turns"][0]["p"][0]
    assert passage["x"].startswith("…word ") and passage["x"].endswith("…") and len(passage["x"]) <= 242
    assert [passage["x"][s:e] for s, e in passage["h"]] == ["Robert Curthose"]


def test_a_trace_written_without_its_conversation_shows_its_searches_titles():
    record = asdict(make_trace(7, random.Random(1), skill=0.5))
    del record["messages"]  # as the traces kept in a results folder are
    shown = page_trace(record, 0)
    queries = [turn["c"][0] for turn in shown["turns"] if turn["r"] == "a"]
    assert queries == [search["query"] for search in record["searches"]] and queries
    assert [p["t"] for turn in shown["turns"] if turn["r"] == "t" for p in turn.get("p", [])] == [
        title for search in record["searches"] for title in search["titles"]]


def test_a_comparison_finds_the_flipped_questions_and_how_searches_and_statuses_changed():
    def trace(q, em, status, searches):
        return {"q": q, "em": em, "st": status, "ns": searches, "nt": searches + 1}

    traces = [trace("a", 0, "done", 1), trace("b", 1, "done", 1), trace("c", 0, "error_parse", 0),
              trace("d", 0, "error_search", 1),
              trace("a", 1, "done", 2), trace("b", 0, "truncated_max_turns", 3), trace("c", 0, "done", 1),
              trace("d", 1, "done", 1), trace("e", 1, "done", 1)]
    found = compare(traces, range(4), range(4, 9))
    assert found["matched"] == 4 and found["em"] == [0.25, 0.5]
    assert (found["gained"], found["lost"]) == ([[0, 4]], [[1, 5]])  # d's failed search is not scored: no flip
    assert found["transitions"] == [["done", "truncated_max_turns", 1], ["error_parse", "done", 1],
                                    ["error_search", "done", 1]]
    assert found["search_changes"] == [(0, 1), (1, 2), (2, 1)]
    assert found["searches"] == [0.75, 1.75]


def test_searchr1_report_writes_one_file_that_loads_nothing_from_elsewhere(tmp_path, capsys):
    run = write_run_folder(tmp_path / "run", {0: 0.2, 2: 0.6}, n=5)
    report_cli.main([str(run)])
    page = (run / "report.html").read_text()
    assert capsys.readouterr().out.startswith(f"report: {run / 'report.html'}")
    assert "<script src" not in page and "<link" not in page and "@import" not in page
    assert page.count("Plotly.newPlot(") >= 4 and '"comparison":{"a":"step 0","b":"step 2"' in page


def test_model_text_cannot_end_the_pages_script(tmp_path):
    out = write_eval_folder(tmp_path / "eval", {"m": 0.5}, n=1)
    record = json.loads((out / eval_cli.TRACES_FILE).read_text())
    record["answer"] = "</script><script>alert(1)</script>"
    (out / eval_cli.TRACES_FILE).write_text(json.dumps(record) + "\n")
    page = render([read_folder(out)])
    assert "</script><script>alert(1)" not in page and "\\u003c/script>\\u003cscript>alert(1)" in page


# ---- the page in headless Chromium ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def browser():
    if CHROMIUM is None:
        pytest.skip("Chromium is not installed: scripts/setup.sh installs Debian's (apt-get install chromium)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield chromium
        chromium.close()


def open_report(browser, path: Path):
    """The page at ``path``, loaded until its script is done; returns the page, its console errors and warnings,
    the requests it tried to send elsewhere (refused), and the seconds it took."""
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    problems, elsewhere = [], []
    page.on("console", lambda m: problems.append(f"{m.type}: {m.text}") if m.type in ("error", "warning") else None)
    page.on("pageerror", lambda error: problems.append(f"pageerror: {error}"))

    def refuse(route):
        elsewhere.append(route.request.url)
        route.abort()

    page.route(lambda url: not url.startswith("file://"), refuse)
    start = time.perf_counter()
    page.goto(path.as_uri())
    page.wait_for_function("document.body.dataset.ready === '1'", timeout=60_000)
    return page, problems, elsewhere, time.perf_counter() - start


def shown(page) -> tuple[int, int]:
    """The filtered count the page states and the rows it shows."""
    return int(page.inner_text("#shown")), page.locator("#trace-table tbody tr.trace").count()


def test_the_report_of_5000_traces_loads_offline_in_seconds_and_its_filters_change_the_rows(browser, tmp_path):
    out = write_eval_folder(tmp_path / "eval", {"warm": 0.3, "trained": 0.6}, n=2500)
    write_report([out])
    records = [json.loads(line) for line in (out / "traces.jsonl").read_text().splitlines()]
    page, problems, elsewhere, seconds = open_report(browser, out / "report.html")
    size_mb = (out / "report.html").stat().st_size / 1e6
    print(f"5000 traces: {size_mb:.1f} MB page, loaded in {seconds:.2f} s")
    assert (problems, elsewhere) == ([], [])
    assert seconds < LOAD_BUDGET_S
    assert shown(page) == (5000, 200)  # a page of rows at a time

    expected = {
        ("#f-outcome", "1"): sum(r["em"] for r in records),
        ("#f-status", "error_parse"): sum(r["status"] == "error_parse" for r in records),
        ("#f-searches", "2"): sum(len(r["searches"]) == 2 for r in records),
        ("#f-source", "hotpotqa"): sum(r["data_source"] == "hotpotqa" for r in records),
        ("#f-set", "1"): 2500,
    }
    for (control, value), count in expected.items():
        start = time.perf_counter()
        page.select_option(control, value)
        assert shown(page) == (count, min(count, 200)), control
        assert time.perf_counter() - start < FILTER_BUDGET_S
        page.select_option(control, "")
    page.select_option("#f-outcome", "0")
    page.select_option("#f-status", "done")
    wrong_but_done = sum(not r["em"] and r["status"] == "done" for r in records)
    assert shown(page)[0] == wrong_but_done
    page.click("#more")
    assert shown(page)[1] == min(wrong_but_done, 400)
    page.fill("#f-text", "event number 1234 ")
    assert shown(page)[0] == sum(not r["em"] and r["status"] == "done" and "number 1234 " in r["question"]
                                 for r in records)
    assert problems == []


def test_a_row_opens_its_turns_with_the_gold_marked_in_the_passages(browser, tmp_path):
    out = write_eval_folder(tmp_path / "eval", {"m": 1.0}, n=20)
    write_report([out])
    records = [json.loads(line) for line in (out / "traces.jsonl").read_text().splitlines()]
    found = next(r for r in records if any(r["golden_answers"][0] in m["content"] for m in r["messages"][1:]
                                           if m["role"] == "tool"))
    page, problems, _, _ = open_report(browser, out / "report.html")
    page.fill("#f-text", found["question"])
    assert shown(page) == (1, 1)
    page.locator("#trace-table tbody tr.trace").click()
    detail = page.locator("#trace-table tr.detail")
    assert detail.locator(".query").all_inner_texts() == [s["query"] for s in found["searches"]]
    assert detail.locator(".title.gold").count() >= 1
    assert set(detail.locator("mark").all_inner_texts()) == set(found["golden_answers"])
    page.locator("#trace-table tbody tr.trace").click()
    assert page.locator("#trace-table tr.detail").count() == 0 and problems == []


def test_two_folders_show_the_flipped_questions_side_by_side(browser, tmp_path):
    before = write_run_folder(tmp_path / "warm", {0: 0.2}, n=30)
    after = write_eval_folder(tmp_path / "trained", {"runs/trained/checkpoint-50": 0.8}, n=30)
    path = write_report([before, after])
    assert path == before / "report_vs_trained.html"
    page, problems, elsewhere, _ = open_report(browser, path)
    assert (problems, elsewhere) == ([], [])

    left = {r["question"]: r for r in read_folder(before).last_set().records}
    right = {r["question"]: r for r in read_folder(after).last_set().records}
    gained = [q for q in left if not left[q]["em"] and right[q]["em"]]
    lost = [q for q in left if left[q]["em"] and not right[q]["em"]]
    assert gained and page.inner_text("#flips-shown") == str(len(gained) + len(lost))
    card = page.locator(f'#flips .flip[data-question="{gained[0]}"]')
    assert card.count() == 1 and card.locator(".tag").inner_text() == "gained"
    sides = card.locator(".flip-body > div").all_inner_texts()
    assert "warm: step 0" in sides[0] and "EM 0" in sides[0]
    assert "trained: agent · trained/checkpoint-50" in sides[1] and "EM 1" in sides[1]
    page.select_option("#flip-kind", "lost")
    assert page.locator("#flips .flip").count() == len(lost)
    assert problems == []
