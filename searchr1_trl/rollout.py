"""Generic multi-turn rollout machinery: statuses, the environment interface, and (to come) the engine.

Only the contract types a task needs are defined here so far (see docs/rollout_contract.md); the engine that
owns the loop, budgets and tokens is added by the rollout-engine work of issue 3.
"""

from __future__ import annotations

import abc
import enum
from dataclasses import dataclass


class RolloutStatus(str, enum.Enum):
    """How a rollout ended."""

    DONE = "done"
    TRUNCATED_MAX_TURNS = "truncated_max_turns"
    TRUNCATED_PROMPT_TOO_LONG = "truncated_prompt_too_long"
    TRUNCATED_LENGTH = "truncated_length"
    ERROR_PARSE = "error_parse"
    ERROR_TIMEOUT = "error_timeout"

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


class MessageEnv(abc.ABC):
    """A task's environment in message space. The engine owns the loop, budgets and tokens."""

    tools: list[dict]  # OpenAI function schemas ({"type": "function", "function": {...}})

    @abc.abstractmethod
    def initial_messages(self, sample) -> list[dict]:
        """The conversation the first turn is generated from."""

    @abc.abstractmethod
    async def step(self, message: dict) -> EnvStep:
        """React to a parsed assistant message.

        ``message`` = ``{"role": "assistant", "content": str, "tool_calls": [{"type": "function",
        "function": {"name": str, "arguments": dict | str}}]}`` ("tool_calls" absent or [] when none).
        """

    def metrics(self) -> dict[str, float]:
        """Counters since the last call, reset on read."""
        return {}
