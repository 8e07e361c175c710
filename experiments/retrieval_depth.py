"""How deep the gold lies: of a seeded question sample, the fraction whose top k passages hold a golden answer, for
k = 1 ... 10, and how many questions a second page (ranks 4-6, what ``exclude_seen_passages`` returns to a repeated
search) rescues when the top 3 miss. The ceiling a second search can lift, before any model reads anything.

    python -m experiments.retrieval_depth --search_url http://127.0.0.1:8000/retrieve \\
        --data $SEARCHR1_CACHE/data/squad_open/test.parquet --num_samples 500 --sample_offset 500 \\
        --out experiments/results/retrieval_depth.jsonl

The sample is ``searchr1-eval``'s (``--sample_seed``, ``--sample_offset``: 500 after 500 is the learning runs' report
sample); the retriever is whatever serves ``--search_url`` (the recipes': MiniLM over the full SQuAD-open corpus).
"""

from __future__ import annotations

import argparse

import httpx

from experiments.report import report
from searchr1_trl.cli.eval import EvalConfig, load_questions
from searchr1_trl.tasks.common.rubric import normalized_golds, passages_hold_gold

DEPTHS = (1, 2, 3, 4, 5, 6, 8, 10)


def depth(search_url: str, samples, batch: int = 50) -> dict:
    """Recall at each of :data:`DEPTHS` and the second page's rescue over ``samples``."""
    holds = []  # per question, per rank: does that passage hold a golden answer
    for start in range(0, len(samples), batch):
        chunk = samples[start:start + batch]
        response = httpx.post(search_url, json={"queries": [s.question for s in chunk], "topk": max(DEPTHS)},
                              timeout=600)
        response.raise_for_status()
        for sample, docs in zip(chunk, response.json()["result"], strict=True):
            golds = normalized_golds(sample.golden_answers)
            holds.append([passages_hold_gold(doc["contents"], golds) for doc in docs])
    return {
        "questions": len(holds),
        **{f"recall_at_{k}": round(sum(any(h[:k]) for h in holds) / len(holds), 3) for k in DEPTHS},
        "second_page_rescues": round(sum(not any(h[:3]) and any(h[3:6]) for h in holds) / len(holds), 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--search_url", default="http://127.0.0.1:8000/retrieve")
    parser.add_argument("--data", required=True, help="question parquet (question, golden_answers, data_source)")
    parser.add_argument("--num_samples", type=int, default=500)
    parser.add_argument("--sample_offset", type=int, default=500)
    parser.add_argument("--sample_seed", type=int, default=0)
    parser.add_argument("--out", help="append the JSON line to this file")
    args = parser.parse_args()
    config = EvalConfig(data=[args.data], num_samples=args.num_samples,
                        sample_offset=args.sample_offset, sample_seed=args.sample_seed)
    samples = [sample for _, sample in load_questions(config)]
    report({"measure": "retrieval_depth", "data": args.data, "num_samples": args.num_samples,
            "sample_offset": args.sample_offset, "sample_seed": args.sample_seed,
            **depth(args.search_url, samples)}, args.out)


if __name__ == "__main__":
    main()
