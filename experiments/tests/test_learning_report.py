"""The learning benchmark's report (experiments/learning.py) sets variants' speed and EM side by side."""

import json

import pytest

from experiments.learning import failures, pool, report


def finished_run(out, variant, seed, runtime, em_last, report_sample=True, steps=30, side_by_side=None):
    folder = out / f"{variant}_s{seed}"
    folder.mkdir(parents=True)
    command = {"variant": variant, "flags": "", "seed": seed, "command": []}
    if side_by_side is not None:  # runs launched before the count was recorded have none
        command["side_by_side"] = side_by_side
    (folder / "command.json").write_text(json.dumps(command))
    (folder / "summary.json").write_text(json.dumps({
        "steps": steps, "train_runtime_s": runtime, "best_step": steps,
        "evals": [{"step": 0, "eval_em": 0.40, **({"report_em": 0.40} if report_sample else {})},
                  {"step": steps, "eval_em": 0.45, **({"report_em": em_last} if report_sample else {})}]}))


def test_the_report_gives_each_variants_train_runtime_and_report_em_and_the_speedup_over_the_baseline(tmp_path,
                                                                                                   capsys):
    for seed, (sync_s, async_s) in enumerate([(160.0, 82.0), (158.0, 80.0), (162.0, 78.0)]):
        finished_run(tmp_path, "sync", seed, sync_s, 0.44)
        finished_run(tmp_path, "async", seed, async_s, 0.43)
    table = report(tmp_path, baseline="sync")
    assert table["sync"]["train_runtime_s"]["mean"] == 160.0 and table["async"]["train_runtime_s"]["mean"] == 80.0
    assert table["async"]["last"]["mean"] == 0.43
    printed = capsys.readouterr().out
    assert ("| async | `` | report | 0 1 2 | 0.400 ± 0.000 (min 0.400) | 0.430 ± 0.000 (min 0.430) | "
            "0.430 ± 0.000 (min 0.430) | "
            "+0.030 ± 0.000 (min +0.030) | +0.030 ± 0.000 (min +0.030) | "
            "+0.030 ± 0.000 (min +0.030) to EM 0.430 at step 30, seeds 0 1 2 | "
            "80.0 | 2.00x |") in printed
    assert ("| sync | `` | report | 0 1 2 | 0.400 ± 0.000 (min 0.400) | 0.440 ± 0.000 (min 0.440) | "
            "0.440 ± 0.000 (min 0.440) | "
            "+0.040 ± 0.000 (min +0.040) | +0.040 ± 0.000 (min +0.040) | "
            "+0.040 ± 0.000 (min +0.040) to EM 0.440 at step 30, seeds 0 1 2 | "
            "160.0 | 1.00x |") in printed
    assert json.loads((tmp_path / "learning.json").read_text())["variants"]["async"]["train_runtime_s"]["n"] == 3


def test_the_report_splits_each_runs_steps_and_shows_a_compile_warm_up_apart_from_its_steady_state(tmp_path,
                                                                                                    capsys):
    finished_run(tmp_path, "compiled", 0, 100.0, 0.44)
    finished_run(tmp_path, "eager", 0, 100.0, 0.44)
    # TRL logs step_time per optimizer step and evaluations on rows of their own, which the split skips.
    rows = ["step,step_time,generate_and_score/time_s,train/peak_memory_gib,eval_em", "0,,,,0.40",
            "1,30.0,4.0,20.5,", "2,12.0,4.0,31.25,", "3,6.0,4.0,19.0,", "4,5.0,4.0,19.0,", "4,,,,0.45"]
    (tmp_path / "compiled_s0" / "log_history.csv").write_text("\n".join(rows) + "\n")
    finished_run(tmp_path, "older", 0, 100.0, 0.44)  # logged before TRL timed generate_and_score
    (tmp_path / "older_s0" / "log_history.csv").write_text("step,step_time,eval_em\n1,30.0,\n2,12.0,\n")
    report(tmp_path)
    printed = capsys.readouterr().out
    # update = step - generate_and_score: 26, 8, 2, 1; first half's median 17, second half's 1.5
    assert "| compiled_s0 | 4 | 13.25 | 4.00 | 9.25 | 17.00 | 1.50 | 31.2 |" in printed  # the largest step's peak
    split = printed.split("| run | steps |")[1]
    assert "eager_s0 |" not in split and "older_s0 |" not in split  # no log, or no split in it: no row


def test_the_report_gives_how_each_runs_training_rollouts_ended(tmp_path, capsys):
    finished_run(tmp_path, "repair", 0, 100.0, 0.44)
    finished_run(tmp_path, "older", 0, 100.0, 0.44)  # no log: no row
    rows = ["step,rollout/status_done,rollout/status_error_parse,eval_em", "0,,,0.40",
            "1,0.90,0.10,", "2,0.94,0.06,", "3,0.98,0.02,", "4,1.00,0.00,", "4,,,0.45"]
    (tmp_path / "repair_s0" / "log_history.csv").write_text("\n".join(rows) + "\n")
    report(tmp_path)
    printed = capsys.readouterr().out
    assert "| run | steps | done | error_parse | error_parse, first half | error_parse, second half |" in printed
    assert "| repair_s0 | 4 | 0.955 | 0.045 | 0.080 | 0.010 |" in printed
    assert "| older_s0 |" not in printed.split("| error_parse, second half |")[1]


def test_the_report_gives_each_runs_worst_step_of_drift(tmp_path, capsys):
    finished_run(tmp_path, "async", 0, 100.0, 0.0, steps=3)
    finished_run(tmp_path, "sync", 0, 100.0, 0.44, steps=3)
    finished_run(tmp_path, "older", 0, 100.0, 0.44)  # no log: no row
    # the H100 collapse's shape: the weights fall, then the KL jumps and rollouts stop parsing
    rows = ["step,kl,async/importance_weight_mean,async/behaviour_kl_max,async/negative_zeroed,"
            "async/off_policy_masked,rollout/status_error_parse,async/skipped_divergent,eval_em", "0,,,,,,,,0.40",
            "1,0.0001,0.99,0.001,0.0,0.0,0.0,0.0,", "2,0.165,0.61,0.02,0.1,0.25,0.02,1.0,",
            "3,10170,0.054,0.09,0.0,0.5,0.64,0.0,", "3,,,,,,,,0.0"]
    (tmp_path / "async_s0" / "log_history.csv").write_text("\n".join(rows) + "\n")
    (tmp_path / "sync_s0" / "log_history.csv").write_text(
        "step,kl,rollout/status_error_parse\n1,0.0,0.03\n2,0.05,0.0\n3,0.01,0.01\n")
    report(tmp_path)
    drift = capsys.readouterr().out.split("| run | steps | KL to the reference, max |")[1]
    assert ("| async_s0 | 3 | 1.02e+04 (step 3) | 0.054 (step 3) | 0.09 (step 3) | 0.1 (step 2) | 0.64 (step 3) | "
            "0.250 | 2 |") in drift
    assert "| sync_s0 | 3 | 0.05 (step 2) | - | - | - | 0.03 (step 1) | - | - |" in drift
    assert "older_s0" not in drift


def test_a_run_the_collapse_guard_stopped_early_gets_no_speedup_from_its_fewer_steps(tmp_path, capsys):
    finished_run(tmp_path, "sync", 0, 288.0, 0.36)
    finished_run(tmp_path, "async", 0, 172.0, 0.0, steps=10)  # H100, 2026-12-05: stopped at step 10, EM 0
    report(tmp_path, baseline="sync")
    printed = capsys.readouterr().out
    assert "| 172.0 | - (10 steps, the baseline 30) |" in printed
    assert "| 288.0 | 1.00x |" in printed


def test_runs_that_shared_the_gpu_with_more_jobs_than_the_baseline_get_no_speedup(tmp_path, capsys):
    # 2026-12-03/05, one H200: lock-step in a batch of six runs, async_safe in a batch of three two days later
    for seed in range(3):
        finished_run(tmp_path, "sync_ipc", seed, 700.0, 0.38, steps=50, side_by_side=6)
        finished_run(tmp_path, "async_safe", seed, 488.5, 0.38, steps=50, side_by_side=3)
        finished_run(tmp_path, "async_old", seed, 703.0, 0.36, steps=50)
    report(tmp_path, baseline="sync_ipc")
    printed = capsys.readouterr().out
    assert "| 488.5 | - (3 runs on the GPU, the baseline's 6) |" in printed
    assert "| 703.0 | - (unrecorded runs on the GPU, the baseline's 6) |" in printed
    assert "| 700.0 | 1.00x |" in printed


def test_a_baseline_that_has_not_run_yet_leaves_the_speedup_out(tmp_path, capsys):
    finished_run(tmp_path, "async", 0, 80.0, 0.43)
    report(tmp_path, baseline="sync")
    printed = capsys.readouterr().out
    assert ("| async | `` | report | 0 | 0.400 ± - (min 0.400) | 0.430 ± - (min 0.430) | 0.430 ± - (min 0.430) | "
            "+0.030 ± - (min +0.030) | +0.030 ± - (min +0.030) | "
            "+0.030 ± - (min +0.030) to EM 0.430 at step 30, seeds 0 | 80.0 | - |") in printed
    assert "no speedup: the baseline variant 'sync' has no finished run here (async)" in printed


def test_learning_variants_compared_without_a_baseline_get_no_speedup(tmp_path, capsys):
    finished_run(tmp_path, "base", 0, 160.0, 0.44)
    finished_run(tmp_path, "steps60", 0, 300.0, 0.45)
    report(tmp_path)
    printed = capsys.readouterr().out
    assert ("| base | `` | report | 0 | 0.400 ± - (min 0.400) | 0.440 ± - (min 0.440) | 0.440 ± - (min 0.440) | "
            "+0.040 ± - (min +0.040) | +0.040 ± - (min +0.040) | "
            "+0.040 ± - (min +0.040) to EM 0.440 at step 30, seeds 0 | 160.0 | - |") in printed
    assert ("| steps60 | `` | report | 0 | 0.400 ± - (min 0.400) | 0.450 ± - (min 0.450) | 0.450 ± - (min 0.450) | "
            "+0.050 ± - (min +0.050) | +0.050 ± - (min +0.050) | "
            "+0.050 ± - (min +0.050) to EM 0.450 at step 30, seeds 0 | 300.0 | - |") in printed
    assert "no speedup" not in printed


def test_runs_without_a_report_sample_are_read_on_validation_and_say_so(tmp_path, capsys):
    finished_run(tmp_path, "sync", 0, 134.0, 0.43, report_sample=False)
    table = report(tmp_path)
    assert table["sync"]["sample"] == "validation" and table["sync"]["gain_last"]["mean"] == 0.05
    assert "| sync | `` | 0 | validation | 0.400 | 0.450 | 0.450 (30) | +0.050 |" in capsys.readouterr().out


def test_with_the_report_sample_at_the_ends_only_chosen_is_the_saved_models_report_em(tmp_path, capsys):
    # report_at ends, as scripts/offline_job.py writes the summary: the report EM at step 0, at step 30 and on the
    # step-20 model the run ended on (rolled out after training, joined to step 20's validation)
    folder = tmp_path / "ends_s0"
    folder.mkdir()
    (folder / "command.json").write_text(json.dumps({"variant": "ends", "flags": "", "seed": 0, "command": []}))
    (folder / "summary.json").write_text(json.dumps({"steps": 30, "train_runtime_s": 90.0, "best_step": 20, "evals": [
        {"step": 0, "eval_em": 0.40, "report_em": 0.38}, {"step": 10, "eval_em": 0.42},
        {"step": 20, "eval_em": 0.50, "report_em": 0.44}, {"step": 30, "eval_em": 0.43, "report_em": 0.41}],
        "fixed_costs": {"startup_s": 61.2, "warm_start_s": 30.5, "first_validation_s": 9.1, "validations": 4,
                        "validation_s": 27.3, "saved_report_s": 4.4}}))
    table = report(tmp_path)
    run = json.loads((tmp_path / "learning.json").read_text())["runs"][0]
    assert run["em"] == {"start": 0.38, "last": 0.41, "chosen": 0.44}
    assert run["em_by_step"] == {"0": 0.38, "20": 0.44, "30": 0.41}, "no figure where the sample was not rolled out"
    assert table["ends"]["gain_chosen"]["mean"] == 0.06
    printed = capsys.readouterr().out
    assert "| ends | `` | 0 | report | 0.380 | 0.410 | 0.440 (20) | +0.030 | +0.060 |" in printed
    assert "| ends_s0 | 61.2 | 30.5 | 4 | 27.3 | 4.4 | 90.0 |" in printed, "where the time outside the steps went"


def test_a_run_cut_short_is_read_to_its_newest_checkpoint_and_kept_out_of_the_means(tmp_path, capsys):
    finished_run(tmp_path, "ans0", 0, 300.0, 0.44)
    folder = tmp_path / "ans0_s1"
    folder.mkdir()
    (folder / "command.json").write_text(json.dumps({"variant": "ans0", "flags": "", "seed": 1, "command": []}))
    history = [{"step": 0, "eval_em": 0.20, "report_em": 0.18}, {"step": 5, "rollout/searches_per_rollout": 0.9},
               {"step": 10, "eval_em": 0.30, "report_em": 0.28}, {"step": 20, "eval_em": 0.33, "report_em": 0.31}]
    for step, entries in [(9, history[:2]), (20, history)]:  # the newest by step, not by name, is read
        (folder / f"checkpoint-{step}").mkdir()
        (folder / f"checkpoint-{step}" / "trainer_state.json").write_text(json.dumps(
            {"global_step": step, "best_global_step": 10, "log_history": entries}))
    (tmp_path / "ans0_s2").mkdir()  # started, never evaluated
    (tmp_path / "ans0_s2" / "command.json").write_text(json.dumps({"variant": "ans0", "flags": "", "seed": 2,
                                                                    "command": []}))
    table = report(tmp_path)
    assert table["ans0"]["seeds"] == [0] and table["ans0"]["unfinished"] == ["ans0_s1", "ans0_s2"]
    assert table["ans0"]["last"]["mean"] == 0.44
    cut = json.loads((tmp_path / "learning.json").read_text())["runs"][1]
    assert (cut["finished"], cut["steps"], cut["em"], cut["train_searches_by_step"]) == (
        False, 20, {"start": 0.18, "last": 0.31, "chosen": 0.28}, {"5": 0.9})
    printed = capsys.readouterr().out
    assert ("| ans0 | `` | 1 | report (unfinished: evaluated to step 20) | 0.180 | 0.310 | 0.280 (10) | +0.130 |"
            in printed)
    assert "| ans0 | `` | 2 | unfinished |" in printed


def test_seeds_cut_short_are_compared_with_the_rest_at_the_newest_step_all_reached(tmp_path, capsys):
    for seed, ems in enumerate([(0.34, 0.39, 0.41), (0.32, 0.38, None), (0.36, 0.40, None)]):
        folder = tmp_path / f"kl_s{seed}"
        folder.mkdir()
        (folder / "command.json").write_text(json.dumps({"variant": "kl", "flags": "", "seed": seed, "command": []}))
        evals = [{"step": step, "eval_em": em, "report_em": em}
                 for step, em in zip((0, 50, 60), ems, strict=True) if em]
        if seed == 0:
            (folder / "summary.json").write_text(json.dumps({"steps": 60, "best_step": 60, "evals": evals}))
        else:  # the machine was taken back during the step-60 evaluation
            (folder / "checkpoint-50").mkdir()
            (folder / "checkpoint-50" / "trainer_state.json").write_text(json.dumps(
                {"global_step": 50, "best_global_step": 50, "log_history": evals}))
    table = report(tmp_path)
    assert table["kl"]["seeds"] == [0] and table["kl"]["unfinished"] == ["kl_s1", "kl_s2"]
    assert (table["kl"]["common_step"], table["kl"]["common_seeds"]) == (50, [0, 1, 2])
    assert table["kl"]["gain_common"] == {"mean": 0.05, "sd": 0.01, "min": 0.04, "n": 3}
    assert table["kl"]["em_common"]["mean"] == 0.39
    assert "| +0.050 ± 0.010 (min +0.040) to EM 0.390 at step 50, seeds 0 1 2 | - | - |" in capsys.readouterr().out


def test_one_recipes_runs_from_two_batches_are_pooled_at_one_step(tmp_path, capsys):
    for seed, em_last in enumerate([0.46, 0.44]):
        finished_run(tmp_path / "batch1", "kl", seed, 100.0, em_last)
    finished_run(tmp_path / "batch2", "sync", 0, 100.0, 0.42)
    finished_run(tmp_path / "batch2", "async", 0, 100.0, 0.10)  # another variant of that batch: left out
    pooled = pool([f"{tmp_path / 'batch1'}:kl", f"{tmp_path / 'batch2'}:sync"], step=30)
    assert pooled["gain"] == {"mean": 0.04, "sd": 0.02, "min": 0.02, "n": 3}
    assert pooled["em"]["mean"] == 0.44
    printed = capsys.readouterr().out
    assert f"| {tmp_path / 'batch2'}/sync_s0 | report | 0.400 | 0.420 | +0.020 |" in printed
    assert "3 runs at step 30: gain +0.040 ± 0.020 (min +0.020), EM 0.440 ± 0.020 (min 0.420)" in printed
    with pytest.raises(SystemExit, match="sync_s0 was not evaluated at step 20"):
        pool([f"{tmp_path / 'batch2'}:sync"], step=20)
    # A run the guard stopped at step 30 counts at step 50 with the checkpoint it ended on (step 10 here).
    stopped = tmp_path / "batch2" / "sync_s0" / "summary.json"
    summary = json.loads(stopped.read_text())
    summary["best_step"] = 10
    summary["evals"].insert(1, {"step": 10, "eval_em": 0.47, "report_em": 0.41})
    stopped.write_text(json.dumps(summary))
    assert pool([f"{tmp_path / 'batch2'}:sync"], step=50)["em"]["mean"] == 0.41
    assert "| 0.410 (guard stop at step 30, ended on step 10) | +0.010 |" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="has no evaluated run of variant 'kl'"):
        pool([f"{tmp_path / 'batch2'}:kl"], step=30)


def test_failures_counts_each_refused_turn_by_kind_and_what_closing_calls_would_read(tmp_path, offline_assets,
                                                                                     capsys):
    call = '<tool_call>\n{"name": "search", "arguments": {"query": "q"}}\n'
    texts = [call + "<tool_call>", call + "\u0e2a\u0e27\u0e31\u0e2a", call + "search</tool_call>",
             "</tool_call>\n" + call.removeprefix("<tool_call>\n") + "<tool_call>", "Paris"]
    for name, kept in (("a_s0", texts), ("a_s1", texts[:1])):
        (tmp_path / name).mkdir()
        (tmp_path / name / "parse_failures.jsonl").write_text(
            "".join(json.dumps({"step": 0, "question": "q", "turn": 1, "text": text}) + "\n" for text in kept))

    table = failures([tmp_path / "a_s0", tmp_path / "a_s1"], offline_assets.model)

    assert table["a_s0"] == {"turns": 5, "whole call, then <tool_call>": 1, "whole call, then other text": 2,
                             "a slip before or inside the JSON": 1, "no block": 1, "closed": 3}
    assert table["all"]["turns"] == 6 and table["all"]["closed"] == 4
    assert "| all | 6 | 2 | 2 | 1 | 1 | 4 |" in capsys.readouterr().out
    finished_run(tmp_path, "clean", 0, 100.0, 0.45)  # a finished run that refused no turn has no file
    assert failures([tmp_path / "clean_s0"], offline_assets.model)["clean_s0"]["turns"] == 0
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit, match=r"empty is no finished run"):
        failures([tmp_path / "empty"], offline_assets.model)
