"""Queries -> top-k documents: one encode, one faiss search and one corpus fetch for a whole batch of queries.

Everything here is synchronous and batch-shaped; the server decides how queries are grouped into batches.
"""

from __future__ import annotations

import hashlib
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
from retriever_server.index import Corpus, SearchConfig, TorchFlatIndex, load_index
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
    """Sidecar written by the builder: what the index was built from, checked by the server before it serves."""
    return Path(f"{index_path}.json")


class MismatchError(ValueError):
    """The encoder or corpus given to the server is not the one the index was built with."""


# Cosine between the probe embeddings of build and server above which they are the same encoder: fp16 on a GPU
# against fp32 on a CPU stays above 0.9999; another model of the same width is far below.
PROBE_MIN_COSINE = 0.99


def corpus_fingerprint(corpus: Corpus) -> str:
    """sha256 of the ``contents`` column, passage boundaries included (row order matters: a row is an index row).
    Reads the Arrow buffers in place: wiki-18's 13 GB take ~10 s at the 1.3 GB/s measured on one core."""
    digest = hashlib.sha256(str(len(corpus)).encode())
    for chunk in corpus.table.column("contents").chunks:
        offsets = np.frombuffer(chunk.buffers()[1], dtype=np.int64)[chunk.offset:chunk.offset + len(chunk) + 1]
        digest.update((offsets - offsets[0]).tobytes())
        digest.update(memoryview(chunk.buffers()[2])[offsets[0]:offsets[-1]])
    return f"sha256:{digest.hexdigest()}"


def sidecar(encoder: Encoder, corpus: Corpus, corpus_path: str, index_config: dict) -> dict:
    """What :func:`check_sidecar` compares at every server start: the encoder (settings, width, the embedding of
    :data:`~retriever_server.encoder.PROBE_PASSAGE`) and the corpus (passage count, content fingerprint)."""
    return {"encoder": encoder.config.fingerprint(), "embedding_dim": encoder.dim,
            "probe_vector": encoder.probe_vector(), "index": index_config, "passages": len(corpus),
            "corpus_fingerprint": corpus_fingerprint(corpus), "corpus_path": str(Path(corpus_path).resolve())}


def _check_encoder(built: dict, encoder: Encoder, sidecar_file: Path) -> None:
    """MismatchError when ``encoder`` does not compute the vectors the index holds; a model of another name that
    embeds the probe the same is only warned about (paths differ between machines)."""
    dim = built.get("embedding_dim")
    if dim is not None and dim != encoder.dim:
        raise MismatchError(f"the index ({sidecar_file}) was built with {dim}-dimensional embeddings but "
                            f"--retriever_model {encoder.config.retriever_model} gives {encoder.dim}; serve it with "
                            "the encoder it was built with")
    settings = built.get("encoder", {})
    for key, new in encoder.config.fingerprint().items():
        old = settings.get(key)
        if key == "retriever_model":
            if Path(str(old).rstrip("/")).name != Path(new.rstrip("/")).name:
                logger.warning("index was built with retriever_model=%r, the server encodes queries with %r", old, new)
        elif old != new:
            raise MismatchError(f"the index ({sidecar_file}) was built with {key}={old!r} but the server encodes "
                                f"with {key}={new!r}; pass --{key} {old!r}")
    if "probe_vector" in built:
        cosine = float(np.dot(built["probe_vector"], encoder.probe_vector()))
        if cosine < PROBE_MIN_COSINE:
            raise MismatchError(f"--retriever_model {encoder.config.retriever_model} is not the encoder the index "
                                f"({sidecar_file}) was built with: it embeds a probe passage at cosine {cosine:.3f} "
                                f"to the build's (expected >= {PROBE_MIN_COSINE}); serve it with that encoder")


def _check_corpus(built: dict, corpus: Corpus, corpus_path: str, sidecar_file: Path) -> None:
    """MismatchError when ``corpus`` is not, passage for passage, the one the index was built from."""
    expected = built.get("passages")
    if expected is not None and expected != len(corpus):
        raise MismatchError(f"--corpus_path {corpus_path} holds {len(corpus)} passages but the index "
                            f"({sidecar_file}) was built from {expected} ({built.get('corpus_path')}); serve the "
                            "corpus it was built from or rebuild the index")
    if "corpus_fingerprint" not in built:
        logger.warning("%s predates corpus fingerprints: the corpus's content is not checked; rebuild the index to "
                       "check it", sidecar_file)
    elif built["corpus_fingerprint"] != corpus_fingerprint(corpus):
        raise MismatchError(f"--corpus_path {corpus_path} is not the corpus the index ({sidecar_file}) was built "
                            f"from ({built.get('corpus_path')}): same {len(corpus)} passages, other contents; serve "
                            "that corpus or rebuild the index")


@dataclass
class Hits:
    """One query's results, best first."""

    documents: Sequence[dict]  # a list, or the corpus rows as :class:`Passages`
    scores: list[float]


class Passages(Sequence):
    """One query's documents, read from the corpus when first used, so the server can weigh a response
    (:func:`passage_bytes`) before it builds one."""

    def __init__(self, corpus: Corpus, rows: np.ndarray):
        self.corpus, self.rows, self._documents = corpus, rows, None

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index):
        if self._documents is None:
            self._documents = self.corpus.take(self.rows)
        return self._documents[index]

    def __eq__(self, other) -> bool:
        return list(self) == list(other)


def passage_bytes(documents: Sequence[dict]) -> int:
    """The bytes of the documents' ``contents``; of :class:`Passages`, read from the corpus's offsets, not the text."""
    if isinstance(documents, Passages):
        return documents.corpus.contents_bytes(documents.rows)
    return sum(len(str(d.get("contents", "")).encode()) for d in documents)


class Retriever:
    def __init__(self, encoder: Encoder, index, corpus: Corpus):
        if index.ntotal != len(corpus):
            raise MismatchError(
                f"index has {index.ntotal} vectors but the corpus has {len(corpus)} passages; "
                "rebuild the index from this corpus"
            )
        self.encoder, self.index, self.corpus = encoder, index, corpus
        if isinstance(index, TorchFlatIndex):
            index.warm_up()

    @classmethod
    def from_paths(cls, index_path: str, corpus_path: str, encoder_config: EncoderConfig,
                   search_config: SearchConfig) -> Retriever:
        """Load the three parts, each checked against the index's sidecar as soon as it is loaded, so a mismatch
        is refused (:class:`MismatchError`) before the longest load; without a sidecar only widths and counts are
        compared."""
        for path in (index_path, corpus_path):
            if not Path(path).is_file():
                raise FileNotFoundError(f"{path} does not exist or is no file")
        sidecar_file = meta_path(index_path)
        built = json.loads(sidecar_file.read_text()) if sidecar_file.exists() else {}
        if not built:
            logger.warning("no %s beside the index: encoder and corpus are checked by width and count only",
                           sidecar_file)
        with loading(f"encoder {encoder_config.retriever_model}"):
            encoder = Encoder(encoder_config)
        _check_encoder(built, encoder, sidecar_file)
        with loading("index", index_path):
            index = load_index(index_path, search_config)
        if index.d != encoder.dim:
            raise MismatchError(f"the index {index_path} holds {index.d}-dimensional vectors but --retriever_model "
                                f"{encoder_config.retriever_model} gives {encoder.dim}; serve it with the encoder "
                                "it was built with")
        with loading("corpus", corpus_path):
            corpus = Corpus.load(corpus_path)
        _check_corpus(built, corpus, corpus_path, sidecar_file)
        return cls(encoder, index, corpus)

    def search(self, queries: list[str], topks: Sequence[int]) -> list[Hits]:
        """Top ``topks[i]`` documents for ``queries[i]``; a query gets fewer only if the index holds fewer."""
        vectors = self.encoder.encode_queries(queries)
        k = min(max(topks), self.index.ntotal)
        scores, rows = self._search_index(vectors, k)
        # Each query keeps its own prefix of the shared top-k; faiss marks missing results (IVF, HNSW) with -1.
        keep = (np.arange(k)[None, :] < np.asarray(topks)[:, None]) & (rows >= 0)
        found = rows[keep]
        flat_scores = scores[keep].tolist()
        bounds = np.concatenate([[0], np.cumsum(keep.sum(axis=1))]).tolist()
        return [Hits(Passages(self.corpus, found[a:b]), flat_scores[a:b]) for a, b in itertools.pairwise(bounds)]

    def _search_index(self, vectors: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """The index's search; a batch the GPU has no memory for is searched as two halves, down to single vectors.
        On a GPU shared with training (the offline GPU recipe) the memory free for a batch comes and goes, and a
        search that waits is better than an error the client retries after seconds."""
        try:
            return self.index.search(vectors, k)
        except torch.OutOfMemoryError:
            if len(vectors) == 1:
                raise
            torch.cuda.empty_cache()
            half = len(vectors) // 2
            logger.warning("out of GPU memory searching %d queries at once: searching them as %d + %d",
                           len(vectors), half, len(vectors) - half)
            halves = self._search_index(vectors[:half], k), self._search_index(vectors[half:], k)
            return np.concatenate([h[0] for h in halves]), np.concatenate([h[1] for h in halves])
