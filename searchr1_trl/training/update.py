"""Levers on the policy update: three on its throughput that keep its numbers (fp32 master weights for bf16 models,
padding-free packing of rollouts and compiled decoder layers) and DAPO's dynamic sampling. All are off by default;
``SearchR1Config`` switches them on.

- **fp32 master weights** (``fp32_master_weights``, with the model loaded in bfloat16): the optimizer keeps an fp32
  copy of every bf16 weight in its state, steps that copy with the gradients cast to fp32, and writes it back rounded
  to bf16. The forward/backward then run on bf16 weights (no autocast re-cast of every weight at every micro-step, half
  the gradient bytes) while lr 1e-6 updates still accumulate in fp32 (they vanish in bf16 weights). Memory per
  parameter: bf16 weight + bf16 grad + fp32 master + AdamW's two fp32 moments = 16 bytes, as with fp32 weights, plus
  an fp32 copy of the gradients during ``step()``. The masters live in the optimizer's state, so a checkpoint resumes
  them exactly. The supervised warm start (``warm_start_traces``) steps through the same masters.
- **padding-free packing** (``padding_free``): a micro-batch's rows, stripped of their padding, are packed first-fit
  (longest first) into as few rows of the padded length as hold them, position ids restarting at 0 for every rollout;
  transformers reads the restarts as sequence boundaries and masks attention across them (sdpa, eager,
  flex_attention). The log-probs land back where the padded batch has them, so the loss (tool tokens masked) is
  unchanged. It saves the padding's compute; a batch without padding packs to itself.
- **compiled decoder layers** (``compile_layers``): ``torch.compile`` of each decoder layer in place
  (``nn.Module.compile``: parameter names, state dicts, hooks and the weight pushes unchanged), not of the whole model,
  so a graph is one layer's and the fused LM head and the loss stay TRL's. On an H200
  (``experiments/policy_update.py --compile_layers``, seq 2048, bf16) it raised the update's MFU from 0.383 to 0.577
  (Qwen3-1.7B) and 0.554 to 0.694 (Qwen3-8B). The first step compiles, for any sequence length and (packed: see
  :func:`pack_rows`' ``one_graph``) any packing; in-process generation runs the layers eager
  (:func:`~searchr1_trl.engine.in_process.eager_layers`). Not under DeepSpeed ZeRO-3 (the trainer refuses it):
  dynamo traces into ZeRO-3's parameter-gathering hooks and recompiles until its limit, then runs eager.
- **DAPO's dynamic sampling, without the refill** (``drop_equal_reward_groups``): a group whose rollouts all got the
  same reward leaves the loss and its token count (:func:`drop_equal_reward_groups`).
"""

from __future__ import annotations

import torch
from transformers.modeling_layers import GradientCheckpointingLayer


class Fp32MasterWeights:
    """Mixin over a torch optimizer class: bf16 parameters are stepped through fp32 copies kept in the state.

    Used by :func:`with_fp32_master_weights`; parameters that already are fp32 are stepped as usual.
    """

    def step(self, closure=None):
        swapped = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None or p.dtype == torch.float32:
                    continue
                state = self.state[p]
                master = state["master"] if "master" in state else p.detach().float()
                swapped.append((p, p.data, p.grad, master))
                p.data, p.grad = master, p.grad.float()
        try:
            # The master is put in the state after the first step: AdamW initialises a parameter's state when empty.
            loss = super().step(closure)
        finally:
            for p, low, grad, master in swapped:
                low.copy_(p.data)
                p.data, p.grad = low, grad
                self.state[p]["master"] = master
        return loss

    def load_state_dict(self, state_dict):
        # torch casts loaded floating state to each parameter's dtype: seen as bf16 they would lose the fp32 masters.
        params = [p for group in self.param_groups for p in group["params"] if p.dtype != torch.float32]
        low = [p.data for p in params]
        for p in params:
            p.data = p.data.float()
        try:
            super().load_state_dict(state_dict)
        finally:
            for p, data in zip(params, low, strict=True):
                p.data = data


def with_fp32_master_weights(optimizer: torch.optim.Optimizer, deepspeed: bool = False) -> torch.optim.Optimizer:
    """``optimizer`` itself, its class extended by :class:`Fp32MasterWeights` (same param groups, schedule, fused or
    not); ValueError under DeepSpeed or when no parameter is below fp32, where masters would change nothing."""
    if deepspeed:
        raise ValueError("fp32_master_weights=True under DeepSpeed: its bf16 mode keeps fp32 master weights itself; "
                         "remove fp32_master_weights from the recipe")
    if {p.dtype for group in optimizer.param_groups for p in group["params"]} == {torch.float32}:
        raise ValueError("fp32_master_weights=True but the model's weights are float32 already; load them in "
                         "bfloat16 (dtype: bfloat16) or drop fp32_master_weights")
    cls = type(optimizer)
    optimizer.__class__ = type(f"Fp32Master{cls.__name__}", (Fp32MasterWeights, cls), {})
    return optimizer


def loss_mask(batch: dict) -> torch.Tensor:
    """The tokens GRPO's loss reads in a batch as ``GRPOTrainer._generate_and_score_completions`` returns it: completion
    tokens less tool responses (TRL 1.16's ``mask`` in ``_compute_loss``)."""
    return batch["completion_mask"] * batch.get("tool_mask", 1)


def pack_rows(attention_mask: torch.Tensor, one_graph: bool = False
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Where each real token of a padded batch goes in a packed one of the same row length.

    Returns ``(source, target, position_ids, rows)``: flat indices of the real tokens in the padded ``(B, L)`` batch
    and in the packed ``(rows, L)`` one, the packed batch's position ids (restarting at 0 per sequence; a row's padded
    tail continues its last sequence, which it follows, so no real token attends to it) and the row count. Built on
    the host from one copy of the mask, then moved to its device: one synchronisation per micro-batch.

    ``one_graph`` (for compiled layers): each batch reaches the layers in the form of the others, or they compile
    again (7-10 s each on an H200, three times in 30 steps). A single row would be a graph of its own (dynamo
    specialises sizes of 1), so there are at least two; and every batch has a sequence boundary, without which
    transformers passes no attention mask (another graph): a padded tail is a sequence of its own, and a batch of
    rows each exactly one rollout gets an empty row too (each position its own sequence).

    >>> pack_rows(torch.tensor([[0, 1, 1, 1], [1, 1, 0, 0], [0, 0, 0, 1]]))[2]
    tensor([[0, 1, 2, 0],
            [0, 1, 2, 3]])
    """
    batch, length = attention_mask.shape
    real = attention_mask.bool().cpu()
    lengths = real.sum(-1).tolist()
    bins: list[list[int]] = []
    fill: list[int] = []
    for i in sorted(range(batch), key=lambda i: -lengths[i]):
        row = next((r for r, used in enumerate(fill) if used + lengths[i] <= length), None)
        if row is None:
            bins.append([])
            fill.append(0)
            row = len(bins) - 1
        bins[row].append(i)
        fill[row] += lengths[i]
    if one_graph and (len(bins) < 2 or (all(len(members) == 1 for members in bins) and min(fill) == length)):
        bins.append([])  # its position ids stay 0: every position a sequence of its own
    sources, targets = [], []
    position_ids = torch.zeros(len(bins), length, dtype=torch.long)
    for row, members in enumerate(bins):
        offset = 0
        for i in members:
            sources.append(real[i].nonzero().squeeze(-1) + i * length)
            targets.append(torch.arange(offset, offset + lengths[i]) + row * length)
            position_ids[row, offset:offset + lengths[i]] = torch.arange(lengths[i])
            offset += lengths[i]
        if offset and offset < length:
            first = 0 if one_graph else position_ids[row, offset - 1] + 1
            position_ids[row, offset:] = torch.arange(first, first + length - offset)
    device = attention_mask.device
    return torch.cat(sources).to(device), torch.cat(targets).to(device), position_ids.to(device), len(bins)


def packed_forward(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int,
                   autocast, scored_columns: torch.Tensor | None = None, one_graph: bool = False, **model_kwargs):
    """TRL's fused-LM-head forward (log-probs and entropies of the last ``logits_to_keep`` columns) run on the packed
    rows of ``input_ids``; returns the model's output with ``log_probs``/``entropy`` laid out as the padded batch's.
    ``scored_columns`` (B, logits_to_keep), where given, narrows the LM head to those positions (0 elsewhere);
    ``one_graph``: as :func:`pack_rows`."""
    source, target, position_ids, rows = pack_rows(attention_mask, one_graph)
    batch, length = input_ids.shape
    scored = torch.zeros_like(attention_mask, dtype=torch.bool)
    scored[:, -logits_to_keep:] = True if scored_columns is None else scored_columns.bool()
    scored &= attention_mask.bool()
    packed = input_ids.new_zeros(rows * length)
    packed[target] = input_ids.reshape(-1)[source]
    labels = torch.full_like(packed, -100)
    labels[target] = torch.where(scored.reshape(-1)[source], input_ids.reshape(-1)[source], -100)
    labels = labels.view(-1, length)
    labels[position_ids == 0] = -100  # a sequence's first token has nothing before it (it is a prompt token anyway)
    with autocast():
        outputs = model(input_ids=packed.view(-1, length), position_ids=position_ids, labels=labels,
                        fused_lm_head=True, **model_kwargs)

    def unpack(per_token):  # (rows, L - 1), token t+1 scored at t -> (B, logits_to_keep)
        if per_token is None:
            return None
        flat = torch.cat([per_token.new_zeros(per_token.size(0), 1), per_token], dim=1).reshape(-1)
        padded = per_token.new_zeros(batch * length).index_put((source,), flat[target])
        return padded.view(batch, length)[:, -logits_to_keep:]

    outputs.log_probs, outputs.entropy = unpack(outputs.log_probs), unpack(outputs.entropy)
    return outputs


def packed_logps_and_entropies(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int,
                               batch_size: int | None, compute_entropy: bool, compute_aux_loss: bool, autocast,
                               positions: tuple[torch.Tensor, torch.Tensor | None] | None = None,
                               one_graph: bool = False, **multimodal):
    """TRL's ``(log-probs, entropies, aux loss)`` of ``_get_per_token_logps_and_entropies``, each chunk of
    ``batch_size`` rows packed (:func:`packed_forward`). ``positions``: the loss's ``(scored, old log-probs)``, so the
    LM head scores only those; a skipped position takes its old log-prob where there is one, so its ratio is 1 (as
    TRL's on-policy case) and none overflows before the mask."""
    given = sorted(name for name, value in multimodal.items() if value is not None)
    if given:
        raise ValueError(f"padding_free=True packs text rollouts only; this batch has {', '.join(given)}")
    batch_size = batch_size or input_ids.size(0)
    scored, old = positions or (None, None)
    if scored is not None and scored.shape != (input_ids.size(0), logits_to_keep):
        raise ValueError(f"loss positions {tuple(scored.shape)} do not match the batch's "
                         f"{(input_ids.size(0), logits_to_keep)} completion positions")
    logps, entropies, aux_losses = [], [], []
    for start in range(0, input_ids.size(0), batch_size):
        rows = slice(start, start + batch_size)
        outputs = packed_forward(
            model, input_ids[rows], attention_mask[rows], logits_to_keep, autocast,
            scored_columns=None if scored is None else scored[rows], one_graph=one_graph,
            **({"output_router_logits": True} if compute_aux_loss else {}))
        if scored is not None and old is not None:
            outputs.log_probs = torch.where(scored[rows], outputs.log_probs, old[rows].to(outputs.log_probs))
        logps.append(outputs.log_probs)
        entropies.append(outputs.entropy)
        aux_losses.append(outputs.aux_loss)
    return (torch.cat(logps), torch.cat(entropies) if compute_entropy else None,
            torch.stack(aux_losses).mean() if compute_aux_loss else None)


def compile_decoder_layers(model: torch.nn.Module) -> int:
    """``torch.compile`` every decoder layer of ``model`` (a transformers model, PEFT-wrapped or not) in place; returns
    how many. Decoder layers are transformers' ``GradientCheckpointingLayer`` modules, which every decoder model's
    layers are; ValueError for a model without any, where there is nothing this lever would compile."""
    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    if not layers:
        raise ValueError(f"compile_layers=True but {type(model).__name__} has no transformers decoder layers "
                         "(GradientCheckpointingLayer modules) to compile; drop compile_layers")
    for layer in layers:
        layer.compile(dynamic=True)  # rollout lengths change every step: one compile, not a second at the next length
    return len(layers)


def compile_for_training(model: torch.nn.Module, ref_model: torch.nn.Module | None, accelerator) -> None:
    """``compile_layers``: the policy's decoder layers compiled, and the reference model's (its forward, with
    beta > 0, is a third of the update's work, in series); ValueError under DeepSpeed ZeRO-3."""
    deepspeed = getattr(accelerator.state, "deepspeed_plugin", None)
    if deepspeed is not None and deepspeed.zero_stage == 3:
        raise ValueError("compile_layers=True under DeepSpeed ZeRO-3: torch.compile traces into ZeRO-3's "
                         "parameter-gathering hooks and recompiles until its limit, then runs the layers "
                         "eager; drop compile_layers, or train without ZeRO-3 (ZeRO-1/2 compile as one GPU)")
    compile_decoder_layers(model)
    if ref_model is not None:
        compile_decoder_layers(ref_model)


def drop_equal_reward_groups(output: dict, num_generations: int, accelerator, metrics: dict[str, list[float]]) -> dict:
    """A step's scored ``output`` without its groups whose advantages are all ~0 (equal rewards; TRL divides by
    std + 1e-4, so float noise stays far below 0.01 while a group with spread has |advantage| ~1): they leave the loss
    mask and the DAPO token count, counted as ``train/dropped_groups``."""
    advantages = output["advantages"]
    if advantages.numel() % num_generations:
        raise ValueError(f"drop_equal_reward_groups: this process holds {advantages.numel()} rollouts, not whole "
                         f"groups of num_generations={num_generations}")
    keep = (advantages.view(-1, num_generations).abs() > 0.01).any(dim=1)
    metrics["train/dropped_groups"].append(1.0 - keep.float().mean().item())
    output["completion_mask"] = output["completion_mask"] * keep.repeat_interleave(num_generations)[:, None]
    output["num_items_in_batch"] = accelerator.gather(loss_mask(output).sum()).sum()
    return output
