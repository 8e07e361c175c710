"""searchr1-eval: EM of checkpoints x methods on seeded question samples, as a Search-R1 paper table.

    searchr1-eval --checkpoints <folder or Hub id> [...] --data <parquet or Hub dataset[:file]> [...] \\
        --methods direct rag agent --num_samples 500 --sample_seed 0 \\
        --search_url http://127.0.0.1:8000/retrieve --generator vllm --vllm_server_base_url http://127.0.0.1:8001 \\
        --output_dir runs/eval
    searchr1-eval --config eval.yaml --num_samples 32     # every field from a YAML, the command line overrides

Methods (searchr1_trl/training/evaluation.py): ``direct`` answers closed-book, ``rag`` reads the top-k passages for the
question
pasted into its prompt (one turn), ``agent`` is the multi-turn search rollout the policy is trained on; all greedy,
with the same retriever, top-k and budgets. The env and rollout settings are the training recipe's fields: a
checkpoint the trainer saved records the recipe it was trained with, and every method runs with its settings
(searchr1_trl/training/as_trained.py); a flag (same names as the recipe) overrides one, and the table says which.

The paper's table in one command: ``--data PeterJinGo/nq_hotpotqa_train`` (its test.parquet holds the seven test
sets, told apart by ``data_source``: nq, triviaqa, popqa, hotpotqa, 2wikimultihopqa, musique, bamboogle). Each cell
is EM / token F1.

Questions: from each data file, each ``data_source`` separately, a seeded random sample of ``num_samples`` rows
(the first ``num_samples`` of one seeded permutation, so a larger sample extends a smaller one), not the first rows.

Writes to ``output_dir``: ``traces.jsonl`` (one line per question x method x checkpoint: answer, EM, each search's
query and passage titles, status, the conversation), ``results.json`` (per row: EM per data source and their
average, searches, turns and calls the engine closed per rollout, status fractions) and ``results.md`` (the table:
rows method x checkpoint, columns data sources + average). Every finished trace is on disk at once: rerun the same
command after a crash and only the missing ones are generated. The table holds every checkpoint evaluated into
``output_dir`` on this sample, so checkpoints served one at a time (one vLLM server each) end up in one table;
``settings.json`` refuses a rerun whose sample seed or policy settings differ (its traces would not be comparable).

A retriever outage is never a result: before the first question the retriever (``/health`` and a probe query, when
a method searches) and every checkpoint's generator are checked, and the run stops in one line if one fails. A
trace with a search the retriever did not answer is written with status ``error_search``, left out of the EM,
counted in the table's ``failed searches`` column and generated again by a rerun; the run exits non-zero while any
remain.

Generators: ``vllm`` posts to a running ``trl vllm-serve`` that serves the checkpoint (one checkpoint per URL in
``vllm_server_base_url``); ``transformers`` loads each checkpoint in-process (GPU if there is one; a LoRA checkpoint,
such as the CPU recipe's, loads with its base model).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from collections import defaultdict
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

from searchr1_trl.cli.eval_results import TraceFile, markdown_table, results
from searchr1_trl.serving.vllm_server import GeneratorUnavailable
from searchr1_trl.tasks import TASKS, get_task
from searchr1_trl.tasks.common.data import SearchR1Dataset, SearchR1DatasetConfig, SearchR1Sample, load_samples
from searchr1_trl.tasks.common.retrieval import check_retriever
from searchr1_trl.training import evaluation
from searchr1_trl.training.as_trained import given_fields, policy_as_trained
from searchr1_trl.training.recipe import knob_fields, part_config


@dataclass
class PolicyConfig(knob_fields("PolicyKnobs", ("env", "rollout", "sampling"))):
    """How the policy runs, the recipe's settings under its names, defaults and help: the task and its env, rollout
    and per-turn fields. A checkpoint's recorded recipe sets them (:func:`policy_as_trained`): it runs as it trained."""

    task: str = field(default="search_r1",
                      metadata={"help": f"The task the checkpoints were trained on: {', '.join(TASKS)}, or a module "
                                        "path; by default the one their recipe records."})

logger = logging.getLogger("searchr1-eval")

TRACES_FILE, RESULTS_JSON, RESULTS_MD, SETTINGS_FILE = "traces.jsonl", "results.json", "results.md", "settings.json"


@dataclass
class EvalConfig:
    """What to evaluate and where the results go; how the policy runs is :data:`PolicyConfig`, the recipe's fields."""

    checkpoints: list[str] = field(
        default_factory=list, metadata={"help": "Model folders or Hub ids; one table row per method x checkpoint."})
    data: list[str] = field(
        default_factory=list,
        metadata={"help": "Question files: local parquet, or a Hub dataset `repo_id` (its test.parquet) or "
                          "`repo_id:file.parquet`; columns question, golden_answers (and data_source)."})
    data_sources: list[str] | None = field(
        default=None, metadata={"help": "Keep only these data_source values (default: every one in the files)."})
    num_samples: int = field(default=500, metadata={"help": "Questions per data source (all when fewer)."})
    sample_seed: int = field(default=0, metadata={"help": "Seed of the random sample of each data source."})
    sample_offset: int = field(
        default=0,
        metadata={"help": "Skip this many questions of each seeded sample first: `--num_samples 500 --sample_offset "
                          "500` is a training recipe's report sample (eval_num_samples 500, report_num_samples 500)."})
    methods: list[str] | None = field(
        default=None,
        metadata={"help": f"Any of {', '.join(evaluation.METHODS)} that the task supports; none: all it supports."})
    generator: str = field(
        default="vllm",
        metadata={"help": "`vllm`: a running `trl vllm-serve` per checkpoint; `transformers`: in-process."})
    vllm_server_base_url: list[str] = field(
        default_factory=lambda: ["http://127.0.0.1:8001"],
        metadata={"help": "With generator=vllm: the server of each checkpoint, in the order of `checkpoints`."})
    max_concurrency: int = field(default=256, metadata={"help": "Rollouts in flight at once."})
    dtype: str = field(
        default="auto", metadata={"help": "With generator=transformers: weight dtype (auto: bfloat16 on GPU, "
                                          "float32 on CPU)."})
    output_dir: str = field(default="runs/eval", metadata={"help": "Where traces and results are written."})
    trace_report: bool = field(
        default=True, metadata={"help": "Write output_dir/report.html at the end (searchr1-report): the table's charts "
                                        "and every trace, browsable offline."})

    def __post_init__(self):
        unknown = [m for m in self.methods or () if m not in evaluation.METHODS]
        if unknown:
            raise ValueError(f"methods {unknown}; expected any of {', '.join(evaluation.METHODS)}")
        if self.generator not in ("vllm", "transformers"):
            raise ValueError(f"generator={self.generator!r}; expected 'vllm' or 'transformers'")
        if self.num_samples < 1:
            raise ValueError(f"num_samples={self.num_samples}; expected >= 1")
        if self.sample_offset < 0:
            raise ValueError(f"sample_offset={self.sample_offset}; expected >= 0")


# ---- questions -------------------------------------------------------------------------------------------------


def _local_file(data: str) -> str:
    """A data entry as a local parquet: the path itself, or the Hub dataset file (downloaded once, then cached)."""
    if Path(data).expanduser().exists():
        return str(Path(data).expanduser())
    repo_id, _, filename = data.partition(":")
    if repo_id.count("/") != 1:
        raise ValueError(f"data {data!r} is neither a local file nor a Hub dataset `owner/name[:file.parquet]`")
    import huggingface_hub

    return huggingface_hub.hf_hub_download(repo_id, filename or "test.parquet", repo_type="dataset")


def load_questions(config: EvalConfig) -> list[tuple[str, SearchR1Sample]]:
    """``(key, sample)`` for every question to ask: per file and data source, the seeded sample of
    :meth:`SearchR1Dataset.take`. A key names the file, the source and the position in the sample."""
    questions = []
    for data in config.data:
        path = _local_file(data)
        rows = load_samples(path)
        sources = sorted({s.data_source for s in rows}, key=str)
        for source in sources:
            if config.data_sources is not None and source not in config.data_sources:
                continue
            stream = SearchR1Dataset(SearchR1DatasetConfig(data_path=path, data_source=source, shuffle=True,
                                                           seed=config.sample_seed))
            label = source or Path(path).stem
            taken = stream.take(config.sample_offset + config.num_samples)[config.sample_offset:]
            for position, sample in enumerate(taken, start=config.sample_offset):
                questions.append((f"{data}|{label}|{position}", replace(sample, data_source=label)))
    if not questions:
        raise ValueError(f"no questions in {config.data} for data_sources={config.data_sources}")
    return questions


# ---- traces on disk --------------------------------------------------------------------------------------------


def _check_settings(path: Path, settings: dict) -> None:
    """Record how the traces in this folder are made; ValueError when a rerun would mix in traces made otherwise.

    Checkpoints, methods, data files and sample sizes may change between runs (the table collects them); the sample
    seed and the policy's settings (retriever, top-k, budgets, prompt switches) may not. A setting added after the
    folder was written was made at its default.
    """
    if path.exists():
        recorded = {**{f.name: f.default for f in fields(PolicyConfig)}, **json.loads(path.read_text())}
        changed = {k: (recorded.get(k), v) for k, v in settings.items() if recorded.get(k) != v}
        if changed:
            described = ", ".join(f"{k} {old!r} -> {new!r}" for k, (old, new) in changed.items())
            raise ValueError(f"{path.parent} holds traces made with other settings ({described}); use another "
                             f"output_dir or the same settings")
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(settings, indent=2))


# ---- generation ------------------------------------------------------------------------------------------------


def generator_url(config: EvalConfig, index: int) -> str | None:
    """The vLLM server of checkpoint ``index`` (its position in ``vllm_server_base_url``); None for transformers."""
    urls = config.vllm_server_base_url
    if config.generator != "vllm":
        return None
    if len(urls) != len(config.checkpoints):
        raise ValueError(f"generator=vllm serves one model per server: give one vllm_server_base_url per "
                         f"checkpoint ({len(config.checkpoints)}), got {len(urls)}; or use generator=transformers")
    return urls[index]


def check_services(config: EvalConfig, policy, pending: list[dict[str, list]]) -> None:
    """ValueError naming the first part that cannot serve the run, before any question is asked: the retriever
    (health and a probe query) if a method with traces to generate searches, and the generator of every checkpoint
    with traces to generate (``pending[i]``: checkpoint i's missing traces by method). Without it, a retriever that
    was down turned every search into a finished trace with no passages."""
    searches = get_task(policy.task).needs_retriever and any(
        todo for work in pending for method, todo in work.items() if method != "direct")
    if searches:
        check_retriever(policy.search_url, policy.topk)
    for index, checkpoint in enumerate(config.checkpoints):
        if any(pending[index].values()):
            evaluation.check_generator(config.generator, checkpoint, generator_url(config, index))


def make_generator(config: EvalConfig, checkpoint: str, index: int, tokenizer):
    """The generator of one checkpoint (for ``vllm``, the server in ``vllm_server_base_url`` at its position)."""
    return evaluation.policy_generator(config.generator, checkpoint, tokenizer, url=generator_url(config, index),
                                       dtype=config.dtype, max_concurrency=config.max_concurrency)


# ---- main ------------------------------------------------------------------------------------------------------


def _finished(record: dict | None) -> bool:
    """Whether a trace on disk stands: written, and none of its searches failed (those are generated again)."""
    return record is not None and record["status"] != evaluation.SEARCH_FAILED


def trace_record(key: str, checkpoint: str, trace: evaluation.Trace) -> dict:
    return {"key": key, "checkpoint": checkpoint, **asdict(trace)}


async def _evaluate_checkpoint(config: EvalConfig, policy, index: int,
                               pending: dict[str, list[tuple[str, SearchR1Sample]]], total: int,
                               traces: TraceFile) -> None:
    """The missing traces of one checkpoint, method after method, each written as soon as it is finished."""
    from tqdm.auto import tqdm

    checkpoint = config.checkpoints[index]
    tokenizer = evaluation.policy_tokenizer(checkpoint)
    generator = make_generator(config, checkpoint, index, tokenizer)
    params = evaluation.greedy_params(policy.max_tokens_per_turn)
    env_config, rollout_config = part_config(policy, "env"), part_config(policy, "rollout")
    try:
        for name, todo in pending.items():
            if not todo:
                continue
            method = evaluation.build_method(name, get_task(policy.task), tokenizer, generator, env_config,
                                             rollout_config)
            progress = tqdm(total=total, initial=total - len(todo), unit="question", dynamic_ncols=True,
                            desc=f"{name} {Path(checkpoint).name}")

            def write(i: int, trace: evaluation.Trace, todo=todo, progress=progress) -> None:
                traces.add(trace_record(todo[i][0], checkpoint, trace))
                progress.update()

            try:
                await evaluation.run(method, [s for _, s in todo], params, on_trace=write,
                                     max_concurrency=config.max_concurrency)
            finally:
                progress.close()
                await method.aclose()
    finally:
        await generator.aclose()


def evaluate(config: EvalConfig, policy, source: dict[str, dict] | None = None) -> list[dict]:
    """Generate every missing trace, then write results.json and results.md (``source``: where the settings came
    from, :func:`policy_as_trained`); returns the table rows. ``methods`` none: every one the task supports."""
    supported = get_task(policy.task).methods
    config = replace(config, methods=config.methods or list(supported))
    if unsupported := [m for m in config.methods if m not in supported]:
        raise ValueError(f"methods {unsupported}; task {policy.task} supports any of {', '.join(supported)}")
    questions = load_questions(config)
    per_source: dict[str, int] = defaultdict(int)
    for _, sample in questions:
        per_source[sample.data_source] += 1
    out = Path(config.output_dir)
    _check_settings(out / SETTINGS_FILE, {"sample_seed": config.sample_seed, **asdict(policy)})
    traces = TraceFile(out / TRACES_FILE)
    try:
        pending = [{m: [(k, s) for k, s in questions if not _finished(traces.records.get((checkpoint, m, k)))]
                    for m in config.methods} for checkpoint in config.checkpoints]
        check_services(config, policy, pending)
        for index, checkpoint in enumerate(config.checkpoints):
            if not any(pending[index].values()):
                logger.info("%s: every trace is already in %s", checkpoint, traces.path)
                continue
            asyncio.run(_evaluate_checkpoint(config, policy, index, pending[index], len(questions), traces))
    finally:
        traces.close()
    keys = {key for key, _ in questions}
    records = [r for r in traces.records.values() if r["key"] in keys]
    rows = results(records, config.methods)
    (out / RESULTS_JSON).write_text(json.dumps({
        "config": asdict(config), "policy": asdict(policy), "policy_source": source,
        "num_samples_per_source": dict(per_source), "results": rows,
    }, indent=2))
    (out / RESULTS_MD).write_text(markdown_table(rows, dict(per_source), source))
    return rows


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults after each flag, the description as written."""


def main(argv: list[str] | None = None) -> None:
    from searchr1_trl.training.loading import RecipeParser

    parser = RecipeParser((EvalConfig, PolicyConfig), description=__doc__,
                          formatter_class=_HelpFormatter, prog="searchr1-eval")
    logging.basicConfig(level=logging.INFO, format="[searchr1-eval] %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request would bury the progress bar
    argv = sys.argv[1:] if argv is None else argv
    try:
        config, policy = parser.parse_args_and_config(args=argv)
        if not config.checkpoints or not config.data:
            raise ValueError("give --checkpoints and --data (see --help)")
        policy, source = policy_as_trained(config.checkpoints, policy, given_fields(argv))
        rows = evaluate(config, policy, source)
    except ValueError as error:
        sys.exit(f"error: {error}")
    except GeneratorUnavailable as error:  # lost mid-run: the traces written so far stay, a rerun resumes after them
        sys.exit(f"error: {error}; rerun the same command once it serves again to resume")
    out = Path(config.output_dir)
    print((out / RESULTS_MD).read_text(), end="")
    print(f"{len(rows)} rows; traces, JSON and table in {out}")
    if config.trace_report:
        from searchr1_trl.report.page import write_report

        print(f"trace report: {write_report([out])}")
    failed = sum(row["search_failed"] for row in rows)
    if failed:
        sys.exit(f"error: {failed} traces have a failed search (the retriever did not answer) and are not scored; "
                 "rerun the same command once it serves again to generate them")


if __name__ == "__main__":
    main()
