"""Cross-request micro-batching: queries of concurrent requests share one encode and one faiss search.

Hundreds of rollouts each ask for one query at a time; encoding them one by one wastes the encoder, whose cost per
batch is nearly flat up to a few hundred short queries. Requests wait in a queue; one worker fills a batch with
their queries until it holds ``max_batch_size`` queries (or ``max_batch_chars`` characters) or the oldest request has
waited ``max_wait_ms``, runs the batch in a background thread (``search_threads`` of them, one batch each) and
hands each request its own slice of the results. Under load the queue refills while a batch runs, so later batches
form without waiting at all.

Four rules keep one request from costing the others:

- **A big request is served in slices, with its share of the time.** Requests that have had nothing yet fill a
  batch; a partly served request larger than one batch (bulk) continues in a batch of its own while bulk batches
  have taken at most ``max_bulk_share`` of the last :data:`BULK_WINDOW_S` seconds of search time, or when no newcomer
  arrives for :data:`BULK_IDLE_S` (alone, it has the server). A request of 1,024 long queries so runs as many small
  batches, one for every four of the short requests arriving meanwhile, instead of one batch of minutes that they all
  wait behind. A request that fits one batch is never cut in two (it waits whole for the next batch), and once the
  rest of a big request fits one batch it keeps its place in the queue like any other.
  ``max_batch_chars`` bounds a batch's encoder work (the encoder truncates a query at ``max_length`` tokens, so at
  most :data:`CHARS_PER_QUERY_CAP` characters of one query count).
- **Bulk requests are admitted by cost.** Requests larger than one batch may hold ``max_bulk_chars`` query
  characters in all (one is always admitted); another gets :class:`Busy` (HTTP 429) at once. Nine maximal requests
  held together filled the queue and the good clients got 503s; one at a time, they cost the good clients little.
- **A failing batch is retried request by request, then query by query.** A batch that raises is not everyone's
  failure: each of its requests runs alone; one that still fails is searched query by query, and fails alone with
  :class:`BadQuery` naming its first query that cannot be searched (HTTP 422). The other requests get their results.
- **A request whose client left is dropped.** Cancelling ``submit`` (the server does when the connection closes)
  drops the request's queries that have not run yet and frees their room in the queue.

Memory stays bounded: a request that would take the number of queued and running queries over
``max_queued_queries`` is refused at once (``QueueFull``, HTTP 503) instead of queued. With ``batching`` off each
batch holds queries of one request only, through the same queue and thread, which is the baseline the benchmark
compares against.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from retriever_server.batching_config import BatcherConfig
from retriever_server.metrics import Metrics
from retriever_server.retriever import Hits

logger = logging.getLogger(__name__)

SearchFn = Callable[[list[str], list[int]], list[Hits]]

# The encoder keeps at most 256 tokens of a query (EncoderConfig.max_length), about 1 KB of English: characters
# beyond that cost it nothing, so they do not count against max_batch_chars.
CHARS_PER_QUERY_CAP = 1024

# Bulk work's share of the search time is measured over this window; when no small request arrives for
# BULK_IDLE_S after a batch, the bulk work may run whatever its share.
BULK_WINDOW_S = 2.0
BULK_IDLE_S = 0.05


class QueueFull(RuntimeError):
    """The server holds as many queries as it may; the client should retry later."""


class Busy(RuntimeError):
    """Requests larger than one batch already hold ``max_bulk_chars``; this one should come back later (HTTP 429)."""


class BadQuery(ValueError):
    """A query that fails the search on its own (the request's other queries and other requests are unaffected)."""

    def __init__(self, index: int, error: BaseException):
        super().__init__(f"queries[{index}]: cannot be searched ({type(error).__name__}: {str(error)[:200]})")
        self.index = index


@dataclass
class _Request:
    queries: list[str]
    topk: int
    future: asyncio.Future
    enqueued_at: float
    hits: list[Hits | None] = field(default_factory=list)
    taken: int = 0  # queries handed to batches so far
    bulk: bool = False  # larger than one batch

    @property
    def untaken(self) -> int:
        return len(self.queries) - self.taken


@dataclass
class _Slice:
    """Queries ``start:end`` of one request, as they sit in a batch."""

    request: _Request
    start: int
    end: int

    @property
    def queries(self) -> list[str]:
        return self.request.queries[self.start:self.end]


def _timed(search: SearchFn, queries: list[str], topks: list[int]) -> tuple[list[Hits], float]:
    """``search``'s result and its seconds, measured in the search thread (no queueing or hand-off counted)."""
    start = time.perf_counter()
    return search(queries, topks), time.perf_counter() - start


def _cost(query: str) -> int:
    return min(len(query), CHARS_PER_QUERY_CAP)


class MicroBatcher:
    def __init__(self, search: SearchFn, config: BatcherConfig, metrics: Metrics, device_type: str = "cpu"):
        """``device_type``: where the encoder runs, which sets the batch limits ``config`` leaves unset."""
        self.search, self.config, self.metrics = search, config.for_device(device_type), metrics
        self._pending: list[_Request] = []  # requests with queries not yet handed to a batch, oldest first
        self._held_queries = 0  # queries queued or running
        self._bulk_chars = 0  # query characters of the held requests larger than one batch
        self.last_failure: str | None = None  # the error of the last search, None once one succeeds
        self._recent: deque[tuple[float, float, bool]] = deque()  # (end, seconds, bulk) of recent batches
        self._arrived = asyncio.Event()
        self._executor = ThreadPoolExecutor(max_workers=self.config.search_threads, thread_name_prefix="retrieve")
        self._free_threads = asyncio.Semaphore(self.config.search_threads)
        self._running: set[asyncio.Task] = set()  # batches being searched (the loop keeps only weak references)
        self._worker: asyncio.Task | None = None

    async def start(self) -> None:
        self._worker = asyncio.create_task(self._run())

    async def stop(self) -> None:
        for task in [self._worker, *self._running]:
            if task is not None:
                task.cancel()
        self._executor.shutdown(wait=True)

    def check_room(self, bulk_chars: int) -> None:
        """:class:`Busy` unless a request of ``bulk_chars`` query characters larger than one batch (0 for one that
        fits a batch) may be held now. The server asks before reading a body over ``max_batch_chars`` bytes, with its
        size, which bounds its characters: a client resending a refused 1 MB request costs no JSON parse."""
        if bulk_chars and self._bulk_chars and self._bulk_chars + bulk_chars > self.config.max_bulk_chars:
            raise Busy(f"{self._bulk_chars} query characters of requests larger than one batch are being served; "
                       f"{bulk_chars} more would exceed max_bulk_chars={self.config.max_bulk_chars}; retry later")

    async def submit(self, queries: list[str], topk: int) -> list[Hits]:
        """Results for ``queries``, computed in whichever batches they land in; cancel it to drop the request."""
        if self._held_queries + len(queries) > self.config.max_queued_queries:
            raise QueueFull(
                f"{self._held_queries} queries queued or running; {len(queries)} more would exceed "
                f"max_queued_queries={self.config.max_queued_queries}"
            )
        bulk = 0 if self._fits_a_batch(queries) else sum(map(_cost, queries))
        self.check_room(bulk)
        loop = asyncio.get_running_loop()
        request = _Request(queries, topk, loop.create_future(), loop.time(), hits=[None] * len(queries),
                           bulk=bool(bulk))
        self._held_queries += len(queries)
        self._bulk_chars += bulk
        self._pending.append(request)
        self._arrived.set()
        try:
            return await request.future
        finally:
            self._bulk_chars -= bulk

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._arrived.wait()
            self._arrived.clear()
            while True:
                # A batch forms only once a search thread is free, so requests arriving meanwhile can still join it.
                await self._free_threads.acquire()
                batch = await self._next_batch(loop) if self._drop_finished() else []
                if not batch:  # nothing is pending
                    self._free_threads.release()
                    break
                task = loop.create_task(self._execute(batch, loop))
                self._running.add(task)
                task.add_done_callback(self._batch_done)

    def _batch_done(self, task: asyncio.Task) -> None:
        self._running.discard(task)
        self._free_threads.release()

    def _drop_finished(self) -> bool:
        """Forget requests whose client left (their future is cancelled) or that failed; True if any remain."""
        for request in [r for r in self._pending if r.future.done()]:
            self._pending.remove(request)
            self._held_queries -= request.untaken
            self.metrics.dropped_queries += request.untaken
        return bool(self._pending)

    async def _next_batch(self, loop: asyncio.AbstractEventLoop) -> list[_Slice]:
        """Slices of pending requests, newcomers first, up to ``max_batch_size`` queries and ``max_batch_chars``
        characters (always at least one query)."""
        if not await self._gather(loop):
            return []
        ready, big = self._split_pending()
        while big and not ready and not self._bulk_may_run(loop.time()):
            # Bulk work has had its share: a gap after a batch under load is only the time small clients take to
            # read their answers and ask again, so wait for them and serve them first.
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), BULK_IDLE_S)
            except TimeoutError:
                break  # no small client is waiting: the bulk work may have the server
            if not await self._gather(loop):
                return []
            ready, big = self._split_pending()
        # Newcomers first, in arrival order, unless bulk work is owed its share of the time.
        use_big = bool(big) and (not ready or self._bulk_may_run(loop.time()))
        candidates = big[:1] if use_big else ready if self.config.batching else ready[:1]
        # A bulk slice is a quarter of a batch, so a newcomer arriving while one runs waits little for it.
        max_chars = self.config.max_batch_chars // 4 if use_big else self.config.max_batch_chars
        batch: list[_Slice] = []
        size = chars = 0
        for request in candidates:
            end = request.taken
            while end < len(request.queries) and size < self.config.max_batch_size:
                cost = _cost(request.queries[end])
                if size and chars + cost > max_chars:
                    break
                size, chars, end = size + 1, chars + cost, end + 1
            if end == request.taken:  # the batch is full
                break
            if batch and end < len(request.queries) and self._rest_fits_a_batch(request):
                break  # the next batch takes it whole
            batch.append(_Slice(request, request.taken, end))
            request.taken = end
        self._pending = [r for r in self._pending if r.untaken]
        return batch

    async def _gather(self, loop: asyncio.AbstractEventLoop) -> bool:
        """With batching, wait until ``max_batch_size`` queries are pending or the oldest newcomer (a request that
        has had nothing yet) has waited ``max_wait_ms``; True if any request remains."""
        if self.config.batching:
            newcomers = [r for r in self._pending if not r.taken]
            deadline = (newcomers or self._pending)[0].enqueued_at + self.config.max_wait_ms / 1000
            while sum(r.untaken for r in self._pending) < self.config.max_batch_size:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    break
                self._arrived.clear()
                try:
                    await asyncio.wait_for(self._arrived.wait(), remaining)
                except TimeoutError:
                    break
        return self._drop_finished()

    def _split_pending(self) -> tuple[list[_Request], list[_Request]]:
        """(ready, big): requests that may join the next batch whole or as newcomers, and partly served requests
        whose rest is larger than one batch."""
        ready = [r for r in self._pending if not r.taken or self._rest_fits_a_batch(r)]
        return ready, [r for r in self._pending if r.taken and not self._rest_fits_a_batch(r)]

    def _bulk_may_run(self, now: float) -> bool:
        """Whether the last batch was no bulk slice and bulk slices took at most ``max_bulk_share`` of the search time
        of the last :data:`BULK_WINDOW_S` seconds: bulk slices run one at a time between the small batches, never in
        a row ahead of newcomers (a row of them, up to the share, doubled the good clients' p99)."""
        while self._recent and self._recent[0][0] < now - BULK_WINDOW_S:
            self._recent.popleft()
        if not self._recent:
            return True
        bulk = sum(seconds for _, seconds, is_bulk in self._recent if is_bulk)
        return not self._recent[-1][2] and bulk <= self.config.max_bulk_share * sum(s for _, s, _ in self._recent)

    def _rest_fits_a_batch(self, request: _Request) -> bool:
        """Whether the queries of ``request`` not yet taken fit one batch on their own. Such a request is never cut
        to fill a batch, and once partly served it keeps its place in the queue instead of waiting behind
        newcomers: with 8 clients sending 64-query requests, the queries cut off a request at the end of a batch
        otherwise waited behind every newcomer (p99 5.8 s against a p50 of 0.36 s on 2 cores)."""
        return self._fits_a_batch(request.queries[request.taken:])

    def _fits_a_batch(self, queries: list[str]) -> bool:
        return len(queries) <= self.config.max_batch_size and sum(map(_cost, queries)) <= self.config.max_batch_chars

    async def _execute(self, batch: list[_Slice], loop: asyncio.AbstractEventLoop) -> None:
        queries = [q for s in batch for q in s.queries]
        try:
            hits, seconds = await loop.run_in_executor(
                self._executor, _timed, self._searched, queries, [s.request.topk for s in batch for _ in s.queries])
        except Exception:
            self.metrics.batch_errors += 1
            logger.warning("batch of %d queries from %d requests failed; retrying request by request", len(queries),
                           len(batch), exc_info=True)
            for part in batch:
                await self._execute_alone(part, loop)
        else:
            self.metrics.record_batch(len(queries), len({id(s.request) for s in batch}), seconds)
            self._recent.append((loop.time(), seconds, any(s.request.bulk for s in batch)))
            start = 0
            for part in batch:
                self._deliver(part, hits[start:start + len(part.queries)])
                start += len(part.queries)
        finally:
            self._held_queries -= len(queries)

    async def _execute_alone(self, part: _Slice, loop: asyncio.AbstractEventLoop) -> None:
        """Search one slice alone, and on failure query by query; the first query that fails alone fails its
        request with :class:`BadQuery`."""
        if part.request.future.done():
            return
        topks = [part.request.topk] * len(part.queries)
        try:
            self._deliver(part, await self._search(part.queries, topks, loop))
            return
        except Exception as error:  # noqa: BLE001 - narrowed down below
            first_error = error
        for offset, query in enumerate(part.queries):
            try:
                [one] = await self._search([query], [part.request.topk], loop)
            except Exception as error:  # noqa: BLE001 - this query is the culprit
                self._fail(part.request, BadQuery(part.start + offset, error))
                return
            self._deliver(_Slice(part.request, part.start + offset, part.start + offset + 1), [one])
        # Every query passed alone but not together: not the queries' fault.
        self._fail(part.request, first_error)

    async def _search(self, queries: list[str], topks: list[int], loop: asyncio.AbstractEventLoop) -> list[Hits]:
        return await loop.run_in_executor(self._executor, self._searched, queries, topks)

    def _searched(self, queries: list[str], topks: list[int]) -> list[Hits]:
        """``search``'s result, remembering in :attr:`last_failure` whether it raised (in a search thread; one
        attribute assignment, atomic)."""
        try:
            hits = self.search(queries, topks)
        except Exception as error:
            self.last_failure = f"{type(error).__name__}: {str(error)[:200]}"
            raise
        self.last_failure = None
        return hits

    def _deliver(self, part: _Slice, hits: list[Hits]) -> None:
        request = part.request
        if request.future.done():  # its client left, or another slice of it failed
            return
        request.hits[part.start:part.end] = hits
        if request.taken == len(request.queries) and all(h is not None for h in request.hits):
            request.future.set_result(request.hits)

    def _fail(self, request: _Request, error: BaseException) -> None:
        self.metrics.bad_queries += isinstance(error, BadQuery)
        if not request.future.done():
            request.future.set_exception(error)
