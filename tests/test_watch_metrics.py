"""What to watch: /metrics scraped during a load, parsed with prometheus-client's parser."""

from __future__ import annotations

from typing import Any

from service_helpers import lab_server

from labkit.experiments import watch


def test_parse_scrape_reads_the_gauges_and_the_histogram_buckets() -> None:
    text = (
        "# TYPE labkit_open_streams gauge\nlabkit_open_streams 3.0\n"
        "# TYPE labkit_queue_depth gauge\nlabkit_queue_depth 1.0\n"
        "# TYPE labkit_time_to_first_token_seconds histogram\n"
        'labkit_time_to_first_token_seconds_bucket{le="0.1"} 2.0\n'
        'labkit_time_to_first_token_seconds_bucket{le="+Inf"} 5.0\n'
        "labkit_time_to_first_token_seconds_count 5.0\nlabkit_time_to_first_token_seconds_sum 1.5\n"
    )
    row = watch.parse_scrape(text, 0.5)
    assert row == {"t": 0.5, "labkit_open_streams": 3.0, "labkit_queue_depth": 1.0, "ttft_le_0.1": 2.0,
                   "ttft_le_+Inf": 5.0, "ttft_count": 5.0, "ttft_sum": 1.5}  # fmt: skip


def test_a_load_in_waves_shows_a_queue_and_the_metrics_account_for_every_stream(tiny_gpt2: Any) -> None:
    """A scrape must land while a queue stands: with 150 tokens a stream, 11-14 of ~19 scrapes
    saw one here (with 60, 4-5 of 9, few enough that a faster engine could slip between two)."""
    config = watch.Config(max_batch=2, waves=2, per_wave=5, wave_gap_s=0.3, tokens=150, scrape_every=0.1)
    with lab_server(tiny_gpt2) as server:
        tables = watch.run(config, server=server)
    scrapes = tables["scrapes"]
    assert len(tables["requests"]) == 10 and (tables["requests"].ended_by == "done").all()
    assert scrapes.labkit_open_streams.max() > config.max_batch
    labels, new = watch.buckets(scrapes, "ttft")
    assert labels[-1] == "+Inf" and new.sum() == 10  # every first token lands in exactly one bucket, once
    assert [v.holds for v in watch.verdicts(tables, config)] == [True, True]
