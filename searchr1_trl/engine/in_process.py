"""The in-process generator: the trained model itself generates, batched, in a worker thread (for GPUs without vLLM,
and the CPU recipe). Its contract is :mod:`searchr1_trl.engine.generation`'s: the distribution :class:`SamplingParams`
describes, processed logprobs, the same end tokens and stop strings."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field

from searchr1_trl.engine.generation import Generation, Generator, SamplingParams, end_token_ids


@dataclass
class _Request:
    prompt_ids: list[int]
    params: SamplingParams
    future: asyncio.Future


@contextlib.contextmanager
def eager_layers(model):
    """``model``'s ``torch.compile``-d submodules (``compile_layers``) run eager inside: ``generate`` would compile
    them again for each layer's KV cache (a guard on that layer's cache entry) and every decode shape, up to dynamo's
    recompile limit, whose entries the training forward shares. Not for a model another thread is running: in-process
    generation reads the policy only while the trainer waits (lock-step), else a copy of its own (async)."""
    compiled = [(module, module._compiled_call_impl) for module in model.modules()
                if getattr(module, "_compiled_call_impl", None) is not None]
    for module, _ in compiled:
        module._compiled_call_impl = None
    try:
        yield
    finally:
        for module, impl in compiled:
            module._compiled_call_impl = impl


class _SampledLogprobs:
    """generate's last logits processor: temperature and top-p as generate's own warpers apply them, and the processed
    logprob of each sampled token (what vLLM's ``processed_logprobs`` gives). A step's token is known only at the next
    step's call (the last one's from the sequences), so one step's log-softmax is held at a time: generate's
    ``output_scores`` keeps every step's, 40 GiB at 256 rows x 256 tokens x Qwen's 152k vocabulary."""

    def __init__(self, temperature: float, top_p: float):
        from transformers import TemperatureLogitsWarper, TopPLogitsWarper

        self.warpers = [*([TemperatureLogitsWarper(temperature)] if temperature > 0 and temperature != 1.0 else []),
                        *([TopPLogitsWarper(top_p)] if temperature > 0 and top_p < 1.0 else [])]
        self.steps: list = []  # per step, each row's sampled-token logprob
        self._last = None  # the newest step's log-softmax, [rows, vocab]

    def __call__(self, input_ids, scores):
        import torch

        if self._last is not None:  # the previous step's tokens are now the sequences' last column
            self.steps.append(self._last.gather(-1, input_ids[:, -1:]).squeeze(-1))
        for warper in self.warpers:
            scores = warper(input_ids, scores)
        self._last = torch.log_softmax(scores.float(), dim=-1)
        return scores

    def logprobs(self, last_tokens):
        """[rows, steps]: the sampled tokens' logprobs, given the last step's tokens."""
        import torch

        steps = [*self.steps, self._last.gather(-1, last_tokens.unsqueeze(-1).to(self._last.device)).squeeze(-1)]
        return torch.stack(steps, dim=1)


@dataclass
class TransformersGeneratorConfig:
    """Knobs of :class:`TransformersGenerator`."""

    max_batch_size: int = field(
        default=64, metadata={"help": "In-process generator: most rows of one model.generate call."}
    )


class TransformersGenerator(Generator):
    """In-process generation with a ``transformers`` causal LM; see the module docstring.

    Calls issued in the same event-loop instant with the same temperature and top-p are generated together, up to
    ``max_batch_size`` per ``model.generate`` (for the largest ``max_tokens`` among them; each row is then cut to its
    own, so rollouts near their token budget don't split a batch); calls that arrive while a batch runs form the next
    batch. Batches run one at a time in a worker thread, so the event loop (and the environments' I/O) keeps going.
    """

    def __init__(self, model, tokenizer, max_batch_size: int = TransformersGeneratorConfig.max_batch_size):
        if max_batch_size < 1:
            raise ValueError(f"expected max_batch_size >= 1, got {max_batch_size}")
        self.model, self.tokenizer = model, tokenizer
        self.max_batch_size = max_batch_size
        self.eos_token_ids = end_token_ids(tokenizer, model.generation_config)
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_token_ids[0]
        self._pending: list[_Request] = []
        self._worker: asyncio.Task | None = None

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        loop = asyncio.get_running_loop()
        request = _Request(list(prompt_ids), params, loop.create_future())
        self._pending.append(request)
        if self._worker is None or self._worker.done():
            self._worker = loop.create_task(self._drain())
        return await request.future

    async def _drain(self) -> None:
        """Generate pending requests batch by batch until none is left."""
        await asyncio.sleep(0)  # one loop iteration, so every call issued in this instant joins the first batch
        while self._pending:
            batch = self._take_batch()
            try:
                generations = await asyncio.to_thread(self._generate_batch, batch)
            except Exception as error:  # noqa: BLE001 -- reported to the callers, whose rollouts raise it
                for request in batch:
                    if not request.future.done():
                        request.future.set_exception(error)
                continue
            for request, generation in zip(batch, generations, strict=True):
                if not request.future.done():  # done when the rollout waiting for it was cancelled
                    request.future.set_result(generation)

    def _take_batch(self) -> list[_Request]:
        """Up to ``max_batch_size`` pending requests sampled like the first one, oldest first."""
        params = self._pending[0].params
        batch = [r for r in self._pending if r.params.with_max_tokens(params.max_tokens) == params]
        batch = batch[: self.max_batch_size]
        taken = set(map(id, batch))
        self._pending = [r for r in self._pending if id(r) not in taken]
        return batch

    def _generate_batch(self, batch: list[_Request]) -> list[Generation]:
        import torch
        from transformers import GenerationConfig, LogitsProcessorList

        params = batch[0].params
        width = max(len(r.prompt_ids) for r in batch)
        # Left padding, so every prompt ends where generation starts.
        input_ids = torch.tensor([[self.pad_token_id] * (width - len(r.prompt_ids)) + r.prompt_ids for r in batch])
        attention_mask = torch.tensor([[0] * (width - len(r.prompt_ids)) + [1] * len(r.prompt_ids) for r in batch])
        sampled = _SampledLogprobs(params.temperature, params.top_p)
        # Temperature and top-p are _SampledLogprobs' (generate adds its own warpers after every custom processor);
        # the values here are explicit no-ops, so the model's generation_config.json cannot change the distribution.
        config = GenerationConfig(
            max_new_tokens=max(r.params.max_tokens for r in batch),
            do_sample=params.temperature > 0,
            **({"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "typical_p": 1.0}
               if params.temperature > 0 else {}),
            repetition_penalty=1.0,
            no_repeat_ngram_size=0,
            eos_token_id=self.eos_token_ids,
            pad_token_id=self.pad_token_id,
            return_dict_in_generate=True,
        )
        device = self.model.device
        with torch.inference_mode(), eager_layers(self.model):
            output = self.model.generate(
                input_ids=input_ids.to(device), attention_mask=attention_mask.to(device), generation_config=config,
                logits_processor=LogitsProcessorList([sampled]),
            )
        new_tokens = output.sequences[:, width:]
        chosen = sampled.logprobs(new_tokens[:, -1]).tolist()
        rows = zip(batch, new_tokens.tolist(), chosen, strict=True)
        return [self._cut(r.params, tokens, lps) for r, tokens, lps in rows]

    def _cut(self, params: SamplingParams, tokens: list[int], logprobs: list[float]) -> Generation:
        """One row of a batch: up to and including its first eos or the token completing its first ``stop`` string
        ("stop"), else its first ``max_tokens`` ("length"). Stop strings are looked for in the generated text only, as
        vLLM does (``generate``'s own ``stop_strings`` match across the prompt's tail, ending turns early)."""
        tokens = tokens[:params.max_tokens]
        end = next((i + 1 for i, token in enumerate(tokens) if token in self.eos_token_ids), None)
        end = self._stop_string_end(tokens[:end], params.stop) or end
        if end is None:
            return Generation(tokens, logprobs[:params.max_tokens], "length")
        return Generation(tokens[:end], logprobs[:end], "stop")

    def _stop_string_end(self, tokens: list[int], stop: tuple[str, ...]) -> int | None:
        """The fewest of ``tokens`` whose text holds one of ``stop``; None when none does. A prefix's text only grows
        with the prefix, so the search halves."""
        def holds(n: int) -> bool:
            text = self.tokenizer.decode(tokens[:n], skip_special_tokens=False)
            return any(string in text for string in stop)

        if not stop or not holds(len(tokens)):
            return None
        low, high = 1, len(tokens)
        while low < high:
            middle = (low + high) // 2
            low, high = (low, middle) if holds(middle) else (middle + 1, high)
        return low

    async def aclose(self) -> None:
        if self._worker is not None:
            await self._worker
