"""Supervised warm start: scripted search -> answer traces through the real rollout engine and retriever, and a
fine-tune on the model's turns that GRPO then starts from."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM
from trl import ModelConfig

from searchr1_trl.cli.train import hand_warm_start_to_generator, train
from searchr1_trl.engine.generation import end_token_ids
from searchr1_trl.engine.rollout import RolloutConfig, RolloutStatus
from searchr1_trl.tasks.common.data import SearchR1Dataset, SearchR1DatasetConfig
from searchr1_trl.tasks.common.rubric import normalize_answer, passages_hold_gold
from searchr1_trl.tasks.common.search import SearchR1EnvConfig
from searchr1_trl.tasks.search_r1.env import SearchR1EnvFactory
from searchr1_trl.tasks.search_r1.warm_start import keep, keyword_query, scripted_traces
from searchr1_trl.training.trainer import SearchR1Config
from searchr1_trl.training.warm_start import (
    WarmStartConfig,
    fine_tuning_rows,
    search_turns_mask,
    with_second_searches_repeated,
)


def traces(tokenizer, retriever_url, questions_file, n: int, topk: int = 3, second_search: bool = False, **env):
    samples = SearchR1Dataset(SearchR1DatasetConfig(data_path=questions_file, data_source=None)).take(n)
    search = SearchR1EnvFactory(SearchR1EnvConfig(search_url=retriever_url, topk=topk, **env))

    async def run():
        try:
            return await scripted_traces(tokenizer, search, RolloutConfig(max_turns=3), samples,
                                         set(end_token_ids(tokenizer)), second_search=second_search)
        finally:
            await search.aclose()

    return samples, asyncio.run(run())


@pytest.mark.slow
def test_a_trace_searches_the_question_then_answers_with_the_gold_the_passages_hold(tokenizer, retriever_url,
                                                                                  questions_file):
    samples, rollouts = traces(tokenizer, retriever_url, questions_file, 24, restate_question=True)
    for sample, rollout in zip(samples, rollouts, strict=True):
        # The engine parsed the scripted turn as the model's own: one search of the question, then a final answer.
        assert rollout.status == RolloutStatus.DONE and rollout.num_turns == 2 and rollout.num_tool_calls == 1
        call = rollout.messages[-3]["tool_calls"][0]["function"]
        assert call["name"] == "search" and call["arguments"] == {"query": sample.question}
        assert rollout.messages[-2]["role"] == "tool" and sample.question in rollout.messages[-2]["content"]
        answer = rollout.messages[-1]["content"]
        assert answer in sample.golden_answers
        # The loss sees the two assistant turns (with their end tokens) and nothing the environment wrote.
        model_tokens = [t for t, m in zip(rollout.completion_ids, rollout.env_mask, strict=True) if m]
        text = tokenizer.decode(model_tokens)
        assert text.startswith("<tool_call>") and text.endswith(f"{answer}<|im_end|>")
        assert "Doc 1(Title:" not in text and "Doc 1(Title:" in tokenizer.decode(rollout.completion_ids)
        in_passages = f" {normalize_answer(answer)} " in f" {normalize_answer(rollout.messages[-2]['content'])} "
        assert keep(rollout) == in_passages
    kept = sum(map(keep, rollouts))
    assert 0 < kept < len(rollouts), kept  # the small corpus holds most answers, the top-3 passages not all


@pytest.mark.slow
def test_an_answer_the_passages_do_not_hold_is_not_a_trace(tokenizer, retriever_url, questions_file):
    samples, _ = traces(tokenizer, retriever_url, questions_file, 4)
    search = SearchR1EnvFactory(SearchR1EnvConfig(search_url=retriever_url, topk=3))
    invented = [replace(s, golden_answers=("Zyxwvut Qponmlk",)) for s in samples]

    async def run():
        try:
            return await scripted_traces(tokenizer, search, RolloutConfig(), invented,
                                         set(end_token_ids(tokenizer)))
        finally:
            await search.aclose()

    rollouts = asyncio.run(run())
    assert [r.messages[-1]["content"] for r in rollouts] == ["Zyxwvut Qponmlk"] * 4
    assert not any(map(keep, rollouts))


def test_the_search_turns_mask_drops_the_last_run_of_model_tokens():
    assert search_turns_mask([0, 0, 1, 1, 0, 0, 1, 1, 1]) == [0, 0, 1, 1, 0, 0, 0, 0, 0]
    assert search_turns_mask([1, 1, 0, 1, 0, 0]) == [1, 1, 0, 0, 0, 0]  # env tokens after the answer stay out
    assert search_turns_mask([0, 1, 1]) == [0, 0, 0]
    with pytest.raises(ValueError, match="answer_traces=-1: expected >= 0"):
        WarmStartConfig(num_traces=8, answer_traces=-1)


@pytest.mark.slow
def test_traces_past_answer_traces_teach_only_their_search_calls(tokenizer, retriever_url, questions_file):
    _, rollouts = traces(tokenizer, retriever_url, questions_file, 8, restate_question=True)
    kept = [r for r in rollouts if keep(r)][:3]
    assert len(kept) == 3
    full = fine_tuning_rows(kept, WarmStartConfig(num_traces=8))
    one = fine_tuning_rows(kept, WarmStartConfig(num_traces=8, answer_traces=1))
    none = fine_tuning_rows(kept, WarmStartConfig(num_traces=8, answer_traces=0))

    def taught(row) -> str:
        return tokenizer.decode([t for t, m in zip(row["input_ids"], row["assistant_masks"], strict=True) if m])

    assert [r["input_ids"] for r in one] == [r["input_ids"] for r in full] == [r["input_ids"] for r in none]
    assert one[0] == full[0]  # the first answer_traces teach the whole trace
    for trace, whole, search_only in zip(kept, full, none, strict=True):
        answer = trace.messages[-1]["content"]
        assert taught(search_only).startswith("<tool_call>") and taught(search_only).endswith("</tool_call><|im_end|>")
        assert taught(whole) == f"{taught(search_only)}{answer}<|im_end|>"
    assert one[1:] == none[1:]


def answer_nll(model_dir: Path, rollouts) -> float:
    """Mean NLL of the traces' model tokens under the model in ``model_dir``."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    total, count = 0.0, 0
    for r in rollouts:
        ids = torch.tensor([r.prompt_ids + r.completion_ids])
        with torch.no_grad():
            logprobs = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
        picked = logprobs.gather(1, ids[0, 1:, None])[:, 0][len(r.prompt_ids) - 1:]
        mask = torch.tensor(r.env_mask, dtype=torch.bool)
        total -= picked[mask].sum().item()
        count += int(mask.sum())
    return total / count


@pytest.mark.slow
def test_grpo_starts_from_the_warm_started_model(tiny_model_dir, tokenizer, retriever_url, questions_file, tmp_path):
    """bf16 weights, as the GPU recipes run: SFT and GRPO both step through fp32 masters (the fp32 recipes' warm start
    is the same path without them; a float32 case doubled this test's 100 s of CPU for no branch of its own)."""
    args = SearchR1Config(
        output_dir=str(tmp_path / "run"), use_cpu=True, bf16=False, max_steps=1, learning_rate=0.0, warmup_steps=0,
        per_device_train_batch_size=2, gradient_accumulation_steps=1, num_generations=2, max_turns=2,
        max_tokens_per_turn=8, train_data_path=questions_file, eval_data_path=questions_file,
        eval_data_source=None, eval_strategy="no", save_strategy="no", report_to="none",
        search_url=retriever_url, generator="transformers", restate_question=True, bare_json_tool_calls=True, topk=1,
        # Few, short traces one at a time: TRL's SFT loss scores every position of a trace against the 152k
        # vocabulary on CPU, 2-3 s a trace whatever the batch, and steps of one learn more per trace (8 traces x 2
        # epochs lowered the NLL by 2.2 nats in 39 s; 12 x 3 in batches of 4 by 1.3 in 80 s).
        warm_start_traces=8, warm_start_learning_rate=3e-3, warm_start_epochs=2, warm_start_batch_size=1,
        fp32_master_weights=True,
    )
    train(args, ModelConfig(model_name_or_path=str(tiny_model_dir), dtype="bfloat16"))

    history = json.loads((tmp_path / "run" / "trainer_state.json").read_text())["log_history"]
    [first_step] = [entry for entry in history if "time/startup_s" in entry]
    assert 0 < first_step["time/warm_start_s"] < first_step["time/startup_s"], "the start-up holds the warm start"
    warm = tmp_path / "run" / "warm_start"
    assert (warm / "tokenizer.json").is_file() and (warm / "generation_config.json").is_file()
    _, held_out = traces(tokenizer, retriever_url, questions_file, 8, topk=1, restate_question=True)
    assert answer_nll(warm, held_out) < answer_nll(tiny_model_dir, held_out) - 1.0
    # GRPO ran at lr 0 from the warm start: its final weights are the warm start's, not the base model's.
    final, warmed = load_file(tmp_path / "run" / "model.safetensors"), load_file(warm / "model.safetensors")
    base = load_file(tiny_model_dir / "model.safetensors")
    assert all(torch.equal(final[name], warmed[name]) for name in final)
    assert not all(torch.equal(warmed[name], base[name].to(warmed[name].dtype)) for name in warmed)


@pytest.mark.slow  # two reloads and three 8-token greedy completions on the shared CPU vLLM server
def test_a_reload_generator_samples_from_the_warm_started_weights_once_handed_them(vllm_server, offline_assets,
                                                                                  tmp_path):
    """searchr1-train hands the warm start to a reload generator after waiting for it (it may have been starting up
    during the warm start), so that the step-0 validation samples from the warm-started weights. The weights here:
    the model with its first input norm negated (vLLM's reload keeps every weight a folder leaves out)."""
    name = "model.layers.0.input_layernorm.weight"
    norm = load_file(Path(offline_assets.model) / "model.safetensors")[name]

    def folder(sign: float) -> str:
        path = tmp_path / f"norm{sign:+.0f}"
        path.mkdir()
        save_file({name: norm * sign}, str(path / "model.safetensors"))
        return str(path)

    def greedy() -> str:
        request = {"model": offline_assets.model, "prompt": "The river Thames flows", "max_tokens": 8,
                   "temperature": 0.0}
        return httpx.post(f"{vllm_server.base_url}/v1/completions", json=request, timeout=300).json()["choices"][0][
            "text"]

    before = greedy()
    try:
        hand_warm_start_to_generator(SimpleNamespace(generator_url=vllm_server.base_url, weight_sync_timeout_s=300),
                                     folder(-1.0))
        assert greedy() != before
    finally:  # the server is shared: its own weights back
        hand_warm_start_to_generator(SimpleNamespace(generator_url=vllm_server.base_url, weight_sync_timeout_s=300),
                                     folder(+1.0))
    assert greedy() == before


def test_the_second_query_is_the_questions_content_words():
    assert keyword_query("What year did the Broncos win Super Bowl 50?") == "year Broncos win Super Bowl 50"
    assert keyword_query("Who is it?") == ""


@pytest.mark.slow
def test_a_first_search_without_the_gold_makes_the_teacher_search_its_keywords_before_answering(
        tokenizer, retriever_url, questions_file):
    samples, once = traces(tokenizer, retriever_url, questions_file, 48, topk=1, restate_question=True)
    _, twice = traces(tokenizer, retriever_url, questions_file, 48, topk=1, restate_question=True, second_search=True)
    second = 0
    for sample, one, two in zip(samples, once, twice, strict=True):
        first_hit = keep(one)
        if first_hit or two.num_tool_calls == 1:  # the first search held the gold: the same trace either way
            assert two.num_tool_calls == 1 and two.messages == one.messages
            continue
        assert two.num_turns == 3 and two.status == RolloutStatus.DONE
        query = two.messages[-3]["tool_calls"][0]["function"]["arguments"]["query"]
        assert query == keyword_query(sample.question) != sample.question
        answer = {normalize_answer(two.messages[-1]["content"])}
        assert keep(two) == passages_hold_gold(two.messages[-2]["content"], answer)
        second += keep(two)
    assert second > 0, "no first-search miss was rescued by the keyword query on 48 questions at top-1"
    assert sum(map(keep, twice)) == sum(map(keep, once)) + second
    # repeated, the two-search traces weigh more in the fine-tuning set; the one-search ones stay once each
    tuned = with_second_searches_repeated([r for r in twice if keep(r)], repeats=4)
    assert len(tuned) == sum(map(keep, twice)) + 3 * second
    assert sum(r.num_tool_calls == 2 for r in tuned) == 4 * second


def test_repeating_second_searches_needs_them():
    with pytest.raises(ValueError, match="second_search_repeats=3: expected >= 1, and > 1 only with second_search"):
        WarmStartConfig(num_traces=8, second_search_repeats=3)
    with pytest.raises(ValueError, match="second_search_repeats=0"):
        WarmStartConfig(num_traces=8, second_search=True, second_search_repeats=0)
