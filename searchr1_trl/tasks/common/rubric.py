"""The reward of every task here: exact match (EM) of the final answer against the golden answers.

Pure EM 0/1 by default; opt-in levers put the search behaviour and near misses into the gradient:

- ``no_search_penalty`` (0.0) is subtracted from a correct answer given without any ``search`` call, so answering
  from memory earns less than answering after searching (against closed-book reward hacking);
- ``retrieval_score`` (0.0) is partial credit when the answer is wrong or missing but a search result contained a
  golden answer as whole words (rewards finding the fact even when the model failed to use it);
- ``answer_f1`` (0.0) is partial credit for a wrong answer in proportion to its SQuAD token F1 against the best
  golden answer. Unlike ``retrieval_score`` it pays only for what the answer says: a policy that learns to end its
  rollouts with any text after a lucky search (observed with the offline 0.5B model) gains nothing from it.

=========================================================  ===============================
rollout                                                    reward
=========================================================  ===============================
correct, searched                                          ``score`` (1.0)
correct, never searched                                    ``score - no_search_penalty``
wrong or no answer                                         the larger of ``retrieval_score`` (if a search
                                                           result holds a golden answer) and ``answer_f1 x F1``
anything else                                              0.0
=========================================================  ===============================

The final answer is what the task's ``answer`` reader finds in the conversation; by default (:func:`final_answer`, the
tool-call protocol) the content of the last assistant message, none when the rollout ended on a tool call or on
empty content. Answers and golden answers are compared after SQuAD normalisation, exactly as the official
SQuAD script does it, so EM numbers stay comparable with published Search-R1 results.

A :class:`Rubric` sums weighted reward functions and gives ``truncation_reward`` (0.0) to rollouts a budget cut
short, and none at all (None) to a rollout that ended because the retriever did not answer (``error_tool``), so an
outage neither counts as a wrong answer nor moves its group's baseline. It scores each
:class:`~searchr1_trl.engine.rollout.Rollout` from its own sample on every path: as a TRL reward function it takes
``rollout`` (the trainer's rollout function hands each completion's on as an extra field), and :meth:`Rubric.score`
takes one. Its reward functions are TRL reward functions too: ``fn(prompts, completions, *, messages,
golden_answers, status=None, **kwargs) -> list[float]``, where ``messages`` is the whole conversation of each
completion and ``status`` its :class:`~searchr1_trl.engine.rollout.RolloutStatus` (or its value), all read by the
rubric from the rollouts. """

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from searchr1_trl.engine.rollout import RolloutStatus
from searchr1_trl.tasks.common.search import SEARCH_TOOL_NAME

_PUNCTUATION = frozenset(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")


def normalize_answer(text: str) -> str:
    """SQuAD normalisation: lowercase, drop punctuation, drop a/an/the, collapse whitespace.

    ``"The  Eiffel Tower!"`` -> ``"eiffel tower"``; punctuation is deleted, not spaced, as in SQuAD:
    ``"Eiffel-Tower"`` -> ``"eiffeltower"``.
    """
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def final_answer(messages: Sequence[dict]) -> str | None:
    """The last assistant message's content, stripped; None if it made tool calls or is empty."""
    for message in reversed(messages):
        if message.get("role") == "assistant":
            if message.get("tool_calls"):
                return None
            return (message.get("content") or "").strip() or None
    return None


def token_f1(answer: str, gold: str) -> float:
    """SQuAD token F1 of two normalised strings: ``token_f1("denver broncos team", "denver broncos")`` -> 0.8."""
    answer_tokens, gold_tokens = answer.split(), gold.split()
    common = sum((Counter(answer_tokens) & Counter(gold_tokens)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(answer_tokens), common / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def _made_search_call(messages: Sequence[dict]) -> bool:
    """Whether any assistant message called the ``search`` tool."""
    return any(
        (call.get("function") or {}).get("name") == SEARCH_TOOL_NAME
        for message in messages
        if message.get("role") == "assistant"
        for call in message.get("tool_calls") or []
    )


def passages_hold_gold(passages: str, golds: set[str]) -> bool:
    """Whether a normalised golden answer appears as whole words in normalised passages.

    ``{"ten"}`` is found in ``"Doc 1(Title: Ten) ten pins"`` but not in ``"Doc 1(Title: Tennis) tennis"``.
    """
    # Pad with spaces so the match is on whole words: " ten " is not inside " tennis ".
    padded = f" {normalize_answer(passages)} "
    return any(f" {gold} " in padded for gold in golds)


def search_results(messages: Sequence[dict]) -> list[str]:
    """The text of every ``search`` tool message, in order."""
    return [m.get("content") or "" for m in messages
            if m.get("role") == "tool" and m.get("name") == SEARCH_TOOL_NAME]


def retrieval_surfaced_gold(messages: Sequence[dict], golds: set[str]) -> bool:
    """Whether any search result holds a normalised golden answer (:func:`passages_hold_gold`)."""
    return any(passages_hold_gold(result, golds) for result in search_results(messages))


def normalized_golds(golden_answers: Sequence[str]) -> set[str]:
    """Normalised golden answers, without those that normalise to nothing (``"The"`` would match every answer)."""
    return {gold for gold in map(normalize_answer, golden_answers) if gold}


@dataclass
class RewardExactMatchConfig:
    score: float = field(default=1.0, metadata={"help": "Reward of a correct final answer given after searching."})
    no_search_penalty: float = field(
        default=0.0,
        metadata={"help": "Subtracted from a correct answer given without any search call (0.0: pure EM)."},
    )
    retrieval_score: float = field(
        default=0.0,
        metadata={"help": "Reward of a wrong or missing answer when a search result held a golden answer "
                          "(0.0: pure EM)."},
    )
    answer_f1: float = field(
        default=0.0,
        metadata={"help": "Reward of a wrong answer per unit of its token F1 against the best golden answer "
                          "(0.0: pure EM)."},
    )
    weight: float = field(default=1.0, metadata={"help": "Weight of this reward in the rubric's sum."})


AnswerReader = Callable[[Sequence[dict]], str | None]


class RewardExactMatch:
    """Exact match of the final answer (``answer``: the task's reader) against any golden answer, with the levers of
    the module docstring."""

    def __init__(self, config: RewardExactMatchConfig | None = None, answer: AnswerReader = final_answer):
        self.config = config or RewardExactMatchConfig()
        self.answer = answer
        self.weight = self.config.weight
        self.__name__ = "exact_match"  # the name TRL logs this reward under

    def _normalized_answer(self, messages: Sequence[dict]) -> str | None:
        """The final answer after SQuAD normalisation; None when there is none."""
        answer = self.answer(messages)
        return normalize_answer(answer) if answer is not None else None

    def correct(self, messages: Sequence[dict], golden_answers: Sequence[str]) -> bool:
        """Whether the final answer is a golden answer (plain EM: what validation measures, no levers)."""
        return self._normalized_answer(messages) in normalized_golds(golden_answers)

    def score(self, messages: Sequence[dict], golden_answers: Sequence[str]) -> float:
        """The reward of one conversation."""
        golds = normalized_golds(golden_answers)
        normalized = self._normalized_answer(messages)
        if normalized in golds:
            if _made_search_call(messages):
                return self.config.score
            return self.config.score - self.config.no_search_penalty
        partial = 0.0
        if self.config.retrieval_score and retrieval_surfaced_gold(messages, golds):
            partial = self.config.retrieval_score
        if self.config.answer_f1 and normalized is not None and golds:
            partial = max(partial, self.config.answer_f1 * max(token_f1(normalized, g) for g in golds))
        return partial

    def __call__(self, prompts, completions, *, messages, golden_answers, status=None, log_metric=None,
                 **kwargs) -> list[float]:
        """The rewards; with TRL's ``log_metric``, also ``rubric/correct``: the fraction answered exactly right, the
        training counterpart of validation EM (the reward mixes in partial credit)."""
        if log_metric is not None:
            hits = [self.correct(m, g) for m, g in zip(messages, golden_answers, strict=True)]
            log_metric("rubric/correct", sum(hits) / len(hits))
        return [self.score(m, g) for m, g in zip(messages, golden_answers, strict=True)]


RewardFn = Callable[..., list[float]]


@dataclass
class RubricConfig:
    """Knobs of :class:`Rubric` itself (each reward function has its own)."""

    truncation_reward: float = field(
        default=0.0, metadata={"help": "Reward of a rollout a budget cut short (it has no final answer to score)."}
    )


class Rubric:
    """Weighted sum of reward functions; a truncated rollout gets ``truncation_reward`` instead.

    A reward function's weight is its ``weight`` attribute (1.0 if it has none). As a TRL reward function the
    rubric returns the total and, when TRL passes ``log_metric``, logs each reward function's batch mean
    (``rubric/<name>``) and the truncated fraction (``rubric/truncated``), and hands ``log_metric`` on to the reward
    functions for their own metrics (:class:`RewardExactMatch`: ``rubric/correct``), so
    ``GRPOTrainer(reward_funcs=[rubric])`` trains on exactly :meth:`score` while every part stays visible.
    """

    def __init__(self, reward_fns: Sequence[RewardFn] | None = None,
                 truncation_reward: float = RubricConfig.truncation_reward):
        self.reward_fns = list(reward_fns) if reward_fns is not None else [RewardExactMatch()]
        self.truncation_reward = truncation_reward
        self.__name__ = "rubric"

    def __call__(self, prompts, completions, *, rollout: Sequence[Any], log_metric=None,
                 **kwargs) -> list[float | None]:
        """The rewards of each completion's ``rollout``, from its conversation, status and own sample's golden
        answers; TRL's copies of those (row columns, extra fields) are not read."""
        own = {"messages": [r.messages for r in rollout], "status": [r.status for r in rollout],
               "golden_answers": [r.sample.golden_answers for r in rollout]}
        kwargs = {key: value for key, value in kwargs.items() if key not in own}
        truncated = [RolloutStatus(s).truncated for s in own["status"]]
        outage = [RolloutStatus(s) is RolloutStatus.ERROR_TOOL for s in own["status"]]
        totals = [self.truncation_reward if t else 0.0 for t in truncated]
        for fn in self.reward_fns:
            scores = fn(prompts, completions, **own, rollout=rollout, log_metric=log_metric, **kwargs)
            weight = getattr(fn, "weight", 1.0)
            totals = [total if t else total + weight * s for total, t, s in zip(totals, truncated, scores, strict=True)]
            if log_metric is not None:
                log_metric(f"rubric/{fn.__name__}", sum(scores) / len(scores))
        if log_metric is not None:
            log_metric("rubric/truncated", sum(truncated) / len(truncated))
            log_metric("rubric/unscored_tool_failures", sum(outage) / len(outage))
        # None: TRL (1.16) leaves an unscorable completion out of its group's baseline and gives it no advantage.
        return [None if failed else total for total, failed in zip(totals, outage, strict=True)]

    def score(self, rollout: Any) -> float | None:
        """The reward of one :class:`~searchr1_trl.engine.rollout.Rollout` (its sample carries ``golden_answers``);
        None for one the retriever did not answer."""
        return self([None], [None], rollout=[rollout])[0]
