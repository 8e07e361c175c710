"""Counters and recent-latency percentiles behind ``GET /metrics``.

Only the event loop thread writes here, so no lock is needed. Percentiles are over the last ``window`` requests,
which keeps memory constant however long the server runs.
"""

from __future__ import annotations

from collections import Counter, deque

import numpy as np


class Metrics:
    def __init__(self, window: int = 10_000):
        self.requests = 0
        self.queries = 0
        self.batches = 0
        self.batch_errors = 0
        self.rejected: Counter[int] = Counter()
        self._latencies_s: deque[float] = deque(maxlen=window)
        self._batch_queries: deque[int] = deque(maxlen=window)
        self._batch_requests: deque[int] = deque(maxlen=window)

    def record_request(self, queries: int, latency_s: float) -> None:
        self.requests += 1
        self.queries += queries
        self._latencies_s.append(latency_s)

    def record_batch(self, queries: int, requests: int) -> None:
        self.batches += 1
        self._batch_queries.append(queries)
        self._batch_requests.append(requests)

    def record_rejection(self, status: int) -> None:
        self.rejected[status] += 1

    def snapshot(self) -> dict:
        """What ``GET /metrics`` returns; ``*_recent`` statistics cover the last ``window`` requests or batches."""
        latencies_ms = np.asarray(self._latencies_s) * 1000
        p50, p90, p99 = np.percentile(latencies_ms, [50, 90, 99]).tolist() if len(latencies_ms) else (None,) * 3
        sizes = np.asarray(self._batch_queries)
        return {
            "requests": self.requests,
            "queries": self.queries,
            "batches": self.batches,
            "batch_errors": self.batch_errors,
            "rejected": {str(status): n for status, n in sorted(self.rejected.items())},
            "batch_queries_recent": {
                "mean": float(sizes.mean()) if len(sizes) else None,
                "max": int(sizes.max()) if len(sizes) else None,
            },
            "batch_requests_recent": {
                "mean": float(np.mean(self._batch_requests)) if self._batch_requests else None,
                "max": max(self._batch_requests, default=None),
            },
            "latency_ms_recent": {"p50": p50, "p90": p90, "p99": p99, "count": len(latencies_ms)},
        }
