"""The calculator task, the worked example of docs/adding_a_task.md: its tool, a rollout on the real Qwen2.5 chat
template, and two GRPO steps of the tiny model on CPU with the task chosen by the recipe."""

from __future__ import annotations

import asyncio

import pytest

from searchr1_trl.engine.generation import Generation, Generator, SamplingParams
from searchr1_trl.engine.rollout import RolloutConfig, RolloutEngine, RolloutStatus
from searchr1_trl.tasks import get_task
from searchr1_trl.tasks.calculator.env import CalculatorEnvFactory, arithmetic_questions, calculate
from searchr1_trl.tasks.common.data import SearchR1Dataset, SearchR1DatasetConfig, SearchR1Sample
from searchr1_trl.tasks.common.rubric import Rubric

CALCULATOR = get_task("calculator")


def test_the_calculator_evaluates_arithmetic_and_nothing_else():
    assert [calculate(e) for e in ("12 * (3 + 4)", "7 / 2", "-3 - 4", "1.5 * 2")] == ["84", "3.5", "-7", "3"]
    for expression in ("__import__('os')", "2 ** 8", "1 / 0", "x + 1", "True + 1", "12 *"):
        with pytest.raises(ValueError):
            calculate(expression)


def test_a_call_gets_its_value_and_a_bad_one_an_error_that_is_counted():
    envs = CalculatorEnvFactory()
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "17 * 23"}}}
    as_json = {"function": {"name": "calculator", "arguments": '{"expression": "2 + 2"}'}}
    assert [envs.answer(c)["content"] for c in (call, as_json)] == ["391", "4"]
    bad = envs.answer({"function": {"name": "calculator", "arguments": {"expr": "2 + 2"}}})
    assert bad["content"].startswith("Error: ") and "expected an arithmetic expression" in bad["content"]
    assert envs.metrics() == {"calculator/bad_calls": 1} and envs.metrics() == {"calculator/bad_calls": 0}


class CallThenAnswer(Generator):
    """Calls the calculator on the question's expression, then answers with what the tool said."""

    def __init__(self, tokenizer):
        self.tokenizer, self.prompts = tokenizer, []

    async def generate(self, prompt_ids, params) -> Generation:
        prompt = self.tokenizer.decode(prompt_ids)
        self.prompts.append(prompt)
        if "<tool_response>" in prompt:
            text = prompt.rsplit("<tool_response>\n", 1)[1].split("\n</tool_response>")[0]
        else:
            expression = prompt.rsplit("What is ", 1)[1].split("?")[0]
            text = f'<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{expression}"}}}}\n</tool_call>'
        ids = [*self.tokenizer.encode(text), self.tokenizer.eos_token_id]
        return Generation(ids, [0.0] * len(ids), "stop")


def test_a_rollout_that_calls_the_calculator_then_answers_is_an_exact_match(tokenizer):
    sample = SearchR1Sample("What is 17 * 23?", ("391",))
    generator = CallThenAnswer(tokenizer)
    engine = RolloutEngine(tokenizer, generator, CALCULATOR.envs(None), RolloutConfig(max_turns=3))

    rollout = asyncio.run(engine.rollout(sample, SamplingParams.greedy(max_tokens=64)))

    assert (rollout.status, rollout.num_turns, rollout.num_tool_calls) == (RolloutStatus.DONE, 2, 1)
    assert '"name": "calculator"' in generator.prompts[0]  # the chat template offers the tool
    assert rollout.messages[2] == {"role": "tool", "name": "calculator", "content": "391"}
    assert Rubric().score(rollout) == 1.0 and CALCULATOR.answer(rollout.messages) == "391"


def test_arithmetic_questions_are_a_question_stream(tmp_path):
    path = tmp_path / "arithmetic.parquet"
    arithmetic_questions(16, seed=3).to_parquet(path)
    samples = SearchR1Dataset(SearchR1DatasetConfig(data_path=str(path), shuffle=False)).take(16)
    assert len(samples) == 16 and {s.data_source for s in samples} == {"arithmetic"}
    assert all(s.golden_answers == (calculate(s.question.removeprefix("What is ").removesuffix("?")),)
               for s in samples)


# two GRPO steps of the tiny model on CPU: ~10 s, no server
def test_two_grpo_steps_train_the_calculator_task_chosen_by_the_recipe(tiny_model_dir, tmp_path):
    from test_trainer import small_config, trainer_with_text_reward

    questions = tmp_path / "arithmetic.parquet"
    arithmetic_questions(32).to_parquet(questions)
    # no retriever: the calculator task needs none, and nothing searches
    args = small_config(tmp_path, str(questions), "http://127.0.0.1:9/retrieve", task="calculator",
                        generator="transformers", max_steps=2, max_turns=2, max_tokens_per_turn=8)
    trainer = trainer_with_text_reward(str(tiny_model_dir), args)
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    trainer.train()

    steps = [entry for entry in trainer.state.log_history if "rollout/time_s" in entry]
    assert trainer.state.global_step == 2 and len(steps) == 2
    assert all("calculator/bad_calls" in step and "search/searches" not in step for step in steps)
    assert any(not p.detach().equal(before[name]) for name, p in trainer.model.named_parameters())
