"""Weight-sync correctness and speed against a running vLLM server: does the server sample from the trainer's
weights after a push, and how long does the push take?

1. Fixed completions: the server's greedy answers to ``--num_prompts`` SQuAD dev questions (chat template).
2. Logprobs of those completion tokens from the server (``prompt_logprobs``) and from the trainer's model
   (bf16 autocast over the recipe's fp32 weights, as in training): the gap before any update.
3. One AdamW step (lr ``--lr``) raising the logprob of the completions, then a push: ``nccl`` (TRL's
   ``VLLMClient`` over NCCL: the trainer on another GPU than the server) or ``reload`` (safetensors to a tmpfs
   folder the server reloads: works with both on one GPU; ``--push_dtype bfloat16`` writes the weights rounded to
   bf16, as the recipe's ``weight_sync_dtype: bfloat16`` does) or ``ipc`` (CUDA IPC handles of bf16 copies to a
   server on the same GPU started with ``--worker-extension-cls searchr1_trl.serving.weight_sync.IpcWeightLoader``).
4. Both logprobs again: the gap after the push must stay within ``--tolerance`` (mean absolute, nats; bf16 kernels
   differ between vLLM and transformers), and the server's per-token change must follow the trainer's (correlation,
   same sign). Then ``--pushes`` timed pushes of the unchanged weights.

    CUDA_VISIBLE_DEVICES=1 VLLM_HOST_IP=127.0.0.1 python -m experiments.weight_sync --model M --sync nccl \\
        --server_url http://127.0.0.1:8001 --questions test.parquet --out weight_sync.jsonl
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import httpx
import pandas as pd
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from experiments.report import report
from searchr1_trl.serving.vllm_server import reload_weights
from searchr1_trl.serving.weight_sync import IpcPush, save_for_reload


def post(url: str, payload: dict) -> dict:
    response = httpx.post(url, json=payload, timeout=300)
    if response.status_code != 200:
        raise RuntimeError(f"POST {url}: HTTP {response.status_code}: {response.text[:1000]}")
    return response.json()


def server_logprobs(url: str, model: str, sequences: list[list[int]], prompt_lengths: list[int]) -> list[list[float]]:
    """The server's logprob of every completion token (positions from each prompt's end), at temperature 1."""
    payload = {"model": model, "prompt": sequences, "max_tokens": 1, "temperature": 1.0, "prompt_logprobs": 0}
    choices = post(f"{url}/v1/completions", payload)["choices"]
    out = []
    for choice, sequence, start in zip(choices, sequences, prompt_lengths, strict=True):
        rows = choice["prompt_logprobs"]
        out.append([rows[i][str(sequence[i])]["logprob"] for i in range(start, len(sequence))])
    return out


def trainer_logprobs(model, sequences: list[list[int]], prompt_lengths: list[int]) -> list[list[float]]:
    out = []
    for sequence, start in zip(sequences, prompt_lengths, strict=True):
        ids = torch.tensor([sequence], device=model.device)
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=model.device.type == "cuda"):
            logits = model(ids).logits.float()
        logprobs = torch.log_softmax(logits[0, :-1], dim=-1).gather(-1, ids[0, 1:, None])[:, 0]
        out.append(logprobs[start - 1:].tolist())
    return out


def flat(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor([x for row in rows for x in row])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--server_url", default="http://127.0.0.1:8001")
    parser.add_argument("--sync", choices=["nccl", "reload", "ipc"], required=True)
    parser.add_argument("--sync_dir", default="/dev/shm/searchr1_weight_sync_check")
    parser.add_argument("--questions", required=True, help="parquet with a question column")
    parser.add_argument("--num_prompts", type=int, default=16)
    parser.add_argument("--max_tokens", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--tolerance", type=float, default=0.05, help="mean |server - trainer| logprob, nats")
    parser.add_argument("--pushes", type=int, default=3)
    parser.add_argument("--push_dtype", choices=["float32", "bfloat16"], default="float32",
                        help="dtype of the weights a reload or ipc push sends (nccl pushes the model's own)")
    parser.add_argument("--out")
    args = parser.parse_args()

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).cuda()
    served = httpx.get(f"{args.server_url}/v1/models").json()["data"][0]["id"]
    questions = pd.read_parquet(args.questions)["question"].tolist()[: args.num_prompts]
    prompts = [list(tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                                  return_dict=True)["input_ids"]) for q in questions]
    greedy = post(f"{args.server_url}/v1/completions", {
        "model": served, "prompt": prompts, "max_tokens": args.max_tokens, "temperature": 0.0,
        "return_token_ids": True})["choices"]
    sequences = [p + list(c["token_ids"]) for p, c in zip(prompts, greedy, strict=True)]
    lengths = [len(p) for p in prompts]

    server_before = flat(server_logprobs(args.server_url, served, sequences, lengths))
    trainer_before = flat(trainer_logprobs(model, sequences, lengths))

    client = ipc = None
    if args.sync == "ipc":
        from accelerate import Accelerator

        ipc = IpcPush(Accelerator(), args.server_url, args.push_dtype)
    if args.sync == "nccl":
        from trl.generation.vllm_client import VLLMClient

        client = VLLMClient(base_url=args.server_url)
        start = time.perf_counter()
        client.init_communicator(device=0)
        init_s = time.perf_counter() - start

    def push() -> float:
        start = time.perf_counter()
        if client is not None:
            client.update_model_params(model)
            client.reset_prefix_cache()
        elif ipc is not None:
            ipc.push(model)
        else:
            folder = Path(args.sync_dir)
            save_for_reload(model, None, folder, getattr(torch, args.push_dtype))
            reload_weights(args.server_url, folder)
        torch.cuda.synchronize()
        return time.perf_counter() - start

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    model.train()
    loss = 0.0
    for sequence, start_at in zip(sequences, lengths, strict=True):
        ids = torch.tensor([sequence], device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(ids).logits.float()
        logprobs = torch.log_softmax(logits[0, :-1], dim=-1).gather(-1, ids[0, 1:, None])[:, 0]
        loss = loss - logprobs[start_at - 1:].mean() / len(sequences)
    loss.backward()
    optimizer.step()
    model.eval()

    first_push_s = push()
    server_after = flat(server_logprobs(args.server_url, served, sequences, lengths))
    trainer_after = flat(trainer_logprobs(model, sequences, lengths))
    push_s = [push() for _ in range(args.pushes)]
    if client is not None:
        client.close_communicator()

    trainer_delta, server_delta = trainer_after - trainer_before, server_after - server_before
    gap_before = (server_before - trainer_before).abs()
    gap_after = (server_after - trainer_after).abs()
    moved = trainer_delta.abs() > 2 * args.tolerance
    row = {
        "benchmark": "weight_sync", "sync": args.sync, "model": Path(args.model).name,
        "push_dtype": args.push_dtype if args.sync != "nccl" else str(next(model.parameters()).dtype),
        "parameters": sum(p.numel() for p in model.parameters()),
        "bytes_pushed": sum(p.numel() * (2 if args.sync != "nccl" and args.push_dtype == "bfloat16"
                                         else p.element_size()) for p in model.parameters()),
        "tokens_compared": len(trainer_before), "tolerance_nats": args.tolerance,
        "gap_before_mean": round(gap_before.mean().item(), 4), "gap_before_max": round(gap_before.max().item(), 4),
        "gap_after_mean": round(gap_after.mean().item(), 4), "gap_after_max": round(gap_after.max().item(), 4),
        "trainer_delta_mean": round(trainer_delta.mean().item(), 4),
        "server_delta_mean": round(server_delta.mean().item(), 4),
        "delta_correlation": round(torch.corrcoef(torch.stack([trainer_delta, server_delta]))[0, 1].item(), 4),
        "same_sign_where_moved": (
            round((trainer_delta[moved].sign() == server_delta[moved].sign()).float().mean().item(), 4)
            if moved.any() else None
        ),
        "first_push_s": round(first_push_s, 3), "push_s_median": round(statistics.median(push_s), 3),
        **({"init_communicator_s": round(init_s, 2)} if client is not None else {}),
    }
    row["within_tolerance"] = row["gap_before_mean"] <= args.tolerance and row["gap_after_mean"] <= args.tolerance
    report(row, args.out)
    if not row["within_tolerance"]:
        raise SystemExit(f"server and trainer logprobs differ by more than {args.tolerance} nats: {row}")


if __name__ == "__main__":
    main()
