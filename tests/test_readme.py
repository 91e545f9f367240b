"""The README's measured tables are rendered from data/, never typed: they cannot drift apart."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from labkit import readme

ROOT = Path(__file__).resolve().parent.parent


def test_the_readme_tables_are_what_the_data_renders():
    text = (ROOT / "README.md").read_text()
    assert readme.render(text, ROOT / "data") == text, "run `python -m labkit.readme` after make lab / make bench"
    assert "<!-- data: durations -->" in text and "<!-- data: bench_step -->" in text


def test_a_block_is_replaced_by_its_rendered_table_and_an_unknown_block_is_refused(tmp_path):
    pd.DataFrame(
        [
            {"notebook": "01_wire_format", "profile": "full", "seconds": 90.0, "commit": "abcdef0123", "date": "2026-11-30"},
            {"notebook": "total", "profile": "full", "seconds": 90.0, "commit": "abcdef0123", "date": "2026-11-30"},
        ]
    ).to_csv(tmp_path / "durations.csv", index=False)
    out = readme.render("a\n<!-- data: durations -->\nstale 99 min\n<!-- /data -->\nb\n", tmp_path)
    assert "stale" not in out and "| `01_wire_format` | 1.5 | abcdef0 |" in out and "Last `make lab`: commit abcdef0" in out
    assert out.startswith("a\n<!-- data: durations -->\n") and out.endswith("<!-- /data -->\nb\n")
    missing = "<!-- data: bench_step -->\nnot yet\n<!-- /data -->\n"
    assert readme.render(missing, tmp_path) == missing  # no data file yet: left as it is
    with pytest.raises(ValueError, match="no renderer"):
        readme.render("<!-- data: nonsense -->\n<!-- /data -->", tmp_path)


def test_the_attention_table_shows_each_cell_with_its_spread_and_the_ratios(tmp_path):
    (tmp_path / "bench").mkdir()
    row = {"context": 512, "batch": 32, "n": 3, "copied_MiB_per_step": 810.0}
    for what, base in (("attention", 10.0), ("step", 100.0)):
        for mode, factor in (("gather", 1.0), ("kernel", 0.5)):
            for stat, k in (("median", 1.0), ("min", 0.9), ("max", 1.2)):
                row[f"{what}_{mode}_ms_{stat}"] = base * factor * k
        row[f"{what}_kernel/gather"] = 0.5
    pd.DataFrame([row]).to_csv(tmp_path / "bench" / "attention.csv", index=False)
    out = readme.render("<!-- data: bench_attention -->\n<!-- /data -->\n", tmp_path)
    assert "| 512 | 32 | 810.0 | 100.0 (90.0–120.0) | 50.0 (45.0–60.0) | 0.50 |" in out
    assert "3 interleaved repetitions" in out


def test_the_peers_table_puts_each_server_in_a_column_with_the_runs_provenance(tmp_path):
    folder = tmp_path / "peers" / "load"
    folder.mkdir(parents=True)
    pd.DataFrame([{"measurement": "tokens/s, 32 streams", "labkit": "260.0 (250.0–270.0)", "llama.cpp": "211.0"}]).to_csv(
        folder / "beside.csv", index=False)
    record = {"sizes": {"repetitions": 3}, "environment": {"git_commit": "abcdef0123", "date": "2026-12-02T10:00:00"},
              "machine": {"loadavg_before": [0.25, 0.3, 0.3]}}
    (folder / "results.json").write_text(json.dumps(record))
    out = readme.render("<!-- data: peers -->\n<!-- /data -->\n", tmp_path)
    assert "| | labkit | llama.cpp |" in out and "| tokens/s, 32 streams | 260.0 (250.0–270.0) | 211.0 |" in out
    assert "3 interleaved rounds: commit abcdef0, 2026-12-02, load average 0.25 before" in out


def test_notebooks_run_at_different_commits_are_not_called_one_make_lab(tmp_path):
    rows = [
        {"notebook": "01_wire_format", "profile": "full", "seconds": 60.0, "commit": "aaaaaaa1", "date": "2026-11-30"},
        {"notebook": "09_peers", "profile": "full", "seconds": 120.0, "commit": "bbbbbbb2", "date": "2026-12-01"},
    ]
    pd.DataFrame(rows).to_csv(tmp_path / "durations.csv", index=False)
    out = readme.render("<!-- data: durations -->\n<!-- /data -->\n", tmp_path)
    assert "| `09_peers` | 2.0 | bbbbbbb |" in out and "| **total** | **3.0** | |" in out
    assert "Last `make lab`" not in out and "2 commits" in out and "2026-12-01" in out
