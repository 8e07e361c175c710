"""Evaluation: the three methods' prompts and traces, the summary, and validation as the same path."""

from __future__ import annotations

import asyncio
import json

import pytest

from searchr1_trl.engine.generation import Generation, Generator
from searchr1_trl.engine.rollout import RolloutConfig, RolloutEngine, RolloutStatus
from searchr1_trl.tasks import get_task
from searchr1_trl.tasks.common.data import SearchR1Sample
from searchr1_trl.tasks.common.rubric import Rubric
from searchr1_trl.tasks.common.search import RESTATEMENT, SearchR1EnvConfig
from searchr1_trl.tasks.search_r1.env import SearchR1EnvFactory
from searchr1_trl.training import evaluation

SEARCH_R1 = get_task("search_r1")
QUESTION = SearchR1Sample("Which NFL team represented the AFC at Super Bowl 50?", ("Denver Broncos",), "squad")


class ScriptedGenerator(Generator):
    """A policy that searches for the question when it has the tool, then answers; its answer is "Denver Broncos"
    when the prompt holds passages, "Carolina Panthers" when it answers from memory. Records every prompt."""

    def __init__(self, tokenizer, call_end: str = "</tool_call>"):
        self.tokenizer, self.call_end = tokenizer, call_end  # call_end: what the policy writes after its call's JSON
        self.prompts: list[str] = []

    async def generate(self, prompt_ids, params) -> Generation:
        prompt = self.tokenizer.decode(prompt_ids)
        self.prompts.append(prompt)
        last_turn = prompt.rsplit("<|im_start|>", 2)[-2]
        if "Doc 1(Title:" in last_turn:
            text = "Denver Broncos"
        elif '"name": "search"' in prompt:
            text = '<tool_call>\n{"name": "search", "arguments": {"query": "Super Bowl 50 AFC"}}\n' + self.call_end
        else:
            text = "Carolina Panthers"
        ids = [*self.tokenizer.encode(text), self.tokenizer.eos_token_id]
        return Generation(ids, [0.0] * len(ids), "stop")


def trace_of(method_name, tokenizer, retriever_url, generator=None,
             rollout_config=None) -> tuple[evaluation.Trace, list[str]]:
    generator = generator or ScriptedGenerator(tokenizer)
    method = evaluation.build_method(method_name, SEARCH_R1, tokenizer, generator,
                                     SearchR1EnvConfig(search_url=retriever_url),
                                     rollout_config or RolloutConfig(max_turns=3))

    async def main():
        try:
            return await evaluation.run(method, [QUESTION], evaluation.greedy_params(64))
        finally:
            await method.aclose()

    [trace] = asyncio.run(main())
    return trace, generator.prompts


def test_direct_is_one_closed_book_turn_without_the_search_tool(tokenizer, retriever_url):
    trace, prompts = trace_of("direct", tokenizer, retriever_url)
    assert len(prompts) == 1 and '"name": "search"' not in prompts[0] and "Doc 1" not in prompts[0]
    assert evaluation.DIRECT_INSTRUCTION in prompts[0] and QUESTION.question in prompts[0]
    assert (trace.answer, trace.em, trace.searches, trace.num_turns, trace.status) == (
        "Carolina Panthers", False, [], 1, "done")


def test_rag_pastes_the_questions_passages_then_the_restatement_and_answers_in_one_turn(tokenizer, retriever_url):
    trace, prompts = trace_of("rag", tokenizer, retriever_url)
    assert len(prompts) == 1 and '"name": "search"' not in prompts[0]
    assert prompts[0].index("Doc 1(Title:") < prompts[0].index(RESTATEMENT.format(question=QUESTION.question))
    assert (trace.answer, trace.em, trace.num_turns, trace.status) == ("Denver Broncos", True, 1, "done")
    [search] = trace.searches
    assert search["query"] == QUESTION.question and search["titles"][0] == "Super Bowl 50"


def test_agent_searches_with_its_own_query_and_records_the_passage_titles(tokenizer, retriever_url):
    trace, prompts = trace_of("agent", tokenizer, retriever_url)
    assert len(prompts) == 2 and '"name": "search"' in prompts[0]
    assert (trace.answer, trace.em, trace.num_turns, trace.status) == ("Denver Broncos", True, 2, "done")
    [search] = trace.searches
    assert search["query"] == "Super Bowl 50 AFC" and len(search["titles"]) == 3
    assert json.loads(json.dumps(trace.messages)) == trace.messages, "a trace is JSON as it is"


def test_an_agent_trace_counts_the_calls_the_engine_closed(tokenizer, retriever_url):
    # a stray tag where </tool_call> belongs: refused as it is, closed by the engine when asked
    strict, _ = trace_of("agent", tokenizer, retriever_url, ScriptedGenerator(tokenizer, call_end="<tool_call>"))
    closed, _ = trace_of("agent", tokenizer, retriever_url, ScriptedGenerator(tokenizer, call_end="<tool_call>"),
                         RolloutConfig(max_turns=3, close_tool_calls=True))
    assert (strict.status, strict.em, strict.closed_turns) == ("error_parse", False, 0)
    assert (closed.status, closed.em, closed.closed_turns, len(closed.searches)) == ("done", True, 1, 1)
    assert evaluation.summarize([strict, closed])["closed_turns_per_rollout"] == 0.5


def trace(source, em, searches=0, status="done") -> evaluation.Trace:
    return evaluation.Trace("q", ["a"], source, "agent", "a" if em else "b", em,
                            [{"query": "q", "titles": []}] * searches, 1 + searches, status)


def test_summary_gives_em_overall_and_per_source_searches_and_status_fractions():
    traces = [trace("nq", True, 1), trace("nq", False, 2, "truncated_max_turns"), trace("hotpotqa", True, 1),
              trace("hotpotqa", True, 0), trace("hotpotqa", False, 0, "error_parse")]
    traces[0].closed_turns = 2  # the engine closed two of its calls (close_tool_calls)
    summary = evaluation.summarize(traces)
    assert summary["em"] == pytest.approx(3 / 5)
    assert summary["closed_turns_per_rollout"] == pytest.approx(2 / 5)
    assert (summary["em/nq"], summary["em/hotpotqa"]) == (pytest.approx(1 / 2), pytest.approx(2 / 3))
    assert evaluation.macro_average(summary) == pytest.approx((1 / 2 + 2 / 3) / 2)
    assert summary["searches_per_rollout"] == pytest.approx(4 / 5)
    assert (summary["status_done"], summary["status_truncated_max_turns"], summary["status_error_parse"]) == (
        pytest.approx(3 / 5), pytest.approx(1 / 5), pytest.approx(1 / 5))
    assert summary["num_samples"] == 5


def test_token_f1_stands_beside_em_per_trace_per_source_and_in_the_average():
    answered = [{"role": "assistant", "content": "The Denver Broncos team"}]
    assert evaluation.answer_f1(answered, ["Denver Broncos", "Broncos"]) == pytest.approx(0.8)  # the best gold
    assert evaluation.answer_f1([{"role": "assistant", "content": ""}], ["Denver"]) == 0.0  # no answer
    traces = [trace("nq", True, 1), trace("nq", False, 1), trace("hotpotqa", False, 1)]
    traces[0].f1, traces[1].f1, traces[2].f1 = 1.0, 0.5, 0.25
    summary = evaluation.summarize(traces)
    assert (summary["f1"], summary["f1/nq"], summary["f1/hotpotqa"]) == (pytest.approx(1.75 / 3), 0.75, 0.25)
    assert evaluation.macro_average(summary, "f1") == pytest.approx((0.75 + 0.25) / 2)


def test_a_trace_with_a_failed_search_is_counted_apart_and_left_out_of_the_em():
    traces = [trace("nq", True, 1), trace("nq", False, 1, evaluation.SEARCH_FAILED), trace("hotpotqa", False, 1,
                                                                                         evaluation.SEARCH_FAILED)]
    summary = evaluation.summarize(traces)
    assert (summary["em"], summary["em/nq"], summary["search_failed"]) == (1.0, 1.0, 2)
    assert summary["em/hotpotqa"] != summary["em/hotpotqa"]  # NaN: no trace of it could be scored
    assert summary["status_error_search"] == pytest.approx(2 / 3)


@pytest.mark.parametrize("method_name", ["rag", "agent"])
def test_a_search_the_retriever_does_not_answer_makes_a_failed_trace_not_a_wrong_answer(tokenizer, method_name):
    from conftest import free_port

    generator = ScriptedGenerator(tokenizer)
    closed = f"http://127.0.0.1:{free_port()}/retrieve"  # nothing listens: every attempt is refused
    method = evaluation.build_method(method_name, SEARCH_R1, tokenizer, generator,
                                     SearchR1EnvConfig(search_url=closed, max_retries=0), RolloutConfig(max_turns=3))

    [failed] = asyncio.run(evaluation.run(method, [QUESTION], evaluation.greedy_params(64)))

    assert (failed.status, failed.em, failed.searches[0]["failed"], failed.searches[0]["titles"]) == (
        evaluation.SEARCH_FAILED, False, True, [])


def test_a_rollout_whose_searches_all_failed_ends_error_tool_counted_and_without_reward(tokenizer):
    from conftest import free_port

    env = SearchR1EnvFactory(SearchR1EnvConfig(search_url=f"http://127.0.0.1:{free_port()}/retrieve", max_retries=0))
    engine = RolloutEngine(tokenizer, ScriptedGenerator(tokenizer), env, RolloutConfig(max_turns=3))

    async def main():
        try:
            return await engine.rollout(QUESTION, evaluation.greedy_params(64))
        finally:
            await env.aclose()

    rollout = asyncio.run(main())

    # Not "done" after reading an empty result: the outage ends it, before the model answers from nothing.
    assert (rollout.status, rollout.num_turns, rollout.messages[-1]["role"]) == (
        RolloutStatus.ERROR_TOOL, 1, "assistant")
    counts = env.metrics()
    assert (counts["search/failed_steps"], counts["search/failures"], counts["search/searches"]) == (1, 1, 1)
    assert Rubric().score(rollout) is None  # TRL: no advantage, and out of its group's baseline


def test_passage_titles_keep_parentheses_inside_a_title():
    passages = "Doc 1(Title: Queen (band)) A British rock band.\nDoc 2(Title: Paris) The capital."
    assert evaluation.passage_titles(passages) == ["Queen (band)", "Paris"]


def test_run_hands_over_each_trace_as_it_finishes_and_returns_them_in_input_order(tokenizer, retriever_url):
    generator = ScriptedGenerator(tokenizer)
    method = evaluation.build_method("direct", SEARCH_R1, tokenizer, generator,
                                     SearchR1EnvConfig(search_url=retriever_url), RolloutConfig())
    samples = [SearchR1Sample(f"Question {i}?", ("x",), "squad") for i in range(5)]
    seen = []
    traces = asyncio.run(evaluation.run(method, samples, evaluation.greedy_params(8),
                                        on_trace=lambda i, t: seen.append((i, t.question)), max_concurrency=2))
    assert [t.question for t in traces] == [s.question for s in samples]
    assert sorted(seen) == [(i, s.question) for i, s in enumerate(samples)]
