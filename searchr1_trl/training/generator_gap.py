"""How far the generator's log-probs of the tokens it sampled are from the trainer's, on a lock-step step.

TRL 1.16 logs this gap as ``sampling/sampling_logp_difference/mean`` and ``/max`` (``|log pi_trainer - log
pi_generator|`` over the loss's tokens) wherever it applies its vLLM importance-sampling correction, that is with
``use_vllm``: here ``weight_sync="nccl"``, its own client. With the CUDA IPC or reload push, or the in-process
generator, TRL computes neither, and a lock-step step has no forward of its own before its update (TRL's on-policy
case), so the gap went unseen on the one-GPU recipes. It is measured here from the loss forward's log-probs, which are
those of the weights the generator was given before it sampled: no forward of its own, no change to the loss.

Why it is worth a line in every step's log: a policy that collapses within one step (reward near 0, KL to the
reference up tenfold) either learned it or sampled from weights the trainer does not hold (a push that did not land, a
generator that drifted). The first leaves this gap where it was; the second makes it jump.
"""

from __future__ import annotations

import torch

from searchr1_trl.training.update import loss_mask


class GeneratorGap:
    """The trainer's hooks in order: :meth:`expect` with a training step's scored output, then per micro-batch
    :meth:`begin_loss` and :meth:`forward` with its loss forward's log-probs; once the step's last micro-batch is in,
    the two metrics are logged once for the step, gathered over processes as TRL gathers them."""

    def __init__(self, accelerator, metrics: dict[str, list[float]]):
        self.accelerator, self.metrics = accelerator, metrics
        self.rows = 0  # rollouts of the expected step whose loss forward is still to come
        self.deltas: list[torch.Tensor] = []
        self._inputs: dict | None = None

    def expect(self, output: dict) -> dict:
        """A training step's scored ``output``, returned as it is: measured in its loss forwards, unless TRL measured
        it itself or the generator returned no log-probs. Where TRL scored the rollouts before the update (several
        optimizer steps or iterations a generation), those log-probs are the sampling weights' and the step is
        measured from them now: later micro-batches' loss forwards come after an update."""
        if "importance_sampling_ratio" in output or output.get("sampling_per_token_logps") is None:
            return output
        if output.get("old_per_token_logps") is not None:
            self.deltas = [self._delta(output, output["old_per_token_logps"])]
            self._log()
        else:
            self.rows, self.deltas = output["advantages"].size(0), []
        return output

    def begin_loss(self, inputs: dict) -> None:
        """A micro-batch's loss begins; its first forward is the policy's (TRL 1.16's ``_compute_loss``)."""
        self._inputs = inputs if self.rows > 0 else None

    def forward(self, logps: torch.Tensor) -> None:
        """The loss forward's log-probs of the micro-batch :meth:`begin_loss` named; logs the step at its last one."""
        if self._inputs is None:
            return
        inputs, self._inputs = self._inputs, None
        self.deltas.append(self._delta(inputs, logps))
        self.rows -= inputs["advantages"].size(0)
        if self.rows <= 0:
            self._log()

    def end_loss(self) -> None:
        """The micro-batch's loss is done (or failed)."""
        self._inputs = None

    @staticmethod
    def _delta(batch: dict, logps: torch.Tensor) -> torch.Tensor:
        """``|logps - the generator's|`` on ``batch``'s loss tokens. TRL's rule: tokens the generator could not score
        (NaN) are left out rather than counted as no gap."""
        delta = (logps.detach().float() - batch["sampling_per_token_logps"].float()).abs()
        return delta[loss_mask(batch).bool() & ~torch.isnan(delta)]

    def _log(self) -> None:
        delta = torch.cat(self.deltas)
        zero = torch.zeros((), device=delta.device)
        mean, largest = (delta.mean(), delta.max()) if delta.numel() else (zero, zero)
        # TRL 1.16's names and reductions
        self.metrics["sampling/sampling_logp_difference/mean"].append(self.accelerator.gather(mean).mean().item())
        self.metrics["sampling/sampling_logp_difference/max"].append(self.accelerator.gather(largest).max().item())
        self.rows, self.deltas = 0, []
