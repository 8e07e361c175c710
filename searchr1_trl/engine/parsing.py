"""Assistant text -> message + tool calls: how a finished turn's tokens become the message the environment reads.

This is where small-model rollouts actually fail, so every rule is here and nowhere else. :func:`response_parser`
returns ``parse(generated_ids, prefix_ids) -> message | None``; the rollout engine ends a rollout whose turn parses
to None as ``ERROR_PARSE``. A message is ``{"role": "assistant", "content": str}`` plus ``"tool_calls": [{"type":
"function", "function": {"name": str, "arguments": dict | str}}]`` when the turn called tools, and
``"reasoning_content"`` when the template separates thinking. Three readers, in this order:

1. **The tokenizer's response parser**, with TRL's response schema for the chat templates TRL knows (Qwen2.5/3,
   Llama 3, ...), set on the tokenizer as ``GRPOTrainer`` does. Tool-call JSON it cannot read is a parse failure,
   unless ``repair_tool_calls``: then the turn is read again as reader 2 reads it, with repairs.
   Special tokens other than a final eos are dropped first (a turn ended by Qwen's ``<|endoftext|>``, a
   ``<|fim_middle|>`` written mid-answer), so no message content ever holds one.
2. **Hermes ``<tool_call>`` blocks** (:func:`parse_tool_call_blocks`) on the decoded text, for templates neither
   transformers nor TRL knows. An unclosed block or one that is not a JSON object is a parse failure. With
   ``repair_tool_calls`` (opt-in) a block gets the repairs reader 3 makes (code fences, one or two closing braces
   missing), and a last block left open at the end of the turn is closed. The slip a warm-started model makes at
   temperature 1 is another one: the call's JSON is whole, and the token after it is not ``</tool_call>`` (a second
   ``<tool_call>``, or any token of the vocabulary's tail: 904 of the 988 turns refused in six GPU runs,
   ``experiments/results/learning.md``). :func:`tool_call_end` finds where such a call ends; the rollout engine's
   ``close_tool_calls`` cuts the turn there and closes the block itself (900 of the 988 read so).
3. **Bare JSON calls** (opt-in, ``bare_json_tool_calls``), applied to a message the first two read without tool
   calls: content that is nothing but ``{"name": ..., "arguments": {...}}`` objects, one per line, is read as those
   calls. Small models (Qwen2.5-Coder-0.5B-Instruct) call tools this way; the two slips they make (Markdown code
   fences, one or two closing braces missing at the end) are repaired. A call of an unknown tool is still a call
   (the environment answers it with an error), never a final answer. Anything else stays the answer it was: this
   reader never fails a turn.

Whatever a reader returns must be renderable by the chat template and sendable as JSON, or the turn fails (None)
before it reaches the environment: a lone UTF-16 surrogate (JSON ``"\\ud800"``: valid JSON, no
Unicode; httpx and the tokenizer raise on it) anywhere in the message, or arguments nested deeper than
:data:`MAX_ARGUMENT_DEPTH`. A reader that raises on pathological JSON (nesting too deep for the JSON parser, an
integer over 4,300 digits) fails the turn too; one malformed turn so costs only its own rollout (``ERROR_PARSE``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

Parser = Callable[[list[int], list[int]], dict | None]

# Deepest nesting of tool-call arguments a turn may have; real calls nest 1-3 levels, and the chat template's tojson
# recurses once per level (~990 levels raised RecursionError while rendering).
MAX_ARGUMENT_DEPTH = 32

# What JSON readers raise on text they cannot read: JSONDecodeError and too-long integers (ValueError), nesting
# deeper than the interpreter's recursion limit (RecursionError).
_UNREADABLE = (ValueError, RecursionError)


def response_parser(tokenizer, tools: list[dict], bare_json_tool_calls: bool = False,
                    repair_tool_calls: bool = False) -> Parser:
    """``parse(generated_ids, prefix_ids) -> assistant message | None`` (None: the turn cannot be parsed).

    Uses the tokenizer's response parser, with TRL's response template for chat templates it knows (Qwen2.5/3,
    Llama 3, ...); chat templates neither knows get :func:`parse_tool_call_blocks` on the decoded text. With
    ``repair_tool_calls``, a turn the first reader cannot read is read again by :func:`parse_tool_call_blocks` with
    its repairs. With ``bare_json_tool_calls``, a parsed message without tool calls goes through
    :func:`_bare_json_tool_call`.
    """
    parse = _template_parser(tokenizer, tools)
    tool_names = {tool["function"]["name"] for tool in tools}

    def parse_turn(ids: list[int], prefix: list[int]) -> dict | None:
        try:
            message = parse(ids, prefix)
            if message is None and repair_tool_calls:
                message = parse_tool_call_blocks(tokenizer.decode(ids, skip_special_tokens=True), repair=True)
            if message is not None and bare_json_tool_calls:
                message = _bare_json_tool_call(message, tool_names)
        except _UNREADABLE:
            return None
        return message if message is not None and _renderable(message) else None

    return parse_turn


def _renderable(message: dict) -> bool:
    """Whether every string in ``message`` is valid Unicode and its nesting stays within the argument depth.

    ``{"content": "ok"}`` -> True; ``{"content": "a\\ud800"}`` -> False; arguments nested 33 levels -> False.
    """
    stack = [(message, 0)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_ARGUMENT_DEPTH + 3:  # message -> tool_calls -> call -> function -> arguments
            return False
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                return False
        elif isinstance(value, dict):
            stack.extend((item, depth + 1) for pair in value.items() for item in pair)
        elif isinstance(value, list):
            stack.extend((item, depth + 1) for item in value)
    return True


def _template_parser(tokenizer, tools: list[dict]) -> Parser:
    """Readers 1 and 2 of the module docstring: the tokenizer's response parser, else ``<tool_call>`` blocks."""
    from transformers.utils.chat_parsing.response_templates import load_response_template
    from trl.chat_template_utils import add_response_schema

    if getattr(tokenizer, "response_template", None) is None and getattr(tokenizer, "response_schema", None) is None:
        try:
            add_response_schema(tokenizer)  # sets it on the tokenizer in place, as GRPOTrainer does
        except ValueError:
            return lambda ids, prefix: parse_tool_call_blocks(tokenizer.decode(ids, skip_special_tokens=True))

    # Loaded once: parse_response compiles the template's patterns on every call otherwise (0.3 ms a turn).
    template = load_response_template(tokenizer.response_template)
    special = _special_token_ids(tokenizer)

    def parse(ids: list[int], prefix: list[int]) -> dict | None:
        # The parser would keep special tokens as text: drop all but a final eos (a turn ended by another stop
        # token, Qwen's <|endoftext|>, or a <|fim_middle|> written mid-answer), so no answer ever holds one.
        end = ids[-1:] if ids and ids[-1] == tokenizer.eos_token_id else []
        ids = [i for i in ids[: len(ids) - len(end)] if i not in special] + end
        try:
            parsed = tokenizer.parse_response(ids, template, prefix=_prefix_text(tokenizer, template, prefix),
                                              tools=tools or None)
        except _UNREADABLE:  # ValueError: the parser's way of saying a tool call is not valid JSON
            return None
        return _assistant_message(parsed)

    return parse


# Tokens at the end of a prompt decoded to find its last start anchor: a generation prompt is a few tokens (Qwen3's
# "<|im_start|>assistant\n<think>\n\n</think>\n\n" is 8).
PREFIX_TAIL_TOKENS = 64


def _prefix_text(tokenizer, template, prefix: list[int]) -> str:
    """The prompt as the response parser reads it, decoded from its last start anchor on only.

    The parser keeps only what follows the last start anchor of the prompt (the assistant header); decoding the whole
    prompt, passages and all, for that cost 0.4 ms a turn. The tail of ``PREFIX_TAIL_TOKENS`` is decoded and cut at
    its last anchor, which is the whole prompt's last anchor: the text after it is the same either way. A prompt
    whose tail holds no anchor (or a template without one) is decoded whole, as before.
    """
    anchor = template.start_anchor_re
    if anchor is None or len(prefix) <= PREFIX_TAIL_TOKENS:
        return tokenizer.decode(prefix)
    tail = tokenizer.decode(prefix[-PREFIX_TAIL_TOKENS:])
    last = None
    for last in anchor.finditer(tail):  # noqa: B007 -- the last match is the one wanted
        pass
    return tail[last.start():] if last is not None else tokenizer.decode(prefix)


def _special_token_ids(tokenizer) -> set[int]:
    """Ids of the tokenizer's special tokens, its added ones marked special included (Qwen2.5's ``<|im_start|>``,
    ``<|fim_middle|>``, ...; not ``<tool_call>``, which is an added token the parser reads)."""
    added = getattr(tokenizer, "added_tokens_decoder", {})
    return set(tokenizer.all_special_ids) | {i for i, token in added.items() if token.special}


def _assistant_message(parsed: Any) -> dict | None:
    """The parser's output as the contract's assistant message; None if a tool call lacks a name or arguments.

    ``{"content": "Paris"}`` -> ``{"role": "assistant", "content": "Paris"}``;
    ``{"tool_calls": [{"type": "function", "function": ["a"]}]}`` -> None.
    """
    if not isinstance(parsed, dict):
        return None
    calls = parsed.get("tool_calls") or []
    well_formed = isinstance(calls, list) and all(
        isinstance(call, dict)
        and isinstance(call.get("function"), dict)
        and isinstance(call["function"].get("name"), str)
        and isinstance(call["function"].get("arguments", {}), (dict, str))
        for call in calls
    )
    if not well_formed:
        return None
    message = {"role": "assistant", "content": (parsed.get("content") or "").strip()}
    if parsed.get("reasoning_content"):
        message["reasoning_content"] = parsed["reasoning_content"]
    if calls:
        message["tool_calls"] = [
            {"type": "function",
             "function": {"name": c["function"]["name"], "arguments": c["function"].get("arguments", {})}}
            for c in calls
        ]
    return message


_FENCE_OPEN = re.compile(r"^```(?:json)?\s*")
_FENCE_CLOSE = re.compile(r"\s*```$")
_WHITESPACE = re.compile(r"\s*")


def _repaired_json(text: str) -> Any:
    """``text`` as JSON, after adding the one or two closing braces a small model may have left off; None if not."""
    for suffix in ("", "}", "}}"):
        try:
            return json.loads(text + suffix)
        except _UNREADABLE:
            continue
    return None


def _loads_calls(text: str) -> list | None:
    """The JSON values of bare tool calls as small models write them, one or several separated by whitespace (one
    per line); None if the text is not such a sequence even after repair.

    Repairs the two slips Qwen2.5-Coder-0.5B makes: Markdown code fences around the calls (either or both), and one
    or two closing braces missing at the end. ``'```json\n{"a": {"b": 1}\n```'`` -> ``[{"a": {"b": 1}}]``.
    """
    text = _FENCE_CLOSE.sub("", _FENCE_OPEN.sub("", text.strip()))
    decoder, values, position = json.JSONDecoder(), [], 0
    while position < len(text):
        try:
            value, end = decoder.raw_decode(text, position)
        except _UNREADABLE:
            last = _repaired_json(text[position:])
            return None if last is None else [*values, last]
        values.append(value)
        position = _WHITESPACE.match(text, end).end()
    return values or None


def _as_call(value: Any, tool_names: set[str]) -> dict | None:
    """The tool call a bare JSON value stands for; None if it is no call.

    A JSON object is a call when it names one of ``tool_names``, or names anything with an ``arguments`` field: a
    call of an unknown tool is still a call (the environment answers it with an error), not a final answer; read
    as an answer it would end the rollout, which a policy learns to exploit when finishing pays more than a
    budget cut.
    """
    if not (isinstance(value, dict) and isinstance(value.get("name"), str)
            and (value["name"] in tool_names or "arguments" in value)
            and isinstance(value.get("arguments", {}), (dict, str))):
        return None
    return {"type": "function", "function": {"name": value["name"], "arguments": value.get("arguments", {})}}


def _bare_json_tool_call(message: dict, tool_names: set[str]) -> dict:
    """``message``, with content that is only JSON tool calls read as those calls (see :func:`_as_call`).

    ``'{"name": "search", "arguments": {"query": "x"}}'`` -> content ``""`` and one call of ``search``; so is the same
    call in code fences or missing its last braces, and several such objects one per line are several calls
    (:func:`_loads_calls`). Any other content (text, other JSON, a call followed by a non-call, JSON that cannot be
    repaired) is left as it is.
    """
    values = _loads_calls(message["content"]) if not message.get("tool_calls") else None
    calls = [_as_call(value, tool_names) for value in values or []]
    if not calls or None in calls:
        return message
    return {**message, "content": "", "tool_calls": calls}


def tool_call_end(text: str) -> int | None:
    """Index just past the JSON object of the first ``<tool_call>`` block that its closing tag does not follow; None
    when every block is closed, or a block's JSON is not a whole object.

    ``'<tool_call>\n{"name": "f", "arguments": {}}\n<tool_call>'`` -> 42 (the end of the object), so the turn can
    be cut there and closed: what the model wrote after a whole call is no part of it. Blocks inside a leading
    ``<think>`` section are not calls.
    """
    think = text.rfind("</think>")
    position = 0 if think < 0 else think + len("</think>")
    decoder = json.JSONDecoder()
    while (opening := text.find("<tool_call>", position)) >= 0:
        start = _WHITESPACE.match(text, opening + len("<tool_call>")).end()
        try:
            value, end = decoder.raw_decode(text, start)
        except _UNREADABLE:
            return None
        if not isinstance(value, dict):
            return None
        after = _WHITESPACE.match(text, end).end()
        if not text.startswith("</tool_call>", after):
            return end
        position = after + len("</tool_call>")
    return None


_THINK = re.compile(r"<think>.*?</think>\s*", re.DOTALL)
_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def parse_tool_call_blocks(text: str, repair: bool = False) -> dict | None:
    """Hermes-style ``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` blocks, for templates TRL doesn't know.

    ``'Hi<tool_call>{"name": "f", "arguments": {}}</tool_call>'`` -> content ``"Hi"`` and one call of ``f``;
    an unclosed ``<tool_call>`` or a block that is not a JSON object -> None. With ``repair``, a last block open at
    the end of the text is closed and a block's JSON gets :func:`_loads_calls`' repairs:
    ``'<tool_call>{"name": "f", "arguments": {"q": 1}</tool_call>'`` -> one call of ``f`` with ``{"q": 1}``.
    """
    text = _THINK.sub("", text)
    if repair and text.count("<tool_call>") == text.count("</tool_call>") + 1 and \
            text.rfind("<tool_call>") > text.rfind("</tool_call>"):
        text = text.rstrip() + "</tool_call>"
    blocks = _TOOL_CALL.findall(text)
    if len(blocks) != text.count("<tool_call>"):
        return None
    calls = []
    for block in blocks:
        try:
            call = json.loads(block)
        except _UNREADABLE:
            values = _loads_calls(block) if repair else None
            if not values or len(values) != 1:
                return None
            call = values[0]
        if not isinstance(call, dict):
            return None
        function = {"name": call.get("name"), "arguments": call.get("arguments", {})}
        calls.append({"type": "function", "function": function})
    return _assistant_message({"content": text.split("<tool_call>", 1)[0], "tool_calls": calls})
