"""searchr1-train: train a Search-R1 policy with TRL from a recipe.

    searchr1-train --config offline --max_steps 5          # a shipped recipe by name; any field overridden on the CLI
    searchr1-train --config my_recipe.yaml                  # or a YAML file
    accelerate launch --config_file accelerate_configs/zero3.yaml scripts/train.py --config qwen3_8b

Shipped recipes (``configs/`` in the repository, ``searchr1_trl/recipes`` in the installed package):
offline, offline_gpu, qwen3_1_7b, qwen3_8b, qwen3_30b_a3b, muse_glimmer_30b; each ends with its plan (GPUs, machines,
what the retriever serves), which ``searchr1-launch --config <recipe>`` starts: the generator and the retriever must
be running. A recipe this machine cannot run stops in one line naming what is missing and what to run instead. A run
holds its ``output_dir`` until it ends: a second run on the same folder is refused, naming the first. A generator
that stops answering (killed, or hung past ``generator_timeout_s`` / ``weight_sync_timeout_s``) stops the run in one
line naming it and its URL.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from pathlib import Path

from searchr1_trl.serving.vllm_server import GeneratorUnavailable, reload_weights
from searchr1_trl.training.checkpoints import CheckpointSaveError, OutputDirLock, resume_checkpoint
from searchr1_trl.training.loading import load_recipe, recipe_path, recipe_values
from searchr1_trl.training.plan import PlanError, check_machine, validate_plan, wait_for_generator, warm_start_due

logger = logging.getLogger(__name__)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    with contextlib.ExitStack() as hold:
        try:
            if "--config" in argv:
                i = argv.index("--config") + 1
                argv[i] = str(recipe_path(argv[i]))
            recipe = Path(argv[argv.index("--config") + 1]).stem if "--config" in argv else "command line"
            if {"-h", "--help"} & set(argv):
                print(__doc__)  # then the fields, from the parser
            else:
                check_machine(recipe, recipe_values(argv))  # before the config exists: see recipe_values
            try:
                args, model_args = load_recipe(argv)
            except ValueError as error:  # a field the trainer owns, a bad value: one line, not a traceback
                raise PlanError(f"recipe {recipe}: {error}") from None
            args.recipe = recipe
            validate_plan(args, model_args)
            if args.should_save:  # a second run on this folder would silently replace this one's checkpoints
                hold.enter_context(OutputDirLock(args.output_dir))
            # verified now, not minutes later once the model is loaded; `true` and `latest` arrive as strings
            args.resume_from_checkpoint = resume_checkpoint(args.output_dir, args.resume_from_checkpoint)
        except ValueError as error:  # PlanError included
            sys.exit(f"error: {' '.join(str(error).split())}")
        try:
            train(args, model_args)
        # a server started by hand was killed or hangs, at any point of a run, or never came up after the warm start
        except (GeneratorUnavailable, PlanError) as error:
            sys.exit(f"error: {error}")


def hand_warm_start_to_generator(args, folder: str) -> None:
    """The reload generator loads the warm-started weights (from the main process, the others waiting), so that the
    first validation and rollouts sample from them."""
    from accelerate import PartialState

    state = PartialState()
    if state.is_main_process:
        reload_weights(args.generator_url, folder, args.weight_sync_timeout_s)
    state.wait_for_everyone()


def train(args, model_args) -> None:
    """Warm-start when the recipe asks, train, evaluate the last step if the run did not, save with the model card,
    push to the Hub when asked, write the trace report (``trace_report``)."""
    from trl import get_peft_config

    from searchr1_trl.training.parts import build_task
    from searchr1_trl.training.records import SearchOutage
    from searchr1_trl.training.trainer import SearchR1Trainer
    from searchr1_trl.training.warm_start import warm_start

    args.model_init_kwargs = {
        **(args.model_init_kwargs or {}),
        "dtype": model_args.dtype,
        "attn_implementation": model_args.attn_implementation,
    }
    warm_start_s = None
    if warm_start_due(args):
        started = time.perf_counter()
        warmed = warm_start(args, model_args, build_task(args))
        warm_start_s = time.perf_counter() - started
        if args.generator == "vllm":  # it may have been starting up meanwhile (validate_plan)
            wait_for_generator(args, model_args.model_name_or_path)
            if args.weight_sync == "reload":  # nccl and ipc push before the first rollouts
                hand_warm_start_to_generator(args, warmed)
        model_args.model_name_or_path = warmed
    trainer = SearchR1Trainer(model=model_args.model_name_or_path, args=args, peft_config=get_peft_config(model_args))
    trainer.startup.warm_start_s = warm_start_s  # logged with the first step, as part of the start-up
    try:
        trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    except (SearchOutage, CheckpointSaveError) as error:
        sys.exit(f"error: {error}")
    evaluated_last_step = any(e.get("step") == trainer.state.global_step and "eval_em" in e
                              for e in trainer.state.log_history)
    if trainer.eval_samples and not evaluated_last_step:
        trainer.evaluate()  # the final EM, also recorded in the model card
    trainer.save_state()
    trainer.save_model(args.output_dir)
    trainer.create_model_card()  # README.md beside the weights: recipe, data, retriever, final EM (also on the Hub)
    if args.push_to_hub:
        trainer.push_to_hub()
    if args.trace_report and trainer.is_world_process_zero():
        from searchr1_trl.report.page import write_report

        logger.info("trace report: %s", write_report([args.output_dir]))


if __name__ == "__main__":
    main()
