"""The Search-R1 environment with native tool calls: where a question becomes a prompt and a ``search`` call becomes
passages.

The prompt is one user message, :data:`INSTRUCTION` then the question; the chat template adds :data:`SEARCH_TOOL`
to the system message (Qwen2.5 and Qwen3 inject tools there, so keeping the instruction in the user message leaves
the template's own system prompt intact). A turn without tool calls is the final answer and ends the rollout; a
turn with tool calls gets one ``tool`` message per call, all calls run concurrently, each answered by the shared
search tool (:mod:`searchr1_trl.tasks.common.search`: passages, restatement, outages and counters).

Malformed calls are answered, not raised: arguments that are not a JSON object with a non-empty string ``query``
(whether they arrive as a dict or a JSON string) send nothing and get the empty-query message; a call of any other
tool gets a message naming the unknown tool. Both are counted.
"""

from __future__ import annotations

import asyncio

from searchr1_trl.engine.rollout import EnvStep, MessageEnv
from searchr1_trl.tasks.common.retrieval import valid_text
from searchr1_trl.tasks.common.search import (
    QUESTION_SEPARATOR,
    SEARCH_TOOL_NAME,
    SearchEnvFactory,
    query_from_arguments,
)

SEARCH_TOOL: dict = {
    "type": "function",
    "function": {
        "name": SEARCH_TOOL_NAME,
        "description": (
            "Search a Wikipedia-derived knowledge base and return the top passages for a query. "
            "Use it whenever you need external facts to answer the question."
        ),
        "parameters": {
            "type": "object",
            "properties": {"query": {"type": "string", "description": "The natural-language search query."}},
            "required": ["query"],
        },
    },
}

INSTRUCTION = (
    "Answer the question below. Whenever you are not sure of a fact, call the search tool to look it up; you may "
    "search several times. When you know the answer, reply with only the answer: an entity or a short phrase, "
    "not a sentence and no explanation (for example: Beijing)."
)


class SearchR1Env(MessageEnv):
    """One Search-R1 rollout: its sample's question as the prompt, ``search`` as the only tool; built by
    :class:`SearchR1EnvFactory`, whose retrieval client and counters every rollout shares."""

    def __init__(self, factory: SearchR1EnvFactory):
        self.factory = factory
        self.sample = None
        self.seen: set[str] = set()  # contents of the passages this rollout's searches returned

    def reset(self, sample) -> list[dict]:
        self.sample = sample
        return [{"role": "user", "content": f"{INSTRUCTION}{QUESTION_SEPARATOR}{sample.question}"}]

    async def step(self, messages: list[dict]) -> EnvStep:
        calls = messages[-1].get("tool_calls") or []
        if not calls:
            return EnvStep(messages=[], done=True)
        answers = await asyncio.gather(*(self.factory.run_tool_call(call, self.sample.question, self.seen)
                                         for call in calls))
        searched = [failed for _, failed in answers if failed is not None]
        outage = bool(searched) and all(searched)
        self.factory.count("failed_steps", outage)
        return EnvStep(messages=[message for message, _ in answers], done=False, tool_failed=outage)


class SearchR1EnvFactory(SearchEnvFactory):
    """A :class:`SearchR1Env` per rollout, ``search`` as a function tool; counts calls of unknown tools too."""

    counters = (*SearchEnvFactory.counters, "unknown_tool_calls")

    def __init__(self, config=None):
        super().__init__(config)
        self.tools = [SEARCH_TOOL]

    def __call__(self) -> SearchR1Env:
        return SearchR1Env(self)

    async def run_tool_call(self, call: dict, question: str, seen: set[str]) -> tuple[dict, bool | None]:
        """The tool message answering one call, and whether its search failed (None: nothing was searched)."""
        function = call.get("function") or {}
        name = function.get("name")
        # What the model wrote, as text the chat template can render (str() of deep nesting would recurse).
        shown = valid_text(name)[:200] if isinstance(name, str) else f"<{type(name).__name__}>"
        if name != SEARCH_TOOL_NAME:
            self.count("unknown_tool_calls")
            content, failed = f'Error: unknown tool {shown!r}; the only tool is "{SEARCH_TOOL_NAME}".', None
        else:
            content, failed = await self.search(query_from_arguments(function.get("arguments")), question, seen)
        tool_message = {"role": "tool", "name": shown, "content": content}
        if isinstance(call.get("id"), str) and call["id"]:
            tool_message["tool_call_id"] = valid_text(call["id"])
        return tool_message, failed
