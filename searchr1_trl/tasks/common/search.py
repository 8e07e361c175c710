"""The ``search`` tool both Search-R1 protocols call: a query becomes passages, counted.

:class:`SearchEnvFactory` is what the tool-call task (``tasks/search_r1``) and the paper's tag protocol
(``tasks/search_r1_tags``) share: one pooled, batching, retrying
:class:`~searchr1_trl.tasks.common.retrieval.RetrievalClient`, the knobs (:class:`SearchR1EnvConfig`) and the counters;
a task's own factory only says how a call is written and how the rollout's messages read. A search result is the top
``topk`` passages, one per line: ``Doc 1(Title: <title>) <text>``; with ``restate_question`` they are followed by
:data:`RESTATEMENT` (the answer format and the question again), for small models that lose the question behind long
passages (Qwen2.5-Coder-0.5B, greedy, right after one search: EM 0/24 without it, 2/24 with it, 12/24 with the same
passages pasted into the prompt; ``experiments/probes/answer_formats.py``). With ``exclude_seen_passages`` a search
skips the passages its rollout was already shown, so searching again reads the next ones.

A search the retriever did not answer, all retries spent, is an outage, not "no hits": when every search of a step
failed the step says so (``EnvStep.tool_failed``) and the rollout ends as ``error_tool``, out of the loss; a failed
search beside answered ones gets an empty result. An empty query sends nothing and gets :data:`EMPTY_QUERY_MESSAGE`.
All of it is counted in :meth:`SearchEnvFactory.metrics`, so the model learns a call was wrong and the logs show how
often it happens.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field

from searchr1_trl.engine.rollout import EnvFactory
from searchr1_trl.tasks.common.retrieval import RetrievalClient, RetrievalConfig, is_text, passages_text

SEARCH_TOOL_NAME = "search"

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


def query_from_arguments(arguments: dict | str | None) -> str:
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


class SearchEnvFactory(EnvFactory):
    """The environments of a search task around one pooled :class:`RetrievalClient`, with its counters; a subclass
    builds the per-rollout env and says how a call reads."""

    counters: tuple[str, ...] = ("empty_queries", "failed_steps")  # what metrics() reports, besides the retrieval's

    def __init__(self, config: SearchR1EnvConfig | None = None):
        self.config = config or SearchR1EnvConfig()
        self.retrieval = RetrievalClient(self.config)
        self._counts: Counter[str] = Counter()

    async def search(self, query: str, question: str, seen: set[str]) -> tuple[str, bool | None]:
        """The tool's answer to ``query`` (passages, then the restatement of ``question`` when asked for) and whether
        the retriever failed (None: nothing was searched, the query was empty). The passages found join ``seen``,
        and those in it already are skipped with ``exclude_seen_passages``."""
        if not query:
            self._counts["empty_queries"] += 1
            return EMPTY_QUERY_MESSAGE, None
        skip = frozenset(seen) if self.config.exclude_seen_passages else frozenset()
        docs = await self.retrieval.search_passages(query, skip=skip)
        seen.update(doc["contents"] for doc in docs or ())
        content = passages_text(docs, self.config.max_passage_chars)
        if content and self.config.restate_question:
            content = f"{content}\n\n{RESTATEMENT.format(question=question)}"
        return content, not content

    def count(self, name: str, n: int = 1) -> None:
        """Add ``n`` to the counter ``name`` of :meth:`metrics` (what the rollouts' envs report)."""
        self._counts[name] += n

    def metrics(self) -> dict[str, float]:
        counts, self._counts = self._counts, Counter()
        return {**self.retrieval.metrics(), **{f"search/{name}": counts[name] for name in self.counters}}

    async def aclose(self) -> None:
        await self.retrieval.aclose()
