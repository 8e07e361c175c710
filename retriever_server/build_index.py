"""Corpus JSONL -> passage embeddings -> faiss index file, resumable.

Embeddings are written in shards of ``--shard_size`` passages beside the index (``<index_path>.shards/``); a killed
build picks up at the first missing shard, which matters when embedding wiki-18 takes hours. Shards from a different
corpus or encoder are refused, never mixed in. The index row of a passage is its row in the corpus file, which is how
the server maps search results back to documents. A ``<index_path>.json`` sidecar records the encoder (settings,
width, the embedding of a probe passage) and the corpus (passage count, content fingerprint): the server refuses to
start with any other.

    python -m retriever_server.build_index --corpus_path wiki-18.jsonl --retriever_model intfloat/e5-base-v2 \\
        --retriever_name e5 --index_path e5_flat.faiss
"""

from __future__ import annotations

import json
import logging
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import faiss
import numpy as np
from tqdm import tqdm
from transformers import HfArgumentParser

from retriever_server.encoder import Encoder, EncoderConfig
from retriever_server.index import Corpus, IndexConfig, SearchConfig, configure_search, new_index
from retriever_server.retriever import meta_path, set_cpu_threads, sidecar

logger = logging.getLogger(__name__)


@dataclass
class BuildConfig:
    corpus_path: str = field(metadata={"help": "wiki-18-format JSONL ({'id', 'contents'} per line) or Parquet."})
    index_path: str = field(metadata={"help": "Where the faiss index is written."})
    shard_size: int = field(default=8192, metadata={"help": "Passages per embedding shard (the unit of resuming)."})
    keep_embeddings: bool = field(default=False, metadata={"help": "Keep the embedding shards after the build."})
    ivf_train_size: int = field(default=500_000, metadata={"help": "Vectors sampled to train IVF-PQ."})
    sanity_samples: int = field(default=1000, metadata={"help": "Passages searched for themselves after the build."})
    cpu_threads: int | None = field(default=None, metadata={"help": "torch/faiss CPU threads (default: all cores)."})


def shards_dir(index_path: str) -> Path:
    return Path(f"{index_path}.shards")


def embed_corpus(corpus: Corpus, encoder: Encoder, config: BuildConfig) -> list[Path]:
    """Write any missing embedding shard; returns every shard's path in corpus order."""
    folder = shards_dir(config.index_path)
    folder.mkdir(parents=True, exist_ok=True)
    manifest = {"corpus_path": str(Path(config.corpus_path).resolve()), "passages": len(corpus),
                "shard_size": config.shard_size, "encoder": encoder.config.fingerprint()}
    manifest_file = folder / "manifest.json"
    if manifest_file.exists() and json.loads(manifest_file.read_text()) != manifest:
        raise RuntimeError(
            f"{folder} holds shards of another build ({manifest_file.read_text()}); delete it or change --index_path"
        )
    manifest_file.write_text(json.dumps(manifest, indent=2))

    contents = corpus.table.column("contents")
    starts = range(0, len(corpus), config.shard_size)
    paths = [folder / f"shard_{i:06d}.npy" for i in range(len(starts))]
    done = sum(min(config.shard_size, len(corpus) - s) for s, p in zip(starts, paths, strict=True) if p.exists())
    if done:
        logger.info("resuming: %d of %d passages already embedded in %s", done, len(corpus), folder)
    # Several forward passes per call: long enough to sort by length, short enough for a lively progress bar.
    step = encoder.batch_size * 8
    with tqdm(total=len(corpus), initial=done, unit="passage", desc="embedding", mininterval=5) as progress:
        for start, path in zip(starts, paths, strict=True):
            if path.exists():
                continue
            texts = contents.slice(start, config.shard_size).to_pylist()
            vectors = np.empty((len(texts), encoder.dim), dtype=np.float32)
            for i in range(0, len(texts), step):
                vectors[i:i + step] = encoder.encode_passages(texts[i:i + step])
                progress.update(len(texts[i:i + step]))
            # Write then rename, so a shard that exists is always complete.
            tmp = path.with_suffix(".tmp.npy")
            np.save(tmp, vectors)
            tmp.rename(path)
    return paths


def index_shards(paths: list[Path], dim: int, total: int, index_config: IndexConfig, train_size: int) -> faiss.Index:
    """Add the shards to a new index one at a time, so at most one shard plus the index is in memory."""
    index = new_index(dim, total, index_config)
    if not index.is_trained:
        rng = np.random.default_rng(0)
        fraction = min(1.0, train_size / total)
        sample = []
        for path in paths:
            vectors = np.load(path)
            sample.append(vectors[rng.random(len(vectors)) < fraction])
        sample = np.concatenate(sample)
        logger.info("training %s on %d vectors", index_config.index_type, len(sample))
        index.train(sample)
    for path in tqdm(paths, desc="indexing", unit="shard", mininterval=5):
        index.add(np.load(path))
    return index


def self_retrieval(index: faiss.Index, paths: list[Path], shard_size: int, samples: int) -> tuple[float, int]:
    """Fraction of sampled passages whose own vector finds them at rank 1, searched with the server's defaults.

    A wrong row order shows as ~0; a lossy index (IVF-PQ) or duplicate passages as somewhat below 1.
    """
    total = index.ntotal
    rows = np.unique(np.linspace(0, total - 1, num=min(samples, total)).astype(np.int64))
    vectors = np.concatenate([np.load(paths[r // shard_size], mmap_mode="r")[r % shard_size][None] for r in rows])
    _, found = configure_search(index, SearchConfig()).search(vectors, 1)
    return float((found[:, 0] == rows).mean()), len(rows)


def build(config: BuildConfig, encoder_config: EncoderConfig, index_config: IndexConfig) -> None:
    set_cpu_threads(config.cpu_threads)
    start = time.monotonic()
    corpus = Corpus.load(config.corpus_path)
    encoder = Encoder(encoder_config)
    logger.info("corpus: %d passages from %s; encoder: %s (%d dims) on %s", len(corpus), config.corpus_path,
                encoder_config.retriever_model, encoder.dim, encoder.device)
    paths = embed_corpus(corpus, encoder, config)
    embedded = time.monotonic()
    index = index_shards(paths, encoder.dim, len(corpus), index_config, config.ivf_train_size)
    tmp = f"{config.index_path}.tmp"
    faiss.write_index(index, tmp)
    Path(tmp).rename(config.index_path)
    meta_path(config.index_path).write_text(json.dumps(
        sidecar(encoder, corpus, config.corpus_path, asdict(index_config)), indent=2))
    indexed = time.monotonic()
    accuracy, sampled = self_retrieval(index, paths, config.shard_size, config.sanity_samples)
    if not config.keep_embeddings:
        shutil.rmtree(shards_dir(config.index_path))
    print(f"built {config.index_path}: {len(corpus)} passages, {index_config.index_type}, "
          f"embedding {embedded - start:.1f}s + indexing {indexed - embedded:.1f}s = {indexed - start:.1f}s")
    print(f"self-retrieval@1: {accuracy:.3f} on {sampled} sampled passages")
    if accuracy < 0.9:
        logger.warning("self-retrieval@1 is %.3f; expected ~1.0 for flat/hnsw (duplicates or a lossy index lower it)",
                       accuracy)


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="[build_index] %(message)s")
    parser = HfArgumentParser([BuildConfig, EncoderConfig, IndexConfig], description=__doc__)
    try:
        build(*parser.parse_args_into_dataclasses(args=argv))
    except (ValueError, OSError) as error:  # a bad corpus or path: which file, which line, in one line
        sys.exit("error: " + " ".join(str(error).split()))


if __name__ == "__main__":
    main()
