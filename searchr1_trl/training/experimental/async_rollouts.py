"""Asynchronous rollouts: the generator samples the next steps' questions while the trainer updates.

Experimental: off by default (``async_rollouts``), warned once when on (:mod:`searchr1_trl.training.experimental`).
What this module decides:

- **One step off-policy, bounded.** When the trainer takes step ``i``'s rollouts it launches those of steps
  ``i+1 .. i+max_staleness`` on the rollout loop (a background thread) and returns at once, so generation overlaps the
  reference forward, the update and the optimizer step. Each rollout is tagged with the **policy version** it was
  sampled with: the optimizer step whose weights the generator served when it was launched.
- **Rollouts in flight at a weight push** (``in_flight_rollouts``): ``finish`` (default) waits for them
  (:meth:`RolloutPipeline.drain`): they end on the old weights and keep the old tag, at the cost of the wait.
  ``pause`` freezes them on the vLLM server for the push (its ``/pause?mode=keep``,
  :class:`~searchr1_trl.serving.weight_sync.PausedPush`) and lets them go on with the new weights: no wait, and their
  later
  tokens are one version newer than their tag. The tag stays the launch version (staleness is counted from the
  oldest weights a rollout saw, so the bound still holds), and the importance weight below uses each token's own
  behaviour log-prob, which vLLM reports from the weights that sampled it: the correction is exact either way.
- **The staleness bound**: a rollout is trained on only if ``step - version <= max_staleness``; an older one is
  dropped, counted (``async/stale_dropped``, the fraction of a step's rollouts) and its prompt rolled out again on the
  current weights, so the step keeps its questions and GRPO groups. With rollouts launched ``max_staleness`` steps
  ahead none is older in normal running; the bound is what makes that a guarantee.
- **The importance-sampling correction.** The loss is the decoupled PPO objective: the clipped ratio is taken against
  the current weights (the proximal policy, whose log-probs TRL computes before the update), and every token is
  weighted by ``pi_current / pi_behaviour`` from the generator's own log-probs (the ``logprobs`` our ``rollout_func``
  returns), bounded as TRL's ``vllm_importance_sampling_mode`` / ``_clip_min`` / ``_clip_max`` say (TRL 1.16 default:
  ``sequence_mask`` with C_max 3). TRL 1.16 computes exactly this weight in ``_generate_and_score_completions``, but
  only when ``use_vllm`` is set, which here means ``weight_sync="nccl"`` (its NCCL client): there TRL's is used as it
  is. With ``weight_sync="reload"`` or ``"ipc"`` or the in-process generator TRL skips it, so
  :func:`importance_weights` computes the same weight with the same knobs (from the current weights' log-probs of the
  loss's own forward where TRL computed none: :class:`InLossWeights`, no forward of its own) and
  :func:`fold_into_advantages` multiplies it into the advantages: for every loss TRL builds as ``-min(r A, clip(r)
  A)`` or a multiple of ``A`` (grpo, bnpo, dr_grpo, dapo, luspo, cispo, sapo) a weight ``w >= 0`` on ``A`` is the
  same as on the per-token loss, which is where TRL puts it (vespo is not linear in ``A`` and is refused).
- **The KL term is weighted too.** TRL adds ``beta * KL`` to the per-token loss after its importance weight, and the
  k3 estimate ``exp(ref - logp) - (ref - logp) - 1`` assumes tokens sampled from the current policy. A rollout
  sampled a step earlier can hold a token the last update made far less likely while the reference still likes it:
  on an H200 (experiments/results, "Asynchronous rollouts") one such step's mean KL was 63.5 against at most 0.37
  lock-step. With ``beta > 0`` the KL of every token is weighted by the same ``pi_current / pi_behaviour`` as its
  advantage (:func:`weighted_kl`; ``E_behaviour[w * k3] = E_current[k3]``, and ``w * k3`` stays near
  ``pi_ref / pi_behaviour``), for the token-sum losses (dapo, cispo) whose normalisation the trainer repeats. That
  makes the estimate right; it does not tame the drift behind such a spike, since with ``use_bias_correction_kl``
  (TRL's default) the term's gradient is ``beta * (logp - ref)``, linear in the gap.
- **How far the policy moved** on the rollouts a step trains on is logged (:func:`log_staleness`), and so is the
  share of negative-advantage tokens a ``*_mask`` mode zeroes (``async/negative_zeroed``: errors the policy now likes
  more than the weights that sampled them). TRL's ``off_policy_mask_threshold`` (DeepSeek-V3.2's off-policy sequence
  masking: a negative-advantage rollout the policy has moved far from leaves the loss) works as TRL has it, from the
  same behaviour log-probs, and ``sequence_truncate`` clips where ``sequence_mask`` zeroes. TRL's defaults stand (no
  mask, ``sequence_mask``); the two together (``async_safe`` in experiments/gpu_path.sh) kept three seeds on one H200
  within 0.02 EM of lock-step (experiments/results/README.md, "The remedy, three seeds").
- **A bound on how far the policy moved** (``max_behaviour_kl``, 0.01 by default, 0: off): a step whose mean gap
  ``log pi_behaviour - log pi_current`` exceeds it in size (the policy moved far, either way) keeps its weights: the
  optimizer step is skipped (:class:`~searchr1_trl.training.callbacks.DivergentStepGuard`). With ``max_staleness`` 1 the
  rollouts then in flight were sampled by exactly those weights, so the next step is on-policy, as lock-step's every
  step is (with more, after that many skips; a gap over the bound then stops training: the push is broken). Why:
  where a policy tips over its tool-call format in one update, lock-step corrects it at the next step from the tipped
  policy's own failures; one step stale, that step trains instead on rollouts the tipped weights no longer produce,
  whose importance weights are ~0 (on an H100, gap 0.245 a token, weights 0.08), and the policy goes on to fail every
  rollout, where GRPO's advantages are 0 and nothing corrects it (experiments/results/README.md, "The update without
  checkpointing"). At 0.01, with ``async_safe``'s two knobs, three seeds alone on an H100 ran 30 steps 1.74-1.79x
  faster than lock-step through tmpfs (one run on another H100), none collapsing, EM level with lock-step's (the seed
  that tipped was skipped twice and recovered as lock-step does; experiments/results/README.md, "The bound on the GPU").
  It is on by default where it can run (no DeepSpeed, the correction on; elsewhere it is off, said once), and a
  recipe that turns it off there is warned.
- **Validation stays synchronous**: it waits for the rollouts in flight and launches none.
- **Resume is exact for the question stream**: questions are drawn ahead (:class:`Lookahead`) but a checkpoint saves
  the stream's state from before the oldest draw no step has trained on, so rollouts in flight at a checkpoint are
  dropped with the run and their questions served again after the resume.
- **The in-process generator** samples from a copy of the policy (:class:`SnapshotPush`) that each push refreshes:
  generating from the weights the optimizer is writing would mix versions. It costs one more copy of the weights and
  is refused under DeepSpeed, whose partitioned weights the copy would not hold.

What of TRL 1.16 this relies on: the keys ``sampling_per_token_logps``, ``old_per_token_logps``,
``importance_sampling_ratio`` and ``ref_per_token_logps`` of ``_generate_and_score_completions``' output, and
``_compute_loss`` reading (B, T) advantages as they are, after its forward (where :class:`InLossWeights` folds them),
and building its KL term as :func:`weighted_kl` repeats it;
``tests/test_async_rollouts.py`` checks the folded weight and the KL term against TRL's own.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from searchr1_trl.training.experimental import warn_experimental
from searchr1_trl.training.update import loss_mask

logger = logging.getLogger(__name__)

LINEAR_IN_ADVANTAGE_LOSSES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo", "cispo", "sapo")
TOKEN_SUM_LOSSES = ("dapo", "cispo")  # summed over tokens / num_items_in_batch: the KL term's weighting (weighted_kl)
WEIGHTS = "behaviour_weights"  # the key weight_by_behaviour adds to the step's output: pi_current / pi_behaviour
IMPORTANCE_SAMPLING_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")  # TRL 1.16's


@dataclass
class AsyncRolloutsConfig:
    """Whether rollouts overlap the update, and how stale a rollout may be."""

    enabled: bool = field(
        default=False,
        metadata={"help": "Experimental (warned once): generate the next max_staleness steps' rollouts while the "
                          "trainer updates; each is weighted by pi_current / pi_behaviour (TRL's "
                          "vllm_importance_sampling_* knobs). Off: lock-step."},
    )
    max_staleness: int = field(
        default=1,
        metadata={"help": "With async_rollouts: how many optimizer steps older than the weights it trains a rollout "
                          "may be; rollouts are launched that far ahead, an older one is rolled out again."},
    )
    in_flight: str = field(
        default="finish",
        metadata={"help": "With async_rollouts, the rollouts in flight at a weight push: `finish` waits for them "
                          "(they end on the weights they started with); `pause` (experimental, warned once) freezes "
                          "them on the vLLM server for the push (/pause) and lets them go on with the new weights, "
                          "without the wait. `pause` needs generator vllm; it collapsed the one GPU run measured."},
    )

    max_behaviour_kl: float = field(
        default=0.01,
        metadata={"help": "With async_rollouts: skip the optimizer step of a step whose rollouts' behaviour gap "
                          "(async/behaviour_kl: log pi_behaviour - log pi_current per loss token, over all processes) "
                          "exceeds this in size, so the next step trains on rollouts of the current weights, as "
                          "lock-step would; counted as async/skipped_divergent. 0.01 kept three seeds on an H100 "
                          "level with lock-step; off (said once) under DeepSpeed and without "
                          "vllm_importance_sampling_correction, where it cannot skip or measure. 0: never skip."},
    )

    def __post_init__(self):
        if not self.max_behaviour_kl >= 0:
            raise ValueError(f"max_behaviour_kl={self.max_behaviour_kl}; expected a gap > 0 in nats a token, or 0 "
                             "to never skip")
        if self.max_staleness < 1:
            raise ValueError(f"max_staleness={self.max_staleness}; expected >= 1 (0 is lock-step: set "
                             "async_rollouts false)")
        if self.in_flight not in ("finish", "pause"):
            raise ValueError(f"in_flight_rollouts={self.in_flight!r}; expected 'finish' or 'pause'")


def check_recipe(args, deepspeed: bool) -> float | None:
    """ValueError for a recipe the asynchronous mode cannot run as the module docstring says; the bound on the
    behaviour gap the run applies (``max_behaviour_kl``; None where it is off or cannot run). Warns once that the
    mode is experimental and warns when the bound is off where it could run, or cannot run where it is set."""
    AsyncRolloutsConfig(args.async_rollouts, args.max_staleness, args.in_flight_rollouts,
                        args.max_behaviour_kl)  # checks the knobs
    warn_experimental("async_rollouts", "rollouts one step stale tipped two one-GPU runs over where lock-step "
                      "recovered; max_behaviour_kl (0.01 by default) kept three seeds on an H100 level with lock-step "
                      "(experiments/results/README.md, 'The bound on the GPU')")
    if args.in_flight_rollouts == "pause" and args.generator != "vllm":
        raise ValueError(f"in_flight_rollouts='pause' with generator={args.generator!r}: pausing rollouts for a push "
                         "is vLLM's (/pause on the server); use generator='vllm' or in_flight_rollouts='finish'")
    if args.in_flight_rollouts == "pause":
        warn_experimental("in_flight_rollouts='pause'", "in its one GPU run (H200, vLLM 0.26) the server and the "
                          "trainer parted by 0.43 nats a token at step 13 (importance weight mean 1.8e-07) and it "
                          "collapsed, where 'finish' ran sound; the cause is not found (experiments/results/README.md, "
                          "'Alone on the GPU'). Use 'finish' unless you are investigating it")
    if args.loss_type not in LINEAR_IN_ADVANTAGE_LOSSES:
        raise ValueError(f"async_rollouts with loss_type={args.loss_type!r}: the staleness correction weights the "
                         "advantages, which equals weighting the loss only for "
                         f"{', '.join(LINEAR_IN_ADVANTAGE_LOSSES)}")
    if args.beta != 0.0 and args.loss_type not in TOKEN_SUM_LOSSES:
        raise ValueError(f"async_rollouts with beta={args.beta} and loss_type={args.loss_type!r}: the KL term is "
                         f"weighted by the staleness correction for {', '.join(TOKEN_SUM_LOSSES)} only; use one of "
                         "those or beta 0")
    if args.generator == "transformers" and deepspeed:
        raise ValueError("async_rollouts with generator='transformers' under DeepSpeed: the in-process generator "
                         "samples from a copy of the policy, which partitioned weights cannot give; use "
                         "generator='vllm'")
    if args.steps_per_generation != args.gradient_accumulation_steps or args.num_iterations != 1:
        raise ValueError(f"async_rollouts needs one generation per optimizer step (steps_per_generation == "
                         f"gradient_accumulation_steps and num_iterations == 1), got steps_per_generation="
                         f"{args.steps_per_generation}, gradient_accumulation_steps="
                         f"{args.gradient_accumulation_steps}, num_iterations={args.num_iterations}")
    return _behaviour_bound(args, deepspeed)


def _behaviour_bound(args, deepspeed: bool) -> float | None:
    """``max_behaviour_kl`` where the bound can run, else None, saying why."""
    runs = not deepspeed and args.vllm_importance_sampling_correction
    if not args.max_behaviour_kl:
        if runs:
            logger.warning("async_rollouts with max_behaviour_kl 0: two one-GPU asynchronous runs collapsed where "
                           "their policy tipped (experiments/results/README.md, 'The update without checkpointing'); "
                           "0.01, the default, kept three seeds on an H100 level with lock-step ('The bound on the "
                           "GPU'). Leave it at its default unless you are measuring its absence")
        return None
    if not runs:
        why = ("DeepSpeed steps the optimizer inside the last backward, where a step cannot be skipped from outside"
               if deepspeed else "vllm_importance_sampling_correction=False: the gap it bounds is not measured")
        logger.warning("max_behaviour_kl=%g is off in this run: %s", args.max_behaviour_kl, why)
        return None
    return args.max_behaviour_kl


class Lookahead:
    """The question stream's draws, some made before the step that trains on them.

    ``draw()`` makes the next draw (one optimizer step's rows); ``state()`` is the stream's state. Calling the
    lookahead gives the next draw in order, made earlier by :meth:`peek` or now; :meth:`state_dict` is the state from
    before the oldest draw not yet taken, which a checkpoint saves so that a resumed run draws those questions again.
    """

    def __init__(self, draw: Callable[[], list], state: Callable[[], dict]):
        self._draw, self._state = draw, state
        self._ahead: deque[tuple[dict, list]] = deque()  # (stream state before the draw, the draw)

    def __call__(self) -> list:
        return self._ahead.popleft()[1] if self._ahead else self._draw()

    def peek(self, index: int) -> list:
        """The draw ``index`` places after the next one to be taken (0: the next one)."""
        while len(self._ahead) <= index:
            self._ahead.append((self._state(), self._draw()))
        return self._ahead[index][1]

    def state_dict(self) -> dict:
        return self._ahead[0][0] if self._ahead else self._state()


@dataclass
class _Launched:
    prompts: list
    version: int
    future: concurrent.futures.Future
    launched_at: float = field(default_factory=time.perf_counter)
    done_at: float | None = None

    def __post_init__(self):
        self.future.add_done_callback(lambda _: setattr(self, "done_at", time.perf_counter()))

    def generation_s(self) -> float:
        """Launch to last rollout: how long generation took beside the trainer's step (alone: ``rollout/time_s``)."""
        return (self.done_at or time.perf_counter()) - self.launched_at  # the callback may trail result() by a hair


class RolloutPipeline:
    """Rollouts launched ahead of the step that trains on them; see the module docstring.

    ``start(prompts)`` launches the rollouts of ``prompts`` on the rollout loop and returns their future;
    ``lookahead`` is where the prompts of later steps come from (``prompts_of`` turns a draw into them). ``ahead``
    steps are launched ahead (the trainer: ``max_staleness``); ``metrics`` is the trainer's ``train`` metric lists.
    """

    def __init__(self, start: Callable[[list], concurrent.futures.Future], lookahead: Lookahead,
                 prompts_of: Callable[[list], list], max_staleness: int, metrics: dict[str, list[float]],
                 ahead: int | None = None):
        self.start, self.lookahead, self.prompts_of = start, lookahead, prompts_of
        self.max_staleness, self.ahead = max_staleness, max_staleness if ahead is None else ahead
        self.metrics = metrics
        self.version = 0  # the optimizer step whose weights the generator serves: step 0's until the first push
        self._launched: dict[int, _Launched] = {}  # by the step that will train on them
        self.versions: list[int] = []  # of the rollouts the last take() returned

    def pushed(self, version: int) -> None:
        """The generator serves the weights of optimizer step ``version`` from now on."""
        self.version = version

    def drain(self) -> None:
        """Wait until no rollout is in flight: before a push (``in_flight_rollouts="finish"``), so they finish on the
        weights they started with, and before a validation, which runs alone."""
        start = time.perf_counter()
        concurrent.futures.wait([launched.future for launched in self._launched.values()])
        self.metrics["async/drain_s"].append(time.perf_counter() - start)

    def take(self, step: int, prompts: list, last_step: int) -> list:
        """The rollouts of ``prompts``, step ``step``'s, every one within ``max_staleness`` of ``step``; launches the
        next ``ahead`` steps' (below ``last_step``) first, so they generate while the caller trains on these."""
        start = time.perf_counter()
        launched = self._launched.pop(step, None)
        if launched is not None and launched.prompts != prompts:
            raise RuntimeError(f"step {step} trains on other questions than were rolled out for it ahead: the question "
                               "stream was drawn outside the pipeline's lookahead")
        self._launch_ahead(step, last_step)
        if launched is None:  # the first step, or the first after a resume: nothing was launched ahead
            launched = _Launched(prompts, self.version, self.start(prompts))
        rollouts = launched.future.result()
        versions = [launched.version] * len(rollouts)
        stale = [i for i, version in enumerate(versions) if step - version > self.max_staleness]
        if stale:
            again = self.start([prompts[i] for i in stale]).result()
            for i, rollout in zip(stale, again, strict=True):
                rollouts[i], versions[i] = rollout, self.version
        self.versions = versions
        self.metrics["async/stale_dropped"].append(len(stale) / len(rollouts))
        self.metrics["async/staleness"].append(sum(step - v for v in versions) / len(versions))
        self.metrics["async/wait_s"].append(time.perf_counter() - start)
        self.metrics["async/generation_s"].append(launched.generation_s())
        return rollouts

    def _launch_ahead(self, step: int, last_step: int) -> None:
        for offset in range(self.ahead):
            target = step + 1 + offset
            if target >= last_step:
                break
            if target not in self._launched:
                prompts = self.prompts_of(self.lookahead.peek(offset))
                self._launched[target] = _Launched(prompts, self.version, self.start(prompts))

    def cancel(self) -> None:
        """Drop every rollout in flight (training ended or failed); their questions are the lookahead's still."""
        for launched in self._launched.values():
            launched.future.cancel()
        self._launched.clear()


class SnapshotPush:
    """The in-process generator's weights under ``async_rollouts``: a frozen copy of the policy, refreshed by
    ``push``, so generation in the background never reads weights the optimizer is writing."""

    def __init__(self, model: torch.nn.Module):
        self.model = copy.deepcopy(model).eval().requires_grad_(False)
        # TRL's fused LM head sets the policy's `forward` to a closure over the policy's own bound forward, which a
        # deepcopy keeps: the copy would generate with the policy's layers and the weights the optimizer is writing.
        # Generation needs no fused head, so the copy runs its class's forward on its own weights.
        for module in self.model.modules():
            vars(module).pop("forward", None)

    @torch.no_grad()
    def push(self, model: torch.nn.Module) -> None:
        self.model.load_state_dict(model.state_dict())


def weight_by_behaviour(output: dict, proximal: torch.Tensor, args) -> dict:
    """``output`` of ``GRPOTrainer._generate_and_score_completions`` (or one micro-batch of it) with its advantages
    weighted per token by :func:`importance_weights` (TRL's knobs), where TRL has not weighted the loss itself (see the
    module docstring); the weights, TRL's or these, also under :data:`WEIGHTS` for the KL term. ``proximal``: the
    current weights' log-probs."""
    if not args.vllm_importance_sampling_correction:
        return output
    if "importance_sampling_ratio" in output:  # TRL weights the loss itself; the KL term still needs the weights
        output[WEIGHTS] = output["importance_sampling_ratio"]
    else:
        mask = loss_mask(output)
        weights = importance_weights(proximal, output["sampling_per_token_logps"], mask,
                                     args.vllm_importance_sampling_mode, args.vllm_importance_sampling_clip_min,
                                     args.vllm_importance_sampling_clip_max)
        output["advantages"] = fold_into_advantages(output["advantages"], weights, mask.size(1))
        output[WEIGHTS] = weights
    return output


def log_behaviour(weighted: dict, advantages: torch.Tensor, proximal: torch.Tensor, args,
                  metrics: dict[str, list[float]]) -> float:
    """A step's metrics, once :func:`weight_by_behaviour` has weighted it (``advantages``: its (B,) advantages from
    before): the importance weights where they are ours (TRL logs its own) and :func:`log_staleness`. Returns the
    step's behaviour gap (``async/behaviour_kl``)."""
    mask = loss_mask(weighted)
    if "importance_sampling_ratio" not in weighted:
        weights = weighted[WEIGHTS].expand_as(mask)
        per_token = weights[mask.bool()]
        # a *_mask mode zeroes what the policy now likes far more than the weights that sampled it; a
        # negative-advantage rollout there is one the update should have pushed down and made likelier instead
        negative = weights[mask.bool() & (advantages[:, None] < 0)]
        metrics["async/importance_weight_mean"].append(per_token.mean().item() if per_token.numel() else 1.0)
        metrics["async/importance_weight_zeroed"].append(_zeroed(per_token))
        metrics["async/negative_zeroed"].append(_zeroed(negative))
    return log_staleness(proximal, weighted["sampling_per_token_logps"], mask, weighted["advantages"], args, metrics)


class InLossWeights:
    """The importance weights of a step whose current-weights log-probs TRL did not compute (one optimizer step per
    generation, TRL's on-policy case): rather than a forward of its own over every rollout, each micro-batch is
    weighted from its training forward's log-probs, detached. Within a step the weights do not change between
    micro-batches, so those are the current weights' log-probs (TRL's own ``old = logp.detach()``), and TRL's loss
    reads the advantages after that forward. The step's metrics are logged once, over all its ``rows`` rollouts, when
    the last micro-batch is in, as for a whole step (:func:`log_behaviour`)."""

    def __init__(self, rows: int):
        self.rows, self.parts = rows, []

    def fold(self, micro_batch: dict, proximal: torch.Tensor, args, metrics: dict[str, list[float]]) -> float | None:
        """Weight ``micro_batch``'s advantages in place; once the step's last micro-batch is in, log the step and
        return its behaviour gap (None before)."""
        advantages = micro_batch["advantages"]
        weight_by_behaviour(micro_batch, proximal, args)
        keys = ("advantages", "sampling_per_token_logps", "completion_mask", "tool_mask", WEIGHTS)
        self.parts.append({"unweighted": advantages, "proximal": proximal,
                           **{key: micro_batch[key] for key in keys if key in micro_batch}})
        if sum(part["unweighted"].size(0) for part in self.parts) < self.rows:
            return None
        step = {key: torch.cat([part[key] for part in self.parts]) for key in self.parts[0]}
        return log_behaviour(step, step.pop("unweighted"), step.pop("proximal"), args, metrics)


def _zeroed(weights: torch.Tensor) -> float:
    """The share of ``weights`` that are 0 (0 when there are none)."""
    return (weights == 0).float().mean().item() if weights.numel() else 0.0


def log_staleness(proximal: torch.Tensor, behaviour: torch.Tensor, mask: torch.Tensor, advantages: torch.Tensor,
                  args, metrics: dict[str, list[float]]) -> float:
    """How far the last updates moved the policy on the rollouts a step trains on: ``async/behaviour_kl``, the mean
    over loss tokens of ``log pi_behaviour - log pi_current`` (an estimate of KL(behaviour || current)), and
    ``async/behaviour_kl_max``, its largest per-rollout mean, which is what TRL's ``off_policy_mask_threshold``
    (DeepSeek-V3.2's off-policy sequence masking) compares; with that threshold set, ``async/off_policy_masked`` is
    the fraction of rollouts TRL's loss drops (negative advantage, as weighted, and a per-rollout mean above it).
    ``advantages``: (B,) or (B, T), the same along T. Returns the ``async/behaviour_kl`` it logs."""
    gap = torch.nan_to_num(behaviour - proximal, nan=0.0) * mask
    tokens = mask.sum(-1)
    per_rollout = gap.sum(-1) / tokens.clamp(min=1.0)
    mean_gap = (gap.sum() / tokens.sum().clamp(min=1.0)).item()
    metrics["async/behaviour_kl"].append(mean_gap)
    metrics["async/behaviour_kl_max"].append(per_rollout.max().item() if per_rollout.numel() else 0.0)
    if args.off_policy_mask_threshold is not None:
        dropped = (advantages.reshape(len(per_rollout), -1)[:, 0] < 0) & (per_rollout > args.off_policy_mask_threshold)
        metrics["async/off_policy_masked"].append(dropped.float().mean().item() if dropped.numel() else 0.0)
    return mean_gap


def weighted_kl(logps: torch.Tensor, inputs: dict, mask: torch.Tensor, args) -> tuple[torch.Tensor, torch.Tensor]:
    """TRL 1.16's per-token KL to the reference (``_compute_loss``: k3, times ``pi_theta / pi_old`` with
    ``use_bias_correction_kl``; ``mask`` the loss's tokens), and the same weighted by :data:`WEIGHTS`: what a
    micro-batch's loss sums for the KL term in place of TRL's unweighted one (module docstring)."""
    ref = inputs["ref_per_token_logps"]
    kl = torch.exp(ref - logps) - (ref - logps) - 1
    if args.use_bias_correction_kl:
        old = inputs.get("old_per_token_logps")
        log_ratio = logps - (logps.detach() if old is None else old)
        if args.importance_sampling_level == "sequence":
            log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
        kl = kl * torch.exp(log_ratio)
    return kl, kl * inputs[WEIGHTS]


def importance_weights(proximal: torch.Tensor, behaviour: torch.Tensor, mask: torch.Tensor, mode: str,
                       clip_min: float | None, clip_max: float | None) -> torch.Tensor:
    """``pi_proximal / pi_behaviour`` per token (``token_*`` modes, shape (B, T)) or per sequence (``sequence_*``,
    (B, 1)), clipped to [clip_min, clip_max] (``*_truncate``) or zeroed outside it (``*_mask``): TRL 1.16's
    ``vllm_importance_sampling_*`` weight (``GRPOTrainer._generate_and_score_completions``), for the paths where TRL
    does not compute it. Tokens outside ``mask`` and NaN behaviour log-probs count as ratio 1.

    >>> importance_weights(torch.tensor([[0.0, 0.0]]), torch.tensor([[-1.0, 0.0]]), torch.ones(1, 2), "token_truncate",
    ...                    None, 2.0)
    tensor([[2., 1.]])
    """
    diff = torch.nan_to_num((proximal - behaviour) * mask, nan=0.0)
    if mode.startswith("sequence_"):
        diff = diff.sum(-1, keepdim=True)
    ratio = torch.exp(diff)
    if mode.endswith("_truncate"):
        return torch.clamp(ratio, min=clip_min, max=clip_max)
    if mode.endswith("_mask"):
        low = -math.inf if clip_min is None else clip_min
        high = math.inf if clip_max is None else clip_max
        return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)
    raise ValueError(f"vllm_importance_sampling_mode={mode!r}; expected {', '.join(IMPORTANCE_SAMPLING_MODES)}")


def fold_into_advantages(advantages: torch.Tensor, weights: torch.Tensor, length: int) -> torch.Tensor:
    """Per-token advantages ``A * w`` of shape (B, ``length``), from ``advantages`` (B,) and ``weights`` (B, T) or
    (B, 1); TRL's loss reads (B, T) advantages as they are."""
    return (advantages[:, None] * weights).expand(-1, length).contiguous()


def start_in_thread(loop: asyncio.AbstractEventLoop) -> threading.Thread:
    """Run ``loop`` forever in a daemon thread, so rollouts launched on it go on while the caller trains."""
    thread = threading.Thread(target=loop.run_forever, name="rollout-loop", daemon=True)
    thread.start()
    return thread


def stop_thread(loop: asyncio.AbstractEventLoop, thread: threading.Thread) -> None:
    """Stop the loop :func:`start_in_thread` runs and wait for its thread (the loop can then be closed)."""
    loop.call_soon_threadsafe(loop.stop)
    thread.join()


def run_on(loop: asyncio.AbstractEventLoop, coroutine):
    """Run ``coroutine`` on ``loop`` to its result: on the loop's thread when it runs in one, else here."""
    if loop.is_running():
        return asyncio.run_coroutine_threadsafe(coroutine, loop).result()
    return loop.run_until_complete(coroutine)
