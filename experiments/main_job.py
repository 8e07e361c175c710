"""The CPU main job's wall time and the peak memory of all its processes, measured from outside.

Runs ``scripts/offline_job.py`` (what ``bash scripts/run_offline.sh`` runs once setup is a no-op) with any extra
flags, samples its whole process tree every ``--interval`` seconds, and prints one JSON line: wall time, the peak of
the tree's summed PSS (proportional set size: pages shared between processes, such as vLLM's engine and its parent,
counted once in total) and summed RSS, the peak RSS of each role (index build, retriever, generator, trainer, the
job itself), the peak growth of ``/dev/shm`` (the weight-sync folder: tmpfs files are memory too), and the job's own
``summary.json`` (EM before/after, per-step time split). ``peak_total_gib`` is the peak of the tree's anonymous and
file-backed PSS plus the larger of its shared-memory PSS and the ``/dev/shm`` growth (the server maps the sync
folder's files while loading them: counted once); ``at_peak`` says when it peaked (seconds from the start) and what
each role's PSS and the ``/dev/shm`` growth were at that sample.

    python -m experiments.main_job --out experiments/results/main_job_cpu.jsonl -- --output_dir runs/offline

Flags after ``--`` go to ``scripts/offline_job.py``. The figure that matters is ``peak_total_gib`` against the 12 GB
budget of the CPU recipe, and ``wall_s`` against 5 minutes; ``load_before`` is the 1-minute load average when the job
started (the job is CPU-bound: other work on the machine slows it), and ``cpu_s_by_role`` the CPU seconds each part
used, which other work inflates much less than wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

import psutil

from experiments.report import report

ROOT = Path(__file__).resolve().parent.parent
GIB = 1024**3


def role(process: psutil.Process) -> str:
    """What a process of the job is, from its own or its ancestors' command lines."""
    for p in [process, *process.parents()]:
        try:
            command = " ".join(p.cmdline())
        except psutil.Error:
            continue
        # First match wins: the trainer's command line names the vLLM server too (--vllm_server_base_url).
        for marker, name in (("train.py", "trainer"), ("cli.train", "trainer"), ("build_index", "index_build"),
                             ("retriever_server", "retriever"),
                             ("vllm-serve", "generator"), ("VLLM::", "generator"), ("vllm.entrypoints", "generator"),
                             ("offline_job.py", "job")):
            if marker in command:
                return name
    return "other"


def smaps_rollup(pid: int) -> dict[str, int]:
    """The process's ``/proc/<pid>/smaps_rollup`` in bytes: ``Pss_Anon``, ``Pss_File``, ``Pss_Shmem``, ..."""
    values = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        key, _, rest = line.partition(":")
        values[key] = int(rest.split()[0]) * 1024
    return values


class Sampler(threading.Thread):
    """Peak summed PSS / RSS of a process tree, per-role peak RSS, CPU seconds and the peak growth of /dev/shm."""

    def __init__(self, pid: int, interval: float, timeline: str | None = None):
        super().__init__(daemon=True)
        self.timeline = open(timeline, "w") if timeline else None  # noqa: SIM115 (closed when the thread ends)
        self.root, self.interval = psutil.Process(pid), interval
        self.shm_at_start = shutil.disk_usage("/dev/shm").used
        self.peak_pss = self.peak_rss = self.peak_shm = self.peak_total = 0
        self.peak_by_role: dict[str, int] = defaultdict(int)
        self.at_peak: dict[str, float | dict[str, int]] = {}  # when the total peaked, and each role's PSS then
        self.started = time.monotonic()
        self.cpu_s: dict[int, tuple[str, float]] = {}  # pid -> (role, CPU seconds at its last sample)
        self.roles: dict[int, str] = {}
        self.samples, self.load_sum = 0, 0.0
        self.stop = threading.Event()

    def cpu_s_by_role(self) -> dict[str, float]:
        """CPU seconds (user + system) of each role's processes: unlike wall time, other work on the machine does
        not inflate them much. A process's seconds are as of its last sample (up to one interval short)."""
        totals: dict[str, float] = defaultdict(float)
        for name, seconds in self.cpu_s.values():
            totals[name] += seconds
        return {name: round(seconds) for name, seconds in sorted(totals.items())}

    def run(self) -> None:
        while not self.stop.wait(self.interval):
            try:
                processes = [self.root, *self.root.children(recursive=True)]
            except psutil.Error:
                break
            pss = rss = anon_file = shmem = 0
            by_role: dict[str, int] = defaultdict(int)
            pss_by_role: dict[str, int] = defaultdict(int)
            for p in processes:
                try:
                    name = self.roles.setdefault(p.pid, role(p))
                    times = p.cpu_times()
                    rollup = smaps_rollup(p.pid)
                except (psutil.Error, OSError):
                    continue  # exited between listing and reading
                by_role[name] += rollup["Rss"]
                pss_by_role[name] += rollup["Pss"]
                self.cpu_s[p.pid] = (name, times.user + times.system)
                pss, rss = pss + rollup["Pss"], rss + rollup["Rss"]
                anon_file += rollup.get("Pss_Anon", 0) + rollup.get("Pss_File", 0)
                shmem += rollup.get("Pss_Shmem", 0)
            shm = max(0, shutil.disk_usage("/dev/shm").used - self.shm_at_start)
            # The sync folder's pages are in Pss_Shmem while the server maps them: count them once.
            total = anon_file + max(shmem, shm)
            self.samples += 1
            self.load_sum += os.getloadavg()[0]
            self.peak_pss, self.peak_rss = max(self.peak_pss, pss), max(self.peak_rss, rss)
            if total > self.peak_total:
                self.at_peak = {"t_s": round(time.monotonic() - self.started), "shm": shm, **pss_by_role}
            self.peak_shm, self.peak_total = max(self.peak_shm, shm), max(self.peak_total, total)
            for name, value in by_role.items():
                self.peak_by_role[name] = max(self.peak_by_role[name], value)
            if self.timeline:
                self.timeline.write(json.dumps({"t_s": round(time.monotonic() - self.started, 1),
                                                "total_gib": round(total / GIB, 2), "shm_gib": round(shm / GIB, 2),
                                                **{k: round(v / GIB, 2) for k, v in pss_by_role.items()}}) + "\n")
        if self.timeline:
            self.timeline.close()


def main() -> None:
    argv = sys.argv[1:]
    job_args = argv[argv.index("--") + 1:] if "--" in argv else []
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--interval", type=float, default=2.0, help="seconds between samples")
    parser.add_argument("--label", default="", help="what this run changes (goes into the JSON line)")
    parser.add_argument("--out", help="append the JSON line to this file (experiments/results/main_job_cpu.jsonl)")
    parser.add_argument("--timeline", help="write every sample (total and each role's PSS, GiB) to this JSONL file")
    args = parser.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    output_dir = job_args[job_args.index("--output_dir") + 1] if "--output_dir" in job_args else "runs/offline"

    load_before = os.getloadavg()[0]
    start = time.monotonic()
    job = subprocess.Popen([sys.executable, str(ROOT / "scripts" / "offline_job.py"), *job_args],
                           env={**os.environ, "HF_HUB_OFFLINE": "1"})
    sampler = Sampler(job.pid, args.interval, args.timeline)
    sampler.start()
    returncode = job.wait()
    wall = time.monotonic() - start
    sampler.stop.set()
    sampler.join()
    summary_file = ROOT / output_dir / "summary.json"
    summary = json.loads(summary_file.read_text()) if returncode == 0 and summary_file.exists() else None
    report({
        "label": args.label, "returncode": returncode, "wall_s": round(wall), "load_before": round(load_before, 2),
        "load_mean": round(sampler.load_sum / max(sampler.samples, 1), 2), "cpus": os.cpu_count(),
        "peak_total_gib": round(sampler.peak_total / GIB, 2),
        "peak_pss_gib": round(sampler.peak_pss / GIB, 2), "peak_rss_gib": round(sampler.peak_rss / GIB, 2),
        "peak_shm_gib": round(sampler.peak_shm / GIB, 2),
        "peak_rss_gib_by_role": {k: round(v / GIB, 2) for k, v in sorted(sampler.peak_by_role.items())},
        "at_peak": {k: v if k == "t_s" else round(v / GIB, 2) for k, v in sampler.at_peak.items()},
        "cpu_s_by_role": sampler.cpu_s_by_role(),
        "samples": sampler.samples, "job_args": job_args, "summary": summary,
    }, args.out)
    sys.exit(returncode)


if __name__ == "__main__":
    main()
