"""Rollout throughput: completed rollouts/s, generated tokens/s, turns and searches per rollout of one multi-turn
Search-R1 workload through

(a) ``RolloutEngine`` + ``VLLMServerGenerator`` (every rollout its own task, vLLM's continuous batching),
(b) ``RolloutEngine`` + ``TransformersGenerator`` (in-process, concurrent turns batched into one ``generate``),
(c) TRL's own tool loop: ``GRPOTrainer(tools=[search], use_vllm=True, vllm_mode="server")`` on the same vLLM server,
    timing ``GRPOTrainer._generate`` (generation + tool calls, no scoring or training step).

The workload: ``--num_questions`` rollouts, i.e. ``num_questions / 2`` SQuAD dev questions asked twice each (GRPO
groups need ``num_generations >= 2``, and all three get the very same list), sampled at ``--temperature`` with at
most ``--max_tokens`` per turn and ``--max_turns`` assistant turns (TRL: ``max_tool_calling_iterations = max_turns -
1``). "Generated tokens" are model tokens only (env mask / TRL tool mask 1); a turn is an assistant message, a search
a tool call in one. The offline Qwen2.5-Coder-0.5B calls ``search`` only as bare JSON, which TRL's response parser
reads as a final answer; so all three loops parse turns with the product's parser (``searchr1_trl.engine.parsing``, bare
JSON calls on): (c) gets it as its tokenizer's ``parse_response`` (:func:`tokenizer_with_our_parser`), the one
method TRL 1.16 parses every turn through, and with it TRL's rollouts search too. ``--no-bare_json_tool_calls``
restores the template-only parsers (then the 0.5B's rollouts are one turn). The script starts its own retrieval server
(over the passages of the questions' articles) and, unless ``--vllm_base_url`` names a running one, a vLLM server on
``--vllm_port``; their start-up and model loading are not timed.

    python -m experiments.rollout_throughput --num_questions 16 --backends vllm trl \
        --out experiments/results/rollout_throughput.jsonl
    # the same searches at wiki-18's cost: the index padded to 21M x 768 by random vectors (32 GB fp16 on the GPU)
    python -m experiments.rollout_throughput --num_questions 512 --backends vllm trl --pad_index_rows 21000000

Nothing assumes a CPU: on a CUDA machine the vLLM server runs on the GPU with its default dtype (``--vllm_gpu``
picks which), and (b)'s model goes to the GPU. (c) skips the NCCL weight-transfer handshake GRPOTrainer performs in
server mode (no weights change while generating, and on CPU it cannot run) and keeps its unused policy on the CPU;
nothing else in TRL's generation path is altered.

Each row also splits a search request's time (:func:`search_split`): its latency at the client, at the retrieval
server (its ``/metrics`` counters before and after the run) and the server's batch time within that, queries per
batch, and for (a)/(b) how late the engine's event loop runs a ready coroutine. At wiki-18 scale the engine's client
saw 0.38-1.89 s a request where a batch's scan costs tens of ms; these say which side the rest is on. And for
(a)/(b), when the rollouts finished and what the last one spent generating and searching (:func:`tail`): a fixed
batch's rollouts/s is its size over its last finish.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from experiments.report import report
from retriever_server.launch import RetrieverProcess
from retriever_server.metrics import parse_prometheus
from searchr1_trl.assets.offline import require
from searchr1_trl.engine.generation import SamplingParams, VLLMServerGenerator
from searchr1_trl.engine.in_process import TransformersGenerator
from searchr1_trl.engine.parsing import response_parser
from searchr1_trl.engine.rollout import RolloutConfig, RolloutEngine
from searchr1_trl.serving.processes import free_port
from searchr1_trl.serving.vllm_server import VLLMServer, VLLMServerConfig
from searchr1_trl.tasks.common.data import SearchR1Sample
from searchr1_trl.tasks.common.retrieval import RetrievalClient
from searchr1_trl.tasks.common.search import SearchR1EnvConfig
from searchr1_trl.tasks.search_r1.env import SEARCH_TOOL, SearchR1EnvFactory

ARTICLES = 8  # SQuAD dev articles whose passages form the corpus and whose questions are asked


@dataclass
class Result:
    backend: str
    rollouts: int
    generated_tokens: int
    turns: int
    searches: int
    seconds: float
    searching: dict = field(default_factory=dict)  # where a search's time goes (:func:`search_split`)
    latency: dict = field(default_factory=dict)  # when rollouts finished, and the slowest one's split (:func:`tail`)

    def row(self) -> dict:
        return {**self.searching, **self.latency,
            "backend": self.backend, "rollouts": self.rollouts, "seconds": round(self.seconds, 2),
            "rollouts_per_s": round(self.rollouts / self.seconds, 4),
            "generated_tokens_per_s": round(self.generated_tokens / self.seconds, 1),
            "turns_per_rollout": round(self.turns / self.rollouts, 3),
            "searches_per_rollout": round(self.searches / self.rollouts, 3),
            "generated_tokens": self.generated_tokens,
        }

    def line(self) -> str:
        r = self.row()
        return (f"{self.backend:<34} {r['rollouts_per_s']:8.3f} rollouts/s {r['generated_tokens_per_s']:9.1f} tokens/s"
                f" {r['turns_per_rollout']:5.2f} turns {r['searches_per_rollout']:5.2f} searches per rollout"
                f"   ({self.rollouts} rollouts, {self.generated_tokens} tokens, {self.seconds:.1f} s)"
                + ("" if not self.searching else "\n    a search request: {client_request_latency_ms} ms at the client "
                   "({client_requests} requests), {server_request_latency_ms} ms in the server ({server_requests}), "
                   "{server_batch_ms} ms a batch of {server_queries_per_batch} queries".format(**self.searching)
                   + ("" if self.searching["client_loop_lag_ms"] is None else
                      f"; the client loop's lag (ms) {self.searching['client_loop_lag_ms']}"))
                + ("" if not self.latency else "\n    rollouts done at (s) {rollout_done_s}; the slowest: "
                   "{slowest_rollout}".format(**self.latency)))


def tail(rollouts, done_s: list[float]) -> dict:
    """When the rollouts of one batch finished (``done_s``: each rollout's own ``total_s``, p50, p90, max; engine.run
    starts them one after another, each tokenizing its prompt first, so the last starts a little after the first)
    and the last one's time in generation and in its environment, with its turns and generated tokens: a batch's
    rollouts/s is its size over its last rollout's finish, so this says whether the run waited on the many or on
    one rollout's long chain of turns."""
    slowest = rollouts[max(range(len(rollouts)), key=done_s.__getitem__)]
    done = sorted(done_s)
    return {"rollout_done_s": {"p50": round(done[len(done) // 2], 2), "p90": round(done[int(len(done) * 0.9)], 2),
                               "max": round(done[-1], 2)},
            "slowest_rollout": {"generate_s": round(slowest.timings["generate_s"], 2),
                                "env_s": round(slowest.timings["env_s"], 2), "turns": slowest.num_turns,
                                "generated_tokens": sum(slowest.env_mask)}}


def workload(assets, num_questions: int, work: Path) -> tuple[list[SearchR1Sample], Path]:
    """(samples, corpus file): each of num_questions / 2 questions twice, and the passages of their articles."""
    questions = pd.read_parquet(assets.test_questions)
    titles = list(dict.fromkeys(questions["title"]))[:ARTICLES]
    questions = questions[questions["title"].isin(titles)]
    # Round-robin over the articles, so the searches hit different passages.
    picked = questions.groupby("title", sort=False).cumcount().sort_values(kind="stable").index[: num_questions // 2]
    samples = [SearchR1Sample(r.question, tuple(r.golden_answers), r.data_source)
               for r in questions.loc[picked].itertuples()]
    corpus = work / "corpus.jsonl"
    with open(assets.corpus) as source, open(corpus, "w") as out:
        out.writelines(line for line in source if json.loads(line)["contents"].split("\n", 1)[0] in titles)
    return [s for s in samples for _ in range(2)], corpus


def engine_run(tokenizer, generator, search_url: str, samples, params, rollout_config) -> Result:
    env = SearchR1EnvFactory(SearchR1EnvConfig(search_url=search_url))
    engine = RolloutEngine(tokenizer, generator, env, rollout_config)

    async def main():
        try:
            async with loop_lag_probe() as lags:
                start = time.perf_counter()
                rollouts = await engine.run(samples, params)
            return rollouts, time.perf_counter() - start, lags
        finally:
            await generator.aclose()
            await env.aclose()

    server_before = retriever_counts(search_url)
    rollouts, seconds, lags = asyncio.run(main())
    statuses = {}
    for r in rollouts:
        statuses[r.status.value] = statuses.get(r.status.value, 0) + 1
    client = env.metrics()
    print(f"  statuses: {statuses}; env metrics: {client}", flush=True)
    return Result("", len(rollouts), sum(sum(r.env_mask) for r in rollouts), sum(r.num_turns for r in rollouts),
                  sum(r.num_tool_calls for r in rollouts), seconds,
                  search_split(client, server_before, retriever_counts(search_url), lags),
                  tail(rollouts, [r.timings["total_s"] for r in rollouts]))


LAG_PROBE_S = 0.005


async def loop_lag(lags: list[float]) -> None:
    """Append, every ``LAG_PROBE_S``, how late the event loop woke this task: the time a coroutine that is ready
    (a search whose answer has arrived) waits for the loop to run it."""
    loop = asyncio.get_running_loop()
    while True:
        asked = loop.time()
        await asyncio.sleep(LAG_PROBE_S)
        lags.append(loop.time() - asked - LAG_PROBE_S)


@contextlib.asynccontextmanager
async def loop_lag_probe():
    """The lags :func:`loop_lag` records while the block runs."""
    lags: list[float] = []
    probe = asyncio.get_running_loop().create_task(loop_lag(lags))
    try:
        yield lags
    finally:
        probe.cancel()


def retriever_counts(search_url: str) -> dict[str, float]:
    """The retrieval server's cumulative counters (``GET /metrics``)."""
    import httpx

    text = httpx.get(search_url.rsplit("/", 1)[0] + "/metrics", timeout=60).raise_for_status().text
    return parse_prometheus(text)


def search_split(client: dict, before: dict, after: dict, lags: list[float] | None = None) -> dict:
    """Where one run's search time went: the client's mean request latency (from sending to the answer read, as the
    rollouts' loop saw it), the server's (body read to response built, and the encode + search + lookup of a batch
    within it: the rest of the server's is its queue) over the same run, queries per batch, and the client loop's
    lag (:func:`loop_lag`; None where the loop is not ours). Client minus server latency is HTTP plus the client's
    loop being busy elsewhere."""
    delta = {key: after[key] - before.get(key, 0.0) for key in
             ("requests_total", "queries_total", "batches_total", "request_seconds_total", "batch_seconds_total")}
    requests, batches = delta["requests_total"], delta["batches_total"]
    lag = sorted(lags or [])
    return {
        "client_requests": client["search/requests"],
        "client_request_latency_ms": round(client["search/request_latency_s"] * 1e3, 2),
        "server_requests": int(requests),
        "server_request_latency_ms": round(delta["request_seconds_total"] / requests * 1e3, 2) if requests else None,
        "server_batch_ms": round(delta["batch_seconds_total"] / batches * 1e3, 2) if batches else None,
        "server_queries_per_batch": round(delta["queries_total"] / batches, 2) if batches else None,
        "client_loop_lag_ms": {"mean": round(sum(lag) / len(lag) * 1e3, 2), "p90": round(lag[int(0.9 * (len(lag) - 1))]
                               * 1e3, 2), "max": round(lag[-1] * 1e3, 2)} if lag else None,
    }


def tokenizer_with_our_parser(model_path: str, bare_json_tool_calls: bool):
    """A tokenizer for ``GRPOTrainer`` whose ``parse_response`` is the product's parser
    (``searchr1_trl.engine.parsing``).

    TRL 1.16 reads every turn through ``trl.chat_template_utils.parse_response``, which calls the tokenizer's
    ``parse_response(ids, prefix=..., tools=...)`` when a ``response_template`` is set and falls back to plain text on
    ``ValueError``; our parser's None (an unparseable turn) is raised as that. The parser itself runs on a second
    tokenizer, whose own ``parse_response`` it calls.
    """
    from transformers import AutoTokenizer
    from trl.chat_template_utils import add_response_schema

    parse = response_parser(AutoTokenizer.from_pretrained(model_path), [SEARCH_TOOL], bare_json_tool_calls)
    tokenizer = add_response_schema(AutoTokenizer.from_pretrained(model_path))

    def parse_response(ids, prefix=None, tools=None) -> dict:
        message = parse(list(ids), list(prefix or []))
        if message is None:
            raise ValueError("the turn cannot be parsed (searchr1_trl.engine.parsing)")
        return message

    tokenizer.parse_response = parse_response
    return tokenizer


def trl_tool_loop(model_path: str, base_url: str, search_url: str, samples, args, work: Path) -> Result:
    """TRL's GRPOTrainer tool loop on the same server: time ``_generate`` on the same prompts."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer
    from trl.generation.vllm_client import VLLMClient

    retrieval = RetrievalClient(SearchR1EnvConfig(search_url=search_url))

    async def search(query: str):  # no return annotation: it would add a "return" field to the rendered schema
        return await retrieval.search(query)

    # TRL renders a tool's schema from its docstring: the env's SEARCH_TOOL exactly, so both loops get the same prompts.
    function = SEARCH_TOOL["function"]
    search.__doc__ = (f"{function['description']}\n\nArgs:\n"
                      f"    query: {function['parameters']['properties']['query']['description']}\n")

    envs = SearchR1EnvFactory()
    prompts = [envs().reset(s) for s in samples]
    config = GRPOConfig(
        # The policy is not used by _generate in server mode: on the CPU it leaves the GPU to vLLM.
        output_dir=str(work / "trl"), report_to="none", use_cpu=True, bf16=False,
        per_device_train_batch_size=len(prompts), num_generations=2, max_completion_length=args.max_rollout_tokens,
        max_tool_calling_iterations=args.max_turns - 1, temperature=args.temperature, top_p=1.0,
        use_vllm=True, vllm_mode="server", vllm_server_base_url=base_url,
        chat_template_kwargs={"enable_thinking": False},
    )
    # The NCCL weight-transfer handshake of server mode needs CUDA; generation does not, and no weights change here.
    VLLMClient.init_communicator = lambda self, device=0: None
    trainer = GRPOTrainer(
        model=model_path, args=config, reward_funcs=[lambda completions, **kw: [0.0] * len(completions)],
        train_dataset=Dataset.from_list([{"prompt": p} for p in prompts]), tools=[search],
        processing_class=tokenizer_with_our_parser(model_path, args.bare_json_tool_calls),
    )
    trainer.vllm_generation.sync_weights = lambda: None
    trainer.vllm_generation.max_completion_length = args.max_tokens  # per-turn cap, like max_tokens in (a)/(b)
    # What GRPOTrainer._generate_and_score_completions builds before calling _generate (TRL 1.16): per-rollout tools.
    trainer._sync_tool_dicts = [{} for _ in prompts]
    trainer._async_tool_dicts = [{"search": search} for _ in prompts]
    server_before = retriever_counts(search_url)
    start = time.perf_counter()
    _, completion_ids, tool_mask, completions, *_ = trainer._generate(prompts)
    seconds = time.perf_counter() - start
    assistant = [m for c in completions for m in c if m.get("role") == "assistant"]
    client = retrieval.metrics()
    print(f"  retrieval metrics: {client}", flush=True)
    return Result("", len(completion_ids), sum(sum(m) for m in tool_mask), len(assistant),
                  sum(len(m.get("tool_calls") or []) for m in assistant), seconds,
                  search_split(client, server_before, retriever_counts(search_url)))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num_questions", type=int, default=16, help="rollouts per backend (even)")
    parser.add_argument("--max_tokens", type=int, default=128, help="tokens per assistant turn")
    parser.add_argument("--max_turns", type=int, default=3)
    parser.add_argument("--max_rollout_tokens", type=int, default=2048)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--bare_json_tool_calls", action=argparse.BooleanOptionalAction, default=True,
                        help="all three loops read bare-JSON tool calls (RolloutConfig.bare_json_tool_calls); the "
                             "offline model calls tools only that way, so without it its rollouts are one turn")
    parser.add_argument("--transformers_dtype", default="float32", help="float32 is faster than bfloat16 on most CPUs")
    parser.add_argument("--vllm_base_url", help="use this running vLLM server of the model instead of starting one")
    parser.add_argument("--vllm_port", type=int, help="port of the vLLM server the script starts (default: a free one)")
    parser.add_argument("--vllm_gpu", help="CUDA_VISIBLE_DEVICES of the vLLM server the script starts")
    parser.add_argument("--vllm_gpu_memory_utilization", type=float, default=0.9,
                        help="share of the GPU the vLLM server takes (leave room for a padded index on the same GPU)")
    parser.add_argument("--vllm_enforce_eager", action="store_true",
                        help="vLLM without CUDA graphs on GPU (faster start; always on for CPU)")
    parser.add_argument("--model", help="model folder (default: the offline Qwen2.5-Coder-0.5B-Instruct)")
    parser.add_argument("--backends", nargs="+", default=["transformers", "vllm", "trl"],
                        choices=["transformers", "vllm", "trl"])
    parser.add_argument("--repeats", type=int, default=1, help="runs of (a) and (c), in alternating order")
    parser.add_argument("--pad_index_rows", type=int,
                        help="serve the index padded to this many rows by random vectors (wiki-18: 21000000), so "
                             "searches cost what they cost at that scale (experiments/padded_retriever.py)")
    parser.add_argument("--pad_index_dim", type=int, default=768, help="vector width of the padded index")
    parser.add_argument("--retriever_args", default="",
                        help='more flags for the retrieval server, one string: --retriever_args="--device cpu" puts '
                             "its encoder on the host's cores (on a GPU vLLM keeps busy, its kernels queue there)")
    parser.add_argument("--out",
                        help="append the JSON lines to this file (experiments/results/rollout_throughput.jsonl)")
    args = parser.parse_args(argv)
    if args.num_questions < 2 or args.num_questions % 2:
        parser.error(f"--num_questions must be an even number >= 2, got {args.num_questions}")
    if args.temperature == 0 and "trl" in args.backends:
        # Seen on the CPU server: 'n must be 1 when using greedy sampling, got 2'.
        parser.error("--temperature 0 with the trl backend: TRL asks vLLM for num_generations=2 samples per prompt in "
                     "one request, which vLLM refuses for greedy sampling; use a temperature > 0 or drop trl")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assets = require()
    model_path = args.model or assets.model
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    rollout_config = RolloutConfig(max_turns=args.max_turns, max_rollout_tokens=args.max_rollout_tokens,
                                   bare_json_tool_calls=args.bare_json_tool_calls)
    workload_row = {"device": torch.cuda.get_device_name() if device == "cuda" else f"cpu x{os.cpu_count()}",
                    "model": Path(model_path).name, "num_rollouts": args.num_questions, "max_tokens": args.max_tokens,
                    "max_turns": args.max_turns, "temperature": args.temperature,
                    "bare_json_tool_calls": args.bare_json_tool_calls,
                    "index_rows": args.pad_index_rows, "index_dim": args.pad_index_dim if args.pad_index_rows else None,
                    **({"retriever_args": args.retriever_args} if args.retriever_args else {})}
    results = []

    def record(result: Result) -> None:
        results.append(result)
        print(result.line(), flush=True)
        report({**result.row(), **workload_row}, args.out)

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        samples, corpus = workload(assets, args.num_questions, work)
        index = work / "index.faiss"
        subprocess.run([sys.executable, "-m", "retriever_server.build_index", "--corpus_path", str(corpus),
                        "--retriever_model", assets.embedder, "--index_path", str(index)], check=True)
        module, extra_args = "retriever_server.server", shlex.split(args.retriever_args)
        if args.pad_index_rows:
            module = "experiments.padded_retriever"
            extra_args += ["--pad_to_rows", str(args.pad_index_rows), "--pad_to_dim", str(args.pad_index_dim)]
        with RetrieverProcess(index_path=str(index), corpus_path=str(corpus), retriever_model=assets.embedder,
                              port=free_port(), log_file=str(work / "retriever.log"), module=module,
                              extra_args=tuple(extra_args)) as retriever:
            print(f"{len(samples)} rollouts of {len(samples) // 2} questions, {params}, {rollout_config}", flush=True)
            if "transformers" in args.backends:  # before vLLM starts, so they don't share the device
                model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, args.transformers_dtype))
                generator = TransformersGenerator(model.to(device).eval(), tokenizer, max_batch_size=len(samples))
                result = engine_run(tokenizer, generator, retriever.url, samples, params, rollout_config)
                result.backend = f"(b) engine + transformers ({args.transformers_dtype})"
                record(result)
                del model, generator
            if {"vllm", "trl"} & set(args.backends):
                server_config = VLLMServerConfig.for_this_machine(
                    model_path, port=args.vllm_port or free_port(), max_model_len=4096, log_file=str(work / "vllm.log"),
                    gpu_memory_utilization=args.vllm_gpu_memory_utilization,
                    env={"CUDA_VISIBLE_DEVICES": args.vllm_gpu} if args.vllm_gpu is not None else {},
                    **({"enforce_eager": True} if args.vllm_enforce_eager else {}))
                with contextlib.ExitStack() as stack:
                    base_url = args.vllm_base_url or stack.enter_context(VLLMServer(server_config)).base_url
                    warm_up(base_url)
                    served = [b for b in ("vllm", "trl") if b in args.backends]
                    for repeat in range(args.repeats):
                        # Alternate the order, so neither loop always runs on the freshly started server.
                        for backend in served if repeat % 2 == 0 else served[::-1]:
                            workload_row["prefix_cache_reset"] = reset_prefix_cache(base_url)
                            if backend == "vllm":
                                result = engine_run(tokenizer, VLLMServerGenerator(base_url), retriever.url, samples,
                                                    params, rollout_config)
                                result.backend = "(a) engine + vLLM server"
                                record(result)
                                continue
                            try:
                                result = trl_tool_loop(model_path, base_url, retriever.url, samples, args, work)
                                result.backend = "(c) TRL GRPOTrainer tool loop + vLLM"
                                record(result)
                            except Exception as error:  # noqa: BLE001 -- printed; the other backends' numbers stay
                                print(f"(c) TRL GRPOTrainer tool loop could not run: {error!r}", flush=True)
    print("\nsummary")
    for result in results:
        print(result.line())
    ours = [r for r in results if r.backend.startswith("(a)")]
    theirs = [r for r in results if r.backend.startswith("(c)")]
    if ours and theirs:
        def rate(runs, amount):
            return sum(amount(r) for r in runs) / sum(r.seconds for r in runs)

        print(f"(a) / (c) over {len(ours)} + {len(theirs)} runs: "
              f"{rate(ours, lambda r: r.rollouts) / rate(theirs, lambda r: r.rollouts):.2f}x completed rollouts/s, "
              f"{rate(ours, lambda r: r.generated_tokens) / rate(theirs, lambda r: r.generated_tokens):.2f}x "
              f"generated tokens/s")


def warm_up(base_url: str) -> None:
    """One short completion, so the first timed loop does not pay for the server's first request."""
    import httpx

    model = httpx.get(f"{base_url}/v1/models", timeout=60).json()["data"][0]["id"]
    httpx.post(f"{base_url}/v1/completions", timeout=600,
               json={"model": model, "prompt": "Hello", "max_tokens": 8}).raise_for_status()


def reset_prefix_cache(base_url: str) -> bool:
    """Drop the server's prefix cache, so a loop does not reuse the KV of the previous loop's identical prompts;
    False where the server does not offer it (plain ``vllm serve`` outside dev mode)."""
    import httpx

    try:
        return httpx.post(f"{base_url}/reset_prefix_cache", timeout=60).status_code == 200
    except httpx.HTTPError:
        return False

if __name__ == "__main__":
    main()
