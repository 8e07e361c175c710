"""searchr1-launch: every recipe's plan as commands (GPU sets, process counts, one set per machine), refusals in one
line, and one machine's run: servers stopped when the trainer ends, the trainer stopped when a server exits."""

from __future__ import annotations

import dataclasses
import json
import logging
import shlex
import subprocess
import sys
import time

import pytest
import yaml

from searchr1_trl.cli import launch as cli
from searchr1_trl.serving.launch import Process, print_plan, run_node
from searchr1_trl.serving.processes import free_port
from searchr1_trl.training.loading import CONFIGS

RECIPES = sorted(p.stem for p in CONFIGS.glob("*.yaml"))


def printed(text: str) -> dict[int, dict[str, tuple[dict[str, str], list[str]]]]:
    """``{machine: {role: (environment, argv)}}`` of what ``--dry_run`` prints."""
    machines, machine, role = {}, None, None
    for line in text.splitlines():
        if line.startswith("# machine "):
            machine = machines.setdefault(int(line.split()[2]), {})
        elif line.startswith("# "):
            role = line[2:]
        else:
            tokens, env = shlex.split(line), {}
            for token in tokens:  # NAME=value first, then the command
                name, equals, value = token.partition("=")
                if not (equals and name.isidentifier() and name.isupper()):
                    break
                env[name] = value
            machine[role] = (env, tokens[len(env):])
    return machines


def dry_run(capsys, *argv: str) -> dict[int, dict[str, tuple[dict[str, str], list[str]]]]:
    cli.main([*argv, "--dry_run"])
    return printed(capsys.readouterr().out)


def refusal(*argv: str) -> str:
    with pytest.raises(SystemExit) as stop:
        cli.main([*argv, "--dry_run"])
    message = str(stop.value.code)
    assert message.startswith("error: ") and "\n" not in message
    return message


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def gpus(env: dict[str, str]) -> set[int]:
    return {int(g) for g in env["CUDA_VISIBLE_DEVICES"].split(",") if g}


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_prints_disjoint_gpus_and_the_planned_process_counts(recipe, capsys):
    values = yaml.safe_load((CONFIGS / f"{recipe}.yaml").read_text())
    machines = dry_run(capsys, "--config", recipe)
    assert len(machines) == values.get("nodes", 1)
    trainer_gpus = values.get("trainer_gpus")
    for roles in machines.values():
        held = {role: gpus(env) for role, (env, _) in roles.items()}
        if values.get("weight_sync") == "ipc":  # the push goes through CUDA IPC to a server on the trainer's GPU
            assert held["generator"] == held["trainer"]
            assert values.get("generator_kv_cache_gib"), f"{recipe}: a server beside the trainer needs a fixed cache"
        else:
            assert not held.get("generator", set()) & held.get("trainer", set()), recipe
            assert not held.get("retriever", set()) & (held.get("generator", set()) | held.get("trainer", set()))
        if "generator" in roles:
            tp = values.get("vllm_tensor_parallel_size", 1)
            assert int(flag(roles["generator"][1], "--tensor_parallel_size")) == tp
            assert len(held["generator"]) == (tp if values.get("generator_gpus") else 0)
        if "trainer" in roles:
            argv = roles["trainer"][1]
            i = argv.index("searchr1_trl.cli.train")
            assert argv[i - 1:i + 3] == ["-m", "searchr1_trl.cli.train", "--config", str(CONFIGS / f"{recipe}.yaml")]
            if trainer_gpus is None:  # a CPU trainer: plain python, on no GPU
                assert argv[1:3] == ["-m", "searchr1_trl.cli.train"] and held["trainer"] == set()
            else:
                assert argv[1:3] == ["-m", "accelerate.commands.launch"]
                assert held["trainer"] == set(trainer_gpus)
                assert int(flag(argv, "--num_processes")) == len(trainer_gpus) * values.get("trainer_nodes", 1)


def test_a_generator_sharing_the_trainers_gpu_without_a_fixed_cache_is_warned_about(tmp_path, capsys, caplog):
    recipe = yaml.safe_load((CONFIGS / "offline_gpu.yaml").read_text())
    del recipe["generator_kv_cache_gib"]
    unfixed = tmp_path / "unfixed.yaml"
    unfixed.write_text(yaml.safe_dump(recipe))
    with caplog.at_level("WARNING", logger="searchr1_trl.serving.launch"):
        dry_run(capsys, "--config", "offline_gpu")
        assert caplog.text == ""
        dry_run(capsys, "--config", str(unfixed))
    assert ("the generator shares GPUs [0] with the trainer and takes vllm_gpu_memory_utilization=0.3 of each for "
            "itself; set generator_kv_cache_gib") in caplog.text


def test_the_two_machine_recipe_trains_on_machine_0_and_serves_from_machine_1s_address(capsys):
    machines = dry_run(capsys, "--config", "qwen3_30b_a3b", "--hosts", "10.0.0.1,10.0.0.2")
    assert set(machines[0]) == {"trainer"} and set(machines[1]) == {"retriever", "generator"}
    assert flag(machines[1]["retriever"][1], "--host") == flag(machines[1]["generator"][1], "--host") == "10.0.0.2"
    trainer = machines[0]["trainer"][1]
    assert flag(trainer, "--search_url") == "http://10.0.0.2:8000/retrieve"
    assert flag(trainer, "--vllm_server_base_url") == "http://10.0.0.2:8001"
    assert (gpus(machines[1]["generator"][0]), gpus(machines[1]["retriever"][0])) == ({0, 1, 2, 3}, {4, 5, 6, 7})


def test_a_trainer_across_machines_runs_accelerates_own_multi_machine_launch_on_each(capsys):
    machines = dry_run(capsys, "--config", "qwen3_30b_a3b", "--hosts", "a,b,c", "--nodes", "3", "--trainer_nodes", "2",
                       "--generator_node", "2", "--retriever_node", "2", "--main_process_port", "29600")
    assert [set(machines[i]) for i in range(3)] == [{"trainer"}, {"trainer"}, {"retriever", "generator"}]
    for rank in (0, 1):
        argv = machines[rank]["trainer"][1]
        assert [flag(argv, f) for f in ("--num_processes", "--num_machines", "--machine_rank", "--main_process_ip",
                                        "--main_process_port")] == ["16", "2", str(rank), "a", "29600"]
        assert flag(argv, "--search_url") == "http://c:8000/retrieve"


def test_a_plan_field_on_the_command_line_moves_the_process_and_reaches_the_trainer(capsys):
    machine = dry_run(capsys, "--config", "offline_gpu", "--generator", "vllm", "--weight_sync", "nccl",
                      "--generator_gpus", "0", "--trainer_gpus", "1", "--retriever_gpus", "1", "--max_steps", "7")[0]
    assert (gpus(machine["generator"][0]), gpus(machine["trainer"][0]), gpus(machine["retriever"][0])) == (
        {0}, {1}, {1})
    assert machine["trainer"][1][-2:] == ["--max_steps", "7"]  # after the launcher's own flags: the user's value wins
    assert flag(machine["trainer"][1], "--trainer_gpus") == "1"
    assert machine["retriever"][1][-3:] == ["--faiss_gpu", "--gpu_backend", "torch"]


def test_the_vllm_serve_generator_is_the_server_trl_vllm_serve_runs():
    # TRL 1.16 deprecates `trl vllm-serve`, which now execs `vllm serve` with TRL's flags: generator_server vllm
    # starts that server without the wrapper, and it must stay the one the wrapper starts
    from trl.scripts.vllm_serve import build_command, make_parser

    for recipe in ("qwen3_8b", "offline_gpu"):
        wrapped, direct = (next(p for p in cli.plan(["--config", recipe, "--generator", "vllm",
                                                     "--generator_server", server])[0] if p.role == "generator")
                           for server in ("trl", "vllm"))
        script_args, extra = make_parser().parse_args_and_config(args=wrapped.command[4:],
                                                                 return_remaining_strings=True)
        expected = build_command(script_args, extra)
        assert direct.env == {**wrapped.env, "VLLM_SERVER_DEV_MODE": "1"}
        assert _flags(direct.command[direct.command.index("serve") + 1:]) == _flags(
            expected[expected.index("serve") + 1:])


def _flags(tokens: list[str]) -> tuple[str, set[tuple[str, str | None]]]:
    """(model, {(flag, value or None)}) of a ``vllm serve`` argument list, flags at vLLM's defaults left out."""
    defaults = {("--data-parallel-size", "1"), ("--kv-cache-dtype", "auto"), ("--uvicorn-log-level", "info")}
    pairs, i = set(), 1
    while i < len(tokens):
        value = tokens[i + 1] if i + 1 < len(tokens) and not tokens[i + 1].startswith("--") else None
        pairs.add((tokens[i], value))
        i += 1 if value is None else 2
    return tokens[0], pairs - defaults


@pytest.mark.parametrize(("argv", "expected"), [
    (("--config", "qwen3_8b", "--trainer_gpus", "1", "2", "3", "4"),
     "GPUs [1] of machine 0 are in generator_gpus and trainer_gpus; weight_sync=nccl needs them apart"),
    (("--config", "qwen3_8b", "--generator_gpus", "0"),
     "generator_gpus=[0] holds 1 GPUs but vllm_tensor_parallel_size=2"),
    (("--config", "offline_gpu", "--generator", "vllm", "--trainer_gpus", "1"),
     "weight_sync=ipc pushes to a server on the trainer's own GPU: got generator_gpus [0] on machine 0 and "
     "trainer_gpus [1]"),
    (("--config", "qwen3_8b", "--nodes", "3"), "nodes=3 but machines [1, 2] run nothing"),
    (("--config", "qwen3_8b", "--retriever_node", "1"), "retriever_node=1; expected a machine 0 to 0 (nodes=1)"),
    (("--config", "qwen3_8b", "--trainer_gpus", "2", "2"), "trainer_gpus=[2, 2]; expected distinct GPU numbers"),
    (("--config", "qwen3_8b", "--gpu_ids", "2"), "command line: unrecognized arguments: --gpu_ids 2"),
    (("--config", "qwen3_30b_a3b", "--hosts", "a"), "1 host addresses for nodes=2; give one per machine"),
    (("--config", "qwen3_8b", "--vllm_server_base_url", "http://127.0.0.1:8000"),
     "search_url and vllm_server_base_url both name 127.0.0.1:8000"),
    (("--config", "qwen3_30b_a3b", "--hosts", "a,b", "--weight_sync", "reload"),
     "weight_sync=reload with the generator on another machine than the trainer's first: set weight_sync_dir"),
])
def test_a_plan_that_cannot_run_is_refused_in_one_line_before_anything_starts(argv, expected):
    assert expected in refusal(*argv)


def test_a_multi_machine_launch_needs_each_machines_address(monkeypatch):
    with pytest.raises(ValueError, match="the plan spans 2 machines: give --hosts"):
        cli.plan(["--config", "qwen3_30b_a3b"])  # what a launch (not a dry run) plans
    assert "--node_rank 2; expected 0 to 1" in refusal("--config", "qwen3_30b_a3b", "--hosts", "a,b",
                                                       "--node_rank", "2")


def test_the_trainer_refuses_the_same_plan_the_launcher_does():
    from searchr1_trl.training.loading import load_recipe
    from searchr1_trl.training.plan import PlanError, validate_plan

    args, model_args = load_recipe(["--config", "qwen3_8b", "--use_cpu", "true", "--generator_gpus", "0"])
    with pytest.raises(PlanError, match=r"generator_gpus=\[0\] holds 1 GPUs but vllm_tensor_parallel_size=2"):
        validate_plan(args, model_args, check_machine=False)


def test_a_launch_refuses_a_retriever_without_its_corpus_naming_the_command_that_fetches_it(tmp_path):
    processes, _ = cli.plan(["--config", "qwen3_8b", "--retriever_corpus_path", str(tmp_path / "wiki-18.jsonl")])
    with pytest.raises(ValueError, match=rf"corpus {tmp_path}/wiki-18.jsonl does not exist: fetch Search-R1's with "
                                         r"`searchr1-assets --search_r1`"):
        cli.prepare_retriever(processes, node=0)


@pytest.mark.slow  # embeds a corpus slice with the real encoder
def test_a_launch_builds_a_missing_index_from_the_recipes_corpus(offline_assets, squad_dev_sample, tmp_path):
    corpus, index = tmp_path / "corpus.jsonl", tmp_path / "index" / "index.faiss"
    corpus.write_text("".join(json.dumps(row) + "\n" for row in squad_dev_sample[0][:20]))  # what is built: any
    processes, _ = cli.plan(["--config", "offline", "--retriever_index_path", str(index),
                             "--retriever_corpus_path", str(corpus)])
    cli.prepare_retriever(processes, node=0)
    assert index.is_file()
    built = index.stat().st_mtime_ns
    cli.prepare_retriever(processes, node=0)  # an index that is there is served as it is
    assert index.stat().st_mtime_ns == built


# A stand-in server process (a fault is injected by what it does after it answers), and a stand-in trainer.
SERVER = ("import http.server, sys, time, threading\n"
          "class H(http.server.BaseHTTPRequestHandler):\n"
          "    def do_GET(self): self.send_response(200); self.end_headers()\n"
          "    def log_message(self, *a): pass\n"
          "s = http.server.HTTPServer(('127.0.0.1', int(sys.argv[1])), H)\n"
          "threading.Thread(target=s.serve_forever, daemon=True).start()\n"
          "time.sleep(float(sys.argv[2])); sys.exit(4)\n")


def stand_in(role: str, seconds: float, tmp_path) -> tuple[Process, int]:
    port = free_port()
    return Process(role, 0, [sys.executable, "-c", SERVER, str(port), str(seconds)], {},
                   f"http://127.0.0.1:{port}/health", str(tmp_path / f"{role}.log")), port


def listening(port: int) -> bool:
    return subprocess.run(["bash", "-c", f"exec 3<>/dev/tcp/127.0.0.1/{port}"], capture_output=True).returncode == 0


def test_the_servers_stop_when_the_trainer_ends_and_its_failure_is_named(tmp_path):
    (retriever, retriever_port), (generator, generator_port) = (stand_in(r, 600, tmp_path)
                                                                for r in ("retriever", "generator"))
    trainer = Process("trainer", 0, [sys.executable, "-c", "import sys; sys.exit(3)"], {})
    with pytest.raises(RuntimeError, match="trainer exited with status 3"):
        run_node([retriever, generator, trainer], node=0, startup_timeout_s=60)
    assert not listening(retriever_port) and not listening(generator_port)


def test_a_server_that_exits_under_the_trainer_stops_it_at_once_named_with_its_log(tmp_path):
    (retriever, _), (generator, _) = stand_in("retriever", 600, tmp_path), stand_in("generator", 3, tmp_path)
    trainer = Process("trainer", 0, [sys.executable, "-c", "import time; time.sleep(600)"], {})
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=rf"the vLLM server exited with status 4 while trainer ran \(log: "
                                           rf"{tmp_path}/generator.log\); trainer was stopped"):
        run_node([retriever, generator, trainer], node=0, startup_timeout_s=60)
    assert time.monotonic() - started < 60


def test_a_machine_without_the_trainer_serves_until_a_server_exits_then_stops_the_others(tmp_path):
    (retriever, retriever_port), (generator, _) = stand_in("retriever", 600, tmp_path), stand_in("generator", 3,
                                                                                                 tmp_path)
    with pytest.raises(RuntimeError, match=r"the vLLM server exited with status 4 .*; the others were stopped"):
        run_node([retriever, generator], node=0, startup_timeout_s=60)
    assert not listening(retriever_port)


def test_with_startup_overlap_the_trainer_starts_while_the_generator_is_still_starting_up(tmp_path, caplog,
                                                                                            capsys):
    retriever, _ = stand_in("retriever", 600, tmp_path)
    # a generator still starting up: alive, not answering its health URL for the whole test
    generator = Process("generator", 0, [sys.executable, "-c", "import time; time.sleep(600)"], {},
                        f"http://127.0.0.1:{free_port()}/health", str(tmp_path / "generator.log"))
    ran = tmp_path / "trainer_ran"
    trainer = Process("trainer", 0, [sys.executable, "-c", f"open({str(ran)!r}, 'w')"], {})
    with pytest.raises(TimeoutError, match=r"the vLLM server did not answer http://127\.0\.0\.1:\d+/health within "
                                           r"3s"):
        run_node([retriever, generator, trainer], node=0, startup_timeout_s=3)
    assert not ran.exists()  # the default: the trainer starts once the generator answers

    planned, hosts = cli.plan(["--config", "qwen3_8b", "--generator_startup_overlap", "true"])  # the recipe field
    assert [p.starts_before_generator for p in planned if p.role == "trainer"] == [True]
    print_plan(planned, hosts)  # the dry run says so
    assert "# trainer (started beside the generator: generator_startup_overlap)\n" in capsys.readouterr().out
    overlapping = dataclasses.replace(trainer, starts_before_generator=True)
    with caplog.at_level(logging.WARNING):
        run_node([retriever, generator, overlapping], node=0, startup_timeout_s=3)
    assert ran.exists()  # it ran, and ended, while the generator never answered
    assert "generator_startup_overlap is experimental" in caplog.text


def test_a_port_another_server_holds_is_refused_before_a_second_server_starts(tmp_path):
    from conftest import serve_health

    holder = serve_health()
    try:
        retriever = Process("retriever", 0, [sys.executable, "-c", "raise SystemExit(9)"], {},
                            f"http://127.0.0.1:{holder.server_port}/health", str(tmp_path / "retriever.log"))
        with pytest.raises(RuntimeError, match=r"already answers: another server holds its port"):
            run_node([retriever], node=0)
    finally:
        holder.shutdown()
