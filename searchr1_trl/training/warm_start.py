"""Supervised warm start: the search -> answer behaviour taught on scripted traces before GRPO.

A small model that has never used the tool searches the same query again and again or answers at length (the
untrained 0.5B agent answers 22% of validation questions, RAG with the same model scores 0.31 EM more), so GRPO
spends its first steps finding the format instead of learning to read. The warm start writes the traces a teacher
would: search the question as asked, then answer with a golden answer the passages contain. They go through the
training rollout engine itself, so the prompt, the tool message (with its restatement), the tokens and the
environment mask are exactly those of training, against the real retriever; traces whose passages hold no golden
answer are dropped (the teacher would otherwise teach answering without evidence). The policy is then fine-tuned on
its own turns only (TRL's ``SFTTrainer``, ``assistant_masks`` = the rollout's env mask; with ``answer_traces`` most
traces teach the search calls alone, so that GRPO has the reading left to learn) and saved to
``<output_dir>/warm_start``, the model GRPO starts from; with a ``reload`` generator the server loads it at once
(``nccl`` and ``ipc`` push it before the first rollouts anyway).
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from searchr1_trl.engine.generation import Generation, Generator, SamplingParams, end_token_ids
from searchr1_trl.engine.rollout import Rollout, RolloutEngine, RolloutStatus
from searchr1_trl.serving.vllm_server import reload_weights
from searchr1_trl.tasks.search_r1.data import SearchR1Dataset
from searchr1_trl.tasks.search_r1.env import SEARCH_TOOL_NAME
from searchr1_trl.tasks.search_r1.rubric import (
    normalize_answer,
    passages_hold_gold,
    retrieval_surfaced_gold,
    search_results,
)
from searchr1_trl.training.update import with_fp32_master_weights

logger = logging.getLogger(__name__)


@dataclass
class WarmStartConfig:
    """How many scripted traces, and how the policy is fine-tuned on them."""

    num_traces: int = field(
        default=0,
        metadata={"help": "Scripted search -> answer traces to fine-tune on before GRPO; 0: no warm start. Questions "
                          "are a seeded draw of the training file (data_seed + 1); those whose passages lack every "
                          "golden answer are dropped, so fewer traces remain (the log says how many)."},
    )
    second_search: bool = field(
        default=False,
        metadata={"help": "Where the question's own search holds no golden answer, the teacher searches again with the "
                          "question's content words and answers if that finds one: traces that show a second query, "
                          "which GRPO alone never discovers (0 of 3,000 rollouts after the one-search warm start). "
                          "Needs max_turns >= 3."},
    )
    second_search_repeats: int = field(
        default=1,
        metadata={"help": "How many times each trace with a second search is fine-tuned on: once each, they were too "
                          "few for the tuned policy to search again (offline_gpu, 3 seeds: 0 second queries in 1,500 "
                          "greedy rollouts of the report sample after the warm start)."},
    )
    answer_traces: int | None = field(
        default=None,
        metadata={"help": "How many of the kept traces teach their answer turn too; None: all. The rest teach only "
                          "the search calls, the tool protocol, and leave the reading of the passages to GRPO (with "
                          "every answer taught, offline_gpu's warm start reads at 0.38 EM and GRPO adds +0.03: the "
                          "ceiling of one search read well)."},
    )
    learning_rate: float = field(default=1e-5, metadata={"help": "AdamW learning rate of the warm start."})
    epochs: float = field(default=1.0, metadata={"help": "Passes over the warm-start traces."})
    batch_size: int = field(default=8, metadata={"help": "Traces per optimizer step (per device)."})

    def __post_init__(self):
        if self.num_traces < 0 or self.learning_rate <= 0 or self.epochs <= 0 or self.batch_size < 1:
            raise ValueError(
                f"expected num_traces >= 0, learning_rate > 0, epochs > 0 and batch_size >= 1, got {self.num_traces}, "
                f"{self.learning_rate}, {self.epochs}, {self.batch_size}"
            )
        if self.answer_traces is not None and self.answer_traces < 0:
            raise ValueError(f"answer_traces={self.answer_traces}: expected >= 0 (0: no answer turn is taught), or "
                             "None for all")
        if self.second_search_repeats < 1 or (self.second_search_repeats > 1 and not self.second_search):
            raise ValueError(f"second_search_repeats={self.second_search_repeats}: expected >= 1, and > 1 only with "
                             "second_search=True (without it no trace has a second search to repeat)")


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
    before = engine.render(messages, add_generation_prompt=True)
    after = engine.render([*messages, turn], add_generation_prompt=False)
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
        hits = found(sequence[len(engine.render(messages, add_generation_prompt=True)):])
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


def search_turns_mask(env_mask: list[int]) -> list[int]:
    """``env_mask`` (1: a token the model wrote) without the final answer turn, its last run of model tokens: the loss
    of a trace that teaches the search calls alone."""
    end = len(env_mask)
    while end and not env_mask[end - 1]:
        end -= 1
    start = end
    while start and env_mask[start - 1]:
        start -= 1
    return env_mask[:start] + [0] * (len(env_mask) - start)


def fine_tuning_rows(kept: list[Rollout], config: WarmStartConfig) -> list[dict]:
    """The warm start's fine-tuning set: each kept trace's tokens and its loss mask over the model's own turns. The
    first ``config.answer_traces`` teach the whole trace, the rest only its search calls; two-search traces are
    repeated ``config.second_search_repeats`` times."""
    answers = len(kept) if config.answer_traces is None else config.answer_traces
    taught = [r if i < answers else replace(r, env_mask=search_turns_mask(r.env_mask)) for i, r in enumerate(kept)]
    return [{"input_ids": r.prompt_ids + r.completion_ids, "assistant_masks": [0] * len(r.prompt_ids) + r.env_mask}
            for r in with_second_searches_repeated(taught, config.second_search_repeats)]


def with_second_searches_repeated(traces: list[Rollout], repeats: int) -> list[Rollout]:
    """``traces`` (those :func:`keep` accepted) as the warm start fine-tunes on them: each with a second search
    ``repeats`` times, the others once."""
    return [r for r in traces for _ in range(repeats if r.num_tool_calls == 2 else 1)]


async def scripted_traces(tokenizer, envs, config, samples, end_ids: set[int], chunk: int = 256,
                          second_search: bool = False) -> list[Rollout]:
    """Teacher rollouts of every sample, ``chunk`` at a time (their searches reach the retriever batched)."""
    rollouts: list[Rollout] = []
    for start in range(0, len(samples), chunk):
        rollouts += await asyncio.gather(*(scripted_trace(tokenizer, envs, config, s, end_ids, second_search)
                                           for s in samples[start:start + chunk]))
    return rollouts


def scripted_warm_start_traces(args, model_path: str, tokenizer, task) -> tuple[list[Rollout], list[Rollout]]:
    """The teacher's traces of the warm start's questions (the training stream reseeded: seed + 1, so GRPO does not
    start on the questions it was fine-tuned on), and those :func:`keep` accepts."""
    from transformers import GenerationConfig

    config = task.warm_start
    if args.max_turns < 2 + config.second_search:
        raise ValueError(f"warm_start_traces={config.num_traces} teaches a search then an answer"
                         f"{' (with a second search between them)' if config.second_search else ''}, "
                         f"{2 + config.second_search} turns, but max_turns={args.max_turns}: raise max_turns or set "
                         "warm_start_traces 0")
    stream = task.train_stream.config
    samples = SearchR1Dataset(replace(stream, seed=stream.seed + 1)).take(config.num_traces)
    try:
        generation_config = GenerationConfig.from_pretrained(model_path)
    except OSError:  # a checkpoint without generation_config.json: the tokenizer's end tokens
        generation_config = None
    end_ids = set(end_token_ids(tokenizer, generation_config))
    rollouts = asyncio.run(_traces_then_close(tokenizer, task.envs, task.rollout, samples, end_ids,
                                              config.second_search))
    return rollouts, [r for r in rollouts if keep(r)]


def warm_start(args, model_args, task) -> str:
    """Write the traces, fine-tune the recipe's model on them, save it; the folder GRPO starts from. ``task`` is the
    recipe's :class:`~searchr1_trl.training.recipe.SearchR1Task` (its environment, budgets, question stream and
    warm-start
    config)."""
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import SFTConfig, SFTTrainer, get_peft_config

    config = task.warm_start
    tokenizer = AutoTokenizer.from_pretrained(model_args.model_name_or_path)
    rollouts, kept = scripted_warm_start_traces(args, model_args.model_name_or_path, tokenizer, task)
    logger.info("warm start: %d of %d scripted traces have a golden answer in their passages (%d after a second "
                "search, each fine-tuned on %d times); %s teach the answer turn", len(kept), len(rollouts),
                sum(r.num_tool_calls == 2 for r in kept), config.second_search_repeats,
                "all" if config.answer_traces is None else min(config.answer_traces, len(kept)))
    if not kept:
        raise RuntimeError(f"none of {len(rollouts)} scripted traces found a golden answer in its passages: is the "
                           f"retriever at {args.search_url} serving the corpus of {args.train_data_path}?")
    dataset = Dataset.from_list(fine_tuning_rows(kept, config))
    output_dir = Path(args.output_dir) / "warm_start"
    sft_args = SFTConfig(
        output_dir=str(output_dir), learning_rate=config.learning_rate, num_train_epochs=config.epochs,
        per_device_train_batch_size=config.batch_size, gradient_accumulation_steps=1,
        lr_scheduler_type="constant", warmup_steps=0, max_length=None, bf16=args.bf16, seed=args.seed,
        logging_steps=args.logging_steps, save_strategy="no", report_to=args.report_to, run_name=args.run_name,
        model_init_kwargs=args.model_init_kwargs, activation_checkpointing=args.activation_checkpointing,
        deepspeed=args.deepspeed,
    )
    trainer = SFTTrainer(model=model_args.model_name_or_path, args=sft_args, train_dataset=dataset,
                         processing_class=tokenizer, peft_config=get_peft_config(model_args))
    if args.fp32_master_weights:  # bf16 weights: the warm start's steps need the masters too
        with_fp32_master_weights(trainer.create_optimizer(), deepspeed=trainer.is_deepspeed_enabled)
    trainer.train()
    if hasattr(trainer.model, "merge_and_unload"):  # PEFT: GRPO starts from the merged weights (its own adapter)
        trainer.model = trainer.model.merge_and_unload()
    trainer.save_model(str(output_dir))  # with the tokenizer and the model's generation config
    if trainer.accelerator.is_main_process and args.generator == "vllm" and args.weight_sync == "reload":
        reload_weights(args.generator_url, output_dir)
    trainer.accelerator.wait_for_everyone()
    del trainer
    return str(output_dir)


async def _traces_then_close(tokenizer, envs, config, samples, end_ids, second_search) -> list[Rollout]:
    try:
        return await scripted_traces(tokenizer, envs, config, samples, end_ids, second_search=second_search)
    finally:
        await envs.aclose()
