"""The Search-R1 paper's tag protocol as a task (``search_r1_tags``): its prompt, turns read from tags and cut at the
closing tags, ``<information>`` out of the loss, EM on ``<answer>``, the same budgets and statuses; on the real Qwen2.5
tokenizer, the real retriever and the tiny model."""

from __future__ import annotations

import asyncio

import pytest

from searchr1_trl.engine.generation import Generation, Generator, SamplingParams
from searchr1_trl.engine.rollout import RolloutConfig, RolloutEngine, RolloutStatus
from searchr1_trl.tasks import get_task
from searchr1_trl.tasks.common.data import SearchR1Sample
from searchr1_trl.tasks.common.rubric import RewardExactMatch, Rubric
from searchr1_trl.tasks.common.search import SearchR1EnvConfig
from searchr1_trl.tasks.search_r1_tags.env import (
    INSTRUCTION,
    INVALID_ACTION,
    STOP,
    SearchR1TagEnvFactory,
    parse_turn,
    tag_answer,
)
from searchr1_trl.training import evaluation

TAGS = get_task("search_r1_tags")
SAMPLE = SearchR1Sample("Which NFL team represented the AFC at Super Bowl 50", ("Denver Broncos",), "squad")
SEARCH = "<think>I do not know it; I should search.</think>\n<search> Super Bowl 50 AFC champion </search>"
ANSWER = "<think>The passages say the Broncos.</think>\n<answer> Denver Broncos </answer>"
NOWHERE = "http://127.0.0.1:9/retrieve"  # nothing listens: a test that never searches, or a retriever that is down


class TagTurns(Generator):
    """Writes the given turns in order, as token ids that end with the closing tag (vLLM stops there); records the
    prompts and sampling params it was given."""

    def __init__(self, tokenizer, turns: list[str]):
        self.tokenizer, self.turns = tokenizer, list(turns)
        self.prompts: list[list[int]] = []
        self.params: list[SamplingParams] = []

    async def generate(self, prompt_ids, params) -> Generation:
        self.prompts.append(list(prompt_ids))
        self.params.append(params)
        ids = self.tokenizer.encode(self.turns.pop(0), add_special_tokens=False)
        return Generation(ids, [-0.5] * len(ids), "stop")


def roll(tokenizer, turns: list[str], search_url: str = NOWHERE, max_turns: int = 3, **env):
    """(rollout, generator, env metrics) of one rollout of :data:`SAMPLE` in the tag task."""
    envs = SearchR1TagEnvFactory(SearchR1EnvConfig(search_url=search_url, topk=2, **env))
    generator = TagTurns(tokenizer, turns)
    engine = RolloutEngine(tokenizer, generator, envs, RolloutConfig(max_turns=max_turns))

    async def main():
        try:
            return await engine.rollout(SAMPLE, SamplingParams.greedy(max_tokens=64))
        finally:
            await envs.aclose()

    rollout = asyncio.run(main())
    return rollout, generator, envs.metrics()


def text_where(tokenizer, rollout, mask: int) -> str:
    """The completion's text over the tokens whose env_mask is ``mask`` (1: the model's, 0: the environment's)."""
    return tokenizer.decode([t for t, m in zip(rollout.completion_ids, rollout.env_mask, strict=True) if m == mask])


def test_the_prompt_is_the_papers_through_the_chat_template_and_as_written_without_one(tokenizer, offline_assets):
    from conftest import template_tokenizer

    question = "Which NFL team represented the AFC at Super Bowl 50?"  # the paper's data adds the question mark
    message = [{"role": "user", "content": INSTRUCTION.format(question=question)}]
    assert SearchR1TagEnvFactory()().reset(SAMPLE) == message
    assert message[0]["content"].endswith("For example, <answer> Beijing </answer>. Question: " + question + "\n")
    assert "call a search engine by <search> query </search> and it will return the top searched results between " \
           "<information> and </information>" in INSTRUCTION
    instruct = SearchR1TagEnvFactory().transcript(tokenizer, RolloutConfig())
    assert tokenizer.decode(instruct.prompt(message)) == tokenizer.apply_chat_template(
        message, add_generation_prompt=True, tokenize=False)  # the template's system prompt, no tool schema
    base = template_tokenizer(offline_assets, None)
    base.chat_template = None  # a base model's tokenizer without a template reads the instruction as written
    assert base.decode(SearchR1TagEnvFactory().transcript(base, RolloutConfig()).prompt(message)) == message[0][
        "content"]


def test_a_turn_is_read_as_the_paper_reads_it_its_first_search_or_answer_block():
    searched = parse_turn(SEARCH)
    assert searched["content"] == SEARCH
    assert searched["tool_calls"] == [{"type": "function", "function": {
        "name": "search", "arguments": {"query": "Super Bowl 50 AFC champion"}}}]
    assert "tool_calls" not in parse_turn(ANSWER) and tag_answer([parse_turn(ANSWER)]) == "Denver Broncos"
    assert parse_turn("<search></search>")["tool_calls"][0]["function"]["arguments"] == {"query": ""}
    invalid = parse_turn("I think it is Denver.")
    assert "tool_calls" not in invalid and tag_answer([invalid]) is None
    # the answer is the last <answer> of the final turn; an empty one is none
    twice = {"role": "assistant", "content": "<answer> a </answer> <answer> b </answer>"}
    assert tag_answer([parse_turn(ANSWER), twice]) == "b"
    assert tag_answer([{"role": "assistant", "content": "<answer> </answer>"}]) is None


def test_an_invalid_action_gets_the_papers_note_and_the_rollout_goes_on_to_its_answer(tokenizer):
    rollout, generator, metrics = roll(tokenizer, ["I am not sure what to do.", ANSWER])

    assert (rollout.status, rollout.num_turns, rollout.num_tool_calls) == (RolloutStatus.DONE, 2, 0)
    assert text_where(tokenizer, rollout, 0) == INVALID_ACTION  # the note is the environment's, out of the loss
    assert text_where(tokenizer, rollout, 1) == "I am not sure what to do." + ANSWER
    assert [params.stop for params in generator.params] == [STOP, STOP]  # every turn ends at </search> or </answer>
    assert metrics["search/invalid_actions"] == 1 and metrics["search/searches"] == 0
    assert Rubric([RewardExactMatch(answer=TAGS.answer)]).score(rollout) == 1.0
    assert Rubric().score(rollout) == 0.0  # read as a tool-call rollout, the final message is no bare answer


def test_a_search_on_the_last_turn_ends_truncated_max_turns_without_searching(tokenizer):
    rollout, _, metrics = roll(tokenizer, [SEARCH], max_turns=1)

    assert (rollout.status, rollout.num_tool_calls, metrics["search/searches"]) == (
        RolloutStatus.TRUNCATED_MAX_TURNS, 1, 0)
    assert Rubric([RewardExactMatch(answer=TAGS.answer)]).score(rollout) == 0.0


def test_a_search_the_retriever_does_not_answer_ends_the_rollout_as_error_tool(tokenizer):
    rollout, _, metrics = roll(tokenizer, [SEARCH, ANSWER], max_retries=0)

    assert (rollout.status, rollout.num_turns) == (RolloutStatus.ERROR_TOOL, 1)
    assert (metrics["search/failures"], metrics["search/failed_steps"]) == (1, 1)
    assert Rubric([RewardExactMatch(answer=TAGS.answer)]).score(rollout) is None  # an outage is no wrong answer


def test_a_search_gets_the_retrievers_passages_between_information_tags_out_of_the_loss(tokenizer, retriever_url):
    rollout, generator, metrics = roll(tokenizer, [SEARCH, ANSWER], search_url=retriever_url)

    assert (rollout.status, rollout.num_turns, rollout.num_tool_calls) == (RolloutStatus.DONE, 2, 1)
    passages = rollout.messages[2]
    assert passages["role"] == "tool" and passages["content"].startswith("Doc 1(Title: ")
    # what the environment appended, and nothing else, is out of the loss; the model's turns are all in it
    assert text_where(tokenizer, rollout, 0) == f"\n\n<information>{passages['content']}</information>\n\n"
    assert text_where(tokenizer, rollout, 1) == SEARCH + ANSWER
    # the second turn was generated after exactly the first turn and the information, token for token
    assert generator.prompts[1] == rollout.prompt_ids + rollout.completion_ids[:len(generator.prompts[1])
                                                                               - len(rollout.prompt_ids)]
    assert tokenizer.decode(generator.prompts[1]).endswith("</information>\n\n")
    assert metrics["search/searches"] == 1 and metrics["search/failures"] == 0
    assert Rubric([RewardExactMatch(answer=TAGS.answer)]).score(rollout) == 1.0


def test_the_agent_method_evaluates_the_tag_protocol_by_its_answer_tag(tokenizer, retriever_url):
    method = evaluation.build_method("agent", TAGS, tokenizer, TagTurns(tokenizer, [SEARCH, ANSWER]),
                                     SearchR1EnvConfig(search_url=retriever_url, topk=2), RolloutConfig(max_turns=3))

    async def main():
        try:
            return await evaluation.run(method, [SAMPLE], evaluation.greedy_params(64))
        finally:
            await method.aclose()

    [trace] = asyncio.run(main())
    assert (trace.answer, trace.em, trace.status, trace.num_turns) == ("Denver Broncos", True, "done", 2)
    assert [search["query"] for search in trace.searches] == ["Super Bowl 50 AFC champion"]
    assert len(trace.searches[0]["titles"]) == 2 and not trace.searches[0]["failed"]


def test_the_in_process_generator_ends_a_turn_at_the_token_that_completes_a_stop_string(tiny_model_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from searchr1_trl.engine.in_process import TransformersGenerator

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    generator = TransformersGenerator(model, tokenizer)
    prompt = tokenizer.encode("Question: who won Super Bowl 50?")
    free = asyncio.run(generator.generate(prompt, SamplingParams.greedy(max_tokens=12)))
    # a stop string that ends inside the fifth token's text (the first five tokens' text but its last character, or all
    # of it for a one-character token): the turn ends with that token, the rest is not generated
    five = tokenizer.decode(free.token_ids[:5])
    stop = five[:-1] if len(five) - len(tokenizer.decode(free.token_ids[:4])) > 1 else five
    stopped = asyncio.run(generator.generate(prompt, SamplingParams(temperature=0.0, max_tokens=12, stop=(stop,))))
    assert (stopped.finish_reason, stopped.token_ids) == ("stop", free.token_ids[:5])
    assert stopped.logprobs == pytest.approx(free.logprobs[:5])


def test_the_vllm_generator_ends_a_turn_at_a_stop_string_keeping_every_token(vllm_server, tokenizer):
    from searchr1_trl.engine.generation import VLLMServerGenerator

    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Reply with one word: the capital of France."}],
                                           add_generation_prompt=True, tokenize=True, return_dict=False)

    async def generate(stop: tuple[str, ...]):
        generator = VLLMServerGenerator(vllm_server.base_url)
        try:
            return await generator.generate(prompt, SamplingParams(temperature=0.0, max_tokens=32, stop=stop))
        finally:
            await generator.aclose()

    free = asyncio.run(generate(()))
    assert "Paris" in tokenizer.decode(free.token_ids)
    stopped = asyncio.run(generate(("ari",)))
    # the turn ends with the token that completed "ari" (the token is kept whole, as vLLM generated it)
    end = next(i for i in range(1, len(free.token_ids) + 1) if "ari" in tokenizer.decode(free.token_ids[:i]))
    assert (stopped.finish_reason, stopped.token_ids) == ("stop", free.token_ids[:end])


# a GRPO step of the tiny model on CPU: ~10 s, no server
def test_a_grpo_step_trains_the_tag_task_chosen_by_the_recipe(tiny_model_dir, questions_file, tmp_path):
    from test_trainer import small_config, trainer_with_text_reward

    args = small_config(tmp_path, questions_file, NOWHERE, task="search_r1_tags", generator="transformers",
                        max_turns=2, max_tokens_per_turn=8)
    trainer = trainer_with_text_reward(str(tiny_model_dir), args)
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    trainer.train()

    [step] = [entry for entry in trainer.state.log_history if "rollout/time_s" in entry]
    assert trainer.parts.task is TAGS and trainer.engine.transcript.stop == STOP
    # the random tiny model fills its 8 tokens with no tag: no search, no answer, a budget ends every rollout
    assert step["rollout/status_truncated_length"] == 1.0 and step["rubric/truncated"] == 1.0
    assert step["search/searches"] == 0 and "search/invalid_actions" in step
    assert any(not p.detach().equal(before[name]) for name, p in trainer.model.named_parameters())
