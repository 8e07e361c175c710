"""Load test of the retrieval server: queries/s, latency and server CPU with cross-request batching on and off, and
of the one-request-at-a-time server it replaces (``experiments.searchr1_reference``, Search-R1's behaviour).

Training sends one query per rollout turn from hundreds of rollouts at once, so the load is ``--clients`` concurrent
clients, spread over ``--processes`` load-generator processes, each client posting one request after another for
``--duration_s`` seconds (after ``--warmup_s`` unmeasured seconds); Search-R1-style trainers instead send one request
of ``--queries_per_request`` 64 per turn. Each server in ``--modes`` runs on loopback in turn, over the offline
SQuAD-open corpus, or its first ``--max_passages`` passages: embedding all 30,991 takes ~12 minutes on 2 CPU cores.
The corpus prefix and its index are cached under ``~/.cache/searchr1_trl/index/squad_open-<passages>-<encoder>/``.
Queries are SQuAD dev questions, cycled.

    python -m experiments.retriever_load --clients 64 --duration_s 20 --max_passages 4096
    python -m experiments.retriever_load --clients 8 --queries_per_request 64 --modes on,reference

The load generator shares the machine with the server, so on a small CPU the absolute numbers are lower bounds.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import multiprocessing
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import pandas as pd
import psutil

from experiments.report import report
from retriever_server.launch import RetrieverProcess
from retriever_server.metrics import parse_prometheus
from searchr1_trl.assets.offline import cache_dir, require

REPO = Path(__file__).resolve().parents[1]


@dataclass
class LoadResult:
    mode: str
    requests: int
    errors: int
    elapsed_s: float
    latencies_ms: np.ndarray
    server: dict[str, float]  # the server's /metrics samples at the end, warm-up included ({} for the reference)
    busy_cores: float  # server CPU seconds per second over the measured window
    idle_cores: float  # the same over --idle_s seconds without requests after it

    @property
    def qps(self) -> float:
        return self.requests / self.elapsed_s

    def percentile(self, q: float) -> float:
        return float(np.percentile(self.latencies_ms, q))


def add_index_arguments(parser: argparse.ArgumentParser, assets) -> None:
    """The corpus, encoder and size of the index :func:`prepare_index` builds (defaults: the offline ``assets``)."""
    parser.add_argument("--corpus_path", default=assets.corpus, help="wiki-18-format JSONL (default: SQuAD-open)")
    parser.add_argument("--retriever_model", default=assets.embedder, help="embedding model (default: MiniLM)")
    parser.add_argument("--max_passages", type=int, default=None, help="index only the first N passages")


def prepare_index(corpus_path: str, retriever_model: str, max_passages: int | None, build_flags: list[str]
                  ) -> tuple[Path, Path]:
    """(index, corpus) for the first ``max_passages`` passages, built once per encoder and cached."""
    with open(corpus_path, "rb") as f:
        lines = list(itertools.islice(f, max_passages))
    folder = cache_dir() / "index" / f"squad_open-{len(lines)}-{Path(retriever_model.rstrip('/')).name}"
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


async def run_clients(port: int, questions: list[str], clients: int, first: int, every: int,
                      measure_from: float, stop_at: float, queries_per_request: int, topk: int
                      ) -> tuple[list[float], int]:
    """(latencies in ms of successful requests, errors) of ``clients`` concurrent clients, counting only requests
    sent and answered in the window. Request ``i`` of this process is the ``first + i * every``-th overall, so the
    processes of a run ask different questions."""
    counter = itertools.count()
    latencies: list[float] = []
    errors = 0

    async def client() -> None:
        nonlocal errors
        async with Connection(port, "/retrieve") as connection:
            while (sent := time.monotonic()) < stop_at:
                i = (first + next(counter) * every) * queries_per_request
                queries = [questions[(i + j) % len(questions)] for j in range(queries_per_request)]
                status = await connection.post(json.dumps({"queries": queries, "topk": topk}).encode())
                done = time.monotonic()
                if sent >= measure_from and done <= stop_at:
                    if status == 200:
                        latencies.append((done - sent) * 1000)
                    else:
                        errors += 1

    await asyncio.gather(*(client() for _ in range(clients)))
    return latencies, errors


def _load_process(*args) -> tuple[list[float], int]:
    """One load-generator process: its clients on its own event loop."""
    return asyncio.run(run_clients(*args))


def _ready(_: int) -> None:
    """A no-op task: once every process has run one, all have imported this module and can start at once."""


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process, all its threads included."""
    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


def run_load(port: int, server_pid: int, questions: list[str], args: argparse.Namespace
             ) -> tuple[list[float], int, float, float]:
    """(latencies, errors, server cores busy under load, server cores busy idle afterwards).

    ``--clients`` are spread over ``--processes`` processes: one Python process saturates its core long before the
    server does (~80 QPS). Server CPU is sampled over the measured window and over ``--idle_s`` seconds
    of silence after it, where a server whose threads spin shows up as busy cores.
    """
    processes = min(args.processes, args.clients)
    shares = [args.clients // processes + (p < args.clients % processes) for p in range(processes)]
    with multiprocessing.get_context("spawn").Pool(processes) as pool:
        pool.map(_ready, range(processes), chunksize=1)
        measure_from = time.monotonic() + args.warmup_s
        stop_at = measure_from + args.duration_s
        work = pool.starmap_async(_load_process, [
            (port, questions, share, p, processes, measure_from, stop_at, args.queries_per_request, args.topk)
            for p, share in enumerate(shares)])
        time.sleep(max(0.0, measure_from - time.monotonic()))
        busy_from = cpu_seconds(server_pid)
        time.sleep(max(0.0, stop_at - time.monotonic()))
        busy_cores = (cpu_seconds(server_pid) - busy_from) / args.duration_s
        results = work.get()
    time.sleep(1.0)  # let the last requests finish
    idle_from = cpu_seconds(server_pid)
    time.sleep(args.idle_s)
    idle_cores = (cpu_seconds(server_pid) - idle_from) / args.idle_s
    latencies = [ms for process_latencies, _ in results for ms in process_latencies]
    return latencies, sum(errors for _, errors in results), busy_cores, idle_cores


def bench(mode: str, index: Path, corpus: Path, questions: list[str], threads: list[str], args: argparse.Namespace
          ) -> LoadResult:
    port = args.port
    if mode == "reference":
        module, flags = "experiments.searchr1_reference", threads
    else:
        module = "retriever_server.server"
        flags = ["--batching" if mode == "on" else "--no_batching", "--max_wait_ms", str(args.max_wait_ms), *threads]
        for flag, value in (("--max_batch_size", args.max_batch_size), ("--max_batch_chars", args.max_batch_chars),
                            ("--search_threads", args.search_threads)):
            if value is not None:  # else the server's default for its encoder device
                flags += [flag, str(value)]
    with RetrieverProcess(index_path=str(index), corpus_path=str(corpus), retriever_model=args.retriever_model,
                          port=port, log_file=str(index.parent / f"server-{mode}.log"), extra_args=tuple(flags),
                          module=module) as server:
        latencies, errors, busy, idle = run_load(port, server.process.pid, questions, args)
        metrics = {} if mode == "reference" else parse_prometheus(httpx.get(f"http://127.0.0.1:{port}/metrics").text)
    return LoadResult(mode, len(latencies), errors, args.duration_s, np.asarray(latencies), metrics, busy, idle)


def main(argv: list[str] | None = None) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    assets = require()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_index_arguments(parser, assets)
    parser.add_argument("--clients", type=int, default=64, help="concurrent clients")
    parser.add_argument("--processes", type=int, default=max(1, (os.cpu_count() or 1) // 4),
                        help="load-generator processes the clients are spread over (default: a quarter of the CPUs)")
    parser.add_argument("--duration_s", type=float, default=20.0, help="measured seconds per mode")
    parser.add_argument("--warmup_s", type=float, default=3.0, help="unmeasured seconds before measuring")
    parser.add_argument("--idle_s", type=float, default=3.0, help="seconds of server CPU sampled idle after the load")
    parser.add_argument("--queries_per_request", type=int, default=1, help="queries in each request")
    parser.add_argument("--topk", type=int, default=3, help="documents per query")
    parser.add_argument("--max_batch_size", type=int, default=None,
                        help="server's --max_batch_size (default: the server's, which depends on its encoder device)")
    parser.add_argument("--max_wait_ms", type=float, default=2.0, help="server's --max_wait_ms")
    parser.add_argument("--search_threads", type=int, default=None, help="server's --search_threads")
    parser.add_argument("--max_batch_chars", type=int, default=None,
                        help="server's --max_batch_chars (default: the server's, which depends on its encoder device)")
    parser.add_argument("--cpu_threads", type=int, default=None,
                        help="--cpu_threads of the index builder and servers (default: all cores)")
    parser.add_argument("--modes", default="on,off,reference",
                        help="servers to run, in order: on / off = ours with batching on / off, reference = "
                             "experiments.searchr1_reference (Search-R1's one-request-at-a-time server)")
    parser.add_argument("--port", type=int, default=8790, help="loopback port for the server")
    parser.add_argument("--label", default="", help="what this run measures (written into each JSON row)")
    parser.add_argument("--out", default=None, help="also append one JSON line per mode to this file")
    args = parser.parse_args(argv)
    modes = args.modes.split(",")
    if not set(modes) <= {"on", "off", "reference"}:
        raise ValueError(f"--modes must be a comma-separated subset of on,off,reference, got {args.modes!r}")

    threads = [] if args.cpu_threads is None else ["--cpu_threads", str(args.cpu_threads)]
    index, corpus = prepare_index(args.corpus_path, args.retriever_model, args.max_passages, threads)
    questions = pd.read_parquet(assets.test_questions)["question"].tolist()
    passages = sum(1 for _ in corpus.open("rb"))
    print(f"corpus: {passages} passages; {args.clients} clients in {min(args.processes, args.clients)} processes x "
          f"{args.queries_per_request} query/request, topk={args.topk}, {args.duration_s:.0f}s measured after "
          f"{args.warmup_s:.0f}s warm-up, {os.cpu_count()} CPUs")
    results = {mode: bench(mode, index, corpus, questions, threads, args) for mode in modes}

    print("latency: request sent to response read, at the client; server p50: body read to response built; "
          "cores: server CPU under load / idle after it")
    print(f"{'server':>9} {'requests':>9} {'errors':>6} {'queries/s':>10} {'p50 ms':>8} {'p99 ms':>8} "
          f"{'server p50':>10} {'queries/batch':>13} {'cores':>11}")
    for r in results.values():
        p50_key, batch_key = 'latency_seconds_recent{quantile="0.5"}', 'batch_queries_recent{stat="mean"}'
        server_p50 = f"{r.server[p50_key] * 1000:.1f}" if r.server else "-"
        batch_mean = f"{r.server[batch_key]:.1f}" if r.server else "-"
        print(f"{r.mode:>9} {r.requests:>9} {r.errors:>6} {r.qps * args.queries_per_request:>10.1f} "
              f"{r.percentile(50):>8.1f} {r.percentile(99):>8.1f} {server_p50:>10} {batch_mean:>13} "
              f"{r.busy_cores:>5.2f}/{r.idle_cores:<5.2f}")
    for mode, r in results.items():
        if mode != "reference" and "reference" in results:
            ref = results["reference"]
            print(f"{mode} / reference: queries/s x{r.qps / ref.qps:.2f}, "
                  f"p50 x{r.percentile(50) / ref.percentile(50):.2f}, p99 x{r.percentile(99) / ref.percentile(99):.2f}")
    for r in results.values():
        report({"label": args.label, "server": r.mode, "passages": passages, "clients": args.clients,
                "processes": min(args.processes, args.clients), "queries_per_request": args.queries_per_request,
                "topk": args.topk, "cpus": os.cpu_count(), "cpu_threads": args.cpu_threads, "requests": r.requests,
                "errors": r.errors, "queries_per_s": round(r.qps * args.queries_per_request, 1),
                "p50_ms": round(r.percentile(50), 1), "p99_ms": round(r.percentile(99), 1),
                "server_cores_busy": round(r.busy_cores, 2), "server_cores_idle": round(r.idle_cores, 3)}, args.out)


if __name__ == "__main__":
    main()
