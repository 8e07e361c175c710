"""Reliability around the job: recipe commands keep servers off the network, servers die
with whoever started them, and a child killed by a signal is reported with its likely cause and peak memory.

The killed parent starts the real retrieval server, and a process tree standing in for vLLM (a shell with a child
of its own: vLLM's API server starts engine processes the same way; a real vLLM takes minutes to start on CPU).
Figures go to ``reliability_figures`` (docs/RELIABILITY.md).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from searchr1_trl.serving.processes import free_port, run_reporting

ROOT = Path(__file__).resolve().parent.parent
@pytest.mark.parametrize("recipe", sorted(p.stem for p in (ROOT / "configs").glob("*.yaml")))
def test_recipe_servers_bind_loopback_or_their_machines_named_address_and_the_launcher_says_why(recipe):
    import yaml

    from searchr1_trl.cli import launch
    from searchr1_trl.serving import launch as plan

    nodes = yaml.safe_load((ROOT / "configs" / f"{recipe}.yaml").read_text()).get("nodes", 1)
    hosts = [f"10.0.0.{i + 1}" for i in range(nodes)]
    servers = [p for p in launch.plan(["--config", recipe, "--hosts", ",".join(hosts)])[0] if p.role != "trainer"]
    bound = {p.command[p.command.index("--host") + 1] for p in servers}
    assert servers and bound <= ({"127.0.0.1"} if nodes == 1 else set(hosts)), bound  # never 0.0.0.0
    assert "collective_rpc" in plan.__doc__  # why


def _shell_commands(text: str) -> list[str]:
    """The lines of ``text``, continuation lines (after a trailing backslash) joined to theirs."""
    return re.sub(r"\\\n\s*", " ", text).splitlines()


def test_every_vllm_serve_command_in_the_docs_and_scripts_binds_loopback_or_a_named_address():
    patterns = ("*.md", "docs/**/*.md", "experiments/**/*.md", "scripts/*.sh", "experiments/*.sh")
    files = [p for pattern in patterns for p in ROOT.glob(pattern)]
    commands = [(p.name, line) for p in files for line in _shell_commands(p.read_text())
                if re.search(r"vllm-serve --", line)]

    unbound = [(name, line) for name, line in commands if not re.search(r"--host (127\.0\.0\.1|\$|\"\$)", line)]
    assert commands and unbound == []


def test_the_error_for_a_missing_vllm_server_gives_a_command_bound_to_loopback():
    from searchr1_trl.training.evaluation import check_generator

    with pytest.raises(ValueError, match=r"start `trl vllm-serve --model m --host 127\.0\.0\.1`"):
        check_generator("vllm", "m", f"http://127.0.0.1:{free_port()}")


@pytest.mark.slow  # a real `trl vllm-serve` that fails in its argument checks, ~15 s of imports
def test_a_vllm_server_that_fails_to_start_says_why_in_its_error_even_once_its_log_is_gone(tmp_path):
    from searchr1_trl.serving.vllm_server import VLLMServer, VLLMServerConfig

    not_a_model = tmp_path / "not_a_model"
    not_a_model.mkdir()
    log = tmp_path / "vllm.log"
    config = VLLMServerConfig.for_this_machine(str(not_a_model), port=free_port(), max_model_len=4096,
                                               log_file=str(log), startup_timeout_s=300)
    with pytest.raises(RuntimeError) as failed:
        VLLMServer(config).start()
    log.unlink()  # as a benchmark's temporary folder goes: the reason must be in the message itself
    assert re.search(r"exited with code \d+ during startup: \w*Error: .*Invalid repository ID or local directory "
                     r"specified: '.*not_a_model'", str(failed.value)), str(failed.value)


PARENT = textwrap.dedent("""
    import json, sys, time
    from retriever_server.launch import RetrieverProcess
    from searchr1_trl.serving.processes import owned_popen

    index, corpus, model, port = sys.argv[1:]
    retriever = RetrieverProcess(index_path=index, corpus_path=corpus, retriever_model=model, port=int(port))
    retriever.__enter__()
    tree = owned_popen(["sh", "-c", "sleep 600 & sleep 600"])
    time.sleep(1)
    print(json.dumps({"retriever": retriever.process.pid, "group": tree.pid}), flush=True)
    time.sleep(600)
""")


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _group(pgid: int) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                pids.append(int(entry.name))
    return pids


@pytest.mark.slow  # starts or uses the real retrieval server
def test_servers_die_with_a_parent_killed_by_sigkill(retriever_server, reliability_figures):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    parent = subprocess.Popen([sys.executable, "-c", PARENT, retriever_server.index_path, retriever_server.corpus_path,
                               retriever_server.retriever_model, str(free_port())], env=env, cwd=ROOT,
                              stdout=subprocess.PIPE, text=True)
    started = json.loads(parent.stdout.readline())
    assert _alive(started["retriever"]) and len(_group(started["group"])) == 4  # reaper, sh, 2 x sleep

    parent.send_signal(signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 20
    while (_alive(started["retriever"]) or _group(started["group"])) and time.monotonic() < deadline:
        time.sleep(0.2)

    orphans = int(_alive(started["retriever"])) + len(_group(started["group"]))
    reliability_figures["orphans_after_parent_sigkill"] = orphans
    assert orphans == 0


def test_a_child_killed_by_sigkill_is_reported_with_its_likely_cause_and_peak_memory():
    hog = "import os, signal, time; block = bytearray(1 << 30); time.sleep(1); os.kill(os.getpid(), signal.SIGKILL)"

    with pytest.raises(RuntimeError) as failure:
        run_reporting("trainer", [sys.executable, "-c", hog])

    message = str(failure.value)
    assert message.startswith("trainer was killed by SIGKILL: most likely ")
    assert "OOM" in message and "dmesg" in message
    peak = float(re.search(r"peak resident memory was ([\d.]+) GiB", message).group(1))
    assert 1.0 <= peak < 1.2, message  # the 1 GiB it allocated, not the memory of the process that started it


def test_an_ordinary_failure_is_reported_as_its_exit_status():
    with pytest.raises(RuntimeError, match=r"^trainer exited with status 3$"):
        run_reporting("trainer", [sys.executable, "-c", "raise SystemExit(3)"])


def test_a_server_that_dies_under_the_trainer_stops_it_at_once_and_is_named():
    # The CPU main job starts the trainer while vLLM starts; a vLLM that died starting made the trainer wait its
    # 600 s server timeout and then report only that it had waited.
    server = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1); raise SystemExit(7)"])
    start = time.monotonic()

    with pytest.raises(RuntimeError, match=r"^the vLLM server exited with status 7 while trainer ran "
                                           r"\(log: /tmp/vllm\.log\); trainer was stopped$"):
        run_reporting("trainer", [sys.executable, "-c", "import time; time.sleep(120)"],
                      needs={"the vLLM server": (server, "/tmp/vllm.log")})

    assert time.monotonic() - start < 30


# A job as scripts/offline_job.py runs one: signals turned into an exit, a server under the reaper, then the trainer
# through run_reporting. The job prints its server's process group, the trainer its own pid.
JOB = textwrap.dedent("""
    import contextlib, sys
    from searchr1_trl.serving.processes import exit_on_signals, owned_popen, run_reporting

    exit_on_signals()
    with contextlib.ExitStack() as servers:
        server = owned_popen(["sleep", "600"])
        servers.callback(server.terminate)
        print(server.pid, flush=True)
        run_reporting("trainer", [sys.executable, "-c", "import os, time; print(os.getpid(), flush=True); "
                                                        "time.sleep(600)"])
""")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL], ids=["SIGTERM", "SIGINT", "SIGKILL"])
def test_a_signal_to_the_jobs_own_pid_stops_the_trainer_and_the_servers(sig, reliability_figures):
    job = subprocess.Popen([sys.executable, "-c", JOB], env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT,
                           stdout=subprocess.PIPE, text=True)
    started = {"server_group": int(job.stdout.readline()), "trainer": int(job.stdout.readline())}
    deadline = time.monotonic() + 30
    while len(_group(started["server_group"])) < 2 and time.monotonic() < deadline:  # the reaper has started sleep
        time.sleep(0.05)
    time.sleep(0.2)  # and set its own handlers, a moment after (a server is up long before a trainer starts)
    assert _alive(started["trainer"]) and len(_group(started["server_group"])) == 2

    sent = time.monotonic()
    job.send_signal(sig)
    deadline = sent + 30
    while (_alive(started["trainer"]) or _group(started["server_group"])) and time.monotonic() < deadline:
        time.sleep(0.05)
    stopped_s = time.monotonic() - sent

    assert not _alive(started["trainer"]) and not _group(started["server_group"]), "a child outlived the job"
    assert job.wait(timeout=30) == (-signal.SIGKILL if sig == signal.SIGKILL else 128 + sig)
    reliability_figures.setdefault("children_stopped_after_a_signal_to_the_job_s", {})[sig.name] = round(stopped_s, 2)
