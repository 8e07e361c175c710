"""The policy update's throughput levers (searchr1_trl/training/update.py) compute the baseline's loss and gradients
and keep
tool tokens out of the loss."""

from __future__ import annotations

import copy

import pytest
import torch

from searchr1_trl.training.trainer import SearchR1Config, SearchR1Trainer
from searchr1_trl.training.update import compile_decoder_layers, pack_rows, with_fp32_master_weights


def update_config(tmp_path, questions_file, **overrides) -> SearchR1Config:
    values = dict(
        output_dir=str(tmp_path / "run"), use_cpu=True, bf16=False, generator="transformers", max_steps=1,
        per_device_train_batch_size=4, gradient_accumulation_steps=1, num_generations=4,
        train_data_path=questions_file, eval_strategy="no", save_strategy="no", report_to="none",
        search_url="http://127.0.0.1:9/retrieve", learning_rate=1e-3, warmup_steps=0,
    )
    values.update(overrides)
    return SearchR1Config(**values)


def rollout_batch(vocab: int, seed: int = 0, prompt_lengths=(5, 8, 3, 8), completion_lengths=(12, 3, 2, 7)) -> dict:
    """Four rollouts as GRPOTrainer hands them to compute_loss: prompts padded on the left, completions on the right,
    each completion with a block of tool-response tokens (tool_mask 0). By default of 17, 11, 5 and 15 tokens in rows
    of 20, so packing puts the third after the fourth."""
    generator = torch.Generator().manual_seed(seed)
    prompt_mask = torch.tensor([[0] * (8 - n) + [1] * n for n in prompt_lengths])
    completion_mask = torch.tensor([[1] * n + [0] * (12 - n) for n in completion_lengths])
    tool_mask = torch.ones(4, 12, dtype=torch.long)
    tool_mask[:, 2:4] = 0
    batch = {
        "prompt_ids": torch.randint(0, vocab, (4, 8), generator=generator) * prompt_mask,
        "prompt_mask": prompt_mask,
        "completion_ids": torch.randint(0, vocab, (4, 12), generator=generator) * completion_mask,
        "completion_mask": completion_mask,
        "tool_mask": tool_mask,
        "advantages": torch.tensor([1.0, -0.5, 0.8, -1.3]),
    }
    batch["num_items_in_batch"] = (completion_mask * tool_mask).sum()
    return batch


def completion_logps(trainer, model, batch) -> torch.Tensor:
    """``model``'s log-probs of ``batch``'s completion tokens through the trainer's forward (packed with
    padding_free)."""
    ids, mask = (torch.cat([batch[f"prompt_{key}"], batch[f"completion_{key}"]], 1) for key in ("ids", "mask"))
    return trainer._get_per_token_logps_and_entropies(model, ids, mask, batch["completion_ids"].size(1))[0]


def loss_and_grads(trainer, batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    trainer.model.zero_grad(set_to_none=True)
    loss = trainer.compute_loss(trainer.model, batch)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}


def test_pack_rows_packs_longest_first_into_rows_of_the_padded_length():
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 0, 0], [0, 0, 0, 1], [1, 1, 1, 1]])
    source, target, position_ids, rows = pack_rows(mask)
    # lengths 3, 2, 1, 4 -> [row 3], [row 0, row 2], [row 1]; a padded tail continues the sequence before it
    assert rows == 3
    assert position_ids.tolist() == [[0, 1, 2, 3], [0, 1, 2, 0], [0, 1, 2, 3]]
    assert source.tolist() == [12, 13, 14, 15, 1, 2, 3, 11, 4, 5]
    assert target.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]


def test_pack_rows_for_compiled_layers_gives_every_batch_two_rows_and_a_sequence_boundary():
    # the tails restart: row 2 holds 2 tokens and a tail of 2, a sequence of its own
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 0, 0], [0, 0, 0, 1], [1, 1, 1, 1]])
    assert pack_rows(mask, one_graph=True)[2].tolist() == [[0, 1, 2, 3], [0, 1, 2, 0], [0, 1, 0, 1]]
    # what fits one row gets an empty second one, each of its positions a sequence
    _, target, position_ids, rows = pack_rows(torch.tensor([[0, 1, 1, 0], [1, 0, 0, 0]]), one_graph=True)
    assert rows == 2 and position_ids.tolist() == [[0, 1, 0, 0], [0, 0, 0, 0]]
    assert target.tolist() == [0, 1, 2]
    # rows each exactly one rollout have no boundary: an empty row gives them one
    full = torch.ones(2, 3, dtype=torch.long)
    assert pack_rows(full, one_graph=True)[2].tolist() == [[0, 1, 2], [0, 1, 2], [0, 0, 0]]
    assert pack_rows(full)[3] == 2  # without compiled layers: as they are


def test_compiled_packed_layers_compile_once_per_grad_mode_whatever_the_batch_packs_to(tiny_model_dir, questions_file,
                                                                                         tmp_path):
    """On an H200 each further graph cost 7-10 s, three times in 30 steps: batches packing to one row, and batches
    without a sequence boundary (transformers then passes no attention mask), each compiled again."""
    from torch._dynamo.utils import counters

    trainer = SearchR1Trainer(model=str(tiny_model_dir), args=update_config(
        tmp_path, questions_file, beta=0.04, compile_layers=True, padding_free=True))
    trainer.current_gradient_accumulation_steps = 1

    def step(prompt_lengths, completion_lengths):  # the reference's forward (no grad) and the loss's, as in a step
        batch = rollout_batch(trainer.model.config.vocab_size, 0, prompt_lengths, completion_lengths)
        with torch.no_grad():
            batch["ref_per_token_logps"] = completion_logps(trainer, trainer.ref_model, batch)
        trainer.compute_loss(trainer.model, batch).backward()

    step((5, 8, 3, 8), (12, 3, 2, 7))
    graphs = counters["stats"]["unique_graphs"]
    step((2, 2, 2, 2), (2, 2, 2, 2))  # one row
    step((8, 8, 8, 8), (12, 12, 12, 12))  # four full rows, no padding
    step((8, 8, 8, 8), (11, 11, 11, 11))  # four rows, one rollout each, with tails
    assert counters["stats"]["unique_graphs"] == graphs


def test_in_process_generation_runs_compiled_layers_eager_and_leaves_them_compiled(tiny_model_dir):
    """Through the compiled layers generate compiled a graph for each layer's KV cache and decode shape (6 here, 8 in
    a short async run: dynamo's recompile limit, whose entries the training forward shares)."""
    import asyncio

    from torch._dynamo.utils import counters
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from searchr1_trl.engine.generation import SamplingParams
    from searchr1_trl.engine.in_process import TransformersGenerator

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    eager, compiled = (AutoModelForCausalLM.from_pretrained(tiny_model_dir) for _ in range(2))
    compile_decoder_layers(compiled)
    prompt = tokenizer("The river Thames flows through")["input_ids"]
    graphs = counters["stats"]["unique_graphs"]
    eager_tokens, compiled_tokens = (
        asyncio.run(TransformersGenerator(model, tokenizer).generate(prompt, SamplingParams.greedy(8))).token_ids
        for model in (eager, compiled))
    assert counters["stats"]["unique_graphs"] == graphs
    assert compiled_tokens == eager_tokens
    assert all(layer._compiled_call_impl is not None for layer in compiled.model.layers)  # training still compiled


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_padding_free_gives_the_padded_loss_and_gradients_and_keeps_tool_tokens_out(
        tiny_model_dir, questions_file, tmp_path, attn_implementation):
    args = update_config(tmp_path, questions_file, model_init_kwargs={"attn_implementation": attn_implementation})
    trainer = SearchR1Trainer(model=str(tiny_model_dir), args=args)
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer.train()
    batch = rollout_batch(trainer.model.config.vocab_size)
    assert pack_rows(torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1))[3] == 3
    padded_loss, padded_grads = loss_and_grads(trainer, batch)
    padded_logps = completion_logps(trainer, trainer.model, batch)

    trainer.args.padding_free = True
    scored = []  # the positions the fused LM head is asked to score: the loss's only, not the tool tokens
    hook = trainer.model.register_forward_pre_hook(
        lambda module, args, kwargs: scored.append(int((kwargs["labels"] != -100).sum())), with_kwargs=True)
    packed_loss, packed_grads = loss_and_grads(trainer, batch)
    hook.remove()
    assert scored == [int((batch["completion_mask"] * batch["tool_mask"]).sum())]
    packed_logps = completion_logps(trainer, trainer.model, batch)
    real = batch["completion_mask"].bool()
    torch.testing.assert_close(packed_logps[real], padded_logps[real], rtol=1e-4, atol=1e-4)
    assert (packed_logps[~real] == 0).all()
    torch.testing.assert_close(packed_loss, padded_loss, rtol=1e-4, atol=1e-6)
    assert packed_grads.keys() == padded_grads.keys()
    for name in padded_grads:
        torch.testing.assert_close(packed_grads[name], padded_grads[name], rtol=1e-3, atol=1e-6)

    # Old log-probs far off at the tool tokens would change every ratio there: the loss does not see them.
    old = packed_logps.detach().clone()
    old[batch["tool_mask"] == 0] += 5.0
    with_garbage, _ = loss_and_grads(trainer, {**batch, "old_per_token_logps": old})
    exact, _ = loss_and_grads(trainer, {**batch, "old_per_token_logps": packed_logps.detach()})
    assert torch.equal(with_garbage, exact)


def test_fp32_master_weights_step_bf16_weights_as_adamw_steps_fp32_ones():
    torch.manual_seed(0)
    low = torch.nn.Linear(16, 16).to(torch.bfloat16)
    reference = copy.deepcopy(low).float()  # the same weights, in fp32
    plain = copy.deepcopy(low)  # bf16 weights stepped as they are
    optimizer = with_fp32_master_weights(torch.optim.AdamW(low.parameters(), lr=1e-6))
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-6)
    plain_optimizer = torch.optim.AdamW(plain.parameters(), lr=1e-6)
    for _ in range(3):
        x = torch.randn(4, 16, dtype=torch.bfloat16)
        for model in (low, plain):
            model(x).square().sum().backward()
        for p, r in zip(low.parameters(), reference.parameters(), strict=True):
            r.grad = p.grad.float()
        for opt in (optimizer, reference_optimizer, plain_optimizer):
            opt.step()
            opt.zero_grad()
    for p, r, q in zip(low.parameters(), reference.parameters(), plain.parameters(), strict=True):
        master = optimizer.state[p]["master"]
        assert p.dtype == torch.bfloat16 and master.dtype == torch.float32
        torch.testing.assert_close(master, r.detach(), rtol=0, atol=1e-7)
        assert torch.equal(p.detach(), master.to(torch.bfloat16))
        assert torch.equal(q.detach(), p.detach())  # 3 x 1e-6 is below bf16's resolution: plain bf16 loses it
        assert not torch.equal(master, p.detach().float())  # ... the master keeps it

    resumed = with_fp32_master_weights(torch.optim.AdamW(copy.deepcopy(low).parameters(), lr=1e-6))
    resumed.load_state_dict(optimizer.state_dict())
    for state, loaded in zip(optimizer.state.values(), resumed.state.values(), strict=True):
        assert loaded["master"].dtype == loaded["exp_avg"].dtype == torch.float32
        assert torch.equal(loaded["master"], state["master"]) and torch.equal(loaded["exp_avg"], state["exp_avg"])
    assert {p.dtype for p in resumed.param_groups[0]["params"]} == {torch.bfloat16}


def test_the_trainer_steps_bf16_weights_through_fp32_masters_and_refuses_them_for_fp32_weights(
        tiny_model_dir, questions_file, tmp_path):
    args = update_config(tmp_path, questions_file, fp32_master_weights=True, model_init_kwargs={"dtype": "bfloat16"})
    trainer = SearchR1Trainer(model=str(tiny_model_dir), args=args)
    trainer.current_gradient_accumulation_steps = 1
    trainer.create_optimizer()
    assert type(trainer.optimizer).__name__.startswith("Fp32Master")
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    loss_and_grads(trainer, rollout_batch(trainer.model.config.vocab_size))
    trainer.optimizer.step()
    assert all(p.dtype == torch.bfloat16 for p in trainer.model.parameters())
    assert any(not torch.equal(before[n], p.detach()) for n, p in trainer.model.named_parameters())

    fp32 = SearchR1Trainer(model=str(tiny_model_dir), args=update_config(tmp_path, questions_file,
                                                                          fp32_master_weights=True))
    with pytest.raises(ValueError, match="float32 already; load them in bfloat16"):
        fp32.create_optimizer()


def test_fp32_master_weights_compute_the_fp32_loss_up_to_bf16_rounding(tiny_model_dir, questions_file, tmp_path):
    fp32 = SearchR1Trainer(model=str(tiny_model_dir), args=update_config(tmp_path, questions_file))
    bf16 = SearchR1Trainer(model=str(tiny_model_dir), args=update_config(
        tmp_path, questions_file, fp32_master_weights=True, model_init_kwargs={"dtype": "bfloat16"}))
    batch = rollout_batch(fp32.model.config.vocab_size)
    for trainer in (fp32, bf16):
        trainer.current_gradient_accumulation_steps = 1
    (loss32, grads32), (loss16, grads16) = loss_and_grads(fp32, batch), loss_and_grads(bf16, batch)
    torch.testing.assert_close(loss16.float(), loss32, rtol=2e-2, atol=2e-3)
    cosine = torch.nn.functional.cosine_similarity(torch.cat([g.flatten() for g in grads16.values()]).float(),
                                                   torch.cat([g.flatten() for g in grads32.values()]), dim=0)
    assert cosine > 0.99


@pytest.mark.parametrize("padding_free", [False, True])  # the two levers together are a recipe setting too
def test_compile_layers_compiles_each_decoder_layer_in_place_and_gives_the_eager_loss_and_gradients(
        tiny_model_dir, questions_file, tmp_path, padding_free):
    eager = SearchR1Trainer(model=str(tiny_model_dir), args=update_config(tmp_path, questions_file, beta=0.04,
                                                                           padding_free=padding_free))
    compiled = SearchR1Trainer(model=str(tiny_model_dir), args=update_config(tmp_path, questions_file, beta=0.04,
                                                                              compile_layers=True,
                                                                              padding_free=padding_free))
    for model in (compiled.model, compiled.ref_model):  # the reference's forward is in each step's series too
        assert all(layer._compiled_call_impl is not None for layer in model.model.layers)
    assert all(layer._compiled_call_impl is None for layer in eager.model.model.layers + eager.ref_model.model.layers)
    assert compiled.model.state_dict().keys() == eager.model.state_dict().keys()  # what checkpoints and pushes see
    batch = rollout_batch(eager.model.config.vocab_size)
    with torch.no_grad():
        eager_ref, compiled_ref = (completion_logps(trainer, trainer.ref_model, batch) for trainer in (eager, compiled))
    torch.testing.assert_close(compiled_ref, eager_ref, rtol=1e-4, atol=1e-5)
    batch["ref_per_token_logps"] = eager_ref
    for trainer in (eager, compiled):
        trainer.current_gradient_accumulation_steps = 1
    (eager_loss, eager_grads), (compiled_loss, compiled_grads) = (loss_and_grads(eager, batch),
                                                                  loss_and_grads(compiled, batch))
    torch.testing.assert_close(compiled_loss, eager_loss, rtol=1e-4, atol=1e-6)
    assert compiled_grads.keys() == eager_grads.keys()
    for name in eager_grads:
        torch.testing.assert_close(compiled_grads[name], eager_grads[name], rtol=1e-3, atol=1e-6)


def widened(batch: dict, extra: int) -> dict:
    """``batch`` with ``extra`` more padding columns after the completions: the same rollouts at a new length."""
    def pad(name: str, value: int = 0) -> torch.Tensor:
        return torch.nn.functional.pad(batch[name], (0, extra), value=value)

    return {**batch, "completion_ids": pad("completion_ids"), "completion_mask": pad("completion_mask"),
            "tool_mask": pad("tool_mask", 1)}


@pytest.mark.parametrize("padding_free", [False, True])
def test_compiled_layers_take_a_new_rollout_length_without_compiling_again(tiny_model_dir, questions_file, tmp_path,
                                                                          padding_free):
    # Every step brings rollouts of new lengths; a layer compiled for one static length compiles again at the next
    # (seconds to tens of seconds a compile on a GPU), so the layers are compiled for dynamic lengths from the start.
    torch._dynamo.reset()  # what earlier tests compiled (and the lengths dynamo saw change) would hide a recompile
    compiled = SearchR1Trainer(model=str(tiny_model_dir), args=update_config(tmp_path, questions_file,
                                                                              compile_layers=True,
                                                                              padding_free=padding_free))
    compiled.current_gradient_accumulation_steps = 1
    batch = rollout_batch(compiled.model.config.vocab_size)
    first_loss, _ = loss_and_grads(compiled, batch)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for extra in (3, 9):
        loss, _ = loss_and_grads(compiled, widened(batch, extra))
        torch.testing.assert_close(loss, first_loss, rtol=1e-4, atol=1e-6)  # padding changes nothing
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs


def test_compile_layers_refuses_a_model_without_decoder_layers():
    with pytest.raises(ValueError, match="Linear has no transformers decoder layers"):
        compile_decoder_layers(torch.nn.Linear(4, 4))
