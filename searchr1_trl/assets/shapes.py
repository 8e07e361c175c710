"""Published architecture numbers of the recipe models, so plans validate and benchmarks build random-weight
stand-ins without downloading anything (values from each model's config.json on the Hub)."""

from __future__ import annotations

PUBLISHED_CONFIGS: dict[str, dict] = {
    "Qwen/Qwen3-1.7B": dict(
        model_type="qwen3", hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=40960,
    ),
    "Qwen/Qwen3-8B": dict(
        model_type="qwen3", hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=False,
        max_position_embeddings=40960,
    ),
    "Qwen/Qwen3-30B-A3B": dict(
        model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
        num_experts_per_tok=8, vocab_size=151936, tie_word_embeddings=False, max_position_embeddings=40960,
    ),
    # The seed's 30B dense model with 2 KV heads; its other numbers are a Qwen3-style 30B stand-in.
    "meta-models/Muse-Glimmer-30B": dict(
        model_type="qwen3", hidden_size=6144, intermediate_size=20480, num_hidden_layers=60, num_attention_heads=48,
        num_key_value_heads=2, head_dim=128, vocab_size=151936, tie_word_embeddings=False,
        max_position_embeddings=40960,
    ),
}


def random_model(name: str, dtype="bfloat16", device="cpu", **overrides):
    """A randomly initialised model with the published shape of ``name`` (no download)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    attn_implementation = overrides.pop("attn_implementation", None)
    values = {**PUBLISHED_CONFIGS[name], **overrides}
    config = AutoConfig.for_model(values.pop("model_type"), **values)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype),
                                                attn_implementation=attn_implementation)
