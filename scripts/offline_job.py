"""The main job on the offline default, end to end, with no Hub access:

assets -> corpus slice + index -> retrieval server + vLLM server -> EM before -> GRPO training -> EM after ->
reward/EM curves (PNG) and a summary -> servers stopped.

    python scripts/offline_job.py                     # the CPU recipe (configs/offline.yaml)
    python scripts/offline_job.py --max_steps 2       # extra flags go to scripts/train.py
    python scripts/offline_job.py --config offline_gpu --output_dir runs/offline_gpu --corpus full   # one GPU
    python scripts/offline_job.py --config offline_gpu --corpus full --generator vllm --weight_sync nccl \
        --generator_gpu 0 --trainer_gpu 1 --retriever_gpu 1 --launcher accelerate                    # two GPUs
    python scripts/offline_job.py ... --dry_run      # print the three launch commands as JSON and exit

GPU plans: ``generator: vllm`` starts ``trl vllm-serve`` on ``--generator_gpu`` (its memory share is
``--generator_gpu_memory_utilization``, low when it shares the GPU with the trainer). When generator and trainer
share one GPU (two processes on one GPU cannot form an NCCL pair) the weights go either through CUDA IPC
(``weight_sync: ipc``, offline_gpu's: the server is started with the IPC loader) or through a folder under
``/dev/shm`` (``weight_sync: reload``; tmpfs: no disk in the way, and no CUDA needed); ``weight_sync: nccl`` needs
them on different GPUs. The retriever searches on ``--retriever_gpu`` (flat index, torch backend).

On a 2-core CPU the whole SQuAD-open corpus (31k passages) takes ~12 minutes to embed, so the job indexes a slice
that still holds every answer it asks about: the paragraphs of the first ``--test_articles`` SQuAD dev articles
(validation questions come only from those), of the first ``--train_articles`` SQuAD train articles (training
questions come only from those), and Wikipedia leads as distractors.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import yaml

from retriever_server.launch import RetrieverProcess
from searchr1_trl.assets.offline import corpus_slice, prepare
from searchr1_trl.engine.generation import resolve_generator  # not recipe: the job needs no torch or trl
from searchr1_trl.serving.processes import run_reporting
from searchr1_trl.serving.vllm_server import VLLMServer, VLLMServerConfig
from searchr1_trl.serving.weight_sync import IPC_WORKER_EXTENSION

ROOT = Path(__file__).resolve().parent.parent
logger = logging.getLogger("offline_job")


def slice_data(assets, out: Path, train_articles: int, test_articles: int, distractors: int) -> dict[str, str]:
    """Corpus, train and test files restricted to the articles the job asks about (see module docstring)."""
    out.mkdir(parents=True, exist_ok=True)
    train = pd.read_parquet(assets.train_questions)
    test = pd.read_parquet(assets.test_questions)
    train_titles = set(list(dict.fromkeys(train["title"]))[:train_articles])
    test_titles = set(list(dict.fromkeys(test["title"]))[:test_articles])
    titles = train_titles | test_titles
    train = train[train["title"].isin(train_titles)]
    test = test[test["title"].isin(test_titles)]
    paths = {"corpus": str(out / "corpus.jsonl"), "train": str(out / "train.parquet"),
             "test": str(out / "test.parquet")}
    passages = corpus_slice(assets.corpus, titles, distractors, Path(paths["corpus"]))
    train.to_parquet(paths["train"], index=False)
    test.to_parquet(paths["test"], index=False)
    logger.info("corpus slice: %d passages; %d train questions from %d articles, %d test questions from %d",
                passages, len(train), train_articles, len(test), test_articles)
    return paths


def plot(log_history: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [e for e in log_history if "reward" in e]
    evals = [e for e in log_history if "eval_em" in e]
    fig, ax = plt.subplots(1, 3, figsize=(15, 3.5))
    ax[0].plot([e["step"] for e in train], [e["reward"] for e in train], marker="o", label="reward")
    ax[0].plot([e["step"] for e in train], [e.get("rubric/correct") for e in train], marker="o",
               label="answered exactly right")
    ax[0].set(title="training rollouts (mean per step)", xlabel="optimizer step")
    ax[0].legend()
    ax[1].plot([e["step"] for e in evals], [e["eval_em"] for e in evals], marker="o", color="C1", label="all")
    sources = sorted({k.removeprefix("eval_em/") for e in evals for k in e if k.startswith("eval_em/")})
    for i, source in enumerate(sources if len(sources) > 1 else []):  # one source is the "all" line again
        shown = [e for e in evals if f"eval_em/{source}" in e]
        ax[1].plot([e["step"] for e in shown], [e[f"eval_em/{source}"] for e in shown], marker=".", linestyle="--",
                   color=f"C{i + 2}", label=source)
    ax[1].set(title="validation EM (greedy)", xlabel="optimizer step", ylabel="exact match", ylim=(0, 1))
    ax[1].legend()
    ax[2].plot([e["step"] for e in train], [e.get("rollout/searches_per_rollout") for e in train], marker="o",
               label="searches / rollout")
    ax[2].plot([e["step"] for e in train], [e.get("rollout/status_done") for e in train], marker="o",
               label="fraction DONE")
    ax[2].set(title="rollouts", xlabel="optimizer step")
    ax[2].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def gpu_env(devices: str | None) -> dict[str, str]:
    """The environment of a process pinned to ``devices`` (CUDA_VISIBLE_DEVICES), or nothing to change."""
    return {} if devices is None else {"CUDA_VISIBLE_DEVICES": devices}


def trainer_command(args, recipe: dict, data: dict, generator: VLLMServerConfig, out: Path,
                    train_overrides: list[str]) -> list[str]:
    """scripts/train.py with the job's data, servers and output folder, under accelerate launch if asked."""
    launcher = [sys.executable]
    if args.launcher == "accelerate":
        launcher = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                    str(ROOT / "accelerate_configs" / "single_gpu.yaml")]
    sync_dir = Path("/dev/shm" if Path("/dev/shm").is_dir() else out) / f"searchr1_{out.name}_weights"
    return [
        *launcher, str(ROOT / "scripts" / "train.py"), "--config", args.config,
        "--model_name_or_path", data["model"], "--output_dir", str(out),
        "--train_data_path", data["train"], "--eval_data_path", data["test"], "--eval_on_start", "true",
        "--search_url", f"http://127.0.0.1:{args.retriever_port}/retrieve",
        "--generator", args.generator or resolve_generator(recipe.get("generator", "vllm")),
        *(["--weight_sync", args.weight_sync] if args.weight_sync else []),
        "--vllm_server_base_url", generator.base_url, "--weight_sync_dir", str(sync_dir),
        # the trainer starts while vLLM does and waits for it as long as the job would have
        "--vllm_server_timeout", str(generator.startup_timeout_s),
        *train_overrides,
    ]


def rollouts_per_step(recipe: dict, train_overrides: list[str]) -> int:
    """Training rollouts per optimizer step on one process (the generation batch)."""
    fields = {"per_device_train_batch_size": 8, "gradient_accumulation_steps": 8, **recipe}
    for name in fields:
        if f"--{name}" in train_overrides:
            fields[name] = train_overrides[train_overrides.index(f"--{name}") + 1]
    return int(fields["per_device_train_batch_size"]) * int(fields["gradient_accumulation_steps"])


def time_split(history: list[dict], rollouts_per_step: int) -> dict[str, float]:
    """Mean seconds per optimizer step: rollouts, weight sync, scoring (rewards, advantages and TRL's old-log-prob
    forward: the rest of ``generate_and_score/time_s``), the policy update (the loss and backward passes: the rest of
    TRL's ``step_time``, which spans every micro-batch's ``training_step`` but not the optimizer step) and validation;
    plus rollout throughput."""
    train = [e for e in history if "step_time" in e]
    if not train:
        return {}

    def mean(key: str) -> float:
        values = [e.get(key, 0.0) for e in train]
        return sum(values) / len(values)

    step, rollout, sync = mean("step_time"), mean("rollout/time_s"), mean("weight_sync/time_s")
    prepare = mean("generate_and_score/time_s")
    evals = [e["eval_runtime"] for e in history if "eval_runtime" in e]
    return {
        "step": round(step, 2), "rollout": round(rollout, 2), "weight_sync": round(sync, 3),
        "scoring": round(prepare - rollout - sync, 2), "policy_update": round(step - prepare, 2),
        "evaluation_each": round(sum(evals) / len(evals), 2) if evals else None,
        "rollout_tokens_per_s": round(mean("rollout/generated_tokens") / rollout, 1) if rollout else None,
        "rollouts_per_s": round(rollouts_per_step / rollout, 2) if rollout else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="offline", help="recipe in configs/ (offline or offline_gpu)")
    parser.add_argument("--output_dir", default="runs/offline")
    parser.add_argument("--corpus", choices=["slice", "full"], default="slice",
                        help="index a slice (CPU) or the whole SQuAD-open corpus (GPU)")
    parser.add_argument("--train_articles", type=int, default=10)
    parser.add_argument("--test_articles", type=int, default=2, help="SQuAD dev articles kept (validation is "
                        "the first eval_num_samples questions of the slice, unshuffled)")
    parser.add_argument("--distractors", type=int, default=500)
    parser.add_argument("--retriever_port", type=int, default=8000)
    parser.add_argument("--generator_port", type=int, default=8001)
    parser.add_argument("--generator", choices=["vllm", "transformers"], help="override the recipe's generator")
    parser.add_argument("--weight_sync", choices=["reload", "nccl", "ipc"], help="override the recipe's weight_sync")
    parser.add_argument("--generator_gpu", help="CUDA_VISIBLE_DEVICES of the vLLM server")
    parser.add_argument("--trainer_gpu", help="CUDA_VISIBLE_DEVICES of the trainer")
    parser.add_argument("--retriever_gpu", help="CUDA_VISIBLE_DEVICES of the retriever; set: search on that GPU")
    parser.add_argument("--generator_gpu_memory_utilization", type=float, default=0.3,
                        help="vLLM's share of its GPU (low: it shares the GPU with the trainer or retriever)")
    parser.add_argument("--generator_kv_cache_gib", type=float,
                        help="fixed KV cache of the GPU vLLM server (for several jobs side by side on one GPU)")
    parser.add_argument("--generator_enforce_eager", action="store_true",
                        help="vLLM without CUDA graphs on GPU (faster start; always on for CPU)")
    parser.add_argument("--launcher", choices=["python", "accelerate"], default="python")
    parser.add_argument("--model", help="model folder to train and serve (default: the offline model)")
    parser.add_argument("--dry_run", action="store_true", help="print the launch commands as JSON and exit")
    args, train_overrides = parser.parse_known_args()
    if any(flag.split("=")[0] == "--model_name_or_path" for flag in train_overrides):
        parser.error("--model_name_or_path would reach the trainer but not the vLLM server, which would go on serving "
                     "the offline model; pass --model <folder>, which sets both")
    logging.basicConfig(level=logging.INFO, format="[offline_job %(asctime)s] %(message)s", datefmt="%H:%M:%S")
    start = time.monotonic()
    # For every process started here: glibc's adaptive mmap threshold (up to 32 MiB) keeps freed tensors in the heap,
    # so the CPU trainer held 4.0-4.5 GiB between micro-batches instead of 3.2; blocks of 1 MiB and more are mapped
    # and unmapped instead (the job's peak 12.6 -> 11.4 GiB: python -m experiments.main_job, experiments/results).
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(2**20))
    out = (ROOT / args.output_dir).resolve()

    recipe = yaml.safe_load((ROOT / "configs" / f"{args.config}.yaml").read_text())
    uses_vllm = (args.generator or resolve_generator(recipe.get("generator", "vllm"))) == "vllm"
    weight_sync = args.weight_sync or recipe.get("weight_sync", "reload")
    if uses_vllm and weight_sync == "ipc" and args.generator_gpu != args.trainer_gpu:
        parser.error(f"--weight_sync ipc pushes to a server on the trainer's own GPU; got --generator_gpu "
                     f"{args.generator_gpu} and --trainer_gpu {args.trainer_gpu}")
    assets = prepare()
    if args.dry_run:
        data = {"corpus": assets.corpus, "train": assets.train_questions, "test": assets.test_questions}
    elif args.corpus == "slice":
        data = slice_data(assets, out / "data", args.train_articles, args.test_articles, args.distractors)
    else:
        data = {"corpus": assets.corpus, "train": assets.train_questions, "test": assets.test_questions}
    data["model"] = args.model or assets.model
    index = out / "data" / "index.faiss"
    generator = VLLMServerConfig.for_this_machine(
        data["model"], port=args.generator_port, log_file=str(out / "vllm.log"),
        gpu_memory_utilization=args.generator_gpu_memory_utilization, env=gpu_env(args.generator_gpu),
        **({"enforce_eager": True} if args.generator_enforce_eager else {}),
        **({"gpu_kv_cache_gib": args.generator_kv_cache_gib} if args.generator_kv_cache_gib else {}),
        **({"worker_extension_cls": IPC_WORKER_EXTENSION} if weight_sync == "ipc" else {}))
    retriever = RetrieverProcess(
        index_path=str(index), corpus_path=data["corpus"], retriever_model=assets.embedder, port=args.retriever_port,
        log_file=str(out / "retriever.log"), env=gpu_env(args.retriever_gpu),
        extra_args=("--faiss_gpu", "--gpu_backend", "torch") if args.retriever_gpu is not None else ())
    trainer = trainer_command(args, recipe, data, generator, out, train_overrides)
    if args.dry_run:
        print(json.dumps({
            "retriever": {"command": retriever.command(), "env": retriever.env},
            "generator": {"command": generator.command(), "env": generator.env} if uses_vllm else None,
            "trainer": {"command": trainer, "env": gpu_env(args.trainer_gpu)},
        }, indent=2))
        return
    index.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "retriever_server.build_index", "--corpus_path", data["corpus"],
                    "--retriever_model", assets.embedder, "--index_path", str(index)], check=True,
                   env={**os.environ, **gpu_env(args.retriever_gpu)})
    with contextlib.ExitStack() as servers:
        # vLLM starts up while the retriever and the trainer do (imports, model load: mostly one core each on the
        # 2-core CPU); the trainer waits for it before its first rollout (vllm_server_timeout).
        needs = {}
        if uses_vllm:
            vllm = VLLMServer(generator).launch()
            servers.callback(vllm.stop)
            needs["the vLLM server"] = (vllm.process, generator.log_file or "the output above")
        servers.enter_context(retriever)
        needs["the retrieval server"] = (retriever.process, retriever.log_file)
        logger.info("retriever up after %.0fs; training", time.monotonic() - start)
        # A failure says what killed the trainer and the memory it peaked at, not "died with <Signals.SIGKILL: 9>",
        # and a server that dies under the trainer stops it at once, named.
        run_reporting("trainer", trainer, needs=needs, env={**os.environ, **gpu_env(args.trainer_gpu)})

    state = json.loads((out / "trainer_state.json").read_text())
    history = state["log_history"]
    plot(history, out / "curves.png")
    evals = [e for e in history if "eval_em" in e]
    summary = {
        "em_before": evals[0]["eval_em"] if evals else None, "em_after": evals[-1]["eval_em"] if evals else None,
        "steps": max(e["step"] for e in history), "wall_time_s": round(time.monotonic() - start),
        "rewards": [e["reward"] for e in history if "reward" in e],
        "searches_per_rollout_before_after": [evals[0].get("eval_searches_per_rollout"),
                                              evals[-1].get("eval_searches_per_rollout")] if evals else None,
        "eval_em_by_step": {e["step"]: e["eval_em"] for e in evals},
        # the checkpoint training ended on (the collapse guard's choice by validation EM; None: the last step)
        "best_step": state.get("best_global_step"), "best_eval_em": state.get("best_metric"),
        "report_em_by_step": {e["step"]: e["report_em"] for e in evals if "report_em" in e},
        "evals": [{k: v for k, v in e.items() if k.startswith(("eval_", "report_")) or k == "step"} for e in evals],
        "train_searches_by_step": {e["step"]: e["rollout/searches_per_rollout"] for e in history
                                   if "rollout/searches_per_rollout" in e},
        "train_runtime_s": next((e["train_runtime"] for e in history if "train_runtime" in e), None),
        "per_step_s": time_split(history, rollouts_per_step=rollouts_per_step(recipe, train_overrides)),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    pd.DataFrame(history).to_csv(out / "log_history.csv", index=False)
    logger.info("done: %s; curves in %s", json.dumps(summary), out / "curves.png")


if __name__ == "__main__":
    main()
