"""The GPU plans of scripts/offline_job.py, checked on CPU through --dry_run (the commands it would launch)."""

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path
from unittest import mock

from conftest import script

ROOT = Path(__file__).resolve().parent.parent


def dry_run(*flags: str) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of ``offline_job.py --dry_run *flags``, run in this process: a fresh interpreter
    took 4 s a plan to import torch again (one test runs the script as a command)."""
    out, err, code = io.StringIO(), io.StringIO(), 0
    with mock.patch.object(sys, "argv", ["offline_job.py", "--dry_run", *flags]), mock.patch.dict(os.environ), \
            contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            script("offline_job").main()
        except SystemExit as exit_:
            code = exit_.code
    return code, out.getvalue(), err.getvalue()


def plan(*flags: str) -> dict:
    code, out, err = dry_run(*flags)
    assert code == 0, err
    return json.loads(out)


def test_two_gpu_plan_puts_generator_trainer_and_retriever_on_their_gpus_and_syncs_over_nccl(offline_assets):
    commands = plan("--config", "offline_gpu", "--corpus", "full", "--generator", "vllm", "--weight_sync", "nccl",
                    "--generator_gpu", "0", "--trainer_gpu", "1", "--retriever_gpu", "1", "--launcher", "accelerate")
    generator, trainer, retriever = commands["generator"], commands["trainer"], commands["retriever"]
    assert generator["env"] == {"CUDA_VISIBLE_DEVICES": "0"}
    assert generator["command"][2:4] == ["trl.cli.main", "vllm-serve"]
    assert generator["command"][generator["command"].index("--gpu_memory_utilization") + 1] == "0.3"
    assert trainer["env"] == {"CUDA_VISIBLE_DEVICES": "1"}
    assert trainer["command"][1:3] == ["-m", "accelerate.commands.launch"]
    assert trainer["command"][trainer["command"].index("--config_file") + 1].endswith("single_gpu.yaml")
    args = trainer["command"][trainer["command"].index(str(ROOT / "scripts" / "train.py")) + 1:]
    assert args[args.index("--generator") + 1] == "vllm" and args[args.index("--weight_sync") + 1] == "nccl"
    assert args[args.index("--vllm_server_base_url") + 1] == "http://127.0.0.1:8001"
    assert retriever["env"] == {"CUDA_VISIBLE_DEVICES": "1"}
    assert retriever["command"][-3:] == ["--faiss_gpu", "--gpu_backend", "torch"]


def test_one_gpu_plan_pushes_weights_through_a_tmpfs_folder_and_passes_extra_flags_to_the_trainer(offline_assets):
    commands = plan("--config", "offline", "--generator_gpu", "0", "--trainer_gpu", "0", "--max_steps", "7")
    args = commands["trainer"]["command"]
    assert args[0] == sys.executable and args[1].endswith("train.py")
    assert args[args.index("--weight_sync_dir") + 1].startswith("/dev/shm/")
    assert args[-2:] == ["--max_steps", "7"]  # after the job's own flags, so the user's value wins
    assert commands["retriever"]["env"] == {} and "--faiss_gpu" not in commands["retriever"]["command"]


def test_a_recipe_without_vllm_starts_no_generator_server(offline_assets):
    commands = plan("--config", "offline_gpu", "--generator", "transformers")
    assert commands["generator"] is None
    args = commands["trainer"]["command"]
    assert args[args.index("--generator") + 1] == "transformers"


def test_an_ipc_plan_serves_on_the_trainers_gpu_with_the_ipc_loader_and_refuses_two_gpus(offline_assets):
    commands = plan("--config", "offline_gpu", "--corpus", "full", "--generator", "vllm", "--weight_sync", "ipc",
                    "--generator_gpu", "0", "--trainer_gpu", "0")
    generator = commands["generator"]["command"]
    assert generator[generator.index("--worker-extension-cls") + 1] == (
        "searchr1_trl.serving.weight_sync.IpcWeightLoader")
    args = commands["trainer"]["command"]
    assert args[args.index("--weight_sync") + 1] == "ipc"
    default = plan("--config", "offline_gpu", "--generator", "vllm")  # the recipe's own push since 2026-12-05
    assert "--worker-extension-cls" in default["generator"]["command"]
    assert "--weight_sync" not in default["trainer"]["command"]  # the recipe says ipc; the job adds nothing
    reload = plan("--config", "offline_gpu", "--generator", "vllm", "--weight_sync", "reload")["generator"]["command"]
    assert "--worker-extension-cls" not in reload
    # the script itself, as a command
    refused = subprocess.run([sys.executable, str(ROOT / "scripts" / "offline_job.py"), "--dry_run", "--config",
                              "offline_gpu", "--generator", "vllm", "--weight_sync", "ipc", "--generator_gpu", "0",
                              "--trainer_gpu", "1"], capture_output=True, text=True, cwd=ROOT)
    assert refused.returncode == 2
    assert "--weight_sync ipc pushes to a server on the trainer's own GPU; got --generator_gpu 0 and --trainer_gpu 1" \
        in refused.stderr
    # the recipe's default push too: two GPUs need --weight_sync nccl, as the recipe's two-GPU command passes
    code, _, err = dry_run("--config", "offline_gpu", "--generator", "vllm", "--generator_gpu", "0",
                           "--trainer_gpu", "1")
    assert code == 2 and "--weight_sync ipc pushes to a server on the trainer's own GPU" in err


def test_another_model_is_served_and_trained_through_model_and_refused_through_model_name_or_path(offline_assets):
    commands = plan("--config", "offline_gpu", "--generator", "vllm", "--model", "/models/Qwen2.5-Coder-1.5B-Instruct")
    assert commands["generator"]["command"][commands["generator"]["command"].index("--model") + 1] == (
        "/models/Qwen2.5-Coder-1.5B-Instruct")
    args = commands["trainer"]["command"]
    assert [args[i + 1] for i, flag in enumerate(args) if flag == "--model_name_or_path"] == [
        "/models/Qwen2.5-Coder-1.5B-Instruct"]
    code, _, err = dry_run("--config", "offline_gpu", "--model_name_or_path", "/models/Qwen2.5-Coder-1.5B-Instruct")
    assert code == 2 and "pass --model <folder>, which sets both" in err


def test_the_summary_splits_a_step_into_push_rollouts_scoring_and_update():
    step = {"step_time": 6.0, "rollout/time_s": 2.0, "weight_sync/time_s": 0.5, "generate_and_score/time_s": 3.0,
            "rollout/generated_tokens": 400.0}
    history = [step, {**step, "step_time": 8.0, "generate_and_score/time_s": 4.0}, {"eval_runtime": 5.0}]
    assert script("offline_job").time_split(history, rollouts_per_step=64) == {
        "step": 7.0, "rollout": 2.0, "weight_sync": 0.5, "scoring": 1.0, "policy_update": 3.5,
        "evaluation_each": 5.0, "rollout_tokens_per_s": 200.0, "rollouts_per_s": 32.0}
