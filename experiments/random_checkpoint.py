"""Save a random-weight stand-in of a recipe model (published shape, no download) with the offline model's
tokenizer and chat template (same 151,936-token Qwen vocabulary), so a recipe's mechanics run at full size on a
machine without the Hub: ``python -m experiments.random_checkpoint --model Qwen/Qwen3-1.7B --out /root/qwen3_1_7b``."""

from __future__ import annotations

import argparse

from transformers import AutoTokenizer

from searchr1_trl.assets.offline import require
from searchr1_trl.assets.shapes import random_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="Qwen/Qwen3-1.7B")
    parser.add_argument("--out", required=True)
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(require().model)
    random_model(args.model, dtype=args.dtype).save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    print(f"saved a random-weight {args.model} to {args.out}")


if __name__ == "__main__":
    main()
