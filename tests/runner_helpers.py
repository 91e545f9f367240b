"""Helpers for the runner tests: scattered block tables, HF references, greedy drivers.

The block tables are deliberately non-contiguous and shuffled: a runner that ignored the table
and wrote position p to slot p would pass any test whose tables were ``range(n)``.
"""
from __future__ import annotations

import random
from collections.abc import Sequence

import torch
from prompt_lists import RUNNER_PROMPTS

from labkit.engine.runner import ModelRunner
from labkit.models import LoadedModel

PROMPTS = RUNNER_PROMPTS  # handed on under the name the tests use


def shuffled_tables(num_seqs: int, blocks_each: int, num_blocks: int, seed: int = 0) -> list[list[int]]:
    """Disjoint block tables drawn at random from the whole pool."""
    assert num_seqs * blocks_each <= num_blocks, "pool too small for the tables asked for"
    ids = random.Random(seed).sample(range(num_blocks), num_seqs * blocks_each)
    return [ids[i * blocks_each:(i + 1) * blocks_each] for i in range(num_seqs)]


def make_runner(loaded: LoadedModel, *, block_size: int = 4, num_blocks: int = 512, **kwargs) -> ModelRunner:
    return ModelRunner(loaded, num_blocks=num_blocks, block_size=block_size, **kwargs)


def encode(loaded: LoadedModel, text: str) -> list[int]:
    return list(loaded.tokenizer(text).input_ids)


@torch.inference_mode()
def hf_logits(loaded: LoadedModel, ids: Sequence[int]) -> torch.Tensor:
    """transformers' own forward over the whole sequence: (len, vocab) float32."""
    return loaded.model(torch.tensor([list(ids)])).logits[0].float()


@torch.inference_mode()
def hf_greedy(loaded: LoadedModel, ids: Sequence[int], num_new: int) -> list[int]:
    """transformers' greedy continuation, cut after the first eos."""
    eos = loaded.eos_token_id
    out = loaded.model.generate(torch.tensor([list(ids)]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                max_new_tokens=num_new, do_sample=False, pad_token_id=eos)
    return cut_at_eos(out[0, len(ids):].tolist(), eos)


def cut_at_eos(tokens: list[int], eos: int | None) -> list[int]:
    return tokens[:tokens.index(eos) + 1] if eos in tokens else tokens


def runner_greedy(runner: ModelRunner, prompts: Sequence[Sequence[int]], tables: Sequence[Sequence[int]],
                  num_new: int, eos: int | None) -> list[list[int]]:
    """Greedy decoding of all prompts together: prefill each, then one batched decode per step,
    dropping a sequence from the batch when it emits eos."""
    outputs = [[int(runner.prefill(p, t).argmax())] for p, t in zip(prompts, tables)]
    for _ in range(num_new - 1):
        live = [i for i, out in enumerate(outputs) if out[-1] != eos]
        if not live:
            break
        logits = runner.decode([outputs[i][-1] for i in live],
                               [len(prompts[i]) + len(outputs[i]) - 1 for i in live],
                               [tables[i] for i in live])
        for row, i in enumerate(live):
            outputs[i].append(int(logits[row].argmax()))
    return outputs
