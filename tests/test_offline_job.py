"""The plans of scripts/offline_job.py (searchr1-launch on the offline recipes, pointed at the job's data), checked on
CPU through --dry_run (the commands it would launch)."""

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
from conftest import script
from test_launch import flag, gpus, listening, printed

from searchr1_trl.serving.processes import free_port

ROOT = Path(__file__).resolve().parent.parent


def dry_run(*flags: str) -> tuple[int | str, str, str]:
    """(exit code or message, stdout, stderr) of ``offline_job.py --dry_run *flags``, run in this process: a fresh
    interpreter took 4 s a plan to import torch again (one test runs the script as a command)."""
    out, err, code = io.StringIO(), io.StringIO(), 0
    with mock.patch.object(sys, "argv", ["offline_job.py", "--dry_run", *flags]), mock.patch.dict(os.environ), \
            contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            script("offline_job").main()
        except SystemExit as exit_:
            code = exit_.code
    return code, out.getvalue(), err.getvalue()


def plan(*flags: str) -> dict[str, tuple[dict[str, str], list[str]]]:
    code, out, err = dry_run(*flags)
    assert code == 0, (code, err)
    return printed(out)[0]


def test_two_gpu_plan_puts_generator_trainer_and_retriever_on_their_gpus_and_syncs_over_nccl(offline_assets):
    commands = plan("--config", "offline_gpu", "--corpus", "full", "--generator", "vllm", "--weight_sync", "nccl",
                    "--generator_gpus", "0", "--trainer_gpus", "1", "--retriever_gpus", "1")
    (generator_env, generator), (trainer_env, trainer) = commands["generator"], commands["trainer"]
    assert gpus(generator_env) == {0}
    assert generator[2:4] == ["trl.cli.main", "vllm-serve"]
    assert flag(generator, "--gpu_memory_utilization") == "0.3"
    assert gpus(trainer_env) == {1}
    assert trainer[1:3] == ["-m", "accelerate.commands.launch"]
    assert flag(trainer, "--config_file").endswith("single_gpu.yaml")
    args = trainer[trainer.index("searchr1_trl.cli.train") + 1:]
    assert flag(args, "--generator") == "vllm" and flag(args, "--weight_sync") == "nccl"
    assert (flag(generator, "--host"), flag(generator, "--port")) == ("127.0.0.1", "8001")  # the recipe's URL
    assert flag(args, "--retriever_index_path") == flag(commands["retriever"][1], "--index_path")
    assert gpus(commands["retriever"][0]) == {1}
    assert commands["retriever"][1][-3:] == ["--faiss_gpu", "--gpu_backend", "torch"]


def test_one_cpu_plan_pushes_weights_through_a_tmpfs_folder_and_passes_extra_flags_to_the_trainer(offline_assets):
    commands = plan("--config", "offline", "--max_steps", "7")
    env, args = commands["trainer"]
    assert args[:3] == [sys.executable, "-m", "searchr1_trl.cli.train"] and gpus(env) == set()
    assert flag(args, "--weight_sync_dir").startswith("/dev/shm/")
    assert flag(args, "--output_dir") == str(ROOT / "runs" / "offline")  # the recipe's, from the repository
    assert args[-2:] == ["--max_steps", "7"]  # after the job's own flags, so the user's value wins
    assert gpus(commands["retriever"][0]) == set() and "--faiss_gpu" not in commands["retriever"][1]


def test_a_recipe_without_vllm_starts_no_generator_server(offline_assets):
    commands = plan("--config", "offline_gpu", "--generator", "transformers")
    assert "generator" not in commands
    assert flag(commands["trainer"][1], "--generator") == "transformers"


def test_an_ipc_plan_serves_on_the_trainers_gpu_with_the_ipc_loader_and_refuses_two_gpus(offline_assets):
    commands = plan("--config", "offline_gpu", "--corpus", "full", "--generator", "vllm", "--weight_sync", "ipc")
    generator = commands["generator"][1]
    assert flag(generator, "--worker-extension-cls") == "searchr1_trl.serving.weight_sync.IpcWeightLoader"
    assert gpus(commands["generator"][0]) == gpus(commands["trainer"][0]) == {0}
    default = plan("--config", "offline_gpu", "--generator", "vllm")  # the recipe's own push
    assert "--worker-extension-cls" in default["generator"][1]
    assert "--weight_sync" not in default["trainer"][1]  # the recipe says ipc; the job adds nothing
    reload = plan("--config", "offline_gpu", "--generator", "vllm", "--weight_sync", "reload")["generator"][1]
    assert "--worker-extension-cls" not in reload
    # the script itself, as a command
    refused = subprocess.run([sys.executable, str(ROOT / "scripts" / "offline_job.py"), "--dry_run", "--config",
                              "offline_gpu", "--generator", "vllm", "--weight_sync", "ipc", "--generator_gpus", "0",
                              "--trainer_gpus", "1"], capture_output=True, text=True, cwd=ROOT)
    assert refused.returncode == 1
    assert ("error: weight_sync=ipc pushes to a server on the trainer's own GPU: got generator_gpus [0] on machine 0 "
            "and trainer_gpus [1]") in refused.stderr
    # the recipe's default push too: two GPUs need --weight_sync nccl
    code, _, _ = dry_run("--config", "offline_gpu", "--generator", "vllm", "--trainer_gpus", "1")
    assert "weight_sync=ipc pushes to a server on the trainer's own GPU" in str(code)


def test_another_model_is_served_and_trained_through_model_or_model_name_or_path(offline_assets):
    for flags in (("--model", "/models/Qwen2.5-Coder-1.5B-Instruct"),
                  ("--model_name_or_path", "/models/Qwen2.5-Coder-1.5B-Instruct")):
        commands = plan("--config", "offline_gpu", "--generator", "vllm", *flags)
        assert flag(commands["generator"][1], "--model") == "/models/Qwen2.5-Coder-1.5B-Instruct"
        args = commands["trainer"][1]
        assert [args[i + 1] for i, f in enumerate(args) if f == "--model_name_or_path"][-1] == (
            "/models/Qwen2.5-Coder-1.5B-Instruct")


def test_the_summary_splits_a_step_into_push_rollouts_scoring_and_update():
    step = {"step_time": 6.0, "rollout/time_s": 2.0, "weight_sync/time_s": 0.5, "generate_and_score/time_s": 3.0,
            "rollout/generated_tokens": 400.0}
    history = [step, {**step, "step_time": 8.0, "generate_and_score/time_s": 4.0}, {"eval_runtime": 5.0}]
    assert script("offline_job").time_split(history, rollouts_per_step=64) == {
        "step": 7.0, "rollout": 2.0, "weight_sync": 0.5, "scoring": 1.0, "policy_update": 3.5,
        "evaluation_each": 5.0, "rollout_tokens_per_s": 200.0, "rollouts_per_s": 32.0}


def test_the_summary_gives_the_fixed_costs_and_the_report_em_of_the_model_the_run_saved():
    # report_at ends, a run the guard stopped at step 20 that ended on step 10: the report sample at step 0, after the
    # step-20 validation that decided the stop, and on the step-10 model after training
    history = [{"step": 0, "eval_em": 0.40, "report_em": 0.38, "eval_runtime": 9.0},
               {"step": 1, "time/startup_s": 41.26, "time/warm_start_s": 20.04, "step_time": 2.0},
               {"step": 10, "eval_em": 0.45, "eval_runtime": 5.0},
               {"step": 20, "eval_em": 0.30, "eval_runtime": 5.0},
               {"step": 20, "report_em": 0.29, "report_runtime": 4.0},
               {"step": 20, "train_runtime": 100.0},
               {"step": 20, "saved_report_em": 0.44, "saved_report_runtime": 4.5, "saved_report_step": 10}]
    job = script("offline_job")
    assert job.fixed_costs(history) == {"startup_s": 41.3, "warm_start_s": 20.0, "first_validation_s": 9.0,
                                        "validations": 3, "validation_s": 27.5, "saved_report_s": 4.5}
    validated = job.validations(history, best_step=10)
    assert validated["report_em_by_step"] == {0: 0.38, 10: 0.44, 20: 0.29}
    assert (validated["saved_step"], validated["saved_report_em"]) == (10, 0.44)
    assert validated["evals"][1] == {"step": 10, "eval_em": 0.45, "eval_runtime": 5.0, "report_em": 0.44,
                                     "report_runtime": 4.5}
    assert job.validations(history[:4], best_step=None)["saved_step"] == 20, "without a choice: the last validated"


@pytest.mark.slow
def test_the_cpu_job_trains_through_the_launcher_and_leaves_no_server_behind(offline_assets, tmp_path):
    retriever_port, generator_port = free_port(), free_port()
    out = tmp_path / "job"
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "offline_job.py"), "--output_dir", str(out), "--train_articles", "1",
         "--test_articles", "1", "--distractors", "5", "--max_steps", "1", "--eval_num_samples", "1",
         "--gradient_accumulation_steps", "2", "--report_to", "none", "--trace_report", "false",
         # one short turn a rollout: the job's processes and phases are the same, each generation a few seconds
         "--max_turns", "1", "--max_tokens_per_turn", "8",
         "--search_url", f"http://127.0.0.1:{retriever_port}/retrieve",
         "--vllm_server_base_url", f"http://127.0.0.1:{generator_port}"],
        cwd=ROOT, capture_output=True, text=True, timeout=1500)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 1 and list(summary["eval_em_by_step"]) == ["0", "1"]  # EM before and after (JSON keys)
    costs = summary["fixed_costs"]
    assert costs["validations"] == 2 and costs["validation_s"] > 0 and costs["warm_start_s"] is None
    assert costs["startup_s"] > costs["first_validation_s"], "the start-up holds the step-0 validation"
    assert (out / "retriever.log").stat().st_size and (out / "vllm.log").stat().st_size
    assert not listening(retriever_port) and not listening(generator_port)
