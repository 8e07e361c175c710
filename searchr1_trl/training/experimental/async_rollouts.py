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
- **The importance-sampling correction** and the weighted KL term: :mod:`.staleness`.
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
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from searchr1_trl.training.experimental import warn_experimental
from searchr1_trl.training.experimental.staleness import LINEAR_IN_ADVANTAGE_LOSSES, TOKEN_SUM_LOSSES

logger = logging.getLogger(__name__)



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
