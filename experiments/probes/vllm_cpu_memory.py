"""The CPU vLLM server's memory floor: the summed PSS of its processes once it serves, per process, under the
launch options the CPU main job could use.

Starts the offline model's ``trl vllm-serve`` as the main job does (``VLLMServerConfig.for_this_machine``), plus
any vLLM flags after ``--`` and ``--env NAME=VALUE`` pairs, sends 8 concurrent chat requests of up to 48 tokens (the
recipe's validation batch), and prints one JSON line: start-up seconds, generation seconds, and the PSS of each
process (API server, engine core, worker) after the requests.

    python -m experiments.probes.vllm_cpu_memory --label default --out experiments/results/vllm_cpu_memory.jsonl
    python -m experiments.probes.vllm_cpu_memory --label "mp executor" -- --distributed-executor-backend mp
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

from experiments.main_job import GIB, smaps_rollup
from experiments.report import report
from searchr1_trl.assets.offline import prepare
from searchr1_trl.serving.vllm_server import VLLMServer, VLLMServerConfig


@dataclass
class ProbeConfig(VLLMServerConfig):
    """The job's server config plus vLLM flags to try (given after ``--``; a later flag wins)."""

    extra_args: list[str] = field(default_factory=list)

    def command(self) -> list[str]:
        return [*super().command(), *self.extra_args]


def process_pss(root: int) -> dict[str, float]:
    """PSS (GiB) of ``root`` and each descendant, keyed by ``pid name``."""
    tree = psutil.Process(root)
    out = {}
    for p in [tree, *tree.children(recursive=True)]:
        try:
            out[f"{p.pid} {p.name()}"] = round(smaps_rollup(p.pid)["Pss"] / GIB, 2)
        except (psutil.Error, OSError):
            continue
    return out


async def chat_batch(base_url: str, model: str, n: int, max_tokens: int) -> None:
    async with httpx.AsyncClient(base_url=base_url, timeout=600) as client:
        await asyncio.gather(*[client.post("/v1/chat/completions", json={
            "model": model, "max_tokens": max_tokens, "temperature": 1.0,
            "messages": [{"role": "user", "content": f"Question {i}: who wrote the play Hamlet, and when?"}],
        }) for i in range(n)])


def main() -> None:
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--label", default="")
    parser.add_argument("--env", nargs="*", default=[], help="NAME=VALUE pairs for the server's environment")
    parser.add_argument("--port", type=int, default=18201)
    parser.add_argument("--out", help="append the JSON line to this file")
    args = parser.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    model = prepare().model
    env = dict(pair.split("=", 1) for pair in args.env)
    config = ProbeConfig.for_this_machine(model, port=args.port, env=env, extra_args=extra,
                                          log_file=f"/tmp/vllm_cpu_memory_{os.getpid()}.log")
    start = time.monotonic()
    with VLLMServer(config) as server:
        started = time.monotonic() - start
        at_rest = process_pss(server.process.pid)
        begin = time.monotonic()
        asyncio.run(chat_batch(server.base_url, model, n=8, max_tokens=48))
        generated = time.monotonic() - begin
        after = process_pss(server.process.pid)
    report({
        "label": args.label, "env": env, "extra_args": extra, "startup_s": round(started, 1),
        "generate_8x48_s": round(generated, 1), "pss_total_gib_at_rest": round(sum(at_rest.values()), 2),
        "pss_total_gib_after": round(sum(after.values()), 2), "pss_gib_by_process_after": after,
        "log": str(Path(config.log_file)),
    }, args.out)


if __name__ == "__main__":
    main()
