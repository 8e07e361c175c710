"""searchr1-ask: watch a checkpoint answer a question: each search query, the titles of the passages it got, the answer.

    searchr1-ask --checkpoint <folder or Hub id> --question "Who won Super Bowl 50?"
    searchr1-ask --checkpoint <folder or Hub id>                   # interactive: one question per line, Ctrl-D ends
    searchr1-ask --checkpoint <...> --question "..." --json        # one JSON object per question, for scripts

The rollout is the evaluation's (searchr1_trl/training/evaluation.py): greedy, the ``agent`` method by default,
against a running retriever (``--search_url``) and a generator (``--generator vllm`` with a ``trl vllm-serve`` serving
the checkpoint, or ``transformers`` in-process, where a LoRA adapter folder, what the CPU recipe saves, loads on its
base model). Use the env and rollout settings the checkpoint was trained with (``--restate_question``,
``--bare_json_tool_calls``, ``--max_turns``, ``--topk``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from dataclasses import asdict, dataclass, field

from searchr1_trl.cli.eval import PolicyConfig
from searchr1_trl.serving.vllm_server import GeneratorUnavailable
from searchr1_trl.tasks import get_task
from searchr1_trl.training import evaluation
from searchr1_trl.training.recipe import part_config


@dataclass
class AskConfig:
    checkpoint: str = field(default="", metadata={"help": "Model folder, LoRA adapter folder or Hub id."})
    question: str | None = field(default=None, metadata={"help": "The question; none: read questions from stdin."})
    json: bool = field(default=False, metadata={"help": "Print one JSON object per question instead of text."})
    method: str = field(default="agent", metadata={"help": f"One of {', '.join(evaluation.METHODS)} that the task "
                                                             "supports."})
    generator: str = field(
        default="vllm", metadata={"help": "`vllm`: a running `trl vllm-serve` of the checkpoint; `transformers`."})
    vllm_server_base_url: str = field(default="http://127.0.0.1:8001", metadata={"help": "With generator=vllm."})
    dtype: str = field(default="auto", metadata={"help": "With generator=transformers: weight dtype."})


def render(trace: evaluation.Trace) -> str:
    """The trace as a reader follows it: searches with their passage titles, then the answer."""
    lines = [f"question: {trace.question}"]
    for number, search in enumerate(trace.searches, start=1):
        lines.append(f"search {number}: {search['query']}")
        lines += [f"  - {title}" for title in search["titles"]]
    lines.append(f"answer: {trace.answer if trace.answer is not None else '(none)'}"
                 f"   [{trace.status}, {trace.num_turns} turn(s)]")
    return "\n".join(lines)


async def _answer(config: AskConfig, policy, questions) -> None:
    tokenizer = evaluation.policy_tokenizer(config.checkpoint)
    generator = evaluation.policy_generator(config.generator, config.checkpoint, tokenizer,
                                            url=config.vllm_server_base_url, dtype=config.dtype)
    task = get_task(policy.task)
    method = evaluation.build_method(config.method, task, tokenizer, generator, part_config(policy, "env"),
                                     part_config(policy, "rollout"))
    params = evaluation.greedy_params(policy.max_tokens_per_turn)
    try:
        for question in questions:
            if not question.strip():
                continue
            [trace] = await evaluation.run(method, [task.sample(question.strip(), ("",))], params)
            if config.json:
                record = asdict(trace)
                for unknown in ("golden_answers", "em", "f1", "data_source", "gold_in_first_search"):  # no gold here
                    record.pop(unknown)
                print(json.dumps(record), flush=True)
            else:
                print(render(trace) + "\n", flush=True)
    finally:
        await method.aclose()
        await generator.aclose()


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults after each flag, the description as written."""


def _stdin_questions():
    """Questions typed one per line (a prompt when stdin is a terminal)."""
    while True:
        if sys.stdin.isatty():
            print("question> ", end="", file=sys.stderr, flush=True)
        line = sys.stdin.readline()
        if not line:
            return
        yield line


def main(argv: list[str] | None = None) -> None:
    from searchr1_trl.training.loading import RecipeParser

    parser = RecipeParser((AskConfig, PolicyConfig), description=__doc__,
                          formatter_class=_HelpFormatter, prog="searchr1-ask")
    logging.basicConfig(level=logging.WARNING, format="[searchr1-ask] %(message)s")
    try:
        config, policy = parser.parse_args_and_config(args=argv)
        if not config.checkpoint:
            raise ValueError("give --checkpoint (a model folder or Hub id; see --help)")
        if config.method not in get_task(policy.task).methods:
            raise ValueError(f"method={config.method!r}; task {policy.task} supports "
                             f"{', '.join(get_task(policy.task).methods)}")
        questions = [config.question] if config.question is not None else _stdin_questions()
        asyncio.run(_answer(config, policy, questions))
    except (ValueError, GeneratorUnavailable) as error:
        sys.exit(f"error: {error}")


if __name__ == "__main__":
    main()
