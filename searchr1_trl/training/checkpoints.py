"""Checkpoint folders and the run's output_dir: checked before anything loads them, each problem in one line.

A checkpoint is a whole model (``config.json`` and its weights) or, what the CPU recipe's LoRA run saves, a PEFT
adapter (``adapter_config.json`` and ``adapter_model.safetensors``) that transformers loads on the base model its
config names. :func:`check_model_folder` tells the two apart and refuses, naming the path and the cause, a path that is
missing, a file, an empty folder, a folder that is neither kind, an adapter whose base model cannot be read, and a
safetensors file shorter than its own header says (a save cut short by a kill or a full disk). A name that is no
local path is taken for a Hub id and left to transformers.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import struct
import time
from dataclasses import dataclass
from pathlib import Path

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
            return f"{path.name} is {size} bytes, shorter than a safetensors header"
        (length,) = struct.unpack("<Q", head)
        if 8 + length > size:
            return f"{path.name} is {size:,} bytes but its header alone needs {8 + length:,}"
        try:
            header = json.loads(f.read(length))
            end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
        except (ValueError, KeyError, TypeError, IndexError):
            return f"{path.name} has an unreadable safetensors header"
    if 8 + length + end > size:
        return f"{path.name} is {size:,} bytes of the {8 + length + end:,} its header describes"
    return None


def check_weights(folder: Path) -> None:
    """ValueError naming the first safetensors file of ``folder`` that is truncated, or a shard its index lists that
    is missing."""
    for index in folder.glob("*.safetensors.index.json"):
        shards = sorted(set(json.loads(index.read_text()).get("weight_map", {}).values()))
        missing = [name for name in shards if not (folder / name).is_file()]
        if missing:
            raise ValueError(f"checkpoint {str(folder)!r}: {index.name} lists {', '.join(missing)}, which is not "
                             "there: the save was cut short; use an earlier checkpoint or save it again")
    for path in sorted(folder.glob("*.safetensors")):
        gap = _safetensors_gap(path)
        if gap:
            raise ValueError(f"checkpoint {str(folder)!r}: {gap}: the file is truncated (a save cut short by a kill "
                             "or a full disk); use an earlier checkpoint or save it again")


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
