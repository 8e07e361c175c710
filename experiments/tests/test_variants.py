"""The learning batches' variants (experiments/variants.yaml) as experiments/gpu_path.sh reads them: each a valid
``offline_gpu`` recipe, each saying why in one line."""

import os
import re
import subprocess
from pathlib import Path

from experiments import variants
from searchr1_trl.training.experimental import async_rollouts
from searchr1_trl.training.loading import load_recipe

GPU_SCRIPT = Path(variants.__file__).with_name("gpu_path.sh")


def gpu_script_flags(name: str) -> list[str]:
    """The flags gpu_path.sh's ``variant_flags`` gives ``name``, run by bash as the script runs it."""
    function = re.search(r"^variant_flags\(\) \{\n.*?^\}", GPU_SCRIPT.read_text(), re.M | re.S).group(0)
    run = subprocess.run(["bash", "-c", f'{function}\nvariant_flags "$0"', name], capture_output=True, text=True,
                         env={**os.environ, "SIBLING": "/models/sibling"}, check=True)
    return run.stdout.split()


def test_every_variant_is_a_valid_offline_gpu_recipe_as_the_gpu_script_reads_it():
    # a typo in a variant's flags would cost a GPU session's device time to find
    names = list(variants.load())
    assert {"sync", "reload", "sync_ipc", "async_safe", "async_safe_pause", "async_safe_compiled_packed",
            "q15"} <= set(names)
    parsed = {}
    for name in names:
        flags = gpu_script_flags(name)
        if "--model" in flags:  # offline_job's own flag (it serves and trains that folder), not a recipe field
            i = flags.index("--model")
            assert flags[i + 1] == "/models/sibling", name
            del flags[i:i + 2]
        # unknown flags and the config's own checks refuse here
        args = load_recipe(["--config", "offline_gpu", "--use_cpu", "true", *flags])[0]
        if args.async_rollouts:
            async_rollouts.check_recipe(args, deepspeed=False)  # what the trainer checks before its first step
        parsed[name] = args
    safe = parsed["async_safe_pause"]
    assert (safe.async_rollouts, safe.max_staleness, safe.weight_sync, safe.in_flight_rollouts) == (True, 1, "ipc",
                                                                                                    "pause")
    assert (safe.vllm_importance_sampling_mode, safe.off_policy_mask_threshold) == ("sequence_truncate", 0.02)
    fast = parsed["async_safe_compiled_packed"]
    assert (fast.compile_layers, fast.padding_free, fast.off_policy_mask_threshold) == (True, True, 0.02)
    assert not parsed["sync"].async_rollouts
    fewer = parsed["async_guard_compiled_packed_mb32"]  # the recipe's 64 rollouts a step, in 2 micro-batches
    assert fewer.generation_batch_size == parsed["sync"].generation_batch_size == 64
    assert fewer.steps_per_generation == fewer.gradient_accumulation_steps == 2
    # e2e_alone's lock-step pair: the recipe's own push and the tmpfs reload it replaced (issue 23's baseline)
    assert (parsed["sync"].weight_sync, parsed["reload"].weight_sync) == ("ipc", "reload")
    assert not parsed["sync"].activation_checkpointing, "the recipe runs alone on its GPU: no checkpointing"
    assert (parsed["sync"].compile_layers, parsed["sync"].padding_free) == (True, True)
    every = parsed["compiled_packed_nockpt"]
    assert (every.compile_layers, every.padding_free, every.activation_checkpointing) == (True, True, False)
    lean = parsed["async_safe_nockpt"]
    assert (lean.async_rollouts, lean.activation_checkpointing, lean.off_policy_mask_threshold) == (True, False, 0.02)
    guarded = parsed["async_guard"]
    assert (guarded.activation_checkpointing, guarded.max_behaviour_kl) == (False, 0.01)
    assert lean.max_behaviour_kl == 0  # measured before the bound was the default: without it


def test_an_unknown_variant_stops_the_script_naming_every_variant_there_is():
    function = re.search(r"^variant_flags\(\) \{\n.*?^\}", GPU_SCRIPT.read_text(), re.M | re.S).group(0)
    run = subprocess.run(["bash", "-c", f'{function}\nvariant_flags no-such-variant'], capture_output=True, text=True)
    assert run.returncode != 0 and run.stdout == ""
    assert run.stderr.strip() == f"variant 'no-such-variant'; expected one of {', '.join(variants.load())}"


def test_a_variant_extends_others_in_order_and_its_own_flags_win():
    table = {"a": {"flags": "--x 1 --y 1"}, "b": {"flags": "--y 2"}, "c": {"extends": ["a", "b"], "flags": "--z 3"}}
    assert variants.flags("c", table) == ["--x", "1", "--y", "1", "--y", "2", "--z", "3"]


def test_every_variant_says_why_in_one_undated_line():
    for name, entry in variants.load().items():
        assert set(entry) <= {"flags", "extends", "why"}, name
        assert entry["why"] and "\n" not in entry["why"] and len(entry["why"]) <= 120, name
        assert not re.search(r"\b20\d\d-\d\d", entry["why"]), name
