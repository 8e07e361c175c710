"""searchr1-eval: the seeded sample, the table and JSON, traces that survive a crash, the real vLLM server."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from unittest import mock

import httpx
import pandas as pd
import pytest
from conftest import free_port, script

from searchr1_trl.cli import eval as eval_cli

ROOT = Path(__file__).resolve().parent.parent


def eval_args(checkpoint, data, output_dir, *extra) -> list[str]:
    return ["--checkpoints", str(checkpoint), "--data", data, "--output_dir", str(output_dir),
            "--max_tokens_per_turn", "8", *extra]


def test_the_policy_flags_are_the_recipes_with_its_defaults():
    from dataclasses import fields

    from searchr1_trl.training.recipe import KNOBS, SearchR1Config

    recipe = {f.name: f.default for f in fields(SearchR1Config) if KNOBS.get(f.name, ("",))[0] in
              ("env", "rollout", "sampling") or f.name == "task"}
    assert {f.name: f.default for f in fields(eval_cli.PolicyConfig)} == recipe
    assert {"search_url", "topk", "restate_question", "max_turns", "bare_json_tool_calls",
            "max_tokens_per_turn"} <= set(recipe)


def test_the_task_is_the_one_the_checkpoint_was_trained_on_unless_a_flag_names_another(tmp_path):
    import json

    from searchr1_trl.training.as_trained import RECIPE_FILE, policy_as_trained

    (tmp_path / RECIPE_FILE).write_text(json.dumps({"task": "search_r1_tags", "max_turns": 3}))
    policy, source = policy_as_trained([str(tmp_path)], eval_cli.PolicyConfig(), set())
    assert (policy.task, policy.max_turns, source["trained"]["task"]) == ("search_r1_tags", 3, "search_r1_tags")
    flagged, _ = policy_as_trained([str(tmp_path)], eval_cli.PolicyConfig(task="search_r1"), {"task"})
    assert flagged.task == "search_r1"


def test_the_sample_is_seeded_random_across_articles_and_a_larger_one_extends_a_smaller(offline_assets):
    def sample(n, seed=0):
        config = eval_cli.EvalConfig(checkpoints=["m"], data=[offline_assets.test_questions], num_samples=n,
                                     sample_seed=seed)
        return [s.question for _, s in eval_cli.load_questions(config)]

    test = pd.read_parquet(offline_assets.test_questions)
    titles = dict(zip(test["question"], test["title"], strict=True))
    twenty_four = sample(24)
    assert len({titles[q] for q in twenty_four}) >= 10, "spread over articles, not the file's first one"
    assert twenty_four == sample(24) and sample(48)[:24] == twenty_four
    assert sample(24, seed=1) != twenty_four


def test_the_500_question_sample_of_seed_0_is_the_offline_gpu_recipes_validation_sample(offline_assets):
    from searchr1_trl.training.loading import load_recipe
    from searchr1_trl.training.parts import build_task

    args, _ = load_recipe(["--config", "offline_gpu", "--use_cpu", "true", "--eval_data_path",
                           offline_assets.test_questions])
    validation = [s.question for s in build_task(args).eval_samples]
    config = eval_cli.EvalConfig(checkpoints=["m"], data=[offline_assets.test_questions], num_samples=500,
                                 sample_seed=0)
    assert [s.question for _, s in eval_cli.load_questions(config)] == validation
    assert len(validation) == args.eval_num_samples == 500


def test_eval_writes_a_table_per_method_and_source_json_and_one_trace_per_question(tiny_model_dir,
                                                                                   two_source_questions,
                                                                                   retriever_url, tmp_path):
    out = tmp_path / "eval"
    eval_cli.main(eval_args(tiny_model_dir, two_source_questions, out, "--num_samples", "2", "--generator",
                            "transformers", "--search_url", retriever_url, "--max_turns", "2"))

    traces = [json.loads(line) for line in (out / "traces.jsonl").read_text().splitlines()]
    assert len(traces) == 3 * 2 * 2  # methods x sources x questions
    assert {(t["method"], t["data_source"]) for t in traces} == {
        (m, s) for m in ("direct", "rag", "agent") for s in ("squad_even", "squad_odd")}
    assert all(t["searches"][0]["titles"] for t in traces if t["method"] == "rag")
    table = (out / "results.md").read_text().splitlines()
    assert table[0] == ("| method | checkpoint | squad_even (n=2) | squad_odd (n=2) | average | searches / rollout "
                        "| failed searches |")
    assert [row.split(" | ")[0] for row in table[2:5]] == ["| direct", "| rag", "| agent"]
    assert re.fullmatch(r"\*\*\d\.\d{3}\*\* / \d\.\d{3}", table[2].split(" | ")[4])  # EM / token F1
    # no checkpoint recipe; the policy's flags named (where this machine's retriever answers is no policy setting)
    assert table[5:] == ["", "EM / token F1, greedy.", "Set by flags: max_tokens_per_turn=8, max_turns=2."]
    rows = json.loads((out / "results.json").read_text())["results"]
    assert set(rows[0]) >= {"em", "average", "searches_per_rollout", "turns_per_rollout", "closed_turns_per_rollout",
                            "status", "num_samples"}
    assert rows[1]["searches_per_rollout"] == 1.0 and rows[0]["searches_per_rollout"] == 0.0
    page = (out / "report.html").read_text()  # the trace report, written at the end
    shown = json.loads(page.split('id="report-data">', 1)[1].split("</script>", 1)[0])
    assert [s["label"] for s in shown["sets"]] == [f"{m} · {Path(tiny_model_dir).name}" for m in ("direct", "rag",
                                                                                                 "agent")]
    assert len(shown["traces"]) == len(traces)


def trained_checkpoint(tiny_model_dir, folder: Path, **recipe) -> Path:
    """The tiny model saved with the recipe it was trained with, as the trainer saves every checkpoint."""
    from searchr1_trl.training.as_trained import save_recipe
    from searchr1_trl.training.recipe import SearchR1Config

    shutil.copytree(tiny_model_dir, folder)
    save_recipe(SearchR1Config(output_dir=str(folder), use_cpu=True, bf16=False, report_to="none", **recipe), folder)
    return folder


TRAINED = dict(max_turns=2, max_tokens_per_turn=8, topk=2, restate_question=True, bare_json_tool_calls=True,
               search_url="http://10.0.0.2:8000/retrieve")


def test_eval_without_flags_runs_a_checkpoint_with_the_settings_it_was_trained_with(tiny_model_dir,
                                                                                   two_source_questions, tmp_path):
    checkpoint = trained_checkpoint(tiny_model_dir, tmp_path / "checkpoint-50", **TRAINED)
    run = ["--checkpoints", str(checkpoint), "--data", two_source_questions, "--num_samples", "1", "--methods",
           "direct", "--generator", "transformers"]
    eval_cli.main([*run, "--output_dir", str(tmp_path / "as_trained")])

    settings = json.loads((tmp_path / "as_trained" / "settings.json").read_text())
    assert {k: settings[k] for k in TRAINED if k != "search_url"} == {k: v for k, v in TRAINED.items()
                                                                      if k != "search_url"}
    assert settings["search_url"] == "http://127.0.0.1:8000/retrieve"  # this machine's retriever, not the run's
    table = (tmp_path / "as_trained" / "results.md").read_text()
    assert ("As trained (the checkpoints' recipes): bare_json_tool_calls=True, max_tokens_per_turn=8, max_turns=2, "
            "restate_question=True, topk=2.") in table

    eval_cli.main([*run, "--output_dir", str(tmp_path / "flagged"), "--max_tokens_per_turn", "4"])
    settings = json.loads((tmp_path / "flagged" / "settings.json").read_text())
    assert (settings["max_tokens_per_turn"], settings["max_turns"], settings["topk"]) == (4, 2, 2)
    assert "Set by flags: max_tokens_per_turn=4 (trained: 8)." in (tmp_path / "flagged" / "results.md").read_text()


def test_checkpoints_trained_otherwise_share_an_evaluation_only_where_a_flag_sets_the_difference(tiny_model_dir,
                                                                                               tmp_path):
    from searchr1_trl.training.as_trained import policy_as_trained

    first = trained_checkpoint(tiny_model_dir, tmp_path / "a", max_turns=2)
    second = trained_checkpoint(tiny_model_dir, tmp_path / "b", max_turns=3)
    base = str(tiny_model_dir)  # a base model records no recipe: it runs with the others' settings
    with pytest.raises(ValueError, match=rf"trained with different max_turns \({first}: 2, {second}: 3\); evaluate "
                                         r"them apart or set --max_turns"):
        policy_as_trained([base, str(first), str(second)], eval_cli.PolicyConfig(), set())
    policy, source = policy_as_trained([base, str(first), str(second)], eval_cli.PolicyConfig(max_turns=4),
                                       {"max_turns"})
    assert policy.max_turns == 4 and source["flags"] == {"max_turns": (4, 2)}
    policy, _ = policy_as_trained([base, str(first)], eval_cli.PolicyConfig(), set())
    assert policy.max_turns == 2


def test_a_killed_evaluation_keeps_every_finished_trace_and_the_rerun_adds_only_the_missing(tiny_model_dir,
                                                                                         two_source_questions,
                                                                                         tmp_path):
    out = tmp_path / "eval"
    command = [sys.executable, "-m", "searchr1_trl.cli.eval",
               *eval_args(tiny_model_dir, two_source_questions, out, "--num_samples", "20", "--methods", "direct",
                          "--generator", "transformers", "--max_concurrency", "1")]
    traces = out / "traces.jsonl"
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               env={**os.environ, "PYTHONPATH": str(ROOT)})
    while process.poll() is None and (not traces.exists() or traces.read_text().count("\n") < 3):
        time.sleep(0.02)
    process.send_signal(signal.SIGKILL)
    process.wait()
    finished = traces.read_text()
    assert 3 <= finished.count("\n") < 40, "killed in the middle"
    with traces.open("a") as f:
        f.write('{"key": "a line cut short by the crash')

    eval_cli.main(command[3:])  # the rerun, in this process (a fresh one would only add TRL's ~10 s import)

    after = traces.read_text()
    assert after.startswith(finished), "the finished traces are kept as they were"
    keys = [json.loads(line)["key"] for line in after.splitlines()]
    assert len(keys) == len(set(keys)) == 40
    print(f"killed after {finished.count(chr(10))} of 40 traces; the rerun added {40 - finished.count(chr(10))}")


def test_a_rerun_with_other_policy_settings_is_refused_instead_of_mixing_traces(tiny_model_dir, two_source_questions,
                                                                               tmp_path):
    args = eval_args(tiny_model_dir, two_source_questions, tmp_path, "--num_samples", "1", "--methods", "direct",
                     "--generator", "transformers")
    eval_cli.main(args)
    eval_cli.main([*args, "--num_samples", "2"])  # a larger sample of the same settings extends the table
    with pytest.raises(SystemExit, match=r"holds traces made with other settings \(topk 3 -> 5\)"):
        eval_cli.main([*args, "--topk", "5"])
    # A folder written before a setting existed was made at its default: a rerun at the default extends it.
    settings = tmp_path / "settings.json"
    settings.write_text(json.dumps({k: v for k, v in json.loads(settings.read_text()).items()
                                    if k != "repair_tool_calls"}))
    eval_cli.main([*args, "--num_samples", "2"])
    with pytest.raises(SystemExit, match=r"other settings \(repair_tool_calls False -> True\)"):
        eval_cli.main([*args, "--repair_tool_calls", "true"])
    assert len((tmp_path / "traces.jsonl").read_text().splitlines()) == 2 * 2


def test_a_lora_checkpoint_is_evaluated_on_its_base_model(lora_checkpoint, tiny_model_dir, two_source_questions,
                                                          tmp_path):
    out = tmp_path / "eval"
    eval_cli.main(["--checkpoints", str(tiny_model_dir), str(lora_checkpoint), "--data", two_source_questions,
                   "--output_dir", str(out), "--methods", "direct", "--num_samples", "2", "--generator", "transformers",
                   "--max_tokens_per_turn", "8"])

    traces = [json.loads(line) for line in (out / "traces.jsonl").read_text().splitlines()]
    answers = {checkpoint: [t["answer"] for t in traces if t["checkpoint"] == checkpoint]
               for checkpoint in (str(tiny_model_dir), str(lora_checkpoint))}
    assert [len(a) for a in answers.values()] == [4, 4]
    assert answers[str(lora_checkpoint)] != answers[str(tiny_model_dir)], "the adapter is applied, not the base alone"
    assert f"`{lora_checkpoint}`" in (out / "results.md").read_text()


def test_a_lora_checkpoint_on_a_vllm_server_is_refused_in_one_line(lora_checkpoint, two_source_questions, tmp_path):
    with pytest.raises(SystemExit, match="^" + re.escape(f"error: checkpoint '{lora_checkpoint}' is a LoRA adapter "
                                                         "of ") + ".* a vLLM server serves whole models: use "
                                                                  "--generator transformers"):
        eval_cli.main(eval_args(lora_checkpoint, two_source_questions, tmp_path, "--methods", "direct"))


def test_a_checkpoint_with_truncated_weights_is_refused_in_one_line_naming_the_file(tiny_model_dir,
                                                                                    two_source_questions, tmp_path):
    import shutil

    checkpoint = tmp_path / "cut"
    shutil.copytree(tiny_model_dir, checkpoint)
    weights = checkpoint / "model.safetensors"
    with weights.open("r+b") as f:
        f.truncate(weights.stat().st_size // 2)

    with pytest.raises(SystemExit, match="^" + re.escape(f"error: checkpoint '{checkpoint}': model.safetensors is ")
                                         + r"truncated \([\d,]+ of the [\d,]+ bytes its header describes\): a save cut "
                                           r"short by a kill or a full disk"):
        eval_cli.main(eval_args(checkpoint, two_source_questions, tmp_path / "eval", "--methods", "direct",
                                "--generator", "transformers"))


@pytest.mark.slow
def test_eval_through_the_real_vllm_server_checks_the_served_model(vllm_server, two_source_questions, retriever_url,
                                                                   tmp_path, tiny_model_dir):
    """The traces the server generates for searchr1-eval (every method, no special tokens in an answer) are checked on
    the installed wheel's run of the same command (tests/test_installed_wheel.py): one pass of the CPU server's
    generation for both, here the check that comes before any question."""
    refused = rf"serves .*Qwen2.5-Coder-0.5B-Instruct'?, not checkpoint .*{tiny_model_dir.name}"
    with pytest.raises(ValueError, match=refused):
        eval_cli.evaluate(*eval_cli_configs(str(tiny_model_dir), two_source_questions, tmp_path / "other",
                                            vllm_server.base_url, retriever_url))


def eval_cli_configs(checkpoint, data, out, generator_url, retriever_url):
    config = eval_cli.EvalConfig(checkpoints=[checkpoint], data=[data], num_samples=2, output_dir=str(out),
                                 vllm_server_base_url=[generator_url], max_concurrency=8)
    return config, eval_cli.PolicyConfig(search_url=retriever_url, restate_question=True, max_turns=2,
                                         bare_json_tool_calls=True, max_tokens_per_turn=32)


def eval_offline(*argv: str) -> None:
    """scripts/eval_offline.py run in this process with ``argv``."""
    with mock.patch.object(sys, "argv", ["eval_offline.py", *argv]):
        script("eval_offline").main()


@pytest.mark.slow  # builds an index and starts the real retriever
def test_eval_offline_with_in_process_generation_starts_its_retriever_and_no_vllm(tiny_model_dir, tmp_path, capfd):
    from searchr1_trl.serving.processes import free_port

    out = tmp_path / "eval"
    eval_offline("--checkpoints", str(tiny_model_dir), "--num_samples", "2", "--distractors", "10", "--methods",
                 "direct", "rag", "--generator", "transformers", "--retriever_port", str(free_port()),
                 "--output_dir", str(out))
    assert "build_index" in capfd.readouterr().err  # the index was built: the rerun below must not build it again
    table = (out / eval_cli.RESULTS_MD).read_text()
    assert "| direct |" in table and "| rag |" in table and "| agent |" not in table
    command = (out / "command.txt").read_text()
    assert "--generator transformers" in command and "--vllm_server_base_url" not in command
    assert not (out / "vllm.log").exists()
    assert len((out / "traces.jsonl").read_text().splitlines()) == 4  # 2 questions x 2 methods

    # the same questions again on the index built above: nothing embedded; the same sample's corpus, the same table
    again = tmp_path / "again"
    eval_offline("--checkpoints", str(tiny_model_dir), "--num_samples", "2", "--distractors", "10", "--methods",
                 "direct", "rag", "--generator", "transformers", "--retriever_port", str(free_port()),
                 "--index_path", str(out / "data" / "index.faiss"), "--output_dir", str(again))
    assert "build_index" not in capfd.readouterr().err and not (again / "data" / "index.faiss").exists()
    assert (again / eval_cli.RESULTS_MD).read_text() == table
    # an index of another corpus (a slice with other distractors) is refused before any question, naming why
    with pytest.raises(RuntimeError, match=r"^retrieval server exited with .*corpus[^\n]*$"):  # one line, the why
        eval_offline("--checkpoints", str(tiny_model_dir), "--num_samples", "2", "--distractors", "5", "--methods",
                     "direct", "--generator", "transformers", "--retriever_port", str(free_port()),
                     "--index_path", str(out / "data" / "index.faiss"), "--output_dir", str(tmp_path / "other"))
    assert not (tmp_path / "other" / "traces.jsonl").exists()


class FaultyRetrieverProxy(BaseHTTPRequestHandler):
    """A fault on purpose: forwards to the real retriever (``server.upstream``), but answers /retrieve with
    ``server.status`` (500: an outage; 422: a server that cannot search) when a query is in ``server.failing``
    (every query when it is None)."""

    def do_GET(self):
        self._answer(httpx.get(self.server.upstream.rsplit("/", 1)[0] + self.path))

    def do_POST(self):
        body = self.rfile.read(int(self.headers["Content-Length"]))
        failing = self.server.failing
        if failing is None or failing & set(json.loads(body)["queries"]):
            self._answer(httpx.Response(self.server.status, json={"detail": "queries[0]: cannot be searched"}))
        else:
            self._answer(httpx.post(self.server.upstream, content=body, headers={"content-type": "application/json"},
                                    timeout=60))

    def _answer(self, response: httpx.Response) -> None:
        self.send_response(response.status_code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(response.content)))
        self.end_headers()
        self.wfile.write(response.content)

    def log_message(self, *args):
        pass


@pytest.fixture
def faulty_retriever(retriever_url):
    server = ThreadingHTTPServer(("127.0.0.1", free_port()), FaultyRetrieverProxy)
    server.upstream, server.failing, server.status = retriever_url, set(), 500
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()


def test_eval_stops_in_one_line_before_any_question_when_the_retriever_is_down(tiny_model_dir, two_source_questions,
                                                                               tmp_path):
    closed = f"http://127.0.0.1:{free_port()}/retrieve"

    with pytest.raises(SystemExit, match="^" + re.escape(f"error: retrieval server not reachable at {closed} ")):
        eval_cli.main(eval_args(tiny_model_dir, two_source_questions, tmp_path, "--num_samples", "1", "--methods",
                                "rag", "--generator", "transformers", "--search_url", closed,
                                "--search_max_retries", "0"))
    assert (tmp_path / "traces.jsonl").read_text() == ""  # not one question asked


def test_eval_stops_in_one_line_when_the_retriever_is_up_but_cannot_search(tiny_model_dir, two_source_questions,
                                                                           faulty_retriever, tmp_path):
    faulty_retriever.failing, faulty_retriever.status = None, 422  # every query, as an encoder of another width
    url = f"http://127.0.0.1:{faulty_retriever.server_port}/retrieve"

    with pytest.raises(SystemExit, match="^" + re.escape(
            f"error: the retrieval server at {url} cannot search: a probe query got 422")):
        eval_cli.main(eval_args(tiny_model_dir, two_source_questions, tmp_path, "--num_samples", "1", "--methods",
                                "agent", "--generator", "transformers", "--search_url", url))
    assert (tmp_path / "traces.jsonl").read_text() == ""  # not one question asked


def test_eval_checks_every_checkpoints_generator_before_the_first_question(tiny_model_dir, two_source_questions,
                                                                           tmp_path):
    missing = tmp_path / "no-such-checkpoint"

    with pytest.raises(SystemExit, match="^" + re.escape(f"error: checkpoint '{missing}' does not exist; expected a "
                                                         "model folder")):
        eval_cli.main(["--checkpoints", str(tiny_model_dir), str(missing), "--data", two_source_questions,
                       "--output_dir", str(tmp_path / "eval"), "--methods", "direct", "--num_samples", "1",
                       "--generator", "transformers"])
    assert (tmp_path / "eval" / "traces.jsonl").read_text() == ""  # not one question asked


def test_traces_whose_search_failed_are_counted_not_scored_and_a_rerun_generates_them(tiny_model_dir,
                                                                                      two_source_questions,
                                                                                      faulty_retriever, tmp_path):
    config = eval_cli.EvalConfig(checkpoints=[str(tiny_model_dir)], data=[two_source_questions], num_samples=2)
    questions = [sample.question for _, sample in eval_cli.load_questions(config)]
    faulty_retriever.failing = set(questions[:3])  # an outage during the first three searches
    url = f"http://127.0.0.1:{faulty_retriever.server_port}/retrieve"
    args = eval_args(tiny_model_dir, two_source_questions, tmp_path, "--num_samples", "2", "--methods", "rag",
                     "--generator", "transformers", "--search_url", url, "--search_max_retries", "0",
                     "--max_concurrency", "1")

    with pytest.raises(SystemExit, match=r"^error: 3 traces have a failed search"):
        eval_cli.main(args)

    [row] = json.loads((tmp_path / "results.json").read_text())["results"]
    assert (row["search_failed"], row["num_samples"], row["status"]["error_search"]) == (3, 4, 0.75)
    assert (tmp_path / "results.md").read_text().splitlines()[2].endswith("| 3 |")
    first = [json.loads(line) for line in (tmp_path / "traces.jsonl").read_text().splitlines()]
    failed = [t for t in first if t["status"] == "error_search"]
    assert sorted(t["question"] for t in failed) == sorted(questions[:3]) and not any(t["em"] for t in failed)

    faulty_retriever.failing = set()  # the retriever serves again
    eval_cli.main(args)

    traces = [json.loads(line) for line in (tmp_path / "traces.jsonl").read_text().splitlines()]
    assert len(traces) == 4 + 3  # the three failed traces generated again, appended
    assert all(t["status"] != "error_search" and t["searches"][0]["titles"] for t in traces[4:])
    [row] = json.loads((tmp_path / "results.json").read_text())["results"]
    assert (row["search_failed"], row["num_samples"]) == (0, 4)
