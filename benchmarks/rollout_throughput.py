"""Rollout throughput: completed rollouts/s and generated tokens/s of one Search-R1 workload through

(a) ``RolloutEngine`` + ``VLLMServerGenerator`` (every rollout its own task, vLLM's continuous batching),
(b) ``RolloutEngine`` + ``TransformersGenerator`` (in-process, concurrent turns batched into one ``generate``),
(c) TRL's own tool loop: ``GRPOTrainer(tools=[search], use_vllm=True, vllm_mode="server")`` on the same vLLM server,
    timing ``GRPOTrainer._generate`` (generation + tool calls, no scoring or training step).

The workload: ``--num_questions`` rollouts, i.e. ``num_questions / 2`` SQuAD dev questions asked twice each (GRPO
groups need ``num_generations >= 2``, and (a)/(b) get the very same list), sampled at ``--temperature`` with at most
``--max_tokens`` per turn and ``--max_turns`` assistant turns (TRL: ``max_tool_calling_iterations = max_turns - 1``).
"Generated tokens" are model tokens only (env mask / TRL tool mask 1). The offline Qwen2.5-Coder-0.5B calls
``search`` only as bare JSON, which TRL's response parser (and ours by default) reads as a final answer, so by default
every rollout is one turn; ``--bare_json_tool_calls`` makes (a)/(b) search and go multi-turn (then (c) runs other
conversations and is not comparable). The script starts its own retrieval server
(over the passages of the questions' articles) and vLLM server; their start-up and model loading are not timed.

    python -m benchmarks.rollout_throughput --num_questions 16

On CPU, (c) skips the NCCL weight-transfer handshake GRPOTrainer performs in server mode (it needs CUDA, and no
weights change while generating); nothing else in TRL's generation path is altered.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from retriever_server.launch import RetrieverProcess
from searchr1_trl.assets import require
from searchr1_trl.data import SearchR1Sample
from searchr1_trl.env import RetrievalClient, SearchR1Env, SearchR1EnvConfig
from searchr1_trl.generation import SamplingParams, TransformersGenerator, VLLMServerGenerator
from searchr1_trl.rollout import RolloutConfig, RolloutEngine
from searchr1_trl.vllm_server import VLLMServer, VLLMServerConfig

ARTICLES = 8  # SQuAD dev articles whose passages form the corpus and whose questions are asked


@dataclass
class Result:
    backend: str
    rollouts: int
    generated_tokens: int
    tool_calls: int
    seconds: float

    def line(self) -> str:
        return (f"{self.backend:<34} {self.rollouts / self.seconds:8.3f} rollouts/s {self.generated_tokens / self.seconds:9.1f}"
                f" tokens/s   ({self.rollouts} rollouts, {self.generated_tokens} tokens, {self.tool_calls} searches,"
                f" {self.seconds:.1f} s)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def workload(assets, num_questions: int, work: Path) -> tuple[list[SearchR1Sample], Path]:
    """(samples, corpus file): each of num_questions / 2 questions twice, and the passages of their articles."""
    questions = pd.read_parquet(assets.test_questions)
    titles = list(dict.fromkeys(questions["title"]))[:ARTICLES]
    questions = questions[questions["title"].isin(titles)]
    # Round-robin over the articles, so the searches hit different passages.
    picked = questions.groupby("title", sort=False).cumcount().sort_values(kind="stable").index[: num_questions // 2]
    samples = [SearchR1Sample(r.question, tuple(r.golden_answers), r.data_source)
               for r in questions.loc[picked].itertuples()]
    corpus = work / "corpus.jsonl"
    with open(assets.corpus) as source, open(corpus, "w") as out:
        out.writelines(line for line in source if json.loads(line)["contents"].split("\n", 1)[0] in titles)
    return [s for s in samples for _ in range(2)], corpus


def engine_run(tokenizer, generator, search_url: str, samples, params, rollout_config) -> Result:
    env = SearchR1Env(SearchR1EnvConfig(search_url=search_url))
    engine = RolloutEngine(tokenizer, generator, env, rollout_config)

    async def main():
        try:
            start = time.perf_counter()
            rollouts = await engine.run(samples, params)
            return rollouts, time.perf_counter() - start
        finally:
            await generator.aclose()
            await env.aclose()

    rollouts, seconds = asyncio.run(main())
    statuses = {}
    for r in rollouts:
        statuses[r.status.value] = statuses.get(r.status.value, 0) + 1
    print(f"  statuses: {statuses}; env metrics: {env.metrics()}", flush=True)
    return Result("", len(rollouts), sum(sum(r.env_mask) for r in rollouts),
                  sum(r.num_tool_calls for r in rollouts), seconds)


def trl_tool_loop(model_path: str, base_url: str, search_url: str, samples, args, work: Path) -> Result:
    """TRL's GRPOTrainer tool loop on the same server: time ``_generate`` on the same prompts."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer
    from trl.generation.vllm_client import VLLMClient

    retrieval = RetrievalClient(SearchR1EnvConfig(search_url=search_url))

    async def search(query: str) -> str:
        """Search a Wikipedia-derived knowledge base and return the top passages for a query.

        Args:
            query: The natural-language search query.
        """
        return await retrieval.search(query)

    env = SearchR1Env()
    prompts = [env.initial_messages(s) for s in samples]
    config = GRPOConfig(
        output_dir=str(work / "trl"), report_to="none", use_cpu=True, bf16=False,
        per_device_train_batch_size=len(prompts), num_generations=2, max_completion_length=args.max_rollout_tokens,
        max_tool_calling_iterations=args.max_turns - 1, temperature=args.temperature, top_p=1.0,
        use_vllm=True, vllm_mode="server", vllm_server_base_url=base_url,
        chat_template_kwargs={"enable_thinking": False},
    )
    # The NCCL weight-transfer handshake of server mode needs CUDA; generation does not, and no weights change here.
    VLLMClient.init_communicator = lambda self, device=0: None
    trainer = GRPOTrainer(
        model=model_path, args=config, reward_funcs=[lambda completions, **kw: [0.0] * len(completions)],
        train_dataset=Dataset.from_list([{"prompt": p} for p in prompts]), tools=[search],
    )
    trainer.vllm_generation.sync_weights = lambda: None
    trainer.vllm_generation.max_completion_length = args.max_tokens  # per-turn cap, like max_tokens in (a)/(b)
    start = time.perf_counter()
    _, completion_ids, tool_mask, completions, *_ = trainer._generate(prompts)
    seconds = time.perf_counter() - start
    searches = sum(len(m.get("tool_calls") or []) for c in completions for m in c if m.get("role") == "assistant")
    return Result("", len(completion_ids), sum(sum(m) for m in tool_mask), searches, seconds)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num_questions", type=int, default=16, help="rollouts per backend (even)")
    parser.add_argument("--max_tokens", type=int, default=128, help="tokens per assistant turn")
    parser.add_argument("--max_turns", type=int, default=3)
    parser.add_argument("--max_rollout_tokens", type=int, default=2048)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--bare_json_tool_calls", action="store_true",
                        help="(a)/(b) also read bare-JSON tool calls (RolloutConfig.bare_json_tool_calls); the offline "
                             "model calls tools only that way. Off by default: TRL's loop (c) cannot, so only with it "
                             "off do all three run the same conversations")
    parser.add_argument("--transformers_dtype", default="float32", help="float32 is faster than bfloat16 on most CPUs")
    parser.add_argument("--vllm_base_url", help="use this running vLLM server of the offline model instead of starting one")
    parser.add_argument("--backends", nargs="+", default=["transformers", "vllm", "trl"],
                        choices=["transformers", "vllm", "trl"])
    args = parser.parse_args(argv)
    if args.num_questions < 2 or args.num_questions % 2:
        parser.error(f"--num_questions must be an even number >= 2, got {args.num_questions}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assets = require()
    tokenizer = AutoTokenizer.from_pretrained(assets.model)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    rollout_config = RolloutConfig(max_turns=args.max_turns, max_rollout_tokens=args.max_rollout_tokens,
                                   bare_json_tool_calls=args.bare_json_tool_calls)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        samples, corpus = workload(assets, args.num_questions, work)
        index = work / "index.faiss"
        subprocess.run([sys.executable, "-m", "retriever_server.build_index", "--corpus_path", str(corpus),
                        "--retriever_model", assets.embedder, "--index_path", str(index)], check=True)
        with RetrieverProcess(index_path=str(index), corpus_path=str(corpus), retriever_model=assets.embedder,
                              port=free_port(), log_file=str(work / "retriever.log")) as retriever:
            print(f"{len(samples)} rollouts of {len(samples) // 2} questions, {params}, {rollout_config}", flush=True)
            if "transformers" in args.backends:  # before vLLM starts, so they don't share the CPU
                model = AutoModelForCausalLM.from_pretrained(assets.model, dtype=getattr(torch, args.transformers_dtype))
                generator = TransformersGenerator(model.eval(), tokenizer, max_batch_size=len(samples))
                result = engine_run(tokenizer, generator, retriever.url, samples, params, rollout_config)
                result.backend = f"(b) engine + transformers ({args.transformers_dtype})"
                results.append(result)
                print(result.line(), flush=True)
                del model, generator
            if {"vllm", "trl"} & set(args.backends):
                server_config = VLLMServerConfig.for_this_machine(assets.model, port=free_port(), max_model_len=4096,
                                                                  log_file=str(work / "vllm.log"))
                with contextlib.ExitStack() as stack:
                    base_url = args.vllm_base_url or stack.enter_context(VLLMServer(server_config)).base_url
                    if "vllm" in args.backends:
                        result = engine_run(tokenizer, VLLMServerGenerator(base_url), retriever.url, samples,
                                            params, rollout_config)
                        result.backend = "(a) engine + vLLM server"
                        results.append(result)
                        print(result.line(), flush=True)
                    if "trl" in args.backends:
                        try:
                            result = trl_tool_loop(assets.model, base_url, retriever.url, samples, args, work)
                            result.backend = "(c) TRL GRPOTrainer tool loop + vLLM"
                            results.append(result)
                            print(result.line(), flush=True)
                        except Exception as error:  # report why, keep the other backends' numbers
                            print(f"(c) TRL GRPOTrainer tool loop could not run: {error!r}", flush=True)
    print("\nsummary")
    for result in results:
        print(result.line())


if __name__ == "__main__":
    main()
