"""The training launcher for ``accelerate launch`` (it needs a script path); the same as the ``searchr1-train`` command.

    accelerate launch --config_file accelerate_configs/zero3.yaml scripts/train.py --config qwen3_8b
    python scripts/train.py --config offline --max_steps 5          # any field can be overridden on the CLI

Recipes and the checks that run before training: ``searchr1_trl/cli/train.py``.
"""

from searchr1_trl.cli.train import main

if __name__ == "__main__":
    main()
