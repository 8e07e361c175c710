"""Reliability against the generator server: a ``trl vllm-serve`` started by hand that is killed or hangs stops
training within a bounded time, in one line naming the generator and its URL (and the timeout to raise, where one
ran out), never a bare ``ConnectError`` or ``TimeoutError``.

A killed server is a port nothing listens on, or a fake generator that SIGKILLs itself on the request it gets; a hung
one is a socket that accepts connections and never answers (what a stopped or wedged process looks like to its
clients). The trainer runs are ``searchr1-train`` on the tiny model, its generator that fake (it answers every turn
with the end token, so a step trains); the real vLLM server is shared by the session and cannot be killed here.
Figures go to ``reliability_figures`` (docs/RELIABILITY.md).
"""

from __future__ import annotations

import asyncio
import re
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from searchr1_trl.engine.generation import SamplingParams, VLLMServerGenerator
from searchr1_trl.serving.processes import free_port
from searchr1_trl.serving.vllm_server import GeneratorUnavailable, reload_weights

TIMEOUT_S = 2.0
BOUND_S = 10.0  # a hung generator must stop what waits on it within this, with TIMEOUT_S set


@pytest.fixture
def hung_url():
    """A server that accepts every connection and never answers: the kernel completes the handshakes into the
    listening socket's backlog, and nothing ever reads them."""
    with socket.create_server(("127.0.0.1", 0), backlog=64) as listening:
        yield f"http://127.0.0.1:{listening.getsockname()[1]}"


@pytest.fixture
def failing_url():
    """A server whose engine died: vLLM's API server stays up and answers every request with HTTP 500."""
    from conftest import serve_fake

    died = b'{"error": "EngineDeadError: EngineCore encountered an issue.\n See stack trace"}'
    server = serve_fake(lambda method, path, body: (500, died))
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()
    server.server_close()


def killed_url() -> str:
    return f"http://127.0.0.1:{free_port()}"


def generate(url: str, rollouts: int = 4) -> None:
    """``rollouts`` concurrent turns through the rollout path's client, as the engine sends them."""
    async def main():
        generator = VLLMServerGenerator(url, model="served", timeout_s=TIMEOUT_S)
        try:
            await asyncio.gather(*(generator.generate([1, 2, 3], SamplingParams(max_tokens=4))
                                   for _ in range(rollouts)))
        finally:
            await generator.aclose()

    asyncio.run(main())


def push(url: str) -> None:
    reload_weights(url, "/nonexistent/weights", timeout_s=TIMEOUT_S)


CALLS = {"rollout request": (generate, "generation request (POST /v1/completions)", "generator_timeout_s"),
         "weight push": (push, "weight push (POST /collective_rpc reload_weights)", "weight_sync_timeout_s")}


@pytest.mark.parametrize("call", CALLS)
def test_a_killed_generator_fails_the_call_at_once_in_one_line_naming_it_and_its_url(call):
    function, what, _ = CALLS[call]
    url = killed_url()
    start = time.monotonic()

    with pytest.raises(GeneratorUnavailable) as failure:
        function(url)

    assert time.monotonic() - start < BOUND_S
    assert re.fullmatch(re.escape(f"{what} failed: the generator at {url} could not be reached (") + r"\[Errno 111\] "
                        r"Conn[^\n]+\)\. Is it running\? See its log", str(failure.value)), failure.value


@pytest.mark.parametrize("call", CALLS)
def test_a_hung_generator_fails_the_call_after_its_timeout_naming_it_and_the_setting(call, hung_url,
                                                                                     reliability_figures):
    function, what, setting = CALLS[call]
    start = time.monotonic()

    with pytest.raises(GeneratorUnavailable) as failure:
        function(hung_url)

    waited = time.monotonic() - start
    assert TIMEOUT_S <= waited < BOUND_S
    assert str(failure.value) == (f"{what} failed: the generator at {hung_url} did not answer within 2 s. Is it "
                                  f"running? See its log, and raise {setting} if it is only slow")
    reliability_figures.setdefault("hung_generator_s", {})[call] = round(waited, 1)


@pytest.mark.parametrize("call", CALLS)
def test_a_generator_answering_a_server_error_fails_the_call_in_one_line_showing_its_answer(call, failing_url):
    function, what, _ = CALLS[call]

    with pytest.raises(GeneratorUnavailable) as failure:
        function(failing_url)

    assert str(failure.value) == (f"{what} failed: the generator at {failing_url} answered HTTP 500 "
                                  '({"error": "EngineDeadError: EngineCore encountered an issue. See stack trace"}). '
                                  "See its log")


# TRL's NCCL push as NcclPush drives it on the main process: ``sync_weights`` hangs when given "hung" (the fault: a
# broadcast whose server is gone never returns), then the push's prefix-cache reset goes to the generator at argv[2].
NCCL_PUSH = textwrap.dedent("""
    import sys, time
    from searchr1_trl.serving.weight_sync import NcclPush

    class Client:
        base_url = sys.argv[2]

    class Generation:
        vllm_client = Client()

        def sync_weights(self):
            if sys.argv[1] == "hung":
                time.sleep(3600)

    NcclPush(Generation(), timeout_s=float(sys.argv[3])).push(None)
    time.sleep(2 * float(sys.argv[3]))  # past the deadline: a push that ended must not stop the run later
    print("trained on")
""")


@pytest.mark.parametrize("push_state", ["hung", "done"])
def test_an_nccl_push_that_outlasts_its_timeout_ends_the_run_in_one_line_and_one_that_ends_does_not(push_state):
    from conftest import serve_fake

    generator = serve_fake(lambda method, path, body: (200, b"{}"))  # answers the push's prefix-cache reset
    url = f"http://127.0.0.1:{generator.server_port}"
    try:
        start = time.monotonic()
        pusher = subprocess.run([sys.executable, "-c", NCCL_PUSH, push_state, url, str(TIMEOUT_S)],
                                capture_output=True, text=True, timeout=60)
        ran = time.monotonic() - start
    finally:
        generator.shutdown()
        generator.server_close()

    if push_state == "done":
        assert (pusher.returncode, pusher.stdout, pusher.stderr) == (0, "trained on\n", ""), pusher
        return
    assert pusher.returncode == 1 and pusher.stdout == "", pusher
    assert pusher.stderr == (f"error: weight push (TRL's NCCL sync_weights) failed: the generator at {url} did not "
                             f"answer within 2 s. Is it running? See its log, and raise weight_sync_timeout_s if it "
                             f"is only slow\n")
    assert TIMEOUT_S <= ran < BOUND_S


# A generator that answers health checks, its model list and every turn (with the end token: the rollout ends and
# its step trains), but for the fault it is given: it SIGKILLs itself on the first turn, or never answers a push.
FAKE_GENERATOR = textwrap.dedent("""
    import json, os, signal, sys, time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    fault, end_token, hung_at = sys.argv[1], int(sys.argv[2]), sys.argv[3]

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            self.answer({"data": [{"id": "served"}]})

        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            if fault == "killed during rollouts" and self.path == "/v1/completions":
                os.kill(os.getpid(), signal.SIGKILL)
            if fault == "hung during a weight push" and self.path == "/collective_rpc":
                open(hung_at, "w").write(repr(time.time()))
                time.sleep(3600)
            self.answer({"choices": [{"token_ids": [end_token], "logprobs": {"token_logprobs": [-0.5]},
                                      "finish_reason": "stop"}]})

        def answer(self, body):
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    print(server.server_port, flush=True)
    server.serve_forever()
""")

TRAINER_FAULTS = {
    # refused, or reset when the retry reaches the dying server's socket before it closes: either way one line
    "killed during rollouts": r"generation request \(POST /v1/completions\) failed: the generator at {url} (could not "
                              r"be reached \(\[Errno 111\]|dropped the connection \(\[Errno 104\]) Conn[^\n]+\)\. "
                              r"Is it running\? See its log",
    "hung during a weight push": r"weight push \(POST /collective_rpc reload_weights\) failed: the generator at {url} "
                                 r"did not answer within 2 s\. Is it running\? See its log, and raise "
                                 r"weight_sync_timeout_s if it is only slow",
}


# two trainer runs of the tiny model on CPU (the second trains a step before its push): 13 s and 17 s
@pytest.mark.slow
@pytest.mark.parametrize("fault", TRAINER_FAULTS)
def test_training_stops_in_one_line_naming_the_generator_when_it_is_killed_or_hangs(fault, tiny_model_dir, tokenizer,
                                                                                    tmp_path, caplog, capfd,
                                                                                    reliability_figures):
    from conftest import serve_health

    from searchr1_trl.cli.train import main as train_main

    hung_at = tmp_path / "hung_at"
    generator = subprocess.Popen([sys.executable, "-c", FAKE_GENERATOR, fault, str(tokenizer.eos_token_id),
                                  str(hung_at)], stdout=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{int(generator.stdout.readline())}"
    retriever = serve_health()
    try:
        with pytest.raises(SystemExit) as stop:
            train_main(["--config", "offline", "--model_name_or_path", str(tiny_model_dir), "--output_dir",
                        str(tmp_path / "run"), "--use_peft", "false", "--max_steps", "2", "--save_strategy", "no",
                        "--max_turns", "1", "--max_tokens_per_turn", "8", "--vllm_server_base_url", url,
                        "--search_url", f"http://127.0.0.1:{retriever.server_port}/retrieve",
                        "--generator_timeout_s", str(TIMEOUT_S), "--weight_sync_timeout_s", str(TIMEOUT_S)])
        stopped = time.time()
    finally:
        generator.kill()
        generator.wait()
        retriever.shutdown()

    assert re.fullmatch("error: " + TRAINER_FAULTS[fault].format(url=re.escape(url)), stop.value.code), stop.value.code
    assert "Traceback" not in capfd.readouterr().err
    assert [r.getMessage() for r in caplog.records if r.levelname in ("ERROR", "CRITICAL")] == []
    if fault == "hung during a weight push":
        waited = stopped - float(hung_at.read_text())
        assert TIMEOUT_S <= waited < BOUND_S
        reliability_figures.setdefault("hung_generator_s", {})["weight push in training"] = round(waited, 1)
    reliability_figures.setdefault("generator_lost_in_training", {})[fault] = re.sub(
        r"(127\.0\.0\.1(:|', ))\d+", r"\1PORT", stop.value.code)
