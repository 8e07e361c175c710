"""The faiss index and the passage store: where vectors become row numbers and row numbers become documents.

Index types (all inner product over normalised vectors, i.e. cosine):
- ``flat`` (default): exact search. Search-R1's own wiki-18 index is this with e5-base.
- ``hnsw``: graph search, sub-linear on CPU, about the same memory as flat; faiss cannot run it on GPU.
- ``ivfpq``: inverted lists of product-quantised codes; ~60x smaller than flat at a small recall cost.

Memory for wiki-18 (21M passages) with a 768-dim model such as e5-base-v2:
- flat: 21M x 768 x 4 B = 65 GB in RAM; with ``--faiss_gpu`` it is fp16 and sharded, 32 GB split over the GPUs.
- hnsw (M=32): 65 GB of vectors + ~5 GB of graph links.
- ivfpq (PQ64x8): 64 B codes + 8 B ids per passage = 1.5 GB.
- passages: wiki-18's ``contents`` is ~13 GB of UTF-8 held in Arrow buffers plus 8 B of offsets per row per column
  (~0.3 GB); Python objects are created only for the k documents a batch returns.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from pathlib import Path

import faiss
import numpy as np
import pyarrow as pa
import pyarrow.json as pa_json
import pyarrow.parquet as pq

logger = logging.getLogger(__name__)

INDEX_TYPES = ("flat", "hnsw", "ivfpq")


@dataclass
class IndexConfig:
    """How vectors are indexed; fixed once the index file is written."""

    index_type: str = field(default="flat", metadata={"help": "flat (exact), hnsw or ivfpq.", "choices": INDEX_TYPES})
    hnsw_m: int = field(default=32, metadata={"help": "HNSW neighbours per node."})
    hnsw_ef_construction: int = field(default=200, metadata={"help": "HNSW build beam width."})
    ivf_nlist: int | None = field(default=None, metadata={"help": "IVF lists; default 4*sqrt(passages)."})
    pq_m: int = field(default=64, metadata={"help": "PQ sub-quantisers (bytes per vector); must divide the dim."})

    def __post_init__(self) -> None:
        if self.index_type not in INDEX_TYPES:
            raise ValueError(f"index_type must be one of {INDEX_TYPES}, got {self.index_type!r}")


@dataclass
class SearchConfig:
    """How a loaded index is searched; can change at every server start."""

    hnsw_ef_search: int = field(default=128, metadata={"help": "HNSW search beam width; higher = better recall."})
    ivf_nprobe: int = field(default=64, metadata={"help": "IVF lists visited per query; higher = better recall."})
    faiss_gpu: bool = field(default=False, metadata={"help": "Search on all visible GPUs (fp16, sharded)."})
    gpu_backend: str = field(
        default="faiss",
        metadata={"help": "GPU search engine for a flat index: faiss (needs faiss-gpu) or torch (exact fp16 matmul "
                          "+ top-k in PyTorch, for CUDA versions faiss-gpu wheels do not cover).",
                  "choices": ("faiss", "torch")},
    )


def new_index(dim: int, num_vectors: int, config: IndexConfig) -> faiss.Index:
    """An empty index of the configured type (IVF-PQ still needs ``train``)."""
    if config.index_type == "flat":
        return faiss.IndexFlatIP(dim)
    if config.index_type == "hnsw":
        index = faiss.IndexHNSWFlat(dim, config.hnsw_m, faiss.METRIC_INNER_PRODUCT)
        index.hnsw.efConstruction = config.hnsw_ef_construction
        return index
    if dim % config.pq_m:
        raise ValueError(f"pq_m must divide the embedding dim {dim}, got {config.pq_m}")
    nlist = config.ivf_nlist or max(1, int(4 * math.sqrt(num_vectors)))
    index = faiss.index_factory(dim, f"IVF{nlist},PQ{config.pq_m}x8", faiss.METRIC_INNER_PRODUCT)
    # Polysemous training only serves Hamming-filtered search, which we never use, and it dominates training time.
    index.do_polysemous_training = False
    return index


def configure_search(index: faiss.Index, config: SearchConfig) -> faiss.Index:
    """Apply the search-time settings of a CPU index (in place); returns it."""
    if isinstance(index, faiss.IndexHNSW):
        index.hnsw.efSearch = config.hnsw_ef_search
    ivf = faiss.try_extract_index_ivf(index)
    if ivf is not None:
        ivf.nprobe = config.ivf_nprobe
    return index


def load_index(path: str, config: SearchConfig) -> faiss.Index:
    """Read an index file and apply the search-time settings, moving it to the GPUs if asked."""
    index = configure_search(faiss.read_index(path), config)
    if not config.faiss_gpu:
        return index
    if isinstance(index, faiss.IndexHNSW):
        raise ValueError(f"{path} is an HNSW index, which faiss cannot search on GPU; drop --faiss_gpu")
    if config.gpu_backend == "torch":
        if not isinstance(index, faiss.IndexFlat):
            raise ValueError(f"{path} is not a flat index; --gpu_backend torch searches flat indexes only")
        return TorchFlatIndex.from_vectors(index.reconstruct_n(0, index.ntotal))
    if not hasattr(faiss, "index_cpu_to_all_gpus") or faiss.get_num_gpus() == 0:
        raise RuntimeError("--faiss_gpu needs the faiss-gpu package and at least one visible GPU")
    options = faiss.GpuMultipleClonerOptions()
    options.shard = True
    options.useFloat16 = True
    return faiss.index_cpu_to_all_gpus(index, co=options)


class TorchFlatIndex:
    """Exact inner-product search on every visible GPU: fp16 vectors sharded by rows, one matmul + top-k per shard
    chunk, merged on the first GPU. Same ``ntotal`` / ``search(x, k) -> (scores, rows)`` interface as faiss.

    Per batch it reads the whole index once, so small batches are bound by memory bandwidth (21M x 768 fp16 =
    32 GB per pass) and large ones by matmul throughput; chunking keeps the score matrix small.
    """

    def __init__(self, shards: list, chunk_rows: int = 1 << 20):
        self.shards = shards
        self.offsets = np.cumsum([0] + [len(s) for s in shards])[:-1].tolist()
        self.ntotal = int(sum(len(s) for s in shards))
        self.d = int(shards[0].shape[1])
        self.chunk_rows = chunk_rows

    @classmethod
    def from_vectors(cls, vectors, devices: list | None = None) -> TorchFlatIndex:
        """Shard ``vectors`` (numpy or torch, n x d) row-wise over ``devices`` (default: every visible GPU)."""
        import torch

        devices = devices or [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
        if not devices:
            raise RuntimeError("--gpu_backend torch needs at least one visible GPU")
        vectors = torch.as_tensor(vectors)
        bounds = np.linspace(0, len(vectors), len(devices) + 1).astype(int)
        pieces = zip(bounds[:-1], bounds[1:], devices, strict=True)
        return cls([vectors[a:b].to(device, torch.float16) for a, b, device in pieces])

    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        import torch

        best_scores, best_rows = [], []
        for shard, offset in zip(self.shards, self.offsets, strict=True):
            x = torch.as_tensor(queries, device=shard.device).to(torch.float16)
            for start in range(0, len(shard), self.chunk_rows):
                scores = x @ shard[start:start + self.chunk_rows].T
                top = scores.topk(min(k, scores.shape[1]), dim=1)
                best_scores.append(top.values.float().to(self.shards[0].device))
                best_rows.append((top.indices + offset + start).to(self.shards[0].device))
        scores, rows = torch.cat(best_scores, 1), torch.cat(best_rows, 1)
        top = scores.topk(min(k, scores.shape[1]), dim=1)
        return top.values.cpu().numpy(), rows.gather(1, top.indices).cpu().numpy()


class Corpus:
    """Passages in Arrow columns, so a batch's top-k documents come out of one vectorised ``take``.

    Every column of the source rows is kept and returned (wiki-18 has ``id`` and ``contents``), as Search-R1 does.
    """

    def __init__(self, table: pa.Table):
        if "contents" not in table.column_names:
            raise ValueError(f"corpus needs a 'contents' column, got columns {table.column_names}")
        # 64-bit offsets: wiki-18's text is far over the 2 GB a single 32-bit-offset string array can address.
        large = pa.schema([f.with_type(pa.large_string()) if f.type == pa.string() else f for f in table.schema])
        self.table = table.cast(large).combine_chunks()

    @classmethod
    def load(cls, path: str) -> Corpus:
        """Read wiki-18-format JSONL (one ``{"id", "contents"}`` per line) or a Parquet file with those columns."""
        if Path(path).suffix == ".parquet":
            return cls(pq.read_table(path))
        # Large blocks so one long passage cannot straddle a block boundary (pyarrow rejects that).
        return cls(pa_json.read_json(path, read_options=pa_json.ReadOptions(block_size=64 << 20)))

    def __len__(self) -> int:
        return self.table.num_rows

    def take(self, rows: np.ndarray) -> list[dict]:
        """Rows (any shape, flattened) -> their documents as dicts, in order."""
        return self.table.take(pa.array(np.asarray(rows, dtype=np.int64).ravel())).to_pylist()
