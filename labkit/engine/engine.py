"""BatchEngine: a step-driven continuous-batching engine over a paged KV cache.

Each ``step()`` applies the inbox, asks the scheduler for the step's work (a token for every
decoding sequence, then chunks of prompts within the step's token budget, see scheduler.py),
runs it through the model in one pass, and turns the logits into events: a token for each
decode and for each prompt whose last chunk ran. Other threads only submit, cancel, pause and
resume, which are recorded in the inbox and carried out at the next step boundary.

The step clock: steps are numbered 1, 2, 3, ... as they start (``stats()["step"]`` is the number
of the latest step, 0 before the first), and every event carries the number of the step that
made it, so an effect can be told in steps, which do not jitter with the machine, as well as in
seconds.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import Any

import torch

from labkit.engine.cache import BlockManager
from labkit.engine.config import EngineConfig
from labkit.engine.events import Event, FinishEvent, FinishReason, StepRecord, TokenEvent, Usage
from labkit.engine.runner import Chunk, ModelRunner
from labkit.engine.sampling import Sampler, make_generator
from labkit.engine.scheduler import Command, Inbox, Scheduler, Verb, Work
from labkit.engine.sequence import RequestId, SamplingParams, Sequence
from labkit.engine.text import TextState
from labkit.errors import EmptyPrompt, InvalidRequest, PromptTooLong, QueueFull
from labkit.models.loaded import LoadedModel

OnEvent = Callable[[Event], None]
log = logging.getLogger(__name__)
STEP_LOG = 50_000
SAMPLING_FAILED = "the next token could not be drawn for this request"


class BatchEngine:
    """Many requests, one model, one batched decode per step. Drive it from one thread."""

    def __init__(self, model: LoadedModel, config: EngineConfig | None = None) -> None:
        self.model = model
        self.config = config = config or EngineConfig()
        self.tokenizer = model.tokenizer
        self.max_context = model.max_context
        num_blocks = config.num_blocks or default_num_blocks(model, config)
        self.runner = ModelRunner(
            model,
            num_blocks=num_blocks,
            block_size=config.block_size,
            device=config.device,
            dtype=config.dtype,
            batch_invariant=config.batch_invariant,
            tile_rows=config.tile_rows,
            attention=config.attention,
            matmul=config.matmul,
        )
        self.blocks = BlockManager(num_blocks, config.block_size)
        self.scheduler = Scheduler(self.blocks, config.max_batch, config.step_tokens, config.surge_tokens)
        self.inbox = Inbox()
        self._eos = eos_ids(model)
        self.sampler = Sampler(config.device, native=self.runner.network.native_ops)
        self._ids_lock = threading.Lock()
        self._known: dict[str, int] = {}  # request id -> number of the live sequence holding it
        self.current_step = 0
        # The last STEP_LOG steps (about 4 MB at most): what a run's step-time spread is read from.
        self.step_log: deque[StepRecord] = deque(maxlen=STEP_LOG)
        self._step_lock = threading.Lock()
        self.counters: Counter[str] = Counter()
        self.finished: Counter[str] = Counter()

    # -- the thread-safe side ---------------------------------------------------------------
    def encode(self, prompt: str) -> list[int]:
        return list(self.tokenizer.encode(prompt))

    def submit(
        self,
        prompt: str | Seq[int],
        *,
        max_new_tokens: int = 64,
        stop: str | Seq[str] = (),
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int | None = None,
        ignore_eos: bool = False,
        request_id: str | None = None,
    ) -> RequestId:
        """Validate a request in the caller's thread and queue it; returns its id (a str).

        Raises EmptyPrompt, PromptTooLong or InvalidRequest for a request that can never run, and
        QueueFull at the waiting limit. Nothing is allocated until a step admits it.
        """
        ids = self._prompt_ids(prompt)
        params = _params(max_new_tokens, stop, temperature, top_p, seed, ignore_eos)
        self._check_fits(len(ids), params.max_new_tokens)
        generator = make_generator(params, self.config.device)
        text = TextState(self.tokenizer, ids, params.stop)  # a tokenizer decode: not under the lock
        with self._ids_lock:  # the waiting count and the queue change together (see _apply_inbox)
            rid = self._claim_id(request_id)
            seq = Sequence(rid, ids, params, generator, text)
            self._known[rid] = seq.number
            self.inbox.put(Command("submit", rid, seq))
        return RequestId(rid, seq.number)

    def cancel(self, rid: str) -> None:
        """Finish ``rid``'s request at the next step; a no-op for a request that is over.

        ``rid`` as ``submit`` returned it (a RequestId) names that submission: once it is over, a
        cancel never reaches a newer request that reused the id. A plain string names whichever
        request holds the id now.
        """
        self._wish("cancel", rid)

    def pause(self, rid: str) -> None:
        self._wish("pause", rid)

    def resume(self, rid: str) -> None:
        self._wish("resume", rid)

    def _wish(self, verb: Verb, rid: str) -> None:
        with self._ids_lock:
            holder = self._known.get(rid)
        meant = getattr(rid, "number", holder)
        if holder is not None and holder == meant:
            self.inbox.put(Command(verb, str(rid), number=holder))

    def has_work(self) -> bool:
        """Would a step do anything? (Something in the inbox, to decode, or to admit.)"""
        return (
            len(self.inbox) > 0 or any(not s.paused for s in self.scheduler.running) or self.scheduler.can_admit_any()
        )

    def wait_for_work(self, timeout: float) -> bool:
        """Sleep until a step would do something or ``timeout`` passes; call from the step thread."""
        with self.inbox.cond:
            return self.inbox.cond.wait_for(self.has_work, timeout)

    # -- the step --------------------------------------------------------------------------
    def step(self, on_event: OnEvent | None = None) -> list[Event]:
        """One round of work, numbered ``current_step`` (1 for the first). ``on_event`` sees each
        event the moment it exists."""
        if not self._step_lock.acquire(blocking=False):
            raise RuntimeError("BatchEngine.step() was called from two threads at once")
        try:
            self.current_step += 1
            started = time.perf_counter()
            events: list[Event] = []

            def emit(event: Event) -> None:
                events.append(event)
                if on_event is not None:
                    on_event(event)

            self._apply_inbox(emit)
            work = self.scheduler.schedule()
            if work:
                logits = self.runner.forward(self._chunks(work), [w.sample for w in work])
                self._postprocess(work, logits, emit)
                if self.config.step_delay:
                    time.sleep(self.config.step_delay)  # the lab's slower engine (EngineConfig.step_delay)
            self._log_step(started, work)
            return events
        finally:
            self._step_lock.release()

    def _apply_inbox(self, emit: OnEvent) -> None:
        # The id lock is held while commands move from the inbox to the waiting list, so that a
        # submit in another thread never counts the waiting requests while some are in neither.
        cancelled: list[Sequence] = []
        with self._ids_lock:
            for command in self.inbox.drain():
                seq = self.scheduler.apply(command)
                if seq is not None:
                    cancelled.append(seq)
        for seq in cancelled:
            emit(self._finish_event(seq))

    def _chunks(self, work: list[Work]) -> list[Chunk]:
        return [Chunk(w.tokens, w.start, self.blocks.table(w.seq.number)) for w in work]

    def _postprocess(self, work: list[Work], logits: torch.Tensor, emit: OnEvent) -> None:
        """The chunks are in the cache; draw a token for each decode and each prompt whose last
        chunk this was (``logits`` has their rows, in order) and emit it at once."""
        self.scheduler.advance(work)
        sampled = [w for w in work if w.sample]
        self.counters["prefills"] += sum(1 for w in sampled if w.prefill)
        self.counters["decode_steps"] += any(not w.prefill for w in work)
        self._accept_all([w.seq for w in sampled], logits, emit)

    def _log_step(self, started: float, work: list[Work]) -> None:
        self.counters["steps"] += 1
        prefills = [w for w in work if w.prefill]
        prefill_tokens = sum(len(w.tokens) for w in prefills)
        self.counters["prefill_tokens"] += prefill_tokens
        seconds = time.perf_counter() - started
        surge = bool(prefills) and self.scheduler.surging is not None
        decoded = len(work) - len(prefills)
        record = StepRecord(self.current_step, started, seconds, decoded, len(prefills), prefill_tokens, surge)
        self.step_log.append(record)

    def _accept_all(self, batch: list[Sequence], logits: torch.Tensor, emit: OnEvent) -> None:
        """Sample a token for each row of ``logits`` and accept it; a row that could not be
        sampled ends its own request with reason ``error`` (its neighbours go on)."""
        for seq, token_id in zip(batch, self.sampler.sample(logits, batch)):
            if token_id is None:
                self._fail(seq, emit)
            else:
                self._accept(seq, token_id, emit)

    def _fail(self, seq: Sequence, emit: OnEvent) -> None:
        log.warning("request %r ended with an error at step %d: %s", seq.rid, self.current_step, SAMPLING_FAILED)
        self.counters["sampling_errors"] += 1
        self.scheduler.finish(seq, "error")
        emit(self._finish_event(seq, error=SAMPLING_FAILED))

    def _accept(self, seq: Sequence, token_id: int, emit: OnEvent) -> None:
        """Record a sampled token, emit its event, and finish the sequence if it is done."""
        seq.output_ids.append(token_id)
        self.counters["tokens"] += 1
        is_eos = token_id in self._eos
        reason: FinishReason | None = (
            "eos"
            if is_eos and not seq.params.ignore_eos
            else "length"
            if seq.num_output >= seq.params.max_new_tokens
            else None
        )
        text, stopped = seq.text.push(token_id, special=is_eos, final=reason is not None)
        if stopped:
            reason = "stop"
        emit(TokenEvent(seq.rid, seq.num_output - 1, token_id, text, time.perf_counter(), self.current_step))
        if reason is not None:
            self.scheduler.finish(seq, reason)
            emit(self._finish_event(seq))

    def _finish_event(self, seq: Sequence, error: str | None = None) -> FinishEvent:
        assert seq.finish_reason is not None
        with self._ids_lock:
            if self._known.get(seq.rid) == seq.number:
                del self._known[seq.rid]  # the id may be used again once its request is over
        self.finished[seq.finish_reason] += 1
        return FinishEvent(
            seq.rid,
            seq.finish_reason,
            Usage(seq.num_prompt, seq.num_output),
            time.perf_counter(),
            self.current_step,
            error,
        )

    # -- validation --------------------------------------------------------------------------
    def _prompt_ids(self, prompt: str | Seq[int]) -> list[int]:
        if isinstance(prompt, str):
            ids = self.encode(prompt) if prompt else []
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = list(prompt)
        else:
            raise InvalidRequest(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        if not ids:
            raise EmptyPrompt("prompt is empty: it must contain at least one token")
        vocab = self.model.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise InvalidRequest(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        return ids

    def _check_fits(self, num_prompt: int, max_new_tokens: int) -> None:
        total = num_prompt + max_new_tokens
        if total > self.max_context:
            raise PromptTooLong(
                f"prompt ({num_prompt} tokens) + max_new_tokens ({max_new_tokens}) = {total} "
                f"exceeds the model's context of {self.max_context} tokens"
            )
        if self.blocks.blocks_needed(total) > self.blocks.num_blocks:
            raise PromptTooLong(
                f"prompt + max_new_tokens = {total} tokens needs {self.blocks.blocks_needed(total)} "
                f"blocks, more than the whole cache ({self.blocks.num_blocks})"
            )

    def _claim_id(self, request_id: str | None) -> str:
        """Check the waiting limit and take a unique id; the caller holds ``_ids_lock``."""
        limit = self.config.max_waiting
        if limit is not None and len(self.scheduler.waiting) + self.inbox.count_submits() >= limit:
            raise QueueFull(f"{limit} requests are already waiting for a slot")
        rid = request_id or f"req-{secrets.token_hex(6)}"
        if not isinstance(rid, str):
            raise InvalidRequest(f"request_id must be a string, got {type(rid).__name__}")
        if rid in self._known:
            raise InvalidRequest(f"request_id {rid!r} is already in use")
        return str(rid)  # a plain string, even when the caller passed a RequestId back

    # -- introspection -------------------------------------------------------------------
    def steps_since(self, step: int) -> list[StepRecord]:
        """The logged steps numbered above ``step`` (a copy; safe from any thread)."""
        return [r for r in self.step_log.copy() if r.step > step]  # copy(): one C call, atomic

    def stats(self) -> dict[str, Any]:
        sched = self.scheduler
        with self._ids_lock:  # a step may be moving submits from the inbox to the waiting list
            waiting = len(sched.waiting) + self.inbox.count_submits()
        return {
            "running": len(sched.running),
            "waiting": waiting,
            "paused": sum(1 for s in list(sched.live.values()) if s.paused),
            "free_blocks": self.blocks.num_free,
            "reserved_blocks": self.blocks.num_held,
            "total_blocks": self.blocks.num_blocks,
            "block_size": self.blocks.block_size,
            "max_batch": sched.max_batch,
            "step": self.current_step,
            "steps": self.counters["steps"],
            "prefills": self.counters["prefills"],
            "prefill_tokens": self.counters["prefill_tokens"],
            "decode_steps": self.counters["decode_steps"],
            "tokens_generated": self.counters["tokens"],
            "sampling_errors": self.counters["sampling_errors"],
            "releases": self.blocks.num_releases,
            "finished": dict(self.finished),
        }

    def check_integrity(self) -> None:
        """Raise AssertionError if the cache's books or the queues disagree."""
        self.scheduler.check_integrity()
        assert all(s.text is not None for s in self.scheduler.live.values()), "a live sequence has no text state"


def default_num_blocks(model: LoadedModel, config: EngineConfig) -> int:
    """Enough blocks for ``max_batch`` full contexts, capped by ``config.kv_cache_mb``."""
    per_seq = -(-model.max_context // config.block_size)
    bytes_per_block = kv_bytes_per_token(model, config.dtype) * config.block_size
    budget = (config.kv_cache_mb * 2**20) // bytes_per_block
    return max(1, min(per_seq * config.max_batch, budget))


def kv_bytes_per_token(model: LoadedModel, dtype: str) -> int:
    cfg = model.model.config
    if model.arch == "gpt2":
        layers, width = cfg.n_layer, cfg.n_embd
    else:
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        layers, width = cfg.num_hidden_layers, cfg.num_key_value_heads * head_dim
    return 2 * layers * width * (4 if dtype == "float32" else 2)


def eos_ids(model: LoadedModel) -> frozenset[int]:
    """Every id that ends a sequence: those the model config and the generation config name (one
    id or a list each: Llama-3 lists its end-of-turn ids), else the tokenizer's eos."""
    named: set[int] = set()
    generation = getattr(model.model, "generation_config", None)
    for source in (model.model.config, generation):
        eos = getattr(source, "eos_token_id", None)
        if isinstance(eos, (list, tuple, set, frozenset)):
            named.update(int(e) for e in eos)
        elif eos is not None:
            named.add(int(eos))
    if not named and getattr(model.tokenizer, "eos_token_id", None) is not None:
        named.add(int(model.tokenizer.eos_token_id))
    return frozenset(named)


def _params(
    max_new_tokens: int, stop: str | Seq[str], temperature: float, top_p: float, seed: int | None, ignore_eos: bool
) -> SamplingParams:
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    try:
        return SamplingParams(max_new_tokens, stops, temperature, top_p, seed, ignore_eos)
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from exc
