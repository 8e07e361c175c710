"""The rollout comparison's TRL loop (experiments/rollout_throughput.py) parses turns as our rollout engine does."""

import pytest

BARE_CALL = '{"name": "search", "arguments": {"query": "Super Bowl 50"}}<|im_end|>'


@pytest.fixture(scope="module")
def prefix(tokenizer):
    return list(tokenizer.apply_chat_template([{"role": "user", "content": "q"}], add_generation_prompt=True,
                                              tokenize=True, return_dict=True)["input_ids"])


def test_trl_reads_a_bare_json_call_as_a_search_through_our_parser(offline_assets, tokenizer, prefix):
    from trl.chat_template_utils import add_response_schema, parse_response

    from experiments.rollout_throughput import tokenizer_with_our_parser

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

    from experiments.rollout_throughput import tokenizer_with_our_parser

    ids = tokenizer("Denver Broncos<|im_end|>", add_special_tokens=False)["input_ids"]
    ours = tokenizer_with_our_parser(offline_assets.model, bare_json_tool_calls=True)
    assert parse_response(ours, ids, prefix=prefix) == {"role": "assistant", "content": "Denver Broncos"}


def test_search_split_takes_the_servers_counters_over_one_run_only():
    from experiments.rollout_throughput import search_split

    client = {"search/requests": 10, "search/request_latency_s": 0.5}
    before = {"requests_total": 100, "queries_total": 400, "batches_total": 50, "request_seconds_total": 99.0,
              "batch_seconds_total": 9.0}
    after = {"requests_total": 110, "queries_total": 440, "batches_total": 54, "request_seconds_total": 100.0,
             "batch_seconds_total": 9.2}

    split = search_split(client, before, after, lags=[0.001, 0.002, 0.003, 0.2])

    assert split["client_request_latency_ms"] == 500.0 and split["client_requests"] == 10
    # The run's own 10 requests and 4 batches, not the server's lifetime averages (0.91 s, 0.18 s).
    assert split["server_requests"] == 10 and split["server_request_latency_ms"] == 100.0
    assert split["server_batch_ms"] == 50.0 and split["server_queries_per_batch"] == 10.0
    assert split["client_loop_lag_ms"] == {"mean": 51.5, "p90": 3.0, "max": 200.0}
    assert search_split(client, before, before)["server_request_latency_ms"] is None  # a run without searches


def test_loop_lag_sees_a_loop_held_by_blocking_work():
    import asyncio
    import time

    from experiments.rollout_throughput import loop_lag

    async def main():
        lags: list[float] = []
        probe = asyncio.get_running_loop().create_task(loop_lag(lags))
        await asyncio.sleep(0.05)
        time.sleep(0.1)  # CPU work on the loop, as a burst of rollout turns is
        await asyncio.sleep(0.05)
        probe.cancel()
        return lags

    lags = asyncio.run(main())
    assert max(lags) >= 0.09 and min(lags) < 0.05


def test_tail_names_when_the_batch_finished_and_what_its_last_rollout_spent():
    from types import SimpleNamespace

    from experiments.rollout_throughput import tail

    rollouts = [SimpleNamespace(timings={"generate_s": g, "env_s": e}, num_turns=t, env_mask=[1] * n + [0] * 5)
                for g, e, t, n in [(0.5, 0.1, 2, 40), (3.9, 0.6, 3, 384), (1.0, 0.2, 2, 60), (0.8, 0.1, 1, 20)]]
    done_s = [0.7, 4.6, 1.3, 1.0]  # the second rollout finished last
    assert tail(rollouts, done_s) == {
        "rollout_done_s": {"p50": 1.3, "p90": 4.6, "max": 4.6},
        "slowest_rollout": {"generate_s": 3.9, "env_s": 0.6, "turns": 3, "generated_tokens": 384}}
