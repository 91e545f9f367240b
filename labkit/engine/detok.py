"""From token ids to streamable text: incremental detokenizing and stop strings.

Both classes are independent of any model. The engine pipes each generated id through
``IncrementalDetokenizer.push`` and the resulting delta through ``StopMatcher.push``; at the end of
a sequence it pushes ``detok.flush()`` through the matcher and then emits ``matcher.flush()``.
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Sequence
from functools import lru_cache
from typing import NamedTuple, Protocol

__all__ = ["IncrementalDetokenizer", "StopAutomaton", "StopMatcher", "StopResult"]

REPLACEMENT = "\ufffd"
CONTEXT_TOKENS = 4  # ids kept before the unsent text, so each decode sees a token's neighbour


class TokenDecoder(Protocol):
    """All the detokenizer needs: HF tokenizers and ``tokenizers.Tokenizer`` both fit."""

    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class IncrementalDetokenizer:
    """Text deltas for one sequence, one token at a time, never half a character.

    The technique is vLLM's and TGI's prefix/read offsets, with the read offset counted in
    characters: decode a short window of ids (a few already-sent ids as context, then the new
    ones) and send the part of it past what was already sent. Text is held back while it ends in
    U+FFFD, because that may be a character whose remaining bytes are in the next token; when the
    window ends on a clean character boundary it is cut back to its last few ids, so each push
    costs a couple of decodes of a few tokens however long the sequence grows.

    Why context: SentencePiece-style tokenizers drop the leading space of the first token they
    decode. With the prompt's last ids as context the first delta keeps its space, as the text
    reads after the prompt; without a prompt the deltas equal ``decode(generated_ids)``.

    Special tokens: decoded with ``skip_special_tokens`` (default ``True``), so an eos or a chat
    marker that is pushed contributes no text. The engine does not push eos at all.

    ``clean_up_tokenization_spaces`` is forced off: it rewrites text already sent (``"it 's"``
    into ``"it's"``), which a stream cannot take back. Only when the tokenizer has it on is the
    keyword passed, so any object with ``decode(ids, skip_special_tokens=...)`` works.

    Invariant: ``"".join(pushes) + flush() == decode(generated_ids)`` (same keywords) for
    byte-level BPE (GPT-2, SmolLM2), invalid bytes included. With prompt ids the deltas are the
    text that follows the prompt, ``decode(prompt + gen)[len(decode(prompt)):]``, which differs
    from ``decode(gen)`` only by the SentencePiece leading space. One case no stream can match:
    a byte-fallback tokenizer turns a whole run of byte tokens into U+FFFD once any of it is
    invalid, after part of the run may have been sent. The window grows only while the text
    keeps ending in U+FFFD, i.e. inside a character or a run of invalid bytes.
    """

    def __init__(
        self,
        tokenizer: TokenDecoder,
        prompt_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._kwargs: dict[str, bool] = {"skip_special_tokens": skip_special_tokens}
        if getattr(tokenizer, "clean_up_tokenization_spaces", False):
            self._kwargs["clean_up_tokenization_spaces"] = False
        context = [int(i) for i in prompt_ids[-CONTEXT_TOKENS:]]
        context_text = self._decode(context)
        if context_text.endswith(REPLACEMENT):  # prompt ends inside a character: no context
            context, context_text = [], ""
        self._ids: list[int] = context
        self._sent = len(context_text)  # characters of decode(self._ids) already sent or context

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, **self._kwargs) if ids else ""

    def push(self, token_id: int) -> str:
        """The text ``token_id`` adds, or ``""`` while a character is incomplete."""
        self._ids.append(int(token_id))
        text = self._decode(self._ids)
        stable = len(text.rstrip(REPLACEMENT))
        delta = text[self._sent : stable] if stable > self._sent else ""
        self._sent = max(self._sent, stable)
        if stable == len(text):
            self._trim(text)
        return delta

    def _trim(self, text: str) -> None:
        """Cut the window to its last few ids, at a cut whose decode matches the full text."""
        if len(self._ids) < 2 * CONTEXT_TOKENS:
            return
        for keep in range(CONTEXT_TOKENS, 0, -1):
            tail = self._ids[-keep:]
            tail_text = self._decode(tail)
            if tail_text and text.endswith(tail_text) and not tail_text.endswith(REPLACEMENT):
                self._ids, self._sent = tail, len(tail_text)
                return

    def flush(self) -> str:
        """End of sequence: everything still held back, U+FFFD included."""
        text = self._decode(self._ids)
        delta = text[self._sent :]
        self._sent = len(text)
        return delta


class StopResult(NamedTuple):
    text: str  # safe to send now
    stopped: bool  # a stop string matched; the sequence should end


class StopMatcher:
    """Finds stop strings in a stream of text deltas, across delta boundaries.

    Holds back only the longest tail that could still begin a stop string, so text reaches the
    client as early as possible. When several stop strings match, the one that is complete first
    wins (earliest end; on a tie, earliest start): the answer does not depend on how the text was
    cut into deltas, and the stream never waits for more text once a stop string is complete.
    The text before the match is released; the stop string and anything after it never are.

    Matching walks an Aho-Corasick automaton (:class:`StopAutomaton`) one character at a time, so
    a delta costs the same whether a request has one stop string or thousands; the automaton is
    built once per distinct set of stops and shared.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        if isinstance(stops, str):
            raise TypeError("stops must be a sequence of strings, not one string")
        for stop in stops:
            if not isinstance(stop, str) or stop == "":
                raise ValueError(f"stop strings must be non-empty str, got {stop!r}")
        self._automaton = StopAutomaton.of(tuple(stops))
        self._state = 0  # the automaton's node for the held text
        self._held = ""
        self.stopped = False

    def push(self, text: str) -> StopResult:
        if self.stopped:
            return StopResult("", True)
        buffer = self._held + text
        state, goto, matched = self._automaton.walk(self._state, text)
        if matched:
            end = len(self._held) + goto  # ``goto`` is the index in ``text`` of the match's last char
            self._held, self.stopped = "", True
            return StopResult(buffer[: end + 1 - matched], True)
        self._state = state
        hold = self._automaton.depth[state]
        self._held = buffer[len(buffer) - hold :]
        return StopResult(buffer[: len(buffer) - hold], False)

    def flush(self) -> str:
        """End of sequence without a stop: release what was held back."""
        held, self._held, self._state = self._held, "", 0
        return held


class StopAutomaton:
    """An Aho-Corasick automaton over a set of stop strings (node 0 is the root).

    A node stands for a prefix of some stop string; ``depth`` is its length, and ``match`` is the
    length of the longest stop string that ends there (0 for none). Walking the text keeps the
    longest suffix of what was read that is still a prefix of a stop: exactly the text to hold.
    Edges live in one dict keyed by ``node * 0x110000 + ord(char)`` (small, and no tuple per step);
    from the root, a regex skips to the next character that can start a stop at C speed.
    """

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.edges: dict[int, int] = {}
        self.depth, self.match, self.fail = [0], [0], [0]
        children: list[list[tuple[str, int]]] = [[]]
        for stop in stops:
            self._insert(stop, children)
        self._link(children)
        self._start = re.compile("[" + "".join(re.escape(c) for c, _ in children[0]) + "]") if children[0] else None

    @classmethod
    def of(cls, stops: tuple[str, ...]) -> StopAutomaton:
        return _automaton(stops)

    def _insert(self, stop: str, children: list[list[tuple[str, int]]]) -> None:
        node = 0
        for char in stop:
            child = self.edges.get(node * _CODEPOINTS + ord(char))
            if child is None:
                child = len(self.depth)
                self.edges[node * _CODEPOINTS + ord(char)] = child
                children[node].append((char, child))
                children.append([])
                self.depth.append(self.depth[node] + 1)
                self.match.append(0)
                self.fail.append(0)
            node = child
        self.match[node] = len(stop)

    def _link(self, children: list[list[tuple[str, int]]]) -> None:
        """Breadth first: each node's failure link, and the longest stop that ends at it."""
        queue = deque(child for _, child in children[0])
        while queue:
            node = queue.popleft()
            for char, child in children[node]:
                queue.append(child)
                self.fail[child] = self.step(self.fail[node], char)
                if not self.match[child]:
                    self.match[child] = self.match[self.fail[child]]

    def step(self, state: int, char: str) -> int:
        code = ord(char)
        while True:
            found = self.edges.get(state * _CODEPOINTS + code)
            if found is not None:
                return found
            if state == 0:
                return 0
            state = self.fail[state]

    def walk(self, state: int, text: str) -> tuple[int, int, int]:
        """``(state, index, length)`` of the first stop completed in ``text`` read from ``state``;
        ``(state, -1, 0)`` after the whole text when none is."""
        index, size = 0, len(text)
        while index < size:
            if state == 0:
                found = self._start.search(text, index) if self._start is not None else None
                if found is None:
                    return 0, -1, 0
                index = found.start()
            state = self.step(state, text[index])
            if self.match[state]:
                return state, index, self.match[state]
            index += 1
        return state, -1, 0


_CODEPOINTS = 0x110000


@lru_cache(maxsize=32)
def _automaton(stops: tuple[str, ...]) -> StopAutomaton:
    return StopAutomaton(stops)
