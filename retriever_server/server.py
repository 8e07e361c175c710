"""The retrieval server: Search-R1's HTTP API over a faiss index, with cross-request batching and input limits.

    POST /retrieve  {"queries": [str, ...], "topk": 3, "return_scores": false}
        -> {"result": [[{"id": ..., "contents": "<title>\\n<text>"}, ...] per query]}
        with return_scores: {"result": [[{"document": {...}, "score": float}, ...] per query]}
    GET /health     200 once the index, corpus and encoder are loaded, checked against each other and a probe query
                    has been answered; 503 while searches fail (no file paths: it is unauthenticated)
    GET /metrics    Prometheus text: requests, queries, batches, batch sizes, latency percentiles, rejections

It is a drop-in replacement for Search-R1's ``retrieval_server.py`` (same flags, same JSON), made safe to share
between thousands of model-written queries:

- every rejection is a 4xx whose ``detail`` starts with the field it is about (``queries[3]: ...``), including bodies
  nested too deep for the JSON parser and integers too long to convert; nothing reaches a bare 500, an unexpected
  error is a 500 naming its type, and every one of them is counted in ``/metrics`` with the connection kept open;
- a query that cannot be searched fails its own request only (422), never the batch it shares (batching.py);
- work per request is capped (``max_request_cost`` documents, i.e. queries x topk) and a big request is served in
  slices with the small ones in between, so one valid request cannot stall the others; requests larger than one
  batch are admitted by cost (``max_bulk_chars``; another gets 429 with ``Retry-After``), so nine of them cannot
  either; a request whose client disconnects stops being searched;
- a request's headers are bounded in bytes (``max_header_bytes``, 431) and in time (``header_timeout_s``, 408), and
  its answer in passage bytes (``max_response_bytes``, 413, refused before the passages are read);
- no interactive docs or OpenAPI schema are served;
- it does not start with parts that cannot answer: an encoder or corpus other than the index was built with
  (the index's sidecar, ``retriever.py``), or a probe query that fails, is one line on stderr and exit status 1,
  before the port is bound.

    python -m retriever_server.server --index_path e5_flat.faiss --corpus_path wiki-18.jsonl \\
        --retriever_name e5 --retriever_model intfloat/e5-base-v2 --topk 3
"""

from __future__ import annotations

import os

if __name__ == "__main__":
    # torch and faiss each bring an OpenMP runtime whose threads spin after every parallel region (a few ms, per
    # thread) before they sleep. Between the requests of a single client that kept ~8 of 16 cores busy for nothing on
    # an H200 host, and on a machine shared with vLLM and the trainer it takes their cores; PASSIVE threads sleep at
    # once (server CPU /5 and p50 -20% there; on 2 cores one single-query client waits 2x longer, a
    # 64-query request 3%). Read when the runtimes load, so before the imports below; a value already set wins.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import asyncio
import contextlib
import json
import logging
import sys
import time
from collections.abc import Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import msgspec
import uvicorn
from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from transformers import HfArgumentParser

from retriever_server.batching import BadQuery, Busy, MicroBatcher, QueueFull
from retriever_server.batching_config import BatcherConfig
from retriever_server.encoder import EncoderConfig
from retriever_server.http_limits import bounded_protocol
from retriever_server.index import SearchConfig
from retriever_server.metrics import Metrics
from retriever_server.retriever import Hits, Retriever, passage_bytes, set_cpu_threads

PROBE_QUERY = "Who won Super Bowl 50?"
BUSY_RETRY_AFTER_S = 1
HEALTH_PROBE_TIMEOUT_S = 10.0

logger = logging.getLogger(__name__)


@dataclass
class ServerConfig:
    index_path: str = field(metadata={"help": "faiss index written by retriever_server.build_index."})
    corpus_path: str = field(metadata={"help": "The corpus the index was built from (JSONL or Parquet)."})
    topk: int = field(default=3, metadata={"help": "Documents per query when a request gives no topk."})
    max_topk: int = field(default=100, metadata={"help": "Largest topk a request may ask for."})
    max_queries_per_request: int = field(default=1024, metadata={"help": "Most queries in one request."})
    max_request_cost: int = field(
        default=4096,
        metadata={"help": "Most documents one request may ask for (queries x topk), e.g. 1,024 queries at topk 4 or "
                          "40 at topk 100. 1,024 queries at topk 100 took 130-160 s on 2 cores and returned 100 MB."},
    )
    max_body_bytes: int = field(default=1 << 20, metadata={"help": "Largest request body, checked before parsing."})
    max_response_bytes: int = field(
        default=64 << 20,
        metadata={"help": "Most passage bytes one response may carry (the client's own max_response_bytes): a "
                          "request whose hits hold more is refused with 413 before they are read. With one 1 MB "
                          "passage in the corpus, a 27 KB request got a 270 MB response."},
    )
    max_header_bytes: int = field(default=32 << 10, metadata={"help": "Most bytes of one request's headers (431)."})
    header_timeout_s: float = field(
        default=10.0, metadata={"help": "Seconds a connection may take to send a request's headers (408)."})
    host: str = field(default="127.0.0.1", metadata={"help": "Interface to bind (0.0.0.0 to serve other hosts)."})
    port: int = field(default=8000, metadata={"help": "Port to listen on."})
    cpu_threads: int | None = field(default=None, metadata={"help": "torch/faiss CPU threads (default: all cores)."})

    def __post_init__(self) -> None:
        if not 1 <= self.topk <= self.max_topk:
            raise ValueError(f"topk must be in [1, max_topk={self.max_topk}], got {self.topk}")
        if self.max_request_cost < self.topk:
            raise ValueError(f"max_request_cost must allow one query at the default topk {self.topk}, "
                             f"got {self.max_request_cost}")


@dataclass
class RetrieveRequest:
    queries: list[str]
    topk: int
    return_scores: bool


def _bad(field_name: str, message: str, status: int = 422) -> HTTPException:
    return HTTPException(status_code=status, detail=f"{field_name}: {message}")


def _shown(value, limit: int = 80) -> str:
    """``repr(value)`` cut to ``limit`` characters, for error messages that may echo a 1 MB string."""
    if not isinstance(value, (str, int, float, bool, type(None))):
        return f"a JSON {'array' if isinstance(value, list) else 'object'}"  # repr of deep nesting would recurse
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def _text_problem(query: str) -> str | None:
    """Why ``query`` is no searchable text, or None. A lone UTF-16 surrogate (JSON ``"\\ud800"``) is valid JSON but
    no Unicode text: the tokenizer raises on it."""
    try:
        query.encode("utf-8")
    except UnicodeEncodeError as error:
        return f"contains a lone UTF-16 surrogate {query[error.start]!r} at position {error.start}; expected text"
    return None if query.strip() else f"expected a non-empty string, got {_shown(query)}"


def parse_request(body: bytes, config: ServerConfig, max_queries: int) -> RetrieveRequest:
    """Validate a /retrieve body; every rejection names the offending field, what it got and what was expected."""
    try:
        payload = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise _bad("body", f"invalid JSON ({exc})", status=400) from None
    except RecursionError:
        raise _bad("body", "JSON nested too deeply to parse", status=400) from None
    except ValueError as exc:  # an integer literal longer than Python converts (4,300 digits)
        raise _bad("body", f"unreadable JSON value ({exc})", status=400) from None
    if not isinstance(payload, dict):
        raise _bad("body", f"expected a JSON object, got {type(payload).__name__}")
    queries = payload.get("queries")
    if not isinstance(queries, list):
        raise _bad("queries", f"expected a list of strings, got {type(queries).__name__}")
    if not 1 <= len(queries) <= max_queries:
        raise _bad("queries", f"expected 1 to {max_queries} queries per request, got {len(queries)}")
    for i, query in enumerate(queries):
        problem = _text_problem(query) if isinstance(query, str) else f"expected a string, got {_shown(query)}"
        if problem:
            raise _bad(f"queries[{i}]", problem)
    topk = payload.get("topk")
    if topk is None:
        topk = config.topk
    # bool is an int subclass in Python, but `true` is not a count.
    elif isinstance(topk, bool) or not isinstance(topk, int) or not 1 <= topk <= config.max_topk:
        raise _bad("topk", f"expected an integer in [1, {config.max_topk}], got {_shown(topk)}")
    if len(queries) * topk > config.max_request_cost:
        raise _bad("queries x topk", f"{len(queries)} x {topk} = {len(queries) * topk} documents exceeds "
                                     f"max_request_cost={config.max_request_cost}; split the request")
    return_scores = payload.get("return_scores", False)
    if not isinstance(return_scores, bool):
        raise _bad("return_scores", f"expected true or false, got {_shown(return_scores)}")
    return RetrieveRequest(queries, topk, return_scores)


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused with 413 as soon as it is known to exceed ``limit`` bytes, so it is never held whole."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _bad("body", f"{_shown(declared)} bytes exceeds max_body_bytes={limit}", status=413)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _bad("body", f"more than max_body_bytes={limit} bytes", status=413)
        chunks.append(chunk)
    return b"".join(chunks)


async def _client_left(request: Request) -> None:
    """Returns when the client disconnects (the body is read, so the next ASGI message can only be that)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def format_result(hits: list[Hits], return_scores: bool) -> list[list[dict]]:
    if not return_scores:
        return [list(h.documents) for h in hits]
    return [[{"document": d, "score": s} for d, s in zip(h.documents, h.scores, strict=True)] for h in hits]


def json_response(content: dict) -> Response:
    """``content`` as a JSON response, rendered by msgspec: 0.22 ms for a 64-query result against 0.95 ms with the
    json module (JSONResponse; experiments/retriever_profile.py), time the event loop holds the GIL the search threads
    need."""
    return Response(msgspec.json.encode(content), media_type="application/json")


def create_app(retriever: Retriever, config: ServerConfig, batcher_config: BatcherConfig) -> FastAPI:
    metrics = Metrics()
    batcher = MicroBatcher(retriever.search, batcher_config, metrics, retriever.encoder.device.type)
    # A request must fit the queue on its own, or it could never be served.
    max_queries = min(config.max_queries_per_request, batcher_config.max_queued_queries)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        await batcher.start()
        yield
        await batcher.stop()

    # No /docs, /redoc or /openapi.json: the server is unauthenticated and nothing needs them.
    app = FastAPI(title="searchr1-trl retriever", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    def error(status: int, detail: str, headers: dict | None = None) -> JSONResponse:
        metrics.record_rejection(status)
        return JSONResponse({"detail": detail}, status_code=status, headers=headers)

    @app.exception_handler(StarletteHTTPException)  # ours, and Starlette's 404/405
    async def count_rejection(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error(exc.status_code, exc.detail, exc.headers)

    async def busy(exc: Busy) -> HTTPException:
        """The 429 of a request refused for bulk room, sent after its Retry-After: a client that ignores it and
        resends at once still sends one a second per connection (nine resending 1 MB requests at once took 37% of
        the good clients' throughput with their 10,000 refusals, all on 2 cores)."""
        await asyncio.sleep(BUSY_RETRY_AFTER_S)
        return HTTPException(status_code=429, detail=f"queries: {exc}",
                             headers={"Retry-After": str(BUSY_RETRY_AFTER_S)})

    async def answer(request: Request) -> Response:
        start = time.monotonic()
        declared = request.headers.get("content-length", "")
        try:
            if declared.isdigit() and int(declared) > batcher.config.max_batch_chars:
                batcher.check_room(int(declared))
        except Busy as exc:
            raise await busy(exc) from None
        parsed = parse_request(await read_body(request, config.max_body_bytes), config, max_queries)
        search = asyncio.ensure_future(batcher.submit(parsed.queries, parsed.topk))
        left = asyncio.ensure_future(_client_left(request))
        try:
            await asyncio.wait({search, left}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            left.cancel()
        if not search.done():
            search.cancel()  # the batcher drops the queries not yet searched
            metrics.disconnects += 1
            return Response(status_code=499)  # nobody reads it; nginx's code for "client closed request"
        try:
            hits = search.result()
        except QueueFull as exc:
            raise HTTPException(status_code=503, detail=f"queue: {exc}") from None
        except Busy as exc:
            raise await busy(exc) from None
        except BadQuery as exc:
            raise HTTPException(status_code=422, detail=str(exc)) from None
        size = sum(passage_bytes(h.documents) for h in hits)
        if size > config.max_response_bytes:
            found = sum(len(h.documents) for h in hits)
            raise HTTPException(status_code=413, detail=f"response: the {found} passages found hold {size:,} bytes, "
                                                        f"more than max_response_bytes={config.max_response_bytes:,}; "
                                                        "ask for fewer queries or a smaller topk")
        response = json_response({"result": format_result(hits, parsed.return_scores)})
        metrics.record_request(len(parsed.queries), time.monotonic() - start)
        return response

    @app.post("/retrieve")
    async def retrieve(request: Request) -> Response:
        try:
            return await answer(request)
        except HTTPException:
            raise
        except Exception as exc:
            logger.exception("unexpected error answering /retrieve")
            return error(500, f"internal: {type(exc).__name__}: {str(exc)[:200]}")

    @app.get("/health")
    async def health() -> Response:
        """ok, or 503 while searches fail: after a failed search, ok only once a probe query is answered."""
        if batcher.last_failure is not None:
            with contextlib.suppress(Exception):  # the probe's failure is what last_failure now says
                await asyncio.wait_for(batcher.submit([PROBE_QUERY], 1), HEALTH_PROBE_TIMEOUT_S)
        if batcher.last_failure is not None:
            return JSONResponse({"status": "failing", "detail": f"searches fail: {batcher.last_failure}"},
                                status_code=503)
        return json_response({
            "status": "ok",
            "passages": len(retriever.corpus),
            "index": type(retriever.index).__name__,
            "batching": batcher_config.batching,
        })

    @app.get("/metrics")
    async def get_metrics() -> PlainTextResponse:
        return PlainTextResponse(metrics.prometheus(), media_type="text/plain; version=0.0.4")

    return app


def probe(retriever: Retriever) -> None:
    """ValueError unless one query is searched end to end (tokenizer, encoder, index, corpus) with one hit: a
    server that cannot answer must not report itself healthy."""
    try:
        [hits] = retriever.search([PROBE_QUERY], [1])
    except Exception as error:  # noqa: BLE001 - whatever it is, the server cannot answer queries
        raise ValueError(f"a probe query fails, so no query could be answered: {type(error).__name__}: "
                         f"{str(error)[:300]}") from None
    if len(hits.documents) != 1:
        raise ValueError(f"a probe query found {len(hits.documents)} passages, expected 1: is the index empty?")


def main(argv: list[str] | None = None, adapt: Callable[[Retriever], Retriever] | None = None) -> None:
    """Serve until stopped. ``adapt`` replaces the loaded retriever before the probe (``experiments.padded_retriever``
    pads its index to wiki-18's size)."""
    logging.basicConfig(level=logging.INFO, format="[retriever] %(message)s")
    parser = HfArgumentParser([ServerConfig, EncoderConfig, SearchConfig, BatcherConfig], description=__doc__)
    try:
        config, encoder_config, search_config, batcher_config = parser.parse_args_into_dataclasses(args=argv)
        http = bounded_protocol(config.max_header_bytes, config.header_timeout_s)
        set_cpu_threads(config.cpu_threads)
        start = time.monotonic()
        retriever = Retriever.from_paths(config.index_path, config.corpus_path, encoder_config, search_config)
        if adapt is not None:
            retriever = adapt(retriever)
        probe(retriever)
    except (ValueError, OSError) as error:  # bad flags, mismatched parts, missing files: what to change, in a line
        sys.exit("error: " + " ".join(str(error).split()))
    logger.info("loaded %d passages in %.1fs; serving on http://%s:%d", len(retriever.corpus),
                time.monotonic() - start, config.host, config.port)
    app = create_app(retriever, config, batcher_config)
    uvicorn.run(app, host=config.host, port=config.port, log_level="warning", access_log=False,
                http=http)


if __name__ == "__main__":
    main()
