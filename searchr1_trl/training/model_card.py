"""The model card's recipe section: what a checkpoint needs to be reproduced (task, recipe, data, retriever, budgets,
warm start, loss) and its final validation EM, appended to TRL's card."""

from __future__ import annotations


def validation_em(state, step: int) -> float:
    """The validation EM logged at ``step``."""
    return next(e["eval_em"] for e in state.log_history if e.get("step") == step and "eval_em" in e)


def recipe_section(args, state) -> str:
    """The section for a run of ``args`` whose trainer state is ``state`` (its log history and best checkpoint)."""
    evals = [entry for entry in state.log_history if "eval_em" in entry]
    final_em = f"{evals[-1]['eval_em']:.3f} at step {evals[-1]['step']}" if evals else "not evaluated"
    kept = state.best_global_step
    if args.load_best_model_at_end and evals and kept is not None and kept != evals[-1]["step"]:
        final_em = (f"{validation_em(state, kept):.3f} at step {kept} (the checkpoint the collapse guard kept, "
                    f"which this model is; last validation: {final_em})")
    return "\n".join([
        "", "## Search-R1 recipe", "",
        f"- task: `{args.task}`",
        f"- recipe: `{getattr(args, 'recipe', None) or 'custom'}`",
        f"- training questions: `{args.train_data_path or args.train_repo_id + '/' + args.train_filename}`"
        f" (data_source: {args.train_data_source or 'all'})",
        f"- validation: {'first' if args.eval_sample_seed is None else f'seed-{args.eval_sample_seed} sample of'} "
        f"{args.eval_num_samples} rows of "
        f"`{args.eval_data_path or args.train_repo_id + '/' + args.eval_filename}`"
        f" (data_source: {args.eval_data_source or 'all'}), greedy",
        f"- retriever: `{args.search_url}`, top-{args.topk} passages",
        f"- rollouts: {args.num_generations} per question, max_turns={args.max_turns}, "
        f"max_rollout_tokens={args.max_rollout_tokens}, max_tokens_per_turn={args.max_tokens_per_turn}",
        "- warm start: " + (f"{args.warm_start_traces} scripted traces of the task (warm_start.py), "
                            f"lr={args.warm_start_learning_rate}, epochs={args.warm_start_epochs}"
                            if args.warm_start_traces else "none"),
        f"- loss: {args.loss_type}, epsilon={args.epsilon}, epsilon_high={args.epsilon_high}, beta={args.beta}, "
        f"lr={args.learning_rate}",
        f"- final validation EM: {final_em}", "",
    ])
