"""The learning benchmark: what GRPO adds to the warm start, over several seeds run side by side on one GPU.

    python -m experiments.learning run --out runs/learning --seeds 0 1 2 --variant guard= \\
        --variant kl="--beta 0.04" [--gpu 0] [--kv_cache_gib 3]     # every variant x every seed, all at once
    python -m experiments.learning report runs/learning              # the table again, from the runs' summary.json
    python -m experiments.learning pool --step 50 runs/a:kl runs/b:sync  # one recipe's runs from several batches
    python -m experiments.learning failures runs/learning/*_s0           # refused training turns, by kind
    # synchronous against asynchronous rollouts, speed and EM in one table: one batch of seeds per mode (equal GPU
    # sharing within a batch), both into the same --out
    python -m experiments.learning run --out runs/async --seeds 0 1 2 --variant sync=
    python -m experiments.learning run --out runs/async --seeds 0 1 2 --baseline sync \
        --variant async="--async_rollouts true --max_staleness 1"

Each run is ``scripts/offline_job.py --config offline_gpu --corpus full`` with ``--seed S --data_seed S`` and the
variant's recipe flags, on its own ports, its vLLM server with a fixed KV cache (``--generator_kv_cache_gib``) so
servers starting together do not size their caches off each other. Figures come from the **report sample**
(``report_num_samples`` questions disjoint from the validation sample the collapse guard chooses on): per seed the
warm start alone (step 0), the last step, and the checkpoint the run ended on; per variant mean, standard deviation
and minimum of the gains over the warm start, beside the mean ``train_runtime`` and, with ``--baseline``, its speedup
over that variant (a speed comparison; learning variants that change the work per step have none), and per run the
time outside its steps (start-up, warm start, validations). ``report`` writes ``learning.json`` and prints Markdown
tables.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

from searchr1_trl.assets.offline import MODEL, cache_dir
from searchr1_trl.engine.parsing import response_parser, tool_call_end
from searchr1_trl.engine.transcript import close_tool_call
from searchr1_trl.tasks.search_r1.env import SEARCH_TOOL

ROOT = Path(__file__).resolve().parent.parent


def run_name(variant: str, seed: int) -> str:
    return f"{variant}_s{seed}"


# The update the recipe uses when runs share one GPU: its fast update (2 micro-batches of 32, no activation
# checkpointing, compiled) peaks near 55 GiB a trainer, so several side by side take 16 checkpointed micro-batches of 4.
# A variant's own flags come after these and win.
SHARED_GPU_UPDATE = ("--per_device_train_batch_size 4 --gradient_accumulation_steps 16 --activation_checkpointing true "
                     "--compile_layers false")


def launch(args) -> None:
    variants = dict(v.split("=", 1) if "=" in v else (v, "") for v in args.variant)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    jobs = []
    grid = [(variant, flags, seed) for variant, flags in variants.items() for seed in args.seeds]
    if len(grid) > 1 or args.shared_gpu:
        grid = [(variant, f"{SHARED_GPU_UPDATE} {flags}", seed) for variant, flags, seed in grid]
    for i, (variant, flags, seed) in enumerate(grid):
        folder = out / run_name(variant, seed)
        port = args.base_port + 10 * i
        command = [
            sys.executable, str(ROOT / "scripts" / "offline_job.py"), "--config", args.config, "--corpus", "full",
            "--output_dir", str(folder), "--generator_gpus", args.gpu, "--trainer_gpus", args.gpu,
            "--retriever_gpus", args.gpu, "--search_url", f"http://127.0.0.1:{port}/retrieve",
            "--vllm_server_base_url", f"http://127.0.0.1:{port + 1}",
            "--vllm_gpu_memory_utilization", str(args.gpu_memory_utilization),
            "--generator_kv_cache_gib", str(args.kv_cache_gib),
            *(["--generator_enforce_eager", "true"] if args.eager else []),
            "--seed", str(seed), "--data_seed", str(seed), *shlex.split(flags),
        ]
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "command.json").write_text(json.dumps({"variant": variant, "flags": flags, "seed": seed,
                                                          "side_by_side": len(grid), "command": command}))
        log = open(folder / "job.log", "w")  # noqa: SIM115 - held open for the job's lifetime
        jobs.append((folder, subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)))
        time.sleep(args.stagger_s)  # the index builds and model loads overlap less
    failed = [str(folder) for folder, job in jobs if job.wait() != 0]
    report(out, args.baseline)
    if failed:
        sys.exit(f"error: {len(failed)} of {len(jobs)} runs failed: {', '.join(failed)} (see their job.log)")


def _spread(values: list[float]) -> dict[str, float | None]:
    return {"mean": round(statistics.mean(values), 4) if values else None,
            "sd": round(statistics.stdev(values), 4) if len(values) > 1 else None,
            "min": round(min(values), 4) if values else None, "n": len(values)}


def _spread_text(value: dict, sign: str = "") -> str:
    """``_spread``'s figures as the results write them, "mean ± sd (min m)"; ``sign`` "+" for gains."""
    if value["mean"] is None:
        return "-"
    sd = "-" if value["sd"] is None else f"{value['sd']:.3f}"
    return f"{value['mean']:{sign}.3f} ± {sd} (min {value['min']:{sign}.3f})"


def runs(out: Path) -> list[dict]:
    """One record per run under ``out``: EM at the warm start, the last step and the checkpoint the run ended on, with
    what the agent learned there. EM is on the report sample; a run without one (``report_num_samples 0``, e.g. a quick
    mechanics run) is read on its validation sample and marked so. A run cut short (its machine taken back) has no
    ``summary.json``: it is read up to its newest checkpoint's ``trainer_state.json`` and marked unfinished."""
    records = []
    for folder in sorted(p for p in out.iterdir() if (p / "command.json").exists()):
        meta = {**json.loads((folder / "command.json").read_text()), "run": folder.name}
        summary_file = folder / "summary.json"
        if summary_file.exists():
            summary = json.loads(summary_file.read_text())
            records.append({**_record(meta, True, summary["evals"], summary["steps"], summary.get("best_step"),
                                      summary.get("train_runtime_s"), summary.get("train_searches_by_step")),
                            "fixed_costs": summary.get("fixed_costs")})  # None: a run from before they were kept
            continue
        states = sorted(folder.glob("checkpoint-*/trainer_state.json"), key=lambda f: int(f.parent.name.split("-")[1]))
        state = json.loads(states[-1].read_text()) if states else {}
        evals = [e for e in state.get("log_history", []) if "eval_em" in e]
        if not evals:
            records.append({**meta, "finished": False, "steps": None})
            continue
        searches = {e["step"]: e["rollout/searches_per_rollout"] for e in state["log_history"]
                    if "rollout/searches_per_rollout" in e}
        records.append(_record(meta, False, evals, state["global_step"], state.get("best_global_step"), None,
                               searches))
    return records


def _record(meta: dict, finished: bool, evals: list[dict], steps: int, best_step: int | None,
            runtime: float | None, train_searches: dict | None) -> dict:
    by_step = {e["step"]: e for e in evals}
    start = by_step[min(by_step)]
    prefix = "report" if start.get("report_em") is not None else "eval"
    # with report_at ends the report sample has figures at the ends only (the saved model's joined to its step)
    scored = [step for step, e in by_step.items() if e.get(f"{prefix}_em") is not None]
    last = by_step[max(scored)]
    chosen = by_step.get(best_step, last)
    learned = ("searches_per_rollout", "second_query_rate", "first_search_missed", "em_first_search_missed")
    return {
        **meta, "finished": finished, "steps": steps, "train_runtime_s": runtime, "best_step": best_step,
        "sample": "report" if prefix == "report" else "validation",
        "em": {"start": start.get(f"{prefix}_em"), "last": last.get(f"{prefix}_em"),
               "chosen": chosen.get(f"{prefix}_em")},
        "last_step": last["step"],
        "em_by_step": {step: by_step[step][f"{prefix}_em"] for step in scored},
        "eval_em": {"start": start.get("eval_em"), "last": last.get("eval_em"), "chosen": chosen.get("eval_em")},
        "learned": {key: chosen.get(f"{prefix}_{key}") for key in learned},
        "learned_start": {key: start.get(f"{prefix}_{key}") for key in learned},
        "train_searches_by_step": train_searches,
    }


def _common_step(evaluated: list[dict]) -> dict:
    """GRPO's gain at the newest step every seed was evaluated at, cut-short runs included: seeds compared at one step
    when a machine was taken back before some finished (or the guard stopped one early)."""
    steps = set.intersection(*(set(r["em_by_step"]) for r in evaluated)) if evaluated else set()
    if not steps:
        return {"common_step": None, "common_seeds": [], "gain_common": _spread([]), "em_common": _spread([])}
    step = max(steps)
    return {"common_step": step, "common_seeds": [r["seed"] for r in evaluated],
            "gain_common": _spread([r["em_by_step"][step] - r["em"]["start"] for r in evaluated]),
            "em_common": _spread([r["em_by_step"][step] for r in evaluated])}


def report(out: Path, baseline: str | None = None) -> dict:
    records = runs(out)
    table = {}
    for variant in dict.fromkeys(r["variant"] for r in records):
        done = [r for r in records if r["variant"] == variant and r["finished"] and r["em"]["start"] is not None]
        gains_last = [r["em"]["last"] - r["em"]["start"] for r in done]
        gains_chosen = [r["em"]["chosen"] - r["em"]["start"] for r in done if r["em"]["chosen"] is not None]
        table[variant] = {
            "flags": next(r["flags"] for r in records if r["variant"] == variant),
            "sample": "/".join(dict.fromkeys(r["sample"] for r in done)) or "-",
            "seeds": [r["seed"] for r in done], "unfinished": [r["run"] for r in records
                                                               if r["variant"] == variant and not r["finished"]],
            "warm_start": _spread([r["em"]["start"] for r in done]),
            "last": _spread([r["em"]["last"] for r in done]),
            "chosen": _spread([r["em"]["chosen"] for r in done if r["em"]["chosen"] is not None]),
            "gain_last": _spread(gains_last), "gain_chosen": _spread(gains_chosen),
            "train_runtime_s": _spread([r["train_runtime_s"] for r in done if r["train_runtime_s"] is not None]),
            "steps": sorted({r["steps"] for r in done}),
            "side_by_side": sorted({r.get("side_by_side") for r in done}, key=str),
            **_common_step([r for r in records if r["variant"] == variant and "em" in r]),
        }
    (out / "learning.json").write_text(json.dumps({"variants": table, "runs": records}, indent=2))
    def fmt(value, digits=3):
        return "-" if value is None else f"{value:.{digits}f}"

    print("| variant | flags | seed | sample | warm start | last step | chosen (step) | gain last | gain chosen | "
          "searches | 2nd query | EM when 1st search missed | train_runtime s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in records:
        if "em" not in r:
            print(f"| {r['variant']} | `{r['flags']}` | {r['seed']} | unfinished | | | | | | | | | |")
            continue
        em, learned = r["em"], r["learned"]
        sample = r["sample"] if r["finished"] else f"{r['sample']} (unfinished: evaluated to step {r['last_step']})"
        gain_chosen = "-" if em["chosen"] is None else f"{em['chosen'] - em['start']:+.3f}"
        print(f"| {r['variant']} | `{r['flags']}` | {r['seed']} | {sample} | {fmt(em['start'])} | "
              f"{fmt(em['last'])} | {fmt(em['chosen'])} ({r['best_step']}) | {em['last'] - em['start']:+.3f} | "
              f"{gain_chosen} | {fmt(learned['searches_per_rollout'])} | "
              f"{fmt(learned['second_query_rate'])} | {fmt(learned['em_first_search_missed'])} | "
              f"{fmt(r['train_runtime_s'], 1)} |")
    print()
    print(variant_table(table, baseline))
    for split in (step_split(out), fixed_cost_split(records), rollout_endings(out), drift(out)):
        if split:
            print()
            print(split)
    return table


def fixed_cost_split(records: list[dict]) -> str:
    """Where each finished run's time outside its optimizer steps went (``summary.json``'s ``fixed_costs``): one
    Markdown row per run with its start-up (process start to the first step: warm start and step-0 validation
    included), the warm start, the validations' count and seconds, and the saved model's report rolled out after
    training (outside ``train_runtime``). "" when no run has them."""
    lines = []
    for r in records:
        costs = r.get("fixed_costs")
        if costs:
            cells = [costs[key] for key in ("startup_s", "warm_start_s", "validations", "validation_s",
                                            "saved_report_s")]
            lines.append(f"| {r['run']} | " + " | ".join("-" if c is None else str(c) for c in cells) +
                         f" | {'-' if r['train_runtime_s'] is None else r['train_runtime_s']} |")
    if not lines:
        return ""
    return "\n".join(["| run | start-up s | warm start s | validations | validation s | saved model's report s | "
                      "train_runtime s |", "| --- " * 7 + "|", *lines])


def rollout_endings(out: Path) -> str:
    """How each run's training rollouts ended, from its ``log_history.csv``: one Markdown row per run with the mean
    over its steps of each ``rollout/status_*`` fraction any run logged (done, error_parse, truncated_*, ...), the
    first-half and second-half means of ``error_parse`` beside them: a lever on the parser (``repair``) shows here
    first. "" when no run logged them."""
    runs_logged = dict(_logged_steps(out, "rollout/status_done"))
    statuses = sorted({key for rows in runs_logged.values() for key in rows[0] if key.startswith("rollout/status_")})
    if not statuses:
        return ""

    def mean(rows: list[dict], key: str) -> str:
        values = [float(row[key]) for row in rows if row.get(key)]
        return f"{statistics.mean(values):.3f}" if values else "-"

    lines = []
    for name, rows in runs_logged.items():
        half = len(rows) // 2
        parse = "rollout/status_error_parse"
        lines.append(f"| {name} | {len(rows)} | " + " | ".join(mean(rows, key) for key in statuses) +
                     f" | {mean(rows[:half], parse)} | {mean(rows[half:], parse)} |")
    names = [key.removeprefix("rollout/status_") for key in statuses]
    return "\n".join([f"| run | steps | {' | '.join(names)} | error_parse, first half | error_parse, second half |",
                      "| --- " * (len(names) + 4) + "|", *lines])


def step_split(out: Path) -> str:
    """Where each run's optimizer steps went, from its ``log_history.csv``: one Markdown row per run with the mean
    step, TRL's ``generate_and_score`` (push, rollouts, rewards, old log-probs) and the policy update (the rest of
    TRL's ``step_time``: loss and backward), the update as the median over the first and the second half of the
    steps apart, so a lever that compiles (``compile_layers``) shows its warm-up and its steady state separately,
    and the trainer process's peak GPU memory over the run (``train/peak_memory_gib``; "-" where not logged).
    "" when no run has the file."""
    lines = []
    # runs logged before TRL timed generate_and_score have no split to show
    for name, steps in _logged_steps(out, "step_time", "generate_and_score/time_s"):
        total = [float(row["step_time"]) for row in steps]
        prepare = [float(row["generate_and_score/time_s"]) for row in steps]
        update = [t - g for t, g in zip(total, prepare, strict=True)]
        half = len(update) // 2
        first = f"{statistics.median(update[:half]):.2f}" if half else "-"
        peaks = [float(row["train/peak_memory_gib"]) for row in steps if row.get("train/peak_memory_gib")]
        lines.append(f"| {name} | {len(steps)} | {statistics.mean(total):.2f} | "
                     f"{statistics.mean(prepare):.2f} | {statistics.mean(update):.2f} | {first} | "
                     f"{statistics.median(update[half:]):.2f} | " + (f"{max(peaks):.1f} |" if peaks else "- |"))
    if not lines:
        return ""
    return "\n".join(["| run | steps | step s | generate and score s | policy update s | update, median of the "
                      "first half s | update, median of the second half s | trainer's peak GPU memory GiB |",
                      "| --- " * 8 + "|", *lines])


# The drift table's columns: a logged metric, whether its worst step is its largest or smallest value, its header.
DRIFT = (("kl", max, "KL to the reference, max"),
         ("async/importance_weight_mean", min, "importance weight mean, min"),
         ("async/behaviour_kl_max", max, "behaviour gap of a rollout, max"),
         ("async/negative_zeroed", max, "negative tokens zeroed, max"),
         ("rollout/status_error_parse", max, "error_parse, max"))


def drift(out: Path) -> str:
    """How far each run's policy went, from its ``log_history.csv``: one Markdown row per run with the worst step of
    each sign of drift in :data:`DRIFT` (value and step) and the mean fraction of rollouts TRL's off-policy mask
    dropped, and the steps ``max_behaviour_kl`` skipped. A collapse shows as one of them jumping; lock-step runs
    have "-" in the async columns. "" when no run logged a KL."""
    lines = []
    for name, rows in _logged_steps(out, "kl"):
        cells = []
        for key, worst, _ in DRIFT:
            logged = [(float(row[key]), row["step"]) for row in rows if row.get(key)]
            if logged:
                value, step = worst(logged, key=lambda pair: pair[0])
            cells.append(f"{value:.3g} (step {step})" if logged else "-")
        masked = [float(row["async/off_policy_masked"]) for row in rows if row.get("async/off_policy_masked")]
        cells.append(f"{statistics.mean(masked):.3f}" if masked else "-")
        skipped = [row["step"] for row in rows if float(row.get("async/skipped_divergent") or 0)]
        cells.append(" ".join(skipped) if skipped else "-")
        lines.append(f"| {name} | {len(rows)} | " + " | ".join(cells) + " |")
    if not lines:
        return ""
    headers = [header for _, _, header in DRIFT] + ["off-policy masked, mean", "steps skipped (max_behaviour_kl)"]
    return "\n".join([f"| run | steps | {' | '.join(headers)} |", "| --- " * (len(headers) + 2) + "|", *lines])


def _logged_steps(out: Path, *keys: str):
    """``(run, rows)`` for each run folder in ``out`` with a ``log_history.csv``: its rows that have every one of
    ``keys`` (TRL logs steps and evaluations on rows of their own); runs with none are left out."""
    for folder in sorted(p for p in out.iterdir() if (p / "log_history.csv").exists()):
        with open(folder / "log_history.csv", newline="") as f:
            rows = [row for row in csv.DictReader(f) if all(row.get(key) for key in keys)]
        if rows:
            yield folder.name, rows


def pool(sources: list[str], step: int) -> dict:
    """One recipe's runs from several batches, each source ``FOLDER:VARIANT``, compared at ``step``: per run the warm
    start and the EM there (report sample), then the gain's and the EM's mean (sd, min) over all of them. A figure
    over more seeds than one batch holds, reproducible from the runs' files. A run the collapse guard stopped before
    ``step`` counts at the checkpoint it ended on (it has no later model), and the row says so."""
    records = []
    for source in sources:
        folder, _, variant = source.rpartition(":")
        if not folder or not variant:
            raise SystemExit(f"pool: {source!r}; expected FOLDER:VARIANT, e.g. runs/async_e2e:sync_ipc")
        found = [r for r in runs(Path(folder)) if r["variant"] == variant and "em" in r]
        if not found:
            raise SystemExit(f"pool: {folder} has no evaluated run of variant {variant!r}")
        for record in found:
            stopped = record["finished"] and record["last_step"] < step
            if step not in record["em_by_step"] and not stopped:
                raise SystemExit(f"pool: {folder}/{record['run']} was not evaluated at step {step} (steps "
                                 f"{sorted(record['em_by_step'])})")
            records.append((folder, record))
    ems = [r["em_by_step"].get(step, r["em"]["chosen"]) for _, r in records]
    gains = [em - r["em"]["start"] for (_, r), em in zip(records, ems, strict=True)]
    print(f"| run | sample | warm start | EM at step {step} | gain |\n| --- | --- | --- | --- | --- |")
    for (folder, r), em, gain in zip(records, ems, gains, strict=True):
        ended = "" if step in r["em_by_step"] else (
            f" (guard stop at step {r['last_step']}, ended on step {r['best_step'] or r['last_step']})")
        print(f"| {folder}/{r['run']} | {r['sample']} | {r['em']['start']:.3f} | {em:.3f}{ended} | {gain:+.3f} |")
    pooled = {"step": step, "gain": _spread(gains), "em": _spread(ems)}
    print(f"\n{len(records)} runs at step {step}: gain {_spread_text(pooled['gain'], '+')}, EM "
          f"{_spread_text(pooled['em'])}")
    return pooled


FAILURE_KINDS = ("whole call, then <tool_call>", "whole call, then other text", "a slip before or inside the JSON",
                 "no block")


def failure_kind(text: str) -> str:
    """Which slip a refused training turn (``parse_failures.jsonl``'s text) is: one of :data:`FAILURE_KINDS`."""
    if (end := tool_call_end(text)) is not None:
        return FAILURE_KINDS[0] if text[end:].lstrip().startswith("<tool_call>") else FAILURE_KINDS[1]
    return FAILURE_KINDS[2] if "<tool_call>" in text else FAILURE_KINDS[3]


def failures(folders: list[Path], model: str) -> dict[str, dict[str, int]]:
    """Each run's refused training turns by kind, and how many ``close_tool_calls`` would have read as calls: the
    text re-tokenized with ``model``'s tokenizer and its eos token, closed by the engine's rule and parsed as
    training parses it (the file keeps decoded text, not ids, so this is the rule on the same text). Prints one
    Markdown row per run and the total."""
    from transformers import AutoTokenizer  # here: the other commands need no tokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    parse = response_parser(tokenizer, [SEARCH_TOOL])
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "q"}], tools=[SEARCH_TOOL],
                                           add_generation_prompt=True, tokenize=True, return_dict=False)
    table = {}
    for folder in folders:
        path = folder / "parse_failures.jsonl"
        if not path.exists() and not (folder / "summary.json").exists():
            raise SystemExit(f"failures: {folder} is no finished run (no parse_failures.jsonl, no summary.json)")
        # the trainer writes the file at a run's first refused turn: a finished run without one refused none
        texts = [json.loads(line)["text"] for line in path.read_text().splitlines()] if path.exists() else []
        row = dict.fromkeys(FAILURE_KINDS, 0) | {"turns": len(texts), "closed": 0}
        for text in texts:
            row[failure_kind(text)] += 1
            closed = close_tool_call(tokenizer, [*tokenizer.encode(text, add_special_tokens=False),
                                                 tokenizer.eos_token_id])
            message = closed and parse(closed[0], list(prompt))
            row["closed"] += bool(message and message.get("tool_calls"))
        table[folder.name] = row
    table["all"] = {key: sum(row[key] for row in table.values()) for key in ("turns", *FAILURE_KINDS, "closed")}
    print("| run | refused turns | " + " | ".join(FAILURE_KINDS) + " | read with close_tool_calls |")
    print("| --- " * (len(FAILURE_KINDS) + 3) + "|")
    for name, row in table.items():
        print(f"| {name} | {row['turns']} | " + " | ".join(str(row[kind]) for kind in FAILURE_KINDS) +
              f" | {row['closed']} |")
    return table


def variant_table(table: dict, baseline: str | None = None) -> str:
    """One Markdown row per variant, each figure a mean ± sd (min) over seeds on its sample: EM of the warm start, the
    last step and the chosen checkpoint, and GRPO's gain over the warm start at both (what issue 22's goal reads);
    the gain at the newest step all seeds reached, unfinished ones included (its step and seeds beside it);
    mean ``train_runtime`` and, where a ``baseline`` variant is named, the speedup over it: "-" without one, "-" with
    the step counts where they differ (a run the collapse guard stopped early is no faster for it), and "-" with the
    number of runs that shared the GPU where that differs (three runs side by side step faster than six, whatever the
    mode). Rows as printed: tests/test_learning_report.py."""
    reference = table[baseline]["train_runtime_s"]["mean"] if baseline in table else None
    reference_steps = table[baseline]["steps"] if baseline in table else None
    reference_sharing = table[baseline]["side_by_side"] if baseline in table else None
    lines = ["| variant | flags | sample | seeds | warm start | EM last step | EM chosen | gain, last step | "
             "gain, chosen | gain, step all seeds reached | train_runtime s | speedup |", "| --- " * 12 + "|"]
    for variant, row in table.items():
        runtime = row["train_runtime_s"]["mean"]
        if not (reference and runtime):
            speedup = "-"
        elif row["steps"] != reference_steps:
            counts = ["/".join(map(str, steps)) for steps in (row["steps"], reference_steps)]
            speedup = f"- ({counts[0]} steps, the baseline {counts[1]})"
        elif row["side_by_side"] != reference_sharing:
            counts = ["/".join("unrecorded" if n is None else str(n) for n in sharing)
                      for sharing in (row["side_by_side"], reference_sharing)]
            speedup = f"- ({counts[0]} runs on the GPU, the baseline's {counts[1]})"
        else:
            speedup = f"{reference / runtime:.2f}x"
        common = "-" if row["common_step"] is None else (
            f"{_spread_text(row['gain_common'], '+')} to EM {row['em_common']['mean']:.3f} at step "
            f"{row['common_step']}, seeds {' '.join(map(str, row['common_seeds']))}")
        figures = [_spread_text(row[key]) for key in ("warm_start", "last", "chosen")]
        figures += [_spread_text(row[key], "+") for key in ("gain_last", "gain_chosen")]
        lines.append(f"| {variant} | `{row['flags']}` | {row['sample']} | {' '.join(map(str, row['seeds']))} | "
                     f"{' | '.join(figures)} | {common} | {'-' if runtime is None else f'{runtime:.1f}'} | {speedup} |")
    if baseline is not None and baseline not in table:  # e.g. the baseline's batch of seeds has not run yet
        lines.append(f"\nno speedup: the baseline variant {baseline!r} has no finished run here ({', '.join(table)})")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="every variant x every seed side by side, then the report")
    run.add_argument("--out", default="runs/learning")
    run.add_argument("--config", default="offline_gpu")
    run.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    run.add_argument("--variant", action="append", default=[],
                     help="NAME=\"recipe flags\" (repeat); NAME= alone runs the recipe as committed")
    run.add_argument("--gpu", default=os.environ.get("CUDA_VISIBLE_DEVICES", "0"))
    run.add_argument("--gpu_memory_utilization", type=float, default=0.08)
    run.add_argument("--kv_cache_gib", type=float, default=3.0)
    run.add_argument("--base_port", type=int, default=8100)
    run.add_argument("--stagger_s", type=float, default=5.0)
    run.add_argument("--eager", action="store_true", help="vLLM without CUDA graphs (starts faster)")
    run.add_argument("--shared_gpu", action="store_true",
                     help="the shared update even for a batch of one run, whose GPU another batch shares")
    rep = sub.add_parser("report", help="the table from finished runs")
    rep.add_argument("out")
    pooled = sub.add_parser("pool", help="one recipe's runs from several batches, at one step")
    pooled.add_argument("sources", nargs="+", help="FOLDER:VARIANT (repeat), e.g. runs/async_e2e:sync_ipc")
    pooled.add_argument("--step", type=int, required=True, help="the step every run was evaluated at")
    failed = sub.add_parser("failures", help="runs' refused training turns by kind (parse_failures.jsonl)")
    failed.add_argument("runs", nargs="+", type=Path, help="run folders holding parse_failures.jsonl")
    failed.add_argument("--model", default=str(MODEL.folder(cache_dir())),
                        help="whose tokenizer re-tokenizes the texts (the runs' model; the offline asset by default)")
    for command in (run, rep):
        command.add_argument("--baseline", default=None,
                             help="the variant the speedup is over (a speed comparison; none without it)")
    args = parser.parse_args()
    if args.command == "run":
        if not args.variant:
            parser.error("give at least one --variant NAME=\"flags\"")
        launch(args)
    elif args.command == "failures":
        failures(args.runs, args.model)
    elif args.command == "pool":
        pool(args.sources, args.step)
    else:
        report(Path(args.out), args.baseline)


if __name__ == "__main__":
    main()
