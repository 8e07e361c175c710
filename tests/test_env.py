"""Search-R1 environment and its retrieval client: tool exposure, prompt, tool-call handling, batched retrieval and
its failure handling.

Faults are injected by a small retrieval server on a real loopback socket whose answers each test scripts.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time

import pytest

from searchr1_trl.engine.rollout import EnvFactory, EnvStep, MessageEnv
from searchr1_trl.serving.processes import free_port
from searchr1_trl.tasks.common.data import SearchR1Sample
from searchr1_trl.tasks.common.retrieval import RetrievalClient, passages_text
from searchr1_trl.tasks.common.search import EMPTY_QUERY_MESSAGE, RESTATEMENT, SearchR1EnvConfig
from searchr1_trl.tasks.search_r1.env import INSTRUCTION, SEARCH_TOOL, SearchR1EnvFactory
from tests.conftest import serve_fake

SAMPLE = SearchR1Sample(question="Where is the Eiffel Tower?", golden_answers=("Paris",))


class FakeRetriever:
    """A /retrieve server on loopback. Each request takes the next behaviour of ``script`` ("ok" once it is empty):

    - "ok": ``topk`` passages per query, contents ``"Title <query>\\nPassage <i> about <query>."``
    - "500" / "400": that HTTP status
    - "garbage": 200 with a body that is not JSON
    - "wrong shape": 200 with ``{"result": []}``
    - "slow": answers "ok" after 1 s
    """

    def __init__(self):
        self.script: list[str] = []
        self.requests: list[dict] = []

        def answer(method, path, body):
            if method != "POST":
                return 501, b""  # /retrieve only
            self.requests.append(body)
            behaviour = self.script.pop(0) if self.script else "ok"
            if behaviour == "slow":
                time.sleep(1.0)
            return {
                "500": (500, b"internal error"),
                "400": (400, b"bad request"),
                "garbage": (200, b"<html>not json"),
                "wrong shape": (200, b'{"result": []}'),
            }.get(behaviour, (200, json.dumps({"result": [
                [{"contents": f"Title {q}\nPassage {i} about {q}."} for i in range(body["topk"])]
                for q in body["queries"]
            ]}).encode()))

        self.server = serve_fake(answer)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/retrieve"

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def fake_retriever_server():
    server = FakeRetriever()
    yield server
    server.close()


@pytest.fixture
def fake_retriever(fake_retriever_server):
    """The module's fake server with an empty script and no recorded requests."""
    fake_retriever_server.script, fake_retriever_server.requests = [], []
    return fake_retriever_server


def env_for(url: str, **overrides) -> SearchR1EnvFactory:
    return SearchR1EnvFactory(SearchR1EnvConfig(search_url=url, retry_backoff_s=0.01, **overrides))


def search_call(arguments, name="search") -> dict:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def assistant(*calls, content="") -> dict:
    return {"role": "assistant", "content": content, "tool_calls": list(calls)}


async def env_step(envs: SearchR1EnvFactory, message: dict, sample: SearchR1Sample = SAMPLE) -> EnvStep:
    """The answer to ``message``, the first turn of a rollout of ``sample`` in an env of its own."""
    env = envs()
    return await env.step([*env.reset(sample), message])


def step(envs: SearchR1EnvFactory, message: dict) -> EnvStep:
    return asyncio.run(env_step(envs, message))


def fake_passages(query: str, topk: int = 3) -> str:
    return "\n".join(f"Doc {i + 1}(Title: Title {query}) Passage {i} about {query}." for i in range(topk))


def test_the_only_tool_is_search_with_one_required_string_query():
    envs = SearchR1EnvFactory()

    assert isinstance(envs, EnvFactory) and isinstance(envs(), MessageEnv)
    assert envs.tools == [SEARCH_TOOL]
    function = SEARCH_TOOL["function"]
    assert SEARCH_TOOL["type"] == "function" and function["name"] == "search"
    assert "Wikipedia" in function["description"] and "passages" in function["description"]
    assert function["parameters"] == {
        "type": "object",
        "properties": {"query": {"type": "string", "description": "The natural-language search query."}},
        "required": ["query"],
    }


def test_reset_starts_the_rollout_with_the_instruction_then_the_question_as_one_user_message():
    assert SearchR1EnvFactory()().reset(SAMPLE) == [
        {"role": "user", "content": f"{INSTRUCTION}\n\nQuestion: Where is the Eiffel Tower?"}
    ]
    assert "search" in INSTRUCTION and "only the answer" in INSTRUCTION and "Beijing" in INSTRUCTION


def test_the_chat_template_renders_the_tool_and_the_question(tokenizer):
    env = SearchR1EnvFactory()
    messages = env().reset(SAMPLE)

    prompt = tokenizer.apply_chat_template(messages, tools=env.tools, add_generation_prompt=True, tokenize=False)

    assert json.dumps(SEARCH_TOOL) in prompt
    assert prompt.index(json.dumps(SEARCH_TOOL)) < prompt.index("<|im_start|>user\n" + INSTRUCTION)
    assert prompt.endswith("Question: Where is the Eiffel Tower?<|im_end|>\n<|im_start|>assistant\n")
    with_switch = tokenizer.apply_chat_template(
        messages, tools=env.tools, add_generation_prompt=True, tokenize=False, enable_thinking=False
    )
    assert with_switch == prompt  # templates without a thinking mode ignore the switch


def test_the_chat_template_renders_tool_calls_and_search_results(tokenizer):
    messages = [
        *SearchR1EnvFactory()().reset(SAMPLE),
        assistant(search_call({"query": "Eiffel Tower"})),
        {"role": "tool", "name": "search", "content": "Doc 1(Title: Eiffel Tower) A tower in Paris."},
    ]

    prompt = tokenizer.apply_chat_template(messages, tools=[SEARCH_TOOL], add_generation_prompt=True, tokenize=False)

    assert '<tool_call>\n{"name": "search", "arguments": {"query": "Eiffel Tower"}}\n</tool_call>' in prompt
    assert "<tool_response>\nDoc 1(Title: Eiffel Tower) A tower in Paris.\n</tool_response>" in prompt


def test_passages_are_formatted_one_doc_per_line_with_their_title():
    docs = [{"contents": "Eiffel Tower\nA tower in Paris."}, {"contents": "Paris\nCapital of France.\nOn the Seine."}]

    assert passages_text(docs) == (
        "Doc 1(Title: Eiffel Tower) A tower in Paris.\nDoc 2(Title: Paris) Capital of France.\nOn the Seine."
    )


@pytest.mark.parametrize("message", [
    {"role": "assistant", "content": "Paris"},
    {"role": "assistant", "content": "Paris", "tool_calls": []},
], ids=["no tool_calls", "empty tool_calls"])
def test_a_turn_without_tool_calls_is_done(message):
    assert step(SearchR1EnvFactory(), message) == EnvStep(messages=[], done=True)


def test_a_search_call_gets_one_tool_message_with_the_passages(fake_retriever):
    env = env_for(fake_retriever.url)

    result = step(env, assistant(search_call({"query": "Eiffel Tower"})))

    assert result == EnvStep(
        messages=[{"role": "tool", "name": "search", "content": fake_passages("Eiffel Tower")}], done=False
    )
    assert fake_retriever.requests == [{"queries": ["Eiffel Tower"], "topk": 3, "return_scores": False}]


def test_arguments_as_a_json_string_work_like_a_dict(fake_retriever):
    env = env_for(fake_retriever.url, topk=1)

    result = step(env, assistant(search_call('{"query": "Eiffel Tower"}')))

    assert result.messages[0]["content"] == "Doc 1(Title: Title Eiffel Tower) Passage 0 about Eiffel Tower."


def test_the_tool_call_id_is_echoed_when_the_call_has_one(fake_retriever):
    call = {"id": "call_7", **search_call({"query": "x"})}

    assert step(env_for(fake_retriever.url), assistant(call)).messages[0]["tool_call_id"] == "call_7"


@pytest.mark.parametrize(
    "arguments", ['{"query', "", {}, {"query": "   "}, {"query": 42}, '["Eiffel Tower"]', None],
    ids=["unparseable", "empty string", "no query", "blank query", "not a string", "not an object", "none"],
)
def test_a_call_without_a_usable_query_sends_nothing_and_says_so(fake_retriever, arguments):
    env = env_for(fake_retriever.url)

    result = step(env, assistant(search_call(arguments)))

    assert result == EnvStep(messages=[{"role": "tool", "name": "search", "content": EMPTY_QUERY_MESSAGE}], done=False)
    assert fake_retriever.requests == []
    assert env.metrics()["search/empty_queries"] == 1


def test_an_unknown_tool_is_answered_and_counted(fake_retriever):
    env = env_for(fake_retriever.url)

    result = step(env, assistant(search_call({"query": "x"}, name="browse")))

    assert result.messages == [
        {"role": "tool", "name": "browse", "content": 'Error: unknown tool \'browse\'; the only tool is "search".'}
    ]
    assert fake_retriever.requests == []
    assert env.metrics()["search/unknown_tool_calls"] == 1


def test_the_calls_of_a_turn_run_concurrently_as_one_batched_request(fake_retriever):
    env = env_for(fake_retriever.url, topk=2)

    result = step(env, assistant(search_call({"query": "Eiffel Tower"}), search_call('{"query": "Louvre"}')))

    assert fake_retriever.requests == [{"queries": ["Eiffel Tower", "Louvre"], "topk": 2, "return_scores": False}]
    assert [m["content"] for m in result.messages] == [fake_passages("Eiffel Tower", 2), fake_passages("Louvre", 2)]
    assert env.metrics() == {
        "search/searches": 2, "search/requests": 1, "search/failures": 0,
        "search/request_latency_s": pytest.approx(0.0, abs=1.0),
        "search/empty_queries": 0, "search/unknown_tool_calls": 0, "search/failed_steps": 0,
    }


def test_concurrent_rollouts_share_one_request_and_identical_queries_are_sent_once(fake_retriever):
    env = env_for(fake_retriever.url)

    async def three_rollouts():
        return await asyncio.gather(
            env_step(env, assistant(search_call({"query": "Eiffel Tower"}))),
            env_step(env, assistant(search_call({"query": "Eiffel Tower"}))),
            env_step(env, assistant(search_call({"query": "Louvre"}))),
        )

    results = asyncio.run(three_rollouts())

    assert [r.messages[0]["content"] for r in results] == [
        fake_passages("Eiffel Tower"), fake_passages("Eiffel Tower"), fake_passages("Louvre")
    ]
    assert fake_retriever.requests == [{"queries": ["Eiffel Tower", "Louvre"], "topk": 3, "return_scores": False}]
    assert env.metrics()["search/searches"] == 3


def test_a_query_that_is_not_text_fails_alone_not_the_batch_it_would_join(fake_retriever):
    # TRL's tool loop hands the model's arguments to a search function unchecked; a dict query once failed the whole
    # batched request with it, and every rollout in that batch waited forever.
    client = RetrievalClient(SearchR1EnvConfig(search_url=fake_retriever.url))

    async def two_searches():
        return await asyncio.gather(client.search("Louvre"), client.search({"query": "Louvre"}),
                                    return_exceptions=True)

    answered, rejected = asyncio.run(asyncio.wait_for(two_searches(), timeout=30))

    assert answered == fake_passages("Louvre")
    assert isinstance(rejected, TypeError) and "must be a str, got dict" in str(rejected)
    assert fake_retriever.requests == [{"queries": ["Louvre"], "topk": 3, "return_scores": False}]


def test_searches_of_different_instants_are_separate_requests(fake_retriever):
    env = env_for(fake_retriever.url)

    async def two_turns():
        await env_step(env, assistant(search_call({"query": "a"})))
        await env_step(env, assistant(search_call({"query": "b"})))

    asyncio.run(two_turns())

    assert [r["queries"] for r in fake_retriever.requests] == [["a"], ["b"]]


def test_the_client_keeps_working_across_event_loops(fake_retriever):
    env = env_for(fake_retriever.url, topk=1)

    first = step(env, assistant(search_call({"query": "a"})))
    second = step(env, assistant(search_call({"query": "b"})))

    assert first.messages[0]["content"] == fake_passages("a", 1)
    assert second.messages[0]["content"] == fake_passages("b", 1)


def test_a_failed_request_is_retried(fake_retriever):
    fake_retriever.script = ["500", "garbage"]
    env = env_for(fake_retriever.url, max_retries=2)

    result = step(env, assistant(search_call({"query": "Eiffel Tower"})))

    assert result.messages[0]["content"] == fake_passages("Eiffel Tower")
    assert len(fake_retriever.requests) == 3
    metrics = env.metrics()
    assert (metrics["search/requests"], metrics["search/failures"]) == (3, 0)


@pytest.mark.parametrize("fault", ["500", "garbage", "wrong shape"])
def test_a_search_that_keeps_failing_gets_an_empty_result_and_is_counted_and_logged(fake_retriever, caplog, fault):
    fake_retriever.script = [fault] * 3
    env = env_for(fake_retriever.url, max_retries=2)

    with caplog.at_level(logging.WARNING, logger="searchr1_trl.tasks.common.retrieval"):
        result = step(env, assistant(search_call({"query": "a"}), search_call({"query": "b"})))

    assert [m["content"] for m in result.messages] == ["", ""]
    assert len(fake_retriever.requests) == 3
    metrics = env.metrics()
    assert (metrics["search/searches"], metrics["search/requests"], metrics["search/failures"]) == (2, 3, 2)
    assert "retrieval of 2 queries from " + fake_retriever.url + " failed after 3 attempt(s)" in caplog.text


def test_a_request_that_times_out_gets_an_empty_result(fake_retriever):
    fake_retriever.script = ["slow", "slow"]
    env = env_for(fake_retriever.url, timeout_s=0.2, max_retries=1)

    result = step(env, assistant(search_call({"query": "a"})))

    assert result.messages[0]["content"] == ""  # each "slow" answer (1 s) came after its 0.2 s timeout
    assert len(fake_retriever.requests) == 2
    assert env.metrics()["search/failures"] == 1


def test_a_rejected_request_is_not_retried(fake_retriever):
    fake_retriever.script = ["400"]
    env = env_for(fake_retriever.url, max_retries=2)

    assert step(env, assistant(search_call({"query": "a"}))).messages[0]["content"] == ""
    assert len(fake_retriever.requests) == 1


def test_an_unreachable_server_gives_empty_results():
    env = env_for(f"http://127.0.0.1:{free_port()}/retrieve", max_retries=1)

    result = step(env, assistant(search_call({"query": "a"})))

    assert result.messages[0]["content"] == ""
    metrics = env.metrics()
    assert (metrics["search/requests"], metrics["search/failures"]) == (2, 1)


def test_metrics_reset_on_read(fake_retriever):
    env = env_for(fake_retriever.url)
    step(env, assistant(search_call({"query": "a"})))

    assert env.metrics()["search/searches"] == 1
    assert env.metrics()["search/searches"] == 0


@pytest.mark.parametrize("overrides, problem", [
    ({"search_url": "127.0.0.1:8000/retrieve"}, "search_url must be an http(s) URL"),
    ({"topk": 0}, "expected topk >= 1"),
    ({"max_retries": -1}, "max_retries=-1"),
])
def test_a_bad_config_is_refused_when_built(overrides, problem):
    with pytest.raises(ValueError, match=re.escape(problem)):
        RetrievalClient(SearchR1EnvConfig(**overrides))


@pytest.mark.slow  # the session's retriever_url fixture embeds and indexes the test corpus first
def test_the_real_retrieval_server_returns_formatted_passages(retriever_url):
    env = SearchR1EnvFactory(SearchR1EnvConfig(search_url=retriever_url))

    result = step(env, assistant(
        search_call({"query": "Super Bowl 50 AFC champion team"}), search_call('{"query": "Super Bowl 50 venue"}')
    ))

    assert len(result.messages) == 2
    for message in result.messages:
        lines = message["content"].split("\n")
        assert [line[:13] for line in lines[:1]] == ["Doc 1(Title: "]
        assert sum(line.startswith("Doc ") for line in lines) == 3
        assert "Super Bowl 50" in message["content"]
    metrics = env.metrics()
    assert (metrics["search/searches"], metrics["search/requests"], metrics["search/failures"]) == (2, 1, 0)


def test_restated_question_follows_the_passages_of_a_search_but_not_an_error(retriever_url):
    sample = SearchR1Sample("Which team won Super Bowl 50?", ("Denver Broncos",))
    calls = assistant(search_call({"query": "Super Bowl 50 champion"}), search_call({"query": ""}))
    restating = SearchR1EnvFactory(SearchR1EnvConfig(search_url=retriever_url, restate_question=True))
    plain = SearchR1EnvFactory(SearchR1EnvConfig(search_url=retriever_url))

    passages, error = asyncio.run(env_step(restating, calls, sample)).messages
    plain_passages, _ = asyncio.run(env_step(plain, calls, sample)).messages

    assert passages["content"] == f"{plain_passages['content']}\n\n{RESTATEMENT.format(question=sample.question)}"
    assert plain_passages["content"].startswith("Doc 1(Title: ") and "Question:" not in plain_passages["content"]
    assert error["content"] == EMPTY_QUERY_MESSAGE


def test_the_restatement_is_the_envs_own_question_never_one_read_from_the_prompt(fake_retriever):
    env = env_for(fake_retriever.url, restate_question=True)()
    env.reset(SAMPLE)
    elsewhere = {"role": "user", "content": "Question: Who built the Louvre?"}  # not what reset built

    result = asyncio.run(env.step([elsewhere, assistant(search_call({"query": "a"}))]))

    assert result.messages[0]["content"] == f"{fake_passages('a')}\n\n{RESTATEMENT.format(question=SAMPLE.question)}"


def test_searching_again_pages_on_when_seen_passages_are_excluded(retriever_url):
    call = assistant(search_call({"query": "Super Bowl 50"}))

    async def search_twice(exclude: bool) -> list[set[str]]:
        envs = SearchR1EnvFactory(SearchR1EnvConfig(search_url=retriever_url, topk=2, exclude_seen_passages=exclude))
        env = envs()
        messages = [*env.reset(SAMPLE), call]
        first = await env.step(messages)
        second = await env.step([*messages, *first.messages, call])
        await envs.aclose()
        # Each passage without its "Doc <n>" number, which restarts in every result.
        return [{line.split("(Title: ", 1)[1] for line in step.messages[0]["content"].splitlines()}
                for step in (first, second)]

    paged, repeated = asyncio.run(search_twice(True)), asyncio.run(search_twice(False))

    assert repeated[0] == repeated[1] == paged[0] and len(paged[0]) == 2  # the seed's behaviour, and page one
    assert len(paged[1]) == 2 and not paged[0] & paged[1]  # the next two passages, none shown before


def test_a_batch_beyond_the_servers_request_caps_is_sent_in_parts(retriever_url):
    # The server refuses a request over its max_request_cost whole (422): the client keeps each within the caps.
    config = SearchR1EnvConfig(search_url=retriever_url, topk=3, max_request_documents=6)
    client = RetrievalClient(config)

    async def search_all() -> list[str]:
        try:
            return await asyncio.gather(*(client.search(f"Super Bowl {n}") for n in range(5)))
        finally:
            await client.aclose()

    results = asyncio.run(search_all())

    assert all(text.count("\n") == 2 for text in results)  # three passages each: no search failed
    assert client.metrics() | {"search/request_latency_s": 0} == {
        "search/searches": 5, "search/requests": 3, "search/failures": 0, "search/request_latency_s": 0}
