"""The staleness correction of asynchronous rollouts: a rollout sampled by older weights, weighted to train as one of
the current weights.

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

What of TRL 1.16 this relies on: the keys ``sampling_per_token_logps``, ``old_per_token_logps``,
``importance_sampling_ratio`` and ``ref_per_token_logps`` of ``_generate_and_score_completions``' output, and
``_compute_loss`` reading (B, T) advantages as they are, after its forward (where :class:`InLossWeights` folds them),
and building its KL term as :func:`weighted_kl` repeats it;
``tests/test_async_rollouts.py`` checks the folded weight and the KL term against TRL's own.
"""

from __future__ import annotations

import math

import torch

from searchr1_trl.training.update import loss_mask

LINEAR_IN_ADVANTAGE_LOSSES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo", "cispo", "sapo")
TOKEN_SUM_LOSSES = ("dapo", "cispo")  # summed over tokens / num_items_in_batch: the KL term's weighting (weighted_kl)
WEIGHTS = "behaviour_weights"  # the key weight_by_behaviour adds to the step's output: pi_current / pi_behaviour
IMPORTANCE_SAMPLING_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")  # TRL 1.16's


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




class StalenessCorrection:
    """What the correction adds to a trainer's step, through the trainer's hooks: the advantages weighted once TRL has
    scored the step (:meth:`weigh`), or in each micro-batch's loss forward where TRL computed no current-weights
    log-probs (:class:`InLossWeights`, :meth:`forward`); the KL term weighted (:meth:`kl_term`); and each step's
    behaviour gap, averaged over processes (every replica must skip alike), handed to the divergent step guard."""

    def __init__(self, args, metrics: dict[str, list[float]], accelerator, guard=None):
        self.args, self.metrics, self.accelerator, self.guard = args, metrics, accelerator, guard
        self.in_loss: InLossWeights | None = None  # a step weighted in its loss
        self._weigh: dict | None = None  # the micro-batch whose loss forward gives its weights
        self._logps: list[torch.Tensor] | None = None  # the loss forward's log-probs, for the weighted KL

    def weigh(self, output: dict) -> dict:
        """A training step's scored ``output`` with its advantages weighted by pi_current / pi_behaviour where TRL
        did not weight the loss (:func:`weight_by_behaviour`): now, from TRL's current-weights log-probs, or in the
        loss from its forward's where TRL computed none."""
        if not self.args.vllm_importance_sampling_correction:
            return output
        proximal = output.get("old_per_token_logps")
        if proximal is None:
            self.in_loss = InLossWeights(output["advantages"].size(0))
            return output
        advantages = output["advantages"]
        output = weight_by_behaviour(output, proximal, self.args)
        self._hand_gap(log_behaviour(output, advantages, proximal, self.args, self.metrics))
        return output

    def begin_loss(self, inputs: dict, beta: float) -> bool:
        """A micro-batch's loss begins; whether its KL term is the weighted one (TRL's loss then runs without its
        own, and :meth:`kl_term` adds it)."""
        self._weigh = inputs if self.in_loss is not None else None  # set by a training step only
        weighted = beta != 0.0 and (WEIGHTS in inputs or self._weigh is not None)
        self._logps = [] if weighted else None
        return weighted

    def forward(self, logps: torch.Tensor) -> None:
        """The loss forward's log-probs: kept for the KL term, and folded into the micro-batch's weights (TRL reads
        its advantages after this forward)."""
        if self._logps is not None:
            self._logps.append(logps)
        if self._weigh is not None:
            micro_batch, self._weigh = self._weigh, None
            gap = self.in_loss.fold(micro_batch, logps.detach(), self.args, self.metrics)
            if gap is not None:  # the step's last micro-batch
                self.in_loss = None
                self._hand_gap(gap)

    def kl_term(self, inputs: dict, mask: torch.Tensor, beta: float, training: bool, accumulation_steps: int,
                metrics: dict[str, list[float]]) -> torch.Tensor:
        """``beta`` times the weighted KL of the micro-batch's loss tokens, normalised as TRL's dapo and cispo losses
        are (the only ones async KL runs with: ``check_recipe``); logs TRL's ``kl`` metric, unweighted."""
        kl, weighted = weighted_kl(torch.cat(self._logps), inputs, mask, self.args)
        normalizer = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
        if training:
            normalizer = normalizer * accumulation_steps / self.args.steps_per_generation
        totals = self.accelerator.reduce(torch.stack([(kl * mask).sum().detach(), mask.sum().float()]), "sum")
        metrics["kl"].append((totals[0] / totals[1].clamp(min=1.0)).item())
        return beta * (weighted * mask).sum() / normalizer

    def end_loss(self) -> None:
        """The micro-batch's loss is done (or failed): nothing of it is kept."""
        self._weigh = self._logps = None

    def _hand_gap(self, gap: float) -> None:
        if self.guard is not None:
            gap = torch.tensor(gap, device=self.accelerator.device)
            self.guard.gap = self.accelerator.reduce(gap, "mean").item()
