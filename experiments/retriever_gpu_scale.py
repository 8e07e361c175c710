"""Wiki-18-scale exact search on GPU through the retrieval server's own search path (``TorchFlatIndex``, what
``--faiss_gpu --gpu_backend torch`` loads): 21M x 768 random normalised fp16 vectors, batches of 1 to 512 queries.
Prints latency, queries/s and the memory-bandwidth floor (index bytes / measured device copy bandwidth) as JSON lines,
one per batch size and implementation:

- ``fused_g<G>`` (``--stage1 triton``): the server's search with stage 1 as one Triton kernel (scores and group
  maxima fused, ``retriever_server/flat_kernel.py``), then fp32 rescoring of the best groups; once per
  ``--group_rows`` and per ``--configs`` tile config (``fused_g64_128x256x64-w8-s3``; none: the default by batch);
- ``two_stage_g<G>`` (``--stage1 torch``): the same search with stage 1 as a cuBLAS matmul per chunk, then maxima;
- ``chunk_topk`` (with ``--compare_old``): the search before both, a full-width ``topk`` per 1M-row chunk.

``stage1_ms`` is the group maxima alone (median, synchronised), the rest of ``latency_ms`` is stage 2 and the merge.
Each row also says whether the first ``--check_queries`` queries got the same rows as a brute-force fp32 scan of the
same vectors (``exact``), so a faster variant cannot trade away exactness unnoticed.

    python -m experiments.retriever_gpu_scale --num_vectors 21000000 --dim 768 --stage1 triton,torch \\
        --out experiments/results/retriever_gpu_scale.jsonl
    python -m experiments.retriever_gpu_scale --batches 512 --stage1 triton --configs 128x256x64-w8-s3,128x128x64-w4-s3
    # smoke tests on CPU (the kernel through Triton's interpreter: slow, keep it small)
    python -m experiments.retriever_gpu_scale --device cpu --num_vectors 200000 --dim 64 --batches 1,64 --stage1 torch
    TRITON_INTERPRET=1 python -m experiments.retriever_gpu_scale --device cpu --num_vectors 4000 --dim 64 \\
        --batches 1,8 --repeats 2 --stage1 triton --configs 16x128x64-w4-s2
"""

import argparse
import time

import numpy as np
import torch

from experiments.report import report
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


def fill_random_unit_rows(out, generator=None):
    """Fill ``out`` (rows x dim, in place) with random unit vectors, 1M rows at a time: fp32 randn of 21M x 768
    would not fit beside them. Returns ``out``."""
    for start in range(0, len(out), 1 << 20):
        block = torch.randn(min(1 << 20, len(out) - start), out.shape[1], device=out.device, generator=generator)
        out[start:start + len(block)] = torch.nn.functional.normalize(block, dim=1).to(out.dtype)
    return out


def random_shards(num_vectors: int, dim: int, devices: list) -> list:
    bounds = np.linspace(0, num_vectors, len(devices) + 1).astype(int)
    return [fill_random_unit_rows(torch.empty(b - a, dim, dtype=torch.float16, device=device))
            for a, b, device in zip(bounds[:-1], bounds[1:], devices, strict=True)]


def chunk_topk_search(shards: list, queries: np.ndarray, k: int, chunk_rows: int = 1 << 20):
    """The search before the two-stage one (main d952a21): fp16 scores and a full-width ``topk`` per chunk."""
    best_scores, best_rows, offset = [], [], 0
    for shard in shards:
        x = torch.as_tensor(queries, device=shard.device).to(torch.float16)
        for start in range(0, len(shard), chunk_rows):
            top = (x @ shard[start:start + chunk_rows].T).topk(k, dim=1)
            best_scores.append(top.values.float().to(shards[0].device))
            best_rows.append((top.indices + offset + start).to(shards[0].device))
        offset += len(shard)
    scores, rows = torch.cat(best_scores, 1), torch.cat(best_rows, 1)
    top = scores.topk(k, dim=1)
    return top.values.cpu().numpy(), rows.gather(1, top.indices).cpu().numpy()


def brute_force_rows(shards: list, queries: np.ndarray, k: int) -> np.ndarray:
    """Top-k rows by fp32 scores of every row, one 1M-row slice at a time: the reference for ``exact``."""
    found_scores, found_rows, offset = [], [], 0
    for shard in shards:
        x = torch.as_tensor(queries, dtype=torch.float32, device=shard.device)
        for start in range(0, len(shard), 1 << 20):
            top = (x @ shard[start:start + (1 << 20)].float().T).topk(k, dim=1)
            found_scores.append(top.values.cpu())
            found_rows.append(top.indices.cpu() + offset + start)
        offset += len(shard)
    scores, rows = torch.cat(found_scores, 1), torch.cat(found_rows, 1)
    return rows.gather(1, scores.topk(k, dim=1).indices).numpy()


def stage1_seconds(index: TorchFlatIndex, queries: np.ndarray, repeats: int) -> float:
    """Median seconds of the group maxima of the first shard (the kernel or the torch scan), synchronised."""
    shard = index.shards[0]
    x = torch.as_tensor(queries, dtype=torch.float32, device=shard.device)
    sync = torch.cuda.synchronize if shard.is_cuda else (lambda: None)
    index.group_maxima(shard, x)
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        index.group_maxima(shard, x)
        sync()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def variants(args, shards: list) -> dict:
    """Name -> TorchFlatIndex for each stage 1, group size and (for the kernel) tile config asked for."""
    indexes = {}
    for stage1 in args.stage1.split(","):
        prefix = {"triton": "fused", "torch": "two_stage"}[stage1]
        for g in args.group_rows.split(",") if args.group_rows else [None]:
            configs = args.configs.split(",") if args.configs and stage1 == "triton" else [None]
            for config in configs:
                index = TorchFlatIndex(shards, group_rows=int(g) if g else None, stage1=stage1, kernel_config=config)
                indexes[f"{prefix}_g{index.group_rows}" + (f"_{config}" if config else "")] = index
    return indexes


def kernel_errors() -> tuple:
    """Triton's errors for a tile config that a GPU cannot compile or fit (none without Triton)."""
    try:
        from triton.runtime import errors
    except ImportError:
        return ()
    return tuple(getattr(errors, name) for name in ("OutOfResources", "PTXASError") if hasattr(errors, name))


def timed(search, queries: np.ndarray, k: int, repeats: int) -> tuple[float, np.ndarray]:
    """Median seconds of ``search`` (it returns numpy: the device sync and copy back are included) and its rows."""
    search(queries, k)  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        _, rows = search(queries, k)
        times.append(time.perf_counter() - start)
    return float(np.median(times)), rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num_vectors", type=int, default=21_000_000)
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument("--topk", type=int, default=3)
    parser.add_argument("--batches", default="1,8,64,512")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--stage1", default="triton,torch", help="TorchFlatIndex stage1 values to measure.")
    parser.add_argument("--group_rows", default=None,
                        help="TorchFlatIndex group_rows to measure, comma-separated; default: each stage 1's own.")
    parser.add_argument("--configs", default=None,
                        help="Kernel tile configs BMxBNxBK-wW-sS to sweep, comma-separated; default: by batch.")
    parser.add_argument("--compare_old", action="store_true", help="Also measure the chunk-topk search it replaced.")
    parser.add_argument("--check_queries", type=int, default=16, help="Queries per batch checked against brute force.")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cuda: every visible GPU.")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    gpus = args.device == "cuda"
    devices = [torch.device("cuda", i) for i in range(torch.cuda.device_count())] if gpus else [torch.device("cpu")]
    bandwidth = copy_bandwidth_gbs(devices[0]) if gpus else None
    shards = random_shards(args.num_vectors, args.dim, devices)
    index_gb = args.num_vectors * args.dim * 2 / 1e9
    floor_ms = index_gb / (bandwidth * len(devices)) * 1e3 if gpus else None
    indexes = variants(args, shards)
    searches = {name: index.search for name, index in indexes.items()}
    if args.compare_old:
        searches["chunk_topk"] = lambda queries, k: chunk_topk_search(shards, queries, k)
    untileable = kernel_errors()
    rng = np.random.default_rng(0)
    for batch in map(int, args.batches.split(",")):
        queries = rng.standard_normal((batch, args.dim)).astype(np.float32)
        queries /= np.linalg.norm(queries, axis=1, keepdims=True)
        checked = min(batch, args.check_queries)
        reference = brute_force_rows(shards, queries[:checked], args.topk)
        for name, search in searches.items():
            if gpus:
                torch.cuda.reset_peak_memory_stats(devices[0])
            try:
                seconds, rows = timed(search, queries, args.topk, args.repeats)
            except untileable as e:  # a swept config this GPU cannot compile or fit: say so, measure the rest
                report({"implementation": name, "batch": batch, "error": f"{type(e).__name__}: {e}"}, args.out)
                continue
            latency_ms = seconds * 1e3
            row = {"implementation": name, "num_vectors": args.num_vectors, "dim": args.dim, "devices": len(devices),
                   "device": args.device, "batch": batch, "latency_ms": round(latency_ms, 2),
                   "queries_per_s": round(batch / seconds), "index_gb_fp16": round(index_gb, 1),
                   "exact": bool((rows[:checked] == reference).all()), "checked_queries": checked}
            if name in indexes:
                index, config = indexes[name], None
                if index.stage1 == "triton":
                    from retriever_server.flat_kernel import config_for  # Triton may be absent for torch-only runs

                    config = index.kernel_config or config_for(batch)
                row |= {"stage1": index.stage1, "group_rows": index.group_rows, "kernel_config": config,
                        "stage1_ms": round(stage1_seconds(index, queries, args.repeats) * 1e3, 2)}
            if gpus:
                peak = torch.cuda.max_memory_allocated(devices[0]) - shards[0].numel() * 2
                row |= {"search_peak_extra_gib": round(peak / 2**30, 2), "copy_bandwidth_gbs": round(bandwidth),
                        "bandwidth_floor_ms": round(floor_ms, 2), "fraction_of_floor": round(floor_ms / latency_ms, 2)}
            report(row, args.out)


if __name__ == "__main__":
    main()
