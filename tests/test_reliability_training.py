"""Reliability of a training run: a kill -9 at any moment leaves a checkpoint to resume from
exactly, and the weight-sync folder never takes a user's files with it.

Training is the real trainer on the tiny model of conftest, generating in-process and searching the real retrieval
server; the killed runs are child processes killed with SIGKILL, at a step boundary and inside a checkpoint save.
Figures go to ``reliability_figures`` (docs/RELIABILITY.md).
"""

from __future__ import annotations

import json
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
from searchr1_trl.tasks.common.data import SearchR1Dataset
from searchr1_trl.training.checkpoints import CHECKPOINT_COMPLETE_FILE, checkpoint_problem
from searchr1_trl.training.parts import build_task
from searchr1_trl.training.recipe import part_config
from searchr1_trl.training.trainer import SearchR1Trainer

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


KILL_MODES = ("after", "during")


@pytest.fixture(scope="module")
def killed_runs(tiny_model_dir, questions_file, retriever_url, tmp_path_factory) -> dict[str, Path]:
    """The output folder of each mode's child, killed as CHILD says. Both children run at once: most of each one's
    time is its single-threaded start (the trainer's imports)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    folders = {mode: tmp_path_factory.mktemp(f"killed_{mode}") for mode in KILL_MODES}
    children = {mode: subprocess.Popen([sys.executable, "-c", CHILD, str(tiny_model_dir), str(folder), questions_file,
                                        retriever_url, mode], env=env, cwd=ROOT, stdout=subprocess.DEVNULL,
                                       stderr=subprocess.PIPE, text=True)
                for mode, folder in folders.items()}
    for mode, child in children.items():
        _, stderr = child.communicate(timeout=600)
        assert child.returncode == -signal.SIGKILL, f"{mode}: {stderr[-3000:]}"
    return folders


@pytest.mark.slow  # starts or uses the real retrieval server
@pytest.mark.parametrize(("mode", "resumed_from"), [("after", 2), ("during", 1)])
def test_a_run_killed_after_or_during_a_checkpoint_resumes_exactly(killed_runs, tiny_model_dir, questions_file,
                                                                  retriever_url, mode, resumed_from,
                                                                  reliability_figures):
    tmp_path = killed_runs[mode]
    args = small_config(tmp_path, questions_file, retriever_url, max_steps=3, save_strategy="steps", save_steps=1,
                        save_total_limit=1, generator="transformers", max_tokens_per_turn=8, max_turns=1)
    stream = RecordingStream(part_config(args, "train_stream"))
    stream.drawn = []
    trainer = SearchR1Trainer(model=str(tiny_model_dir), args=args,
                              parts=replace(build_task(args), train_stream=stream))
    trainer.train(resume_from_checkpoint=True)

    fresh = SearchR1Dataset(part_config(args, "train_stream"))
    expected = [next(fresh).question for _ in range(3 * QUESTIONS_PER_STEP)]
    exact = stream.drawn == expected[resumed_from * QUESTIONS_PER_STEP:]
    reliability_figures.setdefault("kill_and_resume", {})[mode] = {"resumed_from_step": resumed_from,
                                                                   "questions_exact": exact}
    assert exact, (stream.drawn, expected)
    assert (Path(args.output_dir) / "checkpoint-3" / CHECKPOINT_COMPLETE_FILE).exists()


@pytest.fixture(scope="module")
def two_checkpoints(tiny_model_dir, questions_file, tmp_path_factory) -> Path:
    """A run of the tiny model with checkpoints at steps 1 and 2. One turn of 8 tokens: no search is made (a call
    in the last turn is not run), so none is served."""
    out = tmp_path_factory.mktemp("two_checkpoints")
    args = small_config(out, questions_file, "http://127.0.0.1:9/retrieve", max_steps=2, save_strategy="steps",
                        save_steps=1, save_total_limit=None, generator="transformers", max_tokens_per_turn=8,
                        max_turns=1)
    SearchR1Trainer(model=str(tiny_model_dir), args=args).train()
    return Path(args.output_dir)


def _cut(path: Path) -> None:
    with path.open("r+b") as f:
        f.truncate(path.stat().st_size // 2)


CORRUPTIONS = {
    "truncated weights": (lambda c: _cut(c / "model.safetensors"),
                          r"model\.safetensors is truncated \([\d,]+ of the [\d,]+ bytes its header describes\)"),
    "truncated optimizer": (lambda c: _cut(c / "optimizer.pt"),
                            r"optimizer\.pt is not a whole torch file \(truncated\)"),
    "no trainer_state.json": (lambda c: (c / "trainer_state.json").unlink(), r"trainer_state\.json is missing"),
    "no completeness marker": (lambda c: (c / CHECKPOINT_COMPLETE_FILE).unlink(),
                               r"incomplete \(no searchr1_checkpoint_complete: the run stopped while saving it\)"),
}


@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
def test_resume_skips_a_damaged_newest_checkpoint_saying_why_and_refuses_it_by_name(two_checkpoints, tmp_path,
                                                                                   corruption, caplog,
                                                                                   reliability_figures):
    import shutil

    from searchr1_trl.training.checkpoints import resume_checkpoint

    out = tmp_path / "run"
    shutil.copytree(two_checkpoints, out)
    damage, cause = CORRUPTIONS[corruption]
    damage(out / "checkpoint-2")

    for asked in (True, "true", "latest"):
        assert resume_checkpoint(str(out), asked) == str(out / "checkpoint-1")
    reliability_figures.setdefault("resume_past_a_damaged_checkpoint_2", {})[corruption] = \
        Path(resume_checkpoint(str(out), "latest")).name
    assert re.search(f"skipping {re.escape(str(out / 'checkpoint-2'))}: {cause}", caplog.text)
    assert f"resuming from {out / 'checkpoint-1'}, the newest intact checkpoint" in caplog.text
    with pytest.raises(ValueError, match=f"^cannot resume from {re.escape(str(out / 'checkpoint-2'))}: {cause}; "
                                         f"resume from {re.escape(str(out / 'checkpoint-1'))}, the newest intact one"):
        resume_checkpoint(str(out), str(out / "checkpoint-2"))
    assert resume_checkpoint(str(out), str(out / "checkpoint-1")) == str(out / "checkpoint-1")


def test_the_command_line_resumes_from_the_newest_intact_checkpoint_with_true(two_checkpoints, tiny_model_dir,
                                                                             questions_file, tmp_path, caplog):
    import shutil

    from conftest import serve_health

    from searchr1_trl.cli.train import main as train_main

    out = tmp_path / "run"
    shutil.copytree(two_checkpoints, out)
    _cut(out / "checkpoint-2" / "optimizer.pt")
    command = ["--config", "offline", "--model_name_or_path", str(tiny_model_dir), "--output_dir", str(out),
               "--train_data_path", questions_file, "--use_peft", "false", "--generator", "transformers",
               "--max_steps", "2", "--max_turns", "1", "--max_tokens_per_turn", "8", "--save_steps", "1"]
    retriever = serve_health()
    command += ["--search_url", f"http://127.0.0.1:{retriever.server_port}/retrieve"]
    try:
        train_main([*command, "--resume_from_checkpoint", "true"])
        empty = tmp_path / "empty"
        with pytest.raises(SystemExit, match="^" + re.escape(f"error: resume_from_checkpoint='latest', but {empty} "
                                                             "has no checkpoint-* folder to resume from")):
            train_main([*command, "--output_dir", str(empty), "--resume_from_checkpoint", "latest"])
    finally:
        retriever.shutdown()

    assert f"resuming from {out / 'checkpoint-1'}, the newest intact checkpoint" in caplog.text
    state = json.loads((out / "checkpoint-2" / "trainer_state.json").read_text())
    assert state["global_step"] == 2 and len([e for e in state["log_history"] if "loss" in e]) == 2
    assert checkpoint_problem(out / "checkpoint-2") is None  # saved again, whole


@pytest.mark.slow  # starts or uses the real retrieval server
def test_the_weight_sync_folder_is_replaced_when_ours_and_refused_when_not(tiny_model_dir, questions_file,
                                                                          retriever_url, tmp_path, monkeypatch):
    reloads = []  # (folder, its files when the server was told to load it)

    def reload_weights(url, folder, timeout_s):
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


def test_a_row_whose_prompt_leaves_no_room_is_skipped_and_counted_not_fatal(tiny_model_dir, tmp_path,
                                                                            reliability_figures):
    """A question longer than max_rollout_tokens ends its rollouts truncated_prompt_too_long with no completion; TRL
    1.16's parse_response raised AttributeError on it and killed the run. No search is made, so none is served."""
    import pandas as pd

    data = tmp_path / "long.parquet"
    # 600 question tokens: over 512 with any prompt around them, and the rows the trainer scores stay short
    pd.DataFrame({"question": ["Why? " + "very " * 600], "golden_answers": [["yes"]]}).to_parquet(data)
    args = small_config(tmp_path, str(data), "http://127.0.0.1:9/retrieve", generator="transformers",
                        max_rollout_tokens=512)
    trainer = SearchR1Trainer(model=str(tiny_model_dir), args=args)
    trainer.train()

    [logged] = [entry for entry in trainer.state.log_history if "rollout/status_truncated_prompt_too_long" in entry]
    assert logged["rollout/status_truncated_prompt_too_long"] == 1.0 and logged["loss"] == 0.0
    counted = logged["rollout/status_truncated_prompt_too_long"]
    reliability_figures["over_long_row"] = {"steps_trained": trainer.state.global_step,
                                            "counted_prompt_too_long": counted}


# A run holding its output_dir (the hold searchr1-train takes before it loads the model), until killed.
HOLDER = textwrap.dedent("""
    import sys, time
    from searchr1_trl.training.checkpoints import OutputDirLock

    hold = OutputDirLock(sys.argv[1]).acquire()
    print("held", flush=True)
    time.sleep(600)
""")


def test_a_second_run_on_an_output_dir_in_use_is_refused_in_one_line_naming_the_first(tiny_model_dir, tmp_path,
                                                                                      reliability_figures):
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
    reliability_figures["second_run_on_a_held_output_dir"] = stop.value.code.split(" (pid")[0]


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


def test_a_checkpoint_save_that_fails_says_why_in_one_line_and_names_the_intact_one(tiny_model_dir, questions_file,
                                                                                   tmp_path, monkeypatch):
    """A full disk, injected where torch writes the optimizer of checkpoint-2, in torch's own words."""
    import torch

    from searchr1_trl.training.checkpoints import CheckpointSaveError

    save = torch.save

    def disk_full_at_step_2(obj, f, *args, **kwargs):
        if "checkpoint-2" in str(f):
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 4480 vs 4374")
        return save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", disk_full_at_step_2)
    args = small_config(tmp_path, questions_file, "http://127.0.0.1:9/retrieve", max_steps=2, save_strategy="steps",
                        save_steps=1, generator="transformers", max_tokens_per_turn=8, max_turns=1)
    with pytest.raises(CheckpointSaveError) as failure:
        SearchR1Trainer(model=str(tiny_model_dir), args=args).train()

    run = Path(args.output_dir)
    assert re.fullmatch(
        f"saving {re.escape(str(run / 'checkpoint-2'))} failed " + r"\((the disk is full|a write failed), [\d.]+ GiB "
        r"free there\): \[enforce fail at inline_container.cc:672\] \. unexpected pos 4480 vs 4374; checkpoint-1 is "
        r"intact: free space, then resume with --resume_from_checkpoint latest", str(failure.value)), failure.value
    assert checkpoint_problem(run / "checkpoint-1") is None
