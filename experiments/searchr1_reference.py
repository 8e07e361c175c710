"""The baseline: a one-request-at-a-time retrieval server that behaves as Search-R1's
``search_r1/search/retrieval_server.py`` (PeterGriffinJin/Search-R1), written from that behaviour, over the same
index, corpus and encoder as ours, so a load test compares serving, not models.

What it keeps of that server, each a cost ours avoids:
- a synchronous FastAPI endpoint: every request runs alone on a thread of Starlette's pool (40 threads), with no
  batching across requests, so concurrent requests run their encodes and searches at once on the same cores;
- per request: one encode of its queries, one faiss search, then each document looked up on its own
  (``corpus[int(row)]`` of a ``datasets.Dataset``), the per-query lists built in Python, a per-request progress bar,
  ``torch.cuda.empty_cache()`` after each encode on GPU, and the response encoded by FastAPI's default path
  (a pydantic request model in, ``jsonable_encoder`` out), with uvicorn's access log on;
- the environment as it finds it: OpenMP's default wait policy (threads spin after each parallel region).

The encoder is ours (same tokenizer call, model, pooling and normalisation as Search-R1's for MiniLM/e5), so both
servers return the same documents. ``/health`` exists only so :class:`RetrieverProcess` can wait for it.

    python -m experiments.searchr1_reference --index_path index.faiss --corpus_path corpus.jsonl \\
        --retriever_model models/all-MiniLM-L6-v2 --port 8000
"""

from __future__ import annotations

import argparse

import datasets
import faiss
import torch
import uvicorn
from fastapi import FastAPI
from pydantic import BaseModel
from tqdm import tqdm

from retriever_server.encoder import Encoder, EncoderConfig
from retriever_server.retriever import set_cpu_threads


class QueryRequest(BaseModel):
    queries: list[str]
    topk: int | None = None
    return_scores: bool = False


def create_app(encoder: Encoder, index: faiss.Index, corpus: datasets.Dataset, default_topk: int) -> FastAPI:
    app = FastAPI()

    def batch_search(queries: list[str], k: int) -> tuple[list[list[dict]], list[list[float]]]:
        documents, scores = [], []
        for start in tqdm(range(0, len(queries), 512), desc="Retrieval process: "):
            vectors = encoder.encode_queries(queries[start:start + 512])
            if encoder.device.type == "cuda":
                torch.cuda.empty_cache()
            batch_scores, batch_rows = index.search(vectors, k)
            rows = [row for query_rows in batch_rows.tolist() for row in query_rows]
            found = [corpus[int(row)] for row in rows]
            documents.extend(found[i * k:(i + 1) * k] for i in range(len(batch_rows)))
            scores.extend(batch_scores.tolist())
        return documents, scores

    @app.post("/retrieve")
    def retrieve(request: QueryRequest) -> dict:
        documents, scores = batch_search(request.queries, request.topk or default_topk)
        if not request.return_scores:
            return {"result": documents}
        return {"result": [[{"document": d, "score": s} for d, s in zip(docs, row_scores, strict=True)]
                           for docs, row_scores in zip(documents, scores, strict=True)]}

    @app.get("/health")
    def health() -> dict:
        return {"status": "ok"}

    return app


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--index_path", required=True)
    parser.add_argument("--corpus_path", required=True)
    parser.add_argument("--retriever_model", required=True)
    parser.add_argument("--topk", type=int, default=3)
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--cpu_threads", type=int, default=None, help="torch/faiss CPU threads (default: all cores)")
    args = parser.parse_args(argv)
    set_cpu_threads(args.cpu_threads)
    encoder = Encoder(EncoderConfig(args.retriever_model))
    index = faiss.read_index(args.index_path)
    corpus = datasets.load_dataset("json", data_files=args.corpus_path, split="train")
    uvicorn.run(create_app(encoder, index, corpus, args.topk), host="127.0.0.1", port=args.port)  # access log on


if __name__ == "__main__":
    main()
