"""Service: what one app holds (engine, hub, settings, resume logs, metrics, flood records).

Routes reach it as ``request.app.state.service``. Everything here runs on the event loop's
thread; the engine is touched only through its thread-safe side (submit, cancel, stats).
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from labkit.hub import Hub, Stream
from labkit.service.deadline import DeadlineGate
from labkit.service.metrics import Metrics
from labkit.service.resume import ResumeLimits, ResumeRegistry
from labkit.service.resume_store import open_store
from labkit.service.stats import ServiceStats, read_stats

if TYPE_CHECKING:  # pragma: no cover
    from labkit.service.config import ServiceConfig


class Service:
    def __init__(self, engine: Any, hub: Hub, config: ServiceConfig) -> None:
        self.engine, self.hub, self.config = engine, hub, config
        self.model_name: str = engine.model.name
        self.metrics = Metrics(self.stats)
        hub.observer = self.metrics
        self.deadline = DeadlineGate(
            engine,
            hub,
            enabled=config.http.deadline_gate,
            window=config.http.deadline_window,
            window_s=config.http.deadline_window_s,
            registry=self.metrics.registry,
        )
        self.resume = ResumeRegistry(
            hub,
            self.model_name,
            grace=config.resume_grace,
            capacity=config.resume_log_events,
            keepalive=config.keepalive_interval,
            pad_bytes=config.pad_bytes,
            store=open_store(config.resume_store, capacity=config.resume_log_events, ttl=config.resume_store_ttl),
            limits=ResumeLimits(config.max_resumable, config.resumable_share, config.retry_after_s),
        )
        self.floods: OrderedDict[str, Any] = OrderedDict()

    def open(
        self,
        prompt_ids: Sequence[int],
        *,
        max_new_tokens: int,
        stop: str | Sequence[str] | None,
        temperature: float,
        top_p: float,
        seed: int | None,
        ignore_eos: bool = False,
        deadline_s: float | None = None,
        arrived: float = 0.0,
    ) -> Stream:
        """Refuse (raise) or submit: EmptyPrompt, PromptTooLong, InvalidRequest, QueueFull, Draining,
        or a 429 ``deadline_unreachable`` when ``deadline_s`` (seconds from ``arrived``, a
        ``perf_counter`` time) cannot be met (:mod:`labkit.service.deadline`). A request that can
        never fit the context is not the gate's to judge: the hub refuses it (422), and an
        unbounded ``max_new_tokens`` never reaches the gate's arithmetic."""
        fits = len(prompt_ids) + max_new_tokens <= self.engine.max_context
        judgement = self.deadline.check(
            deadline_s if fits else None, arrived, max_new_tokens, self.config.retry_after_s
        )
        stream = self.hub.open(
            list(prompt_ids),
            max_new_tokens=max_new_tokens,
            stop=stop or (),
            temperature=temperature,
            top_p=top_p,
            seed=seed,
            ignore_eos=ignore_eos,
        )
        self.deadline.admitted(judgement, stream.rid)
        return stream

    def remember_flood(self, flood_id: str, record: Any, keep: int = 256) -> None:
        self.floods[flood_id] = record
        while len(self.floods) > keep:
            self.floods.popitem(last=False)

    async def drain(self, grace: float | None = None) -> None:
        """Stop admitting, end open streams with ``error: shutdown``, wait up to ``grace`` (default: drain_grace)."""
        grace = self.config.drain_grace if grace is None else grace
        await asyncio.gather(self.hub.drain(grace), self.resume.drain(grace))

    async def aclose(self) -> None:
        """After uvicorn stopped serving: stop resume pumps, then the step thread."""
        await self.resume.aclose()
        await self.hub.aclose()

    def stats(self) -> ServiceStats:
        """The engine's and the hub's books, read once and named once (``GET /stats``, /metrics)."""
        return read_stats(self.model_name, self.engine, self.hub, len(self.resume))
