"""Benchmarks: ratios measured in one run, never asserted by tests.

``step``: the median decode step with no prefill in it, for several batch sizes, beside a bare
transformers forward over the same batch and context. ``generate``: many requests through the
engine at once, against the same requests one after another, and against transformers' own
continuous batching (``generate_batch``).
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import pandas as pd
import torch

from labkit.engine.config import EngineConfig
from labkit.engine.engine import BatchEngine
from labkit.models import LoadedModel, load_model
from labkit.prompts import PROMPTS


@dataclass(frozen=True)
class StepBench:
    model: str = "smollm2-135m"
    batches: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    context: int = 64
    steps: int = 15
    warmup: int = 3
    dtype: str = "float32"


@dataclass(frozen=True)
class GenerateBench:
    model: str = "smollm2-135m"
    requests: int = 32
    new_tokens: int = 64
    dtype: str = "float32"
    with_generate_batch: bool = True


def _context_ids(loaded: LoadedModel, batch: int, context: int) -> list[list[int]]:
    """``batch`` different prompts, each exactly ``context`` tokens long."""
    text = " ".join(PROMPTS)
    ids = loaded.tokenizer.encode(text)
    assert len(ids) >= context + batch, "the prompt pool is too short for this context"
    return [ids[i : i + context] for i in range(batch)]


def _engine_step_ms(loaded: LoadedModel, prompts: list[list[int]], cfg: StepBench, invariant: bool) -> float:
    batch = len(prompts)
    engine = BatchEngine(loaded, EngineConfig(max_batch=batch, dtype=cfg.dtype, batch_invariant=invariant,
                                              num_blocks=batch * (-(-(cfg.context + cfg.steps + cfg.warmup + 2) // 16))))
    for p in prompts:
        engine.submit(p, max_new_tokens=cfg.steps + cfg.warmup + 2)
    engine.step()  # admits and prefills every prompt; the steps timed below only decode
    times = []
    for _ in range(cfg.warmup + cfg.steps):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times[cfg.warmup :])


@torch.inference_mode()
def _bare_forward_ms(loaded: LoadedModel, prompts: list[list[int]], cfg: StepBench) -> float:
    model = loaded.model if cfg.dtype == "float32" else loaded.model.to(getattr(torch, cfg.dtype))
    ids = torch.tensor(prompts)
    out = model(input_ids=ids, use_cache=True)
    cache, nxt = out.cache, out.logits[:, -1:].argmax(-1)
    times = []
    for _ in range(cfg.warmup + cfg.steps):
        t0 = time.perf_counter()
        out = model(input_ids=nxt, cache=cache, use_cache=True)
        nxt = out.logits[:, -1:].argmax(-1)
        times.append(time.perf_counter() - t0)
        cache = out.cache
    if cfg.dtype != "float32":
        loaded.model.to(torch.float32)
    return 1000 * statistics.median(times[cfg.warmup :])


def bench_step(cfg: StepBench = StepBench(), loaded: LoadedModel | None = None) -> pd.DataFrame:
    loaded = loaded or load_model(cfg.model)
    rows = []
    for batch in cfg.batches:
        prompts = _context_ids(loaded, batch, cfg.context)
        bare = _bare_forward_ms(loaded, prompts, cfg)
        invariant = _engine_step_ms(loaded, prompts, cfg, invariant=True)
        plain = _engine_step_ms(loaded, prompts, cfg, invariant=False)
        rows.append({"batch": batch, "bare_forward_ms": bare, "engine_step_ms": invariant,
                     "engine_plain_ms": plain, "engine/bare": invariant / bare,
                     "invariant/plain": invariant / plain})
    return pd.DataFrame(rows)


def _engine_run(loaded: LoadedModel, prompts: list[str], cfg: GenerateBench, concurrent: bool) -> tuple[float, int]:
    engine = BatchEngine(loaded, EngineConfig(max_batch=max(1, len(prompts)), dtype=cfg.dtype))
    tokens, t0 = 0, time.perf_counter()
    groups = [prompts] if concurrent else [[p] for p in prompts]
    for group in groups:
        for p in group:
            engine.submit(p, max_new_tokens=cfg.new_tokens)
        while engine.has_work():
            tokens += sum(1 for e in engine.step() if hasattr(e, "token_id"))
    return time.perf_counter() - t0, tokens


@torch.inference_mode()
def _generate_batch_run(loaded: LoadedModel, prompts: list[str], cfg: GenerateBench) -> tuple[float, int]:
    from transformers import GenerationConfig

    inputs = [loaded.tokenizer.encode(p) for p in prompts]
    gen = GenerationConfig(max_new_tokens=cfg.new_tokens, do_sample=False, eos_token_id=loaded.eos_token_id,
                           pad_token_id=loaded.eos_token_id)
    t0 = time.perf_counter()
    outputs = loaded.model.generate_batch(inputs, generation_config=gen, progress_bar=False)
    elapsed = time.perf_counter() - t0
    return elapsed, sum(len(o.generated_tokens) for o in outputs.values())


def bench_generate(cfg: GenerateBench = GenerateBench(), loaded: LoadedModel | None = None) -> pd.DataFrame:
    loaded = loaded or load_model(cfg.model)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(cfg.requests)]
    runs = {"engine, all at once": _engine_run(loaded, prompts, cfg, concurrent=True),
            "engine, one after another": _engine_run(loaded, prompts, cfg, concurrent=False)}
    if cfg.with_generate_batch:
        runs["transformers generate_batch"] = _generate_batch_run(loaded, prompts, cfg)
    rows = [{"run": name, "seconds": s, "tokens": n, "tokens_per_s": n / s} for name, (s, n) in runs.items()]
    table = pd.DataFrame(rows)
    base = table.loc[table.run == "engine, all at once", "tokens_per_s"].iloc[0]
    table["engine_all_at_once/this"] = base / table.tokens_per_s
    return table
