"""Run the retrieval server as a child process (tests, the offline job, benchmarks) and stop it reliably."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass, field

import httpx


@dataclass
class RetrieverProcess:
    """`python -m retriever_server.server ...` on loopback, healthy on enter, terminated on exit."""

    index_path: str
    corpus_path: str
    retriever_model: str
    port: int = 8000
    log_file: str | None = None
    extra_args: tuple[str, ...] = ()
    startup_timeout_s: float = 300.0
    env: dict[str, str] = field(default_factory=dict)  # extra environment, e.g. CUDA_VISIBLE_DEVICES

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/retrieve"

    def command(self) -> list[str]:
        return [sys.executable, "-m", "retriever_server.server", "--index_path", self.index_path, "--corpus_path",
                self.corpus_path, "--retriever_model", self.retriever_model, "--port", str(self.port),
                *self.extra_args]

    def __enter__(self) -> "RetrieverProcess":
        log = open(self.log_file, "ab") if self.log_file else subprocess.DEVNULL
        self.process = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT,
                                        env={**os.environ, **self.env})
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"retrieval server exited with {self.process.returncode}; log: {self.log_file}")
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=2.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.__exit__()
        raise TimeoutError(f"retrieval server not healthy after {self.startup_timeout_s}s; log: {self.log_file}")

    def __exit__(self, *exc) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
