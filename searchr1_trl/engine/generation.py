"""Generator backends: token ids in; generated token ids, their logprobs and a finish reason out.

The rollout engine only ever talks to :class:`Generator`, so a backend is chosen by configuration, not by code:

- :class:`VLLMServerGenerator` (the main path) posts token-id prompts to a ``trl vllm-serve`` / ``vllm serve``
  OpenAI-compatible server. Every call is its own HTTP request, so as many requests are in flight as rollouts are
  waiting for a turn and vLLM's continuous batching packs them together.
- :class:`~searchr1_trl.engine.in_process.TransformersGenerator` runs the model in-process: the calls issued in the
  same event-loop instant become one left-padded ``model.generate`` run in a worker thread (for GPUs without vLLM and
  small runs).

Both backends sample exactly the distribution :class:`SamplingParams` describes: model-specific defaults (a
``generation_config.json`` with ``top_k``, ``repetition_penalty``, ...) are overridden, because an RL loss needs the
logprobs of the distribution the tokens were actually drawn from. Logprobs are "processed" ones, i.e. after
temperature and top-p, which is what ``trl vllm-serve`` returns (it starts vLLM with
``--logprobs-mode processed_logprobs``). ``temperature == 0`` means greedy decoding with raw logprobs.

A generation ends with ``finish_reason`` ``"stop"`` (the model emitted an end token, or completed one of the turn's
``stop`` strings; either is kept, as the last generated id or the token that completed the string) or ``"length"``
(it used all ``max_tokens``). The end tokens are :func:`end_token_ids`: every eos the
model's generation config names, the tokenizer's eos, and its pad token, in both backends (a model that writes one
and goes on has left its answer: 7 of 700 greedy answers of a trained offline model held a literal
``<|endoftext|>`` followed by more text when only ``<|im_end|>`` stopped generation).
"""

from __future__ import annotations

import abc
import asyncio
import importlib.util
import json
from dataclasses import dataclass, field, replace
from urllib.parse import urlsplit

import aiohttp

from searchr1_trl.serving.vllm_server import GeneratorUnavailable

FINISH_REASONS = ("stop", "length")


def resolve_generator(name: str) -> str:
    """``vllm`` or ``transformers``; ``auto`` picks vllm where it is installed (a GPU machine with the GPU profile)."""
    if name == "auto":
        return "vllm" if importlib.util.find_spec("vllm") is not None else "transformers"
    if name not in ("vllm", "transformers"):
        raise ValueError(f"generator={name!r}; expected 'vllm', 'transformers' or 'auto'")
    return name


def end_token_ids(tokenizer, generation_config=None) -> list[int]:
    """The ids that end a turn: the generation config's eos (an int or a list), the tokenizer's eos and pad tokens.

    The pad token counts because a model never continues a text after padding; for Qwen2.5 it is
    ``<|endoftext|>``, which the upstream generation config lists as an eos but the GGUF-converted offline model's
    does not: ``[<|im_end|> 151645, <|endoftext|> 151643]`` either way.
    """
    eos = getattr(generation_config, "eos_token_id", None)
    ids = {eos} if isinstance(eos, int) else set(eos or [])
    ids |= {tokenizer.eos_token_id, tokenizer.pad_token_id}
    return sorted(ids - {None})


@dataclass(frozen=True)
class SamplingParams:
    """How one turn is sampled."""

    temperature: float = field(default=1.0, metadata={"help": "Sampling temperature; 0 is greedy."})
    top_p: float = field(default=1.0, metadata={"help": "Nucleus sampling mass; 1.0 samples the full distribution."})
    max_tokens: int = field(default=512, metadata={"help": "Generated tokens per assistant turn."})
    stop: tuple[str, ...] = field(
        default=(), metadata={"help": "Strings that end a turn besides the end tokens (a tag protocol's closing "
                                      "tags)."})

    def __post_init__(self):
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.max_tokens < 1:
            raise ValueError(f"expected temperature >= 0, 0 < top_p <= 1 and max_tokens >= 1, got {self}")

    @classmethod
    def greedy(cls, max_tokens: int) -> SamplingParams:
        """Deterministic decoding, for validation."""
        return cls(temperature=0.0, top_p=1.0, max_tokens=max_tokens)

    def with_max_tokens(self, max_tokens: int) -> SamplingParams:
        return replace(self, max_tokens=max_tokens)


@dataclass
class Generation:
    """One generated turn; ``logprobs[i]`` is the sampler's logprob of ``token_ids[i]``."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" | "length"


class Generator(abc.ABC):
    """Continues a token-id prompt. Safe to call concurrently from many asyncio tasks."""

    @abc.abstractmethod
    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        """Generate up to ``params.max_tokens`` tokens after ``prompt_ids``."""

    async def aclose(self) -> None:  # noqa: B027 -- a default, not abstract: a generator may hold nothing to release
        """Release connections or workers; the generator may not be used afterwards."""


@dataclass
class VLLMServerGeneratorConfig:
    """Knobs of :class:`VLLMServerGenerator`."""

    max_concurrency: int = field(
        default=1024,
        metadata={"help": "vLLM server generator: generation requests in flight (more wait here). vLLM's own default "
                          "max_num_seqs on a GPU of 70 GiB or more; a lower cap (the earlier 256) keeps "
                          "vLLM's batches smaller than the rollouts waiting for a turn."},
    )
    timeout_s: float = field(
        default=600.0,
        metadata={"help": "vLLM server generator: how long one request (a turn) may take, in s; a server that does not "
                          "answer in time stops training in one line naming it. Long enough for a turn of "
                          "max_tokens_per_turn queued behind max_concurrency others on a slow server; it bounds how "
                          "long a hung server holds the run."},
    )


class VLLMServerGenerator(Generator):
    """Client of an OpenAI-compatible vLLM server (``trl vllm-serve``) on its ``/v1/completions`` route.

    ``model`` is the served model name; None asks the server (``GET /v1/models``) once. ``max_concurrency`` bounds the
    requests in flight so a huge batch of rollouts queues here rather than in thousands of open sockets.
    ``stop_token_ids`` (:func:`end_token_ids` of the served model) end a turn besides the server's own eos.

    The requests go through one pooled ``aiohttp`` session per event loop. Not httpx: its connection pool scans every
    connection on every request, which with 256 in flight cost 7.3 ms of CPU per request against a server that
    answers at once (aiohttp: 0.7 ms; ``experiments/engine_overhead.py``), more than the whole rest of a rollout-turn
    and enough to make the engine, not vLLM, the bottleneck of a 0.5B model on an H200.
    """

    def __init__(self, base_url: str, model: str | None = None,
                 max_concurrency: int = VLLMServerGeneratorConfig.max_concurrency,
                 timeout_s: float = VLLMServerGeneratorConfig.timeout_s, stop_token_ids: list[int] | None = None):
        url = urlsplit(base_url)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"base_url must be an http(s) URL such as http://127.0.0.1:8001, got {base_url!r}")
        if max_concurrency < 1 or timeout_s <= 0:
            raise ValueError(f"expected max_concurrency >= 1 and timeout_s > 0, got {max_concurrency}, {timeout_s}")
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.max_concurrency = max_concurrency
        self.timeout_s = timeout_s
        self.stop_token_ids = list(stop_token_ids or [])
        self._http: aiohttp.ClientSession | None = None
        self._http_loop: asyncio.AbstractEventLoop | None = None
        self._slots: asyncio.Semaphore | None = None
        self._lookup: asyncio.Lock | None = None

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        http, slots = self._client()
        model = self.model or await self._served_model(http)
        payload = {
            "model": model,
            "prompt": list(prompt_ids),
            "max_tokens": params.max_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            # Override the server's generation_config defaults so the tokens come from exactly `params`.
            "top_k": 0,
            "min_p": 0.0,
            "repetition_penalty": 1.0,
            "logprobs": 0,
            "return_token_ids": True,
            "skip_special_tokens": False,
            "stop_token_ids": self.stop_token_ids,
        }
        if params.stop:  # vLLM keeps every token id; the string is kept in the text too, as the turn wrote it
            payload.update(stop=list(params.stop), include_stop_str_in_output=True)
        url = f"{self.base_url}/v1/completions"
        async with slots:
            status, body = await self._ask(http, "POST", url, payload)
        if status != 200:
            raise RuntimeError(f"POST {url} failed with HTTP {status}: {_shown(body)}")
        return _generation_from_completion(json.loads(body), url)

    async def _served_model(self, http: aiohttp.ClientSession) -> str:
        """The first model the server lists; asked once (the first requests all wait for it), then remembered."""
        async with self._lookup:
            if self.model is None:
                self.model = await self._first_listed_model(http)
        return self.model

    async def _first_listed_model(self, http: aiohttp.ClientSession) -> str:
        url = f"{self.base_url}/v1/models"
        status, body = await self._ask(http, "GET", url)
        if status != 200:
            raise RuntimeError(f"GET {url} failed with HTTP {status}: {_shown(body)}")
        models = json.loads(body).get("data") or []
        if not models:
            raise RuntimeError(f"GET {url} lists no served model: {_shown(body)}")
        return models[0]["id"]

    async def _ask(self, http: aiohttp.ClientSession, method: str, url: str,
                   payload: dict | None = None) -> tuple[int, bytes]:
        """(status, body) of one request, sent once more on a fresh connection if the first was dropped;
        :class:`GeneratorUnavailable` if the server does not answer within ``timeout_s``, cannot be reached or answers
        with a server error (its engine died: no retry helps)."""
        what = f"generation request ({method} {urlsplit(url).path})"
        try:
            try:
                status, body = await _request(http, method, url, payload)
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError):
                # A pooled connection the server closed as idle (uvicorn's keep-alive is 5 s) fails on reuse;
                # generation is idempotent, so send it once more on a fresh connection (seen on an H200 after the
                # NCCL push between validation and the first training rollouts).
                status, body = await _request(http, method, url, payload)
        except asyncio.TimeoutError:
            raise GeneratorUnavailable.timed_out(what, self.base_url, self.timeout_s, "generator_timeout_s") from None
        except aiohttp.ClientError as error:
            if isinstance(error, aiohttp.ClientConnectorError):  # its OS error: the URL is named already
                raise GeneratorUnavailable.lost(what, self.base_url, error.os_error, connecting=True) from None
            raise GeneratorUnavailable.lost(what, self.base_url, error, connecting=False) from None
        if status >= 500:
            raise GeneratorUnavailable.answered(what, self.base_url, status, body.decode("utf-8", errors="replace"))
        return status, body

    def _client(self) -> tuple[aiohttp.ClientSession, asyncio.Semaphore]:
        """The pooled HTTP session and the in-flight bound of the running event loop."""
        loop = asyncio.get_running_loop()
        if self._http is None or self._http_loop is not loop:
            # Connections and semaphores belong to the loop that made them; a new loop (another asyncio.run) gets its
            # own.
            connector = aiohttp.TCPConnector(limit=self.max_concurrency,
                                             keepalive_timeout=2.0)  # below the server's 5 s idle timeout
            self._http = aiohttp.ClientSession(connector=connector,
                                               timeout=aiohttp.ClientTimeout(total=self.timeout_s))
            self._slots = asyncio.Semaphore(self.max_concurrency)
            self._lookup = asyncio.Lock()
            self._http_loop = loop
        return self._http, self._slots

    async def aclose(self) -> None:
        if self._http is not None and self._http_loop is asyncio.get_running_loop():
            await self._http.close()
        self._http = self._http_loop = self._slots = self._lookup = None


async def _request(http: aiohttp.ClientSession, method: str, url: str,
                   payload: dict | None = None) -> tuple[int, bytes]:
    """(status, body) of one request; the body is read whatever the status, so an error can show it."""
    async with http.request(method, url, json=payload) as response:
        return response.status, await response.read()


def _shown(body: bytes) -> str:
    """The start of a response body, for an error message."""
    return body[:500].decode("utf-8", errors="replace")


def _generation_from_completion(body: dict, url: str) -> Generation:
    """The :class:`Generation` in a ``/v1/completions`` response; RuntimeError naming what is missing otherwise."""
    try:
        choice = body["choices"][0]
        token_ids = [int(t) for t in choice["token_ids"]]
        logprobs = [float(lp) for lp in choice["logprobs"]["token_logprobs"]]
        finish_reason = choice["finish_reason"]
    except (KeyError, IndexError, TypeError, ValueError) as error:
        raise RuntimeError(
            f"{url} answered without choices[0].token_ids / logprobs.token_logprobs / finish_reason ({error!r}); "
            f"the server must be vLLM >= 0.10.2 (it needs `return_token_ids`): {str(body)[:500]}"
        ) from error
    if finish_reason not in FINISH_REASONS or len(logprobs) != len(token_ids):
        raise RuntimeError(
            f"{url} returned finish_reason={finish_reason!r} (expected one of {FINISH_REASONS}) with "
            f"{len(token_ids)} token ids and {len(logprobs)} logprobs"
        )
    return Generation(token_ids=token_ids, logprobs=logprobs, finish_reason=finish_reason)
