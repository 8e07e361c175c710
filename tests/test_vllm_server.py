"""The generator: a real `trl vllm-serve` on CPU loads the offline model and generates from token ids."""

import httpx
import pytest

from searchr1_trl.serving.vllm_server import collective_rpc


def test_server_generates_from_token_ids_with_logprobs(vllm_server, tokenizer, offline_assets):
    prompt_ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France? Answer with one word."}],
        add_generation_prompt=True, tokenize=True, return_dict=True,
    )["input_ids"]
    response = httpx.post(
        f"{vllm_server.base_url}/v1/completions",
        json={"model": offline_assets.model, "prompt": prompt_ids, "max_tokens": 16, "temperature": 0.0,
              "logprobs": 0, "return_token_ids": True},
        timeout=300,
    )
    response.raise_for_status()
    choice = response.json()["choices"][0]
    assert choice["prompt_token_ids"] == prompt_ids
    assert len(choice["token_ids"]) == len(choice["logprobs"]["token_logprobs"]) > 0
    assert all(lp <= 0.0 for lp in choice["logprobs"]["token_logprobs"])
    assert "paris" in tokenizer.decode(choice["token_ids"]).lower()
    assert choice["finish_reason"] == "stop" and choice["token_ids"][-1] == tokenizer.eos_token_id


def test_starting_a_server_on_a_port_another_server_answers_on_fails_before_launching():
    """Seen on an H200: the new vLLM could not bind, the old one answered /health, the job trained against it."""
    from conftest import serve_health

    from searchr1_trl.serving.vllm_server import VLLMServer, VLLMServerConfig

    other = serve_health()
    server = VLLMServer(VLLMServerConfig(model="unused", port=other.server_port))
    with pytest.raises(RuntimeError, match=f"another server holds port {other.server_port}"):
        server.start()
    other.shutdown()
    assert server.process is None  # nothing was launched


def test_the_ipc_weight_loader_is_reached_through_the_server_and_refuses_a_cpu_worker_in_words(vllm_server,
                                                                                              offline_assets):
    response = httpx.post(f"{vllm_server.base_url}/collective_rpc",
                          json={"method": "load_ipc_weights", "args": ["unused"]}, timeout=300)
    response.raise_for_status()
    assert response.json() == {"results": [{"error": "weight_sync='ipc' needs a CUDA vLLM worker; this one runs on "
                                                     "cpu: use weight_sync='reload'"}]}
    with pytest.raises(RuntimeError, match="failed load_ipc_weights: weight_sync='ipc' needs a CUDA vLLM worker"):
        collective_rpc(vllm_server.base_url, "load_ipc_weights", args=["unused"])  # what IpcPush raises
    completion = httpx.post(f"{vllm_server.base_url}/v1/completions", timeout=300,
                            json={"model": offline_assets.model, "prompt": "Paris is", "max_tokens": 2})
    assert completion.status_code == 200  # a refused push leaves the server serving
