"""The retrieval server with its index padded to wiki-18's size by random vectors: search costs what it costs over
21M x 768 fp16 (the scan that dominates it reads every row), while the answers stay those of the real index.

Speed benchmarks need wiki-18's search latency behind the real server (issue: TRL's tool loop awaits each sample's
searches one after another, our engine overlaps them), but the offline corpus is 31k passages and its MiniLM vectors
are 384-wide. Padding keeps the answers: the real vectors take the first rows, widened with zeros to ``pad_to_dim``
(the queries likewise, so every real inner product is unchanged); the rest are random unit vectors, whose inner
product with a unit query is about N(0, 1/dim) (over 21M rows at 768 the largest is near 0.2, below the real top-3
cosines of almost every question). A random row that still makes a top-k is answered with the real passage at
``row % passages``, so nothing fails; it only returns a weaker passage. On CUDA the rows are fp16 on the GPU, searched
as ``--faiss_gpu --gpu_backend torch`` searches; elsewhere fp32.

Takes the server's flags plus the ``PadConfig`` ones; ``RetrieverProcess(module="experiments.padded_retriever")``
starts it (``experiments/rollout_throughput.py --pad_index_rows``):

    python -m experiments.padded_retriever --index_path runs/index.faiss --corpus_path corpus.jsonl \\
        --retriever_model $SEARCHR1_CACHE/models/all-MiniLM-L6-v2 --pad_to_rows 21000000 --pad_to_dim 768
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import numpy as np
import torch
from transformers import HfArgumentParser

from experiments.retriever_gpu_scale import fill_random_unit_rows
from retriever_server import server
from retriever_server.index import Corpus, TorchFlatIndex
from retriever_server.retriever import Retriever


@dataclass
class PadConfig:
    pad_to_rows: int = field(default=21_000_000, metadata={"help": "Index rows after padding (wiki-18: 21M)."})
    pad_to_dim: int = field(default=768, metadata={"help": "Vector width after padding (e5-base-v2: 768)."})
    pad_seed: int = field(default=0, metadata={"help": "Seed of the random rows."})
    pad_device: str | None = field(default=None, metadata={"help": "Where the rows live; default cuda if available."})


class PaddedEncoder:
    """The real encoder, its query vectors widened with zeros to ``dim``."""

    def __init__(self, encoder, dim: int):
        self.encoder, self.dim, self.device = encoder, dim, encoder.device

    def encode_queries(self, queries: list[str]) -> np.ndarray:
        vectors = self.encoder.encode_queries(queries)
        return np.pad(vectors, ((0, 0), (0, self.dim - vectors.shape[1])))


class PaddedCorpus(Corpus):
    """``rows`` rows: the real passages, then row ``r`` answered with passage ``r % passages``."""

    def __init__(self, corpus: Corpus, rows: int):
        self.table, self.rows, self.passages = corpus.table, rows, len(corpus)

    def __len__(self) -> int:
        return self.rows

    def take(self, rows: np.ndarray) -> list[dict]:
        return super().take(np.asarray(rows, dtype=np.int64) % self.passages)


def pad_retriever(retriever: Retriever, config: PadConfig) -> Retriever:
    """``retriever`` over ``config.pad_to_rows`` x ``config.pad_to_dim`` vectors, answering as before (module doc)."""
    if not isinstance(retriever.index, TorchFlatIndex):
        raise ValueError(f"padding needs a flat index searched by torch, got {type(retriever.index).__name__}: "
                         "serve a flat index without --faiss_gpu (the padded rows go to pad_device themselves)")
    real = torch.cat([shard.float().cpu() for shard in retriever.index.shards])
    if config.pad_to_rows < len(real) or config.pad_to_dim < real.shape[1]:
        raise ValueError(f"pad_to_rows x pad_to_dim = {config.pad_to_rows} x {config.pad_to_dim} is smaller than the "
                         f"real index ({len(real)} x {real.shape[1]}): padding only adds rows and width")
    device = torch.device(config.pad_device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    vectors = torch.empty(config.pad_to_rows, config.pad_to_dim, dtype=dtype, device=device)
    vectors[:len(real)] = torch.nn.functional.pad(real, (0, config.pad_to_dim - real.shape[1])).to(device, dtype)
    fill_random_unit_rows(vectors[len(real):], torch.Generator(device).manual_seed(config.pad_seed))
    index = TorchFlatIndex([vectors])
    return Retriever(PaddedEncoder(retriever.encoder, config.pad_to_dim), index,
                     PaddedCorpus(retriever.corpus, config.pad_to_rows))


def main(argv: list[str] | None = None) -> None:
    pad, rest = HfArgumentParser(PadConfig).parse_args_into_dataclasses(args=argv, return_remaining_strings=True)
    server.main(rest, adapt=lambda retriever: pad_retriever(retriever, pad))


if __name__ == "__main__":
    main(sys.argv[1:])
