"""The trainer under DeepSpeed ZeRO-3 (accelerate_configs/zero3.yaml), on CPU: DeepSpeed's CPU accelerator runs the
engine, the sharded parameters and their gathering hooks in one process, so the path the Qwen3 recipes take is
checked here: the update against the same update without DeepSpeed (benchmarks/zero3_update.py, one fixed rollout
batch), the refusal of compile_layers, a GRPO step through scripts/train.py with its checkpoint, and asynchronous
rollouts from a vLLM server that each step's gathered weights are pushed to. (Two processes stop at DeepSpeed's
batch-size check on CPU, where transformers counts a world size of 1.)"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file
from test_trainer import model_logprobs, server_logprobs
from transformers import AutoModelForCausalLM, AutoTokenizer

from benchmarks import zero3_update
from benchmarks.probes.tied_head_reload import servable_tiny_qwen2
from searchr1_trl.serving.processes import free_port
from searchr1_trl.serving.vllm_server import VLLMServer, VLLMServerConfig

REPO = Path(__file__).resolve().parents[1]


def launch(config: str, *command: str) -> subprocess.CompletedProcess:
    """``accelerate launch`` of ``command`` under ``accelerate_configs/<config>``, one CPU process, no mixed
    precision: DeepSpeed's bf16 setting must match the trainer's, which is off on CPU."""
    return subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                           str(REPO / "accelerate_configs" / config), "--num_processes", "1", "--mixed_precision", "no",
                           *command],
                          cwd=REPO, capture_output=True, text=True, timeout=900)


UPDATE_FLAGS = ("--per_device_batch", "4", "--seq", "64", "--prompt", "16", "--steps", "2")  # one fixed batch, 2 steps


def update(tmp_path: Path, model: Path, config: str, *flags: str) -> subprocess.CompletedProcess:
    out = tmp_path / f"{config}.jsonl"
    out.unlink(missing_ok=True)
    return launch(config, "-m", "benchmarks.zero3_update", *UPDATE_FLAGS, "--model", str(model), "--out", str(out),
                  *flags)


def train_recipe(tmp_path: Path, model: Path, questions_file: str, search_url: str, **fields) -> Path:
    """A scripts/train.py recipe for a tiny model in ``tmp_path``: 2 rollouts a step of up to 2 turns of 16 tokens,
    no validation, a checkpoint every step in ``tmp_path/run``; ``fields`` add to it or override it."""
    config = tmp_path / "recipe.yaml"
    config.write_text(yaml.safe_dump({
        "model_name_or_path": str(model), "dtype": "bfloat16", "bf16": False, "output_dir": str(tmp_path / "run"),
        "train_data_path": questions_file, "eval_strategy": "no", "per_device_train_batch_size": 2,
        "gradient_accumulation_steps": 1, "num_generations": 2, "max_turns": 2, "max_tokens_per_turn": 16,
        "max_rollout_tokens": 1024, "search_url": search_url, "save_steps": 1, "report_to": "none", "warmup_steps": 0,
        **fields}))
    return config


@pytest.mark.slow  # a DeepSpeed launch (the suite's first builds DeepSpeed's shm op, ~45 s) and the same in-process
def test_a_zero3_step_computes_the_gradients_of_the_step_without_deepspeed(tmp_path, tiny_model_dir):
    run = update(tmp_path, tiny_model_dir, "zero3.yaml")
    assert run.returncode == 0, run.stderr[-3000:]
    zero3 = json.loads((tmp_path / "zero3.yaml.jsonl").read_text().splitlines()[-1])
    # without DeepSpeed the same update runs in this process (a launch would only add TRL's ~10 s import)
    zero3_update.main([*UPDATE_FLAGS, "--model", str(tiny_model_dir), "--out", str(tmp_path / "plain.jsonl")])
    plain = json.loads((tmp_path / "plain.jsonl").read_text().splitlines()[-1])
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
    config = train_recipe(tmp_path, tiny_model_dir, questions_file, retriever_url, max_steps=1,
                          generator="transformers")
    run = launch("zero3.yaml", "scripts/train.py", "--config", str(config))
    assert run.returncode == 0, run.stderr[-3000:]
    state = json.loads((tmp_path / "run" / "checkpoint-1" / "trainer_state.json").read_text())
    assert [entry["step"] for entry in state["log_history"] if "loss" in entry] == [1]
    # ZeRO-3 holds each parameter as an empty shard outside a gather; the checkpoint must hold the whole tensors
    saved = load_file(tmp_path / "run" / "checkpoint-1" / "model.safetensors")
    original = load_file(tiny_model_dir / "model.safetensors")
    assert {name: tuple(t.shape) for name, t in saved.items()} == {name: tuple(t.shape) for name, t in original.items()}


@pytest.fixture(scope="module")
def served_tiny_model_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """The tiny model as a CPU vLLM server can serve it: head_dim 64 (vLLM's CPU attention has no head_dim 16 kernel)
    and an LM head of its own (on CPU vLLM prepacks a tied head's weights, and a reload that changes the embeddings
    leaves that packed copy stale: a server quirk, not the push's)."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    path = tmp_path_factory.mktemp("served-tiny-qwen2")
    servable_tiny_qwen2(tokenizer, tied=False).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tiny_vllm_server(served_tiny_model_dir, tmp_path_factory):
    """A real `trl vllm-serve` on CPU serving that model (~2 GB, ~20 s to start; the 0.5B under ZeRO-3 would not fit
    the suite's memory beside its own server)."""
    log = tmp_path_factory.mktemp("tiny-vllm") / "server.log"
    config = VLLMServerConfig.for_this_machine(str(served_tiny_model_dir), port=free_port(), max_model_len=4096,
                                               log_file=str(log), startup_timeout_s=600, cpu_kv_cache_gib=0.1)
    with VLLMServer(config) as server:
        yield server


@pytest.mark.slow  # a vLLM server and three asynchronous GRPO steps through accelerate + DeepSpeed, ~60 s
def test_async_rollouts_under_zero3_train_on_a_vllm_server_that_each_push_gives_the_gathered_weights(
        tmp_path, served_tiny_model_dir, tiny_vllm_server, questions_file, retriever_url):
    # weight_sync reload, the default: ZeRO-3 holds each parameter as a shard, and only the DeepSpeed engine can
    # gather them whole for the push. Weight decay moves every weight at every step, rewards or not.
    config = train_recipe(tmp_path, served_tiny_model_dir, questions_file, retriever_url, max_steps=3,
                          generator="vllm", vllm_server_base_url=tiny_vllm_server.base_url, weight_sync="reload",
                          async_rollouts=True, max_staleness=1, learning_rate=0.05, weight_decay=1.0)
    run = launch("zero3.yaml", "scripts/train.py", "--config", str(config))
    assert run.returncode == 0, run.stderr[-3000:]
    state = json.loads((tmp_path / "run" / "checkpoint-3" / "trainer_state.json").read_text())
    steps = [entry for entry in state["log_history"] if "async/staleness" in entry]
    # each step trains on rollouts sampled one version earlier; the pushes before steps 2 and 3 are timed
    assert [entry["async/staleness"] for entry in steps] == [0, 1, 1]
    assert ["weight_sync/time_s" in entry for entry in steps] == [False, True, True]

    # The server serves the weights of the last push (before step 3's rollouts: step 2's), not the start's
    probe = AutoTokenizer.from_pretrained(served_tiny_model_dir).apply_chat_template(
        [{"role": "user", "content": "Who wrote Hamlet?"}, {"role": "assistant", "content": "William Shakespeare"}],
        tokenize=True, return_dict=True)["input_ids"]
    served = server_logprobs(tiny_vllm_server.base_url, str(served_tiny_model_dir), probe)

    def gap(folder: Path) -> float:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        return (served - model_logprobs(model, probe)).abs().max().item()

    tolerance = 1e-4  # nats per token; measured 1e-6 (fp32 server, fp32 forward of the same bf16 weights)
    assert gap(tmp_path / "run" / "checkpoint-2") < tolerance
    assert gap(served_tiny_model_dir) > 100 * tolerance  # measured 0.06
    assert gap(tmp_path / "run" / "checkpoint-3") > 100 * tolerance  # measured 0.03
