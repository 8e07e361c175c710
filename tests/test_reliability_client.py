"""Reliability of the retrieval client: every fault a retriever can show
costs at most the searches it answers, within stated time bounds.

Injected faults (hang, drip, 500, 429, garbage, wrong shape, oversized) come from a scripted server on a real loopback
socket; refusal, SIGKILL mid-batch and restart use the real retrieval server (conftest's ``retriever_server``).
Figures go to ``reliability_figures`` (docs/RELIABILITY.md).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from retriever_server.launch import RetrieverProcess
from searchr1_trl.serving.processes import free_port
from searchr1_trl.tasks.common.retrieval import RetrievalClient, RetrievalConfig


class FaultyRetriever:
    """A /retrieve server whose n-th request gets ``script[n]`` ("ok" once the script is empty):

    "ok" (one passage per query), "500", "429", "garbage" (not JSON), "wrong shape", "cannot search" (a 422 of a server
    whose encoder does not fit its index), "bad request" (a 422 naming a field), "hang" (answers nothing for 30 s),
    "drip" (a valid answer, one byte every 0.1 s), "huge" (a valid answer of 2 MB), "odd text" (a passage of 10,000
    characters holding a lone surrogate escape).
    """

    def __init__(self):
        self.script: list[str] = []
        self.requests = 0
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fake.requests += 1
                behaviour = fake.script.pop(0) if fake.script else "ok"
                ok = json.dumps({"result": [[{"contents": f"T\nabout {q}"}] for q in body["queries"]]}).encode()
                status, payload = {
                    "500": (500, b"internal error"), "429": (429, b"slow down"), "garbage": (200, b"<html>"),
                    "wrong shape": (200, b'{"result": []}'),
                    "cannot search": (422, b'{"detail": "queries[0]: cannot be searched (RuntimeError: mat1 and '
                                           b'mat2 shapes cannot be multiplied)"}'),
                    "bad request": (422, b'{"detail": "topk: expected an integer in [1, 100], got 0"}'),
                    "huge": (200, json.dumps({"result": [[{"contents": "T\n" + "x" * (2 << 20)}]]}).encode()),
                    "odd text": (200, b'{"result": [[{"contents": "T\\nbad \\ud800 ' + b"y" * 10_000 + b'"}]]}'),
                }.get(behaviour, (200, ok))
                try:
                    if behaviour == "hang":
                        time.sleep(30)
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    if behaviour == "drip":
                        for i in range(len(payload)):
                            self.wfile.write(payload[i:i + 1])
                            self.wfile.flush()
                            time.sleep(0.1)
                    else:
                        self.wfile.write(payload)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/retrieve"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture(scope="module")
def faulty():
    server = FaultyRetriever()
    yield server
    server.server.shutdown()


@pytest.fixture
def fault(faulty):
    faulty.script, faulty.requests = [], 0
    return faulty


def search(client: RetrievalClient, *queries: str) -> tuple[list[str], float]:
    """The results of ``queries`` searched in one instant (one request), and the seconds it took."""
    async def main():
        try:
            return await asyncio.gather(*(client.search(q) for q in queries))
        finally:
            await client.aclose()

    start = time.monotonic()
    results = asyncio.run(main())
    return results, time.monotonic() - start


def client_for(url: str, **overrides) -> RetrievalClient:
    return RetrievalClient(RetrievalConfig(search_url=url, topk=1, retry_backoff_s=0.01, **overrides))


@pytest.mark.parametrize("behaviour", ["500", "429", "garbage", "wrong shape", "cannot search", "hang", "drip"])
def test_one_faulty_answer_is_retried_within_the_time_budget(fault, behaviour):
    fault.script = [behaviour]

    [result], seconds = search(client_for(fault.url, timeout_s=1.0), "Eiffel Tower")

    assert result == "Doc 1(Title: T) about Eiffel Tower"
    assert fault.requests == 2 and seconds < 3.0, seconds


def test_a_server_that_cannot_search_is_an_outage_retried_and_counted_and_a_bad_request_is_not_retried(fault):
    fault.script = ["cannot search"] * 3
    client = client_for(fault.url, max_retries=2)

    [result], _ = search(client, "Eiffel Tower")

    assert (result, fault.requests, client.metrics()["search/failures"]) == ("", 3, 1)  # every attempt, then failed
    fault.script, fault.requests = ["bad request"], 0
    [result], _ = search(client_for(fault.url, max_retries=2), "Eiffel Tower")
    assert (result, fault.requests) == ("", 1)  # the same request would be refused again


def test_a_dripping_server_is_cut_off_at_timeout_s_not_at_each_byte(fault):
    fault.script = ["drip"] * 3

    [result], seconds = search(client_for(fault.url, timeout_s=0.5, max_retries=2), "a")

    assert result == "" and fault.requests == 3
    assert 1.5 <= seconds < 2.5, seconds  # 3 attempts x 0.5 s; the answer would have taken 6 s each


def test_a_search_never_outlasts_its_deadline(fault):
    fault.script = ["hang"] * 10

    [result], seconds = search(client_for(fault.url, timeout_s=0.4, max_retries=10, deadline_s=1.0), "a")

    assert result == "" and seconds < 1.5, seconds


def test_an_oversized_answer_is_refused_and_not_retried(fault):
    fault.script = ["huge"]

    [result], _ = search(client_for(fault.url, max_response_bytes=1 << 20), "a")

    assert result == "" and fault.requests == 1


def test_passages_reach_the_model_as_bounded_valid_text(fault):
    fault.script = ["odd text"]

    [result], _ = search(client_for(fault.url, max_passage_chars=100), "a")

    assert result.startswith("Doc 1(Title: T) bad \ufffd yyy") and len(result) < 120
    result.encode("utf-8")  # would raise on a lone surrogate


def test_a_query_that_is_no_valid_text_costs_no_other_search(fault):
    queries = [f"good question {i}" for i in range(7)] + ["Notre Dame \ud800"]

    results, _ = search(client_for(fault.url), *queries)

    assert results[:7] == [f"Doc 1(Title: T) about good question {i}" for i in range(7)]
    assert results[7] == "Doc 1(Title: T) about Notre Dame \ufffd" and fault.requests == 1


def test_default_retries_wait_longer_than_a_retriever_restart_and_end_before_the_rollout_step():
    from searchr1_trl.engine.rollout import RolloutConfig

    config = RetrievalConfig()
    waits = [min(config.retry_backoff_s * 2 ** i, config.max_backoff_s) for i in range(config.max_retries)]

    assert sum(waits) >= 30
    assert config.deadline_s < RolloutConfig().step_timeout_s


@pytest.mark.slow  # starts or uses the real retrieval server
def test_searches_survive_a_retriever_killed_mid_batch_and_restarted(retriever_server, tmp_path, reliability_figures):
    """SIGKILL while a batch of 64 long queries is being searched, restart on the same port; with the default
    retries every search of the batch, and of one sent during the outage, still gets its passages."""
    port = free_port()
    server = RetrieverProcess(index_path=retriever_server.index_path, corpus_path=retriever_server.corpus_path,
                              retriever_model=retriever_server.retriever_model, port=port,
                              log_file=str(tmp_path / "server.log")).__enter__()
    client = RetrievalClient(RetrievalConfig(search_url=f"http://127.0.0.1:{port}/retrieve", topk=2))
    restarted = {}

    async def main():
        batch = [client.search(f"question {i} about the Super Bowl " * 20) for i in range(64)]
        searches = asyncio.ensure_future(asyncio.gather(*batch))
        await asyncio.sleep(0.5)  # the batch is on the server
        os.kill(server.process.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        during = asyncio.ensure_future(client.search("Who won Super Bowl 50?"))
        await asyncio.to_thread(server.process.wait)
        await asyncio.to_thread(server.__enter__)  # same port, healthy again
        restarted["outage_s"] = time.monotonic() - killed_at
        results = await searches + [await during]
        await client.aclose()
        return results

    try:
        results = asyncio.run(main())
        metrics = client.metrics()
    finally:
        server.__exit__()

    reliability_figures["client_outage"] = {"outage_s": round(restarted["outage_s"], 1),
                                            "searches": len(results), "empty": results.count(""),
                                            "requests": metrics["search/requests"]}
    assert restarted["outage_s"] >= 3  # a real restart: loading the encoder and index again
    assert "" not in results and all(r.startswith("Doc 1(Title: ") for r in results)
    assert metrics["search/failures"] == 0 and metrics["search/requests"] > 2


def test_rollouts_through_an_outage_longer_than_the_retry_budget_end_error_tool_unrewarded(tokenizer,
                                                                                           reliability_figures):
    from test_evaluation import QUESTION, ScriptedGenerator

    from searchr1_trl.engine.generation import SamplingParams
    from searchr1_trl.engine.rollout import RolloutConfig, RolloutEngine
    from searchr1_trl.tasks.common.rubric import Rubric
    from searchr1_trl.tasks.common.search import SearchR1EnvConfig
    from searchr1_trl.tasks.search_r1.env import SearchR1EnvFactory

    refused = f"http://127.0.0.1:{free_port()}/retrieve"  # nothing listens: every attempt is refused
    env = SearchR1EnvFactory(SearchR1EnvConfig(search_url=refused, max_retries=3, retry_backoff_s=0.01))
    engine = RolloutEngine(tokenizer, ScriptedGenerator(tokenizer), env, RolloutConfig(max_turns=3))

    async def main():
        try:
            return await engine.run([QUESTION] * 8, SamplingParams.greedy(max_tokens=64))
        finally:
            await env.aclose()

    rollouts = asyncio.run(main())

    statuses = [r.status.value for r in rollouts]
    rewards = [Rubric().score(r) for r in rollouts]
    counts = env.metrics()
    reliability_figures["outage_rollouts"] = {"rollouts": len(rollouts), "done": statuses.count("done"),
                                              "error_tool": statuses.count("error_tool"),
                                              "rewarded": sum(r is not None for r in rewards)}
    assert statuses == ["error_tool"] * 8 and rewards == [None] * 8
    assert (counts["search/failures"], counts["search/failed_steps"]) == (8, 8)
