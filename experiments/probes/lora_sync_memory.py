"""The trainer's peak memory while it writes merged LoRA weights for the generator (the ``reload`` weight sync).

Each variant runs in its own process: load the offline model in float32 with the CPU recipe's LoRA adapter, then
write the merged weights to a folder under ``/dev/shm`` as ``searchr1_trl.serving.weight_sync.ReloadPush`` does, and
report the process's resident memory before the write and its peak during the write (``VmHWM``, reset after loading
through ``/proc/self/clear_refs``, so the loading peak does not count):

- ``clone``: the merged state dict copied tensor by tensor, one safetensors file (before this change);
- ``in_place``: the model's own tensors, merged in place, one file (what the trainer does now);
- ``in_place_sharded``: the same in 256 MB shards (whether safetensors' own buffering matters: it does not).

    python -m experiments.probes.lora_sync_memory --out experiments/results/lora_sync_memory.jsonl
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time

from experiments.report import report

VARIANTS = ("clone", "in_place", "in_place_sharded")


def status_gib(field: str) -> float:
    """``VmRSS`` or ``VmHWM`` (the peak) of this process, in GiB."""
    with open("/proc/self/status") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith(f"{field}:"))
    return kib / 2**20


def one(variant: str) -> dict:
    import torch
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM
    from trl import get_peft_config

    from searchr1_trl.serving.weight_sync import _merged_peft_state_dict
    from searchr1_trl.training.loading import load_recipe

    _, model_args = load_recipe(["--config", "offline"])
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_args.model_name_or_path, dtype=torch.float32),
                           get_peft_config(model_args))
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    before = status_gib("VmRSS")
    folder = tempfile.mkdtemp(dir="/dev/shm")
    start = time.perf_counter()
    try:
        if variant == "clone":
            with _merged_peft_state_dict(model) as merged:
                merged = {name: tensor.clone() for name, tensor in merged.items()}
            model.get_base_model().save_pretrained(folder, state_dict=merged, max_shard_size="100GB")
        else:
            with _merged_peft_state_dict(model) as merged:
                model.get_base_model().save_pretrained(
                    folder, state_dict=merged, max_shard_size="256MB" if variant == "in_place_sharded" else "100GB")
        seconds = time.perf_counter() - start
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    peak = status_gib("VmHWM")
    return {"variant": variant, "rss_before_write_gib": round(before, 2), "peak_rss_gib": round(peak, 2),
            "write_extra_gib": round(peak - before, 2), "write_s": round(seconds, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variant", choices=VARIANTS, help="run one variant in this process (internal)")
    parser.add_argument("--out", help="append the JSON lines to this file")
    args = parser.parse_args()
    if args.variant:
        print(json.dumps(one(args.variant)), flush=True)
        return
    for variant in VARIANTS:
        line = subprocess.run([sys.executable, "-m", "experiments.probes.lora_sync_memory", "--variant", variant],
                              check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
        report(json.loads(line), args.out)


if __name__ == "__main__":
    main()
