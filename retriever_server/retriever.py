"""Queries -> top-k documents: one encode, one faiss search and one corpus fetch for a whole batch of queries.

Everything here is synchronous and batch-shaped; the server decides how queries are grouped into batches.
"""

from __future__ import annotations

import itertools
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import faiss
import numpy as np
import torch

from retriever_server.encoder import Encoder, EncoderConfig
from retriever_server.index import Corpus, SearchConfig, load_index
from retriever_server.progress import loading

logger = logging.getLogger(__name__)


def set_cpu_threads(threads: int | None) -> None:
    """Cap the threads torch and faiss use on CPU (None keeps their default, one per core).

    On cores shared with other busy processes, every parallel region waits for its slowest thread to be scheduled,
    so fewer threads than cores can be several times faster there.
    """
    if threads is not None:
        torch.set_num_threads(threads)
        faiss.omp_set_num_threads(threads)


def meta_path(index_path: str) -> Path:
    """Sidecar written by the builder: how the passages were encoded, so the server can warn if queries differ."""
    return Path(f"{index_path}.json")


@dataclass
class Hits:
    """One query's results, best first."""

    documents: list[dict]
    scores: list[float]


class Retriever:
    def __init__(self, encoder: Encoder, index, corpus: Corpus):
        if index.ntotal != len(corpus):
            raise ValueError(
                f"index has {index.ntotal} vectors but the corpus has {len(corpus)} passages; "
                "rebuild the index from this corpus"
            )
        self.encoder, self.index, self.corpus = encoder, index, corpus

    @classmethod
    def from_paths(cls, index_path: str, corpus_path: str, encoder_config: EncoderConfig,
                   search_config: SearchConfig) -> Retriever:
        meta = meta_path(index_path)
        if meta.exists():
            built_with = json.loads(meta.read_text())["encoder"]
            # Paths differ between machines, so the model is compared by name; the rest must match exactly.
            for key, new in encoder_config.fingerprint().items():
                old = built_with.get(key)
                if key == "retriever_model":
                    old, new = Path(str(old).rstrip("/")).name, Path(new.rstrip("/")).name
                if old != new:
                    logger.warning("index was built with %s=%r but the server encodes queries with %r", key, old, new)
        with loading(f"encoder {encoder_config.retriever_model}"):
            encoder = Encoder(encoder_config)
        with loading("index", index_path):
            index = load_index(index_path, search_config)
        with loading("corpus", corpus_path):
            corpus = Corpus.load(corpus_path)
        return cls(encoder, index, corpus)

    def search(self, queries: list[str], topks: Sequence[int]) -> list[Hits]:
        """Top ``topks[i]`` documents for ``queries[i]``; a query gets fewer only if the index holds fewer."""
        vectors = self.encoder.encode_queries(queries)
        k = min(max(topks), self.index.ntotal)
        scores, rows = self.index.search(vectors, k)
        # Each query keeps its own prefix of the shared top-k; faiss marks missing results (IVF, HNSW) with -1.
        keep = (np.arange(k)[None, :] < np.asarray(topks)[:, None]) & (rows >= 0)
        documents = self.corpus.take(rows[keep])
        flat_scores = scores[keep].tolist()
        bounds = np.concatenate([[0], np.cumsum(keep.sum(axis=1))]).tolist()
        return [Hits(documents[a:b], flat_scores[a:b]) for a, b in itertools.pairwise(bounds)]
