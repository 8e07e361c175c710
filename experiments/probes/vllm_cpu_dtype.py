"""Decode speed of the offline model on a CPU vLLM server by weight dtype: why CPU servers run float32
(``VLLMServerConfig.for_this_machine``). On a CPU without bf16 matrix instructions bf16 matmuls take slow paths.

    python -m experiments.probes.vllm_cpu_dtype bfloat16 float32

Prints generated tokens/s for one and eight concurrent 50-token greedy completions (after one warm-up request).
"""

from __future__ import annotations

import sys
import time

import httpx

from searchr1_trl.assets.offline import require
from searchr1_trl.serving.vllm_server import VLLMServer, VLLMServerConfig


def main(dtypes: list[str]) -> None:
    model = require().model
    for dtype in dtypes:
        config = VLLMServerConfig(model=model, dtype=dtype, enforce_eager=True, port=8031,
                                  log_file=f"/tmp/vllm_cpu_{dtype}.log")
        with VLLMServer(config) as server:
            for batch in (1, 8):
                body = {"model": model, "prompt": ["The capital of France is"] * batch, "max_tokens": 50,
                        "temperature": 0.0, "ignore_eos": True}
                httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=600).raise_for_status()
                start = time.perf_counter()
                httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=600).raise_for_status()
                seconds = time.perf_counter() - start
                print(f"dtype={dtype} batch={batch}: {50 * batch / seconds:.1f} generated tokens/s ({seconds:.1f} s)",
                      flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or ["bfloat16", "float32"])
