"""Who runs next: the inbox, the waiting queue, the running set, and the blocks they hold.

Other threads only ever touch the inbox. Everything else is changed by the step thread, between
forward passes, which is why cancelling a sequence can never pull tensors out from under the
model: a cancel is a wish until the next step boundary carries it out.

Each step's work is chosen decode first (vLLM's chunked prefill): every running, unpaused
sequence that has its first token gets one row, so a stream never waits for someone else's
prompt; what is left of the step's token budget (``step_tokens``) goes to prompts in arrival
order, partly prefilled ones first, then newly admitted ones, a chunk each, so a long prompt is
prefilled over several steps. When decode rows alone fill the budget, the oldest prompt still
gets one token, so prefill never stops. ``step_tokens=None`` is unchunked: every prompt that can
be admitted is prefilled whole in this step (the engine before chunking).

The budget is there to keep a step short for the streams it stalls. In a surge, when more prompts
could start than streams decode (many clients arriving at an idle or lightly loaded engine), a
longer step stalls fewer streams than it moves prompts along, so the step takes up to
``surge_tokens`` instead (vLLM's ``max_num_batched_tokens`` plays that part there), though no
prompt more than ``step_tokens`` of it: 32 short prompts arriving together start in one step
rather than one budget at a time, while a long prompt is chunked by the small budget whoever else
is there, so it never buys a long step for itself. Only prompts that could be admitted now count
(a free slot and their reservation, in admission order). Right after a surge step, the streams it
started (their first token only) count with the prompts, not with the streams: clients that arrive
together reach the inbox on either side of a step boundary, and a burst split there (say 20 of 32
prompts in the first step) would otherwise leave the rest outnumbered by their own burst and
trickling in through the small budget. That credit is given once a burst: a surge that needed it
gives none, so a client sending a few short prompts every step cannot chain surge steps (the
prompts alone must then outnumber every stream again). ``surge_tokens=None``: the small budget
always.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

from labkit.engine.cache import BlockManager
from labkit.engine.events import FinishReason
from labkit.engine.sequence import Sequence, Status
from labkit.errors import DoubleFree

Verb = Literal["submit", "cancel", "pause", "resume"]


@dataclass(frozen=True)
class Command:
    """A wish about request ``rid``. ``number`` names the sequence the caller meant (the one that
    held the id when the wish was made), so that a wish arriving after that request finished and
    its id was taken again never touches the newer request."""

    verb: Verb
    rid: str
    seq: Sequence | None = None
    number: int | None = None


class Inbox:
    """A thread-safe list of wishes, drained once per step; a Condition lets the step thread sleep."""

    def __init__(self) -> None:
        self._items: deque[Command] = deque()
        self.cond = threading.Condition()

    def put(self, command: Command) -> None:
        with self.cond:
            self._items.append(command)
            self.cond.notify_all()

    def drain(self) -> list[Command]:
        with self.cond:
            items = list(self._items)
            self._items.clear()
            return items

    def __len__(self) -> int:
        return len(self._items)

    def count_submits(self) -> int:
        with self.cond:
            return sum(1 for c in self._items if c.verb == "submit")


@dataclass(frozen=True)
class Work:
    """One sequence's share of a step: ``tokens`` fed at positions ``start``, ``start + 1``, ...

    A decode is one token (the pending one at ``num_cached``); a prefill chunk is a run of prompt
    tokens. ``sample``: this work ends the sequence's prefill or is a decode, so a token is drawn
    from its last row's logits.
    """

    seq: Sequence
    start: int
    tokens: list[int]
    sample: bool
    prefill: bool


class Scheduler:
    """FIFO admission by reservation, a batch limit, pause/resume/cancel, one place to release."""

    def __init__(
        self, blocks: BlockManager, max_batch: int, step_tokens: int | None = None, surge_tokens: int | None = None
    ) -> None:
        self.blocks = blocks
        self.max_batch = max_batch
        self.step_tokens = step_tokens
        self.surge_tokens = surge_tokens
        # the last schedule()'s surge: None, "outnumbered" (the prompts alone outnumbered the streams)
        # or "credited" (only with the last surge's new streams on their side)
        self.surging: Literal["outnumbered", "credited"] | None = None
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.live: dict[str, Sequence] = {}

    # -- the inbox, applied at a step boundary ---------------------------------------------
    def apply(self, command: Command) -> Sequence | None:
        """Carry out one wish. Returns a sequence that a cancel has just finished, if any."""
        if command.verb == "submit":
            assert command.seq is not None
            self.live[command.rid] = command.seq
            self.waiting.append(command.seq)
            return None
        seq = self.live.get(command.rid)
        if seq is None or (command.number is not None and seq.number != command.number):
            return None  # unknown, already finished, or meant for an earlier holder of the id: a no-op
        if command.verb == "cancel":
            self.finish(seq, "cancelled")
            return seq
        seq.paused = command.verb == "pause"
        return None

    # -- a step's work ---------------------------------------------------------------------
    def schedule(self) -> list[Work]:
        """This step's work: a decode row for every sequence that has its first token, then
        prefill chunks in arrival order within what is left of the budget (see the module)."""
        work = [Work(s, s.num_cached, [s.pending], True, False) for s in self.running if s.decoding]
        room = self._prefill_room(len(work))
        queue = self._prefill_order()
        while room is None or room > 0:
            seq = next(queue, None)
            if seq is None:
                break
            start, left = seq.num_prefilled, seq.num_prompt - seq.num_prefilled
            count = left if room is None or self.step_tokens is None else min(room, left, self.step_tokens)
            work.append(Work(seq, start, seq.prompt_ids[start : start + count], count == left, True))
            room = None if room is None else room - count
        return work

    def _prefill_room(self, decode_rows: int) -> int | None:
        """Prompt tokens this step may run: the budget (the surge budget while more prompts could
        start than streams decode) less the decode rows, at least one (None: no limit, the
        unchunked engine)."""
        credit, self.surging = self.surging == "outnumbered", None
        if self.step_tokens is None:
            return None
        budget = self.step_tokens
        if self.surge_tokens is not None:
            self.surging = self._surge(decode_rows, credit)
            budget = self.surge_tokens if self.surging else budget
        return max(1, budget - decode_rows)

    def _surge(self, decode_rows: int, credit: bool) -> Literal["outnumbered", "credited"] | None:
        """Whether more prompts could start than streams decode: "outnumbered" by the prompts alone,
        or "credited" with the streams that the last surge started (one token so far) on the prompts'
        side, as the rest of the same burst; the credit only follows an outnumbered surge."""
        if self._starting(decode_rows + 1) > decode_rows:
            return "outnumbered"
        young = sum(1 for s in self.running if s.decoding and s.num_output == 1) if credit else 0
        outnumber = max(0, decode_rows - 2 * young)  # settled streams less the young: what the prompts must exceed
        return "credited" if young and self._starting(outnumber + 1) > outnumber else None

    def _starting(self, limit: int) -> int:
        """Prompts that this step could move along (partly prefilled ones, and waiting ones that
        admission would take now: a free slot and their whole reservation, in order, paused ones
        stepped over as :meth:`_admit_next` does), counted up to ``limit``."""
        count = sum(1 for s in self.running if s.prefilling and not s.paused)
        slots, blocks = self.max_batch - len(self.running), self.blocks.num_free
        for seq in self.waiting:
            if count >= limit:
                break
            if seq.paused:
                continue
            blocks -= self.blocks.blocks_needed(seq.reservation)
            if slots <= 0 or blocks < 0:
                break
            count, slots = count + 1, slots - 1
        return count

    def advance(self, work: list[Work]) -> None:
        """Record that the step ran: each prefill chunk's tokens are now in the cache."""
        for w in work:
            if w.prefill:
                w.seq.num_prefilled += len(w.tokens)

    def _prefill_order(self) -> Iterator[Sequence]:
        """Prompts to prefill, oldest first: those admitted and partly prefilled, then each newly
        admitted one (admitted only when the caller asks for the next, i.e. has room for it)."""
        yield from [s for s in self.running if s.prefilling and not s.paused]
        while (seq := self._admit_next()) is not None:
            yield seq

    # -- admission ----------------------------------------------------------------------
    def _admit_next(self) -> Sequence | None:
        """Admit the first unpaused waiting request if a slot and its whole reservation are free.

        The head of the queue is never overtaken by a smaller request behind it (no
        starvation); paused requests keep their place but are stepped over.
        """
        for seq in self.waiting:
            if seq.paused:
                continue
            if len(self.running) >= self.max_batch or not self.blocks.can_allocate(seq.reservation):
                return None
            self.blocks.allocate(seq.number, seq.reservation)
            self.waiting.remove(seq)
            seq.status = Status.RUNNING
            self.running.append(seq)
            return seq
        return None

    def can_admit_any(self) -> bool:
        for seq in self.waiting:
            if not seq.paused:
                return len(self.running) < self.max_batch and self.blocks.can_allocate(seq.reservation)
        return False

    # -- the one place a sequence leaves -------------------------------------------------
    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Mark ``seq`` finished and release its blocks; finishing it twice raises DoubleFree.

        The status is checked first and the books are keyed by ``seq.number``, so a second finish
        raises without touching anything, even after its id has been given to a newer request.
        """
        if seq.status is Status.FINISHED:
            raise DoubleFree(f"sequence {seq.number} ({seq.rid!r}) finished twice ({seq.finish_reason}, then {reason})")
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
            self.blocks.deallocate(seq.number)
        else:
            self.waiting.remove(seq)
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        if self.live.get(seq.rid) is seq:
            del self.live[seq.rid]

    def check_integrity(self) -> None:
        running = {s.number for s in self.running}
        waiting = {s.number for s in self.waiting}
        assert not running & waiting, "a sequence is both running and waiting"
        assert running | waiting == {s.number for s in self.live.values()}, (
            "live sequences differ from running + waiting"
        )
        assert all(rid == s.rid for rid, s in self.live.items()), "a live sequence is filed under another id"
        assert all(s.status is Status.RUNNING for s in self.running), "a running sequence is not RUNNING"
        assert all(s.status is Status.WAITING for s in self.waiting), "a waiting sequence is not WAITING"
        assert len(self.running) <= self.max_batch, "batch limit exceeded"
        self.blocks.check_integrity(running)
