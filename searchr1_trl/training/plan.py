"""Checks a recipe's plan before anything heavy starts, so a bad plan fails in one line that says what to change.

Checked: required fields, the generator's tensor parallel size against the model's KV heads (vLLM shards KV heads,
so TP must divide them), the launch plan's GPUs (:func:`~searchr1_trl.serving.launch.check_plan`), local files (data
files row by row, training prompts against ``max_rollout_tokens``), that the weight-sync folder holds nothing a push
did not write, and (optionally) that the retrieval server (for a task that searches) and the generator server answer.
KV head counts come from the model's config when it can be read (local folder or Hub cache), else from the published
numbers below, so recipes validate offline.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import time
from pathlib import Path

import httpx

from searchr1_trl.assets.shapes import PUBLISHED_CONFIGS
from searchr1_trl.serving.launch import check_plan
from searchr1_trl.serving.weight_sync import check_sync_folder_is_ours, reload_folder
from searchr1_trl.tasks import get_task
from searchr1_trl.tasks.common.data import load_samples
from searchr1_trl.tasks.common.retrieval import check_retriever
from searchr1_trl.training.recipe import part_config
from searchr1_trl.training.rows import overlong_prompts

logger = logging.getLogger(__name__)


class PlanError(ValueError):
    """A recipe that cannot run as configured; the message says what to change."""


def kv_heads(model_name_or_path: str) -> int:
    """The model's number of key/value heads."""
    try:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(model_name_or_path, local_files_only=not Path(model_name_or_path).exists()
                                            and os.environ.get("HF_HUB_OFFLINE") == "1")
        config = getattr(config, "text_config", config)
        return int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
    except (OSError, ValueError):
        if model_name_or_path in PUBLISHED_CONFIGS:
            return PUBLISHED_CONFIGS[model_name_or_path]["num_key_value_heads"]
        raise PlanError(f"cannot read the config of model {model_name_or_path!r}: download it first "
                        f"(scripts/download_hf_assets.py) or check the name") from None


def _server_answers(url: str, wait_s: float = 0.0) -> bool:
    """Whether ``url`` answers without a server error, asked every second for up to ``wait_s`` seconds."""
    deadline = time.monotonic() + wait_s
    for attempt in itertools.count():
        with contextlib.suppress(httpx.HTTPError):  # not up yet: that is what is being asked
            if httpx.get(url, timeout=3.0).status_code < 500:
                return True
        if time.monotonic() >= deadline:
            return False
        if attempt == 0:
            logger.warning("%s does not answer yet; waiting up to %.0fs", url, wait_s)
        time.sleep(1.0)


def _check_prompt_room(args, model: str) -> None:
    """:class:`PlanError` naming the training rows whose prompt leaves no room for a generated token within
    ``max_rollout_tokens`` (:func:`~searchr1_trl.training.rows.overlong_prompts`); their rollouts could teach
    nothing. Skipped, with a warning, when the model's tokenizer cannot be read here."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(model)
    except (OSError, ValueError) as error:
        logger.warning("prompt lengths not checked: no tokenizer of %s loads here (%s)", model, error)
        return
    rows = [(row, sample) for row, sample in enumerate(load_samples(args.train_data_path))
            if args.train_data_source is None or sample.data_source == args.train_data_source]
    envs = get_task(args.task).envs(part_config(args, "env"))
    long = overlong_prompts([sample for _, sample in rows], envs, tokenizer, part_config(args, "rollout"))
    if long:
        shown = ", ".join(f"row {rows[position][0]}: {tokens:,} tokens" for position, tokens in long[:3])
        more = ", ..." if len(long) > 3 else ""
        raise PlanError(f"train_data_path: {len(long)} row(s) have a prompt that leaves no room for a generated token "
                        f"within max_rollout_tokens={args.max_rollout_tokens} ({shown}{more}): drop them from "
                        f"{args.train_data_path} or raise max_rollout_tokens")


def _check_hub(token: str | None) -> None:
    """:class:`PlanError` unless the Hub answers and knows this login: the push comes after training, where a
    network or login problem surfaced as a traceback after hours of work."""
    from huggingface_hub import HfApi

    try:
        HfApi().whoami(token=token)
    except Exception as error:  # noqa: BLE001 - offline, no token, a refused token, no network: each stops the push
        cause = " ".join(str(error).split())[:200]
        raise PlanError(f"push_to_hub is set but the Hub cannot be reached or refuses this login "
                        f"({type(error).__name__}: {cause}): log in (`hf auth login`), check the network and "
                        "HF_HUB_OFFLINE, or drop push_to_hub") from None


def check_machine(recipe: str, values: dict) -> None:
    """Raise :class:`PlanError` when the recipe's ``values`` (:func:`~searchr1_trl.training.loading.recipe_values`:
    YAML + command line, typed, not yet a config) need CUDA and this machine has none, naming what is needed and what
    to run instead.

    Run before the config is built: ``TrainingArguments`` refuses bf16 without a GPU with "Your setup doesn't support
    bf16/gpu" in a traceback, and TRL's configs default bf16 to on unless fp16 or ``use_cpu`` is set.
    """
    import torch

    if torch.cuda.is_available():
        return
    needs = []
    fp16 = values.get("fp16", False)
    bf16 = not fp16 if values.get("bf16") is None else values["bf16"]
    if (bf16 or fp16) and not values.get("use_cpu", False):
        needs.append(f"{'bf16' if bf16 else 'fp16'} mixed precision")
    if values.get("weight_sync") == "nccl" and values.get("generator", "vllm") != "transformers":
        needs.append("weight_sync=nccl")
    if needs:
        raise PlanError(
            f"recipe {recipe} needs CUDA GPUs ({', '.join(needs)}) and this machine has none: on a CPU run "
            f"`searchr1-train --config offline` (add --max_steps 1 for a smoke run), or force this recipe onto the "
            f"CPU with --use_cpu true --bf16 false --weight_sync reload"
        )


def validate_plan(args, model_args, check_machine: bool = True) -> None:
    """Raise :class:`PlanError` naming the first problem in the recipe.

    ``check_machine=False`` checks the recipe alone (what tests on a CPU machine can check); True also checks this
    machine and the servers the run needs.
    """
    model = model_args.model_name_or_path
    if not model:
        raise PlanError("model_name_or_path is not set: name a Hub model or a local folder in the recipe")
    validates = args.eval_strategy != "no" or args.eval_on_start
    for name, source in (("train_data_path", args.train_data_source),
                         ("eval_data_path", args.eval_data_source if validates else None)):
        path = getattr(args, name)
        if path and not Path(path).exists():
            raise PlanError(f"{name}={path} does not exist: prepare it (searchr1-assets) or fix the path")
        if path:
            try:  # every row and the data_source filter, now: the trainer reads them once the model is loaded
                load_samples(path, source)
            except ValueError as error:
                raise PlanError(f"{name}: {error}") from None
    if args.train_data_path:
        _check_prompt_room(args, model)
    tp = args.vllm_tensor_parallel_size
    heads = kv_heads(model)
    if tp > heads or heads % tp:
        divisors = [d for d in range(1, heads + 1) if heads % d == 0]
        raise PlanError(f"vllm_tensor_parallel_size={tp} does not divide the {heads} KV heads of {model}: "
                        f"use one of {divisors}")
    try:
        check_plan(part_config(args, "launch"), args.generator, args.weight_sync, tp)
    except ValueError as error:
        raise PlanError(str(error)) from None
    if args.generator == "vllm" and args.weight_sync == "reload":
        try:  # at the first push, minutes into the run, would be too late to say it
            check_sync_folder_is_ours(reload_folder(args))
        except ValueError as error:
            raise PlanError(str(error)) from None
    if not check_machine:
        return
    if args.weight_sync in ("nccl", "ipc") and args.generator == "vllm":
        import torch

        if not torch.cuda.is_available():
            raise PlanError(f"weight_sync={args.weight_sync} needs CUDA: use weight_sync=reload on this machine")
    if args.push_to_hub:
        _check_hub(args.hub_token)
    try:  # health and a probe query: a server that is up but cannot search would fail every search of the run
        if get_task(args.task).needs_retriever:
            check_retriever(args.search_url, args.topk)
    except ValueError as error:
        raise PlanError(str(error)) from None
    # Waits, as TRL's own client does: the server may be starting up beside the trainer. A warm start needs only the
    # retriever (its traces are scripted), so it runs meanwhile and the trainer waits afterwards (wait_for_generator).
    if args.generator == "vllm":
        if not warm_start_due(args):
            wait_for_generator(args, model)
        elif not _server_answers(f"{args.generator_url}/health"):
            logger.warning("%s/health does not answer yet: warm-starting meanwhile, then waiting up to %.0fs for it",
                           args.generator_url, args.vllm_server_timeout)


def warm_start_due(args) -> bool:
    """Whether the run fine-tunes on warm-start traces before GRPO (a resumed run's checkpoint has its weights)."""
    return bool(args.warm_start_traces) and not args.resume_from_checkpoint


def wait_for_generator(args, model: str) -> None:
    """Return once the vLLM server answers ``/health``, asked for up to ``vllm_server_timeout`` seconds; PlanError
    naming the server and the command that serves ``model`` otherwise."""
    if not _server_answers(f"{args.generator_url}/health", args.vllm_server_timeout):
        raise PlanError(f"vLLM server not reachable at {args.generator_url}/health within vllm_server_timeout="
                        f"{args.vllm_server_timeout:.0f}s: start `trl vllm-serve --model {model} --host 127.0.0.1` "
                        "or fix vllm_server_base_url")
