"""How the retrieval server merges requests into batches (``MicroBatcher`` in batching.py): the limits a deployment
tunes, and their defaults for a CPU or a GPU encoder."""

from __future__ import annotations

from dataclasses import dataclass, field, replace


@dataclass
class BatcherConfig:
    batching: bool = field(default=True, metadata={"help": "Merge concurrent requests into shared batches."})
    max_batch_size: int | None = field(
        default=None,
        metadata={"help": "Most queries in one batch (a bigger request is served in slices). Default: 256 with a CPU "
                          "encoder, 512 with a GPU one."},
    )
    max_batch_chars: int | None = field(
        default=None,
        metadata={"help": "Most query characters in one batch (each query counts at most 1,024): bounds how long one "
                          "batch, and so a request queued behind it, takes when queries are long. Default: 4,096 with "
                          "a CPU encoder (about the work of 64 rollouts' questions), 65,536 with a GPU one, where a "
                          "big batch costs little more than a small one."},
    )
    max_wait_ms: float = field(default=2.0, metadata={"help": "Longest a request waits for others to join its batch."})
    search_threads: int = field(
        default=1,
        metadata={"help": "Batches searched at once, each in its own thread. 1 suits a CPU encoder (it uses every core "
                          "already); with a GPU encoder one batch's tokenisation, CPU search and lookup can overlap "
                          "another's GPU work."},
    )
    max_queued_queries: int = field(
        default=8192, metadata={"help": "Queued plus running queries above which requests get 503."}
    )
    max_bulk_share: float = field(
        default=0.2,
        metadata={"help": "Most of the search time that requests larger than one batch get while smaller ones keep "
                          "arriving (measured over the last 2 s); alone they get all of it."},
    )
    max_bulk_chars: int = field(
        default=1 << 20,
        metadata={"help": "Most query characters (each query counts at most 1,024) of requests larger than one batch "
                          "held at once; another such request gets 429 until they are served (one is always admitted). "
                          "The default holds one request of the largest size: nine of them held at once filled the "
                          "queue, and good clients got 503s."},
    )

    def __post_init__(self) -> None:
        limits = [v for v in (self.max_batch_size, self.max_batch_chars, self.max_queued_queries,
                              self.search_threads, self.max_bulk_chars) if v is not None]
        if min(limits) <= 0 or self.max_wait_ms < 0 or not 0 < self.max_bulk_share <= 1:
            raise ValueError(
                "max_batch_size, max_batch_chars, max_queued_queries, search_threads and max_bulk_chars must be "
                f"positive and max_wait_ms >= 0, got {self.max_batch_size}, {self.max_batch_chars}, "
                f"{self.max_queued_queries}, {self.search_threads}, {self.max_bulk_chars}, {self.max_wait_ms}; "
                f"max_bulk_share must be in (0, 1], got {self.max_bulk_share}"
            )

    def for_device(self, device_type: str) -> BatcherConfig:
        """This config with the unset batch limits set for an encoder on ``device_type`` ("cuda" or "cpu"). On an
        H200, 8 clients sending 64-query requests got 0.58x the throughput of a one-request-at-a-time server with the
        CPU limits (a request just over 4,096 characters was sliced and waited behind newcomers: p99 6.4 s) and 2.35x
        with the GPU ones (experiments/results, 2026-12-01)."""
        gpu = device_type == "cuda"
        return replace(self, max_batch_size=self.max_batch_size or (512 if gpu else 256),
                       max_batch_chars=self.max_batch_chars or (65_536 if gpu else 4_096))
