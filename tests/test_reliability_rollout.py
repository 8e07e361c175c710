"""Reliability of the rollout path: a malformed turn ends only its own rollout, as
``ERROR_PARSE``, and never reaches the environment, the chat template or another rollout's search.

Turns go through the real path: the Qwen2.5 tokenizer, its response parser (searchr1_trl.engine.parsing), the Search-R1
environment and the chat template rendering the next prompt. The end-to-end cases search the real retrieval server;
the property test (2,000 fuzzed completions in the suite, 10,000 for the figures) answers searches in-process so it
can run that many in CI time.
Figures go to ``reliability_figures`` (docs/RELIABILITY.md).
"""

from __future__ import annotations

import asyncio
import json

import pytest
from conftest import reliability_size
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from searchr1_trl.engine.generation import Generation, Generator, SamplingParams
from searchr1_trl.engine.parsing import response_parser
from searchr1_trl.engine.rollout import RolloutConfig, RolloutEngine, RolloutStatus
from searchr1_trl.tasks.common.data import SearchR1Sample
from searchr1_trl.tasks.common.search import SearchR1EnvConfig
from searchr1_trl.tasks.search_r1.env import SearchR1EnvFactory

GOOD_CALL = '<tool_call>\n{"name": "search", "arguments": {"query": "Super Bowl 50 winner"}}\n</tool_call>'
SURROGATE_SHAPES = {
    "surrogate in the query":
        '<tool_call>\n{"name": "search", "arguments": {"query": "Notre Dame \\ud800"}}\n</tool_call>',
    "surrogate in the tool name": '<tool_call>\n{"name": "se\\udc00arch", "arguments": {"query": "x"}}\n</tool_call>',
    "surrogate in another argument": '<tool_call>\n{"name": "search", "arguments": {"query": "x", "k": "\\ud83d"}}'
                                     '\n</tool_call>',
    "bare JSON call with a surrogate": '{"name": "search", "arguments": {"query": "\\udfff"}}',
}
DEEP_SHAPES = {
    "990 nested arrays": '<tool_call>\n{"name": "search", "arguments": {"query": ' + "[" * 990 + "]" * 990
                         + '}}\n</tool_call>',
    "990 nested arrays, unclosed": "<tool_call>\n" + "[" * 990 + "\n</tool_call>",
    "bare JSON, 990 nested": '{"name": "search", "arguments": ' + "[" * 990 + "]" * 990 + "}",
    "5,000-digit integer": '<tool_call>\n{"name": "search", "arguments": {"query": ' + "9" * 5000 + "}}\n</tool_call>",
    "bare JSON, 5,000 digits": '{"name": "search", "arguments": {"query": ' + "9" * 5000 + "}}",
    "arguments as a JSON string nested 990": '<tool_call>\n{"name": "search", "arguments": "' + "[" * 990
                                             + '"}\n</tool_call>',
}


class ScriptedGenerator(Generator):
    """Question ``q<i>``'s first turn is ``first[i]``, every later turn the answer "Paris"."""

    def __init__(self, tokenizer, first: list[str]):
        self.tokenizer, self.first = tokenizer, first

    async def generate(self, prompt_ids, params):
        text = self.tokenizer.decode(prompt_ids)
        question = int(text.rsplit("Question: q", 1)[1].split("<|im_end|>", 1)[0])
        later = text.count("<|im_start|>assistant") > 1
        ids = self.tokenizer.encode(("Paris" if later else self.first[question]) + "<|im_end|>")
        await asyncio.sleep(0)
        return Generation(ids, [-0.1] * len(ids), "stop")


def run(tokenizer, env: SearchR1EnvFactory, first: list[str]):
    """Rollouts of questions q0..qN whose first turns are ``first``, all at once."""
    engine = RolloutEngine(tokenizer, ScriptedGenerator(tokenizer, first), env,
                           RolloutConfig(max_turns=2, max_rollout_tokens=32768, bare_json_tool_calls=True))
    samples = [SearchR1Sample(question=f"q{i}", golden_answers=("Paris",)) for i in range(len(first))]

    async def main():
        try:
            return await engine.run(samples, SamplingParams(max_tokens=8192))
        finally:
            await env.aclose()

    return asyncio.run(main())


# Turns no reader can take for a call are the model's answer (the bare-JSON reader never fails a turn), and a search
# whose JSON-string arguments cannot be read is answered with an error message: both end their rollout as done.
READ_AS_ANSWER_OR_ANSWERED = {"bare JSON, 990 nested", "bare JSON, 5,000 digits",
                              "arguments as a JSON string nested 990"}


@pytest.mark.slow  # starts or uses the real retrieval server
@pytest.mark.parametrize("shape", [*SURROGATE_SHAPES, *DEEP_SHAPES])
def test_a_malformed_turn_ends_only_its_own_rollout_and_costs_no_other_search(tokenizer, retriever_url, shape,
                                                                              reliability_figures):
    turn = {**SURROGATE_SHAPES, **DEEP_SHAPES}[shape]
    env = SearchR1EnvFactory(SearchR1EnvConfig(search_url=retriever_url))

    rollouts = run(tokenizer, env, [turn] + [GOOD_CALL] * 7)

    searched = [r.messages[2]["content"] for r in rollouts[1:]]
    expected = RolloutStatus.DONE if shape in READ_AS_ANSWER_OR_ANSWERED else RolloutStatus.ERROR_PARSE
    assert rollouts[0].status == expected
    assert [r.status for r in rollouts[1:]] == [RolloutStatus.DONE] * 7
    assert all(text.startswith("Doc 1(Title: Super Bowl 50)") for text in searched)
    assert env.metrics()["search/failures"] == 0
    reliability_figures.setdefault("malformed_turns", {})[shape] = {
        "own_rollout": rollouts[0].status.value, "other_rollouts_lost": sum(r.status != RolloutStatus.DONE
                                                                            for r in rollouts[1:])}


class InProcessEnv(SearchR1EnvFactory):
    """The Search-R1 environments with searches answered in-process (the property test runs thousands of turns)."""

    def __init__(self):
        super().__init__(SearchR1EnvConfig())

        async def search_passages(query: str, skip=()) -> list[dict]:
            json.dumps(query, ensure_ascii=False).encode()  # what the HTTP client would send: raises on no text
            return [{"contents": f"T\nabout {query}"}]  # read as "Doc 1(Title: T) about <query>"

        self.retrieval.search_passages = search_passages


escape = st.sampled_from(["\\ud800", "\\udfff", "\\ud83d\\ude00", "\\u0000", "\\n", '\\"', "\\\\", "\\x", "\\u12"])
json_text = st.lists(st.text(max_size=6) | escape, max_size=5).map("".join)
nested = st.builds(lambda depth, inner, closed: "[" * depth + inner + ("]" * depth if closed else ""),
                   st.integers(0, 1200), st.sampled_from(["", "1", '"x"', "{}"]), st.booleans())
number = st.builds(lambda digits: "9" * digits, st.integers(1, 6000))
value = st.one_of(st.builds(lambda t: f'"{t}"', json_text), nested, number, st.sampled_from(["null", "true", "{"]))
name = st.one_of(st.just('"search"'), st.builds(lambda t: f'"{t}"', json_text), value)
arguments = st.one_of(st.builds(lambda v: '{"query": ' + v + "}", value),
                      st.builds(lambda k, v: "{" + f'"{k}": {v}' + "}", json_text, value), value)
call_json = st.builds(lambda n, a: '{"name": ' + n + ', "arguments": ' + a + "}", name, arguments)
completion = st.one_of(
    st.builds(lambda c: f"<tool_call>\n{c}\n</tool_call>", call_json),
    st.builds(lambda c, n: "\n".join([c] * n), call_json, st.integers(1, 3)),  # bare JSON calls, one per line
    st.builds(lambda c: f"```json\n{c}\n```", call_json),
    st.builds(lambda c, cut: f"<tool_call>\n{c}"[:cut], call_json, st.integers(0, 200)),  # cut off anywhere
    st.text(max_size=80),
    st.builds(lambda t: f"<think>{t}</think>{t}", st.text(max_size=20)),
)


USER = {"role": "user", "content": "Question: q"}


async def one_step(envs: SearchR1EnvFactory, message: dict):
    """The answer to ``message`` as the first turn of its own rollout of the question "q"."""
    env = envs()
    env.reset(SearchR1Sample(question="q", golden_answers=("Paris",)))
    return await env.step([USER, message])


COMPLETIONS = reliability_size(suite=2_000, full=10_000)  # the figure in docs/RELIABILITY.md is the full size's


@pytest.mark.slow  # 2,000 completions through the parser, the environment and the chat template: ~5 s
def test_fuzzed_completions_parse_step_and_render_without_raising(tokenizer, reliability_figures):
    """Property: any turn either fails to parse (the rollout's ERROR_PARSE) or gives a message the environment
    answers and the chat template renders, together with the environment's answer."""
    env = InProcessEnv()
    tools = env.tools
    parse = response_parser(tokenizer, tools, bare_json_tool_calls=True)
    prefix = tokenizer.apply_chat_template([USER], tools=tools, add_generation_prompt=True, tokenize=True,
                                           return_dict=False)
    counts = {"completions": 0, "escapes": 0, "error_parse": 0, "tool_calls": 0}

    @settings(max_examples=COMPLETIONS // 10, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(st.lists(completion, min_size=10, max_size=10))
    def parse_step_render(turns: list[str]):
        counts["completions"] += len(turns)
        try:
            messages = [parse(tokenizer.encode(turn + "<|im_end|>"), list(prefix)) for turn in turns]
            parsed = [m for m in messages if m is not None]

            async def steps():
                return await asyncio.gather(*(one_step(env, m) for m in parsed))

            for message, step in zip(parsed, asyncio.run(steps()), strict=True):
                tokenizer.apply_chat_template([USER, message, *step.messages], tools=tools, tokenize=False,
                                              add_generation_prompt=True)  # the template is what can raise
        except Exception:
            counts["escapes"] += 1
            raise
        counts["error_parse"] += len(messages) - len(parsed)
        counts["tool_calls"] += sum(len(m.get("tool_calls") or []) for m in parsed)

    parse_step_render()

    reliability_figures["parse_fuzz"] = counts
    assert counts["completions"] >= COMPLETIONS and counts["escapes"] == 0


def test_fuzzed_turns_never_cost_the_rollout_beside_them(tokenizer, reliability_figures):
    """Property, end to end through ``RolloutEngine.run``: seven fuzzed first turns and one good search call in one
    batch; every rollout comes back and the good one is answered."""
    counts = {"batches": 0, "escapes": 0, "control_lost": 0}

    @settings(max_examples=60, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(st.lists(completion, min_size=7, max_size=7))
    def rollouts_of(turns: list[str]):
        try:
            rollouts = run(tokenizer, InProcessEnv(), [*turns, GOOD_CALL])
        except Exception:
            counts["escapes"] += 1
            raise
        counts["batches"] += 1
        counts["control_lost"] += rollouts[-1].status != RolloutStatus.DONE
        assert rollouts[-1].messages[2]["content"] == "Doc 1(Title: T) about Super Bowl 50 winner"

    rollouts_of()

    reliability_figures["rollout_fuzz"] = counts
    assert counts["escapes"] == counts["control_lost"] == 0
