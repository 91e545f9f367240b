"""Models by Hugging Face id or local folder, read only from what is already on this machine.

The hub is unreachable from the lab machines, so nothing here tries the network: an id loads
only if the user's Hugging Face cache already holds it, and the error says what to use instead.
"""

from __future__ import annotations

from pathlib import Path

from labkit.errors import UnknownModel
from labkit.models.loaded import Arch, LoadedModel
from labkit.models.tiny import freeze

#: transformers ``model_type`` -> the runner architecture that serves it (tested ones only).
SUPPORTED_TYPES: dict[str, Arch] = {"gpt2": "gpt2", "llama": "llama"}


class WeightsNotCached(UnknownModel):
    """A hub id whose files are not in the local Hugging Face cache (and the hub is unreachable)."""


class UnsupportedArchitecture(UnknownModel):
    """A model whose ``model_type`` the paged runner has no forward for."""


def load_pretrained(name_or_path: str, known: list[str]) -> LoadedModel:
    """Load a local folder with ``config.json`` or a hub id already in the local cache.

    ``known`` is the list of labkit's own names, quoted in the error so that a typo of one of
    them is easy to spot.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config, source = _read_config(name_or_path, known)
    arch = architecture_of(config.model_type)
    try:
        model = AutoModelForCausalLM.from_pretrained(source, local_files_only=True, dtype="float32")
        tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=True)
    except OSError as exc:
        raise WeightsNotCached(_not_cached(name_or_path, known)) from exc
    return LoadedModel(name_or_path, freeze(model), tokenizer, arch)


def architecture_of(model_type: str) -> Arch:
    """The runner architecture for a transformers ``model_type``, or UnsupportedArchitecture."""
    if model_type not in SUPPORTED_TYPES:
        raise UnsupportedArchitecture(
            f"model_type {model_type!r} is not supported by labkit's runner (supported: {', '.join(SUPPORTED_TYPES)})"
        )
    return SUPPORTED_TYPES[model_type]


def _read_config(name_or_path: str, known: list[str]):
    """The model's config and where to load it from (a folder path, or the hub id itself)."""
    from transformers import AutoConfig

    folder = Path(name_or_path).expanduser()
    if name_or_path.startswith(("/", ".", "~")) and not folder.exists():
        raise UnknownModel(f"{name_or_path!r}: no such folder")
    if folder.is_dir() and not (folder / "config.json").is_file():
        raise UnknownModel(f"{name_or_path!r} is a folder without config.json, so it is not a saved model")
    source = str(folder) if folder.is_dir() else name_or_path
    try:
        return AutoConfig.from_pretrained(source, local_files_only=True), source
    except OSError as exc:
        raise WeightsNotCached(_not_cached(name_or_path, known)) from exc
    except ValueError as exc:  # unknown model_type, or not a valid repo id
        raise UnknownModel(f"cannot load {name_or_path!r}: {exc}".splitlines()[0]) from exc


def _not_cached(name: str, known: list[str]) -> str:
    return (
        f"{name!r} is not a labkit model ({', '.join(known)}) and its weights are not in the local "
        "Hugging Face cache; the hub is unreachable from here, so use 'smollm2-135m' for real weights offline"
    )
