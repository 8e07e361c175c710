"""The policy update under DeepSpeed ZeRO-3 through ``Trainer.train()`` (DeepSpeed engine, optimizer, scheduler,
logging), with the rollouts replaced by one fixed synthetic batch so the update is measured alone: per-GPU peak
memory, step time and tokens/s of a random-weight stand-in of a recipe model, and the loss of each step.

    accelerate launch --config_file accelerate_configs/zero3.yaml --num_processes 2 -m experiments.zero3_update \\
        --model Qwen/Qwen3-8B --per_device_batch 4 --seq 2048 --steps 3 --activation_checkpointing
    # loss check: the same small model and global batch under ZeRO-3 on 2 GPUs and without DeepSpeed on 1 GPU
    accelerate launch --config_file accelerate_configs/zero3.yaml --num_processes 2 -m experiments.zero3_update \\
        --model Qwen/Qwen3-1.7B --num_hidden_layers 4 --per_device_batch 2 --steps 1
    accelerate launch --config_file accelerate_configs/single_gpu.yaml -m experiments.zero3_update \\
        --model Qwen/Qwen3-1.7B --num_hidden_layers 4 --per_device_batch 4 --steps 1

The global batch (``per_device_batch`` x processes rows, the same rows whatever the split) and the weights are
seeded, so the first step's loss must agree across topologies up to bf16 rounding. Prints one JSON line on rank 0,
with the step's MFU on a GPU (as ``experiments.policy_update`` counts it, per GPU). ``--model`` may also be a folder
(a checkpoint, e.g. the tests' tiny model). The recipe knobs ``--compile_layers`` and ``--padding_free`` go to the
trainer: under ZeRO-3 the first is refused (torch.compile traces into ZeRO-3's parameter hooks and recompiles until
its limit), under ZeRO-1/2 (an accelerate config with ``zero_stage: 2``) it compiles.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import pandas as pd
import torch
from accelerate import PartialState
from transformers import AutoModelForCausalLM, AutoTokenizer

from experiments.report import report
from searchr1_trl.assets.offline import require
from searchr1_trl.assets.shapes import random_model
from searchr1_trl.training.trainer import SearchR1Config, SearchR1Trainer


def matmul_tflops(n: int = 8192, repeats: int = 10) -> float:
    """The bf16 matrix rate this GPU reaches (8192^3 products): the denominator of MFU."""
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    torch.cuda.synchronize()
    return 2 * n**3 * repeats / (time.perf_counter() - start) / 1e12


def synthetic_rollouts(rows: int, seq: int, prompt: int, vocab: int, seed: int) -> dict:
    """A global rollout batch as GRPOTrainer hands it to compute_loss: prompt + completion, tool tokens masked."""
    generator = torch.Generator().manual_seed(seed)
    completion = seq - prompt
    tool_mask = torch.ones(rows, completion, dtype=torch.long)
    tool_mask[:, completion // 4: completion // 2] = 0  # a block of tool-response tokens
    return {
        "prompt_ids": torch.randint(0, vocab, (rows, prompt), generator=generator),
        "prompt_mask": torch.ones(rows, prompt, dtype=torch.long),
        "completion_ids": torch.randint(0, vocab, (rows, completion), generator=generator),
        "completion_mask": torch.ones(rows, completion, dtype=torch.long),
        "tool_mask": tool_mask,
        "advantages": torch.randn(rows, generator=generator),
    }


class FixedRolloutsTrainer(SearchR1Trainer):
    """SearchR1Trainer whose every rollout batch is this process's share of one fixed global batch."""

    def __init__(self, *args, rollouts: dict, **kwargs):
        super().__init__(*args, **kwargs)
        rank, world = self.accelerator.process_index, self.accelerator.num_processes
        rows = len(rollouts["advantages"]) // world
        self._rollouts = {k: v[rank * rows:(rank + 1) * rows] for k, v in rollouts.items()}
        self._rollouts["num_items_in_batch"] = rollouts["tool_mask"].sum()  # global count, as TRL gathers it

    def _generate_and_score_completions(self, generation_batch):
        return {k: v.to(self.accelerator.device) for k, v in self._rollouts.items()}


def main(argv: list[str] | None = None) -> None:
    """``argv``: the command line's flags (``sys.argv`` when None); the tests run the no-DeepSpeed side in-process."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="Qwen/Qwen3-8B")
    parser.add_argument("--num_hidden_layers", type=int, default=None, help="fewer layers than published")
    parser.add_argument("--per_device_batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--activation_checkpointing", action="store_true")
    parser.add_argument("--compile_layers", action="store_true", help="the recipe knob: each decoder layer compiled")
    parser.add_argument("--padding_free", action="store_true", help="the recipe knob: rollouts packed into rows")
    parser.add_argument("--out", default=None, help="append the JSON line here")
    args = parser.parse_args(argv)
    state = PartialState()
    overrides = {"num_hidden_layers": args.num_hidden_layers} if args.num_hidden_layers else {}
    torch.manual_seed(args.seed)
    if Path(args.model).is_dir():
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16, **overrides)
    else:  # identical on every rank; DeepSpeed shards it
        model = random_model(args.model, dtype="bfloat16", **overrides)
    params = sum(p.numel() for p in model.parameters())
    rows = args.per_device_batch * state.num_processes
    rollouts = synthetic_rollouts(rows, args.seq, args.prompt, model.config.vocab_size, args.seed)
    with tempfile.TemporaryDirectory() as work:
        questions = Path(work) / "q.parquet"
        pd.DataFrame({"question": ["q"] * rows, "golden_answers": [["a"]] * rows}).to_parquet(questions)
        config = SearchR1Config(
            output_dir=str(Path(work) / "run"), generator="transformers", train_data_path=str(questions),
            per_device_train_batch_size=args.per_device_batch, gradient_accumulation_steps=1,
            num_generations=args.per_device_batch, max_steps=args.steps, learning_rate=1e-6,
            bf16=torch.cuda.is_available(),
            logging_steps=1, save_strategy="no", eval_strategy="no", report_to="none", seed=args.seed,
            activation_checkpointing=args.activation_checkpointing, compile_layers=args.compile_layers,
            padding_free=args.padding_free,
        )
        trainer = FixedRolloutsTrainer(model=model, args=config, rollouts=rollouts,
                                       processing_class=AutoTokenizer.from_pretrained(require().model))
        cuda = torch.cuda.is_available()  # a CPU smoke run reports 0 GiB
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        trainer.train()
    peak = torch.tensor([torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0], device=trainer.accelerator.device)
    peaks = trainer.accelerator.gather(peak).tolist()
    peak_tflops = matmul_tflops() if cuda else None
    history = [e for e in trainer.state.log_history if "loss" in e]
    step_times = [e["step_time"] for e in history]
    step_s = sorted(step_times[1:])[len(step_times[1:]) // 2] if len(step_times) > 1 else step_times[0]
    result = {
        "measure": "zero3_update" if trainer.is_deepspeed_enabled else "update_no_deepspeed",
        "model": args.model, "num_hidden_layers": model.config.num_hidden_layers, "params_b": round(params / 1e9, 3),
        "processes": state.num_processes, "global_batch": rows, "seq": args.seq,
        "activation_checkpointing": args.activation_checkpointing, "losses": [e["loss"] for e in history],
        "grad_norms": [e.get("grad_norm") for e in history],
        "step_times_s": [round(t, 3) for t in step_times], "step_s": round(step_s, 3),
        "tokens_per_s": round(rows * args.seq / step_s), "peak_mem_gib_per_gpu": [round(p, 1) for p in peaks],
        "compile_layers": args.compile_layers, "padding_free": args.padding_free,
        "mfu": round(6 * params * rows * args.seq / step_s / state.num_processes / 1e12 / peak_tflops, 3)
        if peak_tflops else None,
    }
    if state.is_main_process:
        report(result, args.out)


if __name__ == "__main__":
    main()
