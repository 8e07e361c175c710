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

import importlib.util
import logging
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import faiss
import numpy as np
import pyarrow as pa
import pyarrow.json as pa_json
import pyarrow.parquet as pq

from retriever_server.corpus_check import first_bad_line

logger = logging.getLogger(__name__)

INDEX_TYPES = ("flat", "hnsw", "ivfpq")
STAGE1_CHOICES = ("auto", "triton", "torch")


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
    gpu_stage1: str = field(
        default="auto",
        metadata={"help": "Stage 1 of --gpu_backend torch (group maxima of the scores): triton (one fused kernel, the "
                          "scores never stored), torch (cuBLAS matmul, then the maxima) or auto (triton when it "
                          "imports).",
                  "choices": STAGE1_CHOICES},
    )
    cpu_backend: str = field(
        default="torch",
        metadata={"help": "CPU search engine for a flat index: torch (fp32 matmul + top-k on torch's BLAS, over the "
                          "faiss index's own vectors; 5-7x faster than faiss for 64 queries on 2 cores) or faiss.",
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
        if config.cpu_backend == "torch" and isinstance(index, faiss.IndexFlatIP) and index.ntotal:
            return TorchFlatIndex.over_faiss_vectors(index)
        return index
    if isinstance(index, faiss.IndexHNSW):
        raise ValueError(f"{path} is an HNSW index, which faiss cannot search on GPU; drop --faiss_gpu")
    if config.gpu_backend == "torch":
        if not isinstance(index, faiss.IndexFlat):
            raise ValueError(f"{path} is not a flat index; --gpu_backend torch searches flat indexes only")
        return TorchFlatIndex.from_vectors(index.reconstruct_n(0, index.ntotal), stage1=config.gpu_stage1)
    if not hasattr(faiss, "index_cpu_to_all_gpus") or faiss.get_num_gpus() == 0:
        raise RuntimeError("--faiss_gpu needs the faiss-gpu package and at least one visible GPU")
    options = faiss.GpuMultipleClonerOptions()
    options.shard = True
    options.useFloat16 = True
    return faiss.index_cpu_to_all_gpus(index, co=options)


class TorchFlatIndex:
    """Exact inner-product search on every visible GPU: fp16 vectors sharded by rows, searched in two stages per
    shard and merged on the first GPU. Same ``ntotal`` / ``search(x, k) -> (scores, rows)`` interface as faiss. On
    CPU it searches a flat faiss index's fp32 vectors in place, in one stage (``_scan_fp32``).

    1. Group maxima: the maximum score of each group of ``group_rows`` consecutive rows, queries rounded to fp16.
       ``stage1="triton"`` (``flat_kernel.py``): one kernel computes tiles of scores in fp32 registers and writes
       only the maxima, so the cost is the matmul (~16.5 TFLOP at 512 queries over 21M x 768) and one read of the
       index. ``stage1="torch"``: per chunk of rows, fp16 scores by one cuBLAS matmul, then their maxima; at 512
       queries over 21M rows the 21.5 GB of scores are written and read back (49.7 ms on an H200 with groups of
       256, matmul ~21 ms). ``"auto"`` is triton on CUDA when it imports, torch otherwise.
    2. Rescore: the best ``k + rescore_margin`` groups of each query by that maximum; their rows are scored again
       in fp32 (fp32 queries, the stored fp16 vectors widened exactly) and the best k kept, so scores and order are
       those of faiss ``IndexFlatIP`` over the same vectors. Why no row is lost: a row of the true top k whose group
       were outside the best k groups would be beaten by the maximum of each of k groups. Stage-1 scores are off by
       at most e = 2**-11 * |x| * |v| (the query's fp16 rounding; the torch scan adds the fp16 rounding of the
       score): under 5e-4 for unit vectors. Of the groups ranked above a true top-k row, at most k - 1 hold a row
       that beats it, so it is missed only if ``rescore_margin`` + 1 other groups hold a row within 2e of it.

    ``group_rows`` defaults to 64 for the kernel (it writes 1/64 of the scores; smaller groups only make stage 2
    cheaper: 512 x 11 x 64 rows to gather) and 256 for the torch scan (there each chunk's maxima cost a read of all
    its scores, and fewer groups were faster up to 256). The torch scan's chunk is sized so its score matrix holds
    about ``score_bytes``: a single query scans a whole shard in a few matmuls (bound by reading the index, 32 GB
    for 21M x 768), 512 queries in 1M-row chunks (bound by the matmul). ``kernel_config`` fixes the kernel's tile
    config (``flat_kernel.parse_config``; default by batch). Nothing in ``search`` waits for the GPU until the
    final copy of k results per query back to the host.
    """

    def __init__(self, shards: list, score_bytes: int = 1 << 30, group_rows: int | None = None,
                 rescore_margin: int = 8, stage1: str = "auto", kernel_config: str | None = None):
        if stage1 not in STAGE1_CHOICES:
            raise ValueError(f"stage1 must be one of {STAGE1_CHOICES}, got {stage1!r}")
        if stage1 == "auto":
            stage1 = "triton" if shards[0].is_cuda and importlib.util.find_spec("triton") else "torch"
        if stage1 == "triton" and not shards[0].is_cuda and not os.environ.get("TRITON_INTERPRET"):
            raise ValueError(f"stage1='triton' needs CUDA shards (or TRITON_INTERPRET=1), got {shards[0].device}")
        self.shards = shards
        self.offsets = np.cumsum([0] + [len(s) for s in shards])[:-1].tolist()
        self.ntotal = int(sum(len(s) for s in shards))
        self.d = int(shards[0].shape[1])
        self.stage1, self.kernel_config = stage1, kernel_config
        self.group_rows = group_rows or (64 if stage1 == "triton" else 256)
        self.score_bytes, self.rescore_margin = score_bytes, rescore_margin

    @classmethod
    def from_vectors(cls, vectors, devices: list | None = None, dtype=None, **search_options) -> TorchFlatIndex:
        """Shard ``vectors`` (numpy or torch, n x d) row-wise over ``devices`` (default: every visible GPU), stored
        as ``dtype`` (default fp16)."""
        import torch

        devices = devices or [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
        if not devices:
            raise RuntimeError("--gpu_backend torch needs at least one visible GPU")
        vectors = torch.as_tensor(vectors)
        bounds = np.linspace(0, len(vectors), len(devices) + 1).astype(int)
        pieces = zip(bounds[:-1], bounds[1:], devices, strict=True)
        return cls([vectors[a:b].to(device, dtype or torch.float16) for a, b, device in pieces], **search_options)

    @classmethod
    def over_faiss_vectors(cls, index: faiss.IndexFlatIP) -> TorchFlatIndex:
        """CPU search over the fp32 vectors a faiss flat index holds, without copying them (wiki-18: 65 GB)."""
        import torch

        vectors = faiss.rev_swig_ptr(index.get_xb(), index.ntotal * index.d).reshape(index.ntotal, index.d)
        flat = cls([torch.from_numpy(vectors)])
        flat.owner = index  # the memory the vectors live in
        return flat

    def warm_up(self) -> None:
        """Compile the fused kernel's configs now, by one search of each batch range, so no request waits for it.
        Without this the first wiki-scale rollouts on an H200 (2026-12-04) met the compiles: batches of 116 queries
        at 813 ms each against 12 at 73 ms once warm. Nothing to compile for the torch scan."""
        if self.stage1 != "triton":
            return
        from retriever_server.flat_kernel import warm_up_batches

        for batch in warm_up_batches():
            self.search(np.zeros((batch, self.d), dtype=np.float32), 1)

    def chunk_rows(self, batch: int) -> int:
        """Rows scanned per matmul: ~``score_bytes`` of scores, whole groups, and under 2**31 elements per chunk
        (the 32-bit indexing limit of some kernels)."""
        rows = min(self.score_bytes // (self.shards[0].element_size() * batch), (2**31 - 1) // self.d)
        return max(self.group_rows, rows // self.group_rows * self.group_rows)

    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        import torch

        first = self.shards[0].device
        best_scores, best_rows = [], []
        for shard, offset in zip(self.shards, self.offsets, strict=True):
            x = torch.as_tensor(queries, dtype=torch.float32).to(shard.device)
            scores, rows = self._search_shard(shard, x, k)
            best_scores.append(scores.to(first))
            best_rows.append((rows + offset).to(first))
        scores, rows = _best_of(best_scores, best_rows, k)
        rows = rows.masked_fill_(scores == -math.inf, -1)  # faiss's mark for "no row"
        return scores.cpu().numpy(), rows.cpu().numpy()

    def _search_shard(self, shard, x, k: int):
        """The best k (fp32 scores, shard rows) per query in one shard; rows past its end score -inf."""
        import torch

        if shard.dtype == torch.float32:
            return self._scan_fp32(shard, x, k)
        g, n = self.group_rows, len(shard)
        maxima = self.group_maxima(shard, x)
        groups = maxima.topk(min(k + self.rescore_margin, maxima.shape[1]), dim=1).indices
        rows = (groups[:, :, None] * g + torch.arange(g, device=shard.device)).flatten(1)
        outside = rows >= n
        rows = rows.masked_fill_(outside, n - 1)
        # Rescore in blocks of queries so the widened candidates stay within ~score_bytes too.
        per_query = rows.shape[1] * self.d * 6
        block = max(1, self.score_bytes // per_query)
        exact = torch.cat([torch.bmm(shard[rows[a:a + block]].float(), x[a:a + block, :, None]).squeeze(2)
                           for a in range(0, len(x), block)])
        top = exact.masked_fill_(outside, -math.inf).topk(min(k, rows.shape[1]), dim=1)
        return top.values, rows.gather(1, top.indices)

    def group_maxima(self, shard, x):
        """Stage 1: (B, ceil(n / group_rows)) maxima of each group's scores in ``shard`` (the last group may be
        short), by the fused kernel or by the torch scan."""
        if self.stage1 == "triton":
            from retriever_server.flat_kernel import group_maxima

            return group_maxima(x, shard, self.group_rows, self.kernel_config)
        return self._torch_group_maxima(shard, x)

    def _torch_group_maxima(self, shard, x):
        """Stage 1 without Triton: fp16 scores by one matmul per chunk, then their group maxima."""
        import torch

        g, n = self.group_rows, len(shard)
        x_stored = x.to(shard.dtype)
        maxima = torch.empty(len(x), -(-n // g), dtype=shard.dtype, device=shard.device)
        step = self.chunk_rows(len(x))
        for start in range(0, n, step):
            scores = x_stored @ shard[start:start + step].T
            if scores.shape[1] % g:  # the shard's last chunk: pad its last group with scores no row can have
                scores = torch.nn.functional.pad(scores, (0, g - scores.shape[1] % g), value=-math.inf)
            maxima[:, start // g:(start + scores.shape[1]) // g] = scores.view(len(x), -1, g).amax(dim=2)
        return maxima

    def _scan_fp32(self, shard, x, k: int):
        """fp32 vectors (the CPU search): their scores are already exact and a CPU ``topk`` over them is cheap, so
        one matmul + ``topk`` per chunk. 64 queries on 2 cores: 1.1 ms over 4,096 passages (faiss 7.3 ms, the two
        stages 33 ms), 9.3 ms over 31,000 (faiss 51 ms)."""
        best_scores, best_rows = [], []
        step = self.chunk_rows(len(x))
        for start in range(0, len(shard), step):
            top = (x @ shard[start:start + step].T).topk(min(k, len(shard) - start, step), dim=1)
            best_scores.append(top.values)
            best_rows.append(top.indices + start)
        return _best_of(best_scores, best_rows, k)


def _best_of(scores: list, rows: list, k: int):
    """The best k (scores, rows) per query among candidate lists (each ``(B, <=k)``), best first."""
    import torch

    scores, rows = torch.cat(scores, 1), torch.cat(rows, 1)
    top = scores.topk(min(k, scores.shape[1]), dim=1)
    return top.values, rows.gather(1, top.indices)


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
        try:
            # Large blocks so one long passage cannot straddle a block boundary (pyarrow rejects that).
            table = pa_json.read_json(path, read_options=pa_json.ReadOptions(block_size=64 << 20))
            table.validate(full=True)  # the UTF-8 of every string: the reader does not check it
            corpus = cls(table)
        except (pa.ArrowInvalid, ValueError) as error:
            raise ValueError(first_bad_line(path) or f"{path}: {error}") from None
        if corpus.table.column("contents").null_count:  # a line without contents
            raise ValueError(first_bad_line(path) or f"{path}: a passage has no 'contents'")
        return corpus

    def __len__(self) -> int:
        return self.table.num_rows

    def contents_bytes(self, rows: np.ndarray) -> int:
        """The UTF-8 bytes of the rows' ``contents``, from the column's offsets: nothing is read or copied."""
        column = self.table.column("contents")
        if column.num_chunks == 0:
            return 0
        chunk = column.chunk(0)  # one chunk: combine_chunks
        offsets = np.frombuffer(chunk.buffers()[1], dtype=np.int64)[chunk.offset:]
        rows = np.asarray(rows, dtype=np.int64).ravel()
        return int((offsets[rows + 1] - offsets[rows]).sum())

    def take(self, rows: np.ndarray) -> list[dict]:
        """Rows (any shape, flattened) -> their documents as dicts, in order."""
        return self.table.take(pa.array(np.asarray(rows, dtype=np.int64).ravel())).to_pylist()
