"""Policy-update throughput, memory and MFU of SearchR1Trainer on random-weight stand-ins of the recipe models,
plus in-process generation throughput. Prints one JSON line per measurement (and appends them to --out).

    python -m benchmarks.policy_update --model Qwen/Qwen3-1.7B --batch 8 --seq 2048
    python -m benchmarks.policy_update --model Qwen/Qwen3-8B --batch 4 --seq 2048 --activation_checkpointing

MFU = 6 x parameters x trained tokens/s (the dense-matmul cost of forward + backward; attention scores excluded)
divided by the bf16 matrix rate measured on this GPU at the start (8192^3 products).
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

import pandas as pd
import torch

from benchmarks.report import report
from benchmarks.zero3_update import synthetic_rollouts
from searchr1_trl.assets import require
from searchr1_trl.generation import SamplingParams, TransformersGenerator
from searchr1_trl.shapes import random_model
from searchr1_trl.trainer import SearchR1Config, SearchR1Trainer


def matmul_tflops(n: int = 8192, repeats: int = 10) -> float:
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    torch.cuda.synchronize()
    return 2 * n**3 * repeats / (time.perf_counter() - start) / 1e12


def policy_update(args, peak_tflops: float, work: Path) -> dict:
    questions = work / "q.parquet"
    pd.DataFrame({"question": ["q"] * 8, "golden_answers": [["a"]] * 8}).to_parquet(questions)
    config = SearchR1Config(
        output_dir=str(work / "run"), generator="transformers", per_device_train_batch_size=args.batch,
        gradient_accumulation_steps=1, num_generations=args.batch, bf16=True, train_data_path=str(questions),
        eval_strategy="no", report_to="none", activation_checkpointing=args.activation_checkpointing,
        max_steps=args.steps, learning_rate=1e-6,
    )
    model = random_model(args.model, dtype=args.dtype, device="cuda", attn_implementation=args.attn)
    params = sum(p.numel() for p in model.parameters())
    from transformers import AutoTokenizer

    trainer = SearchR1Trainer(model=model, args=config, processing_class=AutoTokenizer.from_pretrained(require().model))
    trainer.create_optimizer_and_scheduler(num_training_steps=args.steps)
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer.train(), which this loop stands in for
    inputs = {k: v.cuda() for k, v in synthetic_rollouts(args.batch, args.seq, args.prompt, model.config.vocab_size,
                                                          seed=0).items()}
    inputs["num_items_in_batch"] = inputs["tool_mask"].sum()
    if args.activation_checkpointing:  # Trainer.train() would do this; this loop stands in for it
        trainer.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(args.steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        loss = trainer.compute_loss(trainer.model, inputs)
        trainer.accelerator.backward(loss)
        trainer.optimizer.step()
        trainer.optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    step_s = sorted(times[1:])[len(times[1:]) // 2]  # median, after the step that allocates Adam's moments
    tokens_per_s = args.batch * args.seq / step_s
    return {
        "measure": "policy_update", "model": args.model, "params_b": round(params / 1e9, 3), "batch": args.batch,
        "seq": args.seq, "attn": args.attn, "dtype": args.dtype,
        "activation_checkpointing": args.activation_checkpointing,
        "step_s": round(step_s, 3), "tokens_per_s": round(tokens_per_s),
        "peak_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1),
        "mfu": round(6 * params * tokens_per_s / 1e12 / peak_tflops, 3), "peak_bf16_tflops": round(peak_tflops),
    }


def generation(args) -> dict:
    from transformers import AutoTokenizer

    model = random_model(args.model, dtype="bfloat16", device="cuda", attn_implementation=args.attn).eval()
    tokenizer = AutoTokenizer.from_pretrained(require().model)
    generator = TransformersGenerator(model, tokenizer, max_batch_size=args.gen_batch)
    prompt = torch.randint(0, 150000, (256,)).tolist()
    params = SamplingParams(temperature=1.0, max_tokens=args.gen_tokens)

    async def run():
        return await asyncio.gather(*[generator.generate(prompt, params) for _ in range(args.gen_batch)])

    asyncio.run(run())  # warm-up
    torch.cuda.synchronize()
    start = time.perf_counter()
    outputs = asyncio.run(run())
    seconds = time.perf_counter() - start
    generated = sum(len(o.token_ids) for o in outputs)
    return {"measure": "generation", "model": args.model, "batch": args.gen_batch, "tokens": generated,
            "tokens_per_s": round(generated / seconds)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="Qwen/Qwen3-1.7B")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--attn", default="sdpa")
    parser.add_argument("--dtype", default="float32",
                        help="weight dtype (float32 = fp32 master weights + bf16 autocast)")
    parser.add_argument("--activation_checkpointing", action="store_true")
    parser.add_argument("--generation", action="store_true", help="also measure in-process generation")
    parser.add_argument("--gen_batch", type=int, default=64)
    parser.add_argument("--gen_tokens", type=int, default=256)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as work:
        results.append(policy_update(args, matmul_tflops(), Path(work)))
    torch.cuda.empty_cache()
    if args.generation:
        results.append(generation(args))
    for result in results:
        report(result, args.out)


if __name__ == "__main__":
    main()
