"""Training rows that cannot be rolled out: found by the plan check before a run, made harmless inside one.

A row whose rendered prompt leaves no room for one generated token within ``max_rollout_tokens`` ends its rollouts
``truncated_prompt_too_long`` with an empty completion. TRL 1.16 cannot take an empty completion (its
``parse_response`` raises ``AttributeError`` on it, which killed the run), so :func:`overlong_prompts` lets the plan
check name such rows before training, and :func:`with_placeholder_completion` gives any that reach the trainer anyway
(a recipe built in Python, not through ``searchr1-train``) one end-of-turn token outside the loss: the rollout is
skipped, not trained on, and counted as ``rollout/status_truncated_prompt_too_long``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace

from searchr1_trl.engine.rollout import Rollout, RolloutConfig, RolloutEngine

logger = logging.getLogger(__name__)

# Tokens a message content may add beyond its bytes where it meets the template's text (a merge across the boundary
# can split a token the two sides had whole); generous, since it only decides which prompts are tokenized exactly.
BOUNDARY_SLACK = 16


def overlong_prompts(samples: Sequence, envs, tokenizer, rollout: RolloutConfig) -> list[tuple[int, int]]:
    """``(position, prompt tokens)`` of every sample whose initial prompt leaves no room for a generated token.

    Rendering and tokenizing every prompt of a 170k-row file takes minutes, so each prompt is first bounded: the
    template's tokens with every message content emptied, plus the contents' bytes (a byte-level BPE token covers at
    least one byte), plus :data:`BOUNDARY_SLACK` for merges where a content meets the template. Only a sample whose
    bound reaches ``max_rollout_tokens`` is rendered and tokenized exactly.
    """
    if not samples:
        return []
    engine = RolloutEngine(tokenizer, None, envs, rollout)

    def content_bytes(messages: list[dict]) -> int:
        return sum(len(str(m.get("content") or "").encode()) for m in messages)

    emptied = [{**message, "content": ""} for message in envs().reset(samples[0])]
    template_tokens = len(engine.transcript.prompt(emptied)) + BOUNDARY_SLACK
    found = []
    for position, sample in enumerate(samples):
        messages = envs().reset(sample)
        if template_tokens + content_bytes(messages) < rollout.max_rollout_tokens:
            continue
        tokens = len(engine.transcript.prompt(messages))
        if tokens >= rollout.max_rollout_tokens:
            found.append((position, tokens))
    return found


def with_placeholder_completion(rollouts: Sequence[Rollout], end_token_id: int) -> list[Rollout]:
    """The rollouts, each one without a completion given ``end_token_id`` as its completion, outside the loss
    (``env_mask`` 0), and logged once with its question."""
    empty = [r for r in rollouts if not r.completion_ids]
    for rollout in empty:
        logger.warning("skipping a rollout with no completion (%s, a prompt of %d tokens): %.80r",
                       rollout.status.value, len(rollout.prompt_ids), getattr(rollout.sample, "question", ""))
    return [replace(r, completion_ids=[end_token_id], env_mask=[0], logprobs=[0.0]) if not r.completion_ids else r
            for r in rollouts]

