"""Reliability of a training run: a kill -9 at any moment leaves a checkpoint to resume from
exactly, and the weight-sync folder never takes a user's files with it.

Training is the real trainer on the tiny model of conftest, generating in-process and searching the real retrieval
server; the killed runs are child processes killed with SIGKILL, at a step boundary and inside a checkpoint save.
Figures go to ``reliability_figures`` (docs/RELIABILITY.md).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import pytest
from test_trainer import RecordingStream, small_config

from searchr1_trl.serving import weight_sync
from searchr1_trl.tasks.search_r1.data import SearchR1Dataset
from searchr1_trl.training import trainer as trainer_module
from searchr1_trl.training.recipe import build_task, part_config
from searchr1_trl.training.trainer import CHECKPOINT_COMPLETE_FILE, SearchR1Trainer

ROOT = Path(__file__).resolve().parent.parent
QUESTIONS_PER_STEP = 1  # small_config: 1 per device x 2 accumulation / 2 generations

# The child trains 3 steps, saving every step and keeping one checkpoint, and SIGKILLs itself at step 2: "after" a
# checkpoint (it is saved, marked complete and the older one rotated away), or "during" one (where transformers
# rotates older checkpoints at the end of its own save: before our marker, and before the stream state was written
# on main d952a21).
CHILD = textwrap.dedent("""
    import os, signal, sys
    import transformers.trainer
    from transformers import TrainerCallback
    from searchr1_trl.training.trainer import SearchR1Trainer
    from test_trainer import small_config

    model, out, questions, url, mode = sys.argv[1:]
    args = small_config(__import__("pathlib").Path(out), questions, url, max_steps=3, save_strategy="steps",
                        save_steps=1, save_total_limit=1, generator="transformers", max_tokens_per_turn=8,
                        max_turns=1)

    class KillAfterSave(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            if state.global_step == 2:
                os.kill(os.getpid(), signal.SIGKILL)

    rotate = transformers.trainer.rotate_checkpoints

    def rotate_then_die(*a, **k):
        rotate(*a, **k)
        if trainer.state.global_step == 2:
            os.kill(os.getpid(), signal.SIGKILL)

    if mode == "during":
        transformers.trainer.rotate_checkpoints = rotate_then_die
    trainer = SearchR1Trainer(model=model, args=args, callbacks=[KillAfterSave()] if mode == "after" else [])
    trainer.train()
""")


@pytest.mark.slow  # starts or uses the real retrieval server
@pytest.mark.parametrize(("mode", "resumed_from"), [("after", 2), ("during", 1)])
def test_a_run_killed_after_or_during_a_checkpoint_resumes_exactly(tiny_model_dir, questions_file, retriever_url,
                                                                  tmp_path, mode, resumed_from, reliability_figures):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    child = subprocess.run([sys.executable, "-c", CHILD, str(tiny_model_dir), str(tmp_path), questions_file,
                            retriever_url, mode], env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert child.returncode == -signal.SIGKILL, child.stderr[-3000:]

    args = small_config(tmp_path, questions_file, retriever_url, max_steps=3, save_strategy="steps", save_steps=1,
                        save_total_limit=1, generator="transformers", max_tokens_per_turn=8, max_turns=1)
    stream = RecordingStream(part_config(args, "train_stream"))
    stream.drawn = []
    trainer = SearchR1Trainer(model=str(tiny_model_dir), args=args,
                              task=replace(build_task(args), train_stream=stream))
    trainer.train(resume_from_checkpoint=True)

    fresh = SearchR1Dataset(part_config(args, "train_stream"))
    expected = [next(fresh).question for _ in range(3 * QUESTIONS_PER_STEP)]
    exact = stream.drawn == expected[resumed_from * QUESTIONS_PER_STEP:]
    reliability_figures.setdefault("kill_and_resume", {})[mode] = {"resumed_from_step": resumed_from,
                                                                   "questions_exact": exact}
    assert exact, (stream.drawn, expected)
    assert (Path(args.output_dir) / "checkpoint-3" / CHECKPOINT_COMPLETE_FILE).exists()


def test_resume_refuses_an_incomplete_checkpoint_by_name_and_skips_it_when_asked_for_the_newest(tmp_path):
    for step in (1, 2):
        (tmp_path / f"checkpoint-{step}").mkdir()
    (tmp_path / "checkpoint-1" / CHECKPOINT_COMPLETE_FILE).touch()

    assert trainer_module.newest_complete_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint-1")
    (tmp_path / "checkpoint-1" / CHECKPOINT_COMPLETE_FILE).unlink()
    assert trainer_module.newest_complete_checkpoint(str(tmp_path)) is None


@pytest.mark.slow  # starts or uses the real retrieval server
def test_the_weight_sync_folder_is_replaced_when_ours_and_refused_when_not(tiny_model_dir, questions_file,
                                                                          retriever_url, tmp_path, monkeypatch):
    reloads = []  # (folder, its files when the server was told to load it)

    def reload_weights(url, folder):
        reloads.append((Path(folder), sorted(p.name for p in Path(folder).iterdir())))

    monkeypatch.setattr(weight_sync, "reload_weights", reload_weights)
    args = small_config(tmp_path, questions_file, retriever_url, generator="transformers")
    trainer = SearchR1Trainer(model=str(tiny_model_dir), args=args)
    folder = Path(args.weight_sync_dir)
    push = weight_sync.ReloadPush(trainer.accelerator, "http://127.0.0.1:9", folder)

    push.push(trainer.model)
    assert not folder.exists()  # loaded, then deleted: on tmpfs it is memory
    folder.mkdir()  # what a push killed while the server loaded it leaves: its own folder, marker and all
    (folder / weight_sync.WEIGHT_SYNC_MARKER).touch()
    (folder / "stale.safetensors").touch()
    push.push(trainer.model)  # its own folder: replaced
    assert [f for f, _ in reloads] == [folder, folder]
    assert all("model.safetensors" in files and "stale.safetensors" not in files for _, files in reloads)

    theirs = tmp_path / "notes"
    (theirs / "sub").mkdir(parents=True)
    (theirs / "notes.txt").write_text("mine")
    push.folder = theirs
    with pytest.raises(ValueError, match=r"notes holds files this trainer did not write \(notes.txt, sub\)"):
        push.push(trainer.model)
    assert (theirs / "notes.txt").read_text() == "mine" and (theirs / "sub").is_dir()


def test_a_row_whose_prompt_leaves_no_room_is_skipped_and_counted_not_fatal(tiny_model_dir, tmp_path):
    """A question longer than max_rollout_tokens ends its rollouts truncated_prompt_too_long with no completion; TRL
    1.16's parse_response raised AttributeError on it and killed the run. No search is made, so none is served."""
    import pandas as pd

    data = tmp_path / "long.parquet"
    pd.DataFrame({"question": ["Why? " + "very " * 2000], "golden_answers": [["yes"]]}).to_parquet(data)
    args = small_config(tmp_path, str(data), "http://127.0.0.1:9/retrieve", generator="transformers",
                        max_rollout_tokens=512)
    trainer = SearchR1Trainer(model=str(tiny_model_dir), args=args)
    trainer.train()

    [logged] = [entry for entry in trainer.state.log_history if "rollout/status_truncated_prompt_too_long" in entry]
    assert logged["rollout/status_truncated_prompt_too_long"] == 1.0 and logged["loss"] == 0.0


# A run holding its output_dir (the hold searchr1-train takes before it loads the model), until killed.
HOLDER = textwrap.dedent("""
    import sys, time
    from searchr1_trl.training.checkpoints import OutputDirLock

    hold = OutputDirLock(sys.argv[1]).acquire()
    print("held", flush=True)
    time.sleep(600)
""")


def test_a_second_run_on_an_output_dir_in_use_is_refused_in_one_line_naming_the_first(tiny_model_dir, tmp_path):
    from conftest import serve_health

    from searchr1_trl.cli.train import main as train_main

    out = tmp_path / "run"
    first = subprocess.Popen([sys.executable, "-c", HOLDER, str(out)], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": str(ROOT)})
    retriever = serve_health()
    try:
        assert first.stdout.readline() == "held\n"
        with pytest.raises(SystemExit) as stop:
            train_main(["--config", "offline", "--model_name_or_path", str(tiny_model_dir), "--output_dir", str(out),
                        "--generator", "transformers", "--max_steps", "1", "--max_tokens_per_turn", "8",
                        "--search_url", f"http://127.0.0.1:{retriever.server_port}/retrieve"])
    finally:
        first.kill()
        first.wait()
        retriever.shutdown()
    assert re.fullmatch(re.escape(f"error: output_dir '{out}' is in use by another run (pid {first.pid} on ")
                        + r".+, since [\d-]+ [\d:]+\): wait for it to end or stop it, or give this run another "
                          r"output_dir", stop.value.code), stop.value.code


def test_the_lock_of_a_killed_run_is_taken_over_and_names_the_new_holder(tmp_path):
    from searchr1_trl.training.checkpoints import LOCK_FILE, OutputDirLock

    killed = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert killed.stdout.readline() == "held\n"
    with pytest.raises(ValueError, match=f"in use by another run \\(pid {killed.pid} "):
        OutputDirLock(str(tmp_path)).acquire()
    killed.kill()
    killed.wait()
    assert (tmp_path / LOCK_FILE).read_text().startswith(f"pid {killed.pid} ")  # what a dead run leaves

    with OutputDirLock(str(tmp_path)):
        assert (tmp_path / LOCK_FILE).read_text().startswith(f"pid {os.getpid()} ")
        with pytest.raises(ValueError, match=f"in use by another run \\(pid {os.getpid()} "):
            OutputDirLock(str(tmp_path)).acquire()  # held: also within one process
    with OutputDirLock(str(tmp_path)):  # released on exit
        pass
