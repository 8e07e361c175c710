"""Generator backends: the in-process transformers backend on a tiny random Qwen2, the vLLM client's error handling.

The vLLM client against a real server is covered by tests/test_rollout_integration.py.
"""

from __future__ import annotations

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from searchr1_trl.engine.generation import SamplingParams, VLLMServerGenerator, end_token_ids
from searchr1_trl.engine.in_process import TransformersGenerator
from searchr1_trl.serving.processes import free_port
from searchr1_trl.serving.vllm_server import GeneratorUnavailable
from tests.conftest import serve_fake

PROMPTS = [[151644, 872, 198, 9707], [151644, 872, 198, 3838, 374, 279, 6722, 315, 9625, 30], [9707, 11, 1879]]


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    """(model in float32, so batched and single runs agree to rounding, tokenizer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(tiny_model_dir)


class CountingModel:
    """The model with its ``generate`` calls counted (batch size of each)."""

    def __init__(self, model):
        self.model = model
        self.batch_sizes: list[int] = []

    def __getattr__(self, name):
        return getattr(self.model, name)

    def generate(self, input_ids, **kwargs):
        self.batch_sizes.append(len(input_ids))
        return self.model.generate(input_ids=input_ids, **kwargs)


def generate_all(generator, prompts, params):
    async def main():
        return await asyncio.gather(*(generator.generate(p, params) for p in prompts))

    return asyncio.run(main())


def test_calls_issued_together_become_one_generate_call_with_the_same_results_as_alone(tiny):
    model, tokenizer = tiny
    counting = CountingModel(model)
    generator = TransformersGenerator(counting, tokenizer)
    params = SamplingParams.greedy(max_tokens=6)

    together = generate_all(generator, PROMPTS, params)
    alone = [generate_all(generator, [p], params)[0] for p in PROMPTS]

    assert counting.batch_sizes == [3, 1, 1, 1]
    assert [g.token_ids for g in together] == [g.token_ids for g in alone]
    for batched, single in zip(together, alone, strict=True):
        assert batched.logprobs == pytest.approx(single.logprobs, abs=1e-4)


def test_max_batch_size_splits_a_large_group_into_several_generate_calls(tiny):
    model, tokenizer = tiny
    counting = CountingModel(model)
    generator = TransformersGenerator(counting, tokenizer, max_batch_size=2)

    generate_all(generator, PROMPTS + PROMPTS[:2], SamplingParams.greedy(max_tokens=2))

    assert counting.batch_sizes == [2, 2, 1]


def test_calls_with_different_temperatures_are_generated_separately(tiny):
    model, tokenizer = tiny
    counting = CountingModel(model)
    generator = TransformersGenerator(counting, tokenizer)

    async def main():
        return await asyncio.gather(
            generator.generate(PROMPTS[0], SamplingParams.greedy(max_tokens=2)),
            generator.generate(PROMPTS[1], SamplingParams(temperature=0.7, max_tokens=2)),
            generator.generate(PROMPTS[2], SamplingParams.greedy(max_tokens=2)),
        )

    asyncio.run(main())
    assert counting.batch_sizes == [2, 1]


def test_calls_differing_only_in_max_tokens_share_a_batch_and_each_gets_its_own_length(tiny):
    model, tokenizer = tiny
    counting = CountingModel(model)
    generator = TransformersGenerator(counting, tokenizer)

    async def main():
        return await asyncio.gather(*(generator.generate(PROMPTS[0], SamplingParams.greedy(n)) for n in (2, 5)))

    short, long = asyncio.run(main())
    assert counting.batch_sizes == [2]
    assert (len(short.token_ids), len(long.token_ids)) == (2, 5)
    assert short.token_ids == long.token_ids[:2] and short.finish_reason == long.finish_reason == "length"


def test_greedy_decoding_is_deterministic(tiny):
    model, tokenizer = tiny
    generator = TransformersGenerator(model, tokenizer)
    params = SamplingParams.greedy(max_tokens=8)

    first, second = (generate_all(generator, PROMPTS, params) for _ in range(2))

    assert [g.token_ids for g in first] == [g.token_ids for g in second]


def forward_logprobs(model, prompt, generated, temperature=1.0):
    """log_softmax(logits / temperature) of each generated token, from one forward pass over prompt + generated."""
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + generated])).logits[0, len(prompt) - 1 : -1].float()
    logprobs = torch.log_softmax(logits / temperature, dim=-1)
    return logprobs.gather(-1, torch.tensor(generated).unsqueeze(-1)).squeeze(-1).tolist()


def test_greedy_logprobs_are_the_models_logprobs_of_each_generated_token(tiny):
    model, tokenizer = tiny
    [generation] = generate_all(TransformersGenerator(model, tokenizer), PROMPTS[1:2], SamplingParams.greedy(5))

    assert len(generation.logprobs) == len(generation.token_ids) == 5
    assert generation.logprobs == pytest.approx(forward_logprobs(model, PROMPTS[1], generation.token_ids), abs=1e-4)


def test_sampled_logprobs_are_after_temperature_like_vllms_processed_logprobs(tiny):
    model, tokenizer = tiny
    torch.manual_seed(0)
    params = SamplingParams(temperature=0.5, top_p=1.0, max_tokens=5)
    [generation] = generate_all(TransformersGenerator(model, tokenizer), PROMPTS[1:2], params)

    expected = forward_logprobs(model, PROMPTS[1], generation.token_ids, temperature=0.5)
    assert generation.logprobs == pytest.approx(expected, abs=1e-4)


def test_top_p_logprobs_are_over_the_nucleus_renormalised_and_no_step_keeps_the_whole_vocabulary(tiny):
    # vLLM's processed logprobs after top-p: a token's logprob among the nucleus alone. generate's output_scores would
    # keep a [rows, vocab] tensor for every step (40 GiB at 256 rows x 256 tokens of Qwen's vocabulary), so the
    # generator must not ask for them.
    model, tokenizer = tiny
    counting = CountingModel(model)
    configs = []
    counting.generate = lambda input_ids, **kwargs: configs.append(kwargs["generation_config"]) or model.generate(
        input_ids=input_ids, **kwargs)
    torch.manual_seed(0)
    [generation] = generate_all(TransformersGenerator(counting, tokenizer), PROMPTS[1:2],
                                SamplingParams(temperature=0.7, top_p=0.5, max_tokens=5))

    with torch.inference_mode():
        logits = model(torch.tensor([PROMPTS[1] + generation.token_ids])).logits[0, len(PROMPTS[1]) - 1:-1].float()
    expected = []
    for step, token in zip(logits / 0.7, generation.token_ids, strict=True):
        probs = torch.softmax(step, dim=-1)
        ordered, order = probs.sort(descending=True)
        nucleus = order[: int((ordered.cumsum(0) - ordered < 0.5).sum())]  # the smallest set holding 0.5 of the mass
        assert token in nucleus.tolist()
        expected.append(torch.log_softmax(step[nucleus], dim=-1)[nucleus.tolist().index(token)].item())
    assert generation.logprobs == pytest.approx(expected, abs=1e-4)
    assert len(configs) == 1 and not configs[0].output_scores


def test_generation_stops_at_an_eos_token_and_keeps_it_as_finish_reason_stop(tiny):
    model, tokenizer = tiny
    params = SamplingParams.greedy(max_tokens=8)
    [free] = generate_all(TransformersGenerator(model, tokenizer), PROMPTS[:1], params)
    assert (free.finish_reason, len(free.token_ids)) == ("length", 8)

    # Make the third generated token an end-of-sequence token: generation must end there, with it.
    eos = free.token_ids[2]
    model.generation_config.eos_token_id = eos
    try:
        [stopped] = generate_all(TransformersGenerator(model, tokenizer), PROMPTS[:1], params)
    finally:
        model.generation_config.eos_token_id = tokenizer.eos_token_id
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == free.token_ids[: free.token_ids.index(eos) + 1]
    assert stopped.logprobs == pytest.approx(free.logprobs[: len(stopped.token_ids)], abs=1e-4)


def test_a_turn_ends_at_every_eos_the_generation_config_names_and_the_tokenizers_eos_and_pad(tiny):
    from transformers import GenerationConfig

    model, tokenizer = tiny
    im_end, endoftext = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    # The offline model's generation config names only <|im_end|>; <|endoftext|> is its pad token.
    assert end_token_ids(tokenizer, GenerationConfig(eos_token_id=im_end)) == sorted([im_end, endoftext])
    assert end_token_ids(tokenizer, GenerationConfig(eos_token_id=[7, im_end])) == sorted([7, im_end, endoftext])
    assert end_token_ids(tokenizer) == sorted([im_end, endoftext])
    assert TransformersGenerator(model, tokenizer).eos_token_ids == sorted([im_end, endoftext])


def test_sampling_params_validate_and_greedy_means_temperature_zero():
    assert SamplingParams.greedy(max_tokens=7) == SamplingParams(temperature=0.0, top_p=1.0, max_tokens=7)
    with pytest.raises(ValueError, match="max_tokens >= 1"):
        SamplingParams(max_tokens=0)


class FakeCompletionsServer:
    """A loopback stand-in for vLLM's OpenAI routes that records requests and answers with ``status``.

    200: ``GET /v1/models`` lists model "served"; ``POST /v1/completions`` returns the prompt's last two ids as the
    generated ids with logprobs -0.5 each and finish_reason "stop".
    """

    def __init__(self, status: int):
        self.requests: list[tuple[str, str, dict | None]] = []

        def answer(method, path, body):
            self.requests.append((method, path, body))
            if status != 200:
                return status, json.dumps({"error": "overloaded"}).encode()
            if method == "GET":
                return 200, json.dumps({"data": [{"id": "served"}]}).encode()
            ids = body["prompt"][-2:]
            return 200, json.dumps({"choices": [{"token_ids": ids, "logprobs": {"token_logprobs": [-0.5] * len(ids)},
                                                 "finish_reason": "stop"}]}).encode()

        self.server = serve_fake(answer)
        self.url = f"http://127.0.0.1:{self.server.server_port}"


def vllm_generate(url, prompts, model=None, stop_token_ids=None):
    async def main():
        generator = VLLMServerGenerator(url, model=model, stop_token_ids=stop_token_ids)
        try:
            return await asyncio.gather(*(generator.generate(p, SamplingParams(0.7, 0.9, 4)) for p in prompts))
        finally:
            await generator.aclose()

    return asyncio.run(main())


def test_vllm_client_sends_token_ids_and_reads_token_ids_logprobs_and_finish_reason():
    fake = FakeCompletionsServer(200)

    generations = vllm_generate(fake.url, PROMPTS, stop_token_ids=[151643, 151645])

    assert [g.token_ids for g in generations] == [p[-2:] for p in PROMPTS]
    assert all(g.logprobs == [-0.5, -0.5] and g.finish_reason == "stop" for g in generations)
    gets = [r for r in fake.requests if r[0] == "GET"]
    posts = [r[2] for r in fake.requests if r[0] == "POST"]
    assert gets == [("GET", "/v1/models", None)]  # asked once, though every first request needed the name
    assert sorted(p["prompt"] for p in posts) == sorted(PROMPTS)
    assert {(p["model"], p["max_tokens"], p["temperature"], p["top_p"], p["top_k"], p["return_token_ids"])
            for p in posts} == {("served", 4, 0.7, 0.9, 0, True)}
    assert all(p["stop_token_ids"] == [151643, 151645] for p in posts)
    fake.server.shutdown()


def test_vllm_http_failures_name_the_url_and_status():
    refused = FakeCompletionsServer(400)  # a request the server refuses: ours to fix, so not "the generator is down"
    with pytest.raises(RuntimeError, match=rf"POST {refused.url}/v1/completions failed with HTTP 400") as failure:
        vllm_generate(refused.url, PROMPTS[:1], model="served")
    assert not isinstance(failure.value, GeneratorUnavailable)
    with pytest.raises(RuntimeError, match=rf"GET {refused.url}/v1/models failed with HTTP 400"):
        vllm_generate(refused.url, PROMPTS[:1])
    refused.server.shutdown()

    failing = FakeCompletionsServer(503)  # a server error: the generator cannot serve, training stops on it
    for model, what in (("served", "POST /v1/completions"), (None, "GET /v1/models")):
        with pytest.raises(GeneratorUnavailable) as failure:
            vllm_generate(failing.url, PROMPTS[:1], model=model)
        assert str(failure.value) == (f"generation request ({what}) failed: the generator at {failing.url} answered "
                                      'HTTP 503 ({"error": "overloaded"}). See its log')
    failing.server.shutdown()


def test_vllm_generator_rejects_a_url_that_is_not_http():
    with pytest.raises(ValueError, match="base_url must be an http"):
        VLLMServerGenerator("localhost:8001")


def test_a_request_on_a_keepalive_connection_the_server_dropped_is_sent_again():
    """The race seen on an H200: the server closes an idle pooled connection just as the next request goes out."""
    posts = []

    class DropsSecondRequestOfEachConnection(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, so the client pools the connection
        handled = 0

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            posts.append(body["prompt"])
            self.handled += 1
            if self.handled == 2:
                self.close_connection = True  # hang up without an answer
                return
            payload = json.dumps({"choices": [{"token_ids": [7], "logprobs": {"token_logprobs": [-0.1]},
                                               "finish_reason": "stop"}]}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", free_port()), DropsSecondRequestOfEachConnection)
    threading.Thread(target=server.serve_forever, daemon=True).start()

    async def two_turns():
        generator = VLLMServerGenerator(f"http://127.0.0.1:{server.server_port}", model="served")
        try:
            return [await generator.generate(p, SamplingParams.greedy(4)) for p in PROMPTS[:2]]
        finally:
            await generator.aclose()

    generations = asyncio.run(two_turns())
    server.shutdown()
    assert [g.token_ids for g in generations] == [[7], [7]]
    assert posts == [PROMPTS[0], PROMPTS[1], PROMPTS[1]]  # the dropped request went out once more
