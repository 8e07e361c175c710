"""The collapse guard: a scripted collapse stops training, which ends on the newest validated checkpoint within noise
of the best (step 0 included); without a collapse it keeps the last step unless an earlier one beats it by more than
the noise; training-side signals ask for a validation; dynamic sampling drops groups without reward spread. Beside it,
the report sample rolled out where its figure is read (``report_at``): the first validation, the step training stops
at and the model it ends on."""

from __future__ import annotations

import json
import logging
from collections import Counter

import pytest
import torch
from transformers import TrainerControl, TrainerState

from searchr1_trl.training import evaluation
from searchr1_trl.training.callbacks import KEEP_METRIC, CollapseGuard, CollapseGuardConfig, em_noise
from searchr1_trl.training.fixed_costs import report_due, saved_model_unreported
from searchr1_trl.training.parts import build_task
from searchr1_trl.training.trainer import SearchR1Trainer
from tests.test_trainer import model_text_reward, small_config


def scripted_validation(monkeypatch, ems: list[float], searches: list[float]):
    """Validation EM and searches per rollout follow the script, one entry per validation (the real rollouts run)."""
    real, calls = evaluation.summarize, []

    def summarize(traces):
        metrics = dict(real(traces))
        if len(traces) == 4:  # the validation sample; the report sample (3 questions) stays real
            metrics.update(em=ems[len(calls)], searches_per_rollout=searches[len(calls)])
            calls.append(metrics["em"])
        return metrics

    monkeypatch.setattr(evaluation, "summarize", summarize)
    return calls


def guarded_trainer(model, tmp_path, questions_file, retriever_url, max_steps: int = 4,
                    **overrides) -> SearchR1Trainer:
    """Validation and a save after every step of ``max_steps``; 4 validation questions and 3 report questions."""
    args = small_config(tmp_path, questions_file, retriever_url, generator="transformers", max_tokens_per_turn=8,
                        max_turns=1, learning_rate=1e-3, max_steps=max_steps, eval_strategy="steps", eval_steps=1,
                        eval_on_start=True, save_strategy="steps", save_steps=1, eval_num_samples=4,
                        report_num_samples=3, **overrides)
    task = build_task(args)
    return SearchR1Trainer(model=str(model), args=args, parts=task, reward_funcs=[task.rubric, model_text_reward])


def reported(trainer) -> list[tuple[int, str]]:
    """Where the report sample was rolled out: ``(step of the weights, when)``, in log order."""
    found = []
    for entry in trainer.state.log_history:
        if "saved_report_em" in entry:
            found.append((entry["saved_report_step"], "after training"))
        elif "report_em" in entry:
            found.append((entry["step"], "validation" if "eval_em" in entry else "after its validation"))
    return found


def samples_in(traces_file) -> dict[str, int]:
    """How many rollouts of each sample a step's validation_traces file holds."""
    return dict(Counter(json.loads(line)["sample"] for line in traces_file.read_text().splitlines()))


def weights(model) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def saved_weights(checkpoint) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(checkpoint / "model.safetensors"))


def test_a_scripted_collapse_stops_training_and_it_ends_on_the_best_checkpoint(
        tiny_model_dir, tmp_path, questions_file, retriever_url, monkeypatch, caplog):
    calls = scripted_validation(monkeypatch, ems=[0.25, 0.5, 0.25, 0.75, 0.75], searches=[1.0, 1.0, 0.2, 1.0, 1.0])
    trainer = guarded_trainer(tiny_model_dir, tmp_path, questions_file, retriever_url)
    with caplog.at_level(logging.WARNING):
        trainer.train()
    assert calls == [0.25, 0.5, 0.25], "validations at steps 0, 1, 2; the collapse at step 2 stops training"
    assert trainer.state.global_step == 2
    lines = [r.getMessage() for r in caplog.records if "collapse guard" in r.getMessage()]
    assert len(lines) == 1 and "step 2" in lines[0] and "best: step 1" in lines[0]
    assert "validation EM 0.250 is 0.250 below the best 0.500" in lines[0] and "searches per rollout 0.20" in lines[0]
    assert trainer.state.best_global_step == 1, "step 1 is the newest within noise of the best that did not collapse"
    best = saved_weights(tmp_path / "run" / "checkpoint-1")
    now = weights(trainer.model)
    assert all(torch.equal(now[name], best[name]) for name in best), "the model is the step-1 checkpoint's"
    step2 = saved_weights(tmp_path / "run" / "checkpoint-2")
    assert any(not torch.equal(step2[name], best[name]) for name in best), "step 2 had moved the weights"
    # report_at ends: the report sample at the first validation, at the stop (after the validation that decided it)
    # and on the step-1 model training ended on, after training
    assert reported(trainer) == [(0, "validation"), (2, "after its validation"), (1, "after training")]
    traces = tmp_path / "run" / "validation_traces"
    assert samples_in(traces / "step-1.jsonl") == {"eval": 4, "report": 3}, "the kept step's report joins its traces"
    assert samples_in(traces / "step-2.jsonl") == {"eval": 4, "report": 3}
    assert trainer._synced_step == -1, "the restored weights are pushed before the next generation"


def test_the_start_itself_is_a_candidate_and_can_be_what_training_ends_on(
        tiny_model_dir, tmp_path, questions_file, retriever_url, monkeypatch):
    scripted_validation(monkeypatch, ems=[0.75, 0.5, 0.5, 0.5, 0.5], searches=[1.0] * 5)
    trainer = guarded_trainer(tiny_model_dir, tmp_path, questions_file, retriever_url)
    start = weights(trainer.model)
    trainer.train()
    assert trainer.state.global_step == 1, "0.50 is em_drop or more below 0.75: the collapse stops at step 1"
    assert trainer.state.best_global_step == 0
    assert (tmp_path / "run" / "checkpoint-0").is_dir()
    assert all(torch.equal(start[n], p) for n, p in weights(trainer.model).items()), "back to the step-0 weights"
    assert reported(trainer) == [(0, "validation"), (1, "after its validation")], "step 0's report is the saved one's"


def test_without_a_collapse_training_ends_on_its_last_step_when_no_earlier_one_beats_it_beyond_noise(
        tiny_model_dir, tmp_path, questions_file, retriever_url, monkeypatch, caplog):
    # Two steps, not four: the drop that must not stop training (0.75 -> 0.72) is the last validation's either way.
    calls = scripted_validation(monkeypatch, ems=[0.5, 0.75, 0.72], searches=[1.0] * 3)
    trainer = guarded_trainer(tiny_model_dir, tmp_path, questions_file, retriever_url, max_steps=2)
    with caplog.at_level(logging.WARNING):
        trainer.train()
    assert len(calls) == 3 and trainer.state.global_step == 2
    assert trainer.state.best_global_step == 2, "0.72 is within the noise of 0.75 on 4 questions: the last is kept"
    assert trainer.collapse_guard.collapse is None
    assert not any("training ends on the step" in r.getMessage() for r in caplog.records)
    assert reported(trainer) == [(0, "validation"), (2, "validation")], "not at step 1: report_at ends"
    assert len([e for e in trainer.state.log_history if "time/startup_s" in e]) == 1
    assert next(e for e in trainer.state.log_history if "time/startup_s" in e)["step"] == 1, "with the first step"


def test_an_earlier_checkpoint_beating_the_last_by_more_than_the_noise_is_kept(
        tiny_model_dir, tmp_path, questions_file, retriever_url, monkeypatch, caplog):
    scripted_validation(monkeypatch, ems=[0.0, 1.0, 0.5], searches=[1.0] * 3)
    # No collapse (em_drop 0.9): 0.5 is 2 standard errors (0.25 each on 4 questions) below 1.0, beyond noise_z 1.
    trainer = guarded_trainer(tiny_model_dir, tmp_path, questions_file, retriever_url, max_steps=2,
                              collapse_em_drop=0.9, report_at="every_validation")
    with caplog.at_level(logging.WARNING):
        trainer.train()
    assert trainer.state.global_step == 2 and trainer.collapse_guard.collapse is None
    assert trainer.state.best_global_step == 1
    kept = saved_weights(tmp_path / "run" / "checkpoint-1")
    assert all(torch.equal(weights(trainer.model)[name], kept[name]) for name in kept)
    lines = [r.getMessage() for r in caplog.records if "training ends on the step" in r.getMessage()]
    assert lines == ["training ends on the step-1 checkpoint (validation EM 1.000), not the last step 2: it beats the "
                     "last validated step by more than the validation sample's noise"]
    assert reported(trainer) == [(0, "validation"), (1, "validation"), (2, "validation")], "the kept step's is there"


def kept_after(guard: CollapseGuard, step: int, em: float, n: int = 500) -> bool:
    state, control = TrainerState(), TrainerControl()
    state.global_step = step
    metrics = {"eval_em": em, "eval_searches_per_rollout": 1.0, "eval_num_samples": n, "eval_search_failed": 0}
    guard.on_evaluate(None, state, control, metrics=metrics)
    return metrics[f"eval_{KEEP_METRIC}"] == step + 1


def test_a_step_is_kept_when_its_em_is_within_noise_z_standard_errors_of_the_best():
    assert round(em_noise(0.37, 0.40, 500), 4) == 0.0308
    guard = CollapseGuard(CollapseGuardConfig(noise_z=1.0))
    guard.on_train_begin(None, None, None)
    assert kept_after(guard, 0, 0.36), "the first validation is the best seen"
    assert kept_after(guard, 10, 0.40), "a new best"
    assert kept_after(guard, 20, 0.38), "0.02 below, within 0.031"
    assert not kept_after(guard, 30, 0.36), "0.04 below, beyond 0.031 (and within em_drop: no collapse)"
    assert kept_after(guard, 40, 0.39)
    strict = CollapseGuard(CollapseGuardConfig(noise_z=0.0))
    strict.on_train_begin(None, None, None)
    assert kept_after(strict, 0, 0.40) and not kept_after(strict, 10, 0.39) and kept_after(strict, 20, 0.40)


def test_with_report_at_ends_the_report_sample_rides_on_the_first_validation_and_the_one_training_stops_at():
    state, going, stopping = TrainerState(), TrainerControl(), TrainerControl(should_training_stop=True)
    assert report_due("ends", state, going, training=True), "the first validation of the run"
    state.log_history = [{"step": 0, "eval_em": 0.4, "report_em": 0.38}]  # a resumed run's history counts too
    assert not report_due("ends", state, going, training=True)
    assert report_due("ends", state, stopping, training=True), "the last step's (max_steps reached)"
    assert report_due("ends", state, going, training=False), "a standalone evaluation"
    assert report_due("every_validation", state, going, training=True)
    assert saved_model_unreported(state, 10) and not saved_model_unreported(state, 0)


def control_after(guard: CollapseGuard, step: int, **logs) -> TrainerControl:
    state, control = TrainerState(), TrainerControl()
    state.global_step = step
    guard.on_log(None, state, control, logs=logs)
    return control


def evaluated(guard: CollapseGuard, step: int, em: float, searches: float) -> TrainerControl:
    state, control = TrainerState(), TrainerControl()
    state.global_step = step
    guard.on_evaluate(None, state, control, metrics={"eval_em": em, "eval_searches_per_rollout": searches})
    return control


def test_training_rollouts_that_stop_searching_ask_for_a_validation_at_once():
    guard = CollapseGuard(CollapseGuardConfig())
    guard.on_train_begin(None, None, None)
    control_after(guard, 0, **{"rollout/searches_per_rollout": 1.0, "entropy": 0.5})
    assert not evaluated(guard, 0, em=0.4, searches=1.0).should_training_stop
    assert not control_after(guard, 1, **{"rollout/searches_per_rollout": 0.9, "entropy": 0.45}).should_evaluate
    control = control_after(guard, 2, **{"rollout/searches_per_rollout": 0.4, "entropy": 0.45})
    assert control.should_evaluate and control.should_save, "0.4 < 0.5 x 1.0 searches at the best step"
    assert control_after(guard, 3, **{"rollout/searches_per_rollout": 1.0, "entropy": 0.1}).should_evaluate, \
        "entropy 0.1 < 0.3 x 0.5"
    assert not evaluated(guard, 3, em=0.38, searches=0.9).should_training_stop, "a validation decides: no collapse"
    assert evaluated(guard, 4, em=0.34, searches=0.9).should_training_stop, "0.06 below the best"


def test_a_resumed_run_compares_with_the_best_its_checkpoint_recorded():
    state, control = TrainerState(), TrainerControl()
    state.log_history = [{"step": 0, "eval_em": 0.4, "eval_searches_per_rollout": 1.0},
                         {"step": 10, "eval_em": 0.5, "eval_searches_per_rollout": 1.0}]
    state.best_global_step = 10
    guard = CollapseGuard(CollapseGuardConfig())
    guard.on_train_begin(None, state, control)
    assert evaluated(guard, 20, em=0.42, searches=1.0).should_training_stop, "0.08 below the step-10 best"


def test_a_bad_guard_setting_names_the_field():
    with pytest.raises(ValueError, match=r"collapse_searches_drop=1\.5; expected a fraction"):
        CollapseGuardConfig(searches_drop=1.5)
    with pytest.raises(ValueError, match=r"collapse_noise_z=-1; expected >= 0"):
        CollapseGuardConfig(noise_z=-1)


def constant_reward(prompts, completions, **kwargs) -> list[float]:
    return [1.0] * len(completions)


def test_groups_without_reward_spread_leave_the_loss(tiny_model_dir, tmp_path, questions_file, retriever_url):
    args = small_config(tmp_path, questions_file, retriever_url, generator="transformers", max_tokens_per_turn=8,
                        max_turns=1, learning_rate=1e-3, drop_equal_reward_groups=True)
    trainer = SearchR1Trainer(model=str(tiny_model_dir), args=args, reward_funcs=[constant_reward])
    before = weights(trainer.model)
    trainer.train()
    logged = [e for e in trainer.state.log_history if "train/dropped_groups" in e]
    assert [e["train/dropped_groups"] for e in logged] == [1.0]
    assert all(torch.equal(before[n], p) for n, p in weights(trainer.model).items()), "no group had a signal"


def test_without_checkpoints_the_guard_still_stops_and_says_it_cannot_end_on_the_best(tmp_path, caplog):
    from searchr1_trl.training.recipe import SearchR1Config

    with caplog.at_level(logging.WARNING):
        args = SearchR1Config(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none",
                              eval_strategy="steps", eval_steps=5, save_strategy="no")
    assert not args.load_best_model_at_end and args.metric_for_best_model == KEEP_METRIC
    assert any("keeps no checkpoint to end on the best one" in r.getMessage() for r in caplog.records)


def test_a_report_sample_without_validation_names_what_to_set(tmp_path, questions_file):
    from searchr1_trl.training.recipe import SearchR1Config

    args = SearchR1Config(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none",
                          eval_strategy="no", report_num_samples=5, train_data_path=questions_file,
                          eval_data_path=questions_file)
    with pytest.raises(ValueError, match="report_num_samples=5 is evaluated beside validation"):
        build_task(args)
