"""Saving a checkpoint complete, and resuming the question stream from one.

The question stream's state is written (atomically) first, a
:data:`~searchr1_trl.training.checkpoints.CHECKPOINT_COMPLETE_FILE` marker last, and older checkpoints are rotated away
only after the marker (:func:`complete_checkpoint`), so a kill at any moment leaves a complete checkpoint; a save that
fails says why in one line (:func:`~searchr1_trl.training.checkpoints.save_failure`). A resume takes the checkpoint
:func:`~searchr1_trl.training.checkpoints.resume_checkpoint` verifies and puts the stream where it stood there
(:func:`resume_point`). Under asynchronous rollouts the state saved is the one from before the questions drawn ahead,
so those are served again after a resume.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

from transformers.trainer import rotate_checkpoints
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from searchr1_trl.training.checkpoints import (
    CHECKPOINT_COMPLETE_FILE,
    STREAM_STATE_FILE,
    resume_checkpoint,
    save_failure,
)


def write_atomically(path: Path, text: str) -> None:
    """``path`` holds ``text`` or what it held before, never a part of it (a kill mid-write leaves a stray .tmp)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


@contextlib.contextmanager
def complete_checkpoint(trainer, trial, stream):
    """Around transformers' own save of ``trainer``'s checkpoint: ``stream``'s state first, the completeness marker
    after everything every rank wrote, and the rotation of older checkpoints (which transformers does at the end of
    its save) only after the marker. A save that raises (a full disk, in torch's words "unexpected pos") says why."""
    run_dir = Path(trainer._get_output_dir(trial=trial))
    folder = run_dir / f"{PREFIX_CHECKPOINT_DIR}-{trainer.state.global_step}"
    args = trainer.args
    if args.should_save:
        (folder / CHECKPOINT_COMPLETE_FILE).unlink(missing_ok=True)  # a folder saved again is incomplete meanwhile
        write_atomically(folder / STREAM_STATE_FILE, json.dumps(stream.state_dict()))
    limit, args.save_total_limit = args.save_total_limit, None
    try:
        yield
    except (OSError, RuntimeError) as error:
        raise save_failure(folder, error) from error
    finally:
        args.save_total_limit = limit
    trainer.accelerator.wait_for_everyone()  # every rank's shards are written
    if args.should_save:
        write_atomically(folder / CHECKPOINT_COMPLETE_FILE, "")
        rotate_checkpoints(output_dir=str(run_dir), save_total_limit=limit,
                           best_model_checkpoint=trainer.state.best_model_checkpoint, use_mtime=True)


def resume_point(resume_from_checkpoint: str | bool | None, output_dir: str, stream) -> str | None:
    """The checkpoint to resume from, verified (``True`` or ``latest``: the newest intact one of ``output_dir``), with
    ``stream`` moved to where it stood there; ValueError for one that cannot be resumed from."""
    chosen = resume_checkpoint(output_dir, resume_from_checkpoint)
    if chosen:
        stream.load_state_dict(json.loads((Path(chosen) / STREAM_STATE_FILE).read_text()))
    return chosen
