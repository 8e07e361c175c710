"""The trainer under DeepSpeed ZeRO-3 (accelerate_configs/zero3.yaml), on CPU: DeepSpeed's CPU accelerator runs the
engine, the sharded parameters and their gathering hooks in one process, so the path the Qwen3 recipes take is
checked here: the update against the same update without DeepSpeed (benchmarks/zero3_update.py, one fixed rollout
batch), the refusal of compile_layers, and a GRPO step through scripts/train.py with its checkpoint. (Two processes
stop at DeepSpeed's batch-size check on CPU, where transformers counts a world size of 1.)"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[1]


def launch(config: str, *command: str) -> subprocess.CompletedProcess:
    """``accelerate launch`` of ``command`` under ``accelerate_configs/<config>``, one CPU process, no mixed
    precision: DeepSpeed's bf16 setting must match the trainer's, which is off on CPU."""
    return subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                           str(REPO / "accelerate_configs" / config), "--num_processes", "1", "--mixed_precision", "no",
                           *(["--cpu"] if config == "cpu.yaml" else []), *command],
                          cwd=REPO, capture_output=True, text=True, timeout=900)


def update(tmp_path: Path, model: Path, config: str, *flags: str) -> subprocess.CompletedProcess:
    out = tmp_path / f"{config}.jsonl"
    out.unlink(missing_ok=True)
    return launch(config, "-m", "benchmarks.zero3_update", "--model", str(model), "--per_device_batch", "4", "--seq",
                  "64", "--prompt", "16", "--steps", "2", "--out", str(out), *flags)


@pytest.mark.slow  # two launches, ~40 s
def test_a_zero3_step_computes_the_gradients_of_the_step_without_deepspeed(tmp_path, tiny_model_dir):
    results = {}
    for config in ("zero3.yaml", "cpu.yaml"):
        run = update(tmp_path, tiny_model_dir, config)
        assert run.returncode == 0, run.stderr[-3000:]
        results[config] = json.loads((tmp_path / f"{config}.jsonl").read_text().splitlines()[-1])
    zero3, plain = results["zero3.yaml"], results["cpu.yaml"]
    assert (zero3["measure"], plain["measure"]) == ("zero3_update", "update_no_deepspeed")
    assert zero3["grad_norms"][0] > 0
    # the first step's loss is -mean(advantage) whatever the weights; its gradient is what ZeRO-3 could get wrong (a
    # lost shard, a doubled scale: far off); the bf16 model's norm is summed in bf16 without DeepSpeed, in fp32 with
    # it (0.3691 vs 0.3681 here), hence bf16's ~0.4% step
    assert zero3["grad_norms"][0] == pytest.approx(plain["grad_norms"][0], rel=1e-2)
    assert zero3["losses"] == pytest.approx(plain["losses"], rel=1e-3)


@pytest.mark.slow  # a DeepSpeed launch, ~25 s
def test_compile_layers_under_zero3_is_refused_with_the_reason(tmp_path, tiny_model_dir):
    run = update(tmp_path, tiny_model_dir, "zero3.yaml", "--compile_layers")
    assert run.returncode != 0
    assert "compile_layers=True under DeepSpeed ZeRO-3" in run.stderr


@pytest.mark.slow  # one GRPO step of the tiny model through accelerate + DeepSpeed, ~60 s
def test_the_training_entry_point_takes_a_grpo_step_under_zero3_and_saves_whole_weights(tmp_path, tiny_model_dir,
                                                                                       questions_file, retriever_url):
    # `accelerate launch --config_file accelerate_configs/zero3.yaml scripts/train.py --config ...`, as the Qwen3
    # recipes run: rollouts from the ZeRO-3 model gathered for in-process generation, searches on the real retriever
    config = tmp_path / "recipe.yaml"
    config.write_text(yaml.safe_dump({
        "model_name_or_path": str(tiny_model_dir), "dtype": "bfloat16", "bf16": False,
        "output_dir": str(tmp_path / "run"), "train_data_path": questions_file, "eval_strategy": "no", "max_steps": 1,
        "per_device_train_batch_size": 2, "gradient_accumulation_steps": 1, "num_generations": 2, "max_turns": 2,
        "max_tokens_per_turn": 16, "max_rollout_tokens": 1024, "generator": "transformers",
        "search_url": retriever_url, "save_steps": 1, "report_to": "none", "warmup_steps": 0}))
    run = launch("zero3.yaml", "scripts/train.py", "--config", str(config))
    assert run.returncode == 0, run.stderr[-3000:]
    state = json.loads((tmp_path / "run" / "checkpoint-1" / "trainer_state.json").read_text())
    assert [entry["step"] for entry in state["log_history"] if "loss" in entry] == [1]
    # ZeRO-3 holds each parameter as an empty shard outside a gather; the checkpoint must hold the whole tensors
    saved = load_file(tmp_path / "run" / "checkpoint-1" / "model.safetensors")
    original = load_file(tiny_model_dir / "model.safetensors")
    assert {name: tuple(t.shape) for name, t in saved.items()} == {name: tuple(t.shape) for name, t in original.items()}
