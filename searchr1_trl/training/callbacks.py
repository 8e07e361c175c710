"""The trainer's callbacks: the guards that keep a non-finite optimizer step out of the weights and a collapsed
policy out of the saved model.

**The collapse guard** (:class:`CollapseGuard`): GRPO on search rollouts can teach a policy to stop searching, and the
saved model must never be worse on validation than the best one the run saw.

Measured on one H200 (the offline GPU recipe, 3 seeds): between steps 15 and 30 one seed's searches per rollout fell
1.00 -> 0.17 and its validation EM 0.376 -> 0.078, far below its own warm start, and the job exited 0. So:

- **The saved model is the newest validated checkpoint within the noise of the best**: a validation's checkpoint is
  kept when its EM is no more than ``noise_z`` standard errors below the best EM seen and it did not collapse. One
  standard error of the difference of two EMs on ``n`` scored questions is ``sqrt((p1 (1 - p1) + p2 (1 - p2)) / n)``
  (0.030 for two EMs near 0.37 on 500 questions). Without a collapse training therefore ends on its last step unless
  an earlier checkpoint beats it by more than that noise: the "best of six validations" was mostly noise, and it cost
  EM on the disjoint report sample (0.366 kept vs 0.400 at the last step in one run). It rides on transformers' own
  ``load_best_model_at_end``: the guard hands :data:`KEEP_METRIC` to ``metric_for_best_model``, every validation
  saves, the kept checkpoint survives rotation and training ends on it. The step-0 validation (``eval_on_start``,
  e.g. right after a warm start) is a candidate too: the trainer saves ``checkpoint-0`` for it
  (:meth:`CollapseGuard.wants_start_checkpoint`).
- **A collapse stops training**: validation EM ``em_drop`` or more below the best seen, or searches per rollout
  below ``searches_drop`` times those of the best checkpoint. One warning line says which, and training ends on the
  kept checkpoint, which a collapsed step never is.
- **Training rollouts are watched between validations**: when their searches per rollout fall below
  ``searches_drop`` times those at the best checkpoint's step, or their token entropy below ``entropy_drop`` times
  its value there, the guard asks for a validation (and a save) at once instead of waiting for the next one; the
  validation decides, so a noisy batch alone never stops a run.

It only acts where training validates (``eval_strategy`` not ``no``); without checkpoints (``save_strategy: no``) it
still stops on a collapse, with a warning at start that it cannot end on the best one. The choice is made on the
validation sample, so figures to report come from another one (``report_num_samples``).

**The non-finite gradient guard** (:class:`NonFiniteGradientGuard`): an optimizer step whose gradients hold a NaN or
inf is skipped, not written into the weights; :data:`MAX_CONSECUTIVE_NONFINITE_STEPS` in a row stop training.

**The divergent step guard** (:class:`DivergentStepGuard`, asynchronous rollouts with ``max_behaviour_kl``): a step
whose rollouts the policy has moved too far from is skipped, so the next trains on rollouts of the same weights.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import torch
from transformers import TrainerCallback

logger = logging.getLogger(__name__)

MAX_CONSECUTIVE_NONFINITE_STEPS = 3
# What the guard hands transformers to rank checkpoints by (``metric_for_best_model``): the step plus one where the
# step's checkpoint is to be kept, else -1, so a kept step always ranks above every earlier one.
KEEP_METRIC = "kept_step"


@dataclass
class CollapseGuardConfig:
    enabled: bool = field(
        default=True,
        metadata={"help": "Keep the best checkpoint by validation EM, stop on a collapse and end on the best "
                          "checkpoint (needs eval_strategy steps and save_steps a multiple of eval_steps)."},
    )
    em_drop: float = field(
        default=0.05,
        metadata={"help": "Collapse: validation EM this far (absolute) or more below the best seen."},
    )
    searches_drop: float = field(
        default=0.5,
        metadata={"help": "Collapse: searches per rollout below this fraction of the best checkpoint's (validation), "
                          "or of training rollouts at its step (asks for a validation at once)."},
    )
    noise_z: float = field(
        default=1.0,
        metadata={"help": "Standard errors of the EM difference that count as noise: the saved model is the newest "
                          "validated checkpoint whose EM is within this many of the best EM seen (0: the best)."},
    )
    entropy_drop: float = field(
        default=0.3,
        metadata={"help": "Token entropy of training rollouts below this fraction of its value at the best "
                          "checkpoint's step asks for a validation at once."},
    )

    def __post_init__(self):
        if self.em_drop <= 0:
            raise ValueError(f"collapse_em_drop={self.em_drop}; expected > 0 (an absolute EM drop, e.g. 0.05)")
        if self.noise_z < 0:
            raise ValueError(f"collapse_noise_z={self.noise_z}; expected >= 0 (standard errors, e.g. 1)")
        for name in ("searches_drop", "entropy_drop"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"collapse_{name}={getattr(self, name)}; expected a fraction in [0, 1)")


class CollapseGuard(TrainerCallback):
    """See the module docstring. ``collapse`` holds the warning of the collapse that stopped training, if any."""

    def __init__(self, config: CollapseGuardConfig):
        self.config = config
        self.training = False
        self.best: dict | None = None  # {"step", "em", "searches", and the training rollouts' at that step}
        self.train_at: dict[int, dict[str, float]] = {}  # step -> the training signals logged at it
        self.collapse: str | None = None

    def wants_start_checkpoint(self, state) -> bool:
        """Whether the validation just run is training's step-0 one, which must be saved as a candidate."""
        return self.training and state.global_step == 0

    def on_train_begin(self, args, state, control, **kwargs):
        self.training = True
        # A resumed run continues from the best its checkpoint's history holds, not from its first validation after
        # resume.
        evals = [e for e in getattr(state, "log_history", None) or [] if "eval_em" in e]
        if evals:
            best = max(evals, key=lambda e: e["eval_em"])
            self.best = {"step": best["step"], "em": best["eval_em"],
                         "searches": best.get("eval_searches_per_rollout", 0.0)}

    def on_train_end(self, args, state, control, **kwargs):
        self.training = False

    def on_log(self, args, state, control, logs=None, **kwargs):
        signals = {key: logs[key] for key in ("rollout/searches_per_rollout", "entropy") if key in (logs or {})}
        if not self.training or not signals or "eval_em" in logs:
            return
        self.train_at[state.global_step] = signals
        reference = self.train_at.get(self.best["step"], {}) if self.best else {}
        for key, fraction in (("rollout/searches_per_rollout", self.config.searches_drop),
                              ("entropy", self.config.entropy_drop)):
            if key in signals and reference.get(key) and signals[key] < fraction * reference[key]:
                logger.warning("collapse guard: step %d training %s %.3f < %.2f x %.3f at the best step %d: "
                               "validating now", state.global_step, key, signals[key], fraction, reference[key],
                               self.best["step"])
                control.should_evaluate = control.should_save = True
                return

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        if not self.training or "eval_em" not in (metrics or {}):
            return
        em, searches = metrics["eval_em"], metrics.get("eval_searches_per_rollout", 0.0)
        metrics[f"eval_{KEEP_METRIC}"] = -1.0  # until the step is shown to be kept
        if self.best is None or em > self.best["em"]:
            self.best = {"step": state.global_step, "em": em, "searches": searches}
            metrics[f"eval_{KEEP_METRIC}"] = state.global_step + 1.0
            return
        reasons = []
        if em <= self.best["em"] - self.config.em_drop:
            reasons.append(f"validation EM {em:.3f} is {self.best['em'] - em:.3f} below the best {self.best['em']:.3f}")
        if self.best["searches"] and searches < self.config.searches_drop * self.best["searches"]:
            reasons.append(f"searches per rollout {searches:.2f} < {self.config.searches_drop} x "
                           f"{self.best['searches']:.2f}")
        if reasons:
            self.collapse = (f"collapse guard: step {state.global_step}: {' and '.join(reasons)} (best: step "
                             f"{self.best['step']}); training stops and ends on the step-{self.best['step']} "
                             f"checkpoint")
            logger.warning(self.collapse)
            control.should_training_stop = True
            return
        scored = metrics.get("eval_num_samples", 0) - metrics.get("eval_search_failed", 0)
        if em >= self.best["em"] - self.config.noise_z * em_noise(em, self.best["em"], scored):
            metrics[f"eval_{KEEP_METRIC}"] = state.global_step + 1.0


def em_noise(em: float, other: float, n: float) -> float:
    """One standard error of the difference of two EMs measured on ``n`` questions each (as independent
    proportions: conservative for the same questions, whose outcomes agree more often than chance);
    ``em_noise(0.37, 0.40, 500)`` -> 0.0308. Infinite without questions: nothing can then be told apart."""
    if n <= 0:
        return math.inf
    return math.sqrt((em * (1 - em) + other * (1 - other)) / n)


class NonFiniteGradientGuard(TrainerCallback):
    """Skips an optimizer step whose gradients hold a NaN or inf, instead of writing them into the weights.

    One such step (seen on an H200: Qwen2.5-0.5B, bf16 autocast, lr 1e-5, step 5) turns every weight into NaN, and
    the run then dies at the next sampling with a CUDA assert that names nothing. Skipped steps are logged as
    ``train/skipped_nonfinite_step`` (the fraction of steps skipped per log) with a warning; after
    :data:`MAX_CONSECUTIVE_NONFINITE_STEPS` in a row training stops with an error, since the run is then broken, not
    unlucky. Under DeepSpeed ZeRO the gradients are partitioned away from ``param.grad`` and this guard sees none;
    there DeepSpeed's own ``bf16.check_grad_overflow`` (on by default in 0.19) skips such steps.
    """

    def __init__(self, metrics: dict[str, list[float]]):
        self.metrics = metrics
        self.consecutive = 0

    def on_pre_optimizer_step(self, args, state, control, model=None, optimizer=None, **kwargs):
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        if not grads or torch.stack([torch.isfinite(g).all() for g in grads]).all():
            self.consecutive = 0
            self.metrics["train/skipped_nonfinite_step"].append(0.0)
            return
        self.consecutive += 1
        if self.consecutive >= MAX_CONSECUTIVE_NONFINITE_STEPS:
            raise FloatingPointError(
                f"the gradients held NaN or inf at {self.consecutive} optimizer steps in a row (last: step "
                f"{state.global_step + 1}); lower learning_rate or train without bf16/fp16 autocast")
        logger.warning("optimizer step %d skipped: the gradients hold NaN or inf (the weights are left as they were)",
                       state.global_step + 1)
        optimizer.zero_grad(set_to_none=True)  # an optimizer skips parameters without a gradient
        self.metrics["train/skipped_nonfinite_step"].append(1.0)


class DivergentStepGuard(TrainerCallback):
    """Skips the optimizer step of an asynchronous step whose rollouts the policy has moved too far from
    (``max_behaviour_kl``; :mod:`searchr1_trl.training.experimental.async_rollouts` says why). The trainer hands it
    each step's behaviour gap,
    averaged over processes so every replica skips alike; skipped steps are logged as ``async/skipped_divergent``.

    A skip keeps the weights, so after ``max_staleness`` skips in a row every rollout in flight was sampled by the
    weights it will train: a gap over the bound then is not the policy moving but the generator serving other weights
    than the trainer's (a broken push), and training stops with an error saying so."""

    def __init__(self, max_gap: float, max_staleness: int, metrics: dict[str, list[float]]):
        self.max_gap, self.max_staleness, self.metrics = max_gap, max_staleness, metrics
        self.gap: float | None = None  # of the step being trained, until its optimizer step
        self.consecutive = 0

    def on_pre_optimizer_step(self, args, state, control, model=None, optimizer=None, **kwargs):
        gap, self.gap = self.gap, None
        skip = gap is not None and abs(gap) > self.max_gap  # moved far either way
        self.consecutive = self.consecutive + 1 if skip else 0
        if self.consecutive > self.max_staleness:
            raise RuntimeError(
                f"step {state.global_step + 1}: the policy is {gap:+.4f} nats a token from the weights that sampled "
                f"its rollouts although the last {self.max_staleness} step(s) were skipped, so those were these very "
                f"weights: the generator does not serve the trainer's weights; check the weight push (weight_sync)")
        self.metrics["async/skipped_divergent"].append(float(skip))
        if skip:
            logger.warning("optimizer step %d skipped: the policy moved %+.4f nats a token from the weights that "
                           "sampled its rollouts (max_behaviour_kl %g); the next step trains on rollouts of these "
                           "weights", state.global_step + 1, gap, self.max_gap)
            optimizer.zero_grad(set_to_none=True)  # an optimizer skips parameters without a gradient
