"""The card's reporting and sharing paths: a run logged to wandb (offline) and the model card push_to_hub uploads."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_trainer import small_config

from searchr1_trl.training.trainer import SearchR1Trainer


@pytest.fixture(scope="module")
def reported_run(tiny_model_dir, questions_file, retriever_url, tmp_path_factory):
    """One training step of the tiny model with validation before and after, reported to wandb in offline mode."""
    import wandb

    folder = tmp_path_factory.mktemp("reported")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("WANDB_MODE", "offline")
        env.setenv("WANDB_DIR", str(folder))
        env.setenv("WANDB_PROJECT", "searchr1-test")
        args = small_config(folder, questions_file, retriever_url, generator="transformers", max_tokens_per_turn=8,
                            max_turns=1, report_to="wandb", eval_on_start=True, eval_strategy="steps", eval_steps=1,
                            run_name="reporting-test")
        args.recipe = "offline"
        trainer = SearchR1Trainer(model=str(tiny_model_dir), args=args)
        trainer.train()
        wandb.finish()
    return trainer, folder


@pytest.mark.slow
def test_a_wandb_run_records_the_rollout_and_em_metrics(reported_run):
    _, folder = reported_run
    [history] = list((folder / "wandb").glob("offline-run-*/run-*.wandb"))
    # The offline run's record log holds every logged key as a protobuf string (what `wandb sync` uploads).
    recorded = history.read_bytes()
    for key in ("eval/em", "eval/searches_per_rollout", "eval/status_done", "train/reward",
                "train/rollout/searches_per_rollout", "train/rollout/status_done", "train/rubric/correct"):
        assert key.encode() in recorded, f"{key} was not logged to wandb"


@pytest.mark.slow
def test_the_model_card_holds_recipe_data_retriever_and_final_em(reported_run, questions_file, retriever_url):
    trainer, _ = reported_run
    trainer.create_model_card()
    text = (Path(trainer.args.output_dir) / "README.md").read_text()
    final = [e for e in trainer.state.log_history if "eval_em" in e][-1]
    assert "- recipe: `offline`" in text
    assert f"- training questions: `{questions_file}`" in text
    assert f"- retriever: `{retriever_url}`, top-3 passages" in text
    assert "- warm start: none" in text
    assert f"- final validation EM: {final['eval_em']:.3f} at step {final['step']}" in text
