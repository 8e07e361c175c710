"""Reliability of the retrieval server under bad, hostile and heavy requests.

Everything runs against the real server (uvicorn process, MiniLM encoder, exact faiss) of conftest, except the first
test, which drives the real batcher with a search function that fails on one query: the real encoder fails only on
input the server now refuses before batching, so a poison query that gets through validation has to be injected.
Figures go to ``reliability_figures`` (docs/RELIABILITY.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import socket
import time

import httpx
import numpy as np
import pytest
from conftest import reliability_size
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from retriever_server.batching import BadQuery, Busy, MicroBatcher
from retriever_server.batching_config import BatcherConfig
from retriever_server.metrics import Metrics, parse_prometheus
from retriever_server.retriever import Hits

POISON = '{"queries": ["Notre Dame \\ud800"], "topk": 3}'  # valid JSON, but a lone surrogate is no text


@pytest.fixture(scope="module")
def base_url(retriever_url) -> str:
    return retriever_url.rsplit("/", 1)[0]


def metrics(base: str) -> dict[str, float]:
    return parse_prometheus(httpx.get(f"{base}/metrics").text)


def test_a_query_that_fails_its_batch_fails_only_its_own_request():
    def search(queries: list[str], topks: list[int]) -> list[Hits]:
        if "poison" in queries:
            raise RuntimeError("cannot encode")
        return [Hits([{"id": q, "contents": q}], [1.0]) for q in queries]

    async def main():
        batcher = MicroBatcher(search, BatcherConfig(max_wait_ms=20), Metrics())
        await batcher.start()
        requests = [["a", "b"], ["c", "poison", "d"], ["e"]]
        results = await asyncio.gather(*(batcher.submit(q, 1) for q in requests), return_exceptions=True)
        await batcher.stop()
        return results, batcher.metrics

    (first, bad, last), counted = asyncio.run(main())

    assert [h.documents[0]["id"] for h in first] == ["a", "b"] and last[0].documents[0]["id"] == "e"
    assert isinstance(bad, BadQuery) and str(bad).startswith("queries[1]: cannot be searched (RuntimeError")
    assert (counted.batch_errors, counted.bad_queries) == (1, 1)


def slow_search(order: list[list[str]]):
    """A search that records each batch's queries in ``order`` and takes 50 ms."""
    def search(queries, topks):
        order.append(list(queries))
        time.sleep(0.05)
        return [Hits([], []) for _ in queries]

    return search


def test_a_big_request_is_served_in_slices_with_newcomers_first():
    order: list[list[str]] = []

    async def main():
        batcher = MicroBatcher(slow_search(order), BatcherConfig(max_batch_size=4, max_wait_ms=0), Metrics())
        await batcher.start()
        big = asyncio.ensure_future(batcher.submit([f"big{i}" for i in range(12)], 1))
        await asyncio.sleep(0.02)  # the first slice of the big request is running
        small = await batcher.submit(["small"], 1)
        await big
        await batcher.stop()
        return small

    asyncio.run(main())

    assert all(len(batch) <= 4 for batch in order)
    assert "small" in order[1], order  # right after the slice that was running when it arrived


def batches_formed(max_batch_size: int, first: list[list[str]], newcomers: list[list[str]]) -> list[list[str]]:
    """The batches a batcher forms from requests ``first``, sent together, and ``newcomers``, sent while the first
    batch runs (each search takes 50 ms)."""
    order: list[list[str]] = []

    async def main():
        batcher = MicroBatcher(slow_search(order), BatcherConfig(max_batch_size=max_batch_size, max_wait_ms=20),
                               Metrics())
        await batcher.start()
        sent = [asyncio.ensure_future(batcher.submit(q, 1)) for q in first]
        await asyncio.sleep(0.04)
        sent += [asyncio.ensure_future(batcher.submit(q, 1)) for q in newcomers]
        await asyncio.gather(*sent)
        await batcher.stop()

    asyncio.run(main())
    return order


def test_a_request_that_fits_one_batch_is_never_cut_in_two():
    order = batches_formed(4, [["a1", "a2", "a3"], ["b1", "b2", "b3"]], [["c1", "c2"]])

    assert order == [["a1", "a2", "a3"], ["b1", "b2", "b3"], ["c1", "c2"]]


def test_the_rest_of_a_request_cut_by_the_batch_size_comes_before_newcomers():
    order = batches_formed(4, [[f"a{i}" for i in range(6)]], [["c1"], ["d1"]])

    assert order == [["a0", "a1", "a2", "a3"], ["a4", "a5", "c1", "d1"]]


def test_a_request_larger_than_one_batch_is_refused_while_others_hold_the_bulk_room_and_admitted_after():
    order: list[list[str]] = []

    async def main():
        batcher = MicroBatcher(slow_search(order), BatcherConfig(max_batch_size=4, max_wait_ms=0,
                                                                 max_bulk_chars=20), Metrics())
        await batcher.start()
        first = asyncio.ensure_future(batcher.submit([f"a{i}" for i in range(8)], 1))  # 16 characters, 2 batches
        small = asyncio.ensure_future(batcher.submit(["s"], 1))  # fits a batch: never refused for bulk room
        await asyncio.sleep(0)
        with pytest.raises(Busy, match="16 query characters of requests larger than one batch are being served; "
                                       "10 more would exceed max_bulk_chars=20"):
            await batcher.submit([f"b{i}" for i in range(5)], 1)
        await asyncio.gather(first, small)
        again = await batcher.submit([f"b{i}" for i in range(5)], 1)
        await batcher.stop()
        return again

    assert len(asyncio.run(main())) == 5


def test_bulk_work_gets_its_share_of_the_search_time_while_small_clients_keep_asking():
    order: list[list[str]] = []

    async def main():
        batcher = MicroBatcher(slow_search(order), BatcherConfig(max_batch_size=2, max_wait_ms=0,
                                                                 max_bulk_share=0.25), Metrics())
        await batcher.start()
        bulk = asyncio.ensure_future(batcher.submit([f"bulk{i}" for i in range(400)], 1))

        async def small_client(name: str) -> None:
            for i in range(12):
                await batcher.submit([f"{name}.{i}"], 1)

        await asyncio.gather(*(small_client(f"s{c}") for c in range(2)))
        bulk.cancel()
        await batcher.stop()

    asyncio.run(main())

    bulk = [any(q.startswith("bulk") for q in batch) for batch in order]
    while_small = bulk[:max(i for i, b in enumerate(bulk) if not b) + 1]  # until the last small batch
    assert 0.1 <= sum(while_small) / len(while_small) <= 0.3, order  # about a quarter, and never starved


def test_health_is_503_while_every_search_fails_and_ok_again_once_one_is_answered():
    from types import SimpleNamespace

    from starlette.testclient import TestClient

    from retriever_server.server import ServerConfig, create_app

    broken = [True]

    def search(queries, topks):  # a fault on purpose: a device that stops answering, then comes back
        if broken[0]:
            raise RuntimeError("CUDA error: device-side assert triggered")
        return [Hits([{"id": "0", "contents": "Super Bowl 50\nDenver won."}], [1.0]) for _ in queries]

    retriever = SimpleNamespace(search=search, corpus=[None], index=None,
                                encoder=SimpleNamespace(device=SimpleNamespace(type="cpu")))
    app = create_app(retriever, ServerConfig(index_path="i", corpus_path="c"), BatcherConfig())
    with TestClient(app) as client:
        assert client.get("/health").status_code == 200  # nothing has failed yet
        assert client.post("/retrieve", json={"queries": ["Super Bowl 50"]}).status_code == 422
        failing = client.get("/health")
        broken[0] = False
        healed = client.get("/health")

    assert failing.status_code == 503 and failing.json() == {
        "status": "failing", "detail": "searches fail: RuntimeError: CUDA error: device-side assert triggered"}
    assert healed.status_code == 200 and healed.json()["status"] == "ok"


def test_with_two_search_threads_two_batches_run_at_once_and_every_request_gets_its_own_hits():
    running, overlap = [0], [0]

    def search(queries, topks):
        running[0] += 1
        overlap[0] = max(overlap[0], running[0])
        time.sleep(0.05)
        running[0] -= 1
        return [Hits([{"id": q, "contents": q}], [1.0]) for q in queries]

    async def main():
        batcher = MicroBatcher(search, BatcherConfig(max_batch_size=2, max_wait_ms=0, search_threads=2), Metrics())
        await batcher.start()
        requests = [[f"r{i}a", f"r{i}b"] for i in range(6)]
        results = await asyncio.gather(*(batcher.submit(q, 1) for q in requests))
        await batcher.stop()
        return requests, results

    requests, results = asyncio.run(main())

    assert overlap[0] == 2
    assert [[h.documents[0]["id"] for h in hits] for hits in results] == requests


def test_batch_limits_left_unset_follow_the_encoder_device_and_set_ones_are_kept():
    # A GPU encoder takes a 64-question request (about 4,000 characters) whole, so with 8 such clients no request
    # is sliced and left waiting behind newcomers (p99 6.4 s on an H200 at the CPU limits).
    assert (BatcherConfig().for_device("cpu").max_batch_size, BatcherConfig().for_device("cpu").max_batch_chars) == (
        256, 4096)
    assert (BatcherConfig().for_device("cuda").max_batch_size, BatcherConfig().for_device("cuda").max_batch_chars) == (
        512, 65536)
    assert BatcherConfig(max_batch_chars=100).for_device("cuda").max_batch_chars == 100
    with pytest.raises(ValueError, match="must be positive"):
        BatcherConfig(max_batch_size=0)


@pytest.mark.slow  # starts or uses the real retrieval server
def test_a_lone_surrogate_query_gets_422_naming_it_and_its_batchmates_are_answered(retriever_url, base_url):
    good = json.dumps({"queries": ["Who won Super Bowl 50?"], "topk": 3})
    bodies = [POISON if i % 5 == 0 else good for i in range(40)]
    before = metrics(base_url)

    async def burst():
        async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=40)) as client:
            return await asyncio.gather(*(client.post(retriever_url, content=b) for b in bodies))

    responses = asyncio.run(burst())

    after = metrics(base_url)
    codes = [r.status_code for r, b in zip(responses, bodies, strict=True) if b == good]
    poisoned = [r for r, b in zip(responses, bodies, strict=True) if b == POISON]
    assert codes == [200] * 32
    assert {r.status_code for r in poisoned} == {422}
    assert poisoned[0].json()["detail"].startswith("queries[0]: contains a lone UTF-16 surrogate")
    assert after['rejected_total{status="422"}'] - before.get('rejected_total{status="422"}', 0) == 8


@pytest.mark.slow  # starts or uses the real retrieval server
@pytest.mark.parametrize(("body", "detail"), [
    (b"[" * 100_000 + b"]" * 100_000, "body: JSON nested too deeply"),
    (b'{"queries": ["q"], "topk": 1' + b"0" * 5000 + b"}", "body: unreadable JSON value"),
    (b'{"queries": [' + b"[" * 500 + b"]" * 500 + b"]}", "queries[0]: expected a string, got a JSON array"),
    (json.dumps({"queries": ["q"] * 1024, "topk": 100}).encode(), "queries x topk: 1024 x 100 = 102400 documents"),
])
def test_hostile_bodies_get_a_4xx_naming_the_problem_counted_and_the_connection_kept(retriever_url, base_url, body,
                                                                                     detail):
    before = metrics(base_url)
    with socket.create_connection(("127.0.0.1", httpx.URL(retriever_url).port), timeout=60) as sock:
        stream = sock.makefile("rb")
        statuses = []
        for payload in [body] + [json.dumps({"queries": [f"Super Bowl {i}"]}).encode() for i in range(20)]:
            sock.sendall(b"POST /retrieve HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         + f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
            status = int(stream.readline().split()[1])
            headers = list(iter(stream.readline, b"\r\n"))
            length = next(int(line.split(b":")[1]) for line in headers if line.lower().startswith(b"content-length"))
            answer = stream.read(length)
            statuses.append(status)
            if len(statuses) == 1:
                first_detail = json.loads(answer)["detail"]

    assert 400 <= statuses[0] < 500 and first_detail.startswith(detail)
    assert statuses[1:] == [200] * 20  # same connection: it was kept open
    after = metrics(base_url)
    assert after[f'rejected_total{{status="{statuses[0]}"}}'] == before.get(
        f'rejected_total{{status="{statuses[0]}"}}', 0) + 1


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=30),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
bodies = st.one_of(
    st.fixed_dictionaries({}, optional={"queries": json_values | st.lists(st.text(max_size=40), max_size=5),
                                        "topk": json_values | st.integers(-5, 120),
                                        "return_scores": json_values}).map(lambda d: json.dumps(d).encode()),
    json_values.map(lambda v: json.dumps(v).encode()),
    st.binary(max_size=200),
    st.builds(lambda depth, digits: b'{"queries": ["q"], "topk": ' + b"[" * depth + b"1" * digits + b"]" * depth
              + b"}", st.integers(0, 3000), st.integers(1, 6000)),
    st.text(max_size=60).map(lambda q: ('{"queries": ["' + q.replace("\\", "").replace('"', "") + '"]}'
                                        + "\\ud83d").encode("utf-8", "surrogatepass")),
)


FUZZED_BODIES = reliability_size(suite=500, full=2_000)  # the figure in docs/RELIABILITY.md is the full size's


@pytest.mark.slow  # starts or uses the real retrieval server
def test_fuzzed_bodies_get_no_5xx_and_every_4xx_names_its_field(retriever_url, base_url, reliability_figures):
    statuses: list[int] = []
    unnamed: list[str] = []
    client = httpx.Client(timeout=60)

    @settings(max_examples=FUZZED_BODIES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(bodies)
    def post(body: bytes):
        response = client.post(retriever_url, content=body, headers={"content-type": "application/json"})
        statuses.append(response.status_code)
        if response.status_code >= 400:
            detail = response.json()["detail"]
            if detail.split(":", 1)[0] not in ("body", "queries", "topk", "return_scores", "queries x topk") and \
                    not detail.startswith("queries["):
                unnamed.append(detail)

    before = metrics(base_url)
    post()
    client.close()

    after = metrics(base_url)
    fivexx = sum(s >= 500 for s in statuses)
    rejected = sum(after.get(k, 0) - before.get(k, 0) for k in after if k.startswith("rejected_total"))
    reliability_figures["server_fuzz"] = {"bodies": len(statuses), "ok": statuses.count(200), "5xx": fivexx,
                                          "4xx": sum(400 <= s < 500 for s in statuses)}
    assert len(statuses) >= FUZZED_BODIES
    assert fivexx == 0 and unnamed == []
    assert rejected == sum(s >= 400 for s in statuses)  # every rejection counted


@pytest.mark.slow  # starts or uses the real retrieval server
def test_a_request_whose_client_leaves_is_cancelled(retriever_url, base_url):
    heavy = {"queries": [f"{i} " + "long query about the history of the Amazon rainforest " * 18 for i in range(1024)],
             "topk": 4}
    before = metrics(base_url)

    with pytest.raises(httpx.ReadTimeout):
        httpx.post(retriever_url, json=heavy, timeout=httpx.Timeout(60, read=1.0))
    time.sleep(0.5)
    start = time.monotonic()
    answered = httpx.post(retriever_url, json={"queries": ["Who won Super Bowl 50?"]}, timeout=60)
    waited = time.monotonic() - start

    after = metrics(base_url)
    assert answered.status_code == 200 and waited < 5, waited
    assert after["disconnects_total"] == before["disconnects_total"] + 1
    assert after["dropped_queries_total"] - before["dropped_queries_total"] > 512


@pytest.mark.slow  # starts or uses the real retrieval server
def test_no_api_docs_are_served_and_health_shows_no_paths(base_url):
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert httpx.get(f"{base_url}{path}").status_code == 404
    health = httpx.get(f"{base_url}/health").json()
    assert health["status"] == "ok"
    assert not any("path" in key or "model" in key for key in health)
    assert "/" not in json.dumps(health)


@pytest.mark.slow  # starts or uses the real retrieval server
def test_metrics_are_prometheus_text(base_url):
    response = httpx.get(f"{base_url}/metrics")

    assert response.headers["content-type"].startswith("text/plain")
    assert "# TYPE retriever_requests_total counter" in response.text
    samples = parse_prometheus(response.text)
    assert samples["requests_total"] >= 0 and "latency_seconds_recent_count" in samples


def _percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("inf")


HEAVY = json.dumps({"queries": [f"{i} " + "long query about the history of the Amazon rainforest " * 17
                                for i in range(1024)], "topk": 4}).encode()  # 0.96 MB, 4,096 documents: allowed


async def _exchange(reader, writer, body: bytes) -> int:
    """One POST /retrieve on an open keep-alive connection; the status code."""
    writer.write(b"POST /retrieve HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length"))
    await reader.readexactly(length)
    return int(head[9:12])


async def _load(port: int, questions: list[str], seconds: float, extra: str | None) -> dict:
    """64 good clients, each posting one question after another for ``seconds`` (after 1 s unmeasured), beside
    ``extra``: "poison" (a client sending a lone-surrogate query every 50 ms), "heavy" (one client sending the largest
    allowed request again and again), "nine heavy" (nine such clients, each resending at once whatever the answer)
    or None. Good requests' latencies, throughput and failures, and the extra clients' statuses."""
    good_ms: list[float] = []
    failed: list[object] = []
    extra_statuses: list[int] = []
    loop = asyncio.get_running_loop()
    measure_from = loop.time() + 1.0
    stop_at = measure_from + seconds

    async def good(i: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            n = i
            while (sent := loop.time()) < stop_at:
                body = json.dumps({"queries": [questions[n % len(questions)]], "topk": 3}).encode()
                n += 64
                try:
                    status = await _exchange(reader, writer, body)
                except (OSError, asyncio.IncompleteReadError) as error:
                    failed.append(repr(error))
                    reader, writer = await asyncio.open_connection("127.0.0.1", port)
                    continue
                if sent >= measure_from:
                    good_ms.append((loop.time() - sent) * 1000) if status == 200 else failed.append(status)
        finally:
            writer.close()

    async def other() -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            while loop.time() < stop_at:
                if extra == "poison":
                    extra_statuses.append(await _exchange(reader, writer, POISON.encode()))
                    await asyncio.sleep(0.05)
                else:
                    extra_statuses.append(await _exchange(reader, writer, HEAVY))
        finally:
            writer.close()  # a heavy request still running is cancelled by the server

    extras = [asyncio.ensure_future(other()) for _ in range({None: 0, "nine heavy": 9}.get(extra, 1))]
    await asyncio.gather(*(good(i) for i in range(64)))
    for task in extras:
        task.cancel()
    await asyncio.gather(*extras, return_exceptions=True)
    return {"good_requests": len(good_ms) + len(failed), "good_failed": len(failed),
            "good_per_s": len(good_ms) / seconds, "p50_ms": _percentile(good_ms, 50),
            "p99_ms": _percentile(good_ms, 99), "extra_statuses": sorted(set(extra_statuses)),
            "extra_requests": len(extra_statuses), "extra_429": extra_statuses.count(429)}


LOAD_S = reliability_size(suite=2, full=5)  # each load run's measured seconds (after 1 s unmeasured)


@pytest.fixture(scope="module")
def load_runs(retriever_url, squad_dev_sample, reliability_figures) -> dict[str, dict]:
    """The good clients' figures when alone, beside poison, beside one and beside nine heavy clients, LOAD_S each."""
    questions = squad_dev_sample[1]["question"].tolist()
    port = httpx.URL(retriever_url).port
    runs = {extra or "clean": asyncio.run(_load(port, questions, LOAD_S, extra))
            for extra in (None, "poison", "heavy", "nine heavy")}
    reliability_figures["server_load"] = runs
    print(json.dumps(runs, indent=1))
    return runs


@pytest.mark.slow  # starts or uses the real retrieval server
def test_64_good_clients_are_all_answered_beside_poison_and_a_heavy_request(load_runs, base_url):
    clean, poison, heavy = load_runs["clean"], load_runs["poison"], load_runs["heavy"]
    assert clean["good_failed"] == poison["good_failed"] == heavy["good_failed"] == 0
    assert poison["extra_statuses"] == [422] and poison["extra_requests"] >= 5 * LOAD_S  # one per 50 ms + answer
    # Counts, not p99 (a tail latency of a few hundred samples flakes on a busy CI machine). A heavy request that held
    # the good clients back would leave them almost nothing answered: it outlasts the run. The CPU its chunks
    # take is a share two cores cannot avoid: 0.84-0.95x of clean on an idle machine, 0.48x once in a full suite.
    assert heavy["good_requests"] >= clean["good_requests"] / 4, (heavy["good_requests"], clean["good_requests"])
    assert metrics(base_url)["disconnects_total"] >= 1  # the heavy request left running was cancelled


@pytest.mark.slow  # starts or uses the real retrieval server
def test_beside_nine_maximal_requests_every_good_request_is_answered_and_all_but_one_heavy_client_gets_429(
        load_runs, base_url):
    nine = load_runs["nine heavy"]

    assert nine["good_failed"] == 0 and nine["good_requests"] > 0
    # One maximal request is served at a time (it takes longer than the run); the other eight are refused, each
    # answer held back one second (Retry-After), however fast they resend.
    assert nine["extra_statuses"] == [429] and 8 <= nine["extra_429"] <= 8 * (LOAD_S + 1)
    assert metrics(base_url)['rejected_total{status="429"}'] >= nine["extra_429"]


@pytest.fixture(scope="module")
def bounded_server(retriever_server, tmp_path_factory):
    """A second server on the same index with small input bounds: 4 KiB of headers, 1 s to send them, 2,000 passage
    bytes per response (about three SQuAD paragraphs)."""
    from retriever_server.launch import RetrieverProcess
    from searchr1_trl.serving.processes import free_port

    log = tmp_path_factory.mktemp("bounded") / "server.log"
    with RetrieverProcess(index_path=retriever_server.index_path, corpus_path=retriever_server.corpus_path,
                          retriever_model=retriever_server.retriever_model, port=free_port(), log_file=str(log),
                          extra_args=("--max_header_bytes", "4096", "--header_timeout_s", "1",
                                      "--max_response_bytes", "2000")) as server:
        yield server


def _raw_exchange(port: int, data: bytes, wait_s: float = 10.0) -> tuple[int | None, str, float]:
    """(status, body, seconds until the server closed) for ``data`` sent on a fresh connection; None: no answer."""
    start = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=wait_s) as sock:
        with contextlib.suppress(ConnectionResetError, BrokenPipeError):
            sock.sendall(data)
        received = b""
        with contextlib.suppress(ConnectionResetError, socket.timeout):
            while chunk := sock.recv(65536):
                received += chunk
    head, _, body = received.partition(b"\r\n\r\n")
    status = int(head.split()[1]) if head.startswith(b"HTTP/1.1 ") else None
    return status, body.decode(errors="replace"), time.monotonic() - start


@pytest.mark.parametrize("headers", [b"X-Big: " + b"a" * (1 << 20) + b"\r\n",
                                     b"".join(b"X-%d: 1\r\n" % i for i in range(5000))], ids=["one 1 MiB", "5,000"])
def test_headers_over_max_header_bytes_get_431_naming_the_limit(bounded_server, headers, reliability_figures):
    port = int(bounded_server.url.split(":")[2].split("/")[0])
    request = b"POST /retrieve HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n" + headers + b"\r\n{}"

    status, body, _ = _raw_exchange(port, request)

    assert (status, json.loads(body)) == (431, {"detail": "headers: more than max_header_bytes=4096 bytes"})
    reliability_figures.setdefault("server_input_bounds", {})[f"headers {len(headers):,} bytes"] = status
    assert httpx.post(bounded_server.url, json={"queries": ["Super Bowl"], "topk": 1}).status_code == 200


def test_a_body_still_arriving_after_an_early_answer_is_not_counted_as_headers(bounded_server):
    """A request refused before its body is read (here 413 for its declared size; 429 for bulk room) is answered
    while the body arrives: those bytes belong to no headers, and the next request on the connection is served."""
    port = int(bounded_server.url.split(":")[2].split("/")[0])
    body = b"x" * (2 << 20)
    good = b'{"queries": ["Super Bowl"], "topk": 1}'
    request = (b"POST /retrieve HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body) + body
               + b"POST /retrieve HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: %d\r\n\r\n" % len(good)
               + good)

    status, answer, _ = _raw_exchange(port, request)

    assert status == 413 and re.findall(rb"HTTP/1.1 (\d+)", answer.encode()) == [b"200"], answer[:300]


@pytest.mark.parametrize("sent", [b"", b"POST /retrieve HTTP/1.1\r\nHost: x\r\n"], ids=["nothing", "half"])
def test_a_connection_that_stalls_before_its_headers_end_gets_408_and_is_closed(bounded_server, sent,
                                                                               reliability_figures):
    port = int(bounded_server.url.split(":")[2].split("/")[0])

    status, body, seconds = _raw_exchange(port, sent)

    assert (status, json.loads(body)) == (408, {"detail": "headers: not complete within header_timeout_s=1"})
    assert 0.9 < seconds < 5, seconds
    reliability_figures.setdefault("server_input_bounds", {})[f"stalled after {len(sent)} bytes: closed after s"] = \
        round(seconds, 2)


def test_a_response_over_max_response_bytes_is_refused_with_413_before_it_is_built(bounded_server,
                                                                                  reliability_figures):
    small = httpx.post(bounded_server.url, json={"queries": ["Super Bowl 50"], "topk": 1})
    big = httpx.post(bounded_server.url, json={"queries": [f"question {i}" for i in range(10)], "topk": 3})

    assert small.status_code == 200
    assert big.status_code == 413 and re.fullmatch(
        r"response: the 30 passages found hold [\d,]+ bytes, more than max_response_bytes=2,000; ask for fewer "
        r"queries or a smaller topk", big.json()["detail"]), big.text
    reliability_figures.setdefault("server_input_bounds", {})["30 passages over 2,000 bytes"] = big.status_code
