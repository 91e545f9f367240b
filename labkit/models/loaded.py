"""LoadedModel: what every loader returns and what the engine consumes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

Arch = Literal["gpt2", "llama"]


@dataclass
class LoadedModel:
    """A transformers causal LM with its tokenizer, in eval mode, on the CPU in float32.

    ``model`` is both the source of the weights the engine's runner uses and the reference
    that tests compare the engine against.
    """

    name: str
    model: Any  # transformers PreTrainedModel (GPT2LMHeadModel or LlamaForCausalLM)
    tokenizer: Any  # transformers PreTrainedTokenizerBase
    arch: Arch

    @property
    def eos_token_id(self) -> int | None:
        """One id that ends a sequence (some configs list several; the first is the primary)."""
        eos = self.model.config.eos_token_id
        if eos is None:
            eos = self.tokenizer.eos_token_id
        if isinstance(eos, (list, tuple)):
            eos = eos[0] if eos else None
        return None if eos is None else int(eos)

    @property
    def max_context(self) -> int:
        cfg = self.model.config
        return int(getattr(cfg, "n_positions", None) or cfg.max_position_embeddings)

    @property
    def vocab_size(self) -> int:
        return int(self.model.config.vocab_size)
