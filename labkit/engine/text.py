"""A sequence's text: incremental UTF-8 deltas with stop strings matched across tokens."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from labkit.engine.detok import IncrementalDetokenizer, StopMatcher


class TextState:
    """Turns one sequence's sampled ids into the text each token event carries.

    Deltas can be empty while a multi-byte character or a possible stop string is held back; the
    last token of a sequence carries whatever is still held.
    """

    def __init__(self, tokenizer: Any, prompt_ids: Sequence[int], stops: Sequence[str]) -> None:
        self.detok = IncrementalDetokenizer(tokenizer, prompt_ids)
        self.stopper = StopMatcher(stops) if stops else None

    def push(self, token_id: int, *, special: bool, final: bool) -> tuple[str, bool]:
        """Text for this token, and whether a stop string ended the sequence on it."""
        text = "" if special else self.detok.push(token_id)
        if final:
            text += self.detok.flush()
        if self.stopper is None:
            return text, False
        text, stopped = self.stopper.push(text)
        if final and not stopped:
            text += self.stopper.flush()
        return text, stopped
