"""The retrieval client: a tool call's query becomes passages from a Search-R1 retrieval server.

Retrieval goes through one pooled ``httpx.AsyncClient`` per :class:`RetrievalClient`. Searches issued in the same
event-loop instant (the calls of one turn, and the turns of every concurrent rollout that reaches a search together)
are sent as one request, so the retriever embeds them in one batch. A request that times out, fails to connect,
gets a 5xx/429, a 422 saying its queries cannot be searched (a server that cannot search is an outage, not "no
hits") or an unreadable body is retried up to ``max_retries`` times with exponential backoff (0.5 s doubling
up to 8 s: the defaults wait 39.5 s in all, so a retriever restart of ~10 s costs no search); a search that still
fails gives the model an empty result, is logged as a warning and is counted in :meth:`RetrievalClient.metrics`, never
raised into the rollout. Every bound is on wall time, not on socket reads: an attempt gets ``timeout_s`` from
connecting to its last byte (a server that drips one byte a second is cut off), a search gets ``deadline_s`` over
all its attempts and waits, and a response over ``max_response_bytes`` is refused unread; passages are cut at
``max_passage_chars`` and any text that is not valid Unicode (lone surrogates) is replaced, so what reaches the
chat template is always text.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections import Counter
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

import httpx

logger = logging.getLogger(__name__)


@dataclass
class RetrievalConfig:
    search_url: str = field(
        default="http://127.0.0.1:8000/retrieve", metadata={"help": "URL of the retrieval server's /retrieve route."}
    )
    topk: int = field(default=3, metadata={"help": "Passages returned per search."})
    timeout_s: float = field(
        default=60.0, metadata={"help": "Time budget of one retrieval request, connect to last byte, in seconds."}
    )
    max_retries: int = field(
        default=8, metadata={"help": "Retries of a failed retrieval request before the searches get empty results."}
    )
    retry_backoff_s: float = field(
        default=0.5,
        metadata={"help": "Wait before the first retry, doubled for every further retry up to max_backoff_s, in "
                          "seconds (defaults: 39.5 s of waits over 8 retries, longer than a retriever restart)."},
    )
    max_backoff_s: float = field(default=8.0, metadata={"help": "Longest wait between two retries, in seconds."})
    deadline_s: float = field(
        default=180.0,
        metadata={"help": "Longest one search may take, every attempt and wait included, in seconds; then it gets an "
                          "empty result. Keep it below the rollout's step_timeout_s."},
    )
    max_response_bytes: int = field(
        default=64 << 20, metadata={"help": "Largest retrieval response read; a larger one is a failed request."}
    )
    max_passage_chars: int = field(
        default=4096, metadata={"help": "Characters of one passage kept in the tool message (wiki-18's are ~600)."}
    )
    max_request_queries: int = field(
        default=1024, metadata={"help": "Most queries in one request; more concurrent searches are split (the "
                                        "retrieval server's max_queries_per_request)."}
    )
    max_request_documents: int = field(
        default=4096, metadata={"help": "Most passages one request asks for (queries x topk, more where "
                                        "exclude_seen_passages skips some); more are split (the server's "
                                        "max_request_cost)."}
    )


_SURROGATE = re.compile("[\ud800-\udfff]")


def valid_text(text: str) -> str:
    """``text`` with lone UTF-16 surrogates (JSON ``"\\ud800"``, valid JSON but no Unicode) replaced by U+FFFD, so
    it can be encoded as UTF-8 by httpx and tokenizers. ``"a\\ud800b"`` -> ``"a\\ufffdb"``."""
    return text if text.isascii() else _SURROGATE.sub("\ufffd", text)


def is_text(text: str) -> bool:
    """Whether ``text`` is valid Unicode (no lone surrogates)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def passages_text(docs: list[dict] | None, max_chars: int | None = None) -> str:
    """The passages as the model reads them, one per line, each cut at ``max_chars``; "" for None (a failed search).

    ``[{"contents": "Eiffel Tower\\nA tower in Paris."}]`` -> ``"Doc 1(Title: Eiffel Tower) A tower in Paris."``
    """
    if docs is None:
        return ""
    lines = []
    for number, doc in enumerate(docs, start=1):
        title, _, text = valid_text(doc["contents"][:max_chars]).partition("\n")
        lines.append(f"Doc {number}(Title: {title}) {text}")
    return "\n".join(lines)


class ResponseTooLarge(ValueError):
    """The retrieval server sent more than ``max_response_bytes``."""


def _passages_per_query(body: Any, num_queries: int) -> list[list[dict]]:
    """The ``result`` lists of a /retrieve response; ValueError naming what was expected if it has another shape."""
    result = body.get("result") if isinstance(body, dict) else None
    well_formed = isinstance(result, list) and len(result) == num_queries and all(
        isinstance(docs, list) and all(isinstance(doc, dict) and isinstance(doc.get("contents"), str) for doc in docs)
        for docs in result
    )
    if not well_formed:
        raise ValueError(
            f'expected {{"result": [[{{"contents": str}}, ...], ...]}} with {num_queries} lists, got {str(body)[:200]}'
        )
    return result


class CannotSearch(RuntimeError):
    """The server read the request but could not search it (a 422 ``queries[i]: cannot be searched``): the client
    only sends valid text, so the fault is the server's (a broken encoder or device), an outage to retry."""


async def _head(response: httpx.Response, limit: int) -> bytes:
    """The first ``limit`` bytes of a streamed body (an error's detail; a hostile server's cannot be held whole)."""
    head = bytearray()
    async for chunk in response.aiter_bytes():
        head += chunk
        if len(head) >= limit:
            break
    return bytes(head[:limit])


def _retryable(error: Exception) -> bool:
    """Whether sending the same request again may succeed: not when the server rejected it as a bad request."""
    if isinstance(error, httpx.HTTPStatusError):
        status = error.response.status_code
        return status >= 500 or status == 429
    return not isinstance(error, ResponseTooLarge)


class RetrievalClient:
    """Batched, retrying client of a Search-R1 retrieval server; see the module docstring."""

    def __init__(self, config: RetrievalConfig):
        url = httpx.URL(config.search_url)
        if url.scheme not in ("http", "https") or not url.host:
            raise ValueError(f"search_url must be an http(s) URL such as http://127.0.0.1:8000/retrieve, "
                             f"got {config.search_url!r}")
        if (config.topk < 1 or min(config.timeout_s, config.deadline_s) <= 0 or config.max_retries < 0
                or min(config.retry_backoff_s, config.max_backoff_s) < 0
                or min(config.max_response_bytes, config.max_passage_chars, config.max_request_queries,
                       config.max_request_documents) < 1):
            raise ValueError(f"expected topk >= 1, timeout_s, deadline_s > 0, max_retries, retry_backoff_s, "
                             f"max_backoff_s >= 0 and max_response_bytes, max_passage_chars, max_request_queries, "
                             f"max_request_documents >= 1, got "
                             f"topk={config.topk}, timeout_s={config.timeout_s}, deadline_s={config.deadline_s}, "
                             f"max_retries={config.max_retries}, retry_backoff_s={config.retry_backoff_s}, "
                             f"max_backoff_s={config.max_backoff_s}, max_response_bytes={config.max_response_bytes}, "
                             f"max_passage_chars={config.max_passage_chars}, max_request_queries="
                             f"{config.max_request_queries}, max_request_documents={config.max_request_documents}")
        self.config = config
        self._http: httpx.AsyncClient | None = None
        self._http_loop: asyncio.AbstractEventLoop | None = None
        self._pending: list[tuple[str, int, asyncio.Future[list[dict] | None]]] = []
        self._requests_in_flight: set[asyncio.Task] = set()
        self._counts: Counter[str] = Counter()

    async def search(self, query: str) -> str:
        """The top ``topk`` passages for ``query``, formatted for the model; "" if retrieval failed (an answered
        search has at least one passage, so "" means the retriever did not answer).

        TypeError for a query that is not a str (a tool loop passing the model's arguments through unchecked): it
        would otherwise fail the whole batch it joins."""
        return passages_text(await self.search_passages(query), self.config.max_passage_chars)

    async def search_passages(self, query: str, skip: Collection[str] = ()) -> list[dict] | None:
        """The top ``topk`` passages for ``query`` whose ``contents`` are not in ``skip`` (those a rollout was shown
        already: the server is asked for ``topk + len(skip)``, so the next ones take their places); None if
        retrieval failed. TypeError for a query that is not a str, as :meth:`search`."""
        if not isinstance(query, str):
            raise TypeError(f"search query must be a str, got {type(query).__name__}: {query!r:.200}")
        loop = asyncio.get_running_loop()
        if not self._pending:
            # Flush on the next loop iteration, after every search issued in this one has joined the batch.
            loop.call_soon(self._flush)
        future: asyncio.Future[list[dict] | None] = loop.create_future()
        self._pending.append((query, self.config.topk + len(skip), future))
        self._counts["searches"] += 1
        docs = await future
        return None if docs is None else [d for d in docs if d["contents"] not in skip][:self.config.topk]

    def _flush(self) -> None:
        """Send the pending searches, one request per depth (``topk``, or more where passages are skipped), each
        within ``max_request_queries`` and ``max_request_documents`` (a bigger one would be refused whole)."""
        batch, self._pending = self._pending, []
        for depth in dict.fromkeys(depth for _, depth, _ in batch):
            searches = [(query, future) for query, d, future in batch if d == depth]
            queries = list(dict.fromkeys(query for query, _ in searches))
            size = max(1, min(self.config.max_request_queries, self.config.max_request_documents // depth))
            for start in range(0, len(queries), size):
                chunk = queries[start:start + size]
                wanted = set(chunk)
                task = asyncio.get_running_loop().create_task(
                    self._answer(depth, chunk, [(query, future) for query, future in searches if query in wanted]))
                self._requests_in_flight.add(task)  # the loop keeps only weak references to tasks
                task.add_done_callback(self._requests_in_flight.discard)

    async def _answer(self, depth: int, queries: list[str],
                      batch: list[tuple[str, asyncio.Future[list[dict] | None]]]) -> None:
        """Retrieve ``depth`` passages for each of ``queries`` (distinct: identical searches are retrieved once) and
        resolve the futures of ``batch``, the searches asking for them."""
        try:
            results = await self._retrieve(queries, depth)
        except Exception as error:  # a bug, not a retrieval failure: surface it in the rollouts instead of hanging them
            for _, future in batch:
                if not future.done():
                    future.set_exception(error)
            raise
        if results is None:
            self._counts["failures"] += len(batch)
            results = [None] * len(queries)
        by_query = dict(zip(queries, results, strict=True))
        for query, future in batch:
            if not future.done():  # done when the rollout waiting for it was cancelled
                future.set_result(by_query[query])

    async def _retrieve(self, queries: list[str], depth: int) -> list[list[dict]] | None:
        """The top ``depth`` passages of each query, or None once every attempt has failed."""
        # Encoded here, not by httpx: a query that is no valid text (a lone surrogate) would make httpx raise for
        # the whole batch; valid_text makes it searchable as it would read.
        body = json.dumps({"queries": [valid_text(q) for q in queries], "topk": depth,
                           "return_scores": False}, ensure_ascii=False).encode()
        http = self._client()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.deadline_s
        last_error: Exception = TimeoutError(f"deadline_s={self.config.deadline_s} passed")
        attempts = 0
        for attempt in range(self.config.max_retries + 1):
            if attempt:
                backoff = min(self.config.retry_backoff_s * 2 ** (attempt - 1), self.config.max_backoff_s)
                if loop.time() + backoff >= deadline:
                    break
                await asyncio.sleep(backoff)
            self._counts["requests"] += 1
            attempts += 1
            start = time.perf_counter()
            try:
                async with asyncio.timeout(min(self.config.timeout_s, deadline - loop.time())):
                    return _passages_per_query(json.loads(await self._post(http, body)), len(queries))
            # ValueError: body is not JSON, has another shape or is too large; TimeoutError: timeout_s or deadline_s
            except (httpx.HTTPError, CannotSearch, ValueError, TimeoutError) as error:
                last_error = error
                if not _retryable(error):
                    break
            finally:
                self._counts["latency_s"] += time.perf_counter() - start
        # Warn, don't raise, so one flaky retriever doesn't crash the rollouts; the failures are counted too.
        logger.warning(
            "retrieval of %d queries from %s failed after %d attempt(s): %r; those searches get empty results",
            len(queries), self.config.search_url, attempts, last_error,
        )
        return None

    async def _post(self, http: httpx.AsyncClient, body: bytes) -> bytes:
        """The response body of one POST, read up to ``max_response_bytes``; raises for a 4xx/5xx status."""
        headers = {"content-type": "application/json"}
        async with http.stream("POST", self.config.search_url, content=body, headers=headers) as response:
            if response.status_code == 422:
                detail = await _head(response, 4096)
                if b"cannot be searched" in detail:
                    raise CannotSearch(f"422 {detail[:200].decode(errors='replace')}")
            response.raise_for_status()
            declared = response.headers.get("content-length", "")
            if declared.isdigit() and int(declared) > self.config.max_response_bytes:
                raise ResponseTooLarge(f"{declared} bytes > max_response_bytes={self.config.max_response_bytes}")
            received = bytearray()
            async for chunk in response.aiter_bytes():
                received += chunk
                if len(received) > self.config.max_response_bytes:
                    raise ResponseTooLarge(f"more than max_response_bytes={self.config.max_response_bytes}")
            return bytes(received)

    def _client(self) -> httpx.AsyncClient:
        """The pooled HTTP client of the running event loop."""
        loop = asyncio.get_running_loop()
        if self._http is None or self._http_loop is not loop:
            # Pooled connections belong to the loop that opened them; a new loop (another asyncio.run) needs its own.
            self._http = httpx.AsyncClient(timeout=self.config.timeout_s)
            self._http_loop = loop
        return self._http

    def metrics(self) -> dict[str, float]:
        """Counters since the last call (reset on read)."""
        counts, self._counts = self._counts, Counter()
        return {
            "search/searches": counts["searches"],
            "search/requests": counts["requests"],
            "search/failures": counts["failures"],
            "search/request_latency_s": counts["latency_s"] / counts["requests"] if counts["requests"] else 0.0,
        }

    async def aclose(self) -> None:
        if self._http is not None and self._http_loop is asyncio.get_running_loop():
            await self._http.aclose()
        self._http = self._http_loop = None


PROBE_QUERY = "Who won Super Bowl 50?"


def check_retriever(search_url: str, topk: int, timeout_s: float = 30.0) -> None:
    """ValueError naming the problem unless the retrieval server at ``search_url`` says it is healthy and answers a
    probe query with passages: a server that is down, or up but unable to search, would turn every search of a run
    into a failure (the plan check and ``searchr1-eval`` ask before anything heavy starts)."""
    base = search_url.rsplit("/", 1)[0]
    try:
        health = httpx.get(f"{base}/health", timeout=timeout_s)
        answer = httpx.post(search_url, json={"queries": [PROBE_QUERY], "topk": topk}, timeout=timeout_s) \
            if health.status_code == 200 else None
    except httpx.HTTPError as error:
        raise ValueError(f"retrieval server not reachable at {search_url} ({error!r}): start "
                         "`searchr1-retriever` or fix search_url") from None
    if answer is None:
        raise ValueError(f"the retrieval server at {base}/health answers {health.status_code} "
                         f"{health.text[:200]!r}: it cannot serve searches")
    try:
        answer.raise_for_status()
        [passages] = _passages_per_query(answer.json(), 1)
    except (httpx.HTTPStatusError, ValueError) as error:
        raise ValueError(f"the retrieval server at {search_url} cannot search: a probe query got {answer.status_code} "
                         f"{' '.join(str(error).split())[:200]}; {answer.text[:200]!r}") from None
    if not passages:
        raise ValueError(f"the retrieval server at {search_url} found no passage for a probe query: is its index "
                         "empty?")
