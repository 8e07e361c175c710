"""Generic multi-turn rollout machinery: the loop, budgets and tokens that every tool-calling task shares.

A task supplies an :class:`EnvFactory`: the tools, and a new :class:`MessageEnv` for every rollout, which
:meth:`~MessageEnv.reset` starts on that rollout's sample (its initial messages) and whose ``step`` answers the latest
assistant message. Per-sample state (the question, anything a tool needs of it) lives on that env, never in prompt
text; TRL 1.16's ``environment_factory`` has the same shape (one instance per rollout, ``reset(**row)``). The
:class:`RolloutEngine` owns everything else. One turn: generate from token ids -> parse the assistant message ->
``env.step`` -> append the environment's messages as tokens -> next turn. How messages become tokens and a turn
becomes a message is the factory's :class:`~searchr1_trl.engine.transcript.Transcript` (the chat template and tool
calls by default; a text the model continues, for tag protocols): token-in/token-out either way, earlier turns are
never re-tokenized and environment tokens have ``env_mask`` 0.

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
import time
from dataclasses import dataclass, field, replace
from typing import Any

from searchr1_trl.engine.generation import Generation, Generator, SamplingParams
from searchr1_trl.engine.transcript import ChatTranscript, Transcript


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

    def transcript(self, tokenizer, config: RolloutConfig) -> Transcript:
        """How these environments' rollouts read as tokens: the chat template with :attr:`tools` by default."""
        return ChatTranscript(tokenizer, self.tools, enable_thinking=config.enable_thinking,
                              bare_json_tool_calls=config.bare_json_tool_calls,
                              repair_tool_calls=config.repair_tool_calls)

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
        self.transcript = envs.transcript(tokenizer, self.config)

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
        prompt_ids = self.transcript.prompt(messages)
        completion_ids: list[int] = []
        env_mask: list[int] = []
        logprobs: list[float] = []
        num_turns = closed_turns = 0
        status = RolloutStatus.TRUNCATED_PROMPT_TOO_LONG if not self._room(prompt_ids) else None
        while status is None:
            sequence = prompt_ids + completion_ids
            clock = time.perf_counter()
            turn = replace(params, max_tokens=min(params.max_tokens, self._room(sequence)), stop=self.transcript.stop)
            generation = await self.generator.generate(sequence, turn)
            timings["generate_s"] += time.perf_counter() - clock
            _check_generation(generation)
            num_turns += 1
            turn_ids, kept = generation.token_ids, len(generation.token_ids)
            message = None if generation.finish_reason == "length" else self.transcript.parse(turn_ids, sequence)
            if message is None and generation.finish_reason == "stop" and self.config.close_tool_calls:
                closed = self.transcript.close(generation.token_ids)
                if closed is not None and (message := self.transcript.parse(closed[0], sequence)) is not None:
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
                suffix = self.transcript.env_suffix(messages, step.messages, turn_ids)
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

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)


def _check_generation(generation: Generation) -> None:
    """ValueError unless the generator kept its contract (the engine's alignment depends on it)."""
    if not generation.token_ids or len(generation.logprobs) != len(generation.token_ids):
        raise ValueError(
            f"a generator must return at least one token and one logprob per token, got "
            f"{len(generation.token_ids)} tokens and {len(generation.logprobs)} logprobs"
        )
