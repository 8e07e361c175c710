"""Load test of the retrieval server: QPS and latency with cross-request batching on and off.

Training sends one query per rollout turn from hundreds of rollouts at once, so the load is ``--clients`` concurrent
clients, each posting one request after another for ``--duration_s`` seconds (after ``--warmup_s`` unmeasured
seconds). The server runs on loopback, once with ``--batching`` and once with ``--no_batching``, over the offline
SQuAD-open corpus, or its first ``--max_passages`` passages: embedding all 30,991 takes ~12 minutes on 2 CPU cores.
The corpus prefix and its index are cached under ``~/.cache/searchr1_trl/index/squad_open-<passages>/``. Queries are
SQuAD dev questions, cycled.

    python -m benchmarks.retriever_load --clients 64 --duration_s 20 --max_passages 4096

The load generator shares the machine with the server, so on a small CPU the absolute numbers are lower bounds.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import pandas as pd

from retriever_server.launch import RetrieverProcess
from retriever_server.metrics import parse_prometheus
from searchr1_trl.assets import cache_dir, require

REPO = Path(__file__).resolve().parents[1]


@dataclass
class LoadResult:
    mode: str
    requests: int
    errors: int
    elapsed_s: float
    latencies_ms: np.ndarray
    server: dict[str, float]  # the server's /metrics samples at the end, warm-up included

    @property
    def qps(self) -> float:
        return self.requests / self.elapsed_s

    def percentile(self, q: float) -> float:
        return float(np.percentile(self.latencies_ms, q))


def prepare_index(corpus_path: str, retriever_model: str, max_passages: int | None, build_flags: list[str]
                  ) -> tuple[Path, Path]:
    """(index, corpus) for the first ``max_passages`` passages, built once and cached."""
    with open(corpus_path, "rb") as f:
        lines = list(itertools.islice(f, max_passages))
    folder = cache_dir() / "index" / f"squad_open-{len(lines)}"
    folder.mkdir(parents=True, exist_ok=True)
    corpus, index = folder / "corpus.jsonl", folder / "index.faiss"
    if not corpus.exists():
        corpus.write_bytes(b"".join(lines))
    if not index.exists():
        print(f"building the index of {len(lines)} passages in {folder} (resumable)", flush=True)
        subprocess.run([sys.executable, "-m", "retriever_server.build_index", "--corpus_path", str(corpus),
                        "--retriever_model", retriever_model, "--index_path", str(index), *build_flags],
                       check=True, cwd=REPO)
    return index, corpus


class Connection:
    """One keep-alive HTTP/1.1 connection that speaks just enough HTTP for ``POST /retrieve``.

    A full client (httpx) spends about as much CPU per request as the server does; on a 2-core machine the load
    generator would then be what is measured.
    """

    def __init__(self, port: int, path: str):
        self.port, self.path = port, path

    async def __aenter__(self) -> Connection:
        self.reader, self.writer = await asyncio.open_connection("127.0.0.1", self.port)
        return self

    async def __aexit__(self, *_) -> None:
        self.writer.close()

    async def post(self, body: bytes) -> int:
        """Send one request and read the whole response; returns the status code."""
        head = (f"POST {self.path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n").encode()
        self.writer.write(head + body)
        response = await self.reader.readuntil(b"\r\n\r\n")
        length = next(int(line.split(b":", 1)[1]) for line in response.split(b"\r\n")
                      if line.lower().startswith(b"content-length:"))
        await self.reader.readexactly(length)
        return int(response[9:12])


async def run_load(port: int, questions: list[str], args: argparse.Namespace) -> tuple[list[float], int]:
    """(latencies in ms of successful requests, errors), counting only requests sent and answered in the window."""
    counter = itertools.count()
    latencies: list[float] = []
    errors = 0
    measure_from = time.monotonic() + args.warmup_s
    stop_at = measure_from + args.duration_s

    async def client() -> None:
        nonlocal errors
        async with Connection(port, "/retrieve") as connection:
            while (sent := time.monotonic()) < stop_at:
                i = next(counter) * args.queries_per_request
                queries = [questions[(i + j) % len(questions)] for j in range(args.queries_per_request)]
                status = await connection.post(json.dumps({"queries": queries, "topk": args.topk}).encode())
                done = time.monotonic()
                if sent >= measure_from and done <= stop_at:
                    if status == 200:
                        latencies.append((done - sent) * 1000)
                    else:
                        errors += 1

    await asyncio.gather(*(client() for _ in range(args.clients)))
    return latencies, errors


def bench(mode: str, index: Path, corpus: Path, questions: list[str], threads: list[str], args: argparse.Namespace
          ) -> LoadResult:
    port = args.port
    flags = ["--batching" if mode == "on" else "--no_batching", "--max_batch_size", str(args.max_batch_size),
             "--max_wait_ms", str(args.max_wait_ms), *threads]
    with RetrieverProcess(index_path=str(index), corpus_path=str(corpus), retriever_model=args.retriever_model,
                          port=port, log_file=str(index.parent / f"server-{mode}.log"), extra_args=tuple(flags)):
        latencies, errors = asyncio.run(run_load(port, questions, args))
        server = parse_prometheus(httpx.get(f"http://127.0.0.1:{port}/metrics").text)
    return LoadResult(mode, len(latencies), errors, args.duration_s, np.asarray(latencies), server)


def main(argv: list[str] | None = None) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    assets = require()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus_path", default=assets.corpus, help="wiki-18-format JSONL (default: SQuAD-open)")
    parser.add_argument("--retriever_model", default=assets.embedder, help="embedding model (default: MiniLM)")
    parser.add_argument("--max_passages", type=int, default=None, help="index only the first N passages")
    parser.add_argument("--clients", type=int, default=64, help="concurrent clients")
    parser.add_argument("--duration_s", type=float, default=20.0, help="measured seconds per mode")
    parser.add_argument("--warmup_s", type=float, default=3.0, help="unmeasured seconds before measuring")
    parser.add_argument("--queries_per_request", type=int, default=1, help="queries in each request")
    parser.add_argument("--topk", type=int, default=3, help="documents per query")
    parser.add_argument("--max_batch_size", type=int, default=256, help="server's --max_batch_size")
    parser.add_argument("--max_wait_ms", type=float, default=2.0, help="server's --max_wait_ms")
    parser.add_argument("--cpu_threads", type=int, default=None,
                        help="--cpu_threads of the index builder and server (default: all cores)")
    parser.add_argument("--modes", default="on,off", help="batching modes to run, in order")
    parser.add_argument("--port", type=int, default=8790, help="loopback port for the server")
    args = parser.parse_args(argv)

    threads = [] if args.cpu_threads is None else ["--cpu_threads", str(args.cpu_threads)]
    index, corpus = prepare_index(args.corpus_path, args.retriever_model, args.max_passages, threads)
    questions = pd.read_parquet(assets.test_questions)["question"].tolist()
    passages = sum(1 for _ in corpus.open("rb"))
    print(f"corpus: {passages} passages; {args.clients} clients x {args.queries_per_request} query/request, "
          f"topk={args.topk}, {args.duration_s:.0f}s measured after {args.warmup_s:.0f}s warm-up, "
          f"{os.cpu_count()} CPUs")
    results = {mode: bench(mode, index, corpus, questions, threads, args) for mode in args.modes.split(",")}

    print("latency: request sent to response read, at the client; server p50: body read to response built")
    print(f"{'batching':>8} {'requests':>9} {'errors':>6} {'QPS':>8} {'p50 ms':>8} {'p99 ms':>8} {'server p50':>10} "
          f"{'queries/batch':>13}")
    for r in results.values():
        server_p50_ms = r.server['latency_seconds_recent{quantile="0.5"}'] * 1000
        batch_mean = r.server['batch_queries_recent{stat="mean"}']
        print(f"{r.mode:>8} {r.requests:>9} {r.errors:>6} {r.qps:>8.1f} {r.percentile(50):>8.1f} "
              f"{r.percentile(99):>8.1f} {server_p50_ms:>10.1f} {batch_mean:>13.1f}")
    if {"on", "off"} <= results.keys():
        on, off = results["on"], results["off"]
        print(f"batching on/off: QPS x{on.qps / off.qps:.2f}, "
              f"p50 latency x{on.percentile(50) / off.percentile(50):.2f}, "
              f"p99 latency x{on.percentile(99) / off.percentile(99):.2f}")


if __name__ == "__main__":
    main()
