"""Drain on restart, on a real ``labkit serve`` subprocess (tiny model), as notebook 08 runs it."""

from __future__ import annotations

import pytest

from labkit.experiments import drain


@pytest.mark.slow
def test_sigterm_ends_every_open_stream_refuses_new_work_and_a_restart_forgets_the_logs() -> None:
    config = drain.Config(model="tiny-gpt2", streams=4, tokens=300, drain_grace=2.5)
    tables = drain.run(config)
    streams, probes, process = tables["streams"], tables["probes"], tables["process"].iloc[0]
    # every open stream: its done, or error: shutdown; the resumable ones are told so too
    assert set(streams.ended_by) <= {"done", "error"}
    assert set(streams.error_type.dropna()) == {"shutdown"}
    assert (streams.ended_after_signal_s < config.drain_grace).all()
    # new requests during the drain: 503 draining with Retry-After, then the port refuses
    answered = probes[probes.status.notna()]
    assert len(answered) >= 1 and (answered.status == 503).all() and (answered.retry_after == "1").all()
    assert probes.error_type.iloc[-1].startswith("refused")
    assert process.exit_code == 0 and not process.traceback_in_stderr
    assert process.exited_after_s <= config.drain_grace + 2.0  # generous: the interpreter's exit
    # the restarted process never heard of the old streams: the same 404 an unknown id gets
    assert len(tables["reconnect"]) == 2 and (tables["reconnect"].status == 404).all()
    assert all(v.holds for v in drain.verdicts(tables, config))
    # the timeline is one clock, the signal at 0: the streams' ends and the 503s come before the exit
    timeline = tables["timeline"]
    exit_t = float(timeline[timeline.what == "process exited"].t.iloc[0])
    assert exit_t == pytest.approx(process.exited_after_s)
    assert (timeline[timeline.what.str.contains("probe 503")].t < exit_t).all()
