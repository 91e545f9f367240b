"""Batched sampling is today's per-row sampling, token for token, and a bad row fails alone.

``reference_sample`` is the engine's per-row sampler as it was before sampling was batched: the
batched ``Sampler`` must draw exactly what it drew, for greedy and for seeded rows, whatever the
neighbours in the batch.
"""
import random

import pytest
import torch

from labkit.engine.sampling import Sampler, make_generator
from labkit.engine.sequence import GREEDY_BELOW, SamplingParams, Sequence


def reference_sample(logits, params, generator):
    if params.temperature == 0:
        return int(torch.argmax(logits))
    logits = logits.float()
    probs = torch.softmax((logits - logits.max()) / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        sorted_probs[before >= params.top_p] = 0.0
        kept = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        probs = kept / kept.sum()
    return int(torch.multinomial(probs, 1, generator=generator))


def _seq(params):
    return Sequence("r", [1], params, make_generator(params, "cpu"))


def _mixed_params(rng, n):
    out = []
    for i in range(n):
        kind = rng.choice(["greedy", "temp", "temp+top_p"])
        if kind == "greedy":
            out.append(SamplingParams())
        else:
            top_p = rng.choice([0.05, 0.5, 0.9, 0.95]) if kind == "temp+top_p" else 1.0
            out.append(SamplingParams(temperature=rng.choice([0.3, 0.7, 1.0, 1.5, 3.0]), top_p=top_p, seed=1000 + i))
    return out


@pytest.mark.parametrize("vocab", [50257, 300])
def test_batched_sampling_draws_what_per_row_sampling_drew(vocab):
    rng = random.Random(vocab)
    torch.manual_seed(vocab)
    for batch in (1, 3, 8, 17):
        params = _mixed_params(rng, batch)
        logits = torch.randn(batch, vocab) * 4
        seqs = [_seq(p) for p in params]
        refs = [make_generator(p, "cpu") for p in params]
        sampler = Sampler("cpu")
        for _ in range(3):  # the same batch for several steps: the cached row tensors are reused
            got = sampler.sample(logits, seqs)
            want = [reference_sample(logits[i], p, g) for i, (p, g) in enumerate(zip(params, refs))]
            assert got == want, (batch, params)


def test_a_seeded_row_draws_the_same_whatever_its_neighbours():
    torch.manual_seed(0)
    row = torch.randn(1, 4000) * 3
    params = SamplingParams(temperature=1.2, top_p=0.9, seed=42)
    alone = [Sampler("cpu").sample(row, [_seq(params)])[0] for _ in range(1)]
    crowd_logits = torch.cat([torch.randn(5, 4000), row, torch.randn(4, 4000)])
    crowd = [_seq(p) for p in _mixed_params(random.Random(1), 5)] + [_seq(params)] + \
        [_seq(p) for p in _mixed_params(random.Random(2), 4)]
    assert Sampler("cpu").sample(crowd_logits, crowd)[5] == alone[0]


@pytest.mark.parametrize("temperature", [5e-324, 1e-45, 1e-30, GREEDY_BELOW / 2])
def test_temperatures_below_the_threshold_are_greedy(temperature):
    params = SamplingParams(temperature=temperature, seed=1)
    assert params.greedy and make_generator(params, "cpu") is None


def test_a_top_p_that_underflows_keeps_the_most_likely_token():
    logits = torch.randn(2, 1000)
    seqs = [_seq(SamplingParams(temperature=1.0, top_p=5e-324, seed=s)) for s in (1, 2)]
    assert Sampler("cpu").sample(logits, seqs) == torch.argmax(logits, dim=-1).tolist()


def test_a_row_without_a_distribution_gets_none_and_its_neighbours_their_tokens():
    logits = torch.randn(3, 500)
    logits[1] = float("nan")
    params = [SamplingParams(temperature=0.8, seed=s) for s in (1, 2, 3)]
    refs = [make_generator(p, "cpu") for p in params]
    got = Sampler("cpu").sample(logits, [_seq(p) for p in params])
    assert got[1] is None
    assert [got[0], got[2]] == [reference_sample(logits[i], params[i], refs[i]) for i in (0, 2)]


def test_a_row_whose_draw_raises_gets_none_and_its_neighbours_their_tokens():
    logits = torch.randn(3, 500)
    params = [SamplingParams(temperature=0.8, seed=s) for s in (1, 2, 3)]
    seqs = [_seq(p) for p in params]
    seqs[0].generator = object()  # not a generator: multinomial raises for this row only
    refs = [make_generator(p, "cpu") for p in params]
    got = Sampler("cpu").sample(logits, seqs)
    assert got[0] is None
    assert got[1:] == [reference_sample(logits[i], params[i], refs[i]) for i in (1, 2)]
