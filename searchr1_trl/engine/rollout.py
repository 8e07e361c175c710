"""Generic multi-turn rollout machinery: the loop, budgets and tokens that every tool-calling task shares.

A task supplies an :class:`EnvFactory`: the tools, and a new :class:`MessageEnv` for every rollout, which
:meth:`~MessageEnv.reset` starts on that rollout's sample (its initial messages) and whose ``step`` answers the latest
assistant message. Per-sample state (the question, anything a tool needs of it) lives on that env, never in prompt
text; TRL 1.16's ``environment_factory`` has the same shape (one instance per rollout, ``reset(**row)``). The
:class:`RolloutEngine` owns everything else. One turn: generate from token ids -> parse the assistant message
(:mod:`searchr1_trl.engine.parsing`) -> ``env.step`` -> append the environment's messages as tokens -> next turn.

Token-in/token-out. A rollout's sequence is ``prompt_ids`` followed by ``completion_ids``: the model's generated ids,
exactly as returned, interleaved with the environment's messages rendered as tokens. Earlier turns are never
re-tokenized, so the sequence is exactly what the model saw in its last turn (plus that turn's output). An
environment suffix is the chat template's rendering of the conversation with the new environment messages and the
next generation prompt, minus its rendering without them, cut just after the token that ended the model's turn: the
template glue after the model's end-of-turn token (Qwen's "\n" after ``<|im_end|>``), the tool-turn wrappers and the
next assistant header are environment tokens (``env_mask`` 0), the model's own end-of-turn token is a model token
(``env_mask`` 1). Templates that do not render earlier messages identically when messages follow (Qwen3 drops old
reasoning) are replaced by TRL's prefix-preserving training template, as ``GRPOTrainer`` does.

Budgets, checked in this order every turn, decide how a rollout ends (:class:`RolloutStatus`):

- a turn used all its ``max_tokens`` (``finish_reason == "length"``) -> ``TRUNCATED_LENGTH``; a turn's ``max_tokens``
  is also capped so prompt + completion never exceed ``max_rollout_tokens``;
- the assistant message cannot be parsed (malformed tool-call JSON; the rules: :mod:`searchr1_trl.engine.parsing`) ->
  ``ERROR_PARSE``; with ``close_tool_calls``, a turn whose call is whole but not closed right after its JSON is first
  cut there and closed by the engine (its closing tokens are environment tokens), and goes on;
- ``env.step`` takes longer than ``step_timeout_s`` -> ``ERROR_TIMEOUT``;
- the environment says its tools did not answer the step (``EnvStep.tool_failed``: the service behind them is down)
  -> ``ERROR_TOOL``;
- the environment is done -> ``DONE``;
- it wants another turn but ``max_turns`` turns were generated -> ``TRUNCATED_MAX_TURNS`` (a last turn with tool
  calls ends so without ``env.step``: no turn is left to read the results, so they are not computed; TRL's tool loop
  does the same, and on the CPU comparison it saved 16 of 36 searches);
- the next prompt would leave no room for a generated token within ``max_rollout_tokens`` ->
  ``TRUNCATED_PROMPT_TOO_LONG`` (also when the initial prompt alone is that long).

``Rollout.messages`` mirrors the tokens: environment messages are recorded only once they are part of the sequence,
so those of a step after which the rollout was cut are dropped. An assistant turn that was cut by its length or could
not be parsed is recorded as its decoded text, without tool calls.
"""

from __future__ import annotations

import abc
import asyncio
import enum
import functools
import time
from dataclasses import dataclass, field
from typing import Any

from searchr1_trl.engine.generation import Generation, Generator, SamplingParams
from searchr1_trl.engine.parsing import response_parser, tool_call_end


class RolloutStatus(str, enum.Enum):
    """How a rollout ended."""

    DONE = "done"
    TRUNCATED_MAX_TURNS = "truncated_max_turns"
    TRUNCATED_PROMPT_TOO_LONG = "truncated_prompt_too_long"
    TRUNCATED_LENGTH = "truncated_length"
    ERROR_PARSE = "error_parse"
    ERROR_TIMEOUT = "error_timeout"
    ERROR_TOOL = "error_tool"

    @property
    def truncated(self) -> bool:
        """True when a budget (turns, prompt length, per-turn tokens) ended the rollout."""
        return self in (
            RolloutStatus.TRUNCATED_MAX_TURNS,
            RolloutStatus.TRUNCATED_PROMPT_TOO_LONG,
            RolloutStatus.TRUNCATED_LENGTH,
        )


@dataclass
class EnvStep:
    """What the environment answers to one assistant message."""

    messages: list[dict]  # environment messages to append, e.g. [{"role": "tool", "name": "search", "content": "..."}]
    done: bool  # True: the assistant message was the final answer; messages is then []
    # True: the step's tools did not answer (their service is down, not the model's doing): the rollout ends as
    # ERROR_TOOL, so nothing is trained on turns that read an outage as "no results".
    tool_failed: bool = False


class MessageEnv(abc.ABC):
    """One rollout's environment in message space, built for that rollout alone. The engine owns the loop, budgets
    and tokens."""

    @abc.abstractmethod
    def reset(self, sample) -> list[dict]:
        """Start the rollout of ``sample``: the conversation its first turn is generated from."""

    @abc.abstractmethod
    async def step(self, messages: list[dict]) -> EnvStep:
        """React to the conversation so far (read it, do not change it); its last message is the parsed assistant
        turn ``{"role": "assistant", "content": str, "tool_calls": [{"type": "function", "function": {"name": str,
        "arguments": dict | str}}]}`` ("tool_calls" absent or [] when none).
        """


class EnvFactory(abc.ABC):
    """A task's environments: a new :class:`MessageEnv` per rollout, the tools every one of them exposes, and what
    they share (a pooled client, counters)."""

    tools: list[dict]  # OpenAI function schemas ({"type": "function", "function": {...}})

    @abc.abstractmethod
    def __call__(self) -> MessageEnv:
        """A fresh environment for one rollout."""

    def metrics(self) -> dict[str, float]:
        """Counters of every environment built, since the last call; reset on read."""
        return {}

    async def aclose(self) -> None:  # noqa: B027 (a task that shares nothing has nothing to close)
        """Close what the environments share."""


@dataclass
class RolloutConfig:
    """Budgets of one rollout (see the module docstring for how each ends it)."""

    max_turns: int = field(default=4, metadata={"help": "Assistant turns per rollout."})
    max_rollout_tokens: int = field(
        default=3072,
        metadata={"help": "Prompt + completion tokens of a rollout; a next prompt beyond it is a truncation."},
    )
    step_timeout_s: float = field(
        default=240.0,
        metadata={
            "help": "Time budget of one environment step, in seconds. Keep it above the environment's own worst case "
            "(Search-R1's retrieval gives up after its deadline_s, 180 s, and answers with empty results), so a "
            "dead tool degrades the answer instead of ending rollouts as errors."
        },
    )
    enable_thinking: bool = field(
        default=False, metadata={"help": "Passed to chat templates that accept it (Qwen3); others ignore it."}
    )
    repair_tool_calls: bool = field(
        default=False,
        metadata={
            "help": "Repair a tool call in the chat template's <tool_call> blocks whose JSON misses one or two closing "
            "braces (or sits in code fences), or whose last block is left open, instead of failing the rollout "
            "(error_parse); searchr1_trl/engine/parsing.py, reader 2."
        },
    )
    close_tool_calls: bool = field(
        default=False,
        metadata={
            "help": "A turn the parser refuses whose <tool_call> block holds a whole JSON call but is not closed "
            "right after it (a second <tool_call>, stray text) is cut just past the JSON and closed by the engine: "
            "the closing tag and end-of-turn token are environment tokens (not trained on), what the model wrote "
            "after the call is dropped. Off: the rollout ends as error_parse (searchr1_trl/engine/parsing.py)."
        },
    )
    bare_json_tool_calls: bool = field(
        default=False,
        metadata={
            "help": "Also read an assistant turn that is nothing but JSON objects {\"name\": <one of the env's "
            "tools>, \"arguments\": {...}} (one per line) as tool calls. Some small models (Qwen2.5-Coder-0.5B-"
            "Instruct) call tools this way instead of in their chat template's format (<tool_call>...</tool_call>); "
            "searchr1_trl/engine/parsing.py says what is repaired."
        },
    )

    def __post_init__(self):
        if self.max_turns < 1 or self.max_rollout_tokens < 2 or self.step_timeout_s <= 0:
            raise ValueError(
                f"expected max_turns >= 1, max_rollout_tokens >= 2 and step_timeout_s > 0, got {self.max_turns}, "
                f"{self.max_rollout_tokens}, {self.step_timeout_s}"
            )


@dataclass
class Rollout:
    """One finished rollout: the conversation, its tokens and how it ended."""

    sample: Any  # what the dataset yielded (has .golden_answers etc.): the rubric scores the rollout from it
    messages: list[dict]  # initial messages + every assistant and environment message, in order
    prompt_ids: list[int]  # the rendered initial prompt
    completion_ids: list[int]  # everything after the prompt: model turns and env tokens, exactly as the model saw them
    env_mask: list[int]  # 1 on model-generated tokens (incl. their end-of-turn token), 0 on env/template tokens
    logprobs: list[float]  # aligned with completion_ids; generator's logprob on mask-1 tokens, 0.0 elsewhere
    status: RolloutStatus
    num_turns: int  # assistant turns generated
    num_tool_calls: int
    closed_turns: int  # turns whose tool call the engine closed (``close_tool_calls``)
    timings: dict[str, float]  # {"generate_s", "env_s", "total_s"}


async def _gather(coroutines: list) -> list:
    """Run coroutines as concurrent tasks, results in order; after a failure, cancel the rest rather than leak them."""
    tasks = [asyncio.ensure_future(c) for c in coroutines]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()


class RolloutEngine:
    """Runs a task's environments against a :class:`Generator`, many rollouts at once, one environment each; see
    the module docstring."""

    def __init__(self, tokenizer, generator: Generator, envs: EnvFactory, config: RolloutConfig | None = None):
        self.tokenizer = tokenizer
        self.generator = generator
        self.envs = envs
        self.config = config or RolloutConfig()
        self._chat_template = _prefix_preserving_chat_template(tokenizer)
        self._parse = response_parser(tokenizer, envs.tools, bare_json_tool_calls=self.config.bare_json_tool_calls,
                                      repair_tool_calls=self.config.repair_tool_calls)
        self._split_at = _split_tokens(tokenizer)
        self._text_cut = _tokenizes_alone(tokenizer, self._split_at)
        # Texts recur across a GRPO group: its rollouts start from one prompt, and most make the same search, so
        # their environment suffixes (passages and template glue) are one text too.
        self._encode_text = functools.lru_cache(maxsize=1024)(
            lambda text: tuple(tokenizer.encode(text, add_special_tokens=False)))

    async def run(self, samples: list, params: SamplingParams) -> list[Rollout]:
        """Roll out every sample concurrently; results in input order.

        Each rollout is its own task, so one waiting on its environment never holds back the others' generation.
        """
        return await _gather([self.rollout(sample, params) for sample in samples])

    async def rollout(self, sample, params: SamplingParams, messages: list[dict] | None = None) -> Rollout:
        """Roll out one sample in an environment of its own until it is done or a budget ends it; ``messages``, when
        given, replace the environment's initial ones (a prompt built elsewhere, e.g. with passages pasted in)."""
        started = time.perf_counter()
        timings = {"generate_s": 0.0, "env_s": 0.0}
        env = self.envs()
        initial = env.reset(sample)
        messages = list(initial if messages is None else messages)
        prompt_ids = self._initial_prompt(messages)
        completion_ids: list[int] = []
        env_mask: list[int] = []
        logprobs: list[float] = []
        num_turns = closed_turns = 0
        status = RolloutStatus.TRUNCATED_PROMPT_TOO_LONG if not self._room(prompt_ids) else None
        while status is None:
            sequence = prompt_ids + completion_ids
            clock = time.perf_counter()
            turn = params.with_max_tokens(min(params.max_tokens, self._room(sequence)))
            generation = await self.generator.generate(sequence, turn)
            timings["generate_s"] += time.perf_counter() - clock
            _check_generation(generation)
            num_turns += 1
            turn_ids, kept = generation.token_ids, len(generation.token_ids)
            message = None if generation.finish_reason == "length" else self._parse(turn_ids, sequence)
            if message is None and generation.finish_reason == "stop" and self.config.close_tool_calls:
                closed = close_tool_call(self.tokenizer, generation.token_ids)
                if closed is not None and (message := self._parse(closed[0], sequence)) is not None:
                    (turn_ids, kept), closed_turns = closed, closed_turns + 1
            completion_ids += turn_ids
            env_mask += [1] * kept + [0] * (len(turn_ids) - kept)
            logprobs += generation.logprobs[:kept] + [0.0] * (len(turn_ids) - kept)

            if message is None:
                messages.append({"role": "assistant", "content": self._decode(generation.token_ids)})
                cut = generation.finish_reason == "length"
                status = RolloutStatus.TRUNCATED_LENGTH if cut else RolloutStatus.ERROR_PARSE
                break
            messages.append(message)
            if message.get("tool_calls") and num_turns >= self.config.max_turns:
                # No turn is left to read the results: skip the calls (their messages would be dropped anyway).
                status = RolloutStatus.TRUNCATED_MAX_TURNS
                break

            clock = time.perf_counter()
            try:
                step = await asyncio.wait_for(env.step(messages), self.config.step_timeout_s)
            except asyncio.TimeoutError:
                status = RolloutStatus.ERROR_TIMEOUT
                break
            finally:
                timings["env_s"] += time.perf_counter() - clock
            if step.tool_failed:
                status = RolloutStatus.ERROR_TOOL
            elif step.done:
                status = RolloutStatus.DONE
            elif num_turns >= self.config.max_turns:
                status = RolloutStatus.TRUNCATED_MAX_TURNS
            else:
                suffix = self._env_suffix(messages, step.messages, turn_ids)
                if not self._room(prompt_ids + completion_ids + suffix):
                    status = RolloutStatus.TRUNCATED_PROMPT_TOO_LONG
                else:
                    messages += step.messages
                    completion_ids += suffix
                    env_mask += [0] * len(suffix)
                    logprobs += [0.0] * len(suffix)

        timings["total_s"] = time.perf_counter() - started
        return Rollout(
            sample=sample, messages=messages, prompt_ids=prompt_ids, completion_ids=completion_ids, env_mask=env_mask,
            logprobs=logprobs, status=status, num_turns=num_turns, closed_turns=closed_turns,
            num_tool_calls=sum(len(m.get("tool_calls") or []) for m in messages if m["role"] == "assistant"),
            timings=timings,
        )

    def _room(self, sequence: list[int]) -> int:
        """How many tokens may still be generated after ``sequence``; 0 means the prompt is too long."""
        return max(0, self.config.max_rollout_tokens - len(sequence))

    def render(self, messages: list[dict], add_generation_prompt: bool) -> list[int]:
        """Token ids of ``messages`` under the chat template, with the env's tools and the thinking switch."""
        return self.tokenizer.encode(self._render_text(messages, add_generation_prompt), add_special_tokens=False)

    def _render_text(self, messages: list[dict], add_generation_prompt: bool) -> str:
        """:meth:`render` before tokenization (the chat template's text; its special tokens are in it already)."""
        return self.tokenizer.apply_chat_template(
            messages, tools=self.envs.tools or None, add_generation_prompt=add_generation_prompt, tokenize=False,
            chat_template=self._chat_template, enable_thinking=self.config.enable_thinking,
        )

    def _initial_prompt(self, messages: list[dict]) -> list[int]:
        """``render(messages, add_generation_prompt=True)``, its text tokenized once: the rollouts of a GRPO group
        start from one prompt."""
        return list(self._encode_text(self._render_text(messages, add_generation_prompt=True)))

    def _env_suffix(self, messages: list[dict], env_messages: list[dict], generated_ids: list[int]) -> list[int]:
        """Tokens to append after the model's turn: template glue, ``env_messages`` and the next generation prompt.

        The cut is just after the token that ended the model's turn in the template's rendering (Qwen:
        ``...<|im_end|>`` | ``\n<|im_start|>user\n<tool_response>...<|im_start|>assistant\n``). If the model
        stopped on a token the template does not end turns with, the template's own end-of-turn token is appended as
        glue, so the next turn still sees a well-formed conversation.

        Only the text after the cut is tokenized when that gives the very tokens of the whole rendering (the cut
        falls at an added token, which the tokenizer splits the text at, and :func:`_tokenizes_alone` holds):
        tokenizing the whole conversation, passages included, twice per environment step was half of the engine's
        CPU time per rollout-turn (``experiments/engine_overhead.py``).
        """
        stop, eos = generated_ids[-1], self.tokenizer.eos_token_id
        stop_text, eos_text = self._split_at.get(stop), self._split_at.get(eos)
        if self._text_cut and stop_text is not None and (eos is None or eos_text is not None):
            before = self._render_text(messages, add_generation_prompt=False)
            after = self._render_text(messages + env_messages, add_generation_prompt=True)
            return list(self._encode_text(_after_turn(before, after, stop_text, eos_text)))
        before = self.render(messages, add_generation_prompt=False)
        after = self.render(messages + env_messages, add_generation_prompt=True)
        return _after_turn(before, after, stop, eos)

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)


def close_tool_call(tokenizer, token_ids: list[int]) -> tuple[list[int], int] | None:
    """``(turn, kept)`` for a turn whose tool call is whole but not closed right after its JSON
    (:func:`~searchr1_trl.engine.parsing.tool_call_end`): the first ``kept`` of ``token_ids`` (up to the token that
    completes the JSON), then ``</tool_call>`` and the turn's own end token; None when the turn has no such call, or
    the token completing the JSON carries more than whitespace."""
    text = tokenizer.decode(token_ids, skip_special_tokens=False)
    if (end := tool_call_end(text)) is None:
        return None
    for kept in range(1, len(token_ids)):
        prefix = tokenizer.decode(token_ids[:kept], skip_special_tokens=False)
        if len(prefix) >= end:
            break
    else:
        return None
    if prefix[:end] != text[:end] or prefix[end:].strip():
        return None
    closing = tokenizer.encode(("" if prefix.endswith("\n") else "\n") + "</tool_call>", add_special_tokens=False)
    return token_ids[:kept] + closing + token_ids[-1:], kept


def _after_turn(before, after, stop, end_of_turn):
    """``after`` from just past the model's turn in ``before``: after the last ``stop`` in ``before``, else from its
    last ``end_of_turn`` on. Works on token lists (``stop``, ``end_of_turn``: ids) and on rendered text (their
    strings) alike; ValueError when neither is in ``before`` or ``after`` does not start like ``before``."""
    if (at := _rfind(before, stop)) >= 0:
        cut = at + (len(stop) if isinstance(stop, str) else 1)
    elif (at := _rfind(before, end_of_turn)) >= 0:
        cut = at
    else:
        raise ValueError(
            f"cannot find the end of the assistant turn: neither the model's stop token {stop!r} nor the "
            f"tokenizer's eos token {end_of_turn!r} appears in the rendered conversation"
        )
    if after[:cut] != before[:cut]:
        raise ValueError(
            "the chat template renders the conversation differently once environment messages follow, so the "
            "environment's tokens cannot be appended without re-tokenizing earlier turns"
        )
    return after[cut:]


def _rfind(sequence: str | list[int], item: str | int | None) -> int:
    """Index of the last ``item`` in ``sequence`` (a substring of a str, an element of a list); -1 if none."""
    if item is None:
        return -1
    if isinstance(sequence, str):
        return sequence.rfind(item)
    return len(sequence) - 1 - sequence[::-1].index(item) if item in sequence else -1


def _split_tokens(tokenizer) -> dict[int, str]:
    """``{id: text}`` of the added tokens the tokenizer cuts the text at exactly, so that the text on either side is
    tokenized on its own (no stripping of neighbouring spaces, no whole-word or normalised matching)."""
    return {
        i: token.content for i, token in getattr(tokenizer, "added_tokens_decoder", {}).items()
        if not (token.lstrip or token.rstrip or token.single_word or token.normalized)
    }


def _tokenizes_alone(tokenizer, split_at: dict[int, str]) -> bool:
    """Whether a text that starts right after an added token gets the same tokens alone as within a longer text.

    True for Qwen's byte-level BPE; false for a tokenizer that adds a space to the start of a text (e.g.
    SentencePiece's ``prepend_scheme="first"``), for which the engine tokenizes whole conversations instead.
    """
    if tokenizer.eos_token_id not in split_at or not getattr(tokenizer, "is_fast", False):
        return False
    eos = split_at[tokenizer.eos_token_id]
    for text in (" Doc 1(Title: Paris) A city.\n", "\n\nDoc", "Hello world", "\u00e9t\u00e9 \u6587"):
        whole = tokenizer.encode(f"a b{eos}{text}", add_special_tokens=False)
        alone = tokenizer.encode(text, add_special_tokens=False)
        if whole[_rfind(whole, tokenizer.eos_token_id) + 1:] != alone:
            return False
    return True


def _check_generation(generation: Generation) -> None:
    """ValueError unless the generator kept its contract (the engine's alignment depends on it)."""
    if not generation.token_ids or len(generation.logprobs) != len(generation.token_ids):
        raise ValueError(
            f"a generator must return at least one token and one logprob per token, got "
            f"{len(generation.token_ids)} tokens and {len(generation.logprobs)} logprobs"
        )


def _prefix_preserving_chat_template(tokenizer) -> str | None:
    """None to use the tokenizer's chat template, or TRL's training variant when that one is not prefix-preserving."""
    # Imported here: every task module imports this file's contract types, and TRL takes seconds to import.
    from trl.chat_template_utils import get_training_chat_template, is_chat_template_prefix_preserving

    if is_chat_template_prefix_preserving(tokenizer):
        return None
    return get_training_chat_template(tokenizer)
