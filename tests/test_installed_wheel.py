"""The console scripts from a fresh ``pip install`` of the built wheel: searchr1-train (recipes shipped inside it),
searchr1-eval and searchr1-ask against the real vLLM server and the real retriever.

The fresh venv reuses this environment's third-party packages through a ``.pth`` line (they take minutes to install
on CPU); the package itself comes only from the wheel, run from a folder outside the repository.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    """A fresh venv holding the wheel of this checkout, installed by pip."""
    work = tmp_path_factory.mktemp("wheel")
    # Built from a copy, so no build/ folder left by an earlier build can slip stale files into the wheel.
    source = work / "source"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".git", "build", "*.egg-info", ".venv", "runs",
                                                                "docs", "__pycache__", ".pytest_cache"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w",
                    str(work / "dist"), str(source)], check=True)
    [wheel] = list((work / "dist").glob("searchr1_trl-*.whl"))
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(work / "venv")], check=True)
    python = work / "venv" / "bin" / "python"
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    Path(site, "reused_packages.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    # --ignore-installed: this environment's editable install of the package is visible through the .pth line.
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet", "--no-deps",
                    "--ignore-installed", str(wheel)], check=True)
    return work / "venv"


def run(venv: Path, *command: str, check: bool = True, env: dict | None = None,
        **kwargs) -> subprocess.CompletedProcess:
    """A console script of the venv, run outside the repository with nothing of the checkout on the path."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | (env or {})
    done = subprocess.run([str(venv / "bin" / command[0]), *command[1:]], cwd=venv.parent, env=env, check=False,
                          capture_output=True, text=True, **kwargs)
    if check and done.returncode:
        raise AssertionError(f"{command[0]} exited {done.returncode}:\n{done.stderr[-3000:]}")
    return done


def test_the_package_and_its_recipes_come_from_the_wheel(venv):
    found = run(venv, "python", "-c", "import searchr1_trl.training.loading as r; print(r.__file__); print(r.CONFIGS)")
    module, recipes = found.stdout.split()
    assert module.startswith(str(venv)) and recipes.startswith(str(venv)) and recipes.endswith("recipes")
    assert (Path(recipes) / "qwen3_8b.yaml").is_file()
    # searchr1-launch finds a recipe's accelerate config in the wheel too
    assert (Path(recipes).parent / "accelerate_configs" / "zero3.yaml").is_file()


def test_searchr1_train_finds_a_shipped_recipe_and_checks_its_plan_first(venv):
    stopped = run(venv, "searchr1-train", "--config", "qwen3_8b", check=False, env={"CUDA_VISIBLE_DEVICES": ""})
    assert stopped.returncode == 1
    assert stopped.stderr.strip().splitlines()[-1].startswith("error: recipe qwen3_8b needs CUDA GPUs")


def test_searchr1_train_trains_from_the_installed_package(venv, tiny_model_dir, questions_file, retriever_url):
    out = venv.parent / "train"
    # --use_peft false: the recipe's LoRA targets layers 16-23 of the 24-layer 0.5B, the tiny model has 2.
    # --gradient_accumulation_steps 2: 2 rollouts, not the recipe's 4 (each costs seconds in TRL's LM head on CPU).
    run(venv, "searchr1-train", "--config", "offline", "--model_name_or_path", str(tiny_model_dir),
        "--use_peft", "false", "--gradient_accumulation_steps", "2", "--generator", "transformers",
        "--train_data_path", questions_file,
        "--eval_data_path", questions_file,
        "--eval_num_samples", "2", "--eval_data_source", "squad", "--search_url", retriever_url, "--max_steps", "1",
        "--max_tokens_per_turn", "8", "--output_dir", str(out), "--report_to", "none", "--save_strategy", "no")
    assert (out / "model.safetensors").is_file()
    assert "- recipe: `offline`" in (out / "README.md").read_text()
    assert "Reward (training rollouts)" in (out / "report.html").read_text()  # the trace report, from the wheel


def test_searchr1_eval_and_ask_run_from_the_installed_package(venv, offline_assets, vllm_server, retriever_url,
                                                              two_source_questions):
    """The eval through the real vLLM server is also test_eval_cli's: every method's row, in order, and answers
    without the template's special tokens (one pass of the CPU server's generation for both). The three commands run
    side by side, as clients of one server do: its CPU engine decodes their requests in the same batches. One passage a
    search and one question a source: the CPU server reads a passage at about 2 s, and what these commands print does
    not depend on how many (the table's columns per source and the trace count per method are checked on 2 questions a
    source by test_eval_cli's in-process run)."""
    out = venv.parent / "eval"
    common = ["--search_url", retriever_url, "--topk", "1", "--restate_question", "true", "--bare_json_tool_calls",
              "true", "--max_turns", "2", "--max_tokens_per_turn", "32"]
    with concurrent.futures.ThreadPoolExecutor(max_workers=3) as pool:
        evaluating = pool.submit(run, venv, "searchr1-eval", "--checkpoints", offline_assets.model, "--data",
                                 two_source_questions, "--num_samples", "1", "--vllm_server_base_url",
                                 vllm_server.base_url, "--output_dir", str(out), *common)
        asking = pool.submit(run, venv, "searchr1-ask", "--checkpoint", offline_assets.model, "--question",
                             "Which NFL team represented the AFC at Super Bowl 50?", "--json", "--vllm_server_base_url",
                             vllm_server.base_url, *common)
        asking_text = pool.submit(run, venv, "searchr1-ask", "--checkpoint", offline_assets.model,
                                  "--vllm_server_base_url", vllm_server.base_url, *common,
                                  input="Where did Super Bowl 50 take place?\n")
    finished, asked, text = evaluating.result(), asking.result(), asking_text.result()

    assert "| direct |" in finished.stdout and "| rag |" in finished.stdout and "| agent |" in finished.stdout
    rows = json.loads((out / "results.json").read_text())["results"]
    assert [row["method"] for row in rows] == ["direct", "rag", "agent"]
    traces = [json.loads(line) for line in (out / "traces.jsonl").read_text().splitlines()]
    assert len(traces) == 3 * 2 * 1  # methods x sources x questions
    specials = ("<|im_end|>", "<|endoftext|>", "<|im_start|>")
    assert not any(s in (t["answer"] or "") for t in traces for s in specials)
    assert "Trace report: eval" in (out / "report.html").read_text()

    answer = json.loads(asked.stdout)
    assert set(answer) >= {"question", "answer", "searches", "status", "messages"}
    assert all(set(search) == {"query", "titles", "failed"} for search in answer["searches"])
    assert text.stdout.startswith("question: Where did Super Bowl 50 take place?\n") and "\nanswer: " in text.stdout
