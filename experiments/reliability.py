"""Reliability figures: run the reliability suite, print its figures and write docs/RELIABILITY.md.

The figures are measured by the tests themselves (tests/test_reliability_*.py record them in the
``reliability_figures`` fixture), so the document shows exactly what the suite checked, from one run. The run sets
RELIABILITY_FULL_SIZE=1: the fuzz and load tests then run at the sizes the document states (10,000 completions,
2,000 bodies, 5 s load runs) where the test suite checks the same properties on less.

    python -m experiments.reliability            # ~10 min on 2 CPU cores; run it alone (flock /tmp/heavy.lock ...)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SUITE = ["tests/test_reliability_rollout.py", "tests/test_reliability_server.py", "tests/test_reliability_client.py",
         "tests/test_reliability_training.py", "tests/test_reliability_processes.py",
         "tests/test_reliability_generator.py"]


def rows(f: dict) -> list[tuple[str, str, str, bool, str]]:
    """(figure, must, measured, met, test) for every must-value of the reliability spec."""
    try:
        return _rows(f)
    except (KeyError, ValueError, ZeroDivisionError) as missing:
        return [("figures", "all recorded", f"missing: {missing!r} (a test failed before recording it)", False,
                 "see the pytest output")]


def _rows(f: dict) -> list[tuple[str, str, str, bool, str]]:
    malformed = f["malformed_turns"]
    lost = max(m["other_rollouts_lost"] for m in malformed.values())
    load = f["server_load"]
    poison, heavy, clean, nine = load["poison"], load["heavy"], load["clean"], load["nine heavy"]
    success = (poison["good_requests"] - poison["good_failed"]) / poison["good_requests"]
    ratio = heavy["good_requests"] / clean["good_requests"]
    nine_ratio, nine_share = nine["p99_ms"] / clean["p99_ms"], nine["good_per_s"] / clean["good_per_s"]
    outage = f["client_outage"]
    blackout = f["outage_rollouts"]
    resumes = f["kill_and_resume"]
    escapes = f["parse_fuzz"]["escapes"] + f["rollout_fuzz"]["escapes"]
    stopped = f["children_stopped_after_a_signal_to_the_job_s"]
    bounds = f["server_input_bounds"]
    resumed = f["resume_past_a_damaged_checkpoint_2"]
    hung, stopped_by_generator = f["hung_generator_s"], f["generator_lost_in_training"]
    return [
        ("other rollouts lost per malformed turn", "0",
         f"{lost} (over {len(malformed)} malformed-turn shapes x 7 rollouts beside each; {f['rollout_fuzz']['control_lost']} "
         f"of {f['rollout_fuzz']['batches']} control rollouts beside 7 fuzzed turns)",
         lost == 0 and f["rollout_fuzz"]["control_lost"] == 0,
         "test_reliability_rollout: test_a_malformed_turn_ends_only_its_own_rollout_and_costs_no_other_search, "
         "test_fuzzed_turns_never_cost_the_rollout_beside_them"),
        ("escapes (exceptions out of parse -> env -> chat template)", "0",
         f"{escapes} in {f['parse_fuzz']['completions']:,} fuzzed completions ({f['parse_fuzz']['error_parse']:,} "
         f"error_parse, {f['parse_fuzz']['tool_calls']:,} tool calls answered and rendered)", escapes == 0,
         "test_reliability_rollout: test_fuzzed_completions_parse_step_and_render_without_raising"),
        ("5xx from fuzzed request bodies", "0",
         f"{f['server_fuzz']['5xx']} of {f['server_fuzz']['bodies']:,} bodies ({f['server_fuzz']['4xx']:,} 4xx naming "
         f"the field, {f['server_fuzz']['ok']:,} answered)", f["server_fuzz"]["5xx"] == 0,
         "test_reliability_server: test_fuzzed_bodies_get_no_5xx_and_every_4xx_names_its_field"),
        ("good-request success beside poison queries (64 clients)", "100%",
         f"{success:.1%} of {poison['good_requests']:,} ({poison['extra_requests']} poison requests, all "
         f"{poison['extra_statuses']})", success == 1.0,
         "test_reliability_server: test_64_good_clients_are_all_answered_beside_poison_and_a_heavy_request"),
        ("good requests answered beside the heaviest allowed request (64 clients, 10 s)",
         ">= 1/4 of clean (held back: ~0, the request outlasts the run)",
         f"{heavy['good_requests']:,} vs clean {clean['good_requests']:,} = {ratio:.2f}x, {heavy['good_failed']} "
         f"failed (p99 {heavy['p99_ms']:.0f} ms vs clean {clean['p99_ms']:.0f} ms)",
         ratio >= 0.25 and heavy["good_failed"] == 0,
         "test_reliability_server: test_64_good_clients_are_all_answered_beside_poison_and_a_heavy_request"),
        ("good clients beside nine maximal requests (1,024 x ~940 characters, topk 4) resent at once",
         "p99 <= 2x clean, throughput >= 70% of clean",
         f"p99 {nine['p99_ms']:.0f} ms = {nine_ratio:.2f}x, {nine['good_per_s']:.0f} requests/s = {nine_share:.0%} "
         f"of clean; {nine['good_failed']} of {nine['good_requests']:,} failed; the heavy clients got "
         f"{nine['extra_429']} 429s", nine_ratio <= 2 and nine_share >= 0.7 and nine["good_failed"] == 0,
         "test_reliability_server: test_beside_nine_maximal_requests_every_good_request_is_answered_and_all_but_"
         "one_heavy_client_gets_429"),
        ("retriever outage survived (SIGKILL mid-batch, restart)", "every search answered",
         f"{outage['searches'] - outage['empty']} of {outage['searches']} searches answered across a "
         f"{outage['outage_s']:.1f} s outage ({outage['requests']} requests)", outage["empty"] == 0,
         "test_reliability_client: test_searches_survive_a_retriever_killed_mid_batch_and_restarted"),
        ("rollouts through an outage longer than the retry budget (every attempt refused)",
         "none ends done or is rewarded",
         f"{blackout['error_tool']} of {blackout['rollouts']} ended error_tool, {blackout['done']} done, "
         f"{blackout['rewarded']} rewarded", blackout["done"] == blackout["rewarded"] == 0,
         "test_reliability_client: test_rollouts_through_an_outage_longer_than_the_retry_budget_end_error_tool_"
         "unrewarded"),
        ("resumes exact after kill -9", "exact",
         "; ".join(f"killed {mode} a checkpoint: resumed from step {r['resumed_from_step']}, questions "
                   f"{'exact' if r['questions_exact'] else 'DIFFERENT'}" for mode, r in sorted(resumes.items())),
         all(r["questions_exact"] for r in resumes.values()),
         "test_reliability_training: test_a_run_killed_after_or_during_a_checkpoint_resumes_exactly"),
        ("orphans left after the parent's SIGKILL", "0", str(f["orphans_after_parent_sigkill"]),
         f["orphans_after_parent_sigkill"] == 0,
         "test_reliability_processes: test_servers_die_with_a_parent_killed_by_sigkill"),
        ("children left when the job's own pid gets a signal (trainer, servers)", "0, within 5 s",
         "0; all stopped after " + ", ".join(f"{name} {s:.2f} s" for name, s in sorted(stopped.items())),
         len(stopped) == 3 and max(stopped.values()) < 5,
         "test_reliability_processes: test_a_signal_to_the_jobs_own_pid_stops_the_trainer_and_the_servers"),
        ("hostile headers and oversized answers (limits 4 KiB, 1 s, 2,000 bytes)", "a 4xx naming the limit",
         "; ".join(f"{name.split(':')[0]}: 408, closed after {value} s" if name.startswith("stalled") else
                   f"{name}: {value}" for name, value in sorted(bounds.items())),
         sorted(v for k, v in bounds.items() if not k.startswith("stalled")) == [413, 431, 431]
         and all(v < 5 for k, v in bounds.items() if k.startswith("stalled")),
         "test_reliability_server: test_headers_over_max_header_bytes_get_431_naming_the_limit, "
         "test_a_connection_that_stalls_before_its_headers_end_gets_408_and_is_closed, "
         "test_a_response_over_max_response_bytes_is_refused_with_413_before_it_is_built"),
        ("resume with a damaged newest checkpoint", "the newest intact one",
         "; ".join(f"{damage}: resumed from {folder}" for damage, folder in sorted(resumed.items())),
         len(resumed) == 4 and set(resumed.values()) == {"checkpoint-1"},
         "test_reliability_training: test_resume_skips_a_damaged_newest_checkpoint_saying_why_and_refuses_it_by_name"),
        ("a training row whose prompt leaves no room", "skipped and counted, never fatal",
         f"{f['over_long_row']['steps_trained']} step trained, rollout/status_truncated_prompt_too_long "
         f"{f['over_long_row']['counted_prompt_too_long']:.2f}", f["over_long_row"]["steps_trained"] == 1,
         "test_reliability_training: test_a_row_whose_prompt_leaves_no_room_is_skipped_and_counted_not_fatal"),
        ("a second run on an output_dir in use", "refused in one line",
         re.sub(r"'/\S+/", "'.../", f["second_run_on_a_held_output_dir"]) + " (pid ...): wait for it to end ...",
         "is in use by another run" in f["second_run_on_a_held_output_dir"],
         "test_reliability_training: test_a_second_run_on_an_output_dir_in_use_is_refused_in_one_line_naming_the_"
         "first"),
        ("a generator hung (timeouts set to 2 s)", "stops what waits on it within 10 s, naming the setting to raise",
         "stopped after " + ", ".join(f"{call} {s:.1f} s" for call, s in sorted(hung.items())),
         len(hung) == 3 and max(hung.values()) < 10,
         "test_reliability_generator: test_a_hung_generator_fails_the_call_after_its_timeout_naming_it_and_the_"
         "setting, test_training_stops_in_one_line_naming_the_generator_when_it_is_killed_or_hangs"),
        ("a generator killed or hung during training", "training stops in one line naming the generator and its URL",
         "; ".join(f"{fault}: {line}" for fault, line in sorted(stopped_by_generator.items())),
         len(stopped_by_generator) == 2 and all(line.startswith("error: ") and "the generator at http://" in line
                                               for line in stopped_by_generator.values()),
         "test_reliability_generator: test_training_stops_in_one_line_naming_the_generator_when_it_is_killed_or_hangs"),
    ]


FINDINGS = """\
| finding | fix | test (fails before its fix, passes now) |
| --- | --- | --- |
| lone surrogate escape loses the batch | parser fails the turn (ERROR_PARSE) on any lone surrogate; the client encodes queries itself; passages and tool names made valid text | `test_a_malformed_turn_ends_only_its_own_rollout...[surrogate *]`, `test_a_query_that_is_no_valid_text_costs_no_other_search` |
| deep nesting / huge ints escape parsers | every JSON reader treats RecursionError/ValueError as unreadable; arguments deeper than 32 fail the turn; env reads them as an empty query | `test_a_malformed_turn_ends_only_its_own_rollout...[990 nested *, 5,000-digit *]`, the 10,000-completion property test |
| one bad query fails its batch | batch retried request by request, then query by query; only the culprit's request gets a 422 naming `queries[i]`; surrogates refused up front | `test_a_query_that_fails_its_batch_fails_only_its_own_request`, `test_a_lone_surrogate_query_gets_422...` |
| bare 500s | deep nesting / long integers are a 400 naming the body; an unexpected error is a named, counted 500; connection kept | `test_hostile_bodies_get_a_4xx_naming_the_problem_counted_and_the_connection_kept`, the fuzzed-bodies test |
| one request stalls the server | `max_request_cost` (queries x topk, 4,096); big requests served in slices of `max_batch_chars` after newcomers; disconnect cancels | `test_a_big_request_is_served_in_slices_with_newcomers_first`, `test_a_request_whose_client_leaves_is_cancelled`, the load test |
| recipes expose the generator | every recipe command binds `--host 127.0.0.1` (two-node: `$NODE2_PRIVATE_IP`) and says why | `test_recipe_commands_bind_servers_to_loopback_or_a_named_private_address_and_say_why` |
| weight_sync_dir deleted | a non-empty folder without the trainer's marker is refused | `test_the_weight_sync_folder_is_replaced_when_ours_and_refused_when_not` |
| resume does not survive a kill | stream state atomic and first, completeness marker last, rotation after the marker; resume takes the newest complete checkpoint | `test_a_run_killed_after_or_during_a_checkpoint_resumes_exactly[during-1]` |
| client gaps | wall-time bound per attempt (drip cut off), `deadline_s` per search, 8 retries / 39.5 s of backoff, response size cap, passages capped | `test_one_faulty_answer_is_retried_within_the_time_budget[*]`, `test_a_dripping_server_is_cut_off...`, `test_a_search_never_outlasts_its_deadline`, `test_an_oversized_answer_is_refused...` |
| exposure | no /docs, /redoc, /openapi.json; /health without paths | `test_no_api_docs_are_served_and_health_shows_no_paths` |
| orphans and silent OOM | vLLM under a reaper (process group + PR_SET_PDEATHSIG), retriever with PDEATHSIG; a signal death says its likely cause and peak memory | `test_servers_die_with_a_parent_killed_by_sigkill`, `test_a_child_killed_by_sigkill_is_reported_with_its_likely_cause_and_peak_memory` |
| a corpus or encoder other than the index's is served (Zelda passages for Super Bowl 50; every query a 422 while `/health` is ok) | the sidecar records passage count, a sha256 of the contents, the encoder's width and its embedding of a probe passage; the server refuses in one line, and answers a probe query before it binds its port | `tests/test_retriever_index.py`: `test_the_server_refuses_*`, `test_a_server_that_cannot_answer_a_probe_query_does_not_start` |
| nine maximal requests starve everyone (good p99 6.0 -> 16.5 s, 33.6 -> 10.9 requests/s; here 503s) | requests larger than one batch admitted by cost (`max_bulk_chars`, one maximal request) with a 429 held back for its `Retry-After`, a body too big for the room refused unread; bulk slices a quarter batch, one at a time between small batches, at most `max_bulk_share` (20%) of the search time | `test_beside_nine_maximal_requests_every_good_request_is_answered...`, `test_bulk_work_gets_its_share_of_the_search_time...`, `test_a_request_larger_than_one_batch_is_refused_while_others_hold...` |
| an evaluation turns a retriever outage into results and keeps them (21 of 30 traces finished with no passages, exit 0; a closed port: EM 0.000) | `searchr1-eval` checks the retriever (health and a probe query) and every generator before the first question; a trace with a failed search is `error_search`, out of the EM, counted in the table, generated again by a rerun, and the run exits non-zero while any remain | `tests/test_eval_cli.py`: `test_eval_stops_in_one_line_*`, `test_traces_whose_search_failed_are_counted_not_scored_and_a_rerun_generates_them` |
| an outage longer than the retry budget ends rollouts `done` (trained on as if nothing was found); a server that answers 422 to every query is not retried | a 422 "cannot be searched" is an outage, retried; a step whose every search failed ends its rollout `error_tool`, rewarded None (no advantage, out of the group baseline); training stops in one line above `max_failed_search_fraction` of a step's searches | `test_a_server_that_cannot_search_is_an_outage_retried...`, `test_a_rollout_whose_searches_all_failed_ends_error_tool...`, `test_training_stops_in_one_line_when_more_than...` |
| the CPU recipe's LoRA output cannot be evaluated or asked ("Unrecognized model ... `model_type`") | a checkpoint is checked before it loads: a whole model or a LoRA adapter, loaded on its base; a LoRA adapter on a vLLM server is refused naming what to do | `tests/test_eval_cli.py`: `test_a_lora_checkpoint_is_evaluated_on_its_base_model`; `tests/test_ask_cli.py`: `test_a_lora_checkpoint_answers_with_its_base_model` |
| one over-long question kills training (TRL's `parse_response` on an empty completion) | the plan check names the training rows whose prompt leaves no room within `max_rollout_tokens`; inside the trainer such a rollout gets one end-of-turn token outside the loss and is counted | `tests/test_recipe.py`: `test_a_training_row_whose_prompt_leaves_no_room_*`, `test_a_row_whose_prompt_leaves_no_room_is_skipped_and_counted_not_fatal` |
| rows without `data_source` kill the trainer at construction; a filter matching nothing passes the plan check | empty `data_source` cells refused naming the rows; the plan reads each file through the run's filter | `tests/test_recipe.py`: `test_a_bad_data_file_*`, `test_a_data_source_filter_that_matches_no_row_*` |
| two runs on one `output_dir` both exit 0, checkpoints mixed | `searchr1-train` holds an flock on the folder; another run is refused naming the holder; a dead run's lock is taken over | `test_a_second_run_on_an_output_dir_in_use_*`, `test_the_lock_of_a_killed_run_is_taken_over_*` |
| SIGTERM to the job's pid orphans the trainer (46.7 s on, a checkpoint after the job exited) | the job turns SIGTERM/SIGINT into an exit that stops every child; the trainer has PR_SET_PDEATHSIG | `test_a_signal_to_the_jobs_own_pid_stops_the_trainer_and_the_servers[*]` |
| a damaged newest checkpoint stops resume with a raw traceback; `--resume_from_checkpoint true` is a path "true" | resume reads marker, JSON, safetensors against their headers and torch files as whole zips; `true`/`latest` take the newest intact one, saying which and why others were skipped | `test_resume_skips_a_damaged_newest_checkpoint_*[*]`, `test_the_command_line_resumes_from_the_newest_intact_checkpoint_with_true` |
| `searchr1-ask` on an empty, missing or file path, or truncated weights: tracebacks or "install sentencepiece" | one line naming the path and the cause | `tests/test_ask_cli.py`: `test_a_path_that_holds_no_model_*[*]`, `test_a_lora_checkpoint_whose_adapter_weights_are_truncated_*`; `tests/test_eval_cli.py`: `test_a_checkpoint_with_truncated_weights_*` |
| `build_index` on a bad corpus: tracebacks naming neither file nor line | UTF-8 validated, null contents refused; the first bad line named by file and line | `tests/test_retriever_index.py`: `test_build_index_names_the_file_and_line_of_a_bad_corpus_in_one_line[*]` |
| unbounded headers (1 MiB, 5,000 headers: 200), header waits (75 s+), responses (270 MB for a 27 KB request) | `max_header_bytes` (431), `header_timeout_s` (408), `max_response_bytes` (413, weighed before the passages are read) | the three server-bound tests above |
| bad recipe values and data files give tracebacks; `golden_answers: [""]` accepted | one YAML reader checks syntax, mapping and each value's type; each part's checks run at load; the plan reads local data files row by row; blank answers refused | `tests/test_recipe.py`: `test_a_bad_recipe_value_or_yaml_*`, `test_a_recipe_that_is_no_mapping_*`, `test_a_bad_data_file_*` |
| a generator started by hand, killed: a raw `httpx.ConnectError` / aiohttp error in 2.4-6.6 s; hung: 306.7 s, then `httpx.ReadTimeout` (the push's fixed 300 s), or up to `generator_timeout_s` (600 s) a request, then a bare `TimeoutError` | every request to the generator raises `GeneratorUnavailable` on a refused or dropped connection, no answer in time or a server error (HTTP 5xx, its answer shown), one line naming what failed, the generator's URL and the setting to raise; `searchr1-train` exits with it; the push timeout is the recipe's `weight_sync_timeout_s`, which also bounds TRL's NCCL push as a whole (past it the process ends with that line) | `tests/test_reliability_generator.py`: `test_a_killed_generator_*[*]`, `test_a_hung_generator_*[*]`, `test_a_generator_answering_a_server_error_*[*]`, `test_an_nccl_push_that_outlasts_its_timeout_*[*]`, `test_training_stops_in_one_line_naming_the_generator_*[*]` |
"""


def render(figures: dict, seconds: float, returncode: int) -> str:
    table = rows(figures)
    verdict = "all tests passed" if returncode == 0 else f"**the suite failed (pytest exit {returncode})**"
    lines = [
        "# Reliability", "",
        "No single bad turn, query or request may cost a batch, a run or a checkpoint. Every figure below is measured "
        "by the reliability suite (`tests/test_reliability_*.py`, part of CI) on real parts: the Qwen2.5 tokenizer "
        "and chat template, the retrieval server (uvicorn, MiniLM, exact faiss) over the SQuAD dev test corpus, the "
        "tiny-model trainer; fakes only inject faults the real server cannot show on demand. CI checks the fuzz and "
        "load properties on less (2,000 completions, 500 request bodies, load runs of 2 s); the run below has the "
        "sizes it states (RELIABILITY_FULL_SIZE=1).", "",
        f"Regenerate: `python -m experiments.reliability` (this run: {verdict}, {seconds / 60:.1f} min on "
        f"{os.cpu_count()} CPU cores shared with other jobs, so latencies are noisy).", "",
        "| figure | must | measured | met | test |", "| --- | --- | --- | --- | --- |",
        *(f"| {name} | {must} | {measured} | {'yes' if met else '**NO**'} | {test} |"
          for name, must, measured, met, test in table),
        "", "## Findings and fixes", "", FINDINGS,
        "## Raw figures", "", "```json", json.dumps(figures, indent=1, sort_keys=True), "```", "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(ROOT / "docs" / "RELIABILITY.md"))
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        figures_file = Path(tmp) / "figures.json"
        start = time.monotonic()
        run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *SUITE], cwd=ROOT,
                             env={**os.environ, "RELIABILITY_FIGURES": str(figures_file), "HF_HUB_OFFLINE": "1",
                                  "RELIABILITY_FULL_SIZE": "1"})  # the sizes the figures state
        seconds = time.monotonic() - start
        figures = json.loads(figures_file.read_text()) if figures_file.exists() else {}
    for name, must, measured, met, _ in rows(figures):
        print(f"{'ok ' if met else 'NO '} {name}: {measured} (must: {must})")
    Path(args.out).write_text(render(figures, seconds, run.returncode))
    print(f"wrote {args.out}")
    if run.returncode:
        sys.exit(f"the reliability suite failed (exit {run.returncode}); see the table")


if __name__ == "__main__":
    main()
