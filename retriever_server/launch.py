"""Run the retrieval server as a child process (tests, the offline job, benchmarks) and stop it reliably, also
when the parent is killed: the kernel then SIGKILLs the server (``PR_SET_PDEATHSIG``; the server starts no
processes of its own, so that is all of it; vLLM, which does, gets a reaper in ``searchr1_trl.serving.processes``)."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _die_with_parent() -> None:
    """``preexec_fn``: the kernel SIGKILLs the child when its parent dies (Linux; elsewhere a no-op)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)


@dataclass
class RetrieverProcess:
    """`python -m retriever_server.server ...` on loopback, healthy on enter, terminated on exit. ``module`` may name
    another server taking the same flags (the benchmarks' Search-R1 reference)."""

    index_path: str
    corpus_path: str
    retriever_model: str
    port: int = 8000
    log_file: str | None = None
    extra_args: tuple[str, ...] = ()
    startup_timeout_s: float = 300.0
    env: dict[str, str] = field(default_factory=dict)  # extra environment, e.g. CUDA_VISIBLE_DEVICES
    module: str = "retriever_server.server"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/retrieve"

    def command(self) -> list[str]:
        return [sys.executable, "-m", self.module, "--index_path", self.index_path, "--corpus_path",
                self.corpus_path, "--retriever_model", self.retriever_model, "--port", str(self.port),
                *self.extra_args]

    def __enter__(self) -> RetrieverProcess:
        log = open(self.log_file, "ab") if self.log_file else subprocess.DEVNULL
        self.process = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT,
                                        env={**os.environ, **self.env}, preexec_fn=_die_with_parent)
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"retrieval server exited with {self.process.returncode}{self._last_line()}; "
                                   f"log: {self.log_file}")
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=2.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.__exit__()
        raise TimeoutError(f"retrieval server not healthy after {self.startup_timeout_s}s; log: {self.log_file}")

    def _last_line(self) -> str:
        """``: <the log's last line>`` (where the server says why it refused to start), or "" without a log."""
        lines = Path(self.log_file).read_text(errors="replace").splitlines() if self.log_file else []
        return f": {lines[-1]}" if lines else ""

    def __exit__(self, *exc) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
