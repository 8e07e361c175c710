"""Transcripts: how a rollout's messages become the tokens the model reads, and a generated turn becomes a message.

Token-in/token-out, whichever transcript: a rollout's sequence is ``prompt_ids`` followed by ``completion_ids``: the
model's generated ids, exactly as returned, interleaved with the environment's messages rendered as tokens. Earlier
turns are never re-tokenized, so the sequence is exactly what the model saw in its last turn (plus that turn's
output). A task's :class:`~searchr1_trl.engine.rollout.EnvFactory` says which transcript its rollouts use:

- :class:`ChatTranscript` (the default): messages through the chat template, tools in the template's format, turns
  parsed into tool calls (:mod:`searchr1_trl.engine.parsing`). An environment suffix is the template's rendering of
  the conversation with the new environment messages and the next generation prompt, minus its rendering without
  them, cut just after the token that ended the model's turn: the template glue after the model's end-of-turn token
  (Qwen's "\n" after ``<|im_end|>``), the tool-turn wrappers and the next assistant header are environment tokens
  (``env_mask`` 0), the model's own end-of-turn token is a model token (``env_mask`` 1). Templates that do not render
  earlier messages identically when messages follow (Qwen3 drops old reasoning) are replaced by TRL's
  prefix-preserving training template, as ``GRPOTrainer`` does.
- :class:`TextTranscript`: one text the model continues, as the Search-R1 paper's tag protocol writes it. The prompt
  is the chat template's rendering of the initial messages when the tokenizer has a template (instruct and most base
  models), else their text; a turn ends at an end token or one of the task's ``stop`` strings; the task parses its
  text into a message and writes each environment message as the text appended after it.
"""

from __future__ import annotations

import abc
import functools
from collections.abc import Callable

from searchr1_trl.engine.parsing import response_parser, tool_call_end


class Transcript(abc.ABC):
    """How one task's rollouts read as tokens; the engine owns the loop and the budgets."""

    stop: tuple[str, ...] = ()  # strings that end a turn besides the end tokens (kept in the turn)

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        # Texts recur across a GRPO group: its rollouts start from one prompt, and most make the same tool call, so
        # their environment suffixes (tool results and template glue) are one text too.
        self._encode_text = functools.lru_cache(maxsize=1024)(
            lambda text: tuple(tokenizer.encode(text, add_special_tokens=False)))

    @abc.abstractmethod
    def prompt(self, messages: list[dict]) -> list[int]:
        """The token ids the first turn is generated after."""

    @abc.abstractmethod
    def parse(self, turn_ids: list[int], prefix_ids: list[int]) -> dict | None:
        """The assistant message a finished turn wrote; None: the turn cannot be read (``ERROR_PARSE``)."""

    @abc.abstractmethod
    def env_suffix(self, messages: list[dict], env_messages: list[dict], turn_ids: list[int]) -> list[int]:
        """The tokens after the model's turn ``turn_ids``: ``env_messages`` and whatever leads to the next turn."""

    def close(self, turn_ids: list[int]) -> tuple[list[int], int] | None:
        """A refused turn closed by the engine (``close_tool_calls``): ``(turn, kept)``, or None when it cannot be."""
        return None


class ChatTranscript(Transcript):
    """Messages through the chat template, with the env's tools and the thinking switch; see the module docstring."""

    def __init__(self, tokenizer, tools: list[dict], enable_thinking: bool = False,
                 bare_json_tool_calls: bool = False, repair_tool_calls: bool = False):
        super().__init__(tokenizer)
        self.tools, self.enable_thinking = tools, enable_thinking
        self._chat_template = _prefix_preserving_chat_template(tokenizer)
        self._parse = response_parser(tokenizer, tools, bare_json_tool_calls=bare_json_tool_calls,
                                      repair_tool_calls=repair_tool_calls)
        self._split_at = _split_tokens(tokenizer)
        self._text_cut = _tokenizes_alone(tokenizer, self._split_at)

    def render(self, messages: list[dict], add_generation_prompt: bool) -> list[int]:
        """Token ids of ``messages`` under the chat template, with the env's tools and the thinking switch."""
        return self.tokenizer.encode(self._render_text(messages, add_generation_prompt), add_special_tokens=False)

    def _render_text(self, messages: list[dict], add_generation_prompt: bool) -> str:
        """:meth:`render` before tokenization (the chat template's text; its special tokens are in it already)."""
        return self.tokenizer.apply_chat_template(
            messages, tools=self.tools or None, add_generation_prompt=add_generation_prompt, tokenize=False,
            chat_template=self._chat_template, enable_thinking=self.enable_thinking,
        )

    def prompt(self, messages: list[dict]) -> list[int]:
        """``render(messages, add_generation_prompt=True)``, its text tokenized once: the rollouts of a GRPO group
        start from one prompt."""
        return list(self._encode_text(self._render_text(messages, add_generation_prompt=True)))

    def parse(self, turn_ids: list[int], prefix_ids: list[int]) -> dict | None:
        return self._parse(turn_ids, prefix_ids)

    def close(self, turn_ids: list[int]) -> tuple[list[int], int] | None:
        return close_tool_call(self.tokenizer, turn_ids)

    def env_suffix(self, messages: list[dict], env_messages: list[dict], turn_ids: list[int]) -> list[int]:
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
        stop, eos = turn_ids[-1], self.tokenizer.eos_token_id
        stop_text, eos_text = self._split_at.get(stop), self._split_at.get(eos)
        if self._text_cut and stop_text is not None and (eos is None or eos_text is not None):
            before = self._render_text(messages, add_generation_prompt=False)
            after = self._render_text(messages + env_messages, add_generation_prompt=True)
            return list(self._encode_text(_after_turn(before, after, stop_text, eos_text)))
        before = self.render(messages, add_generation_prompt=False)
        after = self.render(messages + env_messages, add_generation_prompt=True)
        return _after_turn(before, after, stop, eos)


class TextTranscript(Transcript):
    """One text the model continues; see the module docstring. ``parse_text`` reads a turn's text (special tokens
    dropped) into an assistant message, ``env_text`` gives the text an environment message appends, ``stop`` the
    strings that end a turn."""

    def __init__(self, tokenizer, parse_text: Callable[[str], dict | None], env_text: Callable[[dict], str],
                 stop: tuple[str, ...] = (), enable_thinking: bool = False):
        super().__init__(tokenizer)
        self.parse_text, self.env_text, self.stop = parse_text, env_text, tuple(stop)
        self.enable_thinking = enable_thinking

    def prompt(self, messages: list[dict]) -> list[int]:
        if getattr(self.tokenizer, "chat_template", None):
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                                      enable_thinking=self.enable_thinking)
        else:  # a base model's tokenizer without a template: the instruction as written
            text = "".join(message["content"] for message in messages)
        return list(self._encode_text(text))

    def parse(self, turn_ids: list[int], prefix_ids: list[int]) -> dict | None:
        return self.parse_text(self.tokenizer.decode(turn_ids, skip_special_tokens=True))

    def env_suffix(self, messages: list[dict], env_messages: list[dict], turn_ids: list[int]) -> list[int]:
        return list(self._encode_text("".join(self.env_text(message) for message in env_messages)))


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


def _prefix_preserving_chat_template(tokenizer) -> str | None:
    """None to use the tokenizer's chat template, or TRL's training variant when that one is not prefix-preserving."""
    # Imported here: every task module imports this file's contract types, and TRL takes seconds to import.
    from trl.chat_template_utils import get_training_chat_template, is_chat_template_prefix_preserving

    if is_chat_template_prefix_preserving(tokenizer):
        return None
    return get_training_chat_template(tokenizer)
