"""Wiki-18-scale exact search on GPU through the retrieval server's own search path (``TorchFlatIndex``, what
``--faiss_gpu --gpu_backend torch`` loads): 21M x 768 random normalised fp16 vectors, batches of 1 to 512 queries.
Prints latency, queries/s and the memory-bandwidth floor (index bytes / measured device copy bandwidth) as JSON lines.

    python -m benchmarks.retriever_gpu_scale --num_vectors 21000000 --dim 768 \\
        --out docs/results/retriever_gpu_scale.jsonl
"""

import argparse
import time

import numpy as np
import torch

from benchmarks.report import report
from retriever_server.index import TorchFlatIndex


def copy_bandwidth_gbs(device, gib: int = 8) -> float:
    """Device-to-device copy rate, counting bytes read and written (a scan of the index only reads, so this is the
    memory system's total rate, the one a pure read can reach)."""
    src = torch.empty(gib << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(2):
        dst.copy_(src)
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(5):
        dst.copy_(src)
    torch.cuda.synchronize(device)
    return 2 * 5 * src.numel() / (time.perf_counter() - start) / 1e9


def random_index(num_vectors: int, dim: int) -> TorchFlatIndex:
    devices = [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    bounds = np.linspace(0, num_vectors, len(devices) + 1).astype(int)
    shards = []
    for a, b, device in zip(bounds[:-1], bounds[1:], devices, strict=True):
        shard = torch.empty(b - a, dim, dtype=torch.float16, device=device)
        for start in range(0, b - a, 1 << 20):  # generate in chunks: fp32 randn of 21M x 768 would not fit
            block = torch.randn(min(1 << 20, b - a - start), dim, device=device)
            shard[start:start + len(block)] = torch.nn.functional.normalize(block, dim=1).half()
        shards.append(shard)
    return TorchFlatIndex(shards)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num_vectors", type=int, default=21_000_000)
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument("--topk", type=int, default=3)
    parser.add_argument("--batches", default="1,8,64,512")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    bandwidth = copy_bandwidth_gbs(torch.device("cuda", 0))
    index = random_index(args.num_vectors, args.dim)
    index_gb = args.num_vectors * args.dim * 2 / 1e9
    floor_ms = index_gb / (bandwidth * torch.cuda.device_count()) * 1e3
    rng = np.random.default_rng(0)
    for batch in map(int, args.batches.split(",")):
        queries = rng.standard_normal((batch, args.dim)).astype(np.float32)
        queries /= np.linalg.norm(queries, axis=1, keepdims=True)
        index.search(queries, args.topk)  # warm-up
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            index.search(queries, args.topk)  # returns numpy: includes the device sync and copy back
            times.append(time.perf_counter() - start)
        latency_ms = float(np.median(times)) * 1e3
        row = {"num_vectors": args.num_vectors, "dim": args.dim, "gpus": torch.cuda.device_count(), "batch": batch,
               "latency_ms": round(latency_ms, 2), "queries_per_s": round(batch / latency_ms * 1e3),
               "index_gb_fp16": round(index_gb, 1), "copy_bandwidth_gbs": round(bandwidth),
               "bandwidth_floor_ms": round(floor_ms, 2), "fraction_of_floor": round(floor_ms / latency_ms, 2)}
        report(row, args.out)


if __name__ == "__main__":
    main()
