"""Where the passages go decides whether a small policy answers from them: the probe behind ``restate_question``.

Two measurements on questions whose paragraph is in the index, against a running generator server (vLLM's
OpenAI API, e.g. ``trl vllm-serve``) and a running retrieval server:

1. one turn, greedy, after a search with the question as the query: EM of the reply when the passages are
   (a) pasted into the prompt, followed by the answer format and the question (:data:`RESTATEMENT`),
   (b) the tool message of the search, as the environment returns it, (c) the same with ``restate_question``;
2. whole rollouts as in training (sampling temperature, ``max_turns``), with ``restate_question`` off and on:
   EM (the exact-match reward), searches per rollout and how rollouts end.

    searchr1-retriever --index_path <index.faiss> --corpus_path <corpus.jsonl> --retriever_model <embedder> &
    trl vllm-serve --model <policy> --port 8001 --enforce_eager --dtype float32 &   # CPU: float32 is faster
    python -m experiments.probes.answer_formats --model <policy> --corpus_path <corpus.jsonl> \\
        --questions ~/.cache/searchr1_trl/data/squad_open/train.parquet --out experiments/results/answer_formats.jsonl
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections import Counter

import pandas as pd
from transformers import AutoTokenizer

from experiments.report import report
from searchr1_trl.engine.generation import SamplingParams, VLLMServerGenerator
from searchr1_trl.engine.rollout import RolloutConfig, RolloutEngine
from searchr1_trl.tasks.common.data import SearchR1Sample
from searchr1_trl.tasks.common.rubric import RewardExactMatch
from searchr1_trl.tasks.common.search import RESTATEMENT, SearchR1EnvConfig
from searchr1_trl.tasks.search_r1.env import SEARCH_TOOL, SearchR1EnvFactory


def questions_in_corpus(path: str, corpus_path: str, n: int) -> list[SearchR1Sample]:
    """The first ``n`` questions (file order) whose article is in the retriever's corpus."""
    with open(corpus_path) as f:
        titles = {json.loads(line)["contents"].split("\n", 1)[0] for line in f}
    rows = pd.read_parquet(path)
    rows = rows[rows["title"].isin(titles)].head(n)
    return [SearchR1Sample(r.question, tuple(r.golden_answers), r.data_source) for r in rows.itertuples()]


async def one_turn_em(tokenizer, generator, search_url: str, samples: list[SearchR1Sample]) -> dict[str, float]:
    """Greedy EM of the reply right after a search for the question, per place of the passages."""
    plain = SearchR1EnvFactory(SearchR1EnvConfig(search_url=search_url))
    restating = SearchR1EnvFactory(SearchR1EnvConfig(search_url=search_url, restate_question=True))
    conversations: dict[str, list[list[dict]]] = {"passages_in_prompt": [], "tool_message": [],
                                                  "tool_message_restated": []}
    for sample in samples:
        call = {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "search", "arguments": {"query": sample.question}}}]}
        for name, envs in (("tool_message", plain), ("tool_message_restated", restating)):
            env = envs()
            start = [*env.reset(sample), call]
            conversations[name].append(start + (await env.step(start)).messages)
        passages = conversations["tool_message"][-1][-1]["content"]
        conversations["passages_in_prompt"].append([{
            "role": "user", "content": f"{passages}\n\n{RESTATEMENT.format(question=sample.question)}"}])
    params = SamplingParams.greedy(max_tokens=32)
    exact_match, result = RewardExactMatch(), {}
    for name, convs in conversations.items():
        prompts = [tokenizer.apply_chat_template(c, tools=[SEARCH_TOOL], add_generation_prompt=True, tokenize=True,
                                                 return_dict=False) for c in convs]
        replies = await asyncio.gather(*(generator.generate(p, params) for p in prompts))
        texts = [tokenizer.decode(r.token_ids, skip_special_tokens=True) for r in replies]
        scores = [exact_match.correct([{"role": "assistant", "content": text}], s.golden_answers)
                  for text, s in zip(texts, samples, strict=True)]
        result[f"one_turn_em/{name}"] = sum(scores) / len(scores)
    await plain.aclose()
    await restating.aclose()
    return result


async def rollout_em(tokenizer, generator, search_url: str, samples: list[SearchR1Sample], restate: bool,
                     args) -> dict[str, float]:
    """EM, searches and terminal statuses of sampled multi-turn rollouts, as in training."""
    env = SearchR1EnvFactory(SearchR1EnvConfig(search_url=search_url, restate_question=restate))
    engine = RolloutEngine(tokenizer, generator, env, RolloutConfig(max_turns=args.max_turns,
                                                                    bare_json_tool_calls=True))
    repeated = [s for s in samples for _ in range(args.samples_per_question)]
    params = SamplingParams(temperature=args.temperature, top_p=1.0, max_tokens=args.max_tokens_per_turn)
    rollouts = await engine.run(repeated, params)
    await env.aclose()
    exact_match = RewardExactMatch()
    prefix = f"rollouts/restate_{str(restate).lower()}"
    statuses = Counter(r.status.value for r in rollouts)
    return {
        f"{prefix}/em": sum(exact_match.correct(r.messages, r.sample.golden_answers) for r in rollouts) / len(rollouts),
        f"{prefix}/searches_per_rollout": sum(r.num_tool_calls for r in rollouts) / len(rollouts),
        **{f"{prefix}/status_{status}": count / len(rollouts) for status, count in sorted(statuses.items())},
    }


async def measure(args) -> dict:
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    generator = VLLMServerGenerator(args.generator_url, max_concurrency=args.max_concurrency)
    samples = questions_in_corpus(args.questions, args.corpus_path, args.num_questions)
    row = {"model": args.model, "questions": len(samples), "temperature": args.temperature,
           "samples_per_question": args.samples_per_question, "max_turns": args.max_turns}
    row.update(await one_turn_em(tokenizer, generator, args.search_url, samples))
    for restate in (False, True):
        row.update(await rollout_em(tokenizer, generator, args.search_url, samples, restate, args))
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="the policy the generator server serves (its tokenizer)")
    parser.add_argument("--corpus_path", required=True, help="the retriever's corpus (to pick answerable questions)")
    parser.add_argument("--questions", required=True, help="parquet with question, golden_answers, title")
    parser.add_argument("--generator_url", default="http://127.0.0.1:8001")
    parser.add_argument("--search_url", default="http://127.0.0.1:8000/retrieve")
    parser.add_argument("--num_questions", type=int, default=32)
    parser.add_argument("--samples_per_question", type=int, default=2)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--max_turns", type=int, default=3)
    parser.add_argument("--max_tokens_per_turn", type=int, default=64)
    parser.add_argument("--max_concurrency", type=int, default=16,
                        help="requests in flight (a CPU server with hundreds queued times them out)")
    parser.add_argument("--out", default=None, help="append the result as a JSON line")
    args = parser.parse_args()
    report(asyncio.run(measure(args)), args.out)


if __name__ == "__main__":
    main()
