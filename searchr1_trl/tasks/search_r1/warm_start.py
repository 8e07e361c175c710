"""The Search-R1 task's warm-start traces: what a teacher would write, searched and answered.

Search the question as asked, then answer with a golden answer the passages contain (with ``second_search``, where the
first search holds none, search again with the question's content words first). The traces go through the training
rollout engine itself, so the prompt, the tool message (with its restatement), the tokens and the environment mask are
exactly those of training, against the real retriever; :func:`keep` drops those whose passages hold no golden answer
(the teacher would otherwise teach answering without evidence). The fine-tune on them is the framework's
(:mod:`searchr1_trl.training.warm_start`).
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable

from searchr1_trl.engine.generation import Generation, Generator, SamplingParams
from searchr1_trl.engine.rollout import Rollout, RolloutEngine, RolloutStatus
from searchr1_trl.tasks.common.rubric import (
    normalize_answer,
    passages_hold_gold,
    retrieval_surfaced_gold,
    search_results,
)
from searchr1_trl.tasks.common.search import SEARCH_TOOL_NAME


class ScriptedTurns(Generator):
    """A generator that plays given turns in order instead of sampling: each turn is a function of the token
    sequence so far (so a turn may read what the environment returned) to the ids of that turn."""

    def __init__(self, turns: list[Callable[[list[int]], list[int]]]):
        self._turns = list(turns)

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        if not self._turns:
            raise RuntimeError("the script has no turn left: the rollout asked for more turns than were written")
        token_ids = self._turns.pop(0)(prompt_ids)
        return Generation(token_ids=token_ids, logprobs=[0.0] * len(token_ids), finish_reason="stop")


def assistant_turn_ids(engine: RolloutEngine, messages: list[dict], turn: dict, end_ids: set[int]) -> list[int]:
    """The ids the chat template gives the assistant message ``turn`` after ``messages``, up to and including its
    end-of-turn token: what the model would generate to produce that message."""
    before = engine.transcript.render(messages, add_generation_prompt=True)
    after = engine.transcript.render([*messages, turn], add_generation_prompt=False)
    if after[: len(before)] != before:
        raise ValueError("the chat template renders an assistant turn differently from its generation prompt")
    rest = after[len(before):]
    end = next((i for i, token in enumerate(rest) if token in end_ids), None)
    if end is None:
        raise ValueError(f"the chat template ends an assistant turn with none of the end tokens {sorted(end_ids)}")
    return rest[: end + 1]


# Words a keyword query leaves out of the question: what a search engine would ignore anyway, and the question words.
STOP_WORDS = frozenset({"a", "an", "the", "of", "in", "on", "at", "to", "for", "from", "by", "with", "as", "and",
    "or", "is", "are", "was", "were", "be", "been", "being", "do", "does", "did", "what", "which", "who", "whom",
    "whose", "when", "where", "why", "how", "that", "this", "these", "those", "it", "its", "there", "their", "his",
    "her", "they", "he", "she", "has", "have", "had", "name"})


def keyword_query(question: str) -> str:
    """The question's content words, the teacher's second query: ``"What year did the Broncos win Super Bowl 50?"``
    -> ``"year Broncos win Super Bowl 50"``."""
    return " ".join(w for w in re.findall(r"[\w'-]+", question) if w.lower() not in STOP_WORDS)


async def scripted_trace(tokenizer, envs, config, sample, end_ids: set[int], second_search: bool = False) -> Rollout:
    """One teacher rollout of ``sample`` in an env of ``envs``: search the question, then answer with the first golden
    answer that the passages contain (the first golden answer when none does; such traces are filtered by
    :func:`keep`). With ``second_search``, passages that hold no golden answer make the teacher search again with the
    question's content words (:func:`keyword_query`) before answering."""
    messages = envs().reset(sample)
    golds = [(gold, normalize_answer(gold)) for gold in sample.golden_answers if normalize_answer(gold)]
    # The replies' rendering does not depend on the passages' text: a placeholder tool message stands for them.
    tool = {"role": "tool", "name": SEARCH_TOOL_NAME, "content": "..."}

    def call(query: str) -> dict:
        return {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": SEARCH_TOOL_NAME, "arguments": {"query": query}}}]}

    first, keywords = call(sample.question), keyword_query(sample.question)
    again = call(keywords)

    def found(token_ids: list[int]) -> list[str]:
        """The golden answers in ``token_ids`` (what a search turn and its result rendered to)."""
        seen = f" {normalize_answer(tokenizer.decode(token_ids, skip_special_tokens=True))} "
        return [gold for gold, normalized in golds if f" {normalized} " in seen]

    def reply(hits: list[str], before: list[dict]) -> list[int]:
        content = (hits or list(sample.golden_answers))[0]
        return assistant_turn_ids(engine, [*messages, *before], {"role": "assistant", "content": content}, end_ids)

    def search(_: list[int]) -> list[int]:
        return assistant_turn_ids(engine, messages, first, end_ids)

    first_result_end = 0  # where the sequence stood when the first search's result was in

    def answer_or_search_again(sequence: list[int]) -> list[int]:
        nonlocal first_result_end
        first_result_end = len(sequence)
        hits = found(sequence[len(engine.transcript.render(messages, add_generation_prompt=True)):])
        if second_search and not hits and keywords not in ("", sample.question):
            return assistant_turn_ids(engine, [*messages, first, tool], again, end_ids)
        return reply(hits, [first, tool])

    def answer_after_the_second_search(sequence: list[int]) -> list[int]:
        return reply(found(sequence[first_result_end:]), [first, tool, again, tool])

    engine = RolloutEngine(tokenizer, ScriptedTurns([search, answer_or_search_again, answer_after_the_second_search]),
                           envs, config)
    return await engine.rollout(sample, SamplingParams.greedy(max_tokens=1 << 20))


def keep(rollout: Rollout) -> bool:
    """A trace to learn from: it searched (once, or twice where the first search held no golden answer), was
    answered, and its answer is in what its searches returned."""
    answer = {normalize_answer(rollout.messages[-1].get("content") or "")}
    return (rollout.status == RolloutStatus.DONE and rollout.num_tool_calls in (1, 2)
            and retrieval_surfaced_gold(rollout.messages, answer)
            and (rollout.num_tool_calls == 1 or not passages_hold_gold(search_results(rollout.messages)[0], answer)))


async def scripted_traces(tokenizer, envs, config, samples, end_ids: set[int], chunk: int = 256,
                          second_search: bool = False) -> list[Rollout]:
    """Teacher rollouts of every sample, ``chunk`` at a time (their searches reach the retriever batched)."""
    rollouts: list[Rollout] = []
    for start in range(0, len(samples), chunk):
        rollouts += await asyncio.gather(*(scripted_trace(tokenizer, envs, config, s, end_ids, second_search)
                                           for s in samples[start:start + chunk]))
    return rollouts


async def warm_start_traces(tokenizer, envs, rollout_config, samples, end_ids: set[int],
                            config) -> tuple[list[Rollout], list[Rollout]]:
    """The teacher's rollouts of ``samples`` and those :func:`keep` accepts; ``config`` is the recipe's
    :class:`~searchr1_trl.training.warm_start.WarmStartConfig`. Closes ``envs``' connections when done."""
    if rollout_config.max_turns < 2 + config.second_search:
        raise ValueError(f"warm_start_traces={config.num_traces} teaches a search then an answer"
                         f"{' (with a second search between them)' if config.second_search else ''}, "
                         f"{2 + config.second_search} turns, but max_turns={rollout_config.max_turns}: raise max_turns "
                         "or set warm_start_traces 0")
    try:
        rollouts = await scripted_traces(tokenizer, envs, rollout_config, samples, end_ids,
                                         second_search=config.second_search)
    finally:
        await envs.aclose()
    return rollouts, [r for r in rollouts if keep(r)]
