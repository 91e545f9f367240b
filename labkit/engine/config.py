"""EngineConfig: the engine's settings, validated once when made."""

from __future__ import annotations

from dataclasses import dataclass

import torch

DTYPES = ("float32", "bfloat16", "float16")
_ATTENTION = ("auto", "kernel", "gather")  # attention.py ATTENTION_MODES (kept light: no torch import there)
_MATMUL = ("auto", "kernel", "library")  # matmul.py MATMUL_MODES
# Chosen from notebook 09's budget sweep and burst (data/peers/: 32 streams of 64 tokens; a 1,000-token prompt
# arriving among 31): smaller budgets smooth the gaps but leave few prompt tokens a step once the streams
# decode, so a prompt arriving among them waits long for its first token; larger ones let its prefill stall them.
DEFAULT_STEP_TOKENS = 64
# A step's budget in a surge (more prompts waiting to start than streams decoding): vLLM's default
# max_num_batched_tokens for chunked prefill, enough for 32 prompts of ~40 tokens in one step.
DEFAULT_SURGE_TOKENS = 2048


@dataclass(frozen=True)
class EngineConfig:
    """How big the cache is, how many sequences decode together, and where they run.

    ``num_blocks=None`` sizes the cache so that ``max_batch`` sequences of the model's full
    context fit. ``batch_invariant`` makes a row's numbers independent of how many neighbours it
    has (see runner.py): the fixed-order matmul (``matmul``), or row tiles of ``tile_rows``.
    ``max_waiting=None`` means no waiting limit. ``kv_cache_mb`` caps the default cache size.
    ``attention``: how decode reads the cache: ``"kernel"`` through the block tables (paged
    kernel), ``"gather"`` by a contiguous copy, ``"auto"`` the kernel where it builds with hardware
    FMA (see attention.py ``choose_attention``; the runner's ``attention.reason`` says which and why).
    ``matmul``: how the batch-invariant mode multiplies: ``"kernel"`` in a fixed order
    (``matmul.py``), ``"library"`` through torch's matmuls in probed row chunks (``layers.Tiling``),
    ``"auto"`` the kernel where it builds with hardware FMA and, measured once on this machine, is
    not slower than the library (the runner's ``matmul.reason`` says which and why, with the numbers).
    On ``device="cuda"`` every kernel is off and ``auto`` says so: the torch path runs there.
    ``step_tokens``: the token budget of one step (chunked prefill, see scheduler.py): every
    decoding sequence gets its one token, and prompts fill the rest, in chunks, so a long prompt
    is spread over several steps instead of stalling every stream for its whole prefill (at
    least one prompt token per step goes in whatever the decode rows take). ``None`` is
    unchunked: each step prefills every prompt it admits whole, before the streams move on.
    ``surge_tokens``: the budget instead while more prompts could start than streams decode (the
    streams a surge step just started counting as prompts, once a burst; no prompt taking more than
    ``step_tokens`` of the budget), when a longer step stalls fewer streams than
    it moves prompts along; at least ``step_tokens``, and unused unchunked (None: ``step_tokens``
    always).
    ``step_delay``: seconds slept at the end of every step that did work, for the lab only (0,
    the default, adds nothing): a slower engine on demand, so a test can show that a verdict
    counted in steps and tokens does not move when the engine's speed does.
    """

    block_size: int = 16
    num_blocks: int | None = None
    max_batch: int = 32
    max_waiting: int | None = None
    device: str = "cpu"
    dtype: str = "float32"
    batch_invariant: bool = True
    tile_rows: int = 8
    kv_cache_mb: int = 512
    attention: str = "auto"
    matmul: str = "auto"
    step_tokens: int | None = DEFAULT_STEP_TOKENS  # tokens one step may run, decode rows first (none: unchunked)
    surge_tokens: int | None = DEFAULT_SURGE_TOKENS  # the budget while starting prompts outnumber decoding streams
    step_delay: float = 0.0

    def __post_init__(self) -> None:
        _positive("block_size", self.block_size)
        _positive("max_batch", self.max_batch)
        _positive("tile_rows", self.tile_rows)
        _positive("kv_cache_mb", self.kv_cache_mb)
        if self.num_blocks is not None:
            _positive("num_blocks", self.num_blocks)
        if self.step_tokens is not None:
            _positive("step_tokens", self.step_tokens)
        if self.surge_tokens is not None:
            _positive("surge_tokens", self.surge_tokens)
            if self.step_tokens is not None and self.surge_tokens < self.step_tokens:
                raise ValueError(
                    f"EngineConfig.surge_tokens ({self.surge_tokens}) must be at least step_tokens "
                    f"({self.step_tokens}): a surge widens the step's budget, never narrows it"
                )
        if self.max_waiting is not None and (not isinstance(self.max_waiting, int) or self.max_waiting < 0):
            raise ValueError(f"EngineConfig.max_waiting must be a non-negative int or None, got {self.max_waiting!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"EngineConfig.dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.attention not in _ATTENTION:
            raise ValueError(f"EngineConfig.attention must be one of {_ATTENTION}, got {self.attention!r}")
        if self.matmul not in _MATMUL:
            raise ValueError(f"EngineConfig.matmul must be one of {_MATMUL}, got {self.matmul!r}")
        if (
            not isinstance(self.step_delay, (int, float))
            or isinstance(self.step_delay, bool)
            or not 0 <= self.step_delay <= 10
        ):
            raise ValueError(f"EngineConfig.step_delay must be seconds in [0, 10], got {self.step_delay!r}")
        check_device(self.device)


_DEVICE_TYPES = ("cpu", "cuda", "mps", "xpu")


def check_device(device: object) -> None:
    """Refuse a device torch cannot name, or one this machine does not have, when the config is made.

    Found later, a bad device fails inside the first step (the model, the cache, each request's
    sampling generator are all placed on it), where it ends every open stream at once.
    """
    if not isinstance(device, str) or not device:
        raise ValueError(f"EngineConfig.device must be a device name like 'cpu' or 'cuda', got {device!r}")
    try:
        parsed = torch.device(device)
    except RuntimeError:
        raise ValueError(
            f"EngineConfig.device {device!r} is not a device name: use one of "
            f"{', '.join(_DEVICE_TYPES)}, optionally with an index ('cuda:1')"
        ) from None
    if parsed.type not in _DEVICE_TYPES:
        raise ValueError(f"EngineConfig.device {device!r} is not supported: use one of {', '.join(_DEVICE_TYPES)}")
    if parsed.type == "cpu":
        return
    backend = getattr(torch, parsed.type, None) if parsed.type != "mps" else torch.backends.mps
    if backend is None or not backend.is_available():
        raise ValueError(
            f"EngineConfig.device {device!r}: this machine has no {parsed.type} device (torch {torch.__version__})"
        )
    count = backend.device_count() if hasattr(backend, "device_count") else 1
    if parsed.index is not None and parsed.index >= count:
        raise ValueError(f"EngineConfig.device {device!r}: this machine has {count} {parsed.type} device(s)")


def _positive(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"EngineConfig.{name} must be a positive int, got {value!r}")
