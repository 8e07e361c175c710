"""Counters and recent-latency percentiles behind ``GET /metrics``, in Prometheus' text format.

Only the event loop thread writes here, so no lock is needed. Percentiles are over the last ``window`` requests,
which keeps memory constant however long the server runs. :func:`parse_prometheus` reads the text back (tests and
benchmarks), so nothing needs a second, JSON, endpoint.
"""

from __future__ import annotations

from collections import Counter, deque

import numpy as np

PREFIX = "retriever_"


class Metrics:
    def __init__(self, window: int = 10_000):
        self.requests = 0
        self.queries = 0
        self.batches = 0
        self.batch_errors = 0  # batches that raised and were retried request by request
        self.bad_queries = 0  # requests failed by a query that cannot be searched even alone
        self.dropped_queries = 0  # queries never searched because their request was cancelled or failed
        self.disconnects = 0  # requests whose client left before the answer
        self.rejected: Counter[int] = Counter()
        self._latencies_s: deque[float] = deque(maxlen=window)
        self._batch_queries: deque[int] = deque(maxlen=window)
        self._batch_requests: deque[int] = deque(maxlen=window)
        self._batch_seconds: deque[float] = deque(maxlen=window)
        self.request_seconds = 0.0  # sums since start: a client differences two reads for its own run's means
        self.batch_seconds = 0.0

    def record_request(self, queries: int, latency_s: float) -> None:
        self.requests += 1
        self.queries += queries
        self.request_seconds += latency_s
        self._latencies_s.append(latency_s)

    def record_batch(self, queries: int, requests: int, seconds: float) -> None:
        self.batches += 1
        self.batch_seconds += seconds
        self._batch_queries.append(queries)
        self._batch_requests.append(requests)
        self._batch_seconds.append(seconds)

    def record_rejection(self, status: int) -> None:
        self.rejected[status] += 1

    def prometheus(self) -> str:
        """What ``GET /metrics`` returns; ``*_recent`` statistics cover the last ``window`` requests or batches."""
        lines: list[str] = []

        def metric(name: str, kind: str, help_text: str, samples: dict[str, float]) -> None:
            lines.extend([f"# HELP {PREFIX}{name} {help_text}", f"# TYPE {PREFIX}{name} {kind}"])
            lines.extend(f"{PREFIX}{name}{labels} {_number(value)}" for labels, value in samples.items())

        metric("requests_total", "counter", "Requests answered with results.", {"": self.requests})
        metric("queries_total", "counter", "Queries answered.", {"": self.queries})
        metric("batches_total", "counter", "Batches searched.", {"": self.batches})
        metric("request_seconds_total", "counter", "Body read to response built, summed over answered requests.",
               {"": self.request_seconds})
        metric("batch_seconds_total", "counter", "Encode + search + lookup, summed over batches.",
               {"": self.batch_seconds})
        metric("batch_errors_total", "counter", "Batches that failed and were retried request by request.",
               {"": self.batch_errors})
        metric("bad_queries_total", "counter", "Requests failed (422) by a query that cannot be searched alone.",
               {"": self.bad_queries})
        metric("dropped_queries_total", "counter", "Queries never searched: their request was cancelled or failed.",
               {"": self.dropped_queries})
        metric("disconnects_total", "counter", "Requests whose client left before the answer (work cancelled).",
               {"": self.disconnects})
        metric("rejected_total", "counter", "Requests answered with an error, by HTTP status.",
               {f'{{status="{status}"}}': n for status, n in sorted(self.rejected.items())})
        for name, help_text, seconds in (
            ("latency_seconds_recent", "Body read to response built, over recent requests.", self._latencies_s),
            ("batch_seconds_recent", "Encode + search + lookup of one batch in the search thread, over recent "
                                     "batches (a request's latency minus these is queueing and HTTP).",
             self._batch_seconds),
        ):
            values = np.asarray(seconds)
            quantiles = np.percentile(values, [50, 90, 99]) if len(values) else [float("nan")] * 3
            metric(name, "summary", help_text,
                   {**{f'{{quantile="{q}"}}': v for q, v in zip(("0.5", "0.9", "0.99"), quantiles, strict=True)},
                    "_count": len(values)})
        for name, values in (("batch_queries_recent", self._batch_queries),
                             ("batch_requests_recent", self._batch_requests)):
            metric(name, "gauge", f"{name.split('_')[1].capitalize()} per batch over recent batches (mean, max).",
                   {'{stat="mean"}': float(np.mean(values)) if values else float("nan"),
                    '{stat="max"}': max(values, default=float("nan"))})
        return "\n".join(lines) + "\n"


def _number(value: float) -> str:
    return str(value) if isinstance(value, int) else "NaN" if value != value else repr(float(value))


def parse_prometheus(text: str) -> dict[str, float]:
    """``{"name{labels}": value}`` of every sample in Prometheus text, without the ``retriever_`` prefix.

    ``'retriever_rejected_total{status="422"} 3'`` -> ``{'rejected_total{status="422"}': 3.0}``.
    """
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name.removeprefix(PREFIX)] = float(value)
    return samples
