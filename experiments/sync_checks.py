"""Both weight pushes checked on two GPUs, servers included: :mod:`experiments.weight_sync` against two vLLM servers
this starts, waits for and stops on exit (also on an error or Ctrl-C; when this process is killed the servers' reapers
stop them: :func:`searchr1_trl.serving.processes.owned_popen`).

- ``nccl``: the server on GPU 0, without CUDA graphs; the trainer on GPU 1 (two processes on one GPU cannot form
  an NCCL pair).
- ``reload``: the server on GPU 1 with CUDA graphs (vLLM's default), beside the trainer: the push that works on one
  GPU. The two servers' start-up times side by side show what graph capture costs.
- ``ipc``: the same server (it has the CUDA IPC loader installed, ``--worker-extension-cls``), bf16 copies of the
  weights shared with it through CUDA IPC: the one-GPU push without a file.

A check on a server an earlier check pushed into first has the server reload ``--model`` from disk, so every check
starts from a server and a trainer on the same weights (else the IPC check after the reload one would meet a server
already on the weights its own update step leads to, and could not tell a push from none). Each check appends its
row to ``--out``; the first that fails (log-probs beyond tolerance, a server that died under
it) stops the run with its cause named. Server output goes to ``<log_dir>/vllm_gpu<N>.log``.

    python -m experiments.sync_checks --model M --questions test.parquet --out runs/weight_sync.jsonl
    python -m experiments.sync_checks --model M --questions test.parquet --dry_run   # the commands, as JSON
    python -m experiments.sync_checks --model M --questions test.parquet --checks reload ipc --trainer_gpu 0  # 1 GPU
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from searchr1_trl.serving.processes import run_reporting
from searchr1_trl.serving.vllm_server import VLLMServer, VLLMServerConfig, reload_weights
from searchr1_trl.serving.weight_sync import IPC_WORKER_EXTENSION


@dataclass(frozen=True)
class SyncCheck:
    """One push (``--sync`` of experiments.weight_sync) and the server it is checked against."""

    sync: str
    server_gpu: str
    port: int
    enforce_eager: bool


def sync_checks(args: argparse.Namespace) -> list[SyncCheck]:
    """The checks ``--checks`` names: NCCL against a server on ``--nccl_server_gpu``, reload and IPC against one
    server on ``--trainer_gpu`` (``--checks reload ipc --trainer_gpu 0`` on a one-GPU host)."""
    every = {"nccl": SyncCheck("nccl", server_gpu=args.nccl_server_gpu, port=8001, enforce_eager=True),
             "reload": SyncCheck("reload", server_gpu=args.trainer_gpu, port=8002, enforce_eager=False),
             "ipc": SyncCheck("ipc", server_gpu=args.trainer_gpu, port=8002, enforce_eager=False)}
    return [every[name] for name in args.checks]


def server_config(check: SyncCheck, args: argparse.Namespace) -> VLLMServerConfig:
    """The server of ``check``; 0.3 of its GPU, so the trainer fits beside it; the one on the trainer's GPU with the
    CUDA IPC loader installed."""
    return VLLMServerConfig(
        model=args.model, port=check.port, gpu_memory_utilization=0.3, enforce_eager=check.enforce_eager,
        startup_timeout_s=args.startup_timeout_s, log_file=str(Path(args.log_dir) / f"vllm_gpu{check.server_gpu}.log"),
        env={"CUDA_VISIBLE_DEVICES": check.server_gpu},
        worker_extension_cls=IPC_WORKER_EXTENSION if check.server_gpu == args.trainer_gpu else None)


def check_command(check: SyncCheck, server: VLLMServerConfig, args: argparse.Namespace) -> list[str]:
    """experiments.weight_sync pushing with ``check.sync`` into ``server`` (run on ``--trainer_gpu``); the IPC push
    in bf16, what the server runs."""
    return [sys.executable, "-m", "experiments.weight_sync", "--model", args.model, "--sync", check.sync,
            "--server_url", server.base_url, "--questions", args.questions, *(["--out", args.out] if args.out else []),
            *(["--push_dtype", "bfloat16"] if check.sync == "ipc" else [])]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="model folder to serve and train")
    parser.add_argument("--questions", required=True, help="parquet with a question column")
    parser.add_argument("--out", help="JSONL file each check appends its row to")
    parser.add_argument("--log_dir", default="runs", help="where the servers' logs go")
    parser.add_argument("--startup_timeout_s", type=float, default=300.0, help="how long to wait for each server")
    parser.add_argument("--checks", nargs="+", choices=["nccl", "reload", "ipc"], default=["nccl", "reload", "ipc"])
    parser.add_argument("--trainer_gpu", default="1", help="the trainer's GPU, and the reload and IPC server's")
    parser.add_argument("--nccl_server_gpu", default="0", help="the NCCL check's server GPU (not the trainer's)")
    parser.add_argument("--dry_run", action="store_true", help="print the servers' and checks' commands and exit")
    args = parser.parse_args(argv)
    if "nccl" in args.checks and args.nccl_server_gpu == args.trainer_gpu:
        parser.error("the nccl check needs the server on another GPU than the trainer (two processes on one GPU "
                     "cannot form an NCCL pair): set --nccl_server_gpu, or leave nccl out of --checks")
    checks = [(check, server_config(check, args)) for check in sync_checks(args)]
    trainer_env = {"CUDA_VISIBLE_DEVICES": args.trainer_gpu}
    ports = [check.port for check, _ in checks]
    pushed_before = [port in ports[:i] for i, port in enumerate(ports)]
    if args.dry_run:
        print(json.dumps({check.sync: {"server": {"command": server.command(), "env": server.env},
                                       "check": {"command": check_command(check, server, args), "env": trainer_env},
                                       "reloads_the_checkpoint_first": restore}
                          for (check, server), restore in zip(checks, pushed_before, strict=True)}, indent=2))
        return
    Path(args.log_dir).mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as servers:
        start = time.monotonic()
        by_port = {}  # one server per port: the reload and IPC checks share theirs
        for check, config in checks:  # the servers start up at once, so their start-up times compare
            if check.port not in by_port:
                by_port[check.port] = VLLMServer(config).launch()
                servers.callback(by_port[check.port].stop)
        for server in by_port.values():
            server.wait_until_healthy()
            kind = "eager" if server.config.enforce_eager else "CUDA-graph"
            print(f"{kind} server on GPU {server.config.env['CUDA_VISIBLE_DEVICES']} healthy after "
                  f"{time.monotonic() - start:.0f}s", flush=True)
        for (check, _), restore in zip(checks, pushed_before, strict=True):
            server = by_port[check.port]
            if restore:
                reload_weights(server.config.base_url, args.model)
            # a server that dies under its check stops it at once, named with its log
            needs = {f"the vLLM server on GPU {check.server_gpu}": (server.process, server.config.log_file)}
            run_reporting(f"the {check.sync} check", check_command(check, server.config, args), needs=needs,
                          env={**os.environ, **trainer_env})


if __name__ == "__main__":
    main()
