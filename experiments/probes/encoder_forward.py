"""Seconds the retriever's encoder takes per batch by how its texts are split into forward passes: why a CPU forward
holds at most 4,096 padded characters (``EncoderConfig.max_forward_chars``) and why long texts get passes of their
own (``encoder.forward_groups``). A forward pads every text to its longest; on a CPU big forwards are slow as well.

    python -m experiments.probes.encoder_forward --max_forward_chars 0 8192 4096 2048 1024

Prints, per budget (0: unbounded, as before; long texts still get passes of their own), the mean of two encodes
of: 64 and 256 SQuAD dev questions, the first 114 passages of the offline corpus (about what the CPU main job
indexes) and 60 questions beside 4 queries of ~935 characters (the heavy client of tests/test_reliability_server.py).
"""

from __future__ import annotations

import argparse
import itertools
import json
import time

import pandas as pd

from retriever_server.encoder import Encoder, EncoderConfig
from searchr1_trl.assets.offline import require


def seconds(encode, texts: list[str]) -> float:
    encode(texts)  # warm-up
    start = time.perf_counter()
    encode(texts)
    encode(texts)
    return (time.perf_counter() - start) / 2


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max_forward_chars", type=int, nargs="+", default=[0, 4096])
    args = parser.parse_args(argv)
    assets = require()
    questions = pd.read_parquet(assets.test_questions)["question"].tolist()[:256]
    with open(assets.corpus) as f:
        passages = [json.loads(line)["contents"] for line in itertools.islice(f, 114)]
    heavy = [f"{i} " + "long query about the history of the Amazon rainforest " * 17 for i in range(4)]
    for budget in args.max_forward_chars:
        encoder = Encoder(EncoderConfig(retriever_model=assets.embedder, device="cpu"))
        encoder.max_forward_chars = budget or None
        row = {"max_forward_chars": budget or None,
               "64 questions": seconds(encoder.encode_queries, questions[:64]),
               "256 questions": seconds(encoder.encode_queries, questions),
               "114 passages": seconds(encoder.encode_passages, passages),
               "60 questions + 4 long": seconds(encoder.encode_queries, questions[:60] + heavy)}
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}), flush=True)


if __name__ == "__main__":
    main()
