"""Assistant text -> message + tool calls, with the real Qwen2.5 tokenizer and its response parser.

Each test hands the parser a turn as the model generates it (text tokenized to ids, ending in its stop token) and
the prompt it followed, and checks the message the environment would read (None: the rollout ends as error_parse).
"""

from __future__ import annotations

import pytest
from conftest import LOOKUP_TOOL, template_tokenizer

from searchr1_trl.engine.parsing import parse_tool_call_blocks, response_parser, tool_call_end


def lookup(query: str) -> dict:
    """The tool call the environment reads for a lookup of ``query``."""
    return {"type": "function", "function": {"name": "lookup", "arguments": {"query": query}}}


@pytest.fixture
def parse(tokenizer):
    """``parse(turn, bare_json=False, repair=False)``: the message of one generated turn after a one-question prompt."""
    prefix = tokenizer.apply_chat_template([{"role": "user", "content": "Question: q"}], tools=[LOOKUP_TOOL],
                                           add_generation_prompt=True, tokenize=True, return_dict=False)

    def parse(turn: str, bare_json: bool = False, repair: bool = False) -> dict | None:
        parser = response_parser(tokenizer, [LOOKUP_TOOL], bare_json_tool_calls=bare_json, repair_tool_calls=repair)
        return parser(tokenizer.encode(turn), list(prefix))

    return parse


def test_an_answer_is_its_stripped_content(parse):
    assert parse(" Paris\n<|im_end|>") == {"role": "assistant", "content": "Paris"}


def test_a_template_tool_call_is_a_call_with_its_arguments(parse):
    turn = 'Let me check.\n<tool_call>\n{"name": "lookup", "arguments": {"query": "a"}}\n</tool_call><|im_end|>'
    assert parse(turn) == {"role": "assistant", "content": "Let me check.", "tool_calls": [lookup("a")]}


def test_tool_call_json_that_does_not_parse_is_a_parse_failure(parse):
    assert parse('<tool_call>\n{"name": "lookup", "arguments": {"query": </tool_call><|im_end|>') is None


@pytest.mark.parametrize("slip", [
    '<tool_call>\n{"name": "lookup", "arguments": {"query": "a"}\n</tool_call>',  # "}\n sampled for "}}\n
    '<tool_call>\n{"name": "lookup", "arguments": {"query": "a"\n</tool_call>',  # both braces missing
    '<tool_call>\n```json\n{"name": "lookup", "arguments": {"query": "a"}}\n```\n</tool_call>',  # in a code fence
    '<tool_call>\n{"name": "lookup", "arguments": {"query": "a"}}',  # the block left open
    '<tool_call>\n{"name": "lookup", "arguments": {"query": "a"}\n',  # open, and a brace missing
])
def test_tool_call_blocks_with_the_small_models_slips_are_repaired_only_when_asked(parse, slip):
    assert parse(slip + "<|im_end|>") is None
    assert parse(slip + "<|im_end|>", repair=True) == {"role": "assistant", "content": "", "tool_calls": [lookup("a")]}


@pytest.mark.parametrize("broken", [
    '<tool_call>\n{"name": "lookup", "arguments": {"query": </tool_call>',  # cut mid-value
    '<tool_call>\n{"name": "lookup", "arguments": {"query": "a"}}\n<tool_call>\n{"name": "lookup"}</tool_call>',
    '<tool_call>\n{"name": "lookup", "arguments": {"query": "a"}}\n{"name": "lookup"}\n</tool_call>',  # two in one
    '<tool_call>\n["lookup"]\n</tool_call>',
])
def test_tool_call_blocks_beyond_repair_still_fail_the_turn(parse, broken):
    assert parse(broken + "<|im_end|>", repair=True) is None


CALL = '{"name": "lookup", "arguments": {"query": "a"}}'


@pytest.mark.parametrize(("text", "end"), [
    (f"<tool_call>\n{CALL}\n<tool_call>", 12 + len(CALL)),  # the closing tag written as an opening one
    (f"<tool_call>\n{CALL}\n\u0e2a\u0e27\u0e31\u0e2a", 12 + len(CALL)),  # a token of the vocabulary's tail
    (f"<tool_call>\n{CALL}\nsearch</tool_call>", 12 + len(CALL)),  # stray text before the closing tag
    (f"Let me check.\n<tool_call>\n{CALL}\n<tool_call>", 26 + len(CALL)),
    (f"<tool_call>\n{CALL}\n</tool_call>\n<tool_call>\n{CALL}\n<tool_call>", 38 + 2 * len(CALL)),
    (f"<think>a <tool_call> b</think>\n<tool_call>{CALL}<tool_call>", 42 + len(CALL)),
    (f"<tool_call>\n{CALL}\n</tool_call>", None),  # closed: nothing to cut
    (f"<tool_call>\n{CALL[:-1]}\n<tool_call>", None),  # the JSON is not whole
    ('<tool_call>\n"lookup"\n<tool_call>', None),  # not an object
    (f"{CALL}\n<tool_call>", None),  # no block before the JSON
    ("Paris", None),
])
def test_tool_call_end_is_where_a_whole_unclosed_call_ends(text, end):
    assert tool_call_end(text) == end
    if end is not None:
        assert text[:end].endswith(CALL)


def test_a_turn_ended_by_another_stop_token_is_parsed_without_it(parse):
    assert parse("Paris<|endoftext|>") == {"role": "assistant", "content": "Paris"}


def test_special_tokens_written_mid_answer_never_reach_the_content(parse):
    assert parse("Par<|fim_middle|>is<|im_start|><|im_end|>") == {"role": "assistant", "content": "Paris"}
    turn = '<|box_start|><tool_call>\n{"name": "lookup", "arguments": {"query": "a"}}\n</tool_call><|endoftext|>'
    assert parse(turn) == {"role": "assistant", "content": "", "tool_calls": [lookup("a")]}


def test_thinking_is_kept_out_of_the_content(parse):
    assert parse("<think>\nIt is Paris.\n</think>\n\nParis<|im_end|>") == {
        "role": "assistant", "content": "Paris", "reasoning_content": "It is Paris."}


def test_the_fallback_parser_reads_hermes_tool_call_blocks():
    assert parse_tool_call_blocks('Hi<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>') == {
        "role": "assistant", "content": "Hi",
        "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {"x": 1}}}],
    }
    assert parse_tool_call_blocks("<think>hmm</think>Paris") == {"role": "assistant", "content": "Paris"}
    assert parse_tool_call_blocks('<tool_call>{"name": "f"') is None
    assert parse_tool_call_blocks("<tool_call>[1]</tool_call>") is None


def test_bare_json_calls_are_calls_only_when_enabled(parse):
    bare = '{"name": "lookup", "arguments": {"query": "a"}}'

    assert parse(bare + "<|im_end|>") == {"role": "assistant", "content": bare}
    assert parse(bare + "<|im_end|>", bare_json=True) == {"role": "assistant", "content": "",
                                                            "tool_calls": [lookup("a")]}


def test_a_bare_json_call_of_an_unknown_tool_is_a_call_not_an_answer(parse):
    # The trained 0.5B learned to end rollouts with such a "call" when it was read as a (wrong) final answer.
    message = parse('{"name": "tool_response", "arguments": {"query": "a"}}\n```<|im_end|>', bare_json=True)

    assert message["tool_calls"] == [{"type": "function", "function": {"name": "tool_response",
                                                                       "arguments": {"query": "a"}}}]


@pytest.mark.parametrize("answer", ['{"name": "Paris"}', '["search"]', '{"answer": "Paris"}'])
def test_bare_json_that_is_no_call_stays_an_answer(parse, answer):
    assert parse(answer + "<|im_end|>", bare_json=True) == {"role": "assistant", "content": answer}


@pytest.mark.parametrize("slip", [
    '```json\n{"name": "lookup", "arguments": {"query": "a"}}\n```',  # in a code fence
    '```\n{"name": "lookup", "arguments": {"query": "a"}}\n```',
    '{"name": "lookup", "arguments": {"query": "a"}}\n```',  # a closing fence only
    '{"name": "lookup", "arguments": {"query": "a"}',  # last brace missing
    '{"name": "lookup", "arguments": {"query": "a"',  # both missing
])
def test_bare_json_calls_with_the_small_models_slips_are_repaired(parse, slip):
    assert parse(slip + "<|im_end|>", bare_json=True)["tool_calls"] == [lookup("a")]


def test_bare_json_calls_one_per_line_are_several_calls_unless_one_is_no_call(parse):
    two = '{"name": "lookup", "arguments": {"query": "a"}}\n{"name": "lookup", "arguments": {"query": "b"}'
    mixed = '{"name": "lookup", "arguments": {"query": "a"}}\n{"response": "Paris"}'

    assert parse(two + "<|im_end|>", bare_json=True)["tool_calls"] == [lookup("a"), lookup("b")]
    assert parse(mixed + "<|im_end|>", bare_json=True) == {"role": "assistant", "content": mixed}


def test_bare_json_beyond_repair_stays_an_answer(parse):
    broken = '{"name": "lookup", "arguments": {"que'  # cut inside a string
    assert parse(broken + "<|im_end|>", bare_json=True) == {"role": "assistant", "content": broken}


@pytest.mark.parametrize(("template", "enable_thinking"),
                         [(None, False), ("qwen3.jinja", False), ("qwen3.jinja", True)])
def test_a_long_prompt_is_read_as_if_decoded_whole(offline_assets, monkeypatch, template, enable_thinking):
    import searchr1_trl.engine.parsing

    tokenizer = template_tokenizer(offline_assets, template)
    passages = "Doc 1(Title: Été) " + "Paris is the capital of France. " * 40
    conversation = [{"role": "user", "content": "Question: q"},
                    {"role": "assistant", "content": "", "tool_calls": [lookup("a")]},
                    {"role": "tool", "name": "lookup", "content": passages}]
    prompt = tokenizer.apply_chat_template(conversation, tools=[LOOKUP_TOOL], add_generation_prompt=True,
                                           tokenize=True, return_dict=False, enable_thinking=enable_thinking)
    prefilled = prompt + tokenizer.encode(" word" * 80)  # no anchor in its last PREFIX_TAIL_TOKENS
    turns = [" Paris\n<|im_end|>", "<think>\nHm.\n</think>\n\nParis<|im_end|>",
             '<tool_call>\n{"name": "lookup", "arguments": {"query": "b"}}\n</tool_call><|im_end|>']
    cases = [(tokenizer.encode(turn), prefix) for turn in turns for prefix in (prompt, prefilled)]
    assert len(prompt) > searchr1_trl.engine.parsing.PREFIX_TAIL_TOKENS

    parse = response_parser(tokenizer, [LOOKUP_TOOL])
    from_tail = [parse(ids, prefix) for ids, prefix in cases]
    monkeypatch.setattr(searchr1_trl.engine.parsing, "PREFIX_TAIL_TOKENS", 10**9)

    assert from_tail == [parse(ids, prefix) for ids, prefix in cases]
    assert from_tail[0] == {"role": "assistant", "content": "Paris"}
