"""The generator's gap on a lock-step step: TRL's two sampling metrics, logged where TRL logs none."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
from accelerate import Accelerator
from transformers import AutoModelForCausalLM

from searchr1_trl.training import trainer as trainer_module
from searchr1_trl.training.generator_gap import GeneratorGap
from tests.test_trainer import small_config, trainer_with_text_reward

MEAN, MAX = "sampling/sampling_logp_difference/mean", "sampling/sampling_logp_difference/max"


def micro_batch(logps: list[list[float]], completion: list[list[int]], tool: list[list[int]]) -> dict:
    rows = len(logps)
    return {"sampling_per_token_logps": torch.tensor(logps), "completion_mask": torch.tensor(completion),
            "tool_mask": torch.tensor(tool), "advantages": torch.zeros(rows)}


def test_the_gap_covers_the_loss_tokens_of_every_micro_batch_and_is_logged_once_a_step():
    metrics = {MEAN: [], MAX: []}
    gap = GeneratorGap(Accelerator(cpu=True), metrics)
    first = micro_batch([[-1.0, -2.0, -3.0]], [[1, 1, 1]], [[1, 0, 1]])  # the middle token is a tool's: not scored
    second = micro_batch([[-0.5, math.nan, -9.0]], [[1, 1, 0]], [[1, 1, 1]])  # NaN: unscored; the last is padding
    gap.expect({"sampling_per_token_logps": torch.zeros(2, 3), "advantages": torch.zeros(2)})
    gap.begin_loss(first)
    gap.forward(torch.tensor([[-1.5, 5.0, -2.0]]))
    assert metrics == {MEAN: [], MAX: []}, "half the step's rollouts are in"
    gap.end_loss()
    gap.begin_loss(second)
    gap.forward(torch.tensor([[-0.25, -1.0, 0.0]]))
    assert metrics[MEAN] == [pytest.approx((0.5 + 1.0 + 0.25) / 3)] and metrics[MAX] == [pytest.approx(1.0)]
    gap.forward(torch.tensor([[7.0, 7.0, 7.0]]))  # a forward outside a loss (TRL's reference log-probs)
    assert len(metrics[MEAN]) == 1


def test_a_step_trl_measured_itself_or_without_the_generators_logprobs_is_not_measured_again():
    metrics = {MEAN: [], MAX: []}
    gap = GeneratorGap(Accelerator(cpu=True), metrics)
    batch = micro_batch([[-1.0]], [[1]], [[1]])
    for output in ({**batch, "importance_sampling_ratio": torch.ones(1, 1)},
                   {key: value for key, value in batch.items() if key != "sampling_per_token_logps"}):
        gap.expect(output)
        gap.begin_loss(output)
        gap.forward(torch.zeros(1, 1))
    assert metrics == {MEAN: [], MAX: []}


def test_a_step_trl_scored_before_its_update_is_measured_from_those_log_probs_and_not_again_in_its_losses():
    # several optimizer steps a generation: a later micro-batch's loss forward runs on updated weights
    metrics = {MEAN: [], MAX: []}
    gap = GeneratorGap(Accelerator(cpu=True), metrics)
    batch = micro_batch([[-1.0, -2.0]], [[1, 1]], [[1, 1]])
    gap.expect({**batch, "old_per_token_logps": torch.tensor([[-1.5, -2.0]])})
    assert metrics[MEAN] == [pytest.approx(0.25)] and metrics[MAX] == [pytest.approx(0.5)]
    gap.begin_loss(batch)
    gap.forward(torch.tensor([[3.0, 3.0]]))
    assert len(metrics[MEAN]) == 1


@pytest.mark.slow
def test_the_gap_stays_near_zero_on_the_trainers_weights_and_jumps_when_the_generator_runs_other_weights(
        tiny_model_dir, questions_file, retriever_url, tmp_path, monkeypatch):
    args = small_config(tmp_path, questions_file, retriever_url, max_steps=2, generator="transformers",
                        max_tokens_per_turn=8, max_turns=1, learning_rate=1e-3)
    trainer = trainer_with_text_reward(str(tiny_model_dir), args)
    # A fault injected on purpose: from step 1 on the generator runs weights the trainer does not hold, as a server
    # does whose push landed corrupted (the tiny model's logits are near uniform, so a step of training alone would
    # barely move them: the stand-in is noise on every weight).
    other = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=trainer.model.dtype).eval()
    with torch.no_grad():
        generator = torch.Generator().manual_seed(0)
        for parameter in other.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.1)
    unwrap = trainer_module.unwrap_model_for_generation

    def generator_weights(model, accelerator):
        return contextlib.nullcontext(other) if trainer.state.global_step >= 1 else unwrap(model, accelerator)

    monkeypatch.setattr(trainer_module, "unwrap_model_for_generation", generator_weights)
    trainer.train()
    steps = [entry for entry in trainer.state.log_history if "reward" in entry]
    means, largest = [s[MEAN] for s in steps], [s[MAX] for s in steps]
    print(f"generator's gap, mean / max: step 1 {means[0]:.2e} / {largest[0]:.2e}, step 2 {means[1]:.2e} / "
          f"{largest[1]:.2e}")
    assert len(steps) == 2
    assert largest[0] < 1e-3, "the in-process generator samples from the trainer's own weights"
    assert means[1] > 1e-2 and means[1] > 100 * means[0]
