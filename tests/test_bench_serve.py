"""The serving bench's client reads both servers' streams and sums them up the same way
(the timings themselves are never asserted)."""
from __future__ import annotations

import pytest

from labkit.bench_serve import Server, Timed, labkit_command, long_prompt, summary


def test_a_token_is_an_event_line_for_labkit_and_a_data_line_for_llama_cpp() -> None:
    labkit, llama = Server("http://x", "labkit"), Server("http://x", "llama.cpp")
    assert labkit.is_token("event: token") and not labkit.is_token('data: {"index": 0}')
    assert llama.is_token('data: {"content": "a", "stop": false}')
    assert not llama.is_token('data: {"content": "", "stop": true}') and not llama.is_token("")
    path, body = llama.request("hi", 8)
    assert path == "/completion" and body["ignore_eos"] and body["cache_prompt"] is False and body["n_predict"] == 8
    assert labkit.request("hi", 8) == ("/v1/stream", {"prompt": "hi", "max_new_tokens": 8, "ignore_eos": True})


def test_summary_reads_first_tokens_gaps_and_throughput_from_the_arrival_times() -> None:
    runs = [Timed(0.0, [1.0, 1.1, 1.2]), Timed(0.5, [1.5, 1.7, 2.0])]
    row = summary(runs)
    assert row["tokens"] == 6 and row["tokens_per_s"] == pytest.approx(3.0)
    assert row["first_p50_ms"] == pytest.approx(1000.0)
    assert row["gap_p50_ms"] == pytest.approx(150.0)


def test_the_unchunked_budget_is_passed_as_none_and_a_long_prompt_has_about_the_words_asked() -> None:
    assert labkit_command(8000, model="tiny-gpt2", step_tokens=None)[-2:] == ["--step-tokens", "none"]
    assert len(long_prompt(1000).split()) == 880
