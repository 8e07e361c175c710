"""Where the time of one ``/retrieve`` request goes in our server: the stages of a request of
``--queries_per_request`` queries (64: what a Search-R1-style trainer sends per turn), timed on the real code path
in this process, then the same requests end to end through a real server on loopback.

Stages (median ms over ``--repeats`` requests of different questions):
- ``parse``: body bytes -> validated request (``server.parse_request``, JSON included);
- ``tokenize``: the encoder's tokenization (``Encoder._tokenize``); ``encoder``: the model's forward; ``pooling``:
  the rest of ``encode_queries`` (pooling, normalising, the copy to numpy);
- ``search``: the index's search; ``lookup``: the corpus ``take`` of the returned rows; ``hits``: the rest of
  ``Retriever.search`` (splitting documents and scores per query);
- ``format`` and ``json``: ``server.format_result`` and rendering the JSON response body;
- ``<stage>_thread`` (tokenize, encoder, pooling, search, lookup, json): the CPU time of the thread that called
  it, which holds the GIL but in native code that releases it (the Rust tokenizer's and torch's own threads are not
  counted): what the server's other threads may wait for;
- ``http+queue``: what the end-to-end latency at the client adds to the stages (HTTP, the event loop, the
  batcher's queue and its wait for other requests, the thread hand-off, and any further batch when the request is
  over ``--max_batch_chars``; the batches per request are printed). The server's own ``/metrics`` split it: its
  request latency (body read to response built) and the search thread's time per batch, as the server ran them.

The server sets ``OMP_WAIT_POLICY=PASSIVE`` for itself; run this with the same variable to time the stages as it
runs them.

    python -m experiments.retriever_profile --max_passages 4096 --queries_per_request 64 --repeats 30
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from collections import defaultdict

import httpx
import numpy as np
import pandas as pd

from experiments.report import report
from experiments.retriever_load import Connection, add_index_arguments, prepare_index
from retriever_server.batching_config import BatcherConfig
from retriever_server.encoder import EncoderConfig
from retriever_server.index import SearchConfig
from retriever_server.launch import RetrieverProcess
from retriever_server.metrics import parse_prometheus
from retriever_server.retriever import Retriever, set_cpu_threads
from retriever_server.server import ServerConfig, create_app, format_result, json_response, parse_request
from searchr1_trl.assets.offline import require


class Timed:
    """Wraps a callable (or an object's ``__call__``) and adds each call's seconds to ``times[name]`` and the calling
    thread's CPU seconds to ``times[name + "_thread"]``; other attributes pass through, so a wrapped model still looks
    like itself to the encoder."""

    def __init__(self, target, name: str, times: dict[str, float]):
        self._target, self._name, self._times = target, name, times

    def __call__(self, *args, **kwargs):
        start, cpu = time.perf_counter(), time.thread_time()
        try:
            return self._target(*args, **kwargs)
        finally:
            self._times[self._name] += time.perf_counter() - start
            self._times[f"{self._name}_thread"] += time.thread_time() - cpu

    def __getattr__(self, attribute):
        return getattr(self._target, attribute)


def profile_in_process(retriever: Retriever, bodies: list[bytes], config: ServerConfig) -> dict[str, list[float]]:
    """Seconds per stage for each body, on the server's own functions."""
    times: dict[str, float] = defaultdict(float)
    encoder = retriever.encoder
    encoder._tokenize = Timed(encoder._tokenize, "tokenize", times)
    encoder.model = Timed(encoder.model, "encoder", times)
    encode_queries = encoder.encode_queries
    encoder.encode_queries = Timed(encode_queries, "encode_total", times)
    retriever.index = Timed(retriever.index, "index", times)  # keeps ntotal; search is wrapped below
    retriever.index.search = Timed(retriever.index._target.search, "search", times)
    retriever.corpus.take = Timed(retriever.corpus.take, "lookup", times)
    per_stage: dict[str, list[float]] = defaultdict(list)
    for body in [bodies[0], *bodies]:  # the first is a warm-up
        times.clear()
        start = time.perf_counter()
        request = parse_request(body, config, config.max_queries_per_request)
        times["parse"] = time.perf_counter() - start
        start = time.perf_counter()
        hits = retriever.search(request.queries, [request.topk] * len(request.queries))
        search_total = time.perf_counter() - start
        start = time.perf_counter()
        content = {"result": format_result(hits, request.return_scores)}
        times["format"] = time.perf_counter() - start
        Timed(json_response, "json", times)(content)
        for suffix in ("", "_thread"):
            times[f"pooling{suffix}"] = (times.pop(f"encode_total{suffix}") - times[f"tokenize{suffix}"]
                                         - times[f"encoder{suffix}"])
        times["hits"] = search_total - times["pooling"] - times["tokenize"] - times["encoder"] - times["search"] \
            - times["lookup"]
        for stage, seconds in times.items():
            per_stage[stage].append(seconds)
    return {stage: values[1:] for stage, values in per_stage.items()}


def request_bodies(questions: list[str], queries_per_request: int, topk: int, repeats: int) -> list[bytes]:
    """``repeats`` /retrieve bodies of ``queries_per_request`` consecutive questions each, cycling through
    ``questions``: 30 requests of 512 need 15,360 questions and SQuAD dev has 10,570 (without the cycle the last
    requests were empty, which the server refuses with a 422)."""
    return [json.dumps({"queries": [questions[(i * queries_per_request + j) % len(questions)]
                                    for j in range(queries_per_request)], "topk": topk}).encode()
            for i in range(repeats)]


async def end_to_end(port: int, bodies: list[bytes]) -> list[float]:
    """Seconds per request from one sequential client (after one warm-up request)."""
    latencies = []
    async with Connection(port, "/retrieve") as connection:
        for body in [bodies[0], *bodies]:
            start = time.perf_counter()
            status = await connection.post(body)
            latencies.append(time.perf_counter() - start)
            if status != 200:
                raise RuntimeError(f"/retrieve answered {status}")
    return latencies[1:]


def main(argv: list[str] | None = None) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    assets = require()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_index_arguments(parser, assets)
    parser.add_argument("--queries_per_request", type=int, default=64)
    parser.add_argument("--topk", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--cpu_threads", type=int, default=None, help="torch/faiss threads, here and in the server")
    parser.add_argument("--max_batch_chars", type=int, default=None,
                        help="the server's --max_batch_chars (a request over it is searched in several batches; "
                             "default: the server's for its encoder device)")
    parser.add_argument("--port", type=int, default=8791)
    parser.add_argument("--label", default="", help="what this run measures (written into the row)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)

    threads = [] if args.cpu_threads is None else ["--cpu_threads", str(args.cpu_threads)]
    index, corpus = prepare_index(args.corpus_path, args.retriever_model, args.max_passages, threads)
    passages = sum(1 for _ in corpus.open("rb"))
    questions = pd.read_parquet(assets.test_questions)["question"].tolist()
    n = args.queries_per_request
    bodies = request_bodies(questions, n, args.topk, args.repeats)

    set_cpu_threads(args.cpu_threads)
    retriever = Retriever.from_paths(str(index), str(corpus), EncoderConfig(args.retriever_model), SearchConfig())
    config = ServerConfig(index_path=str(index), corpus_path=str(corpus))
    create_app(retriever, config, BatcherConfig())  # as the server does, so nothing left unbuilt is timed
    stages = profile_in_process(retriever, bodies, config)
    del retriever

    with RetrieverProcess(index_path=str(index), corpus_path=str(corpus), retriever_model=args.retriever_model,
                          port=args.port, log_file=str(index.parent / "server-profile.log"),
                          extra_args=(*(() if args.max_batch_chars is None else
                                        ("--max_batch_chars", str(args.max_batch_chars))), *threads)):
        latencies = asyncio.run(end_to_end(args.port, bodies))
        served = parse_prometheus(httpx.get(f"http://127.0.0.1:{args.port}/metrics").text)
    batches_per_request = served["batches_total"] / served["requests_total"]

    medians = {stage: float(np.median(values)) * 1e3 for stage, values in stages.items()}
    order = ["parse", "tokenize", "encoder", "pooling", "search", "lookup", "hits", "format", "json"]
    in_process = sum(medians[s] for s in order)
    e2e = float(np.median(latencies)) * 1e3
    medians["http+queue"] = e2e - in_process
    print(f"{n} queries per request, topk {args.topk}, {len(bodies)} requests, {os.cpu_count()} CPUs")
    for stage in [*order, "http+queue"]:
        print(f"{stage:>11} {medians[stage]:8.2f} ms {medians[stage] / e2e:6.1%}")
    print(f"{'end to end':>11} {e2e:8.2f} ms (p50 at one sequential client; {batches_per_request:.2f} batches "
          f"per request, max_batch_chars {args.max_batch_chars or 'by device'})")
    server = {"server_request_p50_ms": served['latency_seconds_recent{quantile="0.5"}'] * 1e3,
              "server_batch_p50_ms": served['batch_seconds_recent{quantile="0.5"}'] * 1e3}
    print(f"in the server: request {server['server_request_p50_ms']:.2f} ms (body read to response built), search "
          f"thread {server['server_batch_p50_ms']:.2f} ms per batch (p50s)")
    report({"label": args.label, "queries_per_request": n, "topk": args.topk, "passages": passages,
            "cpus": os.cpu_count(), "cpu_threads": args.cpu_threads, "end_to_end_p50_ms": round(e2e, 2),
            "max_batch_chars": args.max_batch_chars, "batches_per_request": round(batches_per_request, 2),
            **{f"{stage}_ms": round(medians[stage], 2) for stage in [*order, "http+queue"]},
            **{f"{stage}_ms": round(medians[stage], 2) for stage in sorted(medians) if stage.endswith("_thread")},
            **{key: round(value, 2) for key, value in server.items()}}, args.out)


if __name__ == "__main__":
    main()
