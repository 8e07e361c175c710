"""What the warm start fine-tunes on, by retrieval depth: of a recipe's scripted traces (its warm-start questions, as
``warm_start`` draws them), how many hold a golden answer after the question's own search, how many more a second
(keyword) search rescues, and how many are left out: the headroom a second query has, before any training.

    python -m experiments.warm_start_mix --config offline_gpu --search_url http://127.0.0.1:8000/retrieve \\
        --topk 1 3 --num_traces 2000 --out experiments/results/warm_start_mix.jsonl

The retriever is the recipe's (for offline_gpu: MiniLM over the whole SQuAD-open corpus, ``--corpus full``); any
other flag overrides the recipe (``--train_data_path``, ``--max_turns`` ...).
"""

from __future__ import annotations

import argparse

from transformers import AutoTokenizer

from experiments.report import report
from searchr1_trl.training.loading import load_recipe
from searchr1_trl.training.parts import build_task
from searchr1_trl.training.warm_start import scripted_warm_start_traces


def mix(config: str, search_url: str, topk: int, num_traces: int, seed: int, overrides: list[str] = ()) -> dict:
    args, model_args = load_recipe([  # bf16 off: nothing trains here, so a GPU recipe reads on a CPU machine too
        "--config", config, "--search_url", search_url, "--topk", str(topk), "--warm_start_traces", str(num_traces),
        "--warm_start_second_search", "true", "--data_seed", str(seed), "--report_to", "none", "--bf16", "false",
        *overrides,
    ])
    tokenizer = AutoTokenizer.from_pretrained(model_args.model_name_or_path)
    rollouts, kept = scripted_warm_start_traces(args, model_args.model_name_or_path, tokenizer, build_task(args))
    twice = sum(r.num_tool_calls == 2 for r in kept)
    return {
        "measure": "warm_start_mix", "config": config, "topk": topk, "data_seed": seed, "traces": len(rollouts),
        "first_search_holds_gold": round((len(kept) - twice) / len(rollouts), 4),
        "second_search_rescues": round(twice / len(rollouts), 4), "kept": len(kept), "kept_with_two_searches": twice,
        "left_out": round(1 - len(kept) / len(rollouts), 4),
        **({"overrides": " ".join(overrides)} if overrides else {}),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="offline_gpu", help="the recipe whose warm start to read")
    parser.add_argument("--search_url", required=True, help="the recipe's retriever")
    parser.add_argument("--topk", type=int, nargs="+", default=[1, 3], help="passages per search, one row each")
    parser.add_argument("--num_traces", type=int, default=2000)
    parser.add_argument("--data_seed", type=int, default=0, help="the run's data_seed (the warm start draws seed + 1)")
    parser.add_argument("--out", default=None, help="JSONL file the rows are appended to")
    args, overrides = parser.parse_known_args()
    for topk in args.topk:
        report(mix(args.config, args.search_url, topk, args.num_traces, args.data_seed, overrides), args.out)


if __name__ == "__main__":
    main()
