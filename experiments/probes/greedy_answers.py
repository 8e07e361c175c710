"""What a policy answers: greedy rollouts of the first SQuAD-open dev questions, before and after training, one JSON
line per rollout (question, golden answers, status, each assistant turn, whether a search result held the gold).
In-process generation (one GPU, or the CPU for a smoke run); the retrieval server is started on the given index.

    python -m experiments.probes.greedy_answers --index_path runs/offline_gpu/data/index.faiss \\
        --models ~/.cache/searchr1_trl/models/Qwen2.5-Coder-0.5B-Instruct runs/offline_gpu/checkpoint-20
"""

from __future__ import annotations

import argparse
import asyncio
import json

import pandas as pd
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from retriever_server.launch import RetrieverProcess
from searchr1_trl.assets.offline import require
from searchr1_trl.engine.generation import SamplingParams
from searchr1_trl.engine.in_process import TransformersGenerator
from searchr1_trl.engine.rollout import RolloutConfig, RolloutEngine
from searchr1_trl.tasks.common.data import SearchR1Sample
from searchr1_trl.tasks.common.search import SearchR1EnvConfig
from searchr1_trl.tasks.search_r1.env import SearchR1EnvFactory


def describe(rollout) -> dict:
    turns = []
    for message in rollout.messages[1:]:
        if message["role"] == "assistant":
            call = message.get("tool_calls", [{}])[0].get("function")
            turns.append(message.get("content", "")[:150] + (f" CALL {json.dumps(call)[:100]}" if call else ""))
    results = " ".join(m.get("content") or "" for m in rollout.messages if m["role"] == "tool").lower()
    return {"q": rollout.sample.question, "gold": list(rollout.sample.golden_answers[:2]),
            "status": rollout.status.value, "turns": turns,
            "gold_in_results": any(g.lower() in results for g in rollout.sample.golden_answers)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--index_path", required=True)
    parser.add_argument("--corpus_path", default=None, help="the index's corpus (default: the whole SQuAD-open)")
    parser.add_argument("--models", nargs="+", required=True, help="model folders (base, checkpoints)")
    parser.add_argument("--num_questions", type=int, default=12)
    parser.add_argument("--max_turns", type=int, default=3)
    args = parser.parse_args()
    assets = require()
    tokenizer = AutoTokenizer.from_pretrained(assets.model)
    test = pd.read_parquet(assets.test_questions).head(args.num_questions)
    samples = [SearchR1Sample(r.question, tuple(r.golden_answers), r.data_source) for r in test.itertuples()]
    device, dtype = ("cuda", torch.bfloat16) if torch.cuda.is_available() else ("cpu", torch.float32)
    with RetrieverProcess(args.index_path, args.corpus_path or assets.corpus, assets.embedder, port=8010) as retriever:
        for path in args.models:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
            engine = RolloutEngine(tokenizer, TransformersGenerator(model, tokenizer),
                                   SearchR1EnvFactory(SearchR1EnvConfig(search_url=retriever.url)),
                                   RolloutConfig(max_turns=args.max_turns, bare_json_tool_calls=True))
            print("=====", path)
            for rollout in asyncio.run(engine.run(samples, SamplingParams.greedy(max_tokens=128))):
                print(json.dumps(describe(rollout)), flush=True)


if __name__ == "__main__":
    main()
