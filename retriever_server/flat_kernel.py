"""Stage 1 of the GPU flat search as one Triton kernel: scores and group maxima fused, the scores never stored.

Each program computes the scores of a tile of ``BLOCK_M`` queries x ``BLOCK_N`` index rows in fp32 registers (fp16
operands, fp32 accumulation over the embedding dim) and writes only the maximum of each group of ``group``
consecutive rows: ``BLOCK_N / group`` numbers per query instead of ``BLOCK_N``. The torch scan it replaces writes
512 x 21M fp16 scores (21.5 GB) and reads them back for the maxima at batch 512 over wiki-18; here stage 1 moves
the index once (32 GB) and the maxima (1/``group`` of the scores), so what is left is the matmul itself.

Tile sizes are chosen by batch (``config_for``), not by ``triton.autotune``: autotuning runs every config on the
whole 21M-row index for each new batch size a server sees; ``experiments/retriever_gpu_scale.py --configs`` sweeps
them once instead. A config is written ``BMxBNxBK-wW-sS`` (tile sizes, warps, pipeline stages).
"""

from __future__ import annotations

import contextlib
import math

import torch
import triton
import triton.language as tl

# Largest batch each config is for -> config. Small batches read the index (memory bound: a narrow query tile,
# wide row tiles); large ones are matmul bound (Hopper's 128 x 256 wgmma tile, 8 warps).
CONFIGS_BY_BATCH = ((16, "16x256x64-w4-s4"), (64, "64x256x64-w8-s4"), (math.inf, "128x256x64-w8-s3"))


def parse_config(text: str) -> dict:
    """``"128x256x64-w8-s3"`` -> ``{"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "num_warps": 8,
    "num_stages": 3}``."""
    try:
        tiles, warps, stages = text.split("-")
        block_m, block_n, block_k = (int(t) for t in tiles.split("x"))
        if warps[0] != "w" or stages[0] != "s":
            raise ValueError
        config = {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k,
                  "num_warps": int(warps[1:]), "num_stages": int(stages[1:])}
    except ValueError:
        raise ValueError(f"a kernel config is written BMxBNxBK-wW-sS, e.g. 128x256x64-w8-s3; got {text!r}") from None
    if any(v < 16 or v & (v - 1) for v in (block_m, block_n, block_k)):
        raise ValueError(f"tile sizes must be powers of two >= 16 (tl.dot's minimum), got {text!r}")
    return config


def config_for(batch: int) -> str:
    """The default config for a batch of ``batch`` queries."""
    return next(config for limit, config in CONFIGS_BY_BATCH if batch <= limit)


def warm_up_batches() -> list[int]:
    """One batch size per default config (the smallest it serves): searching each once compiles every kernel a
    server will launch, since the batch size is not a specialised argument."""
    return [1] + [limit + 1 for limit, _ in CONFIGS_BY_BATCH[:-1]]


@triton.jit
def _maximum(a, b):
    return tl.maximum(a, b)


# B (the batch size) is not specialised: Triton would otherwise compile again for B == 1 and for B divisible by 16,
# and each compile holds the server's queue for seconds at a size it first meets.
@triton.jit(do_not_specialize=["B"])
def _group_max_kernel(x_ptr, v_ptr, out_ptr, B, N, D, num_groups, stride_x, stride_v, stride_out,
                      GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      EVEN_K: tl.constexpr):
    # The query tiles of one row tile are neighbouring programs, so the row tile is read from memory once and
    # served from L2 to the others (the queries, at most 512 x 768 fp16, stay in L2 throughout).
    pid = tl.program_id(0)
    # Builtins only (no tl.cdiv, tl.zeros, tl.max: jit functions of triton's own), so the CPU interpreter runs
    # this kernel even when triton was imported before TRITON_INTERPRET was set, as in the tests.
    num_m = (B + BLOCK_M - 1) // BLOCK_M
    pid_m = pid % num_m
    pid_n = pid // num_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    first_row = pid_n.to(tl.int64) * BLOCK_N  # 21M x 768 elements overflow 32-bit offsets
    m_ok = offs_m < B
    n_ok = first_row + offs_n < N
    x_ptrs = x_ptr + offs_m[:, None] * stride_x + offs_k[None, :]
    v_ptrs = v_ptr + first_row * stride_v + offs_n[None, :] * stride_v + offs_k[:, None]  # BLOCK_K x BLOCK_N
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    for k in range(0, (D + BLOCK_K - 1) // BLOCK_K):
        if EVEN_K:
            a = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)
            b = tl.load(v_ptrs, mask=n_ok[None, :], other=0.0)
        else:
            k_ok = k * BLOCK_K + offs_k < D
            a = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(v_ptrs, mask=n_ok[None, :] & k_ok[:, None], other=0.0)
        acc = tl.dot(a, b, acc)
        x_ptrs += BLOCK_K
        v_ptrs += BLOCK_K
    acc = tl.where(n_ok[None, :], acc, float("-inf"))  # rows past the end: no score can lose to them
    if GROUP == BLOCK_N:  # a reduction in the accumulator's own layout, no reshape (which may go through shared memory)
        maxima = tl.reduce(acc, 1, _maximum)[:, None]
    else:
        maxima = tl.reduce(tl.reshape(acc, (BLOCK_M, BLOCK_N // GROUP, GROUP)), 2, _maximum)
    offs_g = pid_n * (BLOCK_N // GROUP) + tl.arange(0, BLOCK_N // GROUP)
    out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_out + offs_g[None, :]
    tl.store(out_ptrs, maxima, mask=m_ok[:, None] & (offs_g[None, :] < num_groups))


def group_maxima(x: torch.Tensor, vectors: torch.Tensor, group: int, config: str | None = None) -> torch.Tensor:
    """Max over each group of ``group`` consecutive rows of ``x @ vectors.T``: (B, ceil(N / group)) fp32.

    ``x`` (B x D) is rounded to the vectors' dtype (fp16) and the products summed in fp32; the last group of a
    shard that is not whole is the max of the rows it has.
    """
    params = parse_config(config or config_for(len(x)))
    if group & (group - 1) or not 16 <= group <= params["BLOCK_N"]:
        raise ValueError(f"group must be a power of two from 16 to the tile's BLOCK_N ({params['BLOCK_N']}), "
                         f"got {group}")
    if vectors.stride(1) != 1:
        raise ValueError("vectors must be row-major (stride 1 along the embedding dim)")
    x = x.to(vectors.dtype).contiguous()
    (b, d), n = x.shape, len(vectors)
    num_groups = -(-n // group)
    out = torch.empty(b, num_groups, dtype=torch.float32, device=vectors.device)
    grid = (triton.cdiv(b, params["BLOCK_M"]) * triton.cdiv(n, params["BLOCK_N"]),)
    # Triton launches on the current CUDA device, so a shard on another GPU makes its device current first.
    with torch.cuda.device(vectors.device) if vectors.is_cuda else contextlib.nullcontext():
        _group_max_kernel[grid](x, vectors, out, b, n, d, num_groups, x.stride(0), vectors.stride(0), out.stride(0),
                                GROUP=group, EVEN_K=d % params["BLOCK_K"] == 0, **params)
    return out
