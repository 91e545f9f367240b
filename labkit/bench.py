"""Benchmarks: ratios measured in one run, never asserted by tests.

``step``: the median decode step with no prefill in it, for several batch sizes, in both modes
(batch-invariant and plain), beside a bare transformers forward over the same batch and context
and beside the step's floor: its matrix products alone (every layer's and the lm head's, same
shapes, same weights, same threads), which is what a step cannot go below (the gather against the
paged kernel is ``labkit bench attention``, in ``bench_attention.py``). ``generate``: many requests through the
engine at once, against the same requests one after another, and against transformers' own
continuous batching (``generate_batch``), once with a cache sized to the work (as the engine's
is) and once left to size its own. Each request makes exactly ``new_tokens`` unless
``ignore_eos`` is off, and the table counts the outputs identical to the engine's.
"""

from __future__ import annotations

import contextlib
import copy
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pandas as pd
import torch

from labkit.engine.config import EngineConfig
from labkit.engine.engine import BatchEngine
from labkit.engine.events import TokenEvent
from labkit.engine.layers import linear
from labkit.models import LoadedModel, load_model
from labkit.prompts import PROMPTS, context_ids


@dataclass(frozen=True)
class StepBench:
    model: str = "smollm2-135m"
    batches: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    context: int = 64
    steps: int = 15
    warmup: int = 3
    dtype: str = "float32"
    rounds: int = 1  # every column measured this many times, interleaved; the table shows medians


@dataclass(frozen=True)
class GenerateBench:
    model: str = "smollm2-135m"
    requests: int = 32
    new_tokens: int = 64
    dtype: str = "float32"
    with_generate_batch: bool = True
    with_self_sized: bool = True  # also run generate_batch as it sizes itself (slow to start on a CPU)
    ignore_eos: bool = True  # every request makes exactly new_tokens, as throughput benchmarks arrange


def median_ms(call: Callable[[], object], warmup: int, steps: int) -> float:
    """The median of ``steps`` calls of ``call``, in ms, each timed alone with ``perf_counter``
    after ``warmup`` calls timed the same way and left out."""
    times = []
    for _ in range(warmup + steps):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times[warmup:])


def _engine_step_ms(
    loaded: LoadedModel, prompts: list[list[int]], cfg: StepBench, invariant: bool
) -> tuple[float, BatchEngine]:
    batch = len(prompts)
    engine = BatchEngine(
        loaded,
        EngineConfig(
            max_batch=batch,
            dtype=cfg.dtype,
            batch_invariant=invariant,
            num_blocks=batch * (-(-(cfg.context + cfg.steps + cfg.warmup + 2) // 16)),
            step_tokens=None,  # the first step prefills every prompt whole; the timed steps only decode
        ),
    )
    for p in prompts:
        engine.submit(p, max_new_tokens=cfg.steps + cfg.warmup + 2)
    engine.step()  # admits and prefills every prompt; the steps timed below only decode
    return median_ms(engine.step, cfg.warmup, cfg.steps), engine


@torch.inference_mode()
def _matmul_floor_ms(engine: BatchEngine, batch: int, cfg: StepBench, *, as_engine: bool) -> float:
    """The step's matrix products alone, on random rows: every (weight, bias) the forward
    multiplies by, once each, through ``layers.linear``.

    ``as_engine=False`` is the floor: plain matmuls over exactly ``batch`` rows. ``as_engine=True``
    makes them the way the engine's own mode does (padded rows, tiles), which shows how much of
    the step the batch-invariant matmuls themselves cost.
    """
    runner = engine.runner
    tile = runner._tile if as_engine else None
    rows = batch if tile is None else tile.padded(batch)
    products = runner.network.matmuls()
    inputs = {w.shape[0]: torch.randn(rows, w.shape[0], dtype=runner.dtype, device=runner.device) for w, _ in products}

    def all_products() -> None:
        for weight, bias in products:
            linear(inputs[weight.shape[0]], weight, bias, tile)

    return median_ms(all_products, cfg.warmup, cfg.steps)


@contextlib.contextmanager
def _in_dtype(loaded: LoadedModel, dtype: str) -> Iterator[Any]:
    """The transformers model in ``dtype`` for one measurement.

    Another dtype gets a copy: casting the loaded model down and back would round its float32
    weights for everyone who uses it afterwards.
    """
    if dtype == "float32":
        yield loaded.model
        return
    model = copy.deepcopy(loaded.model).to(getattr(torch, dtype))
    try:
        yield model
    finally:
        del model


@torch.inference_mode()
def _bare_forward_ms(loaded: LoadedModel, prompts: list[list[int]], cfg: StepBench) -> float:
    with _in_dtype(loaded, cfg.dtype) as model:
        return _time_bare_forward(model, prompts, cfg)


def _time_bare_forward(model: torch.nn.Module, prompts: list[list[int]], cfg: StepBench) -> float:
    ids = torch.tensor(prompts)
    out = model(input_ids=ids, use_cache=True)
    cache, nxt = out.cache, out.logits[:, -1:].argmax(-1)

    def decode() -> None:
        nonlocal cache, nxt
        out = model(input_ids=nxt, cache=cache, use_cache=True)
        cache, nxt = out.cache, out.logits[:, -1:].argmax(-1)

    return median_ms(decode, cfg.warmup, cfg.steps)


def _step_row(loaded: LoadedModel, batch: int, cfg: StepBench) -> dict[str, float]:
    """One measurement of every column for one batch size, taken back to back."""
    prompts = context_ids(loaded.tokenizer, batch, cfg.context)
    bare = _bare_forward_ms(loaded, prompts, cfg)
    invariant, engine = _engine_step_ms(loaded, prompts, cfg, invariant=True)
    floor = _matmul_floor_ms(engine, batch, cfg, as_engine=False)
    invariant_matmuls = _matmul_floor_ms(engine, batch, cfg, as_engine=True)
    del engine
    plain, _ = _engine_step_ms(loaded, prompts, cfg, invariant=False)
    return {
        "bare_forward_ms": bare,
        "engine_step_ms": invariant,
        "engine_plain_ms": plain,
        "matmul_floor_ms": floor,
        "invariant_matmuls_ms": invariant_matmuls,
    }


def bench_step(cfg: StepBench = StepBench(), loaded: LoadedModel | None = None) -> pd.DataFrame:
    """One row per batch size: times in ms and the ratios the engine is steered by.

    ``engine_step_ms`` is the batch-invariant mode, ``engine_plain_ms`` the plain one;
    ``matmul_floor_ms`` their matrix products alone as plain matmuls, ``invariant_matmuls_ms``
    the same products as the invariant mode makes them. With ``rounds`` > 1 every column is
    measured that many times, the batch sizes interleaved, and each cell is the median.
    """
    loaded = loaded or load_model(cfg.model)
    samples: dict[int, list[dict[str, float]]] = {batch: [] for batch in cfg.batches}
    for _ in range(max(1, cfg.rounds)):
        for batch in cfg.batches:
            samples[batch].append(_step_row(loaded, batch, cfg))
    rows = []
    for batch, runs in samples.items():
        t = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
        inv, plain, bare, floor = t["engine_step_ms"], t["engine_plain_ms"], t["bare_forward_ms"], t["matmul_floor_ms"]
        rows.append(
            {
                "batch": batch,
                **t,
                "engine/bare": inv / bare,
                "plain/bare": plain / bare,
                "engine/floor": inv / floor,
                "plain/floor": plain / floor,
                "invariant/plain": inv / plain,
            }
        )
    return pd.DataFrame(rows)


def _engine_run(
    loaded: LoadedModel, prompts: list[str], cfg: GenerateBench, concurrent: bool
) -> tuple[float, list[list[int]]]:
    """Seconds and each request's tokens, with every request submitted at once or one at a time."""
    engine = BatchEngine(loaded, EngineConfig(max_batch=max(1, len(prompts)), dtype=cfg.dtype))
    outputs: dict[str, list[int]] = {}
    t0 = time.perf_counter()
    groups = [prompts] if concurrent else [[p] for p in prompts]
    for group in groups:
        rids = [engine.submit(p, max_new_tokens=cfg.new_tokens, ignore_eos=cfg.ignore_eos) for p in group]
        outputs.update({rid: [] for rid in rids})
        while engine.has_work():
            for event in engine.step():
                if isinstance(event, TokenEvent):
                    outputs[event.rid].append(event.token_id)
    return time.perf_counter() - t0, list(outputs.values())


@torch.inference_mode()
def _generate_batch_run(
    loaded: LoadedModel, prompts: list[str], cfg: GenerateBench, sized: bool = True
) -> tuple[float, list[list[int]]]:
    """transformers' continuous batching over the same requests.

    ``sized``: give it a cache the size of this workload, as the engine has. Left to size itself
    (``sized=False``), ``generate_batch`` claims most of the free memory and on a CPU spends tens
    of seconds clearing its static buffers before the first token; that row measures set-up as
    much as generation, and is shown so that the difference is visible.
    """
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    inputs = [loaded.tokenizer.encode(p) for p in prompts]
    eos = -1 if cfg.ignore_eos else loaded.eos_token_id  # transformers reads -1 as "no eos"
    gen = GenerationConfig(
        max_new_tokens=cfg.new_tokens, do_sample=False, eos_token_id=eos, pad_token_id=loaded.eos_token_id
    )
    page = 16
    sizing = ContinuousBatchingConfig(
        page_size=page,
        num_blocks=sum(-(-(len(ids) + cfg.new_tokens) // page) for ids in inputs),
        max_batch_tokens=sum(map(len, inputs)) + len(inputs),
        max_requests_per_batch=len(inputs),
    )
    with _in_dtype(loaded, cfg.dtype) as model:
        t0 = time.perf_counter()
        outputs = model.generate_batch(
            inputs, generation_config=gen, continuous_batching_config=sizing if sized else None
        )
        elapsed = time.perf_counter() - t0
    # generate_batch keys its results by request id; the ids it makes count up in submission order
    ordered = [outputs[key].generated_tokens for key in sorted(outputs, key=_request_number)]
    return elapsed, [list(tokens) for tokens in ordered]


def _request_number(request_id: str) -> int:
    return int(request_id.rsplit("_", 1)[-1])


def bench_generate(cfg: GenerateBench = GenerateBench(), loaded: LoadedModel | None = None) -> pd.DataFrame:
    """Throughput of the same greedy requests three ways, and how many outputs match the engine's."""
    loaded = loaded or load_model(cfg.model)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(cfg.requests)]
    warmup = GenerateBench(cfg.model, requests=2, new_tokens=2, dtype=cfg.dtype, ignore_eos=cfg.ignore_eos)
    _engine_run(loaded, prompts[:2], warmup, concurrent=True)  # first calls pay for lazy set-up: keep it out
    if cfg.with_generate_batch:
        _generate_batch_run(loaded, prompts[:2], warmup)
    runs = {
        "engine, all at once": _engine_run(loaded, prompts, cfg, concurrent=True),
        "engine, one after another": _engine_run(loaded, prompts, cfg, concurrent=False),
    }
    if cfg.with_generate_batch:
        runs["transformers generate_batch, cache sized to the work"] = _generate_batch_run(loaded, prompts, cfg)
    if cfg.with_generate_batch and cfg.with_self_sized:
        runs["transformers generate_batch, self-sized cache"] = _generate_batch_run(loaded, prompts, cfg, sized=False)
    reference = runs["engine, all at once"][1]
    rows = [
        {
            "run": name,
            "seconds": seconds,
            "tokens": sum(map(len, outputs)),
            "tokens_per_s": sum(map(len, outputs)) / seconds,
            "same_tokens_as_engine": f"{sum(a == b for a, b in zip(outputs, reference))}/{len(prompts)}",
        }
        for name, (seconds, outputs) in runs.items()
    ]
    table = pd.DataFrame(rows)
    base = table.tokens_per_s.iloc[0]
    table.insert(4, "engine_all_at_once/this", base / table.tokens_per_s)
    return table
