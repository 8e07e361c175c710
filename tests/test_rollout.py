"""Rollout engine rules, with the real Qwen2.5 tokenizer and chat template.

The generator is scripted: it answers each question's n-th turn with a fixed assistant text (tokenized, so the engine
gets real token ids) and known logprobs, and records every prompt it was given. The environment is a tiny generic
"lookup" task: a tool call gets a tool message, an answer ends the rollout.
"""

from __future__ import annotations

import asyncio

import pytest
from conftest import LOOKUP_TOOL, template_tokenizer

from searchr1_trl.engine.generation import Generation, Generator, SamplingParams
from searchr1_trl.engine.rollout import (
    EnvFactory,
    EnvStep,
    MessageEnv,
    RolloutConfig,
    RolloutEngine,
    RolloutStatus,
)


def call(query: str) -> str:
    """An assistant turn calling lookup, written exactly as the Qwen2.5 template renders tool calls."""
    return f'<tool_call>\n{{"name": "lookup", "arguments": {{"query": "{query}"}}}}\n</tool_call><|im_end|>'


class ScriptedGenerator(Generator):
    """Answers the n-th turn of question q with ``script[q][n]``; logprobs are -0.01, -0.02, ... per turn."""

    def __init__(self, tokenizer, script: dict[str, list[str]]):
        self.tokenizer = tokenizer
        self.script = script
        self.calls: dict[str, list[tuple[list[int], SamplingParams, Generation]]] = {q: [] for q in script}

    async def generate(self, prompt_ids, params):
        text = self.tokenizer.decode(prompt_ids)
        question = next(q for q in self.script if f"Question: {q}<|im_end|>" in text)
        turns = self.calls[question]
        ids = self.tokenizer.encode(self.script[question][len(turns)])
        stopped = ids[-1] in (self.tokenizer.eos_token_id, self.tokenizer.pad_token_id)
        if len(ids) > params.max_tokens:
            ids, stopped = ids[: params.max_tokens], False
        generation = Generation(ids, [-(i + 1) / 100 for i in range(len(ids))], "stop" if stopped else "length")
        turns.append((list(prompt_ids), params, generation))
        await asyncio.sleep(0)  # a real generator yields to the loop
        return generation


class LookupEnv(MessageEnv):
    """One rollout of the lookup task: a tool call gets ``result for <query>``; an answer ends the rollout."""

    def __init__(self, envs: LookupEnvs):
        self.envs, self.sample = envs, None

    def reset(self, sample):
        self.sample = sample
        return [{"role": "user", "content": f"Question: {sample}"}]

    async def step(self, messages):
        message = messages[-1]
        self.envs.stepped.append(message)
        calls = message.get("tool_calls") or []
        await self.envs.before_step(message)
        if not calls:
            return EnvStep(messages=[], done=True)
        return EnvStep(
            messages=[
                {"role": "tool", "name": "lookup", "content": f"result for {c['function']['arguments']['query']}"}
                for c in calls
            ],
            done=False,
        )


class LookupEnvs(EnvFactory):
    """A :class:`LookupEnv` per rollout; records every env built and every message stepped on. ``step_delay_s``
    slows the steps of chosen queries."""

    def __init__(self, step_delay_s: dict[str, float] | None = None):
        self.tools = [LOOKUP_TOOL]
        self.step_delay_s = step_delay_s or {}
        self.built: list[LookupEnv] = []
        self.stepped: list[dict] = []

    def __call__(self) -> LookupEnv:
        self.built.append(LookupEnv(self))
        return self.built[-1]

    async def before_step(self, message: dict) -> None:
        calls = message.get("tool_calls") or []
        await asyncio.sleep(self.step_delay_s.get(calls[0]["function"]["arguments"]["query"] if calls else None, 0.0))


def roll(tokenizer, script, config=None, params=SamplingParams(), env=None):
    """(rollouts in script order, generator, env) after running every scripted question."""
    generator = ScriptedGenerator(tokenizer, script)
    env = env or LookupEnvs()
    engine = RolloutEngine(tokenizer, generator, env, config or RolloutConfig())
    return asyncio.run(engine.run(list(script), params)), generator, env


def runs(rollout, mask_value):
    """Decoded maximal runs of completion tokens whose env_mask is ``mask_value``."""
    pieces, current = [], []
    for token, mask in zip(rollout.completion_ids, rollout.env_mask, strict=True):
        if mask == mask_value:
            current.append(token)
        elif current:
            pieces.append(current)
            current = []
    if current:
        pieces.append(current)
    return pieces


def test_an_answer_without_tool_calls_ends_the_rollout_as_done(tokenizer):
    [rollout], _, _ = roll(tokenizer, {"capital of France": ["Paris<|im_end|>"]})

    assert rollout.status is RolloutStatus.DONE
    assert rollout.messages == [
        {"role": "user", "content": "Question: capital of France"},
        {"role": "assistant", "content": "Paris"},
    ]
    assert rollout.completion_ids == tokenizer.encode("Paris<|im_end|>")
    assert rollout.env_mask == [1, 1]
    assert (rollout.num_turns, rollout.num_tool_calls) == (1, 0)
    assert set(rollout.timings) == {"generate_s", "env_s", "total_s"}


def test_a_tool_call_gets_the_env_messages_unchanged_then_the_answer_ends_it(tokenizer):
    [rollout], _, env = roll(tokenizer, {"q": [call("France capital"), "Paris<|im_end|>"]})

    assert rollout.status is RolloutStatus.DONE
    assert rollout.messages == [
        {"role": "user", "content": "Question: q"},
        {"role": "assistant", "content": "",
         "tool_calls": [{"type": "function",
                         "function": {"name": "lookup", "arguments": {"query": "France capital"}}}]},
        {"role": "tool", "name": "lookup", "content": "result for France capital"},
        {"role": "assistant", "content": "Paris"},
    ]
    assert env.stepped == [rollout.messages[1], rollout.messages[3]]
    assert (rollout.num_turns, rollout.num_tool_calls) == (2, 1)


def test_still_calling_tools_after_max_turns_is_truncated_max_turns(tokenizer):
    [rollout], _, env = roll(tokenizer, {"q": [call("a"), call("b"), "never generated<|im_end|>"]},
                             RolloutConfig(max_turns=2))

    assert rollout.status is RolloutStatus.TRUNCATED_MAX_TURNS
    assert rollout.status.truncated
    # The last call is never run: no turn is left to read its result, so it is neither computed nor part of the rollout.
    assert rollout.num_turns == 2 and env.stepped == [rollout.messages[1]]
    assert [m["role"] for m in rollout.messages] == ["user", "assistant", "tool", "assistant"]
    assert rollout.messages[-1]["tool_calls"][0]["function"]["arguments"] == {"query": "b"}


def test_a_turn_that_uses_all_its_max_tokens_is_truncated_length(tokenizer):
    [rollout], _, env = roll(tokenizer, {"q": ["The capital of France is Paris.<|im_end|>"]},
                             params=SamplingParams(max_tokens=3))

    assert rollout.status is RolloutStatus.TRUNCATED_LENGTH
    assert rollout.completion_ids == tokenizer.encode("The capital of")
    assert rollout.messages[-1] == {"role": "assistant", "content": "The capital of"}
    assert env.stepped == []


def test_max_tokens_of_a_turn_is_capped_so_the_rollout_fits_max_rollout_tokens(tokenizer):
    script = {"q": [call("a"), "The capital of France is Paris, a city on the Seine.<|im_end|>"]}
    [first], generator, _ = roll(tokenizer, script)
    budget = len(first.prompt_ids) + len(first.completion_ids) - 4

    [rollout], generator, _ = roll(tokenizer, script, RolloutConfig(max_rollout_tokens=budget))

    second_prompt, second_params, _ = generator.calls["q"][1]
    assert second_params.max_tokens == budget - len(second_prompt)
    assert rollout.status is RolloutStatus.TRUNCATED_LENGTH
    assert len(rollout.prompt_ids) + len(rollout.completion_ids) == budget


def test_a_next_prompt_beyond_max_rollout_tokens_is_truncated_prompt_too_long(tokenizer):
    script = {"q": [call("a"), "Paris<|im_end|>"]}
    _, first, _ = roll(tokenizer, script)
    second_prompt, _, _ = first.calls["q"][1]

    [rollout], generator, _ = roll(tokenizer, script, RolloutConfig(max_rollout_tokens=len(second_prompt)))

    assert rollout.status is RolloutStatus.TRUNCATED_PROMPT_TOO_LONG
    assert len(generator.calls["q"]) == 1
    assert rollout.completion_ids == tokenizer.encode(call("a"))
    assert [m["role"] for m in rollout.messages] == ["user", "assistant"]


def test_an_initial_prompt_beyond_max_rollout_tokens_is_truncated_prompt_too_long(tokenizer):
    [rollout], generator, _ = roll(tokenizer, {"q": ["Paris<|im_end|>"]}, RolloutConfig(max_rollout_tokens=10))

    assert rollout.status is RolloutStatus.TRUNCATED_PROMPT_TOO_LONG
    assert (rollout.num_turns, rollout.completion_ids, generator.calls["q"]) == (0, [], [])


def test_tool_call_json_that_does_not_parse_is_error_parse(tokenizer):
    bad = '<tool_call>\n{"name": "lookup", "arguments": {"query": </tool_call><|im_end|>'
    [rollout], _, env = roll(tokenizer, {"q": [bad]})

    assert rollout.status is RolloutStatus.ERROR_PARSE
    assert rollout.messages[-1] == {"role": "assistant", "content": tokenizer.decode(tokenizer.encode(bad),
                                                                                       skip_special_tokens=True)}
    assert rollout.completion_ids == tokenizer.encode(bad) and rollout.env_mask == [1] * len(rollout.completion_ids)
    assert env.stepped == []


def test_an_env_step_slower_than_step_timeout_is_error_timeout(tokenizer):
    [rollout], _, _ = roll(tokenizer, {"q": [call("slow")]}, RolloutConfig(step_timeout_s=0.05),
                           env=LookupEnvs(step_delay_s={"slow": 5.0}))

    assert rollout.status is RolloutStatus.ERROR_TIMEOUT
    assert rollout.timings["env_s"] < 5.0  # cut at the timeout, not at the step's end


def test_env_mask_is_one_on_exactly_the_assistant_turns_and_logprobs_align(tokenizer):
    turns = [call("a"), f'Let me check.\n{call("b")}', "Paris<|im_end|>"]
    [rollout], generator, _ = roll(tokenizer, {"q": turns})

    assert [tokenizer.decode(run) for run in runs(rollout, 1)] == turns
    assert len(rollout.logprobs) == len(rollout.completion_ids) == len(rollout.env_mask)
    model_logprobs = [lp for lp, m in zip(rollout.logprobs, rollout.env_mask, strict=True) if m == 1]
    assert model_logprobs == [lp for _, _, g in generator.calls["q"] for lp in g.logprobs]
    assert all(lp == 0.0 for lp, m in zip(rollout.logprobs, rollout.env_mask, strict=True) if m == 0)


def test_env_tokens_are_template_glue_tool_turn_and_next_generation_prompt(tokenizer):
    [rollout], _, _ = roll(tokenizer, {"q": [call("a"), "Paris<|im_end|>"]})

    [env_tokens] = runs(rollout, 0)
    assert tokenizer.decode(env_tokens) == (
        "\n<|im_start|>user\n<tool_response>\nresult for a\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )


def test_earlier_turns_are_never_re_tokenized(tokenizer):
    # Neither spacing is what the template would render, and "Paris" alone tokenizes differently from " Paris".
    odd = '<tool_call>\n{"name":"lookup","arguments":{"query":"a"}}\n</tool_call><|im_end|>'
    [rollout], generator, _ = roll(tokenizer, {"q": [odd, call("b"), "Paris<|im_end|>"]})

    (p1, _, g1), (p2, _, g2), (p3, _, g3) = generator.calls["q"]
    suffixes = runs(rollout, 0)
    assert p1 == rollout.prompt_ids
    assert p2 == p1 + g1.token_ids + suffixes[0]
    assert p3 == p2 + g2.token_ids + suffixes[1]
    assert rollout.completion_ids == g1.token_ids + suffixes[0] + g2.token_ids + suffixes[1] + g3.token_ids


def test_the_final_sequence_is_what_the_model_saw_in_its_last_turn_plus_that_turn(tokenizer):
    [rollout], generator, _ = roll(tokenizer, {"q": [call("a"), call("b"), "Paris<|im_end|>"]})

    last_prompt, _, last = generator.calls["q"][-1]
    assert rollout.prompt_ids + rollout.completion_ids == last_prompt + last.token_ids
    # With turns written the way the template writes them, that sequence is the conversation itself.
    assert tokenizer.decode(rollout.prompt_ids + rollout.completion_ids) + "\n" == tokenizer.apply_chat_template(
        rollout.messages, tools=[LOOKUP_TOOL], tokenize=False
    )


def test_a_turn_ended_by_another_stop_token_gets_the_templates_end_of_turn_as_env_tokens(tokenizer):
    endoftext = call("a").replace("<|im_end|>", "<|endoftext|>")
    [rollout], _, _ = roll(tokenizer, {"q": [endoftext, "Paris<|im_end|>"]})

    assert rollout.status is RolloutStatus.DONE
    assert tokenizer.decode(runs(rollout, 1)[0]).endswith("</tool_call><|endoftext|>")
    assert tokenizer.decode(runs(rollout, 0)[0]).startswith("<|im_end|>\n<|im_start|>user\n<tool_response>")


class SlowUntilAnswered(LookupEnvs):
    """The search for "slow" returns only once the answer ``until`` was given: a loop that ran rollouts one after
    another would never get there (the step's 5 s timeout would end "slow" as error_timeout)."""

    def __init__(self, until: str):
        super().__init__()
        self.until, self.answered = until, asyncio.Event()

    async def before_step(self, message: dict) -> None:
        calls = message.get("tool_calls") or []
        if calls and calls[0]["function"]["arguments"]["query"] == "slow":
            await self.answered.wait()
        elif message["content"] == self.until:
            self.answered.set()


def test_a_slow_env_step_does_not_hold_back_other_rollouts(tokenizer):
    script = {"slow": [call("slow"), "A<|im_end|>"], "fast": [call("fast"), call("fast again"), "B<|im_end|>"]}
    env = SlowUntilAnswered(until="B")
    engine = RolloutEngine(tokenizer, ScriptedGenerator(tokenizer, script), env, RolloutConfig(step_timeout_s=5.0))

    slow, fast = asyncio.run(engine.run(["slow", "fast"], SamplingParams()))

    # Results come back in input order, and "fast" ran all three turns while "slow" waited on its one search.
    assert (slow.sample, fast.sample) == ("slow", "fast")
    assert slow.status is fast.status is RolloutStatus.DONE
    assert [m.get("content") for m in env.stepped if not m.get("tool_calls")] == ["B", "A"]


def test_a_search_the_rollouts_share_is_tokenized_once_and_read_alike(tokenizer):
    script = {"a": [call("x"), "A<|im_end|>"], "b": [call("x"), "B<|im_end|>"]}
    engine = RolloutEngine(tokenizer, ScriptedGenerator(tokenizer, script), LookupEnvs(), RolloutConfig())

    a, b = asyncio.run(engine.run(["a", "b"], SamplingParams()))

    # Two prompts, then one environment suffix for both (a GRPO group's rollouts mostly make the same search).
    cache = engine.transcript._encode_text.cache_info()
    assert (cache.misses, cache.hits) == (2 + 1, 1)
    assert runs(a, 0)[0] == runs(b, 0)[0] and "result for x" in tokenizer.decode(runs(a, 0)[0])
    assert a.status is b.status is RolloutStatus.DONE and tokenizer.decode(runs(b, 1)[-1]) == "B<|im_end|>"


def test_each_rollout_gets_an_env_of_its_own_reset_with_its_sample(tokenizer):
    [a, b], _, envs = roll(tokenizer, {"a": [call("x"), "A<|im_end|>"], "b": ["B<|im_end|>"]})

    assert [env.sample for env in envs.built] == ["a", "b"] and envs.built[0] is not envs.built[1]
    assert (a.sample, b.sample) == ("a", "b")


def test_bare_json_tool_calls_are_tool_calls_only_when_enabled(tokenizer):
    bare = '{"name": "lookup", "arguments": {"query": "a"}}<|im_end|>'
    script = {"q": [bare, "Paris<|im_end|>"]}

    [strict], _, _ = roll(tokenizer, script)
    [lenient], _, _ = roll(tokenizer, script, RolloutConfig(bare_json_tool_calls=True))

    assert (strict.status, strict.num_tool_calls, strict.messages[-1]["content"]) == (
        RolloutStatus.DONE, 0, bare.removesuffix("<|im_end|>"))
    assert (lenient.status, lenient.num_tool_calls) == (RolloutStatus.DONE, 1)
    assert lenient.messages[1] == {"role": "assistant", "content": "",
                                   "tool_calls": [{"type": "function", "function": {"name": "lookup",
                                                                                    "arguments": {"query": "a"}}}]}
    assert tokenizer.decode(runs(lenient, 1)[0]) == bare  # the model's own tokens, not the template's rendering


def test_a_tool_call_block_missing_a_brace_fails_the_rollout_unless_repairs_are_on(tokenizer):
    slip = '<tool_call>\n{"name": "lookup", "arguments": {"query": "a"}\n</tool_call><|im_end|>'
    script = {"q": [slip, "Paris<|im_end|>"]}

    [strict], _, _ = roll(tokenizer, script)
    [repaired], _, _ = roll(tokenizer, script, RolloutConfig(repair_tool_calls=True))

    assert (strict.status, strict.num_tool_calls) == (RolloutStatus.ERROR_PARSE, 0)
    assert (repaired.status, repaired.num_tool_calls, repaired.messages[-1]["content"]) == (
        RolloutStatus.DONE, 1, "Paris")
    assert tokenizer.decode(runs(repaired, 1)[0]) == slip  # trained on what it wrote, slip included


@pytest.mark.parametrize("after", ["<tool_call>", "\u0e2a\u0e27\u0e31\u0e2a", "search</tool_call>"])
def test_a_whole_call_not_closed_after_its_json_is_closed_by_the_engine_only_when_asked(tokenizer, after):
    written = '<tool_call>\n{"name": "lookup", "arguments": {"query": "a"}}\n'
    script = {"q": [written + after + "<|im_end|>", "Paris<|im_end|>"]}

    [strict], _, _ = roll(tokenizer, script)
    [closed], generator, env = roll(tokenizer, script, RolloutConfig(close_tool_calls=True))

    assert (strict.status, strict.num_tool_calls, strict.closed_turns) == (RolloutStatus.ERROR_PARSE, 0, 0)
    assert (closed.status, closed.num_tool_calls, closed.closed_turns) == (RolloutStatus.DONE, 1, 1)
    assert closed.messages[1]["tool_calls"] == [LOOKUP_CALL] and env.stepped[0] == closed.messages[1]
    model, environment = runs(closed, 1), runs(closed, 0)
    assert tokenizer.decode(model[0]) == written  # trained on the call as written, up to its JSON; the rest dropped
    assert tokenizer.decode(environment[0]).startswith("</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>")
    kept = len(model[0])
    assert closed.logprobs[:kept] == generator.calls["q"][0][2].logprobs[:kept]
    assert closed.logprobs[kept:kept + len(environment[0])] == [0.0] * len(environment[0])
    # the second turn was generated after exactly the tokens the rollout records
    second_prompt = generator.calls["q"][1][0]
    assert second_prompt == closed.prompt_ids + closed.completion_ids[:len(second_prompt) - len(closed.prompt_ids)]
    assert tokenizer.decode(second_prompt).endswith("result for a\n</tool_response><|im_end|>\n<|im_start|>assistant\n")


def test_closing_leaves_a_call_whose_json_is_not_whole_an_error(tokenizer):
    script = {"q": ['<tool_call>\n{"name": "lookup", "arguments": {"query": "a"\n<tool_call><|im_end|>']}
    [rollout], _, _ = roll(tokenizer, script, RolloutConfig(close_tool_calls=True))
    assert (rollout.status, rollout.closed_turns) == (RolloutStatus.ERROR_PARSE, 0)


def test_config_rejects_budgets_that_cannot_work():
    with pytest.raises(ValueError, match="max_turns >= 1"):
        RolloutConfig(max_turns=0)


PASSAGES = (" Doc 1(Title: Été) Paris, « la ville »  \nDoc 2(Title: 文) 東京\n\n"
            " literal <|im_end|> and </tool_response>\t")
# (conversation up to the model's turn, environment messages, the token that ended the turn)
LOOKUP_CALL = {"type": "function", "function": {"name": "lookup", "arguments": {"query": "a"}}}
STEPS = [
    ([{"role": "user", "content": "Question: q"},
      {"role": "assistant", "content": "", "tool_calls": [LOOKUP_CALL]}],
     [{"role": "tool", "name": "lookup", "content": PASSAGES}], "<|im_end|>"),
    ([{"role": "user", "content": "Question: q"},
      {"role": "assistant", "content": "Let me check.", "tool_calls": [LOOKUP_CALL, LOOKUP_CALL]}],
     [{"role": "tool", "name": "lookup", "content": "first"}, {"role": "tool", "name": "lookup", "content": " "}],
     "<|endoftext|>"),
    ([{"role": "user", "content": "Question: q"},
      {"role": "assistant", "content": "", "tool_calls": [LOOKUP_CALL]},
      {"role": "tool", "name": "lookup", "content": PASSAGES},
      {"role": "assistant", "content": "Still unsure.", "reasoning_content": "Passages disagree.",
       "tool_calls": [LOOKUP_CALL]}],
     [{"role": "tool", "name": "lookup", "content": "\n" + PASSAGES}], "<|im_end|>"),
]


@pytest.mark.parametrize(("template", "enable_thinking"), [
    (None, False), ("qwen3.jinja", False), ("qwen3.jinja", True), ("qwen3_instruct_2507.jinja", False),
])
def test_env_tokens_and_prompts_are_the_whole_conversations_tokens(offline_assets, template, enable_thinking):
    tokenizer = template_tokenizer(offline_assets, template)
    engine = RolloutEngine(tokenizer, ScriptedGenerator(tokenizer, {}), LookupEnvs(),
                           RolloutConfig(enable_thinking=enable_thinking))

    for messages, env_messages, stop_token in STEPS:
        stop = tokenizer.convert_tokens_to_ids(stop_token)
        before = engine.transcript.render(messages, add_generation_prompt=False)
        whole = engine.transcript.render(messages + env_messages, add_generation_prompt=True)
        # After the model's stop token; a stop token the template does not write: from the template's own end on.
        end = stop if stop in before else tokenizer.eos_token_id
        cut = len(before) - before[::-1].index(end) - (0 if end == stop else 1)

        assert engine.transcript.env_suffix(messages, env_messages, [11, stop]) == whole[cut:]
        first = messages[:1]
        assert engine.transcript.prompt(first) == engine.transcript.render(first, add_generation_prompt=True)
    assert engine.transcript._text_cut  # the tokens above came from tokenizing the environment's text alone
