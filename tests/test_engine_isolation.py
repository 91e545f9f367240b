"""Greedy output does not depend on the neighbours: every concurrent run equals its solo run."""
import pytest
from engine_helpers import PROMPTS, collect, drain, make_engine, solo

PROMPT_POOL = [p + suffix for suffix in ("", " and then", " — said nobody") for p in PROMPTS][:32]


@pytest.fixture(scope="module")
def solo_runs(tiny_gpt2, tiny_llama):
    runs = {}
    for model in (tiny_gpt2, tiny_llama):
        for prompt in PROMPT_POOL:
            runs[model.name, prompt] = solo(model, prompt, max_new_tokens=10).tokens
    return runs


@pytest.mark.parametrize("concurrency", [1, 2, 4, 8, 16, 32])
def test_concurrent_requests_each_equal_their_solo_run(tiny_model, solo_runs, concurrency):
    engine = make_engine(tiny_model)
    prompts = PROMPT_POOL[:concurrency]
    rids = [engine.submit(p, max_new_tokens=10) for p in prompts]
    outcomes = drain(engine)
    for prompt, rid in zip(prompts, rids):
        assert outcomes[rid].tokens == solo_runs[tiny_model.name, prompt], prompt


def test_late_joiners_equal_their_solo_runs(tiny_model, solo_runs):
    engine = make_engine(tiny_model)
    outcomes, rids = {}, {}
    for i, prompt in enumerate(PROMPT_POOL[:12]):
        rids[prompt] = engine.submit(prompt, max_new_tokens=10)
        for _ in range(i % 3 + 1):  # let the batch move on before the next one joins
            collect(engine.step(), outcomes)
    drain(engine, outcomes)
    for prompt, rid in rids.items():
        assert outcomes[rid].tokens == solo_runs[tiny_model.name, prompt], prompt


def test_sampled_request_with_a_seed_does_not_depend_on_its_neighbours(tiny_model):
    alone = solo(tiny_model, PROMPTS[0], max_new_tokens=12, temperature=0.9, top_p=0.95, seed=1234)
    neighbours = {p: {"temperature": 1.0, "seed": i, "top_p": 0.9 if i % 2 else 1.0} if i % 3 else {}
                  for i, p in enumerate(PROMPTS[1:9])}  # sampled with and without top-p, and greedy
    engine = make_engine(tiny_model)
    others = {engine.submit(p, max_new_tokens=12, **kw): p for p, kw in neighbours.items()}
    rid = engine.submit(PROMPTS[0], max_new_tokens=12, temperature=0.9, top_p=0.95, seed=1234)
    outcomes, steps = {}, {}
    while engine.has_work():
        events = engine.step()
        collect(events, outcomes)
        for e in events:
            steps.setdefault(e.rid, set()).add(e.step)
    assert outcomes[rid].tokens == alone.tokens
    for other, prompt in others.items():  # the neighbours were really there, and each is its own solo run
        assert steps[other] & steps[rid], f"{prompt!r} never shared a step with the seeded request"
        assert outcomes[other].tokens == solo(tiny_model, prompt, max_new_tokens=12, **neighbours[prompt]).tokens


@pytest.mark.parametrize("temperature", [1e-4, 1e-40])
def test_a_vanishing_temperature_samples_the_greedy_token_instead_of_failing(tiny_model, temperature):
    greedy = solo(tiny_model, PROMPTS[2], max_new_tokens=6)
    sampled = solo(tiny_model, PROMPTS[2], max_new_tokens=6, temperature=temperature, seed=3)
    assert sampled.tokens == greedy.tokens and sampled.reason == "length"


def test_the_same_seed_gives_the_same_sample_and_another_seed_usually_differs(tiny_model):
    a = solo(tiny_model, PROMPTS[1], max_new_tokens=16, temperature=1.5, seed=7)
    b = solo(tiny_model, PROMPTS[1], max_new_tokens=16, temperature=1.5, seed=7)
    c = [solo(tiny_model, PROMPTS[1], max_new_tokens=16, temperature=1.5, seed=s).tokens for s in (8, 9, 10)]
    assert a.tokens == b.tokens
    assert any(tokens != a.tokens for tokens in c)
