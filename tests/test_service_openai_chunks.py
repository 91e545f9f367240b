"""A token chunk of an OpenAI stream is encoded once per stream and per token only its text:
the bytes must be exactly what encoding the whole chunk gives, for every text a token can carry."""
from __future__ import annotations

import pytest

from labkit.service.openai import _MARK, Shape, _data
from labkit.sse import parse

TEXTS = [
    "",
    " Paris",
    'say "hi" \\ back',
    "line\nbreak\r\nand\rcarriage",
    "tab\tand \x00 nul \x1f",
    "caf\u00e9 \u4e2d\u6587 \U0001f600",
    "\u2028 line separator \u2029 and \ufeff bom",
    "\ufffd",
    "</script>",
]


@pytest.mark.parametrize("kind", ["completion", "chat"])
@pytest.mark.parametrize("usage_null", [False, True])
@pytest.mark.parametrize("text", TEXTS)
def test_a_token_chunk_is_byte_for_byte_the_whole_chunk_encoded(kind: str, usage_null: bool, text: str) -> None:
    shape = Shape(kind, "req-0123456789abcdef", "smollm2-135m", 12)
    assert shape.token_data(text, usage_null) == _data(shape.chunk(text), usage_null)
    assert len(parse(shape.token_data(text, usage_null))) == 1  # one event, whatever the text holds


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_names_that_hold_the_marker_still_give_the_whole_chunks_bytes(kind: str) -> None:
    shape = Shape(kind, "req-" + _MARK, _MARK, 3)  # the marker appears more than once: no frame is cut
    for text in ("x", _MARK, ""):
        assert shape.token_data(text, True) == _data(shape.chunk(text), True)
