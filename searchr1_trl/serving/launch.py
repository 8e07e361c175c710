"""The launch plan: which process runs on which machine and GPUs, the commands that start them, and one machine's run.

A recipe's plan is data: :class:`LaunchConfig`, whose fields the recipe reaches as flat fields like every part's
knobs. It names the GPUs of the generator server (one server; its tensor parallel size is the recipe's
``vllm_tensor_parallel_size``), of the trainer on each of its machines and of the retriever, the machine each runs on,
and what the retriever serves. :func:`check_plan` refuses a plan that cannot run, in one line.

:func:`plan_processes` turns a plan into commands, each a :class:`Process`: the retriever (``retriever_server.server``),
the generator (``trl vllm-serve``, or ``vllm serve`` with the flags TRL's wrapper adds) and the trainer through
``accelerate launch`` with one process per trainer GPU (plain ``python`` for a CPU trainer). A multi-node plan gives
each machine its own commands: accelerate's own ``--num_machines``/``--machine_rank``/``--main_process_ip`` for a
trainer that spans machines, and servers that bind their machine's address instead of loopback. Never 0.0.0.0:
``trl vllm-serve`` serves an unauthenticated ``/collective_rpc`` that runs worker methods, and the retriever has no
authentication either, so a server listens only where the plan needs it (the recipe's URL's host on one machine).

:func:`run_node` runs one machine's processes: the servers under the reaper of :mod:`~searchr1_trl.serving.processes`
(they die with the launcher, whatever kills it), the retriever and the machine's generator answering before the
trainer starts (with ``generator_startup_overlap`` the trainer starts beside the generator and waits for it itself,
``vllm_server_timeout``), the trainer stopped at once
when a server of its machine exits, and every server stopped when the trainer ends, on an error or on Ctrl-C.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import httpx

from searchr1_trl.assets.offline import resolve_path
from searchr1_trl.serving.processes import exit_on_signals, owned_popen, run_reporting
from searchr1_trl.serving.vllm_server import IPC_WORKER_EXTENSION, VLLMServerConfig

logger = logging.getLogger(__name__)

REPOSITORY = Path(__file__).resolve().parents[2]  # where accelerate_configs/ lies in a checkout
TRAINER_MODULE = "searchr1_trl.cli.train"
LOGS = {"retriever": "retriever.log", "generator": "vllm.log"}
NAMES = {"retriever": "the retrieval server", "generator": "the vLLM server", "trainer": "the trainer"}


@dataclass
class LaunchConfig:
    """Where each process of a run goes (``searchr1-launch``); GPU lists are CUDA device numbers on their machine."""

    nodes: int = field(default=1, metadata={"help": "Machines the plan spans, numbered from 0."})
    trainer_gpus: list[int] | None = field(
        default=None,
        metadata={"help": "GPUs of the trainer on each of its machines: one accelerate process each. None: the CPU."})
    trainer_nodes: int = field(
        default=1, metadata={"help": "Machines the trainer spans, 0 to trainer_nodes - 1 (accelerate's num_machines)."})
    accelerate_config: str | None = field(
        default=None,
        metadata={"help": "accelerate config of the trainer (accelerate_configs/zero3.yaml); a relative path is "
                          "looked up in the working directory, then in the repository. None: accelerate's default."})
    generator_gpus: list[int] | None = field(
        default=None,
        metadata={"help": "GPUs of the generator server, as many as vllm_tensor_parallel_size. None: the CPU."})
    generator_node: int = field(default=0, metadata={"help": "Machine of the generator server."})
    generator_server: str = field(
        default="trl",
        metadata={"help": "`trl`: `trl vllm-serve`; `vllm`: vLLM's own `vllm serve` with the flags TRL's wrapper adds "
                          "(the wrapper is deprecated since TRL 1.16)."})
    generator_enforce_eager: bool = field(
        default=False, metadata={"help": "Start the GPU generator without CUDA graphs: faster start, slower decoding."})
    generator_kv_cache_gib: float | None = field(
        default=None,
        metadata={"help": "Fixed KV cache of the GPU generator in GiB; set it when servers start side by side on one "
                          "GPU, so none sizes its cache off another's allocations. None: vLLM's memory profile."})
    retriever_gpus: list[int] | None = field(
        default=None,
        metadata={"help": "GPUs the retriever searches on (--faiss_gpu); it may share them with the others (a small "
                          "index). None: the CPU."})
    retriever_node: int = field(default=0, metadata={"help": "Machine of the retriever."})
    retriever_index_path: str | None = field(
        default=None,
        metadata={"help": "faiss index the launcher serves at search_url. None: no retriever is started, one must "
                          "answer at search_url."})
    retriever_corpus_path: str | None = field(
        default=None, metadata={"help": "Passages of the index (JSONL or Parquet)."})
    retriever_model: str | None = field(default=None, metadata={"help": "Encoder of the queries (folder or Hub id)."})
    retriever_name: str | None = field(
        default=None, metadata={"help": "Encoder family for its prefixes and pooling (e5, bge); None: from the model."})
    retriever_gpu_backend: str = field(
        default="faiss", metadata={"help": "GPU search of a flat index: faiss (faiss-gpu) or torch."})
    generator_startup_overlap: bool = field(
        default=False,
        metadata={"help": "Experimental: start the trainer while the generator server starts up, not once it "
                          "answers, so that the trainer's imports, model load and warm start run during vLLM's "
                          "start-up (about 2 minutes of a one-GPU launch, CUDA graphs included); the trainer waits "
                          "for the server after its warm start. Not yet measured on a GPU; on the 2-core CPU the two "
                          "start-ups side by side peaked at 16 GiB."})

    def __post_init__(self):
        for name in ("trainer_gpus", "generator_gpus", "retriever_gpus"):
            gpus = getattr(self, name)
            if gpus is not None and (not gpus or len(set(gpus)) < len(gpus)
                                     or not all(isinstance(g, int) and not isinstance(g, bool) and g >= 0
                                                for g in gpus)):
                raise ValueError(f"{name}={gpus!r}; expected distinct GPU numbers >= 0, or none for the CPU")
        if self.nodes < 1 or not 1 <= self.trainer_nodes <= self.nodes:
            raise ValueError(f"nodes={self.nodes}, trainer_nodes={self.trainer_nodes}; expected 1 <= trainer_nodes "
                             "<= nodes")
        for name in ("generator_node", "retriever_node"):
            if not 0 <= getattr(self, name) < self.nodes:
                raise ValueError(f"{name}={getattr(self, name)}; expected a machine 0 to {self.nodes - 1} "
                                 f"(nodes={self.nodes})")
        if self.trainer_nodes > 1 and self.trainer_gpus is None:
            raise ValueError(f"trainer_nodes={self.trainer_nodes} with trainer_gpus none: a CPU trainer runs on one "
                             "machine")
        if self.generator_server not in ("trl", "vllm"):
            raise ValueError(f"generator_server={self.generator_server!r}; expected 'trl' or 'vllm'")
        if self.retriever_gpu_backend not in ("faiss", "torch"):
            raise ValueError(f"retriever_gpu_backend={self.retriever_gpu_backend!r}; expected 'faiss' or 'torch'")


def _node_gpus(plan: LaunchConfig, role: str, node: int) -> set[int]:
    """The GPUs ``role`` holds on machine ``node``."""
    if role == "trainer":
        return set(plan.trainer_gpus or ()) if node < plan.trainer_nodes else set()
    return set(getattr(plan, f"{role}_gpus") or ()) if getattr(plan, f"{role}_node") == node else set()


def check_plan(plan: LaunchConfig, generator: str, weight_sync: str, tensor_parallel_size: int) -> None:
    """ValueError naming what a plan cannot run: a generator whose GPU count is not its tensor parallel size, a GPU
    given to the generator and the trainer under ``weight_sync`` nccl (two processes on one GPU form no NCCL pair),
    generator and trainer apart under ipc (it needs them on the same GPU), and a machine that runs nothing."""
    serves = generator == "vllm"
    gpus = plan.generator_gpus
    if serves and gpus is not None and len(gpus) != tensor_parallel_size:
        raise ValueError(f"generator_gpus={gpus} holds {len(gpus)} GPUs but vllm_tensor_parallel_size="
                         f"{tensor_parallel_size}: give the server one GPU per tensor parallel rank")
    if serves and weight_sync == "ipc":
        if plan.generator_node != 0 or gpus != plan.trainer_gpus or plan.trainer_nodes != 1:
            raise ValueError(f"weight_sync=ipc pushes to a server on the trainer's own GPU: got generator_gpus {gpus} "
                             f"on machine {plan.generator_node} and trainer_gpus {plan.trainer_gpus}; set them "
                             "equal, or use weight_sync nccl")
    elif serves and weight_sync == "nccl":
        for node in range(plan.nodes):
            shared = _node_gpus(plan, "generator", node) & _node_gpus(plan, "trainer", node)
            if shared:
                raise ValueError(f"GPUs {sorted(shared)} of machine {node} are in generator_gpus and trainer_gpus; "
                                 "weight_sync=nccl needs them apart (ipc or reload share one)")
    used = set(range(plan.trainer_nodes)) | {plan.retriever_node} | ({plan.generator_node} if serves else set())
    if set(range(plan.nodes)) - used:
        raise ValueError(f"nodes={plan.nodes} but machines {sorted(set(range(plan.nodes)) - used)} run nothing")


@dataclass
class Process:
    """One command of a plan: what it is, the machine it runs on, its extra environment and, for a server, the URL
    that answers once it is up and the file its output goes to."""

    role: str  # retriever, generator or trainer
    node: int
    command: list[str]
    env: dict[str, str]
    health_url: str | None = None
    log_file: str | None = None
    starts_before_generator: bool = False  # a trainer started beside its machine's generator, not after it answers

    def shell(self) -> str:
        """The command as a shell line, its environment first."""
        return shlex.join([*(f"{k}={v}" for k, v in self.env.items()), *self.command])


def _devices(gpus: list[int] | None) -> dict[str, str]:
    """The environment pinning a process to ``gpus``; none hides every GPU (a CPU process stays off them)."""
    return {"CUDA_VISIBLE_DEVICES": ",".join(map(str, gpus or ()))}


def accelerate_config_path(name: str) -> str:
    """``name`` as given when it exists, else in the repository, else in the installed package (a wheel ships
    ``accelerate_configs/`` inside ``searchr1_trl/``); ValueError when none."""
    for path in (Path(name), REPOSITORY / name, Path(__file__).resolve().parents[1] / name):
        if path.is_file():
            return str(path.resolve())
    raise ValueError(f"accelerate_config={name!r} is neither a file nor one of the repository's "
                     f"({REPOSITORY / 'accelerate_configs'})")


def plan_processes(plan: LaunchConfig, values: dict, recipe: str, overrides: list[str], hosts: list[str],
                   main_process_port: int = 29500, startup_timeout_s: float = 1800.0) -> list[Process]:
    """Every command of the plan, machine by machine. ``values``: the recipe's fields with the command line on top
    (:func:`~searchr1_trl.training.loading.recipe_values`); ``overrides``: that command line, passed on to the trainer
    after the launcher's own flags so it wins; ``hosts``: each machine's address (one machine: the recipe's URLs)."""
    if len(hosts) != plan.nodes:
        raise ValueError(f"{len(hosts)} host addresses for nodes={plan.nodes}; give one per machine (--hosts)")
    multi = plan.nodes > 1
    search = urlsplit(values["search_url"])
    served = urlsplit(values["vllm_server_base_url"] or  # as the trainer reads it (SearchR1Config.generator_url)
                      f"http://{values['vllm_server_host']}:{values['vllm_server_port']}")
    retriever_host = hosts[plan.retriever_node] if multi else search.hostname
    generator_host = hosts[plan.generator_node] if multi else served.hostname
    out = Path(values["output_dir"])
    processes, trainer_args = [], []
    if multi:  # the servers listen on their machine's address, and the trainer asks there
        trainer_args += ["--search_url", f"http://{retriever_host}:{search.port}{search.path}",
                         "--vllm_server_base_url", f"http://{generator_host}:{served.port}"]
    if plan.retriever_index_path:
        processes.append(_retriever(plan, values, retriever_host, search.port, out))
    if values["generator"] == "vllm":
        if plan.retriever_index_path and (generator_host, served.port) == (retriever_host, search.port):
            raise ValueError(f"search_url and vllm_server_base_url both name {generator_host}:{served.port}: give "
                             "the generator and the retriever ports of their own")
        processes.append(_generator(plan, values, generator_host, served.port, out))
        trainer_args += ["--vllm_server_timeout", str(startup_timeout_s)]  # it starts while the server does
        if values["weight_sync"] == "reload" and not values["weight_sync_dir"]:
            if plan.generator_node != 0:
                raise ValueError("weight_sync=reload with the generator on another machine than the trainer's "
                                 "first: set weight_sync_dir to a folder both machines share, or use nccl")
            # tmpfs: no disk between the trainer and the server it shares the machine with
            shm = Path("/dev/shm" if Path("/dev/shm").is_dir() else out)
            trainer_args += ["--weight_sync_dir", str(shm / f"searchr1_{out.resolve().name}_weights")]
    trainer = [*trainer_args, *overrides]
    for node in range(plan.trainer_nodes):
        processes.append(Process("trainer", node, [*_trainer_launcher(plan, node, hosts, main_process_port),
                                                   "-m", TRAINER_MODULE, "--config", recipe, *trainer],
                                 _devices(plan.trainer_gpus), starts_before_generator=plan.generator_startup_overlap))
    return sorted(processes, key=lambda p: p.node)


def _retriever(plan: LaunchConfig, values: dict, host: str, port: int, out: Path) -> Process:
    paths = {"--index_path": plan.retriever_index_path, "--corpus_path": plan.retriever_corpus_path,
             "--retriever_model": plan.retriever_model}
    missing = [flag.removeprefix("--") for flag, path in paths.items() if not path]
    if missing:
        raise ValueError(f"retriever_index_path is set but {', '.join('retriever_' + m for m in missing)} is not: "
                         "the retriever needs its index, corpus and encoder")
    command = [sys.executable, "-m", "retriever_server.server",
               *(token for flag, path in paths.items() for token in (flag, resolve_path(path))),
               "--topk", str(values["topk"]), "--host", host, "--port", str(port),
               *(["--retriever_name", plan.retriever_name] if plan.retriever_name else []),
               *(["--faiss_gpu", "--gpu_backend", plan.retriever_gpu_backend] if plan.retriever_gpus else [])]
    return Process("retriever", plan.retriever_node, command, _devices(plan.retriever_gpus),
                   f"http://{host}:{port}/health", str(out / LOGS["retriever"]))


def _generator(plan: LaunchConfig, values: dict, host: str, port: int, out: Path) -> Process:
    shared = _node_gpus(plan, "generator", plan.generator_node) & _node_gpus(plan, "trainer", plan.generator_node)
    if shared and plan.generator_kv_cache_gib is None:
        # vLLM sizes its cache to vllm_gpu_memory_utilization of the whole card, blind to the trainer that starts after
        # it: 30% of an 80 GB card beside offline_gpu's fast update (~57 GiB peak) runs the trainer out of memory.
        logger.warning("the generator shares GPUs %s with the trainer and takes vllm_gpu_memory_utilization=%s of "
                       "each for itself; set generator_kv_cache_gib (a fixed KV cache, e.g. 3 for a 0.5B model) so "
                       "the trainer's peak fits beside it", sorted(shared), values["vllm_gpu_memory_utilization"])
    config = VLLMServerConfig.for_this_machine(
        resolve_path(values["model_name_or_path"]), host=host, port=port,
        tensor_parallel_size=values["vllm_tensor_parallel_size"],
        gpu_memory_utilization=values["vllm_gpu_memory_utilization"],
        **({"max_model_len": values["vllm_max_model_length"]} if values["vllm_max_model_length"] else {}),
        **({"enforce_eager": True} if plan.generator_enforce_eager else {}),
        gpu_kv_cache_gib=plan.generator_kv_cache_gib,
        worker_extension_cls=IPC_WORKER_EXTENSION if values["weight_sync"] == "ipc" else None)
    command = config.command() if plan.generator_server == "trl" else config.vllm_serve_command()
    env = {**_devices(plan.generator_gpus), **config.launch_env(), **config.env}
    if plan.generator_server == "vllm":
        env["VLLM_SERVER_DEV_MODE"] = "1"  # the weight-transfer and prefix-cache routes, as TRL's wrapper sets it
    return Process("generator", plan.generator_node, command, env, f"{config.base_url}/health",
                   str(out / LOGS["generator"]))


def _trainer_launcher(plan: LaunchConfig, node: int, hosts: list[str], main_process_port: int) -> list[str]:
    """``python``, or ``accelerate launch`` with one process per trainer GPU (and its multi-machine flags)."""
    if plan.trainer_gpus is None:
        return [sys.executable]
    launch = [sys.executable, "-m", "accelerate.commands.launch",
              *(["--config_file", accelerate_config_path(plan.accelerate_config)] if plan.accelerate_config else []),
              "--num_processes", str(len(plan.trainer_gpus) * plan.trainer_nodes)]
    if plan.trainer_nodes > 1:
        launch += ["--num_machines", str(plan.trainer_nodes), "--machine_rank", str(node),
                   "--main_process_ip", hosts[0], "--main_process_port", str(main_process_port)]
    return launch


def print_plan(processes: list[Process], hosts: list[str]) -> None:
    """The commands, machine by machine, as shell lines."""
    for node in sorted({p.node for p in processes}):
        print(f"# machine {node} ({hosts[node]})")
        for process in (p for p in processes if p.node == node):
            beside = (" (started beside the generator: generator_startup_overlap)"
                      if process.starts_before_generator else "")
            print(f"# {process.role}{beside}\n{process.shell()}")


def _answers(url: str) -> bool:
    with contextlib.suppress(httpx.HTTPError):  # not up (yet): what is being asked
        return httpx.get(url, timeout=2.0).status_code == 200
    return False


def wait_healthy(process: Process, started: subprocess.Popen | None, timeout_s: float) -> None:
    """Return once ``process``'s health URL answers; RuntimeError if the server it is exits first, TimeoutError
    after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not _answers(process.health_url):
        if started is not None and started.poll() is not None:
            raise RuntimeError(f"{NAMES[process.role]} exited with status {started.returncode} while starting "
                               f"(log: {process.log_file})")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{NAMES[process.role]} did not answer {process.health_url} within {timeout_s:.0f}s"
                               + (f" (log: {process.log_file})" if started is not None else ""))
        time.sleep(1.0)
    logger.info("%s answers at %s", NAMES[process.role], process.health_url)


def _stop(server: subprocess.Popen, timeout_s: float = 30.0) -> None:
    """SIGTERM to the server's process group (its reaper stops the rest), SIGKILL after ``timeout_s``."""
    if server.poll() is not None:
        return
    os.killpg(server.pid, signal.SIGTERM)
    try:
        server.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()


def run_node(processes: list[Process], node: int, startup_timeout_s: float = 1800.0) -> None:
    """Run machine ``node``'s processes (see the module docstring) until its trainer ends, or, on a machine without
    one, until a server exits; RuntimeError saying which process failed and how. SIGTERM or SIGINT to this process
    stops them all on the way out (:func:`~searchr1_trl.serving.processes.exit_on_signals`)."""
    exit_on_signals()
    mine = [p for p in processes if p.node == node]
    trainer = next((p for p in mine if p.role == "trainer"), None)
    with contextlib.ExitStack() as stack:
        started: dict[str, tuple[subprocess.Popen, str]] = {}
        for server in (p for p in mine if p.role != "trainer"):
            if _answers(server.health_url):  # else the new server fails to bind while the old one answers
                raise RuntimeError(f"{server.health_url} already answers: another server holds its port; stop it "
                                   "or choose another port")
            Path(server.log_file).parent.mkdir(parents=True, exist_ok=True)
            log = stack.enter_context(open(server.log_file, "ab"))  # closed by the stack
            logger.info("starting %s: %s", NAMES[server.role], server.shell())
            popen = owned_popen(server.command, env={**os.environ, **server.env}, stdout=log, stderr=subprocess.STDOUT)
            stack.callback(_stop, popen)
            started[NAMES[server.role]] = (popen, server.log_file)
        if trainer is None:
            for server in (p for p in mine if p.role != "trainer"):
                wait_healthy(server, started[NAMES[server.role]][0], startup_timeout_s)
            while all(popen.poll() is None for popen, _ in started.values()):
                time.sleep(1.0)
            name, (popen, log) = next((n, s) for n, s in started.items() if s[0].poll() is not None)
            raise RuntimeError(f"{name} exited with status {popen.returncode} (log: {log}); the others were stopped")
        # Every retriever answers before the trainer starts (its plan check searches at once), and so does this
        # machine's generator: vLLM's start-up peak and the trainer's model load do not overlap (the 2-core CPU job
        # peaked at 16 GiB with them overlapping). With generator_startup_overlap the trainer starts beside the
        # generator and waits for it after its warm start (vllm_server_timeout).
        if trainer.starts_before_generator:
            logger.warning("generator_startup_overlap is experimental: the trainer starts while the generator server "
                           "starts up (not yet measured on a GPU)")
        for server in (p for p in processes if p.role == "retriever" or (
                p in mine and p.role == "generator" and not trainer.starts_before_generator)):
            wait_healthy(server, started.get(NAMES[server.role], (None,))[0], startup_timeout_s)
        logger.info("training: %s", trainer.shell())
        run_reporting("trainer", trainer.command, needs=started, env={**os.environ, **trainer.env})
