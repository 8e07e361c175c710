"""Train a Search-R1 policy with TRL.

    accelerate launch --config_file accelerate_configs/zero3.yaml scripts/train.py --config qwen3_8b.yaml
    python scripts/train.py --config offline --max_steps 5          # any field can be overridden on the CLI

A bare recipe name is looked up in configs/; a path works too. The generator (`trl vllm-serve`) and the retrieval
server (`searchr1-retriever`) must be running: each recipe's header gives the commands.
"""

import logging
import os
import sys
from pathlib import Path

from trl import ModelConfig, TrlParser, get_peft_config

from searchr1_trl.plan import PlanError, validate_plan
from searchr1_trl.trainer import SearchR1Config, SearchR1Trainer

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def resolve_recipe(argv: list[str]) -> list[str]:
    """Turn `--config qwen3_8b` / `--config qwen3_8b.yaml` into the recipe's path in configs/."""
    argv = list(argv)
    if "--config" in argv:
        i = argv.index("--config") + 1
        name = argv[i]
        if not Path(name).exists():
            candidate = CONFIGS / (name if name.endswith(".yaml") else f"{name}.yaml")
            if not candidate.exists():
                known = ", ".join(sorted(p.stem for p in CONFIGS.glob("*.yaml")))
                sys.exit(f"error: recipe {name!r} is neither a file nor one of configs/: {known}")
            argv[i] = str(candidate)
    return argv


def main(argv: list[str] | None = None) -> None:
    parser = TrlParser((SearchR1Config, ModelConfig))
    args, model_args = parser.parse_args_and_config(args=resolve_recipe(sys.argv[1:] if argv is None else argv))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    model_args.model_name_or_path = os.path.expanduser(model_args.model_name_or_path)
    try:
        validate_plan(args, model_args)
    except PlanError as error:
        sys.exit(f"error: {error}")
    args.model_init_kwargs = {
        **(args.model_init_kwargs or {}),
        "dtype": model_args.dtype,
        "attn_implementation": model_args.attn_implementation,
    }
    trainer = SearchR1Trainer(model=model_args.model_name_or_path, args=args, peft_config=get_peft_config(model_args))
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    evaluated_last_step = any(e.get("step") == trainer.state.global_step and "eval_em" in e
                              for e in trainer.state.log_history)
    if trainer.eval_samples and not evaluated_last_step:
        trainer.evaluate()  # the final EM, also recorded in the model card
    trainer.save_state()
    trainer.save_model(args.output_dir)
    if args.push_to_hub:
        trainer.push_to_hub()


if __name__ == "__main__":
    main()
