"""The engine's greedy output equals transformers' own greedy generate, token for token."""
import pytest
import torch
from engine_helpers import PROMPTS, drain, make_engine


@pytest.mark.parametrize("max_new_tokens", [12])
def test_greedy_output_equals_model_generate_for_eight_prompts(tiny_model, max_new_tokens):
    engine = make_engine(tiny_model)
    rids = [engine.submit(p, max_new_tokens=max_new_tokens) for p in PROMPTS[:8]]
    outcomes = drain(engine)
    tok = tiny_model.tokenizer
    for prompt, rid in zip(PROMPTS[:8], rids):
        ids = torch.tensor([tok.encode(prompt)])
        with torch.inference_mode():
            ref = tiny_model.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                            do_sample=False, pad_token_id=tiny_model.eos_token_id)
        expected = ref[0, ids.shape[1]:].tolist()
        got = outcomes[rid].tokens
        assert got == expected[: len(got)], f"{prompt!r}: engine {got} != generate {expected}"
        assert len(got) == len(expected) or outcomes[rid].reason == "eos"


def test_text_equals_decoding_the_generated_ids(tiny_model):
    engine = make_engine(tiny_model)
    rids = [engine.submit(p, max_new_tokens=10) for p in PROMPTS[:6]]
    outcomes = drain(engine)
    for rid in rids:
        out = outcomes[rid]
        assert out.text == tiny_model.tokenizer.decode(out.tokens, skip_special_tokens=True)
        assert out.usage.completion_tokens == len(out.tokens)
