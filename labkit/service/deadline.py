"""The deadline gate (the chapter's exercise 5): refuse, before the first byte, a request that
cannot finish by its deadline, so that the engine's steps go to requests that still can.

A request may carry ``deadline_s``: seconds, counted from its arrival at the route, by which the
client needs the whole answer. The gate predicts when the request would finish and refuses it
(429 ``deadline_unreachable`` with ``Retry-After``) when the prediction is past the deadline.
Requests without a deadline are never refused here.

The prediction, in engine steps and then in seconds:

* the queue ahead is every live stream of the hub, in the order they were submitted, each with
  the tokens it still has to make (``max_new_tokens`` less what it has made). A batch of
  ``max_batch`` slots decodes one token per running request per step; a waiting request takes
  the first slot that frees, spends one step on its prefill, then one step per token. The new
  request takes the first slot free after everyone ahead of it;
* one step costs the mean of the engine's last ``deadline_window`` logged steps
  (``engine.steps_since``: a copy of the log, safe from the loop's thread). The mean, not the
  median: what is predicted is a sum of many steps, and on a busy machine the slow tail of the
  step times (a tenth of them several times the median here) is part of that sum. While a
  stream is queued or running (not paused for a slow reader) the engine is at work, and its last
  steps are its present however old: it is stepping, or stalled on work the new request would
  wait behind. With none, only
  steps that ended in the last ``deadline_window_s`` seconds count. With no step that counts
  (none logged yet, or the engine idle that long) the gate has nothing to predict from and admits.

Why an idle engine's steps age out: a refused request makes no step, so a gate that trusted old
steps could lock itself up. After a run of slow steps (a busy machine, a long prefill, a paused
process) it refused every request with a deadline, the engine stayed idle, the window never
changed, and it refused everything from then on (5 runs in 12 of notebook 08's goodput
experiment). Now such a lock-up ends ``deadline_window_s`` after the engine's last step, and the
request then admitted logs steps of the present machine.

It assumes every request runs to its token limit: a request that ends early on its
end-of-sequence token finishes sooner than predicted, so the gate errs towards refusing a
request that would just have made it, never towards admitting one that cannot (up to the
step cost's own spread). Everything here runs on the event loop's thread.

Every reading (prediction, deadline, refused or the request id it was admitted under) is kept
in a bounded ledger that ``GET /lab/deadline`` serves; with the gate off it still predicts, so
the lab can check whether what it would have refused did miss its deadline.
"""

from __future__ import annotations

import heapq
import math
import statistics
import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Annotated, Any

from prometheus_client import CollectorRegistry, Counter
from pydantic import Field

from labkit.engine.events import StepRecord
from labkit.service.errors import ServiceError
from labkit.service.intake import Number

REFUSAL_TYPE = "deadline_unreachable"
MAX_DEADLINE_S = 3600.0  # a deadline beyond an hour is a mistake, not a deadline

DeadlineSeconds = Annotated[
    Number,
    Field(
        gt=0,
        le=MAX_DEADLINE_S,
        description=(
            "Seconds from the request's arrival by which the whole answer is needed. A request the "
            "server predicts cannot finish in time is refused with 429 deadline_unreachable and "
            "Retry-After, before the first byte. Leave it out for no deadline."
        ),
    ),
]


@dataclass(frozen=True)
class Prediction:
    """When a request would finish, counted from now: ``steps`` engine steps of ``step_s`` each."""

    steps: int
    step_s: float

    @property
    def seconds(self) -> float:
        return self.steps * self.step_s


def steps_to_finish(ahead: Iterable[tuple[bool, int]], tokens: int, slots: int) -> int:
    """Engine steps until a new request of ``tokens`` tokens has made its last one.

    ``ahead``: ``(running, tokens_left)`` for every live request before it, in submission order.
    Running requests hold a slot for ``tokens_left`` more steps; a waiting one takes the first
    slot that frees and holds it for its prefill step plus its tokens. The new request does the
    same after all of them (FIFO admission, as the scheduler does).
    """
    free_at: list[int] = []  # the step at which each slot frees
    waiting: list[int] = []
    for running, left in ahead:
        if running and len(free_at) < slots:
            free_at.append(max(left, 0))
        else:
            waiting.append(max(left, 0))
    free_at += [0] * (slots - len(free_at))
    heapq.heapify(free_at)
    for left in waiting:
        heapq.heappush(free_at, heapq.heappop(free_at) + 1 + left)
    return heapq.heappop(free_at) + 1 + tokens


def step_seconds(records: Sequence[StepRecord], now: float, max_age_s: float) -> float | None:
    """Mean seconds of the ``records`` (steps, oldest first) that ended at most ``max_age_s``
    before ``now`` (``time.perf_counter()``); None when none did."""
    recent = [r.seconds for r in records if now - (r.started + r.seconds) <= max_age_s]
    return statistics.fmean(recent) if recent else None


@dataclass(frozen=True)
class Judgement:
    """The gate's reading of one request with a deadline: what it predicted and what it did.
    ``request_id`` is None for a refused request (it never got one)."""

    request_id: str | None
    deadline_s: float
    predicted_s: float | None  # seconds from arrival to the last token; None: no step to predict from
    steps: int | None
    step_s: float | None
    refused: bool

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class DeadlineGate:
    """Predicts and refuses; counts its refusals in the service's Prometheus registry.

    With ``enabled`` False it still predicts for every request with a deadline and keeps the
    reading (a shadow gate), so an experiment can check its predictions against what then
    happens to requests it would have refused. The last ``LEDGER`` readings are kept.
    """

    LEDGER = 4096

    def __init__(
        self, engine: Any, hub: Any, *, enabled: bool, window: int, window_s: float, registry: CollectorRegistry
    ) -> None:
        self.engine, self.hub, self.enabled = engine, hub, enabled
        self.window, self.window_s = window, window_s
        self.ledger: deque[Judgement] = deque(maxlen=self.LEDGER)
        self.refusals = Counter(
            "labkit_deadline_refusals",
            "Requests the deadline gate refused (429 deadline_unreachable) before the first byte.",
            registry=registry,
        )

    def predict(self, tokens: int) -> Prediction | None:
        """When a request of ``tokens`` tokens submitted now would finish; None without a step that counts."""
        live = self._live()
        at_work = any(s.state.value in ("queued", "running") for s in live)
        last = self.engine.current_step if hasattr(self.engine, "current_step") else 0
        records = self.engine.steps_since(max(0, last - self.window))[-self.window :]
        step_s = step_seconds(records, time.perf_counter(), math.inf if at_work else self.window_s)
        if step_s is None:
            return None
        ahead = [(s.state.value != "queued", s.record.max_new_tokens - s.record.tokens_generated) for s in live]
        slots = int(self.engine.scheduler.max_batch)
        return Prediction(steps_to_finish(ahead, tokens, slots), step_s)

    def _live(self) -> list[Any]:
        streams = [s for s in self.hub.streams() if s.state.live]
        return sorted(streams, key=lambda s: s.record.submitted)

    def check(self, deadline_s: float | None, arrived: float, tokens: int, retry_floor_s: int = 1) -> Judgement | None:
        """Raise a 429 :class:`ServiceError` if a request that arrived at ``arrived``
        (``time.perf_counter()``) with ``deadline_s`` cannot make ``tokens`` tokens in time;
        else return the reading, for :meth:`admitted` to file under the request's id."""
        if deadline_s is None:
            return None
        prediction = self.predict(tokens)
        if prediction is None:
            return Judgement(None, deadline_s, None, None, None, refused=False)
        finish = time.perf_counter() - arrived + prediction.seconds
        refuse = self.enabled and finish > deadline_s
        judgement = Judgement(None, deadline_s, finish, prediction.steps, prediction.step_s, refused=refuse)
        if not refuse:
            return judgement
        self.ledger.append(judgement)
        self.refusals.inc()
        wait = max(retry_floor_s, math.ceil(finish - deadline_s))
        raise ServiceError(
            429,
            REFUSAL_TYPE,
            f"predicted to finish in {finish:.2f} s ({prediction.steps} engine steps of "
            f"{prediction.step_s * 1e3:.1f} ms), after its deadline of {deadline_s:g} s",
            {"Retry-After": str(wait)},
        )

    def admitted(self, judgement: Judgement | None, request_id: str) -> None:
        if judgement is not None:
            self.ledger.append(replace(judgement, request_id=request_id))

    def readings(self) -> list[dict[str, Any]]:
        return [j.as_dict() for j in self.ledger]
