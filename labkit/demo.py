"""A short demonstration: several prompts share the engine, and their text is printed as it comes."""

from __future__ import annotations

import time

from labkit.engine.config import EngineConfig
from labkit.engine.engine import BatchEngine
from labkit.engine.events import FinishEvent, TokenEvent
from labkit.models import load_model
from labkit.prompts import PROMPTS


def run_demo(model: str = "smollm2-135m", requests: int = 6, new_tokens: int = 48) -> dict[str, float]:
    t_load = time.perf_counter()
    loaded = load_model(model)
    print(f"loaded {loaded.name} in {time.perf_counter() - t_load:.1f} s")
    engine = BatchEngine(loaded, EngineConfig(max_batch=requests))
    prompts = {engine.submit(p, max_new_tokens=new_tokens): p for p in PROMPTS[:requests]}
    texts: dict[str, str] = {rid: "" for rid in prompts}
    first: dict[str, float] = {}
    tokens, t0 = 0, time.perf_counter()
    while engine.has_work():
        for ev in engine.step():
            if isinstance(ev, TokenEvent):
                tokens += 1
                texts[ev.rid] += ev.text
                first.setdefault(ev.rid, ev.time - t0)
            elif isinstance(ev, FinishEvent):
                print(f"[{ev.rid} finished: {ev.reason}, {ev.usage.completion_tokens} tokens]")
    elapsed = time.perf_counter() - t0
    for rid, prompt in prompts.items():
        print(f"\n>>> {prompt}\n{texts[rid].strip()}")
    engine.check_integrity()
    summary = {
        "requests": requests,
        "tokens": tokens,
        "seconds": elapsed,
        "tokens_per_s": tokens / elapsed,
        "first_token_s_max": max(first.values()),
    }
    print(
        f"\n{requests} concurrent requests, {tokens} tokens in {elapsed:.2f} s: "
        f"{tokens / elapsed:.1f} tokens/s; every first token within {summary['first_token_s_max']:.2f} s; "
        f"cache whole, {engine.stats()['releases']} releases"
    )
    return summary
