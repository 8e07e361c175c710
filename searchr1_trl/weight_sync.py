"""Weight sync: how the trainer's policy reaches the vLLM generator after an optimizer step.

A push is a :class:`WeightPush`: ``push(model)`` returns once the generator serves ``model``'s current weights. The
trainer decides *when* (once per optimizer step, before the step's rollouts or a validation); this module decides
*how*, so another way to push (an asynchronous one, or CUDA IPC to a server on the same GPU) is one more class with
the same method, chosen in :func:`weight_push`:

- :class:`NcclPush` (``weight_sync="nccl"``, CUDA clusters): TRL's ``VLLMGeneration.sync_weights``, which broadcasts
  every parameter to the server's workers (ZeRO-3 gathered and PEFT merged by TRL).
- :class:`ReloadPush` (``weight_sync="reload"``, works without CUDA): the policy saved as safetensors to a folder the
  server reloads in place (:func:`~searchr1_trl.vllm_server.reload_weights`), then deleted (on tmpfs it is memory).
  With PEFT only the decoder layers it trains are written, adapters merged in (:func:`save_for_reload`).
- :class:`PausedPush` (``in_flight_rollouts="pause"`` of the asynchronous mode): either of the two into a server
  whose requests stay in flight, frozen by vLLM's ``/pause`` for the push and resumed after it.

**The sync folder is the pusher's**: it is replaced whole on every push, so a folder that holds anything a push did
not write (no :data:`WEIGHT_SYNC_MARKER`) is refused, never deleted.
"""

from __future__ import annotations

import contextlib
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

import torch

from searchr1_trl.vllm_server import pause_generation, reload_weights, reset_prefix_cache, resume_generation

WEIGHT_SYNC_MARKER = ".searchr1_weight_sync"  # in every weight-sync folder a push writes


class WeightPush(Protocol):
    def push(self, model: torch.nn.Module) -> None:
        """Load ``model``'s current weights into the generator; return once it serves them."""


class NcclPush:
    """TRL's NCCL path; TRL's ``VLLMGeneration`` holds the model, the communicator and the server's address."""

    def __init__(self, vllm_generation):
        self.vllm_generation = vllm_generation

    def push(self, model: torch.nn.Module) -> None:
        self.vllm_generation.sync_weights()


class ReloadPush:
    """Safetensors through ``folder``, reloaded by the server at ``server_url``; ``dtype`` (e.g. ``"bfloat16"``,
    what a GPU server runs) rounds what is written, None writes the trainer's dtype."""

    def __init__(self, accelerator, server_url: str, folder: str | Path, dtype: str | None = None):
        self.accelerator, self.server_url, self.folder = accelerator, server_url, Path(folder)
        self.dtype = getattr(torch, dtype) if dtype else None

    def push(self, model: torch.nn.Module) -> None:
        self.save(model)
        if self.accelerator.is_main_process:
            reload_weights(self.server_url, self.folder)
            # Loaded: the folder has done its job, and on tmpfs it is memory until deleted.
            shutil.rmtree(self.folder, ignore_errors=True)
        self.accelerator.wait_for_everyone()

    def save(self, model: torch.nn.Module) -> None:
        """Gather the policy (every rank takes part under ZeRO-3) and write ``folder`` on the main process."""
        state_dict = self.accelerator.get_state_dict(model)
        if self.accelerator.is_main_process:
            save_for_reload(self.accelerator.unwrap_model(model), state_dict, self.folder, self.dtype)


class PausedPush:
    """``inner``'s push into the server at ``server_url`` while its requests are in flight: ``/pause?mode=keep``
    freezes them, ``inner`` loads the weights, the prefix cache is reset with the frozen requests preempted (they
    recompute their KV with the new weights: no token attends to KV of the old ones) and ``/resume`` lets them go
    on. Their tokens after the push come from the new weights; the behaviour log-probs vLLM returns per token are
    those of the weights that sampled it, so the importance weight of the asynchronous mode stays exact."""

    def __init__(self, inner: WeightPush, accelerator, server_url: str):
        self.inner, self.accelerator, self.server_url = inner, accelerator, server_url

    def push(self, model: torch.nn.Module) -> None:
        main = self.accelerator.is_main_process
        if main:
            pause_generation(self.server_url)
        try:
            self.inner.push(model)
            if main:
                reset_prefix_cache(self.server_url)
        finally:
            if main:
                resume_generation(self.server_url)
        self.accelerator.wait_for_everyone()


def weight_push(args, accelerator, vllm_generation=None) -> WeightPush:
    """The push a recipe asks for: NCCL through TRL's ``vllm_generation`` for ``weight_sync="nccl"``, else a reload
    through ``weight_sync_dir`` (default ``<output_dir>/generator_weights``)."""
    if args.weight_sync == "nccl":
        if vllm_generation is None:
            raise ValueError(f"weight_sync='nccl' needs TRL's vLLM client (use_vllm with generator='vllm'), got "
                             f"generator={args.generator!r}")
        return NcclPush(vllm_generation)
    return ReloadPush(accelerator, args.generator_url, reload_folder(args), args.weight_sync_dtype)


def reload_folder(args) -> Path:
    """The folder a reload push writes: ``weight_sync_dir``, default ``<output_dir>/generator_weights``."""
    return Path(args.weight_sync_dir or Path(args.output_dir) / "generator_weights")


def save_for_reload(model: torch.nn.Module, state_dict: dict | None, folder: Path,
                    dtype: torch.dtype | None = None) -> None:
    """Write what the server loads into ``folder`` (replaced whole, never half-written): ``state_dict`` (None: the
    model's own), or with PEFT the decoder layers it trains, adapters merged in
    (:func:`_layers_with_trainable_parameters`), in ``dtype`` when given."""
    check_sync_folder_is_ours(folder)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent if folder.parent.exists() else None))
    with contextlib.ExitStack() as stack:
        if hasattr(model, "merge_and_unload"):  # PEFT: ship the layers it trains, with the adapter merged in
            state_dict = _layers_with_trainable_parameters(stack.enter_context(_merged_peft_state_dict(model)), model)
            model = model.get_base_model()
        if state_dict is None:
            state_dict = model.state_dict()
        if dtype is not None:
            state_dict = {name: tensor.to(dtype) for name, tensor in state_dict.items()}
        model.save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)
    (tmp / WEIGHT_SYNC_MARKER).write_text("written by searchr1_trl.weight_sync.save_for_reload\n")
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)


def check_sync_folder_is_ours(folder: Path) -> None:
    """ValueError if ``folder`` exists with content a push did not write: every push replaces it whole. The plan
    check asks before the run starts, every push again before it writes."""
    if folder.is_dir() and any(folder.iterdir()) and not (folder / WEIGHT_SYNC_MARKER).exists():
        found = sorted(p.name for p in folder.iterdir())[:5]
        raise ValueError(
            f"weight_sync_dir {folder} holds files this trainer did not write ({', '.join(found)}); every weight "
            "push replaces the folder, so point weight_sync_dir at an empty or new folder"
        )


@contextlib.contextmanager
def _merged_peft_state_dict(model) -> Iterator[dict[str, torch.Tensor]]:
    """Base-model state dict with the LoRA deltas merged in, under the base model's own parameter names; valid inside
    the ``with`` block only. The tensors are the model's own, merged in place and unmerged on exit: no copy of the
    model is made (a copy cost the CPU recipe's trainer 2.43 GB more at every sync, writing in place 0.1 GB:
    ``python -m benchmarks.probes.lora_sync_memory``)."""
    model.merge_adapter()
    try:
        yield {name.removeprefix("base_model.model.").replace(".base_layer", ""): tensor.detach()
               for name, tensor in model.state_dict().items() if "lora_" not in name}
    finally:
        model.unmerge_adapter()


_DECODER_LAYER = re.compile(r"^(.*\.layers\.\d+)\.")


def _layers_with_trainable_parameters(state_dict: dict[str, torch.Tensor], peft_model) -> dict[str, torch.Tensor]:
    """The entries of a merged PEFT ``state_dict`` that lie in a decoder layer holding a trainable parameter, whole
    layers at a time; ``state_dict`` itself if a trainable parameter lies outside the decoder layers (an embedding,
    the head) or none is trainable.

    Every other weight is frozen, so a server that started from the base model (as the step-0 weights are never
    pushed, it must) already holds it. Whole layers because vLLM fuses q/k/v and gate/up into one tensor each and
    rebuilds a layer only once all of its parts arrived; a layer the folder leaves out keeps its weights (vLLM 0.28's
    layerwise reload). The CPU recipe's LoRA on layers 16-23 ships 8 of 24 layers: 0.48 of 2.35 GB.

    ``base_model.model.model.layers.16.mlp.up_proj.lora_A.default.weight`` trainable -> every ``model.layers.16.*``.
    """
    layers = set()
    for name, parameter in peft_model.named_parameters():
        if parameter.requires_grad:
            layer = _DECODER_LAYER.match(name.removeprefix("base_model.model."))
            if layer is None:
                return state_dict
            layers.add(f"{layer.group(1)}.")
    if not layers:
        return state_dict
    return {name: tensor for name, tensor in state_dict.items() if name.startswith(tuple(layers))}
