"""Train a Search-R1 policy with TRL.

    accelerate launch --config_file accelerate_configs/zero3.yaml scripts/train.py --config qwen3_8b.yaml
    python scripts/train.py --config offline --max_steps 5          # any field can be overridden on the CLI

A bare recipe name is looked up in configs/; a path works too. The generator (`trl vllm-serve`) and the retrieval
server (`searchr1-retriever`) must be running: each recipe's header gives the commands.
"""

import logging
import sys

from trl import get_peft_config

from searchr1_trl.plan import PlanError, validate_plan
from searchr1_trl.recipe import load_recipe
from searchr1_trl.trainer import SearchR1Trainer


def main(argv: list[str] | None = None) -> None:
    try:
        args, model_args = load_recipe(argv)
    except ValueError as error:  # an unknown recipe or a field the trainer owns: one line, not a traceback
        sys.exit(f"error: {error}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
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
