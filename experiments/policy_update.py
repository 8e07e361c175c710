"""Policy-update throughput, memory and MFU of SearchR1Trainer on random-weight stand-ins of the recipe models,
plus in-process generation throughput. Prints one JSON line per measurement (and appends them to --out).

    python -m experiments.policy_update --model Qwen/Qwen3-1.7B --batch 8 --seq 2048
    python -m experiments.policy_update --model Qwen/Qwen3-8B --batch 4 --seq 2048 --activation_checkpointing
    # the levers (searchr1_trl/training/update.py and TRL's own), one flag each:
    python -m experiments.policy_update --model Qwen/Qwen3-1.7B --dtype bfloat16 --fp32_master_weights \
        --padding_free --ragged --compile_layers
    # the offline recipe's update: its 0.5B model, 8 micro-batches of 8 rollouts per optimizer step
    python -m experiments.policy_update --model PATH/Qwen2.5-Coder-0.5B-Instruct --batch 8 --accumulation 8 \
        --seq 1024 --ragged

MFU = 6 x parameters x trained tokens/s (the dense-matmul cost of forward + backward; attention scores excluded)
divided by the bf16 matrix rate measured on this GPU at the start (8192^3 products). Trained tokens are the real
(prompt + completion) tokens of the rollouts: padding is not counted, so a padded and a packed run of the same
``--ragged`` batch are compared on the same work. To set a lever's numbers beside the baseline's (same seed: same
weights, same batch), each line has ``logp_mean``, the mean log-prob of the loss's tokens (tool tokens out) in the
first micro-batch before any step, and ``grad_norm``, the first step's gradient norm (the first step's loss itself
is -mean advantage whatever the model, the policy ratio being 1).
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

import pandas as pd
import torch

from experiments.report import report
from experiments.zero3_update import matmul_tflops, synthetic_rollouts
from searchr1_trl.assets.offline import require
from searchr1_trl.assets.shapes import random_model
from searchr1_trl.engine.generation import SamplingParams
from searchr1_trl.engine.in_process import TransformersGenerator
from searchr1_trl.training.trainer import SearchR1Config, SearchR1Trainer


def ragged(rollouts: dict, seed: int) -> dict:
    """``rollouts`` with completions of uniformly drawn lengths (1/8 to all of the budget), padded on the right as
    GRPOTrainer pads them: the padding that ``--padding_free`` packs away."""
    rows, completion = rollouts["completion_ids"].shape
    lengths = torch.randint(completion // 8, completion + 1, (rows, 1), generator=torch.Generator().manual_seed(seed))
    mask = (torch.arange(completion) < lengths).long()
    return {**rollouts, "completion_ids": rollouts["completion_ids"] * mask, "completion_mask": mask}


def build_model(args):
    """A random-weight stand-in of a published shape, or the checkpoint at ``args.model`` (a folder)."""
    torch.manual_seed(args.seed)
    if Path(args.model).is_dir():
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype),
                                                    attn_implementation=args.attn).cuda()
    return random_model(args.model, dtype=args.dtype, device="cuda", attn_implementation=args.attn)


def policy_update(args, peak_tflops: float, work: Path) -> dict:
    questions = work / "q.parquet"
    pd.DataFrame({"question": ["q"] * 8, "golden_answers": [["a"]] * 8}).to_parquet(questions)
    config = SearchR1Config(
        output_dir=str(work / "run"), generator="transformers", per_device_train_batch_size=args.batch,
        gradient_accumulation_steps=args.accumulation, num_generations=args.batch, bf16=True,
        train_data_path=str(questions), eval_strategy="no", report_to="none",
        activation_checkpointing=args.activation_checkpointing, max_steps=args.steps, learning_rate=1e-6,
        optim=args.optim, fp32_master_weights=args.fp32_master_weights, padding_free=args.padding_free,
        use_liger_kernel=args.use_liger_kernel, compile_layers=args.compile_layers,
    )
    model = build_model(args)
    params = sum(p.numel() for p in model.parameters())
    from transformers import AutoTokenizer

    trainer = SearchR1Trainer(model=model, args=config, processing_class=AutoTokenizer.from_pretrained(require().model))
    trainer.create_optimizer_and_scheduler(num_training_steps=args.steps)
    trainer.current_gradient_accumulation_steps = args.accumulation  # set by Trainer.train(), which this stands in for
    rows = args.batch * args.accumulation
    rollouts = synthetic_rollouts(rows, args.seq, args.prompt, model.config.vocab_size, seed=args.seed)
    if args.ragged:
        rollouts = ragged(rollouts, args.seed)
    micro_batches = [{k: v[i * args.batch:(i + 1) * args.batch].cuda() for k, v in rollouts.items()}
                     for i in range(args.accumulation)]
    for micro_batch in micro_batches:  # TRL counts the loss's tokens over the whole step
        micro_batch["num_items_in_batch"] = (rollouts["completion_mask"] * rollouts["tool_mask"]).sum().cuda()
    real_tokens = int(rollouts["prompt_mask"].sum() + rollouts["completion_mask"].sum())
    if args.activation_checkpointing:  # Trainer.train() would do this; this loop stands in for it
        trainer.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    trainer.model.train()
    first = micro_batches[0]
    loss_mask = (first["completion_mask"] * first["tool_mask"]).bool()
    with torch.no_grad():  # the lever's log-probs of the loss's tokens, to set beside the baseline's
        logps, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, torch.cat([first["prompt_ids"], first["completion_ids"]], 1),
            torch.cat([first["prompt_mask"], first["completion_mask"]], 1), first["completion_ids"].size(1))
    logp_mean = float(logps[loss_mask].float().mean())
    torch.cuda.reset_peak_memory_stats()
    times, grad_norms = [], []
    for _ in range(args.steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for micro_batch in micro_batches:
            trainer.accelerator.backward(trainer.compute_loss(trainer.model, micro_batch))
        if not grad_norms:  # outside the timing would cost a sync per step; the first step is not timed anyway
            grad_norms.append(float(torch.linalg.vector_norm(torch.stack(
                [p.grad.float().norm() for p in trainer.model.parameters() if p.grad is not None]))))
        trainer.optimizer.step()
        trainer.optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    step_s = sorted(times[1:])[len(times[1:]) // 2]  # median, after the step that allocates Adam's moments
    tokens_per_s = real_tokens / step_s
    return {
        "measure": "policy_update", "model": args.model, "params_b": round(params / 1e9, 3), "batch": args.batch,
        "accumulation": args.accumulation, "seq": args.seq, "ragged": args.ragged, "attn": args.attn,
        "dtype": args.dtype, "activation_checkpointing": args.activation_checkpointing, "optim": args.optim,
        "fp32_master_weights": args.fp32_master_weights, "padding_free": args.padding_free,
        "use_liger_kernel": args.use_liger_kernel, "compile_layers": args.compile_layers, "real_tokens": real_tokens,
        "padding_fraction": round(1 - real_tokens / (rows * args.seq), 3),
        "step_s": round(step_s, 3), "tokens_per_s": round(tokens_per_s),
        "peak_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1),
        "mfu": round(6 * params * tokens_per_s / 1e12 / peak_tflops, 3), "peak_bf16_tflops": round(peak_tflops),
        "logp_mean": round(logp_mean, 5), "grad_norm": round(grad_norms[0], 5),
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
    parser.add_argument("--model", default="Qwen/Qwen3-1.7B",
                        help="a published shape (searchr1_trl/assets/shapes.py, random weights) or a checkpoint folder")
    parser.add_argument("--batch", type=int, default=8, help="rollouts per micro-batch")
    parser.add_argument("--accumulation", type=int, default=1, help="micro-batches per optimizer step")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--attn", default="sdpa")
    parser.add_argument("--dtype", default="float32",
                        help="weight dtype (float32 = fp32 master weights + bf16 autocast)")
    parser.add_argument("--seed", type=int, default=0, help="of the weights and the rollouts")
    parser.add_argument("--ragged", action="store_true", help="completions of random lengths, padded")
    parser.add_argument("--activation_checkpointing", action="store_true")
    parser.add_argument("--optim", default="adamw_torch_fused", help="TrainingArguments.optim")
    parser.add_argument("--fp32_master_weights", action="store_true", help="with --dtype bfloat16")
    parser.add_argument("--padding_free", action="store_true")
    parser.add_argument("--compile_layers", action="store_true",
                        help="the recipe's compile_layers: torch.compile each decoder layer (the untimed first step "
                             "compiles)")
    parser.add_argument("--use_liger_kernel", action="store_true",
                        help="TRL's Liger layer kernels (needs liger-kernel; no gain measured on an H200)")
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
