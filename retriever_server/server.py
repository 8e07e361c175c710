"""The retrieval server: Search-R1's HTTP API over a faiss index, with cross-request batching and input limits.

    POST /retrieve  {"queries": [str, ...], "topk": 3, "return_scores": false}
        -> {"result": [[{"id": ..., "contents": "<title>\\n<text>"}, ...] per query]}
        with return_scores: {"result": [[{"document": {...}, "score": float}, ...] per query]}
    GET /health     200 once the index, corpus and encoder are loaded
    GET /metrics    requests, queries, batches formed, batch sizes, latency percentiles, rejections

It is a drop-in replacement for Search-R1's ``retrieval_server.py`` (same flags, same JSON), but malformed input gets
a 4xx naming the field instead of a crash, and a full queue gets a 503 instead of unbounded memory.

    python -m retriever_server.server --index_path e5_flat.faiss --corpus_path wiki-18.jsonl \\
        --retriever_name e5 --retriever_model intfloat/e5-base-v2 --topk 3
"""

from __future__ import annotations

import json
import logging
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import uvicorn
from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse
from transformers import HfArgumentParser

from retriever_server.batching import BatcherConfig, MicroBatcher, QueueFull
from retriever_server.encoder import EncoderConfig
from retriever_server.index import SearchConfig
from retriever_server.metrics import Metrics
from retriever_server.retriever import Hits, Retriever, set_cpu_threads

logger = logging.getLogger(__name__)


@dataclass
class ServerConfig:
    index_path: str = field(metadata={"help": "faiss index written by retriever_server.build_index."})
    corpus_path: str = field(metadata={"help": "The corpus the index was built from (JSONL or Parquet)."})
    topk: int = field(default=3, metadata={"help": "Documents per query when a request gives no topk."})
    max_topk: int = field(default=100, metadata={"help": "Largest topk a request may ask for."})
    max_queries_per_request: int = field(default=1024, metadata={"help": "Most queries in one request."})
    max_body_bytes: int = field(default=1 << 20, metadata={"help": "Largest request body, checked before parsing."})
    host: str = field(default="127.0.0.1", metadata={"help": "Interface to bind (0.0.0.0 to serve other hosts)."})
    port: int = field(default=8000, metadata={"help": "Port to listen on."})
    cpu_threads: int | None = field(default=None, metadata={"help": "torch/faiss CPU threads (default: all cores)."})

    def __post_init__(self) -> None:
        if not 1 <= self.topk <= self.max_topk:
            raise ValueError(f"topk must be in [1, max_topk={self.max_topk}], got {self.topk}")


@dataclass
class RetrieveRequest:
    queries: list[str]
    topk: int
    return_scores: bool


def _bad(field_name: str, message: str, status: int = 422) -> HTTPException:
    return HTTPException(status_code=status, detail=f"{field_name}: {message}")


def parse_request(body: bytes, config: ServerConfig, max_queries: int) -> RetrieveRequest:
    """Validate a /retrieve body; every rejection names the offending field, what it got and what was expected."""
    try:
        payload = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise _bad("body", f"invalid JSON ({exc})", status=400) from None
    if not isinstance(payload, dict):
        raise _bad("body", f"expected a JSON object, got {type(payload).__name__}")
    queries = payload.get("queries")
    if not isinstance(queries, list):
        raise _bad("queries", f"expected a list of strings, got {type(queries).__name__}")
    if not 1 <= len(queries) <= max_queries:
        raise _bad("queries", f"expected 1 to {max_queries} queries per request, got {len(queries)}")
    for i, query in enumerate(queries):
        if not isinstance(query, str) or not query.strip():
            raise _bad(f"queries[{i}]", f"expected a non-empty string, got {query!r}")
    topk = payload.get("topk")
    if topk is None:
        topk = config.topk
    # bool is an int subclass in Python, but `true` is not a count.
    elif isinstance(topk, bool) or not isinstance(topk, int) or not 1 <= topk <= config.max_topk:
        raise _bad("topk", f"expected an integer in [1, {config.max_topk}], got {topk!r}")
    return_scores = payload.get("return_scores", False)
    if not isinstance(return_scores, bool):
        raise _bad("return_scores", f"expected true or false, got {return_scores!r}")
    return RetrieveRequest(queries, topk, return_scores)


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused with 413 as soon as it is known to exceed ``limit`` bytes, so it is never held whole."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _bad("body", f"{declared} bytes exceeds max_body_bytes={limit}", status=413)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _bad("body", f"more than max_body_bytes={limit} bytes", status=413)
        chunks.append(chunk)
    return b"".join(chunks)


def format_result(hits: list[Hits], return_scores: bool) -> list[list[dict]]:
    if not return_scores:
        return [h.documents for h in hits]
    return [[{"document": d, "score": s} for d, s in zip(h.documents, h.scores)] for h in hits]


def create_app(retriever: Retriever, config: ServerConfig, batcher_config: BatcherConfig) -> FastAPI:
    metrics = Metrics()
    batcher = MicroBatcher(retriever.search, batcher_config, metrics)
    # A request must fit the queue on its own, or it could never be served.
    max_queries = min(config.max_queries_per_request, batcher_config.max_queued_queries)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        await batcher.start()
        yield
        await batcher.stop()

    app = FastAPI(title="searchr1-trl retriever", lifespan=lifespan)

    @app.exception_handler(HTTPException)
    async def count_rejection(_: Request, exc: HTTPException) -> JSONResponse:
        metrics.record_rejection(exc.status_code)
        return JSONResponse({"detail": exc.detail}, status_code=exc.status_code)

    @app.post("/retrieve")
    async def retrieve(request: Request) -> JSONResponse:
        start = time.monotonic()
        parsed = parse_request(await read_body(request, config.max_body_bytes), config, max_queries)
        try:
            hits = await batcher.submit(parsed.queries, parsed.topk)
        except QueueFull as exc:
            raise HTTPException(status_code=503, detail=f"queue: {exc}") from None
        content = {"result": format_result(hits, parsed.return_scores)}
        metrics.record_request(len(parsed.queries), time.monotonic() - start)
        return JSONResponse(content)

    @app.get("/health")
    async def health() -> dict:
        return {
            "status": "ok",
            "passages": len(retriever.corpus),
            "index": type(retriever.index).__name__,
            "index_path": config.index_path,
            "corpus_path": config.corpus_path,
            "retriever_model": retriever.encoder.config.retriever_model,
            "batching": batcher_config.batching,
        }

    @app.get("/metrics")
    async def get_metrics() -> dict:
        return metrics.snapshot()

    return app


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="[retriever] %(message)s")
    parser = HfArgumentParser([ServerConfig, EncoderConfig, SearchConfig, BatcherConfig], description=__doc__)
    config, encoder_config, search_config, batcher_config = parser.parse_args_into_dataclasses(args=argv)
    set_cpu_threads(config.cpu_threads)
    start = time.monotonic()
    retriever = Retriever.from_paths(config.index_path, config.corpus_path, encoder_config, search_config)
    logger.info("loaded %d passages in %.1fs; serving on http://%s:%d", len(retriever.corpus),
                time.monotonic() - start, config.host, config.port)
    app = create_app(retriever, config, batcher_config)
    uvicorn.run(app, host=config.host, port=config.port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
