"""searchr1-eval on the offline default, servers included: the paper-style table for CPU-sized samples.

    python scripts/eval_offline.py --num_samples 32 --output_dir runs/eval_cpu            # 2-core CPU, ~20 min
    python scripts/eval_offline.py --checkpoints <base> <trained> --corpus full ...       # more checkpoints, GPU
    python scripts/eval_offline.py ... --generator transformers --max_concurrency 256     # in-process, no vLLM
    python scripts/eval_offline.py ... --index_path runs/eval_cpu/data/index.faiss      # the index of an earlier run

Samples the SQuAD-open dev questions exactly as ``searchr1-eval`` does (seeded, across articles), indexes a corpus
slice that holds every sampled question's article plus ``--distractors`` Wikipedia leads (the whole 31k-passage
corpus takes ~12 minutes to embed on 2 cores; ``--corpus full`` indexes it all), starts the retriever and one
``trl vllm-serve`` per checkpoint in turn (none with ``--generator transformers``), and runs the three methods with
the offline recipes' env and rollout settings. Every setting and the ``searchr1-eval`` command line go to
``<output_dir>/command.txt``.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import shlex
import subprocess
import sys
import time
from pathlib import Path

from retriever_server.launch import RetrieverProcess
from searchr1_trl.assets.offline import corpus_slice, prepare
from searchr1_trl.cli import eval as eval_cli
from searchr1_trl.serving.vllm_server import VLLMServer, VLLMServerConfig
from searchr1_trl.training.as_trained import recorded_recipe

logger = logging.getLogger("eval_offline")

# The offline recipes' env and rollout settings (configs/offline_gpu.yaml), for a model that records no recipe (the base
# model): a trained checkpoint runs with the settings it recorded (searchr1_trl/training/as_trained.py).
AGENT_SETTINGS = ["--topk", "3", "--max_turns", "3", "--max_tokens_per_turn", "128", "--restate_question", "true",
                  "--bare_json_tool_calls", "true", "--close_tool_calls", "true"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoints", nargs="+", default=None, help="default: the offline base model")
    parser.add_argument("--num_samples", type=int, default=32)
    parser.add_argument("--sample_seed", type=int, default=0)
    parser.add_argument("--sample_offset", type=int, default=0, help="500 with --num_samples 500: the report sample")
    parser.add_argument("--methods", nargs="+", default=["direct", "rag", "agent"])
    parser.add_argument("--corpus", choices=["slice", "full"], default="slice")
    parser.add_argument("--distractors", type=int, default=500)
    parser.add_argument("--index_path", help="an index built before over the same corpus, e.g. <output_dir>/data/"
                        "index.faiss of an earlier --corpus full run (18 min on 2 cores): not built again; the "
                        "retriever refuses one built from another corpus")
    parser.add_argument("--generator", choices=["vllm", "transformers"], default="vllm",
                        help="vllm: a trl vllm-serve per checkpoint; transformers: each checkpoint in-process")
    parser.add_argument("--max_concurrency", type=int, default=8, help="rollouts in flight (8 suits a CPU vLLM)")
    parser.add_argument("--output_dir", default="runs/eval_cpu")
    parser.add_argument("--retriever_port", type=int, default=8020)
    parser.add_argument("--generator_port", type=int, default=8021)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="[eval_offline %(asctime)s] %(message)s", datefmt="%H:%M:%S")
    start = time.monotonic()
    out = Path(args.output_dir).resolve()
    (out / "data").mkdir(parents=True, exist_ok=True)
    assets = prepare()
    checkpoints = args.checkpoints or [assets.model]

    sample = eval_cli.EvalConfig(checkpoints=checkpoints, data=[assets.test_questions], num_samples=args.num_samples,
                                 sample_seed=args.sample_seed, sample_offset=args.sample_offset)
    questions = [s.question for _, s in eval_cli.load_questions(sample)]
    import pandas as pd

    test = pd.read_parquet(assets.test_questions)
    titles = set(test[test["question"].isin(questions)]["title"])
    corpus = assets.corpus
    if args.corpus == "slice":
        corpus = str(out / "data" / "corpus.jsonl")
        passages = corpus_slice(assets.corpus, titles, args.distractors, Path(corpus))
        logger.info("corpus slice: %d passages (%d articles + leads)", passages, len(titles))
    index = Path(args.index_path or out / "data" / "index.faiss")
    if not args.index_path:  # else the retriever checks that the index was built from this corpus
        subprocess.run([sys.executable, "-m", "retriever_server.build_index", "--corpus_path", corpus,
                        "--retriever_model", assets.embedder, "--index_path", str(index)], check=True)
    with RetrieverProcess(index_path=str(index), corpus_path=corpus, retriever_model=assets.embedder,
                          port=args.retriever_port, log_file=str(out / "retriever.log")) as retriever:
        for checkpoint in checkpoints:
            server = VLLMServerConfig.for_this_machine(checkpoint, port=args.generator_port,
                                                       log_file=str(out / "vllm.log"), startup_timeout_s=1200)
            generator = (["--generator", "vllm", "--vllm_server_base_url", server.base_url] if args.generator == "vllm"
                         else ["--generator", "transformers"])
            command = [
                "searchr1-eval", "--checkpoints", checkpoint, "--data", assets.test_questions,
                "--num_samples", str(args.num_samples), "--sample_seed", str(args.sample_seed),
                "--sample_offset", str(args.sample_offset),
                "--methods", *args.methods, "--search_url", retriever.url, *generator,
                "--max_concurrency", str(args.max_concurrency), "--output_dir", str(out),
                *(AGENT_SETTINGS if recorded_recipe(checkpoint) is None else []),
            ]
            with open(out / "command.txt", "a") as f:
                f.write(shlex.join(command) + "\n")
            with VLLMServer(server) if args.generator == "vllm" else contextlib.nullcontext():
                logger.info("evaluating %s after %.0fs", checkpoint, time.monotonic() - start)
                eval_cli.main(command[1:])
    logger.info("done in %.0fs: %s", time.monotonic() - start, out / eval_cli.RESULTS_MD)


if __name__ == "__main__":
    main()
