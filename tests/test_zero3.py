"""The trainer under DeepSpeed ZeRO-3 (accelerate_configs/zero3.yaml), on CPU: DeepSpeed's CPU accelerator runs the
engine, the sharded parameters and their gathering hooks in one process, so the path the Qwen3 recipes take is
checked here: a GRPO step through scripts/train.py with its checkpoint, and asynchronous rollouts from a vLLM server
that each step's gathered weights are pushed to. (Two processes stop at DeepSpeed's batch-size check on CPU, where
transformers counts a world size of 1.) The update against the same update without DeepSpeed, and the refusal of
compile_layers, are checked through the update benchmark: experiments/tests/test_zero3_update.py."""

import json
from pathlib import Path

import pytest
import torch
import yaml
from conftest import accelerate_launch, servable_tiny_qwen2
from safetensors.torch import load_file
from test_trainer import model_logprobs, server_logprobs
from transformers import AutoModelForCausalLM, AutoTokenizer

from searchr1_trl.serving.processes import free_port
from searchr1_trl.serving.vllm_server import VLLMServer, VLLMServerConfig


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


@pytest.mark.slow  # one GRPO step of the tiny model through accelerate + DeepSpeed, ~60 s
@pytest.mark.usefixtures("tiny_vllm_launched")  # the next test's server starts up meanwhile
def test_the_training_entry_point_takes_a_grpo_step_under_zero3_and_saves_whole_weights(tmp_path, tiny_model_dir,
                                                                                       questions_file, retriever_url):
    # `accelerate launch --config_file accelerate_configs/zero3.yaml scripts/train.py --config ...`, as the Qwen3
    # recipes run: rollouts from the ZeRO-3 model gathered for in-process generation, searches on the real retriever
    config = train_recipe(tmp_path, tiny_model_dir, questions_file, retriever_url, max_steps=1,
                          generator="transformers")
    run = accelerate_launch("zero3.yaml", "scripts/train.py", "--config", str(config))
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
def tiny_vllm_launched(served_tiny_model_dir, tmp_path_factory):
    """A real `trl vllm-serve` on CPU serving that model (~2 GB, ~20 s to start; the 0.5B under ZeRO-3 would not fit
    the suite's memory beside its own server), launched without waiting: the ZeRO-3 launch of the test that runs
    first starts up meanwhile, both mostly single-threaded imports."""
    log = tmp_path_factory.mktemp("tiny-vllm") / "server.log"
    config = VLLMServerConfig.for_this_machine(str(served_tiny_model_dir), port=free_port(), max_model_len=4096,
                                               log_file=str(log), startup_timeout_s=600, cpu_kv_cache_gib=0.1)
    server = VLLMServer(config).launch()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def tiny_vllm_server(tiny_vllm_launched):
    return tiny_vllm_launched.wait_until_healthy()


@pytest.mark.slow  # a vLLM server and two asynchronous GRPO steps through accelerate + DeepSpeed, ~50 s
def test_async_rollouts_under_zero3_train_on_a_vllm_server_that_each_push_gives_the_gathered_weights(
        tmp_path, served_tiny_model_dir, tiny_vllm_server, questions_file, retriever_url):
    # weight_sync reload, the default: ZeRO-3 holds each parameter as a shard, and only the DeepSpeed engine can
    # gather them whole for the push. Weight decay moves every weight at every step, rewards or not.
    config = train_recipe(tmp_path, served_tiny_model_dir, questions_file, retriever_url, max_steps=2,
                          generator="vllm", vllm_server_base_url=tiny_vllm_server.base_url, weight_sync="reload",
                          async_rollouts=True, max_staleness=1, learning_rate=0.05, weight_decay=1.0)
    run = accelerate_launch("zero3.yaml", "scripts/train.py", "--config", str(config))
    assert run.returncode == 0, run.stderr[-3000:]
    state = json.loads((tmp_path / "run" / "checkpoint-2" / "trainer_state.json").read_text())
    steps = [entry for entry in state["log_history"] if "async/staleness" in entry]
    # each step after the first trains on rollouts sampled one version earlier; the push before step 2 is timed
    assert [entry["async/staleness"] for entry in steps] == [0, 1]
    assert ["weight_sync/time_s" in entry for entry in steps] == [False, True]

    # The server serves the weights of the last push (before step 2's rollouts: step 1's), not the start's
    probe = AutoTokenizer.from_pretrained(served_tiny_model_dir).apply_chat_template(
        [{"role": "user", "content": "Who wrote Hamlet?"}, {"role": "assistant", "content": "William Shakespeare"}],
        tokenize=True, return_dict=True)["input_ids"]
    served = server_logprobs(tiny_vllm_server.base_url, str(served_tiny_model_dir), probe)

    def gap(folder: Path) -> float:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        return (served - model_logprobs(model, probe)).abs().max().item()

    tolerance = 1e-4  # nats per token; measured 1e-6 (fp32 server, fp32 forward of the same bf16 weights)
    assert gap(tmp_path / "run" / "checkpoint-1") < tolerance
    assert gap(served_tiny_model_dir) > 100 * tolerance
    assert gap(tmp_path / "run" / "checkpoint-2") > 100 * tolerance
