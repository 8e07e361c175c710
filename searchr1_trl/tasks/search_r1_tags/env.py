"""The Search-R1 paper's tag protocol: the model writes one text, searching and answering in tags.

The prompt is the paper's (:data:`INSTRUCTION`, the question stripped and ending in "?", as the paper's data
preparation writes it), one user message the chat template renders where the tokenizer has one (instruct models and
most base ones), or the text as written where it has none (:class:`~searchr1_trl.engine.transcript.TextTranscript`).
The model reasons in ``<think>...</think>``, searches with ``<search> query </search>`` and answers in
``<answer>...</answer>``; a turn ends at ``</search>`` or ``</answer>`` (or an end token), and is read as the paper
reads it (:func:`parse_turn`): its first ``<search>`` or ``<answer>`` block is the action.

- A search is answered by the shared search tool (:mod:`searchr1_trl.tasks.common.search`: passages, outages and
  counters as for the tool-call task) and appended as ``\\n\\n<information>...</information>\\n\\n``: environment
  tokens, out of the loss as tool tokens are.
- An answer ends the rollout; its EM is on the last ``<answer>`` of the final turn (:func:`tag_answer`).
- A turn with neither gets the paper's :data:`INVALID_ACTION` text and the rollout goes on (counted as
  ``search/invalid_actions``), within the same budgets as every task (``max_turns`` and the rest).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from searchr1_trl.engine.rollout import EnvStep, MessageEnv, RolloutConfig
from searchr1_trl.engine.transcript import TextTranscript, Transcript
from searchr1_trl.tasks.common.search import SEARCH_TOOL_NAME, SearchEnvFactory

INSTRUCTION = (
    "Answer the given question. You must conduct reasoning inside <think> and </think> first every time you get new "
    "information. After reasoning, if you find you lack some knowledge, you can call a search engine by <search> query "
    "</search> and it will return the top searched results between <information> and </information>. You can search "
    "as many times as your want. If you find no further external knowledge needed, you can directly provide the "
    "answer inside <answer> and </answer>, without detailed illustrations. For example, <answer> Beijing </answer>. "
    "Question: {question}\n"
)

INVALID_ACTION = (
    "\nMy previous action is invalid. If I want to search, I should put the query between <search> and </search>. "
    "If I want to give the final answer, I should put the answer between <answer> and </answer>. Let me try again.\n"
)

STOP = ("</search>", "</answer>")

_ACTION = re.compile(r"<(search|answer)>(.*?)</\1>", re.DOTALL)
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def paper_question(question: str) -> str:
    """The question as the paper's prompts hold it: stripped, ending in "?" (``"who wrote hamlet"`` ->
    ``"who wrote hamlet?"``)."""
    question = question.strip()
    return question if question.endswith("?") else f"{question}?"


def parse_turn(text: str) -> dict:
    """A turn's text as an assistant message; its first ``<search>`` block is a ``search`` call.

    ``"<think>...</think><search> Eiffel Tower </search>"`` -> a message with the call ``{"query": "Eiffel Tower"}``;
    an answer or an invalid action is a message without calls (the env tells them apart).
    """
    message = {"role": "assistant", "content": text}
    action = _ACTION.search(text)
    if action is not None and action.group(1) == "search":
        call = {"name": SEARCH_TOOL_NAME, "arguments": {"query": action.group(2).strip()}}
        message["tool_calls"] = [{"type": "function", "function": call}]
    return message


def tag_answer(messages: Sequence[dict]) -> str | None:
    """The last ``<answer>`` of the final assistant turn, stripped; None when it has none or it is empty.

    ``"<think>...</think> <answer> Paris </answer>"`` -> ``"Paris"``."""
    turns = [m for m in messages if m.get("role") == "assistant"]
    answers = _ANSWER.findall(turns[-1].get("content") or "") if turns else []
    return (answers[-1].strip() or None) if answers else None


def env_text(message: dict) -> str:
    """What an environment message appends to the text: search results between ``<information>`` tags, anything
    else (the invalid-action note) as it is."""
    if message["role"] == "tool":
        return f"\n\n<information>{message['content'].strip()}</information>\n\n"
    return message["content"]


class SearchR1TagEnv(MessageEnv):
    """One rollout of the tag protocol; built by :class:`SearchR1TagEnvFactory`, whose search tool it shares."""

    def __init__(self, factory: SearchR1TagEnvFactory):
        self.factory, self.sample = factory, None
        self.seen: set[str] = set()  # contents of the passages this rollout's searches returned

    def reset(self, sample) -> list[dict]:
        self.sample = sample
        return [{"role": "user", "content": INSTRUCTION.format(question=paper_question(sample.question))}]

    async def step(self, messages: list[dict]) -> EnvStep:
        turn = messages[-1]
        if calls := turn.get("tool_calls"):
            query = calls[0]["function"]["arguments"]["query"]
            content, failed = await self.factory.search(query, self.sample.question, self.seen)
            self.factory.count("failed_steps", bool(failed))
            reply = {"role": "tool", "name": SEARCH_TOOL_NAME, "content": content}
            return EnvStep(messages=[reply], done=False, tool_failed=bool(failed))
        if _ANSWER.search(turn.get("content") or ""):
            return EnvStep(messages=[], done=True)
        self.factory.count("invalid_actions")
        return EnvStep(messages=[{"role": "user", "content": INVALID_ACTION}], done=False)


class SearchR1TagEnvFactory(SearchEnvFactory):
    """A :class:`SearchR1TagEnv` per rollout, read through a text transcript that stops at the closing tags; no
    function tools (the chat template renders none)."""

    counters = (*SearchEnvFactory.counters, "invalid_actions")

    def __init__(self, config=None):
        super().__init__(config)
        self.tools = []

    def __call__(self) -> SearchR1TagEnv:
        return SearchR1TagEnv(self)

    def transcript(self, tokenizer, config: RolloutConfig) -> Transcript:
        return TextTranscript(tokenizer, parse_turn, env_text, stop=STOP, enable_thinking=config.enable_thinking)
