"""Cross-request micro-batching: queries of concurrent requests share one encode and one faiss search.

Hundreds of rollouts each ask for one query at a time; encoding them one by one wastes the encoder, whose cost per
batch is nearly flat up to a few hundred short queries. Requests wait in a queue; one worker takes whole requests
from it until a batch holds ``max_batch_size`` queries or the oldest request has waited ``max_wait_ms``, runs the
batch in a single background thread and hands each request its own slice of the results. Under load the queue
refills while a batch runs, so later batches form without waiting at all.

Memory stays bounded: a request that would take the number of queued and running queries over
``max_queued_queries`` is refused at once (``QueueFull``, HTTP 503) instead of queued. With ``batching`` off each
request is its own batch, through the same queue and thread, which is the baseline the benchmark compares against.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

from retriever_server.metrics import Metrics
from retriever_server.retriever import Hits

logger = logging.getLogger(__name__)

SearchFn = Callable[[list[str], list[int]], list[Hits]]


@dataclass
class BatcherConfig:
    batching: bool = field(default=True, metadata={"help": "Merge concurrent requests into shared batches."})
    max_batch_size: int = field(
        default=256, metadata={"help": "Most queries in one batch (a bigger request runs alone)."}
    )
    max_wait_ms: float = field(default=2.0, metadata={"help": "Longest a request waits for others to join its batch."})
    max_queued_queries: int = field(
        default=8192, metadata={"help": "Queued plus running queries above which requests get 503."}
    )

    def __post_init__(self) -> None:
        if self.max_batch_size <= 0 or self.max_queued_queries <= 0 or self.max_wait_ms < 0:
            raise ValueError(
                "max_batch_size and max_queued_queries must be positive and max_wait_ms >= 0, got "
                f"{self.max_batch_size}, {self.max_queued_queries}, {self.max_wait_ms}"
            )


class QueueFull(RuntimeError):
    """The server holds as many queries as it may; the client should retry later."""


@dataclass
class _Request:
    queries: list[str]
    topk: int
    future: asyncio.Future
    enqueued_at: float


class MicroBatcher:
    def __init__(self, search: SearchFn, config: BatcherConfig, metrics: Metrics):
        self.search, self.config, self.metrics = search, config, metrics
        self._pending: deque[_Request] = deque()
        self._pending_queries = 0  # in the queue
        self._held_queries = 0  # in the queue or in the running batch
        self._arrived = asyncio.Event()
        # One thread: the encoder and faiss already use every core, so two batches at once would only contend.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="retrieve")
        self._worker: asyncio.Task | None = None

    async def start(self) -> None:
        self._worker = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
        self._executor.shutdown(wait=True)

    async def submit(self, queries: list[str], topk: int) -> list[Hits]:
        """Results for ``queries``, computed in whichever batch they land in."""
        if self._held_queries + len(queries) > self.config.max_queued_queries:
            raise QueueFull(
                f"{self._held_queries} queries queued or running; {len(queries)} more would exceed "
                f"max_queued_queries={self.config.max_queued_queries}"
            )
        loop = asyncio.get_running_loop()
        request = _Request(queries, topk, loop.create_future(), loop.time())
        self._held_queries += len(queries)
        self._pending_queries += len(queries)
        self._pending.append(request)
        self._arrived.set()
        return await request.future

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._arrived.wait()
            self._arrived.clear()
            while self._pending:
                batch = await self._next_batch(loop)
                await self._execute(batch, loop)

    async def _next_batch(self, loop: asyncio.AbstractEventLoop) -> list[_Request]:
        """Whole requests, oldest first, up to ``max_batch_size`` queries (always at least one request)."""
        if self.config.batching:
            deadline = self._pending[0].enqueued_at + self.config.max_wait_ms / 1000
            while self._pending_queries < self.config.max_batch_size:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    break
                self._arrived.clear()
                try:
                    await asyncio.wait_for(self._arrived.wait(), remaining)
                except TimeoutError:
                    break
        batch = [self._pending.popleft()]
        size = len(batch[0].queries)
        while (self.config.batching and self._pending
               and size + len(self._pending[0].queries) <= self.config.max_batch_size):
            batch.append(self._pending.popleft())
            size += len(batch[-1].queries)
        self._pending_queries -= size
        return batch

    async def _execute(self, batch: list[_Request], loop: asyncio.AbstractEventLoop) -> None:
        queries = [q for r in batch for q in r.queries]
        topks = [r.topk for r in batch for _ in r.queries]
        try:
            hits = await loop.run_in_executor(self._executor, self.search, queries, topks)
        except Exception as exc:  # every waiting request gets the error, and the worker must survive it
            self.metrics.batch_errors += 1
            logger.exception("batch of %d queries failed", len(queries))
            for r in batch:
                if not r.future.done():
                    r.future.set_exception(exc)
        else:
            self.metrics.record_batch(len(queries), len(batch))
            start = 0
            for r in batch:
                if not r.future.done():  # a client that hung up has had its future cancelled
                    r.future.set_result(hits[start:start + len(r.queries)])
                start += len(r.queries)
        finally:
            self._held_queries -= len(queries)
