"""Tiny random models: the real architectures at toy size, for tests that must run in seconds.

Their weights are random but seeded, so every load gives the same model. They are drawn with a
large spread (``initializer_range=0.2``): with the default 0.02 the logits are nearly uniform,
greedy picks hinge on rounding-level gaps, and every prompt continues the same way. With 0.2 the
top logit usually wins by a wide margin and different prompts continue differently.
"""

from __future__ import annotations

import torch

from labkit.models.loaded import LoadedModel
from labkit.models.tokenizers import gpt2_tokenizer, smollm2_tokenizer

SEED = 1234
INIT_STD = 0.2


def tiny_gpt2() -> LoadedModel:
    """A 2-layer, 64-wide GPT-2 (4 heads, 512 positions) with the real GPT-2 tokenizer."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=50257,
        n_positions=512,
        n_embd=64,
        n_layer=2,
        n_head=4,
        initializer_range=INIT_STD,
        bos_token_id=50256,
        eos_token_id=50256,
    )
    model = _seeded(lambda: GPT2LMHeadModel(config))
    return LoadedModel("tiny-gpt2", model, gpt2_tokenizer(), "gpt2")


def tiny_llama() -> LoadedModel:
    """A 2-layer Llama with grouped-query attention (4 query heads share 2 KV heads, head_dim 16),
    an untied lm head and the SmolLM2 tokenizer (bos 1, eos 2)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False,
        initializer_range=INIT_STD,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    model = _seeded(lambda: LlamaForCausalLM(config))
    return LoadedModel("tiny-llama", model, smollm2_tokenizer(), "llama")


def _seeded(build):
    """Build under a fixed seed without disturbing the caller's global RNG state."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        model = build()
    return freeze(model)


def freeze(model):
    """Eval mode, float32, no gradients: what every loader hands out."""
    model = model.to(torch.float32).eval()
    model.requires_grad_(False)
    return model
