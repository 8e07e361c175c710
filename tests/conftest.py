"""Shared fixtures: the real parts (offline assets, a vLLM server on CPU, the retrieval server), started once per
session.

Servers are started by the tests themselves, never by hand, so a fresh clone on a fresh machine passes.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from retriever_server.launch import RetrieverProcess
from searchr1_trl.serving.processes import free_port
from tests.suite_memory import (  # noqa: F401 - the suite's memory peak, reported at the end of every run
    pytest_runtest_logstart,
    pytest_sessionfinish,
    pytest_sessionstart,
    pytest_terminal_summary,
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# SQuAD dev articles whose paragraphs form the small test corpus (and whose questions the tests ask).
TEST_CORPUS_ARTICLES = 8


@functools.cache
def script(name: str):
    """``scripts/<name>.py`` as a module, loaded once: tests run a script's ``main()`` in their own process where a
    fresh interpreter would only add the imports (TRL's alone takes ~10 s)."""
    path = Path(__file__).resolve().parent.parent / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def reliability_size(suite: int, full: int) -> int:
    """How much a reliability test fuzzes or loads: ``full`` where experiments/reliability.py runs it to write the
    figures of docs/RELIABILITY.md (it sets RELIABILITY_FULL_SIZE=1), ``suite`` in the test suite, which checks the
    same property on less."""
    return full if os.environ.get("RELIABILITY_FULL_SIZE") == "1" else suite


def serve_fake(answer, port: int | None = None) -> ThreadingHTTPServer:
    """A stand-in HTTP server, running in a thread on ``port`` (a free one by default), for faults injected on
    purpose: ``answer(method, path, body)`` (``body`` the parsed JSON of a POST, None for a GET or an empty POST)
    gives the status and the bytes to send. A client that hung up first is not an error. The caller shuts it down."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            self._send(*answer("GET", self.path, None))

        def do_POST(self):
            raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            self._send(*answer("POST", self.path, json.loads(raw) if raw else None))

        def _send(self, status: int, body: bytes) -> None:
            try:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client timed out and hung up

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", port or free_port()), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def _healthy(method: str, path: str, body: dict | None) -> tuple[int, bytes]:
    if method == "GET":
        return 200, b""
    # a search: one passage per query, as a retriever's probe check expects
    return 200, json.dumps({"result": [[{"contents": f"T\n{q}"}] for q in body["queries"]]}).encode()


def serve_health(port: int | None = None) -> ThreadingHTTPServer:
    """A stand-in server that answers every GET with 200 and every search with one passage per query: for checks
    that only ask whether some server is up and answers. The caller shuts it down."""
    return serve_fake(_healthy, port)


# A generic tool for rollout and parsing tests that need no real search.
LOOKUP_TOOL = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "Look a fact up.",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
    },
}


def template_tokenizer(offline_assets, template: str | None):
    """A fresh offline Qwen2.5 tokenizer with its own chat template (None) or one of TRL's bundled templates."""
    import trl
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(offline_assets.model)
    if template:
        tokenizer.chat_template = (Path(trl.__file__).parent / "chat_templates" / template).read_text()
    return tokenizer


def accelerate_launch(config: str, *command: str) -> subprocess.CompletedProcess:
    """``accelerate launch`` of ``command`` under ``accelerate_configs/<config>``, one CPU process, no mixed
    precision: DeepSpeed's bf16 setting must match the trainer's, which is off on CPU."""
    repo = Path(__file__).resolve().parent.parent
    return subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                           str(repo / "accelerate_configs" / config), "--num_processes", "1", "--mixed_precision", "no",
                           *command],
                          cwd=repo, capture_output=True, text=True, timeout=900)


def servable_tiny_qwen2(tokenizer, tied: bool):
    """A random 2-layer bf16 Qwen2 (seed 0) that a CPU vLLM server can serve: head_dim 64, vLLM's CPU attention having
    no kernel for smaller heads."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=4096,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                         tie_word_embeddings=tied)
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config).to(torch.bfloat16)


@pytest.fixture(scope="session")
def offline_assets():
    from searchr1_trl.assets.offline import require

    return require()


@pytest.fixture(scope="session")
def tokenizer(offline_assets):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(offline_assets.model)


@pytest.fixture(scope="session")
def tiny_model_dir(offline_assets, tmp_path_factory) -> Path:
    """A randomly initialised 2-layer Qwen2 with the real Qwen2.5 tokenizer and tool-calling chat template."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(offline_assets.model)
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    path = tmp_path_factory.mktemp("tiny-qwen2")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def lora_checkpoint(tiny_model_dir, offline_assets, tmp_path_factory) -> Path:
    """What the CPU recipe (LoRA) saves, on the tiny model: the trainer's ``save_model`` of a LoRA run, an adapter
    folder (adapter_config.json naming the tiny model as its base, adapter weights, tokenizer), its adapters moved
    off zero so that it answers otherwise than its base."""
    import torch
    from peft import LoraConfig

    from searchr1_trl.training.trainer import SearchR1Config, SearchR1Trainer

    work = tmp_path_factory.mktemp("lora")
    args = SearchR1Config(output_dir=str(work / "run"), use_cpu=True, bf16=False, report_to="none", max_steps=1,
                          per_device_train_batch_size=2, num_generations=2, eval_strategy="no", save_strategy="no",
                          train_data_path=offline_assets.test_questions, generator="transformers")
    trainer = SearchR1Trainer(model=str(tiny_model_dir), args=args,
                              peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    torch.manual_seed(0)
    with torch.no_grad():
        for name, parameter in trainer.model.named_parameters():
            if "lora_B" in name:
                parameter.add_(torch.randn_like(parameter))
    trainer.save_model(str(work / "adapter"))
    return work / "adapter"


@pytest.fixture(scope="session")
def squad_dev_sample(offline_assets):
    """(corpus rows, question rows) for the first TEST_CORPUS_ARTICLES SQuAD dev articles."""
    import pandas as pd

    questions = pd.read_parquet(offline_assets.test_questions)
    titles = list(dict.fromkeys(questions["title"]))[:TEST_CORPUS_ARTICLES]
    questions = questions[questions["title"].isin(titles)].reset_index(drop=True)
    corpus = []
    with open(offline_assets.corpus) as f:
        for line in f:
            row = json.loads(line)
            if row["contents"].split("\n", 1)[0] in titles:
                corpus.append(row)
    return corpus, questions


@pytest.fixture(scope="session")
def vllm_server(offline_assets, tmp_path_factory):
    """A real `trl vllm-serve` on CPU serving the offline Qwen2.5-Coder-0.5B-Instruct (with the CUDA IPC weight
    loader installed, whose CPU refusal a test checks)."""
    from searchr1_trl.serving.vllm_server import VLLMServer, VLLMServerConfig
    from searchr1_trl.serving.weight_sync import IPC_WORKER_EXTENSION

    log = tmp_path_factory.mktemp("vllm") / "server.log"
    config = VLLMServerConfig.for_this_machine(offline_assets.model, port=free_port(), max_model_len=4096,
                                               log_file=str(log), startup_timeout_s=1200,
                                               worker_extension_cls=IPC_WORKER_EXTENSION)
    with VLLMServer(config) as server:
        yield server


@pytest.fixture(scope="session")
def retriever_server(offline_assets, squad_dev_sample, tmp_path_factory) -> RetrieverProcess:
    """A real retrieval server (offline MiniLM embedder, exact faiss index) over the small SQuAD dev corpus."""
    corpus_rows, _ = squad_dev_sample
    work = tmp_path_factory.mktemp("retriever")
    corpus = work / "corpus.jsonl"
    corpus.write_text("".join(json.dumps(row) + "\n" for row in corpus_rows))
    index = work / "index.faiss"
    subprocess.run(
        [sys.executable, "-m", "retriever_server.build_index", "--corpus_path", str(corpus),
         "--retriever_model", offline_assets.embedder, "--index_path", str(index)],
        check=True,
    )
    with RetrieverProcess(index_path=str(index), corpus_path=str(corpus), retriever_model=offline_assets.embedder,
                          port=free_port(), log_file=str(work / "server.log")) as server:
        yield server


@pytest.fixture(scope="session")
def retriever_url(retriever_server) -> str:
    return retriever_server.url


@pytest.fixture(scope="session")
def reliability_figures():
    """Figures the reliability tests measure; written as JSON to $RELIABILITY_FIGURES (experiments/reliability.py
    renders them into docs/RELIABILITY.md) when that variable is set."""
    figures: dict = {}
    yield figures
    if os.environ.get("RELIABILITY_FIGURES"):
        Path(os.environ["RELIABILITY_FIGURES"]).write_text(json.dumps(figures, indent=2, sort_keys=True) + "\n")


@pytest.fixture(scope="session")
def questions_file(squad_dev_sample, tmp_path_factory) -> str:
    """SQuAD dev questions whose paragraphs are in the test retriever's corpus."""
    _, questions = squad_dev_sample
    path = tmp_path_factory.mktemp("questions") / "questions.parquet"
    questions.to_parquet(path, index=False)
    return str(path)


@pytest.fixture(scope="session")
def two_source_questions(squad_dev_sample, tmp_path_factory) -> str:
    """The test corpus's SQuAD dev questions under two data sources (by article parity), as a parquet."""
    _, questions = squad_dev_sample
    titles = list(dict.fromkeys(questions["title"]))
    questions = questions.assign(data_source=["squad_even" if titles.index(t) % 2 == 0 else "squad_odd"
                                              for t in questions["title"]])
    path = tmp_path_factory.mktemp("eval_questions") / "questions.parquet"
    questions.to_parquet(path, index=False)
    return str(path)


# Fixtures that boot a real server: vLLM on CPU takes minutes, the retriever builds an index first.
SERVER_FIXTURES = {"vllm_server", "retriever_server"}


def pytest_collection_modifyitems(items):
    """Every test that needs a real server (directly or through another fixture) is ``slow``, so ``-m "not slow"``
    boots none.

    The modules that use the shared vLLM server run last, in their order: the server lives from its first user to
    the end of the session, and the tests that start a vLLM server of their own (the CPU job, ZeRO-3) then run
    before it, not beside it (two CPU engines and a trainer exceed the suite's memory bound, tests/suite_memory.py).
    Whole modules move, so no module-scoped fixture is set up twice."""
    shared = set()
    for item in items:
        names = set(getattr(item, "fixturenames", ()))
        if SERVER_FIXTURES & names:
            item.add_marker(pytest.mark.slow)
        if "vllm_server" in names:
            shared.add(item.module.__name__)
    items.sort(key=lambda item: item.module.__name__ in shared)
