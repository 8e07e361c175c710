"""Child processes that die with their parent, and exits that say why.

A server started for a job (vLLM, whose engine runs in processes of its own) must not outlive the job: when the job
is killed (the OOM killer, a scheduler, Ctrl-C), 8 GB of orphaned servers stayed behind. :func:`owned_popen` starts
a command under a tiny reaper (``python -m searchr1_trl.serving.processes <command>``) in a new process group; the
kernel
sends the reaper SIGTERM when its parent dies (``PR_SET_PDEATHSIG``; strictly, when the thread that started it
ends: start servers from a thread that lives as long as they should), and the reaper then stops the whole group:
SIGTERM, and SIGKILL to whatever is left after ``REAP_GRACE_S``. The reaper also stops the group when the command
exits on its own, so no grandchild survives it, and exits with the command's status (128 + signal if killed).

:func:`describe_exit` turns an exit status into a sentence: a child killed by SIGKILL is most likely the OOM
killer's work, said together with the cgroup's OOM-kill count when the kernel exposes it, the child's measured peak
memory (its process tree, sampled) and what the machine has.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

PR_SET_PDEATHSIG = 1  # linux/prctl.h
REAP_GRACE_S = 10.0  # between SIGTERM and SIGKILL of the group


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now (the kernel's pick), for a server to bind."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Ask the kernel to send ``sig`` to this process when its parent dies (a ``preexec_fn``; Linux only)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)


def exit_on_signals() -> None:
    """Make SIGTERM (and SIGINT) end this process as ``sys.exit(128 + signal)`` from the main thread, so every
    ``finally`` and context manager between here and the children runs and stops them: Python's default SIGTERM
    ends the process on the spot, and a trainer started by a job that ``kill``, supervisord or a scheduler's first
    signal stopped ran on for 47 s, wrote a checkpoint after the job had exited, then died of connection refused."""

    def stop(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # one stop; the cleanup itself may take a while
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        sys.exit(128 + signum)

    if threading.current_thread() is threading.main_thread():  # Python sets handlers there only
        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)


def owned_popen(command: list[str], **kwargs) -> subprocess.Popen:
    """``subprocess.Popen(command)`` whose process group dies with this process; the returned process is the
    reaper, leader of that group (``os.killpg(p.pid, SIGTERM)`` stops it all)."""
    return subprocess.Popen([sys.executable, "-m", "searchr1_trl.serving.processes", *command], start_new_session=True,
                            preexec_fn=die_with_parent, **kwargs)


def _stop_group(grace_s: float) -> None:
    """SIGTERM to this process group, SIGKILL to what is left after ``grace_s`` (this process survives both)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    os.killpg(0, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while (others := [pid for pid in _group_members() if pid != os.getpid()]) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in others:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _group_members() -> list[int]:
    """Live pids of this process group (zombie children of ours are reaped first, so they do not count)."""
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass
    group, members = os.getpgid(0), []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                stat = (entry / "stat").read_text()
                fields = stat.rsplit(")", 1)[1].split()  # state, ppid, pgrp, ...
                if int(fields[2]) == group and fields[0] != "Z":
                    members.append(int(entry.name))
    return members


def _reap(command: list[str]) -> int:
    """Run ``command``, stop the group when it exits or when we are told to stop; its exit status."""
    child = subprocess.Popen(command)

    def stop(signum, frame):
        _stop_group(REAP_GRACE_S)
        sys.exit(128 + signum)

    if threading.current_thread() is threading.main_thread():  # Python sets handlers there only
        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)
    code = child.wait()
    _stop_group(REAP_GRACE_S)
    return code if code >= 0 else 128 - code


def _oom_kills() -> int | None:
    """The OOM-kill count of this process's cgroup (cgroup v2), or None where the kernel does not expose it."""
    try:
        events = Path("/sys/fs/cgroup/memory.events").read_text()
    except OSError:
        return None
    return next((int(line.split()[1]) for line in events.splitlines() if line.startswith("oom_kill ")), None)


def _meminfo_gib(key: str) -> float:
    line = next(line for line in Path("/proc/meminfo").read_text().splitlines() if line.startswith(f"{key}:"))
    return int(line.split()[1]) / 2**20


def describe_exit(name: str, returncode: int, peak_rss_gib: float, oom_kills_before: int | None = None) -> str:
    """What a child's exit status means, e.g. ``"trainer was killed by SIGKILL: most likely the kernel's OOM killer
    (this cgroup's OOM kills went 0 -> 1); its peak resident memory was 21.3 GiB, the machine has 23.5 GiB (1.2
    GiB available now)"``; ``"trainer exited with status 2"`` when no signal was involved."""
    signum = -returncode if returncode < 0 else returncode - 128 if 128 < returncode < 160 else None
    if signum is None:
        return f"{name} exited with status {returncode}"
    try:
        sig = signal.Signals(signum).name
    except ValueError:
        sig = f"signal {signum}"
    memory = (f"its peak resident memory was {peak_rss_gib:.1f} GiB, the machine has "
              f"{_meminfo_gib('MemTotal'):.1f} GiB ({_meminfo_gib('MemAvailable'):.1f} GiB available now)")
    if signum != signal.SIGKILL:
        return f"{name} was killed by {sig}; {memory}"
    kills = _oom_kills()
    cause = ("the kernel's OOM killer" + (f" (this cgroup's OOM kills went {oom_kills_before} -> {kills})"
                                           if kills is not None and oom_kills_before is not None else "")
             if kills is None or oom_kills_before is None or kills > oom_kills_before
             else "a kill -9 (this cgroup's OOM-kill count did not change)")
    return f"{name} was killed by SIGKILL: most likely {cause}; {memory}. `dmesg | grep -i oom` shows the kernel's view"


def run_reporting(name: str, command: list[str], needs: dict[str, tuple[subprocess.Popen, str]] | None = None,
                  **kwargs) -> None:
    """``subprocess.run(command, check=True)`` whose failure says what killed the child and how much memory it
    needed (:func:`describe_exit`), instead of "died with <Signals.SIGKILL: 9>".

    ``needs``: the servers the child works through, ``{name: (process, where its log is)}``. If one exits while the
    child runs, the child is stopped at once and the error names that server and its log: the trainer would otherwise
    wait out its own timeout (600 s for a vLLM server that died while starting) and report only that it waited.

    The child dies with this process (``PR_SET_PDEATHSIG``), and is stopped (SIGTERM, SIGKILL after 30 s) when this
    call ends otherwise than by the child's exit: an exception, or a signal turned into one (:func:`exit_on_signals`).
    """
    oom_kills_before = _oom_kills()
    # The child dies with this process (SIGTERM), however it ends; the cleanup below is for an ordinary end.
    with subprocess.Popen(command, preexec_fn=die_with_parent, **kwargs) as child:
        peak = _PeakMemory(child.pid)
        try:
            while child.poll() is None:
                for server, (process, log) in (needs or {}).items():
                    if process.poll() is not None:
                        raise RuntimeError(f"{server} exited with status {process.returncode} while {name} ran "
                                           f"(log: {log}); {name} was stopped")
                time.sleep(0.5)
        finally:
            if child.poll() is None:
                child.terminate()
                try:
                    child.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    child.kill()
                    child.wait()
            peak.stop()
    if child.returncode:
        raise RuntimeError(describe_exit(name, child.returncode, peak.gib, oom_kills_before))


class _PeakMemory:
    """The largest resident memory of a process and its descendants, sampled every ``interval_s`` in a thread.

    Sampled, not read from ``getrusage``/``wait4``: their ``ru_maxrss`` counts the parent's memory the child was
    forked with (2.1 GiB reported for a child of the test process that held 1 GiB). Each sample also reads the
    root's ``VmHWM`` (its own high-water mark), so a spike between samples in the root is not missed.
    """

    def __init__(self, pid: int, interval_s: float = 0.2):
        self.pid, self.kib = pid, 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, args=(interval_s,), daemon=True)
        self._thread.start()

    @property
    def gib(self) -> float:
        return self.kib / 2**20

    def stop(self) -> None:
        self._done.set()
        self._thread.join()

    def _sample(self, interval_s: float) -> None:
        while not self._done.is_set():
            with contextlib.suppress(OSError, ValueError):
                tree = _descendants(self.pid)
                self.kib = max(self.kib, sum(_status_kib(pid, "VmRSS") for pid in tree),
                               _status_kib(self.pid, "VmHWM"))
            self._done.wait(interval_s)


def _status_kib(pid: int, key: str) -> int:
    """A ``kB`` field of /proc/<pid>/status (0 once the process is gone)."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    return next((int(line.split()[1]) for line in text.splitlines() if line.startswith(f"{key}:")), 0)


def _descendants(root: int) -> list[int]:
    """``root`` and every process below it."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(entry.name))
    tree, stack = [], [root]
    while stack:
        pid = stack.pop()
        tree.append(pid)
        stack.extend(children.get(pid, []))
    return tree


if __name__ == "__main__":
    sys.exit(_reap(sys.argv[1:]))
