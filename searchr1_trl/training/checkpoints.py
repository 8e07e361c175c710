"""Checkpoint folders and the run's output_dir: checked before anything loads them, each problem in one line.

A checkpoint is a whole model (``config.json`` and its weights) or, what the CPU recipe's LoRA run saves, a PEFT
adapter (``adapter_config.json`` and ``adapter_model.safetensors``) that transformers loads on the base model its
config names. :func:`check_model_folder` tells the two apart and refuses, naming the path and the cause, a path that is
missing, a file, an empty folder, a folder that is neither kind, an adapter whose base model cannot be read, and a
safetensors file shorter than its own header says (a save cut short by a kill or a full disk). A name that is no
local path is taken for a Hub id and left to transformers.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import shutil
import socket
import struct
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

ADAPTER_CONFIG = "adapter_config.json"
MODEL_CONFIG = "config.json"
EXPECTED = "a model folder (config.json and weights), a LoRA adapter folder (adapter_config.json) or a Hub model id"


@dataclass(frozen=True)
class ModelFolder:
    """A checked checkpoint: its path (or Hub id) and, for a LoRA adapter, the base model it loads on."""

    path: str
    base_model: str | None = None  # a LoRA adapter's base_model_name_or_path; None for a whole model

    @property
    def tokenizer_source(self) -> str:
        """Where the tokenizer is: the checkpoint when it saved one (the trainer does), else an adapter's base."""
        if self.base_model and not (Path(self.path) / "tokenizer_config.json").is_file():
            return self.base_model
        return self.path


def _is_hub_id(name: str) -> bool:
    """``owner/name`` that is no local path: ``Qwen/Qwen3-8B`` yes, ``runs/offline/`` or ``./m`` no."""
    owner, _, repo = name.partition("/")
    return bool(owner and repo) and "/" not in repo and not name.startswith((".", "~"))


def _safetensors_gap(path: Path) -> str | None:
    """Why a safetensors file cannot be whole (its header, or the data it promises, is cut short); None if whole.

    The format is an 8-byte header length, a JSON header giving each tensor's byte range, then the data: a file
    shorter than the furthest range is a write that did not finish."""
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return f"{path.name} is truncated ({size} bytes, less than a safetensors header)"
        (length,) = struct.unpack("<Q", head)
        if 8 + length > size:
            return f"{path.name} is truncated ({size:,} of the {8 + length:,} bytes its header alone needs)"
        try:
            header = json.loads(f.read(length))
            end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
        except (ValueError, KeyError, TypeError, IndexError):
            return f"{path.name} has an unreadable safetensors header"
    if 8 + length + end > size:
        return f"{path.name} is truncated ({size:,} of the {8 + length + end:,} bytes its header describes)"
    return None


def weights_problem(folder: Path) -> str | None:
    """The first safetensors file of ``folder`` that is cut short, or a shard its index lists that is missing, in a
    few words; None when the weights are whole."""
    for index in folder.glob("*.safetensors.index.json"):
        shards = sorted(set(json.loads(index.read_text()).get("weight_map", {}).values()))
        missing = [name for name in shards if not (folder / name).is_file()]
        if missing:
            return f"{', '.join(missing)}, listed in {index.name}, is missing"
    for path in sorted(folder.glob("*.safetensors")):
        gap = _safetensors_gap(path)
        if gap:
            return gap
    return None


def check_weights(folder: Path) -> None:
    """ValueError in one line when the weights of ``folder`` are not whole (:func:`weights_problem`)."""
    problem = weights_problem(folder)
    if problem:
        raise ValueError(f"checkpoint {str(folder)!r}: {problem}: a save cut short by a kill or a full disk; use "
                         "an earlier checkpoint or save it again")


def check_model_folder(checkpoint: str) -> ModelFolder:
    """The checkpoint as a :class:`ModelFolder`; ValueError in one line naming the path and what is wrong with it."""
    path = Path(checkpoint).expanduser()
    if not path.exists():
        if _is_hub_id(checkpoint):
            return ModelFolder(checkpoint)
        raise ValueError(f"checkpoint {checkpoint!r} does not exist; expected {EXPECTED}")
    if not path.is_dir():
        raise ValueError(f"checkpoint {checkpoint!r} is a file; expected {EXPECTED}")
    if not any(path.iterdir()):
        raise ValueError(f"checkpoint {checkpoint!r} is an empty folder; expected {EXPECTED}")
    if (path / ADAPTER_CONFIG).is_file():
        try:
            base = json.loads((path / ADAPTER_CONFIG).read_text())["base_model_name_or_path"]
        except (ValueError, KeyError, TypeError):
            raise ValueError(f"checkpoint {checkpoint!r}: {ADAPTER_CONFIG} names no base_model_name_or_path; "
                             "expected a PEFT adapter saved by save_pretrained") from None
        check_weights(path)
        if not (Path(base).expanduser().exists() or _is_hub_id(base)):
            raise ValueError(f"checkpoint {checkpoint!r} is a LoRA adapter of {base!r}, which does not exist here: "
                             "put the base model there or edit base_model_name_or_path in its adapter_config.json")
        if Path(base).expanduser().exists():
            check_model_folder(base)
        return ModelFolder(str(path), base_model=base)
    if not (path / MODEL_CONFIG).is_file():
        found = ", ".join(sorted(p.name for p in path.iterdir())[:8])
        raise ValueError(f"checkpoint {checkpoint!r} holds neither {MODEL_CONFIG} nor {ADAPTER_CONFIG} (found "
                         f"{found}); expected {EXPECTED}")
    check_weights(path)
    return ModelFolder(str(path))


# ---- the run's hold on its output_dir ------------------------------------------------------------------------

LOCK_FILE = "_searchr1_run.lock"  # "_*" is left out of a Hub push, as checkpoint-* is


class OutputDirLock:
    """An exclusive hold of ``output_dir`` for one run: a second run on the same folder, whose checkpoints would
    silently replace the first's, is refused in one line naming the holder.

    The hold is an ``flock`` on :data:`LOCK_FILE`, which the kernel drops when its process dies, however it dies: a
    lock file left by a dead run holds nothing and is taken over, with no race between two runs taking it at once.
    The file stays (removing it would let a run lock a file another has just unlinked); it says who holds or held
    it, for the refusal.
    """

    def __init__(self, output_dir: str):
        self.path = Path(output_dir) / LOCK_FILE
        self._file = None

    def acquire(self) -> OutputDirLock:
        """Take the hold; ValueError naming the holder when another run has it."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        file = self.path.open("a+")
        try:
            fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            file.seek(0)
            holder = file.read().strip() or "a run that has not written its pid yet"
            file.close()
            raise ValueError(f"output_dir {str(self.path.parent)!r} is in use by another run ({holder}): wait for "
                             "it to end or stop it, or give this run another output_dir") from None
        file.seek(0)
        file.truncate()
        file.write(f"pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
        file.flush()
        self._file = file
        return self

    def __enter__(self) -> OutputDirLock:
        return self if self._file is not None else self.acquire()

    def __exit__(self, *exc) -> None:
        if self._file is not None:
            self._file.close()  # closing drops the flock
            self._file = None


# ---- which checkpoint a run resumes from ---------------------------------------------------------------------

STREAM_STATE_FILE = "question_stream.json"
CHECKPOINT_COMPLETE_FILE = "searchr1_checkpoint_complete"  # written last: the checkpoint can be resumed from
NEWEST = ("true", "latest")  # what resume_from_checkpoint says on the command line for "the newest intact one"


def _whole_torch_file(path: Path) -> bool:
    """Whether a ``torch.save`` file is whole: it is a zip whose directory, written last, is at its end. Reading
    the directory is cheap where loading an optimizer state would take its size in memory."""
    try:
        with zipfile.ZipFile(path):
            return True
    except (zipfile.BadZipFile, OSError):
        return False


def checkpoint_problem(folder: Path) -> str | None:
    """Why ``folder`` cannot be resumed from, in a few words naming the file; None when it can.

    Resumable: marked complete by the trainer (:data:`CHECKPOINT_COMPLETE_FILE`, written last), its
    ``trainer_state.json`` and question stream state readable, every safetensors file as long as its header says,
    and every ``torch.save`` file (optimizer, scheduler, RNG, DeepSpeed shards) a whole zip.
    """
    if not folder.is_dir():
        return "no such folder"
    if not (folder / CHECKPOINT_COMPLETE_FILE).exists():
        return f"incomplete (no {CHECKPOINT_COMPLETE_FILE}: the run stopped while saving it)"
    for name in ("trainer_state.json", STREAM_STATE_FILE):
        try:
            json.loads((folder / name).read_text())
        except FileNotFoundError:
            return f"{name} is missing"
        except (ValueError, OSError):
            return f"{name} is not readable JSON"
    problem = weights_problem(folder)
    if problem:
        return problem
    for path in sorted(p for suffix in ("pt", "pth", "bin") for p in folder.rglob(f"*.{suffix}")):
        if not _whole_torch_file(path):
            return f"{path.relative_to(folder)} is not a whole torch file (truncated)"
    return None


def _step(folder: Path) -> int:
    suffix = folder.name.rsplit("-", 1)[-1]
    return int(suffix) if suffix.isdigit() else -1


def newest_intact_checkpoint(output_dir: str) -> str | None:
    """The ``checkpoint-<step>`` folder of ``output_dir`` with the highest step that can be resumed from
    (:func:`checkpoint_problem`), or None; each newer one is skipped with a warning saying why."""
    for folder in sorted(Path(output_dir).glob("checkpoint-*"), key=_step, reverse=True):
        problem = checkpoint_problem(folder)
        if problem is None:
            return str(folder)
        logger.warning("skipping %s: %s", folder, problem)
    return None


def resume_checkpoint(output_dir: str, requested: str | bool | None) -> str | None:
    """The checkpoint a run resumes from: None for none; for ``True``, ``"true"`` or ``"latest"`` the newest intact
    one (saying which, and why newer ones were skipped); a path if it is intact. ValueError in one line otherwise,
    naming the problem and the newest intact checkpoint there is."""
    if requested in (None, False, "", "false"):
        return None
    if requested is True or str(requested).lower() in NEWEST:
        chosen = newest_intact_checkpoint(output_dir)
        if chosen is None:
            raise ValueError(f"resume_from_checkpoint={requested!r}, but {output_dir} has no checkpoint-* folder "
                             "to resume from (none, or none intact: see the warnings above)")
        logger.warning("resuming from %s, the newest intact checkpoint of %s", chosen, output_dir)
        return chosen
    problem = checkpoint_problem(Path(requested))
    if problem is not None:
        folder = Path(requested).parent
        intact = newest_intact_checkpoint(str(folder)) if folder.is_dir() else None
        instead = (f"resume from {intact}, the newest intact one, or" if intact else "") + \
            " pass resume_from_checkpoint=latest for the newest intact one"
        raise ValueError(f"cannot resume from {requested}: {problem}; {instead.strip()}")
    return str(requested)


class CheckpointSaveError(RuntimeError):
    """A checkpoint could not be written; the message says why and what to resume from."""


# Free space below which a failed write is put down to a full disk (what is left once a large write has failed).
FULL_DISK_BYTES = 256 << 20


def save_failure(folder: Path, error: BaseException) -> CheckpointSaveError:
    """The one-line error of a checkpoint save that raised ``error``: a full disk said as such (torch's own words are
    "enforce fail at inline_container.cc ... unexpected pos"), the space left, and the intact checkpoint a resume
    takes (the failed one has no completeness marker, so a resume skips it)."""
    where = next(p for p in (folder, *folder.parents) if p.exists())
    free = shutil.disk_usage(where).free
    full = getattr(error, "errno", None) == errno.ENOSPC or free < FULL_DISK_BYTES
    intact = newest_intact_checkpoint(str(folder.parent))
    then = (f"{Path(intact).name} is intact: free space, then resume with --resume_from_checkpoint latest" if intact
            else "no earlier checkpoint is intact")
    first_line = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
    return CheckpointSaveError(f"saving {folder} failed ({'the disk is full' if full else 'a write failed'}, "
                               f"{free / 2**30:.2f} GiB free there): {first_line}; {then}")
