"""Engine overhead: the CPU time the rollout engine's own process spends per rollout-turn, around a model that answers
instantly, against the real retrieval server.

On one H200 our engine completed 0.75x TRL's rollouts/s with the 0.5B model, though vLLM generates far faster for a
model that size than either loop asked it to: the suspect was the engine's own process. This benchmark removes the
model: a scripted generator plays each rollout's turns at once (search the question's last words, search again on
odd-length prompts, then answer), so what is left is the engine's own work per turn (chat template, tokenizer,
parser, environment, asyncio) plus its retrieval client. The retriever is the real server over the passages of
``rollout_throughput``'s workload, in its own process, so its time is not counted; ``--generator http`` puts the
same script behind a fake ``/v1/completions`` server (also its own process; it answers with vLLM's response shape,
prompt ids and per-token logprobs included) to add ``VLLMServerGenerator``'s request path.

The figure is the benchmark process's CPU time (all its threads) divided by the rollout-turns of the run; wall time
is printed too, but on a small machine it includes the retriever's and fake server's share of the cores. Each row
also splits a search request's time between the client, the server and the engine's busy event loop
(``rollout_throughput.search_split``).
``--profile`` adds a cProfile breakdown of one more run (per rollout-turn, inflated by the profiler):

    python -m experiments.engine_overhead --num_rollouts 512 --generator instant http --profile \
        --out experiments/results/engine_overhead.jsonl
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import os
import pstats
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from experiments.report import report
from experiments.rollout_throughput import loop_lag_probe, retriever_counts, search_split, workload
from retriever_server.launch import RetrieverProcess
from searchr1_trl.assets.offline import require
from searchr1_trl.engine.generation import Generation, Generator, SamplingParams, VLLMServerGenerator
from searchr1_trl.engine.rollout import RolloutConfig, RolloutEngine
from searchr1_trl.serving.processes import free_port
from searchr1_trl.tasks.common.search import SearchR1EnvConfig
from searchr1_trl.tasks.search_r1.env import SearchR1EnvFactory


class Script:
    """The turns an instant model plays, a function of the prompt ids alone (so the in-process generator and the
    fake server play the same): turn 1 searches the last words of the question, turn 2 searches again when the
    prompt has an odd length (about half the rollouts), then it answers. Written for Qwen's chat template (turns are
    counted by ``<|im_start|>``) and in the bare-JSON form the offline model uses."""

    QUESTION_TOKENS = 6

    def __init__(self, tokenizer):
        self.im_start, self.im_end = tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
        self.call_open = tokenizer.encode('{"name": "search", "arguments": {"query": "')
        self.call_close = [*tokenizer.encode('"}}'), self.im_end]
        self.answer = [*tokenizer.encode("Denver Broncos"), self.im_end]

    def turn(self, prompt_ids: list[int]) -> list[int]:
        turns_before = (prompt_ids.count(self.im_start) - 3) // 2  # system, user, header; then tool turn + header
        user = prompt_ids.index(self.im_start, prompt_ids.index(self.im_start) + 1)
        question_end = prompt_ids.index(self.im_end, user)
        query = prompt_ids[question_end - self.QUESTION_TOKENS: question_end]
        if turns_before == 0 or (turns_before == 1 and len(prompt_ids) % 2):
            return self.call_open + query + self.call_close
        return self.answer


class InstantGenerator(Generator):
    def __init__(self, script: Script):
        self.script = script

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        token_ids = self.script.turn(prompt_ids)
        return Generation(token_ids, [-0.25] * len(token_ids), "stop")


def serve_fake_vllm(port: int, model_path: str) -> None:
    """A minimal HTTP/1.1 keep-alive server answering ``POST /v1/completions`` at once with the script's turn, in
    vLLM 0.26's response shape for ``logprobs=0, return_token_ids=True``."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    script = Script(tokenizer)

    def completion(request: dict) -> bytes:
        prompt, ids = request["prompt"], script.turn(request["prompt"])
        tokens = tokenizer.convert_ids_to_tokens(ids)
        text = tokenizer.decode(ids)
        choice = {
            "index": 0, "text": text,
            "logprobs": {"text_offset": list(range(len(ids))), "token_logprobs": [-0.25] * len(ids), "tokens": tokens,
                         "top_logprobs": [{token: -0.25} for token in tokens]},
            "finish_reason": "stop", "stop_reason": None, "prompt_logprobs": None, "prompt_token_ids": prompt,
            "token_ids": ids,
        }
        return json.dumps({"id": "cmpl-0", "object": "text_completion", "created": 0, "model": request["model"],
                           "choices": [choice], "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(ids),
                                                          "total_tokens": len(prompt) + len(ids)}}).encode()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError:  # the client closed the connection
                break
            lines = head.decode().split("\r\n")
            headers = dict(line.split(": ", 1) for line in lines[1:] if ": " in line)
            length = int({k.lower(): v for k, v in headers.items()}.get("content-length", 0))
            body = await reader.readexactly(length) if length else b""
            answer = completion(json.loads(body)) if lines[0].startswith("POST") else b'{"status": "ok"}'
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                         % (len(answer), answer))
            await writer.drain()
        writer.close()

    async def main():
        server = await asyncio.start_server(handle, "127.0.0.1", port, backlog=1024)
        async with server:
            await server.serve_forever()

    asyncio.run(main())


def wait_for_port(port: int, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise RuntimeError(f"the fake vLLM server did not listen on port {port} within {timeout_s} s")


def run_once(engine: RolloutEngine, samples, params: SamplingParams, search_url: str,
             profile: cProfile.Profile | None = None):
    """(rollouts, wall s, CPU s of this process, where the searches' time went: :func:`search_split`) of one
    engine.run."""

    async def main():
        try:
            async with loop_lag_probe() as lags:
                rollouts = await engine.run(samples, params)
            return rollouts, lags
        finally:
            await engine.generator.aclose()
            await engine.envs.aclose()

    server_before = retriever_counts(search_url)
    wall, cpu = time.perf_counter(), time.process_time()
    if profile:
        profile.enable()
    rollouts, lags = asyncio.run(main())
    if profile:
        profile.disable()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return rollouts, wall, cpu, search_split(engine.envs.metrics(), server_before, retriever_counts(search_url), lags)


# Where a rollout-turn's time goes: cumulative time of these functions (file suffix, name) in the profile.
PARTS = {
    "chat template (jinja)": [("utils/chat_template_utils.py", "render_jinja_template")],
    "tokenizer (encode)": [("transformers/tokenization_utils_base.py", "__call__"),
                           ("transformers/tokenization_utils_base.py", "encode")],
    "parser": [("searchr1_trl/engine/parsing.py", "parse_turn")],
    "env.step (retrieval client)": [("searchr1_trl/tasks/search_r1/env.py", "step")],
    "generator.generate (HTTP client)": [("searchr1_trl/engine/generation.py", "generate"),
                                         ("experiments/engine_overhead.py", "generate")],
}


def breakdown(profile: cProfile.Profile, turns: int) -> dict[str, float]:
    """Microseconds per rollout-turn of each of PARTS, of everything else the process did (the engine's loop,
    asyncio, HTTP) and of its idle wait for the servers (the event loop's selector)."""
    stats = pstats.Stats(profile).stats
    idle = sum(own for (_, _, name), (_, _, own, _, _) in stats.items() if name.startswith("<method 'poll' of 'select"))
    busy = sum(own for _, _, own, _, _ in stats.values()) - idle
    parts = {
        part: sum(cumulative for (file, _, name), (_, _, _, cumulative, _) in stats.items()
                  if any(file.endswith(suffix) and name == function for suffix, function in functions))
        for part, functions in PARTS.items()
    }
    parts["other (engine loop, asyncio)"] = busy - sum(parts.values())
    parts["idle (waiting for the servers)"] = idle
    return {part: round(seconds / turns * 1e6) for part, seconds in parts.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num_rollouts", type=int, default=512, help="rollouts per run (even)")
    parser.add_argument("--generator", nargs="+", default=["instant", "http"], choices=["instant", "http"])
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per generator (after one warm-up run)")
    parser.add_argument("--profile", action="store_true", help="add a cProfile breakdown of one more run")
    parser.add_argument("--profile_dump", help="also write the profile to <this>.<generator> (for pstats)")
    parser.add_argument("--label", default="", help="written into each JSON line, e.g. the commit measured")
    parser.add_argument("--out", help="append the JSON lines to this file (experiments/results/engine_overhead.jsonl)")
    parser.add_argument("--fake_vllm_port", type=int, help=argparse.SUPPRESS)  # the fake server's own process
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    assets = require()
    if args.fake_vllm_port:
        serve_fake_vllm(args.fake_vllm_port, assets.model)
        return

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(assets.model)
    script = Script(tokenizer)
    params = SamplingParams(temperature=1.0, max_tokens=128)
    rollout_config = RolloutConfig(max_turns=3, max_rollout_tokens=2048, bare_json_tool_calls=True)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        samples, corpus = workload(assets, args.num_rollouts, work)
        index = work / "index.faiss"
        subprocess.run([sys.executable, "-m", "retriever_server.build_index", "--corpus_path", str(corpus),
                        "--retriever_model", assets.embedder, "--index_path", str(index)], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        port = free_port()
        fake = subprocess.Popen([sys.executable, "-m", "experiments.engine_overhead", "--fake_vllm_port", str(port)])
        try:
            wait_for_port(port)
            with RetrieverProcess(index_path=str(index), corpus_path=str(corpus), retriever_model=assets.embedder,
                                  port=free_port(), log_file=str(work / "retriever.log")) as retriever:
                for name in args.generator:
                    def engine(name=name):
                        generator = (InstantGenerator(script) if name == "instant" else
                                     VLLMServerGenerator(f"http://127.0.0.1:{port}", model="fake"))
                        return RolloutEngine(tokenizer, generator, SearchR1EnvFactory(SearchR1EnvConfig(
                            search_url=retriever.url)), rollout_config)

                    for repeat in range(args.repeats + 1):
                        rollouts, wall, cpu, searching = run_once(engine(), samples, params, retriever.url)
                        if repeat == 0:
                            continue  # warm-up: the retriever's and the fake server's first requests
                        turns = sum(r.num_turns for r in rollouts)
                        report({"label": args.label, "generator": name, "rollouts": len(rollouts), "turns": turns,
                                "searches": sum(r.num_tool_calls for r in rollouts),
                                "cpu_us_per_turn": round(cpu / turns * 1e6), "wall_us_per_turn":
                                round(wall / turns * 1e6), "cpu_s": round(cpu, 3), "wall_s": round(wall, 3),
                                **searching}, args.out)
                    if args.profile:
                        profile = cProfile.Profile()
                        rollouts, *_ = run_once(engine(), samples, params, retriever.url, profile)
                        turns = sum(r.num_turns for r in rollouts)
                        if args.profile_dump:
                            profile.dump_stats(f"{args.profile_dump}.{name}")
                        report({"label": args.label, "generator": name, "turns": turns,
                                "profiled_us_per_turn": breakdown(profile, turns)}, args.out)
        finally:
            fake.terminate()
            fake.wait()


if __name__ == "__main__":
    main()
