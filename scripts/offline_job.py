"""The main job on the offline default, end to end, with no Hub access:

assets -> corpus slice + index -> ``searchr1-launch`` (retrieval server + vLLM server + trainer: EM before, GRPO
training, EM after) -> reward/EM curves (PNG) and a summary.

    python scripts/offline_job.py                     # the CPU recipe (configs/offline.yaml)
    python scripts/offline_job.py --max_steps 2       # any other flag is a recipe field (or a searchr1-launch flag)
    python scripts/offline_job.py --config offline_gpu --corpus full                                     # one GPU
    python scripts/offline_job.py --config offline_gpu --corpus full --generator vllm --weight_sync nccl \
        --generator_gpus 0 --trainer_gpus 1 --retriever_gpus 1                                            # two GPUs
    python scripts/offline_job.py ... --dry_run      # print the launch commands and exit

The processes, their GPUs and their lifetimes are ``searchr1-launch``'s (searchr1_trl/serving/launch.py): the plan is
the recipe's, and a plan field on the command line changes it. This job adds the offline data: it points the recipe
at the assets (``searchr1-assets``), the corpus it indexes and the index it builds, and reads the run's history into
a summary.

On a 2-core CPU the whole SQuAD-open corpus (31k passages) takes ~12 minutes to embed, so the job indexes a slice
that still holds every answer it asks about: the paragraphs of the first ``--test_articles`` SQuAD dev articles
(validation questions come only from those), of the first ``--train_articles`` SQuAD train articles (training
questions come only from those), and Wikipedia leads as distractors.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import yaml

from searchr1_trl.assets.offline import corpus_slice, prepare
from searchr1_trl.cli import launch  # the launcher plans in a child process: this one holds no trl
from searchr1_trl.serving.launch import run_node
from searchr1_trl.serving.processes import exit_on_signals

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


def fixed_costs(history: list[dict]) -> dict[str, float | int | None]:
    """Seconds a run spends outside its optimizer steps: the trainer's start-up (process start to the first step,
    the warm start and the step-0 validation included) and the warm start's share, the first validation, the
    validations' count and total seconds (with the report sample's rollouts on their own: after a validation that
    decided to stop, and on the saved model after training), and the last of those."""
    startup = next((e for e in history if "time/startup_s" in e), {})
    each = [e["eval_runtime"] for e in history if "eval_runtime" in e]
    alone = sum(e["report_runtime"] for e in history if "report_runtime" in e)
    saved = sum(e["saved_report_runtime"] for e in history if "saved_report_runtime" in e)

    def seconds(value: float | None) -> float | None:
        return None if value is None else round(value, 1)

    return {"startup_s": seconds(startup.get("time/startup_s")),
            "warm_start_s": seconds(startup.get("time/warm_start_s")),
            "first_validation_s": seconds(each[0]) if each else None, "validations": len(each),
            "validation_s": seconds(sum(each) + alone + saved), "saved_report_s": seconds(saved)}


def validations(history: list[dict], best_step: int | None) -> dict:
    """Each validation's figures (``eval_*``, ``report_*``) by step, the report EM by step, and the step and report EM
    of the model the run saved (``best_step``, the checkpoint training ended on; None: the last). With ``report_at:
    ends`` the report sample is rolled out on its own where a validation decided to stop (``report_*``, logged after
    it) and on the checkpoint training ended on, after training (``saved_report_*``, ``saved_report_step``): each joins
    the validation of the same weights as its ``report_*``."""
    evals = [{k: v for k, v in e.items() if k.startswith(("eval_", "report_")) or k == "step"}
             for e in history if "eval_em" in e]
    by_step = {entry["step"]: entry for entry in evals}
    for entry in history:
        if "saved_report_step" in entry:  # the checkpoint training ended on, after training
            step, prefix = entry["saved_report_step"], "saved_report_"
        elif "report_em" in entry and "eval_em" not in entry:  # the step whose validation decided to stop
            step, prefix = entry["step"], "report_"
        else:
            continue
        if step in by_step:
            by_step[step].update({key.removeprefix("saved_"): value for key, value in entry.items()
                                  if key.startswith(prefix) and key != "saved_report_step"})
    report = {e["step"]: e["report_em"] for e in evals if "report_em" in e}
    saved_step = best_step if best_step is not None else max((e["step"] for e in evals), default=None)
    return {"evals": evals, "report_em_by_step": report, "saved_step": saved_step,
            "saved_report_em": report.get(saved_step)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="offline", help="recipe in configs/ (offline or offline_gpu)")
    parser.add_argument("--output_dir", help="where the run goes (default: the recipe's output_dir)")
    parser.add_argument("--corpus", choices=["slice", "full"], default="slice",
                        help="index a slice (CPU) or the whole SQuAD-open corpus (GPU)")
    parser.add_argument("--train_articles", type=int, default=10)
    parser.add_argument("--test_articles", type=int, default=2, help="SQuAD dev articles kept (validation is "
                        "the first eval_num_samples questions of the slice, unshuffled)")
    parser.add_argument("--distractors", type=int, default=500)
    parser.add_argument("--model", help="model folder to train and serve (default: the offline model)")
    parser.add_argument("--dry_run", action="store_true", help="print the launch commands and exit")
    args, overrides = parser.parse_known_args()
    exit_on_signals()  # SIGTERM/SIGINT to the job: every child is stopped on the way out
    logging.basicConfig(level=logging.INFO, format="[offline_job %(asctime)s] %(message)s", datefmt="%H:%M:%S")
    start = time.monotonic()
    # For every process started here: glibc's adaptive mmap threshold (up to 32 MiB) keeps freed tensors in the heap,
    # so the CPU trainer held 4.0-4.5 GiB between micro-batches instead of 3.2; blocks of 1 MiB and more are mapped
    # and unmapped instead (the job's peak 12.6 -> 11.4 GiB: python -m experiments.main_job, experiments/results).
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(2**20))
    recipe = yaml.safe_load((ROOT / "configs" / f"{args.config}.yaml").read_text())
    out = (ROOT / (args.output_dir or recipe["output_dir"])).resolve()
    assets = prepare()
    if args.corpus == "slice" and not args.dry_run:
        data = slice_data(assets, out / "data", args.train_articles, args.test_articles, args.distractors)
    else:
        data = {"corpus": assets.corpus, "train": assets.train_questions, "test": assets.test_questions}
    index = out / "data" / "index.faiss"
    job = ["--config", args.config, "--output_dir", str(out), "--model_name_or_path", args.model or assets.model,
           "--train_data_path", data["train"], "--eval_data_path", data["test"], "--eval_on_start", "true",
           "--retriever_index_path", str(index), "--retriever_corpus_path", data["corpus"],
           "--retriever_model", assets.embedder, "--retriever_name", Path(assets.embedder).name,
           "--retriever_gpu_backend", "torch",  # exact search on any CUDA: faiss-gpu has no wheel for every one
           *overrides]  # the command line's own flags last: they win
    if args.dry_run:
        launch.main([*job, "--dry_run"])
        return
    processes = launch.planned(job)
    retriever = next(p for p in processes if p.role == "retriever")
    index.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "retriever_server.build_index", "--corpus_path", data["corpus"],
                    "--retriever_model", assets.embedder, "--index_path", str(index)], check=True,
                   env={**os.environ, **retriever.env})  # on the retriever's GPUs
    # vLLM starts up while the retriever and the trainer do (imports, model load: mostly one core each on the 2-core
    # CPU); the trainer waits for it before its first rollout. A failure says what killed the trainer and the memory
    # it peaked at, and a server that dies under the trainer stops it at once, named.
    run_node(processes, node=0)
    logger.info("training done after %.0fs", time.monotonic() - start)

    state = json.loads((out / "trainer_state.json").read_text())
    history = state["log_history"]
    plot(history, out / "curves.png")
    validated = validations(history, state.get("best_global_step"))
    evals = validated["evals"]
    summary = {
        "em_before": evals[0]["eval_em"] if evals else None, "em_after": evals[-1]["eval_em"] if evals else None,
        "steps": max(e["step"] for e in history), "wall_time_s": round(time.monotonic() - start),
        "rewards": [e["reward"] for e in history if "reward" in e],
        "searches_per_rollout_before_after": [evals[0].get("eval_searches_per_rollout"),
                                              evals[-1].get("eval_searches_per_rollout")] if evals else None,
        "eval_em_by_step": {e["step"]: e["eval_em"] for e in evals},
        # the checkpoint training ended on (the collapse guard's choice by validation EM; None: the last step)
        "best_step": state.get("best_global_step"), "best_eval_em": state.get("best_metric"),
        **validated,  # evals, report_em_by_step, saved_step, saved_report_em: the figure to report
        "train_searches_by_step": {e["step"]: e["rollout/searches_per_rollout"] for e in history
                                   if "rollout/searches_per_rollout" in e},
        "train_runtime_s": next((e["train_runtime"] for e in history if "train_runtime" in e), None),
        "per_step_s": time_split(history, rollouts_per_step=rollouts_per_step(recipe, overrides)),
        "fixed_costs": fixed_costs(history),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    pd.DataFrame(history).to_csv(out / "log_history.csv", index=False)
    logger.info("done: %s; curves in %s", json.dumps(summary), out / "curves.png")


if __name__ == "__main__":
    main()
