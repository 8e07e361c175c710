"""The rollout comparison's TRL loop (benchmarks/rollout_throughput.py) parses turns as our rollout engine does."""

import pytest

BARE_CALL = '{"name": "search", "arguments": {"query": "Super Bowl 50"}}<|im_end|>'


@pytest.fixture(scope="module")
def prefix(tokenizer):
    return list(tokenizer.apply_chat_template([{"role": "user", "content": "q"}], add_generation_prompt=True,
                                              tokenize=True, return_dict=True)["input_ids"])


def test_trl_reads_a_bare_json_call_as_a_search_through_our_parser(offline_assets, tokenizer, prefix):
    from trl.chat_template_utils import add_response_schema, parse_response

    from benchmarks.rollout_throughput import tokenizer_with_our_parser

    ids = tokenizer(BARE_CALL, add_special_tokens=False)["input_ids"]
    call = {"type": "function", "function": {"name": "search", "arguments": {"query": "Super Bowl 50"}}}
    ours = tokenizer_with_our_parser(offline_assets.model, bare_json_tool_calls=True)
    assert parse_response(ours, ids, prefix=prefix) == {"role": "assistant", "content": "", "tool_calls": [call]}
    # TRL's own parser reads the same turn as a final answer: why the comparison plugs ours in.
    from transformers import AutoTokenizer

    theirs = add_response_schema(AutoTokenizer.from_pretrained(offline_assets.model))
    assert "tool_calls" not in parse_response(theirs, ids, prefix=prefix)


def test_trl_reads_an_answer_as_an_answer_through_our_parser(offline_assets, tokenizer, prefix):
    from trl.chat_template_utils import parse_response

    from benchmarks.rollout_throughput import tokenizer_with_our_parser

    ids = tokenizer("Denver Broncos<|im_end|>", add_special_tokens=False)["input_ids"]
    ours = tokenizer_with_our_parser(offline_assets.model, bare_json_tool_calls=True)
    assert parse_response(ours, ids, prefix=prefix) == {"role": "assistant", "content": "Denver Broncos"}
