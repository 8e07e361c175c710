"""The suite's memory: the peak of pytest and every process it started (vLLM servers, retrievers, jobs), which test
ran then and what each process held, reported at the end of every run.

A CI machine has 24 GiB and other work beside the suite, so the peak is a property to keep, not a curiosity: with
``SEARCHR1_SUITE_MEMORY_GIB`` set (``scripts/test.sh`` sets 13) a run whose peak exceeds it fails, naming the test.
The summary is written last, after pytest's durations, so a CI log cut to its tail still shows it, with the
:data:`TOP` tests of highest peak: the ones to look at before the next test pushes the suite over.
Memory is PSS (``/proc/<pid>/smaps_rollup``): pages shared between the processes (a vLLM server's API process and its
engine) count once, so the sum is what the tree takes from the machine; other sessions' processes are not in it.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import psutil
import pytest

GIB = 2**30
INTERVAL_S = 0.5
TOP = 5


def _pss(pid: int) -> int:
    """Proportional set size in bytes; 0 for a process that is gone or unreadable."""
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return 0
    return 0


def _label(process: psutil.Process) -> str:
    """A short name for a process of the tree: ``pytest``, ``vllm``, ``retriever``, or its executable's name."""
    try:
        command = " ".join(process.cmdline())
    except psutil.Error:
        return "gone"
    # The specific before the general: a job's or trainer's command names the vLLM server it talks to.
    for needle, label in (("pytest", "pytest"), ("retriever_server", "retriever"), ("offline_job", "offline job"),
                          ("train.py", "trainer"), ("cli.train", "trainer"), ("vllm", "vllm"),
                          ("searchr1-", "console script")):
        if needle in command:
            return label
    return Path(process.cmdline()[0]).name if process.cmdline() else process.name()


class SuiteMemory:
    """Samples the tree's PSS every :data:`INTERVAL_S` seconds in a thread; ``peak`` is (bytes, test, breakdown)."""

    def __init__(self):
        self.root = psutil.Process(os.getpid())
        self.test = "collection"
        self.peak: tuple[int, str, dict[str, float]] = (0, "", {})
        self.per_test: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="suite-memory", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()  # a run shorter than one interval still has a figure

    def sample(self) -> None:
        processes = [self.root, *self.root.children(recursive=True)]
        sizes = [(p, _pss(p.pid)) for p in processes]
        total = sum(size for _, size in sizes)
        test = self.test
        self.per_test[test] = max(self.per_test.get(test, 0), total)
        if total > self.peak[0]:
            breakdown: dict[str, float] = {}
            for process, size in sizes:
                label = _label(process)
                breakdown[label] = breakdown.get(label, 0.0) + size / GIB
            self.peak = (total, test, breakdown)

    def _run(self) -> None:
        while not self._stop.wait(INTERVAL_S):
            try:
                self.sample()
            except psutil.Error:  # a process ended while it was read: the next sample has the new tree
                continue

    def line(self) -> str:
        total, test, breakdown = self.peak
        parts = ", ".join(f"{label} {gib:.2f}" for label, gib in sorted(breakdown.items(), key=lambda kv: -kv[1]))
        return f"suite memory peak: {total / GIB:.2f} GiB (PSS) during {test}: {parts}"

    def top(self) -> list[str]:
        ranked = sorted(self.per_test.items(), key=lambda kv: -kv[1])[:TOP]
        return [f"  {size / GIB:5.2f} GiB  {test}" for test, size in ranked]


_memory = SuiteMemory()


def pytest_sessionstart(session):
    _memory.start()


def pytest_runtest_logstart(nodeid, location):
    _memory.test = nodeid


def pytest_sessionfinish(session, exitstatus):
    _memory.stop()
    limit = os.environ.get("SEARCHR1_SUITE_MEMORY_GIB")
    if limit and _memory.peak[0] > float(limit) * GIB:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
        _memory.over = f"over SEARCHR1_SUITE_MEMORY_GIB={limit}"


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter):
    over = getattr(_memory, "over", None)
    terminalreporter.write_line(_memory.line() + (f" -- {over}" if over else ""), red=bool(over))
    terminalreporter.write_line("tests of highest peak (PSS of the tree while each ran):")
    for line in _memory.top():
        terminalreporter.write_line(line)
