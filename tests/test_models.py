"""Loading models offline: labkit's names, local folders, and the errors for everything else."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from runner_helpers import PROMPTS, encode, hf_greedy

from labkit.errors import UnknownModel
from labkit.models import LoadedModel, UnsupportedArchitecture, WeightsNotCached, known_models, load_model
from labkit.models.cache_dir import cached_folder, labkit_cache_dir
from labkit.models.tokenizers import gpt2_tokenizer, smollm2_tokenizer


def _assert_frozen(loaded: LoadedModel) -> None:
    assert not loaded.model.training
    assert all(p.dtype == torch.float32 and not p.requires_grad for p in loaded.model.parameters())


# -- tokenizers and the cache dir -------------------------------------------------------------
def test_gpt2_tokenizer_is_the_real_bpe_and_loaded_once() -> None:
    tok = gpt2_tokenizer()
    assert tok("Hello world").input_ids == [15496, 995]
    assert len(tok) == 50257 and tok.eos_token_id == 50256
    assert tok.decode(tok("naïve café, 東京").input_ids) == "naïve café, 東京"
    assert gpt2_tokenizer() is tok


def test_smollm2_tokenizer_keeps_ids_and_chat_template() -> None:
    tok = smollm2_tokenizer()
    assert (len(tok), tok.bos_token_id, tok.eos_token_id) == (49152, 1, 2)
    assert tok("The capital of France is").input_ids == [504, 3575, 282, 4649, 314]
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat.endswith("<|im_start|>assistant\n")


def test_cache_dir_follows_labkit_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("LABKIT_CACHE", str(tmp_path / "c"))
    assert labkit_cache_dir() == tmp_path / "c" and (tmp_path / "c").is_dir()


def test_an_interrupted_build_leaves_nothing_behind(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("LABKIT_CACHE", str(tmp_path))

    def crash(folder: Path) -> None:
        (folder / "half.bin").write_bytes(b"x")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        cached_folder("thing", crash)
    assert list(tmp_path.iterdir()) == []
    calls = []
    folder = cached_folder("thing", lambda f: calls.append((f / "ok").write_text("1")))
    assert cached_folder("thing", lambda f: calls.append("again")) == folder
    assert (folder / "ok").read_text() == "1" and len(calls) == 1


# -- labkit's named models --------------------------------------------------------------------
def test_tiny_gpt2_loads_frozen_with_the_gpt2_tokenizer(tiny_gpt2: LoadedModel) -> None:
    _assert_frozen(tiny_gpt2)
    m = tiny_gpt2
    assert (m.arch, m.eos_token_id, m.max_context, m.vocab_size) == ("gpt2", 50256, 512, 50257)
    assert tiny_gpt2.tokenizer is gpt2_tokenizer()


def test_tiny_llama_uses_grouped_query_attention_and_smollm2_tokenizer(tiny_llama: LoadedModel) -> None:
    _assert_frozen(tiny_llama)
    cfg = tiny_llama.model.config
    assert cfg.num_key_value_heads < cfg.num_attention_heads
    m = tiny_llama
    assert (m.arch, m.eos_token_id, m.max_context, m.vocab_size) == ("llama", 2, 512, 49152)


@pytest.mark.parametrize("name", ["tiny-gpt2", "tiny-llama"])
def test_tiny_models_are_identical_across_loads_and_leave_global_rng_alone(name: str) -> None:
    state = torch.get_rng_state()
    first, second = load_model(name), load_model(name)
    assert torch.equal(torch.get_rng_state(), state)
    for (key, a), b in zip(first.model.state_dict().items(), second.model.state_dict().values()):
        assert torch.equal(a, b), key


def test_tiny_models_continue_decisively_and_differently(tiny_model: LoadedModel) -> None:
    prompts = [encode(tiny_model, p) for p in PROMPTS]
    with torch.inference_mode():
        for ids in prompts:
            top2 = tiny_model.model(torch.tensor([ids])).logits[0, -1].topk(2).values
            assert top2[0] - top2[1] > 1e-3, "greedy must not hinge on rounding"
    firsts = [hf_greedy(tiny_model, ids, 4) for ids in prompts]
    assert all(seq[0] != tiny_model.eos_token_id for seq in firsts)
    assert len({tuple(s) for s in firsts}) >= len(prompts) - 2


# -- names, paths and errors ------------------------------------------------------------------
def test_unknown_short_name_lists_the_known_names() -> None:
    with pytest.raises(UnknownModel) as err:
        load_model("tiny-gpt3")
    message = str(err.value)
    assert "\n" not in message and all(name in message for name in known_models())


def test_gpt2_offline_says_the_cache_lacks_it_and_offers_smollm2() -> None:
    from huggingface_hub import try_to_load_from_cache

    if isinstance(try_to_load_from_cache("gpt2", "config.json"), str):
        pytest.skip("this machine's Hugging Face cache holds gpt2")
    with pytest.raises(WeightsNotCached) as err:
        load_model("gpt2")
    message = str(err.value)
    assert "\n" not in message and "Hugging Face cache" in message and "smollm2-135m" in message


def test_a_saved_folder_loads_directly(tiny_gpt2: LoadedModel, tmp_path: Path) -> None:
    tiny_gpt2.model.save_pretrained(tmp_path)
    tiny_gpt2.tokenizer.save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path))
    _assert_frozen(loaded)
    assert loaded.arch == "gpt2" and loaded.tokenizer("Hello world").input_ids == [15496, 995]
    ids = torch.tensor([[15496, 995, 11]])
    with torch.inference_mode():
        assert torch.equal(loaded.model(ids).logits, tiny_gpt2.model(ids).logits)


def test_a_folder_without_config_is_refused(tmp_path: Path) -> None:
    with pytest.raises(UnknownModel, match="config.json"):
        load_model(str(tmp_path))


def test_an_unsupported_architecture_is_named(tmp_path: Path) -> None:
    from transformers import BertConfig

    config = BertConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=2, intermediate_size=64)
    config.save_pretrained(tmp_path)
    with pytest.raises(UnsupportedArchitecture, match="'bert'"):
        load_model(str(tmp_path))


# -- SmolLM2 (real weights, converted once) -----------------------------------------------------
@pytest.mark.slow
@pytest.mark.smollm2
def test_smollm2_loads_from_cache_and_knows_paris() -> None:
    loaded = load_model("smollm2-135m")
    _assert_frozen(loaded)
    cfg = loaded.model.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads) == (30, 576, 9, 3)
    assert "quantization_config" not in cfg.to_dict()
    assert (labkit_cache_dir() / "smollm2-135m" / "model.safetensors").is_file()
    ids = encode(loaded, "The capital of France is")
    assert loaded.tokenizer.decode(hf_greedy(loaded, ids, 3)).startswith(" Paris.")
