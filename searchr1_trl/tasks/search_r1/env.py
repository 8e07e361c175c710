"""The Search-R1 environment: where a question becomes a prompt and a tool call becomes passages.

The prompt is one user message, :data:`INSTRUCTION` then the question; the chat template adds :data:`SEARCH_TOOL`
to the system message (Qwen2.5 and Qwen3 inject tools there, so keeping the instruction in the user message leaves
the template's own system prompt intact). A turn without tool calls is the final answer and ends the rollout; a
turn with tool calls gets one ``tool`` message per call, all calls run concurrently. A search result is the top
``topk`` passages, one per line: ``Doc 1(Title: <title>) <text>``; with ``restate_question`` they are followed by
:data:`RESTATEMENT` (the answer format and the question again), for small models that lose the question behind
long passages (Qwen2.5-Coder-0.5B, greedy, right after one search: EM 0/24 without it, 2/24 with it, 12/24 with
the same passages pasted into the prompt; ``experiments/probes/answer_formats.py``). With ``exclude_seen_passages`` a
search skips the passages its rollout was already shown, so searching again reads the next ones.

Each rollout has its own :class:`SearchR1Env`, which holds its sample (the restatement reads the question from it,
not from the prompt); :class:`SearchR1EnvFactory` builds them around what they share: one pooled, batching,
retrying :class:`~searchr1_trl.tasks.search_r1.retrieval.RetrievalClient` and the counters. A search the retriever did
not answer, all retries spent, is an outage, not "no hits": when every search of a step failed the step says so
(``EnvStep.tool_failed``) and the rollout ends as ``error_tool``, out of the loss; a failed search beside answered
ones gets an empty result. Both are counted in :meth:`SearchR1EnvFactory.metrics`.

Malformed calls are answered, not raised: arguments that are not a JSON object with a non-empty string ``query``
(whether they arrive as a dict or a JSON string) send nothing and get :data:`EMPTY_QUERY_MESSAGE`; a call of any
other tool gets a message naming the unknown tool. Both are counted, so the model learns the call was wrong and the
logs show how often it happens.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from dataclasses import dataclass, field

from searchr1_trl.engine.rollout import EnvFactory, EnvStep, MessageEnv
from searchr1_trl.tasks.search_r1.retrieval import RetrievalClient, RetrievalConfig, is_text, passages_text, valid_text

SEARCH_TOOL_NAME = "search"

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

RESTATEMENT = (
    "Answer the question using the passages above. Reply with only the answer: an entity or a short phrase.\n\n"
    "Question: {question}"
)

QUESTION_SEPARATOR = "\n\nQuestion: "

EMPTY_QUERY_MESSAGE = 'Error: search needs a non-empty string argument "query"; nothing was searched.'


@dataclass
class SearchR1EnvConfig(RetrievalConfig):
    restate_question: bool = field(
        default=False,
        metadata={"help": "End every search result with the answer format and the question again (small models "
                          "lose the question behind long passages; off in the seed recipes)."},
    )
    exclude_seen_passages: bool = field(
        default=False,
        metadata={"help": "A search returns only passages this rollout has not been shown, so searching again pages "
                          "on to the next ones instead of repeating them (off in the seed: a repeated query gets the "
                          "same passages). Over the SQuAD-open corpus a second page (ranks 4-6) holds a golden answer "
                          "for 0.082 of the questions whose top 3 do not (0.716 -> 0.798 of the report sample)."},
    )


def _query_from_arguments(arguments: dict | str | None) -> str:
    """The ``query`` argument of a search call, stripped; "" when missing, empty, not valid text (a lone surrogate),
    not a string or unparseable (also nested too deep for the JSON parser, or an integer too long to convert).

    ``{"query": " Eiffel Tower "}`` and ``'{"query": "Eiffel Tower"}'`` -> ``"Eiffel Tower"``; ``'{"query'`` -> ``""``.
    """
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):  # ValueError: not JSON, or an integer over 4,300 digits
            return ""  # counted by the caller as an empty query
    query = arguments.get("query") if isinstance(arguments, dict) else None
    return query.strip() if isinstance(query, str) and is_text(query) else ""


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
        restate = self.factory.config.restate_question
        restatement = RESTATEMENT.format(question=self.sample.question) if restate else ""
        seen = self.seen if self.factory.config.exclude_seen_passages else set()
        answers = await asyncio.gather(*(self.factory.run_tool_call(call, restatement, seen) for call in calls))
        searched = [failed for _, failed in answers if failed is not None]
        outage = bool(searched) and all(searched)
        self.factory.count("failed_steps", outage)
        return EnvStep(messages=[message for message, _ in answers], done=False, tool_failed=outage)


class SearchR1EnvFactory(EnvFactory):
    """A :class:`SearchR1Env` per rollout around one pooled :class:`RetrievalClient`; counts malformed calls."""

    def __init__(self, config: SearchR1EnvConfig | None = None):
        self.config = config or SearchR1EnvConfig()
        self.tools = [SEARCH_TOOL]
        self.retrieval = RetrievalClient(self.config)
        self._counts: Counter[str] = Counter()

    def __call__(self) -> SearchR1Env:
        return SearchR1Env(self)

    async def run_tool_call(self, call: dict, restatement: str, seen: set[str]) -> tuple[dict, bool | None]:
        """The tool message answering one call (``restatement``, if any, follows the passages of a search), and
        whether its search failed (None: nothing was searched). The passages found join ``seen``, and those in it
        already are skipped: with ``exclude_seen_passages`` it is the rollout's own set, else an empty one."""
        function = call.get("function") or {}
        name = function.get("name")
        # What the model wrote, as text the chat template can render (str() of deep nesting would recurse).
        shown = valid_text(name)[:200] if isinstance(name, str) else f"<{type(name).__name__}>"
        failed = None
        if name != SEARCH_TOOL_NAME:
            self._counts["unknown_tool_calls"] += 1
            content = f'Error: unknown tool {shown!r}; the only tool is "{SEARCH_TOOL_NAME}".'
        elif query := _query_from_arguments(function.get("arguments")):
            docs = await self.retrieval.search_passages(query, skip=frozenset(seen))
            seen.update(doc["contents"] for doc in docs or ())
            content = passages_text(docs, self.config.max_passage_chars)
            failed = not content
            if content and restatement:
                content = f"{content}\n\n{restatement}"
        else:
            self._counts["empty_queries"] += 1
            content = EMPTY_QUERY_MESSAGE
        tool_message = {"role": "tool", "name": shown, "content": content}
        if isinstance(call.get("id"), str) and call["id"]:
            tool_message["tool_call_id"] = valid_text(call["id"])
        return tool_message, failed

    def count(self, name: str, n: int = 1) -> None:
        """Add ``n`` to the counter ``name`` of :meth:`metrics` (what the rollouts' envs report)."""
        self._counts[name] += n

    def metrics(self) -> dict[str, float]:
        counts, self._counts = self._counts, Counter()
        return {
            **self.retrieval.metrics(),
            "search/empty_queries": counts["empty_queries"],
            "search/unknown_tool_calls": counts["unknown_tool_calls"],
            "search/failed_steps": counts["failed_steps"],
        }

    async def aclose(self) -> None:
        await self.retrieval.aclose()
