"""searchr1-launch: start what a recipe's plan names (retriever, generator server, trainer) on its GPUs and machines.

    searchr1-launch --config qwen3_8b                # one machine of 8 GPUs: retriever, vLLM, 4 trainer processes
    searchr1-launch --config qwen3_8b --dry_run      # print the exact commands, start nothing
    searchr1-launch --config qwen3_30b_a3b --hosts gpu-a,gpu-b --node_rank 0    # on each machine of a multi-node plan
    searchr1-launch --config offline_gpu --max_steps 10 --trainer_gpus 1 --generator_gpus 1    # any recipe field

The plan is the recipe's fields ``nodes``, ``trainer_gpus``, ``generator_gpus``, ``retriever_gpus``, ...
(searchr1_trl/serving/launch.py); a field on the command line changes it for the launch and the trainer alike, and
every other field goes to the trainer. The plan and the recipe are checked before anything starts. Servers write
their output to ``output_dir`` (retriever.log, vllm.log); the launcher stops them all when the trainer ends, when one
of them exits and on Ctrl-C. A multi-node plan runs one launcher per machine, each with the same ``--hosts`` (machine
0 first) and its own ``--node_rank``; scripts/slurm/ shows it under SLURM.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace

from searchr1_trl.engine.generation import resolve_generator
from searchr1_trl.serving.launch import Process, check_plan, plan_processes, print_plan, run_node

logger = logging.getLogger("searchr1-launch")


def parser() -> argparse.ArgumentParser:
    # no abbreviations: every flag the launcher does not know is a recipe field for the trainer
    parser = argparse.ArgumentParser(prog="searchr1-launch", description=__doc__, allow_abbrev=False,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="a shipped recipe's name or a recipe file")
    parser.add_argument("--dry_run", action="store_true", help="print the commands, machine by machine, and exit")
    parser.add_argument("--hosts", help="the address of each machine of a multi-node plan, comma-separated, "
                                        "machine 0 (the trainer's main process) first")
    parser.add_argument("--node_rank", type=int, default=0, help="the machine this launcher runs on")
    parser.add_argument("--main_process_port", type=int, default=29500, help="accelerate's rendezvous port")
    parser.add_argument("--startup_timeout_s", type=float, default=1800.0,
                        help="how long a server may take to answer (the wiki-18 flat index takes minutes to load)")
    parser.add_argument("--plan_json", action="store_true", help=argparse.SUPPRESS)  # what planned() reads
    return parser


def plan(argv: list[str]) -> tuple[list[Process], list[str]]:
    """The commands of ``searchr1-launch argv`` and each machine's address; ValueError naming a bad field or plan.

    Reads the recipe through the recipe's own parser (typed, checked), which imports TRL: a launcher that lives as
    long as the run calls :func:`planned` instead, which plans in a child process."""
    from searchr1_trl.training.loading import recipe_path, recipe_values
    from searchr1_trl.training.recipe import part_config

    options, overrides = parser().parse_known_args(argv)
    recipe = str(recipe_path(options.config))
    values = recipe_values(["--config", recipe, *overrides])
    values["generator"] = resolve_generator(values["generator"])
    launch = part_config(SimpleNamespace(**values), "launch")
    check_plan(launch, values["generator"], values["weight_sync"], values["vllm_tensor_parallel_size"])
    if not values["output_dir"]:
        raise ValueError(f"recipe {recipe}: output_dir is not set; the run and the servers' logs go there")
    if options.hosts:
        hosts = options.hosts.split(",")
    elif launch.nodes > 1 and not options.dry_run:
        raise ValueError(f"the plan spans {launch.nodes} machines: give --hosts (each one's address, machine 0 "
                         "first) and --node_rank on each")
    else:
        hosts = [f"node{i}" for i in range(launch.nodes)] if launch.nodes > 1 else ["127.0.0.1"]
    if not 0 <= options.node_rank < launch.nodes:
        raise ValueError(f"--node_rank {options.node_rank}; expected 0 to {launch.nodes - 1}")
    processes = plan_processes(launch, values, recipe, overrides, hosts, options.main_process_port,
                               options.startup_timeout_s)
    return processes, hosts


def planned(argv: list[str]) -> list[Process]:
    """:func:`plan` in a child process, so the launcher does not hold TRL's imports (0.2 GiB) for the whole run;
    SystemExit with the child's one-line error."""
    done = subprocess.run([sys.executable, "-m", "searchr1_trl.cli.launch", "--plan_json", *argv],
                          capture_output=True, text=True)
    if done.returncode:
        sys.exit(done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"planning exited {done.returncode}")
    return [Process(**p) for p in json.loads(done.stdout.splitlines()[-1])]


def prepare_retriever(processes: list[Process], node: int) -> None:
    """Build the index of machine ``node``'s retriever when it is missing (the offline corpus: a minute on a GPU;
    wiki-18: hours, which ``searchr1-assets --search_r1`` saves by fetching Search-R1's); ValueError when its corpus
    is missing too, naming what makes them."""
    for process in (p for p in processes if p.role == "retriever" and p.node == node):
        flags = {flag: process.command[process.command.index(flag) + 1] for flag in
                 ("--index_path", "--corpus_path", "--retriever_model", "--retriever_name")
                 if flag in process.command}
        if not Path(flags["--corpus_path"]).exists():
            raise ValueError(f"the retriever's corpus {flags['--corpus_path']} does not exist: fetch Search-R1's with "
                             "`searchr1-assets --search_r1` (the offline one: searchr1-assets)")
        if not Path(flags["--index_path"]).exists():
            logger.info("building the missing index %s from %s", flags["--index_path"], flags["--corpus_path"])
            Path(flags["--index_path"]).parent.mkdir(parents=True, exist_ok=True)
            subprocess.run([sys.executable, "-m", "retriever_server.build_index",
                            *(token for pair in flags.items() for token in pair)], check=True,
                           env={**os.environ, **process.env})  # on the retriever's GPUs


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    options, _ = parser().parse_known_args(argv)
    logging.basicConfig(level=logging.INFO, format="[searchr1-launch %(asctime)s] %(message)s", datefmt="%H:%M:%S")
    try:
        if options.dry_run or options.plan_json:
            processes, hosts = plan(argv)
            if options.plan_json:
                print(json.dumps([asdict(p) for p in processes]))
            else:
                print_plan(processes, hosts)
            return
        processes = planned(argv)
        prepare_retriever(processes, options.node_rank)
        run_node(processes, options.node_rank, options.startup_timeout_s)
    except (ValueError, RuntimeError, TimeoutError, subprocess.CalledProcessError) as error:
        sys.exit(f"error: {' '.join(str(error).split())}")
    except KeyboardInterrupt:
        sys.exit("stopped (Ctrl-C); every process of this machine was stopped")


if __name__ == "__main__":
    main()
