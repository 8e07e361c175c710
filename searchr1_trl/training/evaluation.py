"""Evaluation: greedy exact match of a policy on held-out questions, tabulated the way the Search-R1 paper does.

One definition and one path, shared by the trainer's validation (:meth:`SearchR1Trainer.evaluate`) and
``searchr1-eval``:

- **EM** is :meth:`~searchr1_trl.tasks.common.rubric.RewardExactMatch.correct`: the SQuAD-normalised final answer (as
  the task reads it) is one of the normalised golden answers. It is the rubric's plain EM, without the training
  reward's levers.
- **Rollouts** go through the :class:`~searchr1_trl.engine.rollout.RolloutEngine` with the recipe's budgets, greedy
  (:func:`greedy_params`), as many at once as the generator takes; each finished one is handed to ``on_trace`` at
  once, so a caller can write it down before the next finishes (that is what makes ``searchr1-eval`` resumable).

Three methods, as in the paper's table (:data:`METHODS`; a task says which it supports, ``Task.methods``); they
differ only in the prompt and the tools:

- ``direct``: closed-book. The question and the answer format (:data:`DIRECT_INSTRUCTION`), no tool, one turn.
- ``rag``: retrieve-then-read. The top-k passages for the question, from the same retriever with the same top-k as
  the agent, pasted into the prompt and followed by the answer format and the question
  (:data:`~searchr1_trl.tasks.common.search.RESTATEMENT`), no tool, one turn.
- ``agent``: the task's rollout, the one the policy is trained on (``Task.envs``), read by the task's ``answer``.

A :class:`Trace` is one question's record: the answer, EM, each search (query and passage titles; for ``rag`` the
one retrieval in the prompt), turns, how the rollout ended and the whole conversation. :func:`summarize` turns
traces into EM overall and per data source, searches and turns per rollout, and the fraction of rollouts ending in
each :class:`~searchr1_trl.engine.rollout.RolloutStatus`.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import httpx

from searchr1_trl.engine.generation import Generator, SamplingParams, VLLMServerGenerator, end_token_ids
from searchr1_trl.engine.in_process import TransformersGenerator
from searchr1_trl.engine.rollout import EnvFactory, EnvStep, MessageEnv, RolloutConfig, RolloutEngine, RolloutStatus
from searchr1_trl.tasks import Task
from searchr1_trl.tasks.common.retrieval import RetrievalClient
from searchr1_trl.tasks.common.rubric import (
    RewardExactMatch,
    final_answer,
    normalize_answer,
    normalized_golds,
    passages_hold_gold,
    search_results,
    token_f1,
)
from searchr1_trl.tasks.common.search import QUESTION_SEPARATOR, RESTATEMENT, SearchR1EnvConfig, query_from_arguments
from searchr1_trl.training.checkpoints import ModelFolder, check_model_folder

METHODS = ("direct", "rag", "agent")

# A trace's status when one of its searches got no answer from the retriever (an outage, not "no hits"): it is not
# scored, a rerun of searchr1-eval generates it again, and the table counts it.
SEARCH_FAILED = "error_search"

DIRECT_INSTRUCTION = (
    "Answer the question below. Reply with only the answer: an entity or a short phrase, not a sentence and no "
    "explanation (for example: Beijing)."
)

_TITLE = re.compile(r"^Doc \d+\(Title: (.*?)\) ", re.MULTILINE)


def greedy_params(max_tokens_per_turn: int) -> SamplingParams:
    """How every evaluation turn is generated: greedy, so a checkpoint has one score."""
    return SamplingParams.greedy(max_tokens=max_tokens_per_turn)


def exact_match(messages: Sequence[dict], golden_answers: Sequence[str], answer=final_answer) -> bool:
    """Whether the conversation's final answer (``answer``: the task's reader) is a golden answer (the EM of every
    table and log)."""
    return RewardExactMatch(answer=answer).correct(messages, golden_answers)


def answer_f1(messages: Sequence[dict], golden_answers: Sequence[str], answer=final_answer) -> float:
    """SQuAD token F1 of the final answer (``answer``: the task's reader) against its best golden answer (0 without
    one): the partial credit every table shows beside EM. ``"Denver Broncos team"`` against ``["Denver Broncos"]`` ->
    0.8."""
    answer, golds = answer(messages), normalized_golds(golden_answers)
    if answer is None or not golds:
        return 0.0
    return max(token_f1(normalize_answer(answer), gold) for gold in golds)


def passage_titles(passages: str) -> list[str]:
    """The titles of formatted passages: ``"Doc 1(Title: Paris) The capital..."`` -> ``["Paris"]``."""
    return _TITLE.findall(passages)


@dataclass
class Trace:
    """One question answered by one method; what a JSONL trace line holds."""

    question: str
    golden_answers: list[str]
    data_source: str
    method: str
    answer: str | None  # the final answer; None when the rollout ended without one
    em: bool  # False when a search failed: such a trace is not scored
    searches: list[dict]  # [{"query": str, "titles": [str, ...], "failed": bool}] in order
    num_turns: int
    status: str  # a RolloutStatus value, or SEARCH_FAILED
    messages: list[dict] = field(default_factory=list)
    gold_in_first_search: bool | None = None  # whether the first search's passages hold a golden answer; None: none
    closed_turns: int = 0  # tool calls the engine closed (``close_tool_calls``): what the model leaves to the engine
    f1: float = 0.0  # token F1 of the answer (answer_f1); 0 when a search failed


def _searches(messages: Sequence[dict], outage: bool = False) -> list[dict]:
    """Each search call's query with the titles of the passages it got back, in call order.

    A tool message answers the earliest unanswered call; a call cut off before its answer has no titles. A call
    answered with an empty message is ``failed``: the env answers so a search the retriever did not answer (every
    other answer, an error message included, has text); with ``outage`` (the rollout ended as ``error_tool``) so are
    the unanswered calls of its last step, whose answers were dropped with it.
    """
    calls, answers = [], []
    for message in messages:
        if message["role"] == "assistant":
            for call in message.get("tool_calls") or []:
                function = call.get("function") or {}
                calls.append({"query": query_from_arguments(function.get("arguments")), "titles": [],
                              "failed": outage})
        elif message["role"] == "tool":
            answers.append(message.get("content") or "")
    # A rollout cut after its last calls has fewer tool messages than calls: those calls keep no titles.
    for call, answer in zip(calls, answers, strict=False):
        call["titles"], call["failed"] = passage_titles(answer), not answer
    return calls


def _gold_in(passages: str | None, golden_answers: Sequence[str]) -> bool | None:
    """Whether the first search's ``passages`` hold a golden answer as whole words; None when nothing was searched."""
    return None if passages is None else passages_hold_gold(passages, normalized_golds(golden_answers))


def _made_second_query(trace: Trace) -> bool:
    """Whether a later search asked something other than the first (after SQuAD normalisation)."""
    queries = [normalize_answer(search["query"] or "") for search in trace.searches]
    return any(query != queries[0] for query in queries[1:])


class OneTurnEnv(MessageEnv):
    """No tools, one turn: the first assistant message is the final answer. The prompt is the closed-book one
    unless the caller passes its own messages (``rag``)."""

    def reset(self, sample) -> list[dict]:
        return [{"role": "user", "content": f"{DIRECT_INSTRUCTION}{QUESTION_SEPARATOR}{sample.question}"}]

    async def step(self, messages: list[dict]) -> EnvStep:
        return EnvStep(messages=[], done=True)


class OneTurnEnvs(EnvFactory):
    """A :class:`OneTurnEnv` per rollout; no tools, nothing shared."""

    def __init__(self):
        self.tools: list[dict] = []

    def __call__(self) -> OneTurnEnv:
        return OneTurnEnv()


class Method:
    """One row kind of the table: an engine (prompt, tools, budgets), how its final answer reads, and, for ``rag``,
    the retrieval it reads."""

    def __init__(self, name: str, engine: RolloutEngine, retrieval: RetrievalClient | None = None,
                 answer=final_answer):
        if name not in METHODS:
            raise ValueError(f"method {name!r}; expected one of {', '.join(METHODS)}")
        self.name, self.engine, self.retrieval, self.read_answer = name, engine, retrieval, answer

    async def answer(self, sample, params: SamplingParams) -> Trace:
        """The trace of ``sample``; a trace with a failed search has status :data:`SEARCH_FAILED` and no EM."""
        if self.retrieval is None:
            rollout = await self.engine.rollout(sample, params)
            searches = _searches(rollout.messages, outage=rollout.status == RolloutStatus.ERROR_TOOL)
            gold_first = _gold_in(next(iter(search_results(rollout.messages)), None), sample.golden_answers)
        else:
            passages = await self.retrieval.search(sample.question)
            prompt = f"{passages}\n\n{RESTATEMENT.format(question=sample.question)}"
            rollout = await self.engine.rollout(sample, params, messages=[{"role": "user", "content": prompt}])
            searches = [{"query": sample.question, "titles": passage_titles(passages), "failed": not passages},
                        *_searches(rollout.messages)]
            gold_first = _gold_in(passages, sample.golden_answers)
        failed = any(search["failed"] for search in searches)
        return Trace(
            question=sample.question, golden_answers=list(sample.golden_answers),
            data_source=sample.data_source or "all", method=self.name, answer=self.read_answer(rollout.messages),
            em=not failed and exact_match(rollout.messages, sample.golden_answers, self.read_answer), searches=searches,
            f1=0.0 if failed else answer_f1(rollout.messages, sample.golden_answers, self.read_answer),
            num_turns=rollout.num_turns, status=SEARCH_FAILED if failed else rollout.status.value,
            messages=rollout.messages, gold_in_first_search=None if failed else gold_first,
            closed_turns=rollout.closed_turns,
        )

    async def aclose(self) -> None:
        if self.retrieval is not None:
            await self.retrieval.aclose()
        await self.engine.envs.aclose()


def build_method(name: str, task: Task, tokenizer, generator: Generator, env_config: SearchR1EnvConfig,
                 rollout_config: RolloutConfig) -> Method:
    """The method ``name`` of ``task`` on ``generator``; ``direct`` and ``rag`` get one turn of ``rollout_config``'s
    budgets. ValueError for a method the task does not support."""
    if name not in task.methods:
        raise ValueError(f"method {name!r}; task {task.name} supports {', '.join(task.methods)}")
    if name == "agent":
        return Method(name, RolloutEngine(tokenizer, generator, task.envs(env_config), rollout_config),
                      answer=task.answer)
    one_turn = replace(rollout_config, max_turns=1)
    retrieval = RetrievalClient(env_config) if name == "rag" else None
    return Method(name, RolloutEngine(tokenizer, generator, OneTurnEnvs(), one_turn), retrieval)


async def run(method: Method, samples: Sequence, params: SamplingParams,
              on_trace: Callable[[int, Trace], None] | None = None, max_concurrency: int = 256) -> list[Trace]:
    """Every sample's trace, in input order; ``on_trace(index, trace)`` is called as each one finishes.

    At most ``max_concurrency`` rollouts are in flight, so a long sample starts its first rollouts at once and
    finished traces arrive from the first minutes on, instead of all at the end.
    """
    if max_concurrency < 1:
        raise ValueError(f"expected max_concurrency >= 1, got {max_concurrency}")
    slots = asyncio.Semaphore(max_concurrency)
    traces: list[Trace | None] = [None] * len(samples)

    async def one(index: int, sample) -> None:
        async with slots:
            traces[index] = await method.answer(sample, params)
        if on_trace is not None:
            on_trace(index, traces[index])

    tasks = [asyncio.ensure_future(one(i, s)) for i, s in enumerate(samples)]
    try:
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:  # after a failure, cancel the rest rather than leak them
            task.cancel()
    return traces


def summarize(traces: Sequence[Trace]) -> dict[str, float]:
    """EM and token F1 overall and per data source (``em/<source>``, ``f1/<source>``), searches and turns per rollout,
    status fractions, the number of traces with a failed search (``search_failed``), the calls the engine closed
    (``closed_turns_per_rollout``), and what a search policy learned:
    ``second_query_rate`` (a later search asked something else), ``first_search_missed`` (the first search's
    passages held no golden answer) and ``em_first_search_missed`` (EM of those).

    ``em`` is over all traces but those with a failed search (micro); a table's average over data sources is
    :func:`macro_average`.
    """
    if not traces:
        raise ValueError("no traces to summarize")
    n = len(traces)
    scored = [t for t in traces if t.status != SEARCH_FAILED]
    # A source whose every trace has a failed search still gets its (NaN) column.
    by_source: dict[str, list[Trace]] = {trace.data_source: [] for trace in traces}
    for trace in scored:
        by_source[trace.data_source].append(trace)
    metrics = {
        "em": _mean([t.em for t in scored]),
        "f1": _mean([t.f1 for t in scored]),
        "searches_per_rollout": sum(len(t.searches) for t in traces) / n,
        "turns_per_rollout": sum(t.num_turns for t in traces) / n,
        "closed_turns_per_rollout": sum(t.closed_turns for t in traces) / n,
        **{f"status_{s}": sum(t.status == s for t in traces) / n for s in (*(r.value for r in RolloutStatus),
                                                                                 SEARCH_FAILED)},
        "second_query_rate": sum(_made_second_query(t) for t in traces if t.searches) / n,
        "num_samples": n,
        "search_failed": n - len(scored),
    }
    missed = [t for t in scored if t.gold_in_first_search is False]
    if any(t.gold_in_first_search is not None for t in scored):
        metrics["first_search_missed"] = len(missed) / len(scored)
    if missed:
        metrics["em_first_search_missed"] = sum(t.em for t in missed) / len(missed)
    metrics.update({f"em/{source}": _mean([t.em for t in v]) for source, v in sorted(by_source.items())})
    metrics.update({f"f1/{source}": _mean([t.f1 for t in v]) for source, v in sorted(by_source.items())})
    return metrics


def _mean(values: Sequence[float]) -> float:
    """The mean (of EMs: the fraction right); NaN for none (a source whose every trace failed has no EM)."""
    return sum(values) / len(values) if values else float("nan")


def macro_average(metrics: dict[str, float], metric: str = "em") -> float:
    """The mean of the per-source ``metric`` (em or f1), the paper's "Avg." column (each data source weighs the
    same)."""
    per_source = [value for key, value in metrics.items() if key.startswith(f"{metric}/")]
    return sum(per_source) / len(per_source)


def _served_model(base_url: str) -> str:
    """The model a vLLM server serves (the first it lists)."""
    response = httpx.get(f"{base_url.rstrip('/')}/v1/models", timeout=10.0)
    response.raise_for_status()
    return response.json()["data"][0]["id"]


def _same_model(served: str, checkpoint: str) -> bool:
    """Whether a served model name and a checkpoint name the same model (same string, or the same folder)."""
    if served == checkpoint:
        return True
    served_path, checkpoint_path = Path(served).expanduser(), Path(checkpoint).expanduser()
    return served_path.exists() and served_path.resolve() == checkpoint_path.resolve()


def check_generator(kind: str, checkpoint: str, url: str | None = None) -> ModelFolder:
    """The checked checkpoint; ValueError naming the problem unless it can be generated from: its folder holds a
    model or a LoRA adapter whose base is there (:func:`check_model_folder`), and with ``vllm`` the server at ``url``
    answers and serves it (a whole model: vLLM does not load an adapter folder), with ``transformers`` its config
    loads."""
    if kind not in ("vllm", "transformers"):
        raise ValueError(f"generator={kind!r}; expected 'vllm' or 'transformers'")
    # a vLLM server may serve a model by a name that is no folder here: only the server can say
    served_by_name = kind == "vllm" and not Path(checkpoint).expanduser().exists()
    folder = ModelFolder(checkpoint) if served_by_name else check_model_folder(checkpoint)
    if kind == "vllm" and folder.base_model:
        raise ValueError(f"checkpoint {checkpoint!r} is a LoRA adapter of {folder.base_model!r} and a vLLM server "
                         "serves whole models: use --generator transformers (it loads the adapter on its base model) "
                         "or serve the merged model (peft's merge_and_unload, then save_pretrained)")
    if kind == "vllm":
        try:
            served = _served_model(url)
        except httpx.HTTPError as error:
            raise ValueError(f"vLLM server not reachable at {url} ({error!r}): start `trl vllm-serve --model "
                             f"{checkpoint} --host 127.0.0.1` there or fix vllm_server_base_url") from None
        except (KeyError, IndexError, TypeError, ValueError):
            raise ValueError(f"the server at {url} answers /v1/models with no model list: is it a vLLM server?") \
                from None
        if not _same_model(served, checkpoint):
            raise ValueError(f"the vLLM server at {url} serves {served!r}, not checkpoint {checkpoint!r}")
    else:
        from transformers import AutoConfig

        try:
            AutoConfig.from_pretrained(folder.base_model or checkpoint)
        except (OSError, ValueError) as error:
            raise ValueError(f"checkpoint {checkpoint!r} cannot be loaded: {' '.join(str(error).split())[:300]}") \
                from None
    return folder


def policy_tokenizer(checkpoint: str):
    """The tokenizer of ``checkpoint``, checked first (:func:`check_model_folder`): an empty or missing folder
    would otherwise fail in a traceback that asks to install sentencepiece; a LoRA adapter saved without one uses
    its base model's."""
    from transformers import AutoTokenizer

    source = check_model_folder(checkpoint).tokenizer_source
    try:
        return AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError) as error:  # a Hub id that is not there (or not reachable offline)
        where = "" if Path(source).exists() else " (no local folder of that name, so a Hub id)"
        raise ValueError(f"checkpoint {checkpoint!r}: no tokenizer loads from {source!r}{where}: "
                         f"{' '.join(str(error).split())[:200]}") from None


def policy_generator(kind: str, checkpoint: str, tokenizer, url: str | None = None, dtype: str = "auto",
                     max_concurrency: int = 256) -> Generator:
    """A generator of ``checkpoint``'s policy: ``vllm``, the server at ``url`` (ValueError unless it answers and
    serves that checkpoint), or ``transformers``, the checkpoint loaded in-process (GPU if there is one; ``dtype``
    auto: bfloat16 on GPU, float32 on CPU). Either stops turns at :func:`end_token_ids`."""
    from transformers import GenerationConfig

    check_generator(kind, checkpoint, url)
    if kind == "vllm":
        try:
            generation_config = GenerationConfig.from_pretrained(checkpoint)
        except OSError:  # a checkpoint without generation_config.json: the tokenizer's end tokens only
            generation_config = None
        return VLLMServerGenerator(url, max_concurrency=max_concurrency,
                                   stop_token_ids=end_token_ids(tokenizer, generation_config))
    import torch
    from transformers import AutoModelForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = dtype if dtype != "auto" else ("bfloat16" if device == "cuda" else "float32")
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype).to(device).eval()
    return TransformersGenerator(model, tokenizer, max_batch_size=min(max_concurrency, 64))
