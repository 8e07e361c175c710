"""The main job on the offline default, end to end, with no Hub access:

assets -> corpus slice + index -> retrieval server + vLLM server -> EM before -> GRPO training -> EM after ->
reward/EM curves (PNG) and a summary -> servers stopped.

    python scripts/offline_job.py                     # the CPU recipe (configs/offline.yaml)
    python scripts/offline_job.py --max_steps 2       # extra flags go to scripts/train.py
    python scripts/offline_job.py --config offline_gpu --output_dir runs/offline_gpu --corpus full   # one GPU

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
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import yaml

from searchr1_trl.assets import prepare
from searchr1_trl.vllm_server import VLLMServer, VLLMServerConfig
from retriever_server.launch import RetrieverProcess

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
    kept, leads = [], 0
    with open(assets.corpus) as f:
        for line in f:
            row = json.loads(line)
            title = row["contents"].split("\n", 1)[0]
            if title in titles:
                kept.append(line)
            elif leads < distractors and int(row["id"]) > 20957:  # Wikipedia leads follow the SQuAD paragraphs
                kept.append(line)
                leads += 1
    paths = {"corpus": str(out / "corpus.jsonl"), "train": str(out / "train.parquet"), "test": str(out / "test.parquet")}
    Path(paths["corpus"]).write_text("".join(kept))
    train.to_parquet(paths["train"], index=False)
    test.to_parquet(paths["test"], index=False)
    logger.info("corpus slice: %d passages; %d train questions from %d articles, %d test questions from %d",
                len(kept), len(train), train_articles, len(test), test_articles)
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
    ax[1].plot([e["step"] for e in evals], [e["eval_em"] for e in evals], marker="o", color="C1")
    ax[1].set(title="validation EM (greedy)", xlabel="optimizer step", ylabel="exact match", ylim=(0, 1))
    ax[2].plot([e["step"] for e in train], [e.get("rollout/searches_per_rollout") for e in train], marker="o",
               label="searches / rollout")
    ax[2].plot([e["step"] for e in train], [e.get("rollout/status_done") for e in train], marker="o",
               label="fraction DONE")
    ax[2].set(title="rollouts", xlabel="optimizer step")
    ax[2].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


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
    args, train_overrides = parser.parse_known_args()
    logging.basicConfig(level=logging.INFO, format="[offline_job %(asctime)s] %(message)s", datefmt="%H:%M:%S")
    start = time.monotonic()
    out = (ROOT / args.output_dir).resolve()

    assets = prepare()
    if args.corpus == "slice":
        data = slice_data(assets, out / "data", args.train_articles, args.test_articles, args.distractors)
    else:
        data = {"corpus": assets.corpus, "train": assets.train_questions, "test": assets.test_questions}
    index = out / "data" / "index.faiss"
    index.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "retriever_server.build_index", "--corpus_path", data["corpus"],
                    "--retriever_model", assets.embedder, "--index_path", str(index)], check=True)
    generator = VLLMServerConfig.for_this_machine(assets.model, port=args.generator_port,
                                                  log_file=str(out / "vllm.log"))
    recipe = yaml.safe_load((ROOT / "configs" / f"{args.config}.yaml").read_text())
    uses_vllm = recipe.get("generator", "vllm") == "vllm"
    with contextlib.ExitStack() as servers:
        servers.enter_context(RetrieverProcess(index_path=str(index), corpus_path=data["corpus"],
                                               retriever_model=assets.embedder, port=args.retriever_port,
                                               log_file=str(out / "retriever.log")))
        if uses_vllm:
            servers.enter_context(VLLMServer(generator))
        logger.info("servers up after %.0fs; training", time.monotonic() - start)
        subprocess.run([
            sys.executable, str(ROOT / "scripts" / "train.py"), "--config", args.config,
            "--model_name_or_path", assets.model, "--output_dir", str(out),
            "--train_data_path", data["train"], "--eval_data_path", data["test"], "--eval_on_start", "true",
            "--search_url", f"http://127.0.0.1:{args.retriever_port}/retrieve",
            "--vllm_server_base_url", generator.base_url, "--weight_sync_dir", str(out / "generator_weights"),
            *train_overrides,
        ], check=True)

    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    plot(history, out / "curves.png")
    evals = [e for e in history if "eval_em" in e]
    summary = {
        "em_before": evals[0]["eval_em"], "em_after": evals[-1]["eval_em"],
        "steps": max(e["step"] for e in history), "wall_time_s": round(time.monotonic() - start),
        "rewards": [e["reward"] for e in history if "reward" in e],
        "searches_per_rollout_before_after": [evals[0].get("eval_searches_per_rollout"),
                                              evals[-1].get("eval_searches_per_rollout")],
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    pd.DataFrame(history).to_csv(out / "log_history.csv", index=False)
    logger.info("done: %s; curves in %s", json.dumps(summary), out / "curves.png")


if __name__ == "__main__":
    main()
