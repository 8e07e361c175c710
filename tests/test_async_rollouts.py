"""Asynchronous rollouts (searchr1_trl/training/experimental/async_rollouts.py): rollouts carry the policy version they
were sampled with,
none older than max_staleness is trained on, stale ones are weighted by pi_current / pi_behaviour as TRL weights
vLLM's, and a resumed run trains on the questions an uninterrupted one does."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import math
import threading
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from test_trainer import StopAfter, small_config, trainer_with_text_reward
from test_update import loss_and_grads, rollout_batch, update_config
from transformers import TrainerCallback

from searchr1_trl.serving.vllm_server import reload_weights
from searchr1_trl.training.callbacks import DivergentStepGuard
from searchr1_trl.training.experimental.async_rollouts import Lookahead, RolloutPipeline, check_recipe
from searchr1_trl.training.experimental.staleness import (
    WEIGHTS,
    fold_into_advantages,
    importance_weights,
    log_behaviour,
    log_staleness,
    weight_by_behaviour,
)
from searchr1_trl.training.parts import build_task
from searchr1_trl.training.resume import STREAM_STATE_FILE
from searchr1_trl.training.trainer import SearchR1Trainer
from searchr1_trl.training.update import loss_mask


class Counter:
    """A question stream of consecutive integers, with a state a checkpoint can hold."""

    def __init__(self, cursor: int = 0):
        self.cursor = cursor

    def draw(self) -> list[int]:
        self.cursor += 1
        return [self.cursor - 1]

    def state(self) -> dict:
        return {"cursor": self.cursor}


class Generator:
    """Rolls a prompt out as ``(prompt, version the pipeline served at the launch)``, at once, or for the launches
    numbered in ``held`` once ``release`` is set."""

    def __init__(self, release: threading.Event | None = None, held: frozenset[int] = frozenset()):
        self.pipeline: RolloutPipeline | None = None
        self.release, self.held, self.launches = release, held, 0
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=4)

    def start(self, prompts):
        version, wait = self.pipeline.version, self.launches in self.held
        self.launches += 1

        def run():
            if wait:
                self.release.wait()
            return [(p, version) for p in prompts]
        return self.pool.submit(run)


def pipeline_over(stream: Counter, max_staleness: int, ahead: int | None = None, release=None,
                  held: frozenset[int] = frozenset()):
    generator = Generator(release, held)
    lookahead = Lookahead(stream.draw, stream.state)
    metrics = defaultdict(list)
    pipeline = RolloutPipeline(generator.start, lookahead, lambda rows: rows, max_staleness, metrics, ahead=ahead)
    generator.pipeline = pipeline
    return pipeline, lookahead, metrics


def train(pipeline, lookahead, steps: range, last_step: int) -> list[list]:
    """What a trainer does with the pipeline per optimizer step: draw, push, take; the rollouts it trained on."""
    trained = []
    for step in steps:
        prompts = lookahead()  # the dataloader's draw of this step
        pipeline.drain()
        pipeline.pushed(step)
        trained.append(pipeline.take(step, prompts, last_step))
    return trained


def test_rollouts_are_launched_max_staleness_steps_ahead_and_tagged_with_the_version_they_were_sampled_with():
    pipeline, lookahead, metrics = pipeline_over(Counter(), max_staleness=1)
    trained = train(pipeline, lookahead, range(4), last_step=4)
    # step 0's rollouts are made at once from step 0's weights; every later step trains on the previous step's
    assert trained == [[(0, 0)], [(1, 0)], [(2, 1)], [(3, 2)]]
    assert metrics["async/staleness"] == [0, 1, 1, 1]
    assert metrics["async/stale_dropped"] == [0, 0, 0, 0]
    assert lookahead.state_dict() == {"cursor": 4}  # nothing was launched for the step after the last


def test_a_rollout_older_than_max_staleness_is_never_trained_on_but_rolled_out_again_and_counted():
    # launched two steps ahead but allowed one step of staleness: from step 2 on every launched rollout is too old
    pipeline, lookahead, metrics = pipeline_over(Counter(), max_staleness=1, ahead=2)
    trained = train(pipeline, lookahead, range(5), last_step=5)
    assert trained == [[(0, 0)], [(1, 0)], [(2, 2)], [(3, 3)], [(4, 4)]]
    assert all(step - version <= 1 for step, rollouts in enumerate(trained) for _, version in rollouts)
    assert metrics["async/stale_dropped"] == [0, 0, 1, 1, 1]
    assert pipeline.versions == [4]


def test_a_push_waits_for_the_rollouts_in_flight():
    release = threading.Event()
    # launch 0: step 1's, launched ahead by step 0's take (before step 0's own, launch 1), held until released
    pipeline, lookahead, metrics = pipeline_over(Counter(), max_staleness=1, release=release, held=frozenset({0}))
    pipeline.pushed(0)
    pipeline.take(0, lookahead(), last_step=3)
    draining = threading.Thread(target=pipeline.drain)
    draining.start()
    draining.join(timeout=0.5)
    assert draining.is_alive()  # step 1's rollouts are still generating on step 0's weights
    release.set()
    draining.join()
    assert not draining.is_alive()
    pipeline.pushed(1)
    pipeline.take(1, lookahead(), last_step=3)
    assert metrics["async/generation_s"][-1] >= 0.5  # launch to done, the held half second in it


def test_the_in_process_generator_samples_from_its_snapshot_which_only_a_push_moves(tiny_model_dir, questions_file,
                                                                                   tmp_path):
    # TRL's fused LM head makes the policy's forward a closure over the policy itself: a snapshot that kept it would
    # generate with the weights the optimizer is writing, whatever version its rollouts are tagged with
    args = small_config(tmp_path, questions_file, "http://127.0.0.1:9/retrieve", generator="transformers",
                        async_rollouts=True, max_staleness=1)
    trainer = trainer_with_text_reward(str(tiny_model_dir), args)
    snapshot = trainer.engine.generator.model
    assert snapshot is trainer.weight_push.model and snapshot is not trainer.model
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        before = snapshot(input_ids=ids).logits
        for parameter in trainer.model.parameters():  # what an optimizer step does to the policy
            parameter.mul_(1.5)
        assert torch.equal(snapshot(input_ids=ids).logits, before)
        trainer.weight_push.push(trainer.model)
        torch.testing.assert_close(snapshot(input_ids=ids).logits, trainer.model(input_ids=ids).logits)
        assert not torch.allclose(snapshot(input_ids=ids).logits, before)


def test_a_checkpoint_saves_the_stream_from_before_the_questions_drawn_ahead():
    stream = Counter()
    pipeline, lookahead, _ = pipeline_over(stream, max_staleness=2)
    train(pipeline, lookahead, range(2), last_step=10)  # steps 0, 1 trained; 2 and 3 in flight
    assert stream.cursor == 4 and lookahead.state_dict() == {"cursor": 2}
    pipeline.cancel()
    resumed = Counter(**lookahead.state_dict())
    pipeline, lookahead, _ = pipeline_over(resumed, max_staleness=2)
    assert train(pipeline, lookahead, range(2, 4), last_step=10) == [[(2, 2)], [(3, 2)]]


def test_importance_weights_are_trls_modes_of_the_current_over_the_behaviour_probability():
    current = torch.tensor([[0.0, -1.0, -2.0], [0.0, 0.0, 0.0]])
    behaviour = torch.tensor([[-2.0, -1.0, float("nan")], [-0.5, 0.0, -9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])  # the last token of row 2 is a tool token: it counts as ratio 1
    e = torch.e
    torch.testing.assert_close(importance_weights(current, behaviour, mask, "token_truncate", None, 3.0),
                               torch.tensor([[3.0, 1.0, 1.0], [e**0.5, 1.0, 1.0]]))
    torch.testing.assert_close(importance_weights(current, behaviour, mask, "token_mask", 0.5, 3.0),
                               torch.tensor([[0.0, 1.0, 1.0], [e**0.5, 1.0, 1.0]]))
    torch.testing.assert_close(importance_weights(current, behaviour, mask, "sequence_truncate", None, 3.0),
                               torch.tensor([[3.0], [e**0.5]]))
    torch.testing.assert_close(importance_weights(current, behaviour, mask, "sequence_mask", None, 3.0),
                               torch.tensor([[0.0], [e**0.5]]))
    with pytest.raises(ValueError, match="vllm_importance_sampling_mode='tokens'; expected token_truncate"):
        importance_weights(current, behaviour, mask, "tokens", None, 3.0)


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "cispo"])
def test_weights_folded_into_the_advantages_give_trls_importance_weighted_loss_and_gradients(
        tiny_model_dir, questions_file, tmp_path, loss_type):
    trainer = SearchR1Trainer(model=str(tiny_model_dir), args=update_config(tmp_path, questions_file,
                                                                             loss_type=loss_type))
    trainer.current_gradient_accumulation_steps = 1
    batch = rollout_batch(trainer.model.config.vocab_size)
    weights = torch.rand(4, 12, generator=torch.Generator().manual_seed(1)) * 2
    folded_loss, folded_grads = loss_and_grads(trainer, {**batch, "advantages": fold_into_advantages(
        batch["advantages"], weights, 12)})
    trainer.use_vllm = trainer.vllm_importance_sampling_correction = True  # TRL's own weighting, as with NCCL
    trls_loss, trls_grads = loss_and_grads(trainer, {**batch, "importance_sampling_ratio": weights})
    torch.testing.assert_close(folded_loss, trls_loss)
    for name in trls_grads:
        torch.testing.assert_close(folded_grads[name], trls_grads[name])


def batch_with_reference(trainer, shift: float = 0.3) -> dict:
    """``rollout_batch`` with reference log-probs ``shift`` nats above the policy's on every token."""
    batch = rollout_batch(trainer.model.config.vocab_size)
    with torch.no_grad():
        logps = trainer._get_per_token_logps_and_entropies(
            trainer.model, torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1),
            torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1), 12)[0]
    return {**batch, "ref_per_token_logps": logps + shift}


@pytest.mark.parametrize("padding_free, level, old", [(False, "token", False), (True, "token", False),
                                                       (False, "sequence", False), (False, "token", True)])
def test_with_weights_of_one_the_async_kl_term_is_trls(tiny_model_dir, questions_file, tmp_path, padding_free, level,
                                                       old):
    # old: TRL's proximal log-probs given (its vLLM path computes them), so the KL's bias correction is not 1
    trainer = SearchR1Trainer(model=str(tiny_model_dir), args=update_config(
        tmp_path, questions_file, beta=0.04, padding_free=padding_free, importance_sampling_level=level))
    trainer.current_gradient_accumulation_steps = 1
    batch = batch_with_reference(trainer)
    if old:
        batch["old_per_token_logps"] = batch["ref_per_token_logps"] - 0.5
    trls_loss, trls_grads = loss_and_grads(trainer, batch)
    ours_loss, ours_grads = loss_and_grads(trainer, {**batch, WEIGHTS: torch.ones(4, 1)})
    torch.testing.assert_close(ours_loss, trls_loss)
    for name in trls_grads:
        torch.testing.assert_close(ours_grads[name], trls_grads[name])
    mode = "train" if trainer.model.training else "eval"
    trls_kl, ours_kl = trainer._metrics[mode]["kl"][-2:]
    assert ours_kl == pytest.approx(trls_kl) and ours_kl > 0.01
    assert trainer.beta == 0.04  # TRL's loss ran without its KL term, and the coefficient is back


def test_a_stale_rollouts_kl_is_weighted_like_its_advantage(tiny_model_dir, questions_file, tmp_path):
    # DAPO sums over tokens, so the weighted loss is TRL's, rollout by rollout, with beta and advantage times w;
    # rollout 2 holds a token the policy finds e^-12 as likely as the reference does, sampled by older weights
    # that liked it (weight e^-12): TRL's unweighted KL term is ~e^12 there, the weighted one ~1
    trainer = SearchR1Trainer(model=str(tiny_model_dir), args=update_config(tmp_path, questions_file, beta=0.04))
    trainer.current_gradient_accumulation_steps = 1
    batch = batch_with_reference(trainer)
    batch["ref_per_token_logps"][2, 0] += 12.0
    weights = torch.tensor([[0.5], [2.0], [math.exp(-12.0)], [1.0]])
    ours_loss, ours_grads = loss_and_grads(trainer, {**batch, WEIGHTS: weights, "advantages": fold_into_advantages(
        batch["advantages"], weights, 12)})
    rowwise_loss, rowwise_grads = 0.0, defaultdict(float)
    for row, weight in enumerate(weights[:, 0].tolist()):
        trainer.beta = 0.04 * weight
        one = {key: value if key == "num_items_in_batch" else value[row:row + 1] for key, value in batch.items()}
        loss, grads = loss_and_grads(trainer, {**one, "advantages": one["advantages"] * weight})
        rowwise_loss += loss
        for name, grad in grads.items():
            rowwise_grads[name] = rowwise_grads[name] + grad
    trainer.beta = 0.04
    torch.testing.assert_close(ours_loss, rowwise_loss)
    for name in rowwise_grads:
        torch.testing.assert_close(ours_grads[name], rowwise_grads[name])
    trls_loss, _ = loss_and_grads(trainer, batch)
    assert abs(ours_loss) < 1.0 < 100.0 < trls_loss


def test_the_mask_modes_count_the_negative_rollouts_they_zero():
    # rows 0 and 1 were sampled by weights that found each of their 3 tokens e^2 less likely than the current ones do
    # (sequence ratio e^6 > 3: zeroed by sequence_mask); rows 0 and 2 have negative advantages
    def output():
        return {"advantages": torch.tensor([-1.0, 1.0, -0.5, 0.5]), "completion_mask": torch.ones(4, 3),
                "old_per_token_logps": torch.zeros(4, 3),
                "sampling_per_token_logps": torch.tensor([[-2.0] * 3, [-2.0] * 3, [0.0] * 3, [0.0] * 3])}
    args = SimpleNamespace(vllm_importance_sampling_correction=True, vllm_importance_sampling_mode="sequence_mask",
                           vllm_importance_sampling_clip_min=None, vllm_importance_sampling_clip_max=3.0,
                           off_policy_mask_threshold=None)
    def weighted_and_logged(metrics):
        batch = output()
        advantages = batch["advantages"]
        weighted = weight_by_behaviour(batch, torch.zeros(4, 3), args)
        log_behaviour(weighted, advantages, torch.zeros(4, 3), args, metrics)
        return weighted

    metrics = defaultdict(list)
    weighted = weighted_and_logged(metrics)
    assert weighted["advantages"][:, 0].tolist() == [0.0, 0.0, -0.5, 0.5]
    assert metrics["async/importance_weight_zeroed"] == [0.5]
    assert metrics["async/negative_zeroed"] == [0.5]  # row 0 of the negative rows 0 and 2
    assert metrics["async/behaviour_kl"] == [pytest.approx(-1.0)]  # rows 0, 1: -2 a token; the current likes them
    args.vllm_importance_sampling_mode = "sequence_truncate"  # clipped to 3 instead: nothing zeroed
    metrics = defaultdict(list)
    weighted = weighted_and_logged(metrics)
    assert weighted["advantages"][:, 0].tolist() == [-3.0, 3.0, -0.5, 0.5]
    assert metrics["async/negative_zeroed"] == [0.0]


ASYNC_METRICS = ("async/importance_weight_mean", "async/importance_weight_zeroed", "async/negative_zeroed",
                 "async/behaviour_kl", "async/behaviour_kl_max")


@pytest.mark.parametrize("mode, padding_free", [("sequence_mask", False), ("token_truncate", True)])
def test_a_step_is_weighted_in_its_loss_forward_as_by_a_forward_of_its_own(tiny_model_dir, questions_file, tmp_path,
                                                                          mode, padding_free):
    # TRL computes no current-weights log-probs when one optimizer step follows each generation; the importance
    # weights then come from each micro-batch's training forward, detached, instead of one more forward over the step
    trainer = SearchR1Trainer(model=str(tiny_model_dir), args=update_config(
        tmp_path, questions_file, beta=0.04, vllm_importance_sampling_mode=mode, padding_free=padding_free))
    trainer.current_gradient_accumulation_steps = 1
    batch = batch_with_reference(trainer)
    current = batch["ref_per_token_logps"] - 0.3
    # rollouts 0 and 1 sampled by weights that liked their tokens less (weights > 1: clipped or zeroed), 2 more
    batch["sampling_per_token_logps"] = current + torch.tensor([[-0.4], [-1.0], [0.2], [0.0]])
    metrics = defaultdict(list)
    expected = weight_by_behaviour(dict(batch), current, trainer.args)
    log_behaviour(expected, batch["advantages"], current, trainer.args, metrics)
    expected_loss, expected_grads = loss_and_grads(trainer, expected)
    trainer._metrics["train"].clear()
    forwards = []
    hook = trainer.model.register_forward_hook(lambda *_: forwards.append(1))
    step = trainer.correction.weigh(dict(batch))
    hook.remove()
    assert not forwards and step["advantages"].dim() == 1  # no forward of its own; nothing folded yet
    halves = [{key: value if key == "num_items_in_batch" else value[rows] for key, value in step.items()}
              for rows in (slice(0, 2), slice(2, 4))]
    first_loss, first_grads = loss_and_grads(trainer, halves[0])
    assert not any(key in trainer._metrics["train"] for key in ASYNC_METRICS)  # the step's, once it is all in
    second_loss, second_grads = loss_and_grads(trainer, halves[1])
    torch.testing.assert_close(first_loss + second_loss, expected_loss)
    for name in expected_grads:
        torch.testing.assert_close(first_grads[name] + second_grads[name], expected_grads[name])
    for key in ASYNC_METRICS:
        assert trainer._metrics["train"][key] == [pytest.approx(metrics[key][0])], key
    assert trainer.correction.in_loss is None and metrics["async/importance_weight_mean"][0] != 1.0


@pytest.mark.parametrize("padding_free", [False, True])
def test_trls_off_policy_mask_drops_the_rollouts_the_staleness_metrics_count(tiny_model_dir, questions_file,
                                                                            tmp_path, padding_free):
    # rollouts 0 (advantage 1.0) and 1 (-0.5) were sampled by weights that liked each of their tokens 0.5 nats more
    # than the current ones do; at threshold 0.1 TRL's loss drops rollout 1 (negative advantage), keeps rollout 0
    trainer = SearchR1Trainer(model=str(tiny_model_dir), args=update_config(
        tmp_path, questions_file, off_policy_mask_threshold=0.1, padding_free=padding_free))
    trainer.current_gradient_accumulation_steps = 1
    batch = batch_with_reference(trainer, shift=0.0)
    current = batch.pop("ref_per_token_logps")
    behaviour = current + torch.tensor([[0.5], [0.5], [0.0], [0.0]])
    metrics = defaultdict(list)
    log_staleness(current, behaviour, loss_mask(batch), batch["advantages"], trainer.args, metrics)
    assert loss_mask(batch).sum(-1).tolist() == [10, 2, 2, 5]
    assert metrics["async/behaviour_kl"] == [pytest.approx((10 * 0.5 + 2 * 0.5) / 19)]
    assert metrics["async/behaviour_kl_max"] == [pytest.approx(0.5)]
    assert metrics["async/off_policy_masked"] == [0.25]
    masked_loss, masked_grads = loss_and_grads(trainer, {**batch, "sampling_per_token_logps": behaviour})
    trainer.off_policy_mask_threshold = None
    dropped_loss, dropped_grads = loss_and_grads(trainer, {**batch, "advantages": torch.tensor([1.0, 0.0, 0.8, -1.3])})
    torch.testing.assert_close(masked_loss, dropped_loss)
    for name in dropped_grads:
        torch.testing.assert_close(masked_grads[name], dropped_grads[name])
    kept_loss, _ = loss_and_grads(trainer, batch)
    assert abs(kept_loss - masked_loss) > 1e-3  # rollout 1 counted for something: dropping it shows


def test_recipes_the_async_mode_cannot_run_are_refused(tiny_model_dir, questions_file, tmp_path):
    with pytest.raises(ValueError, match="max_staleness=0; expected >= 1"):
        SearchR1Trainer(model=str(tiny_model_dir), args=update_config(tmp_path, questions_file, async_rollouts=True,
                                                                       max_staleness=0))
    with pytest.raises(ValueError, match="loss_type='vespo'"):
        SearchR1Trainer(model=str(tiny_model_dir), args=update_config(tmp_path, questions_file, async_rollouts=True,
                                                                       loss_type="vespo"))
    with pytest.raises(ValueError, match=r"beta=0\.04 and loss_type='grpo': the KL term is weighted"):
        SearchR1Trainer(model=str(tiny_model_dir), args=update_config(tmp_path, questions_file, async_rollouts=True,
                                                                       beta=0.04, loss_type="grpo"))


class TrainedQuestions:
    """A reward function of 0 that records the questions of every batch it scores."""

    __name__ = "trained_questions"

    def __init__(self):
        self.batches: list[list[str]] = []

    def __call__(self, prompts, completions, *, question, **kwargs) -> list[float]:
        self.batches.append(list(question))
        return [0.0] * len(prompts)


def async_run(tiny_model_dir, questions_file, folder: Path, resume=None, callbacks=()):
    """Two async optimizer steps of the in-process generator, no search (one turn of 8 tokens), a checkpoint after
    each."""
    args = small_config(folder, questions_file, "http://127.0.0.1:9/retrieve", max_steps=2, save_strategy="steps",
                        save_steps=1, generator="transformers", max_tokens_per_turn=8, max_turns=1,
                        async_rollouts=True, max_staleness=1, learning_rate=1e-3,
                        max_behaviour_kl=0.0)  # lr 1e-3 moves the policy past the bound: every step must train
    task = build_task(args)
    recorder = TrainedQuestions()
    trainer = SearchR1Trainer(model=str(tiny_model_dir), args=args, parts=task,
                              reward_funcs=[task.rubric, recorder], callbacks=list(callbacks))
    with contextlib.suppress(KeyboardInterrupt):
        trainer.train(resume_from_checkpoint=resume)
    assert trainer._loop is None  # the rollout thread stopped and its loop closed, also when interrupted
    return trainer, recorder.batches, args


@pytest.mark.slow  # three short trainings on CPU: about 20 seconds
def test_an_async_run_trains_on_the_previous_steps_rollouts_and_resumes_on_the_same_questions(
        tiny_model_dir, questions_file, tmp_path):
    trainer, uninterrupted, _ = async_run(tiny_model_dir, questions_file, tmp_path / "full")
    logged = [entry for entry in trainer.state.log_history if "async/staleness" in entry]
    assert [entry["async/staleness"] for entry in logged] == [0, 1]
    assert [entry["async/stale_dropped"] for entry in logged] == [0, 0]
    assert all("async/importance_weight_mean" in entry for entry in logged)
    assert len(uninterrupted) == 2 and len({q for batch in uninterrupted for q in batch}) == 2  # one a step

    _, killed, args = async_run(tiny_model_dir, questions_file, tmp_path / "killed", callbacks=[StopAfter(1)])
    checkpoint = Path(args.output_dir) / "checkpoint-1"
    # step 2's questions were drawn and rolled out when the checkpoint was written: they are served again
    assert json.loads((checkpoint / STREAM_STATE_FILE).read_text())["cursor"] == 1  # one step of one question
    _, resumed, _ = async_run(tiny_model_dir, questions_file, tmp_path / "killed", resume=str(checkpoint))
    assert killed + resumed == uninterrupted


def test_recipes_that_cannot_pause_rollouts_in_flight_are_refused(tiny_model_dir, questions_file, tmp_path):
    with pytest.raises(ValueError, match="in_flight_rollouts='later'; expected 'finish' or 'pause'"):
        SearchR1Trainer(model=str(tiny_model_dir), args=update_config(tmp_path, questions_file, async_rollouts=True,
                                                                       in_flight_rollouts="later"))
    with pytest.raises(ValueError, match="in_flight_rollouts='pause' with generator='transformers'"):
        SearchR1Trainer(model=str(tiny_model_dir), args=update_config(tmp_path, questions_file, async_rollouts=True,
                                                                       in_flight_rollouts="pause",
                                                                       generator="transformers"))


class StreamedCompletion(threading.Thread):
    """A greedy completion streamed from the server, its text and token ids; ``started`` is set once ``after`` chunks
    have arrived."""

    def __init__(self, base_url: str, model: str, prompt_ids: list[int], max_tokens: int, after: int = 3):
        super().__init__(daemon=True)
        self.request = {"model": model, "prompt": prompt_ids, "max_tokens": max_tokens, "temperature": 0.0,
                        "stream": True, "ignore_eos": True, "return_token_ids": True}
        self.base_url, self.after = base_url, after
        self.started, self.chunks, self.token_ids, self.finish_reason = threading.Event(), [], [], None

    def run(self):
        with httpx.Client(base_url=self.base_url, timeout=600) as client, \
                client.stream("POST", "/v1/completions", json=self.request) as response:
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                choice = json.loads(line.removeprefix("data: "))["choices"][0]
                self.chunks.append(choice["text"])
                self.token_ids.extend(choice.get("token_ids") or [])
                self.finish_reason = choice["finish_reason"] or self.finish_reason
                if len(self.chunks) >= self.after:
                    self.started.set()


class ReloadFolder:
    """A push that reloads a folder of safetensors into the server (the real reload; what it holds is the test's)."""

    def __init__(self, base_url: str, folder: Path):
        self.base_url, self.folder = base_url, folder

    def push(self, model) -> None:
        reload_weights(self.base_url, self.folder)


def first_norm_folder(model_dir: str, folder: Path, sign: float) -> Path:
    """A checkpoint folder holding only the first layer's input norm of ``model_dir``, times ``sign``: vLLM's layerwise
    reload keeps every weight the folder leaves out, so -1 negates that layer's queries, keys and values (every key and
    value the server caches from then on differs) and +1 restores the model."""
    name = "model.layers.0.input_layernorm.weight"
    with safe_open(str(Path(model_dir) / "model.safetensors"), "pt") as weights:
        norm = weights.get_tensor(name)
    folder.mkdir(parents=True, exist_ok=True)
    save_file({name: norm * sign}, str(folder / "model.safetensors"))
    return folder


@pytest.mark.slow  # three greedy completions of up to 96 tokens on the CPU server (~10 tokens/s)
def test_a_paused_push_lets_the_rollout_in_flight_go_on_with_the_new_weights(vllm_server, offline_assets, tokenizer,
                                                                           tmp_path):
    from accelerate import Accelerator

    from searchr1_trl.serving.weight_sync import PausedPush

    # long enough that the pause lands mid-way even when this process reads the stream late (48 tokens were not, once,
    # with other tests running beside the suite: the server had finished when the pause came)
    length = 96
    prompt_ids = tokenizer.apply_chat_template([{"role": "user", "content": "Tell me about the river Thames."}],
                                               add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    old = StreamedCompletion(vllm_server.base_url, offline_assets.model, prompt_ids, max_tokens=length)
    old.run()  # the old weights' greedy text, start to end
    changed = ReloadFolder(vllm_server.base_url, first_norm_folder(offline_assets.model, tmp_path / "changed", -1.0))
    push = PausedPush(changed, Accelerator(cpu=True), vllm_server.base_url)
    in_flight = StreamedCompletion(vllm_server.base_url, offline_assets.model, prompt_ids, max_tokens=length)
    in_flight.start()
    try:
        assert in_flight.started.wait(timeout=300), "the completion never started streaming"
        push.push(None)
        in_flight.join(timeout=600)
        assert in_flight.finish_reason == "length"  # neither aborted nor cut: all its tokens, across the push
        assert len(in_flight.token_ids) == len(old.token_ids) == length
        split = next((i for i, (a, b) in enumerate(zip(in_flight.token_ids, old.token_ids, strict=True)) if a != b),
                     None)
        assert split is not None and split >= in_flight.after  # the old weights chose what streamed before the pause
        # From there on the new weights chose, attending to keys and values they computed themselves: the server
        # dropped the in-flight request's cache at the push, so it recomputed it, and what it then generated is
        # exactly the new weights' greedy continuation of what it had (KV of the old weights would change it).
        resumed = StreamedCompletion(vllm_server.base_url, offline_assets.model,
                                     prompt_ids + in_flight.token_ids[:split], max_tokens=length - split)
        resumed.run()
        assert resumed.token_ids == in_flight.token_ids[split:]
    finally:  # the server is shared: give it its weights back
        reload_weights(vllm_server.base_url, first_norm_folder(offline_assets.model, tmp_path / "restored", 1.0))
    # and the restore gave the server its own weights back: where the changed weights chose another token, the old one
    restored = StreamedCompletion(vllm_server.base_url, offline_assets.model, prompt_ids + old.token_ids[:split],
                                  max_tokens=1, after=1)
    restored.run()
    assert restored.token_ids == [old.token_ids[split]] != [in_flight.token_ids[split]]


def assert_kl_zero_at_step_1_then_grows(logged: list[dict]) -> None:
    """The KL to the reference and the behaviour gap of an async run's first two logged steps: zero before the first
    update, the update's after it."""
    first, second = (entry["kl"] for entry in logged[:2])
    assert first < 1e-4 < second < 1.0, (first, second)
    # the log-prob gap between the weights that sampled a step's rollouts and the current ones: none at step 1, the
    # update's at step 2 (a mean over 16 tokens, of either sign: an estimate of the KL, not the KL)
    first, second = (entry["async/behaviour_kl"] for entry in logged[:2])
    assert abs(first) < 1e-4 < abs(second) < 1.0, (first, second)


@pytest.mark.slow  # a short compiled training on CPU: ~35 seconds
def test_an_async_runs_kl_to_the_reference_is_zero_before_the_first_update_and_grows_after_it(
        tiny_model_dir, questions_file, tmp_path):
    # the offline_gpu recipe's beta 0.04 with async rollouts: the reference forward runs on the trainer's step; packed
    # and compiled, every speed lever at once, the loss's LM head skipping unscored positions (packed alone: the
    # weighted KL term's tests above; neither: the skipped step's test below). At step 1 the policy is the reference
    # (on an H100 that mode logged 5.6e-05 there, then drifted and collapsed by step 10: experiments/results/README.md,
    # e2e_alone_h100). A reward that differs between rollouts gives the update advantages to move the weights by.
    args = small_config(tmp_path, questions_file, "http://127.0.0.1:9/retrieve", max_steps=2, generator="transformers",
                        max_tokens_per_turn=8, max_turns=1, async_rollouts=True, max_staleness=1, learning_rate=1e-3,
                        beta=0.04, padding_free=True, compile_layers=True,
                        max_behaviour_kl=0.0)  # lr 1e-3 moves the policy past the bound: every step must train
    trainer = trainer_with_text_reward(str(tiny_model_dir), args)
    trainer.train()
    logged = [entry for entry in trainer.state.log_history if "async/staleness" in entry]
    assert [entry["async/staleness"] for entry in logged] == [0, 1]
    assert_kl_zero_at_step_1_then_grows(logged)


class WeightsAtEachStep(TrainerCallback):
    """The first parameter tensor after each optimizer step."""

    def __init__(self):
        self.steps: list[torch.Tensor] = []

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.steps.append(next(model.parameters()).detach().clone())


@pytest.mark.slow  # a short training on CPU: ~15 seconds
def test_a_step_the_policy_moved_too_far_from_is_skipped_and_the_next_one_is_on_policy(
        tiny_model_dir, questions_file, tmp_path, caplog):
    # step 1 trains on rollouts of its own weights (gap ~0), step 2 on rollouts of step 0's weights after step 1's
    # update moved them (the gap the KL test above sees): over the bound, its update is skipped, so the rollouts
    # launched during it, of step 1's weights, are on-policy at step 3, which trains. With the offline_gpu recipe's
    # beta 0.04, unpacked and eager, the KL to the reference is the KL test's above.
    args = small_config(tmp_path, questions_file, "http://127.0.0.1:9/retrieve", max_steps=3, generator="transformers",
                        max_tokens_per_turn=8, max_turns=1, async_rollouts=True, max_staleness=1, learning_rate=1e-3,
                        beta=0.04, max_behaviour_kl=1e-4)
    weights = WeightsAtEachStep()
    trainer = trainer_with_text_reward(str(tiny_model_dir), args, callbacks=[weights])
    with caplog.at_level("WARNING", logger="searchr1_trl.training.callbacks"):
        trainer.train()
    logged = [entry for entry in trainer.state.log_history if "async/staleness" in entry]
    gaps = [entry["async/behaviour_kl"] for entry in logged]
    assert [entry["async/staleness"] for entry in logged] == [0, 1, 1]
    assert abs(gaps[0]) < 1e-4 < abs(gaps[1]), f"step 2's update-sized gap is what the bound must catch: {gaps}"
    assert [entry["async/skipped_divergent"] for entry in logged] == [0.0, 1.0, 0.0]
    assert f"optimizer step 2 skipped: the policy moved {gaps[1]:+.4f} nats a token" in caplog.text
    first, second, third = weights.steps
    assert torch.equal(first, second) and not torch.equal(second, third)
    assert abs(gaps[2]) < 1e-4, f"step 3's rollouts were sampled by the weights it trains: {gaps}"
    assert_kl_zero_at_step_1_then_grows(logged)


def test_the_bound_on_the_gap_is_on_by_default_and_turning_it_off_where_it_could_run_is_warned(questions_file, tmp_path,
                                                                                                   caplog):
    unbounded = update_config(tmp_path, questions_file, async_rollouts=True, generator="vllm", max_behaviour_kl=0.0)
    with caplog.at_level("WARNING", logger="searchr1_trl.training.experimental.async_rollouts"):
        assert check_recipe(update_config(tmp_path, questions_file, async_rollouts=True), deepspeed=False) == 0.01
        assert check_recipe(unbounded, deepspeed=True) is None  # where it cannot skip a step, nothing to advise
        assert check_recipe(update_config(tmp_path, questions_file, async_rollouts=True, generator="vllm",
                                          vllm_importance_sampling_correction=False, max_behaviour_kl=0.0),
                            deepspeed=False) is None  # nor where it cannot measure the gap
        assert "max_behaviour_kl 0" not in caplog.text and "is off in this run" not in caplog.text
        assert check_recipe(unbounded, deepspeed=False) is None
    assert "async_rollouts with max_behaviour_kl 0" in caplog.text and "0.01, the default, kept three" in caplog.text


def test_the_bound_is_off_and_said_so_where_it_cannot_skip_or_measure(tiny_model_dir, questions_file, tmp_path,
                                                                       caplog):
    base = update_config(tmp_path, questions_file, async_rollouts=True, generator="vllm", max_behaviour_kl=0.01)
    with caplog.at_level("WARNING", logger="searchr1_trl.training.experimental.async_rollouts"):
        assert check_recipe(base, deepspeed=True) is None
        assert check_recipe(update_config(tmp_path, questions_file, async_rollouts=True,
                                          vllm_importance_sampling_correction=False), deepspeed=False) is None
    assert "max_behaviour_kl=0.01 is off in this run: DeepSpeed steps the optimizer" in caplog.text
    assert "max_behaviour_kl=0.01 is off in this run: vllm_importance_sampling_correction=False" in caplog.text
    with pytest.raises(ValueError, match=r"max_behaviour_kl=-0\.01; expected a gap > 0"):
        SearchR1Trainer(model=str(tiny_model_dir), args=update_config(tmp_path, questions_file, async_rollouts=True,
                                                                       max_behaviour_kl=-0.01))


def test_asynchronous_rollouts_and_pausing_them_warn_once_that_they_are_experimental(questions_file, tmp_path,
                                                                                      caplog, monkeypatch):
    from searchr1_trl.training import experimental

    monkeypatch.setattr(experimental, "_warned", set())
    paused = update_config(tmp_path, questions_file, async_rollouts=True, generator="vllm", in_flight_rollouts="pause")
    with caplog.at_level("WARNING", logger="searchr1_trl.training.experimental"):
        check_recipe(update_config(tmp_path, questions_file, async_rollouts=True), deepspeed=False)
        check_recipe(paused, deepspeed=False)
        check_recipe(paused, deepspeed=False)
    experimental_lines = [r.getMessage() for r in caplog.records if "is experimental" in r.getMessage()]
    assert [line.split(" is experimental")[0] for line in experimental_lines] == [
        "async_rollouts", "in_flight_rollouts='pause'"]
    assert "collapsed" in experimental_lines[1]
    assert not update_config(tmp_path, questions_file).async_rollouts  # neither is a default
    assert update_config(tmp_path, questions_file).in_flight_rollouts == "finish"


def test_a_gap_that_outlasts_the_skips_stops_training_as_a_broken_push():
    # after max_staleness skips in a row every rollout in flight was sampled by the weights it trains: a gap over the
    # bound then means the generator serves other weights than the trainer's
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)

    def step(guard, global_step, gap):
        model(torch.ones(1, 2)).sum().backward()
        guard.gap = gap
        guard.on_pre_optimizer_step(None, SimpleNamespace(global_step=global_step), None, model=model,
                                    optimizer=optimizer)

    metrics = defaultdict(list)
    guard = DivergentStepGuard(0.01, max_staleness=2, metrics=metrics)
    for global_step, gap in enumerate([0.5, -0.3]):
        step(guard, global_step, gap)
        assert all(p.grad is None for p in model.parameters())  # skipped: nothing for the optimizer to apply
    with pytest.raises(RuntimeError, match=r"step 3: .*the last 2 step\(s\) were skipped.*does not serve the trainer"):
        step(guard, 2, 0.02)
    assert metrics["async/skipped_divergent"] == [1.0, 1.0]
    metrics = defaultdict(list)
    guard = DivergentStepGuard(0.01, max_staleness=1, metrics=metrics)
    for global_step, gap in enumerate([0.5, 0.001, 0.5, None]):  # a step under the bound between two skips
        step(guard, global_step, gap)
    assert metrics["async/skipped_divergent"] == [1.0, 0.0, 1.0, 0.0]
    assert all(p.grad is not None for p in model.parameters())  # the last step, without a gap, trains
