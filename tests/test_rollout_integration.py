"""Real rollouts end to end: the offline Qwen2.5 model on a real CPU vLLM server, the real retrieval server over the
small SQuAD dev corpus, SearchR1Env + RolloutEngine + Rubric.

One batch of rollouts is run per module and every test reads it.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from searchr1_trl.engine.generation import SamplingParams, VLLMServerGenerator
from searchr1_trl.engine.rollout import RolloutConfig, RolloutEngine, RolloutStatus
from searchr1_trl.tasks.common.data import SearchR1Sample
from searchr1_trl.tasks.common.rubric import Rubric
from searchr1_trl.tasks.common.search import SearchR1EnvConfig
from searchr1_trl.tasks.search_r1.env import SearchR1EnvFactory

pytestmark = pytest.mark.slow

NUM_QUESTIONS = 8


@pytest.fixture(scope="module")
def questions(squad_dev_sample) -> list[SearchR1Sample]:
    """One question from each of the first SQuAD dev articles (so the searches hit different passages)."""
    _, rows = squad_dev_sample
    rows = rows.groupby("title", sort=False).head(1).head(NUM_QUESTIONS)
    return [SearchR1Sample(r.question, tuple(r.golden_answers), r.data_source) for r in rows.itertuples()]


@pytest.fixture(scope="module")
def rollouts(vllm_server, retriever_url, tokenizer, questions):
    """(rollouts, env metrics) of greedy rollouts of every question."""
    # One passage a search: the CPU server prefills ~150 tokens a passage for every searching rollout, and no check
    # here depends on how many passages come back.
    env = SearchR1EnvFactory(SearchR1EnvConfig(search_url=retriever_url, topk=1))
    generator = VLLMServerGenerator(vllm_server.base_url)
    # The offline Qwen2.5-Coder-0.5B-Instruct calls tools as bare JSON, never in <tool_call> tags (greedy or not).
    config = RolloutConfig(max_turns=2, max_rollout_tokens=2048, bare_json_tool_calls=True)
    engine = RolloutEngine(tokenizer, generator, env, config)

    async def main():
        try:
            # 48 tokens hold a search call or a short answer; CPU vLLM decodes ~1 token/s per step under load.
            return await engine.run(questions, SamplingParams.greedy(max_tokens=48))
        finally:
            await generator.aclose()
            await env.aclose()

    return asyncio.run(main()), env.metrics()


def test_every_rollout_ends_with_a_valid_status_and_aligned_tokens(rollouts, tokenizer):
    rollouts, _ = rollouts
    for rollout in rollouts:
        assert isinstance(rollout.status, RolloutStatus)
        assert len(rollout.completion_ids) == len(rollout.env_mask) == len(rollout.logprobs) > 0
        assert len(rollout.prompt_ids) + len(rollout.completion_ids) <= 2048
        assert all(lp == 0.0 for lp, m in zip(rollout.logprobs, rollout.env_mask, strict=True) if m == 0)
        assert all(lp <= 0.0 for lp, m in zip(rollout.logprobs, rollout.env_mask, strict=True) if m == 1)
        assert rollout.env_mask[0] == 1  # the completion starts with the model's first turn
        if rollout.status is RolloutStatus.DONE:
            assert rollout.completion_ids[-1] == tokenizer.eos_token_id
            assert rollout.messages[-1]["role"] == "assistant" and not rollout.messages[-1].get("tool_calls")


def test_at_least_one_rollout_searched_and_got_passages_back(rollouts):
    rollouts, metrics = rollouts
    searched = [r for r in rollouts if r.num_tool_calls > 0]
    assert searched, f"no rollout searched: {[r.messages[1:] for r in rollouts]}"
    tool_messages = [m for r in searched for m in r.messages if m["role"] == "tool"]
    assert tool_messages and all(m["name"] == "search" for m in tool_messages)
    assert any(m["content"].startswith("Doc 1(Title: ") for m in tool_messages)
    assert metrics["search/failures"] == 0


def test_rewards_are_exact_match_scores(rollouts):
    rollouts, _ = rollouts
    rubric = Rubric()
    scores = [rubric.score(r) for r in rollouts]
    assert set(scores) <= {0.0, 1.0}
    assert all(score == 0.0 for score, r in zip(scores, rollouts, strict=True) if r.status is not RolloutStatus.DONE)


def test_vllm_logprobs_match_a_transformers_forward_pass_over_the_final_sequence(rollouts, offline_assets):
    """The sequence is exactly what vLLM saw: re-scoring it with the same weights gives the same logprobs."""
    from transformers import AutoModelForCausalLM

    rollouts, _ = rollouts
    rollout = max(rollouts, key=lambda r: (r.num_turns, len(r.completion_ids)))  # the most multi-turn one
    model = AutoModelForCausalLM.from_pretrained(offline_assets.model, dtype=torch.bfloat16).eval()
    sequence = rollout.prompt_ids + rollout.completion_ids
    with torch.inference_mode():
        logits = model(torch.tensor([sequence])).logits[0, len(rollout.prompt_ids) - 1 : -1].float()
    logprobs = torch.log_softmax(logits, dim=-1).gather(-1, torch.tensor(rollout.completion_ids)[:, None])[:, 0]

    mask = torch.tensor(rollout.env_mask, dtype=torch.bool)
    vllm_logprobs = torch.tensor(rollout.logprobs)
    mean_abs = (logprobs[mask] - vllm_logprobs[mask]).abs().mean().item()
    assert mean_abs < 0.1, f"mean |logprob difference| {mean_abs:.3f} over {int(mask.sum())} model tokens"


def test_vllm_generator_returns_stop_with_the_eos_kept_or_length_at_max_tokens(vllm_server, tokenizer):
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Reply with one word: the capital of France."}],
        add_generation_prompt=True, tokenize=True, return_dict=False,
    )
    generator = VLLMServerGenerator(vllm_server.base_url)

    async def main():
        try:
            return await asyncio.gather(
                generator.generate(prompt, SamplingParams.greedy(max_tokens=32)),
                generator.generate(prompt, SamplingParams.greedy(max_tokens=1)),
            )
        finally:
            await generator.aclose()

    full, cut = asyncio.run(main())
    assert full.finish_reason == "stop" and full.token_ids[-1] == tokenizer.eos_token_id
    assert len(full.logprobs) == len(full.token_ids)
    assert (cut.finish_reason, cut.token_ids) == ("length", full.token_ids[:1])


def test_vllm_generator_ends_a_turn_at_a_stop_token_id_and_keeps_it(vllm_server, tokenizer):
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Reply with one word: the capital of France."}],
        add_generation_prompt=True, tokenize=True, return_dict=False,
    )

    async def generate(stop_token_ids):
        generator = VLLMServerGenerator(vllm_server.base_url, stop_token_ids=stop_token_ids)
        try:
            return await generator.generate(prompt, SamplingParams.greedy(max_tokens=32))
        finally:
            await generator.aclose()

    full = asyncio.run(generate(None))
    first = full.token_ids[0]
    assert full.token_ids[-1] == tokenizer.eos_token_id and len(full.token_ids) > 1
    # Any id the caller names ends the turn like an eos: here the first word's own token.
    stopped = asyncio.run(generate([first]))
    assert (stopped.finish_reason, stopped.token_ids) == ("stop", [first])
    assert len(stopped.logprobs) == 1
