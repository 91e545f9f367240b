"""Notebook 09's measurements as a specification: the load and burst verdicts on small synthetic
rows, both ways; a peer that cannot run is a reason saying how to get it, never a crash; and the
ci sizes run against labkit processes alone (slow)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd
import pytest

from labkit.experiments import burst, disconnect, peers, specs
from labkit.lab import LocalLab, NotMeasurable, Stream, Target, run
from labkit.lab.profiles import Profile

CI = Profile("ci")


def verdicts(spec: Any, rows: list[dict[str, Any]], pairs: pd.DataFrame | None = None,
             **sizes: Any) -> dict[str, tuple[str, str]]:
    """``spec``'s verdicts on ``rows``; ``pairs`` by default a pair a round from the rows' labkit
    one stream and engine alone, as measure_load keeps them."""
    s = spec.sizes_for("ci", **sizes)
    tables = {"rows": pd.DataFrame(rows)}
    http = {r["repetition"]: r["tokens_per_s"] for r in rows if r["server"] == peers.LABKIT and r.get("level") == 1}
    alone = [r for r in rows if r["server"] == peers.ENGINE]
    if pairs is None and alone:
        pairs = pd.DataFrame([{"repetition": r["repetition"], "http_tokens_per_s": http[r["repetition"]],
                               "alone_tokens_per_s": r["tokens_per_s"]} for r in alone])  # fmt: skip
    if pairs is not None:
        tables["pairs"] = pairs
    return {v.name: (v.outcome, v.evidence) for v in spec.verdicts({**tables, **spec.tables(tables, s)}, s)}


def lineup(*names: str, missing: dict[str, str] | None = None, loaded: Any = None) -> peers.Lineup:
    servers: dict[str, Target] = {n: Target(f"http://127.0.0.1:{9000 + i}", name=n) for i, n in enumerate(names)}
    known = {peers.LABKIT: peers.DEFAULT, peers.UNCHUNKED: (None, None), "labkit, budget 16": (16, None)}
    budgets = {n: b for n, b in known.items() if n in names}
    return peers.Lineup(servers, missing or {}, budgets, loaded)


def test_both_measurements_are_registered_and_sized_alike_for_both_profiles() -> None:
    assert [s.name for s in specs("peers")] == ["peers.load"] and [s.name for s in specs("burst")] == ["burst.arrival"]
    for spec in (peers.LOAD, burst.BURST):
        assert set(spec.sizes["full"]) == set(spec.sizes["ci"]) and spec.alternate, spec.name
    assert peers.LOAD.sizes["full"]["levels"] == (1, 8, 32) and peers.LOAD.sizes["full"]["tokens"] == 64
    assert burst.BURST.sizes["full"]["streams"] == 31 and burst.BURST.sizes["full"]["prompt_tokens"] == 1000


# --------------------------------------------------------------------------- the lineup


def test_the_lineup_runs_every_level_on_labkit_and_the_peers_and_the_other_budgets_at_the_top_only() -> None:
    group = lineup(peers.LABKIT, peers.TRANSFORMERS, "labkit, budget 16", missing={peers.LLAMA: "not built"}, loaded=1)
    got = peers.load_conditions(peers.LOAD.sizes_for("ci"), group)
    # the engine alone is no condition: labkit's one stream takes turns with it, run by run
    assert got[:3] == [{"server": n, "level": 1} for n in (peers.LABKIT, peers.LLAMA, peers.TRANSFORMERS)]
    assert not any(c["server"] == peers.ENGINE for c in got)
    assert {"server": "labkit, budget 16", "level": 4} in got and {"server": peers.UNCHUNKED, "level": 4} in got
    assert not any(c["server"].startswith("labkit,") and c["level"] == 1 for c in got)
    with pytest.raises(NotMeasurable, match="not built"):
        group.server(peers.LLAMA)
    with pytest.raises(NotMeasurable, match="started no labkit unchunked"):
        group.server(peers.UNCHUNKED)


def test_any_other_target_is_a_lineup_of_one_with_no_engine_reading() -> None:
    other = Target("http://127.0.0.1:9", name="vllm")
    alone = peers.as_lineup(other)
    assert list(alone.servers) == ["vllm"] and alone.loaded is None and alone.budgets == {}
    got = peers.load_conditions(peers.LOAD.sizes_for("ci"), other)
    assert {"server": "vllm", "level": 4} in got and not any(c["server"] == peers.ENGINE for c in got)
    assert burst.conditions(burst.BURST.sizes_for("ci"), other) == [{"server": "vllm"}]
    assert peers.as_lineup(alone) is alone and peers.Lineup.lab_owned and not Target.lab_owned


def test_a_peer_that_cannot_run_here_says_why_and_how_to_get_it(monkeypatch, tmp_path) -> None:
    import labkit.peers
    from labkit.experiments import lineup

    env = {"OMP_NUM_THREADS": "2"}
    monkeypatch.setattr(labkit.peers, "llama_server", lambda: labkit.peers.PeerMissing("llama-server is not built; "
                                                                                       "run `make peers`"))  # fmt: skip
    with pytest.raises(NotMeasurable, match="make peers"):
        peers.PEER_STARTS[peers.LLAMA]("smollm2-135m", 384, env, tmp_path)
    monkeypatch.setattr(labkit.peers, "llama_server", lambda: labkit.peers.LlamaServer(tmp_path, tmp_path))
    with pytest.raises(NotMeasurable, match="this run serves tiny-llama"):
        peers.PEER_STARTS[peers.LLAMA]("tiny-llama", 384, env, tmp_path)
    monkeypatch.setattr(lineup, "find_spec", lambda name: None if name == "rich" else object())
    with pytest.raises(NotMeasurable, match=r"missing rich.*pip install"):
        peers.PEER_STARTS[peers.TRANSFORMERS]("tiny-llama", 384, env, tmp_path)
    with pytest.raises(NotMeasurable, match="not tiny-gpt2"):
        peers.hf_folder("tiny-gpt2")


def test_a_step_over_its_budget_is_counted_and_unchunked_has_none() -> None:
    steps = pd.DataFrame({"decoded": [0, 31, 64, 10], "prefill_tokens": [64, 33, 1, 60]})
    assert peers.over_budget(steps, 64) == 1  # 31 decode rows leave 33; 64 leave at least one; 10 leave 54
    assert peers.over_budget(steps, 128) == 0 and peers.over_budget(steps, None) == 0


def test_a_surge_step_is_held_to_the_surge_budget() -> None:
    steps = pd.DataFrame({"decoded": [0, 3, 3], "prefill_tokens": [1200, 900, 900], "surge": [True, True, False]})
    assert peers.over_budget(steps, 64, surge=2048) == 1  # the last was no surge: 61 tokens allowed
    assert peers.over_budget(steps, 64, surge=1000) == 2 and peers.over_budget(steps, 64, surge=None) == 3


# --------------------------------------------------------------------------- load verdicts


def load_rows(labkit_tps: float = 300.0, labkit_gap: float = 0.1, over: int = 0, whole: int = 4) -> list[dict]:
    rows = []
    for rep in range(6):
        jitter = 1 + 0.01 * rep
        for name, tps, gap, ttft in ((peers.LABKIT, labkit_tps, labkit_gap, 1.0), (peers.LLAMA, 200.0, 0.15, 2.0),
                                     (peers.TRANSFORMERS, 100.0, 0.3, 3.0)):  # fmt: skip
            for level in (1, 4):
                rows.append({"server": name, "level": level, "repetition": rep, "streams": level, "whole": level,
                             "tokens_per_s": tps * jitter * level / 4, "ttft_p50_s": ttft * jitter,
                             "ttft_p99_s": ttft * 1.1 * jitter, "gap_p50_s": 0.06 * jitter, "gap_p99_s": gap * jitter,
                             **({"budget": peers.label(peers.DEFAULT), "over_budget": over} if name == peers.LABKIT else {})})  # fmt: skip
        rows.append({"server": peers.ENGINE, "level": 1, "repetition": rep, "streams": 1, "whole": 1,
                     "tokens_per_s": 70.0 * jitter})  # fmt: skip
    if whole < 4:
        rows[-2]["whole"] = whole  # one stream of transformers serve's last round came short
    return rows


def test_load_verdicts_hold_when_labkit_leads_on_every_target() -> None:
    got = verdicts(peers.LOAD, load_rows())
    for name in ("every stream whole", "every step within its budget", "gaps: p99 at most llama.cpp's",
                 "gaps: p99 within twice the median", "first token: no later than llama.cpp",
                 "throughput: ahead of both", "one stream: HTTP costs little"):  # fmt: skip
        assert got[name][0] == "holds", (name, got[name])
    assert "beside it, labkit/llama.cpp tokens/s" in got["one stream: HTTP costs little"][1]
    one = got["one stream: HTTP costs little"][1]
    assert "labkit/engine alone tokens/s, each round's median pair (6 pairs, 6 rounds)" in one, one


def test_the_one_stream_verdict_takes_each_rounds_median_pair_and_is_unclear_without_the_engine() -> None:
    rows = load_rows()
    pairs = pd.DataFrame([{"repetition": rep, "http_tokens_per_s": 40.0 + i, "alone_tokens_per_s": (42.0 + i) * f}
                          for rep in range(6) for i, f in enumerate((1.0, 1.0, 9.0))])  # one wild pair a round
    name = "one stream: HTTP costs little"
    outcome, evidence = verdicts(peers.LOAD, rows, pairs)[name]
    assert outcome == "holds" and "(18 pairs, 6 rounds)" in evidence, evidence
    assert verdicts(peers.LOAD, rows, pairs[pairs.repetition < 3])[name][0] == "unclear"  # three rounds: too few
    outcome, evidence = verdicts(peers.LOAD, [r for r in rows if r["server"] != peers.ENGINE])[name]
    assert outcome == "unclear" and evidence.startswith("engine alone: not measured")


def test_load_verdicts_fail_when_labkit_is_slower_gappier_or_out_of_budget() -> None:
    got = verdicts(peers.LOAD, load_rows(labkit_tps=30.0, labkit_gap=0.5, over=2, whole=3))
    for name in ("every stream whole", "every step within its budget", "gaps: p99 at most llama.cpp's",
                 "gaps: p99 within twice the median", "throughput: ahead of both", "one stream: HTTP costs little"):
        assert got[name][0] == "falsified", (name, got[name])
    assert got["every step within its budget"][1] == "24 steps over"  # 2 in each of labkit's 12 rows


def test_a_comparison_with_a_peer_that_was_not_measured_is_unclear_and_says_so() -> None:
    rows = [r for r in load_rows() if r["server"] != peers.LLAMA]
    got = verdicts(peers.LOAD, rows)
    assert got["gaps: p99 at most llama.cpp's"] == ("unclear", "llama.cpp: not measured")
    assert got["throughput: ahead of both"][0] == "unclear" and got["every stream whole"][0] == "holds"


def test_the_load_tables_give_the_tradeoff_at_the_top_level_and_the_readme_cells() -> None:
    s = peers.LOAD.sizes_for("ci")
    rows = pd.DataFrame(load_rows())
    tables = peers.LOAD.tables({"rows": rows}, s)
    trade = tables["tradeoff"].set_index("server")
    assert trade.loc[peers.LABKIT, "budget"] == "64, surge 2048" and trade.loc[peers.LLAMA, "budget"] == ""
    assert peers.ENGINE not in trade.index
    beside = tables["beside"].set_index("measurement")
    assert beside.loc["tokens/s, 4 streams", peers.LLAMA] == "205.0 (200.0–210.0)"
    assert beside.loc["gap, p99, 4 streams (ms)", peers.ENGINE] == "n/a"


# --------------------------------------------------------------------------- burst


def burst_rows(steps: int = 20, unchunked: int = 1, largest: float = 0.05) -> list[dict]:
    rows = []
    for rep in range(6):
        for name, prefill in ((peers.LABKIT, steps), (peers.UNCHUNKED, unchunked), (peers.LLAMA, np.nan)):
            rows.append({"server": name, "repetition": rep, "whole": 32, "streams": 32, "prefill_steps": prefill,
                         "largest_s": largest * (1 + 0.01 * rep), "gap_before_p50_s": 0.02})  # fmt: skip
    return rows


def test_burst_verdicts_hold_for_a_chunked_prefill_and_smooth_streams() -> None:
    got = verdicts(burst.BURST, burst_rows())
    assert all(got[n][0] == "holds" for n in got), got


def test_burst_verdicts_fail_for_a_prefill_in_one_step_and_a_stall() -> None:
    got = verdicts(burst.BURST, burst_rows(steps=1, unchunked=2, largest=0.5))
    assert {n: o for n, (o, _) in got.items()} == {
        "every burst stream whole": "holds", "chunked: the long prompt over several steps": "falsified",
        "unchunked: in one step": "falsified", "smooth at the default budget": "falsified"}  # fmt: skip


def test_the_running_streams_tokens_are_read_by_index_from_the_long_prompts_send() -> None:
    streams = [Stream(token_times=[1.0, 1.1, 1.5, 1.6]), Stream(token_times=[1.0, 1.2, 1.4, 1.5, 9.0])]
    got = burst.by_token(streams, sent=1.05)
    assert [g["token"] for g in got] == [1, 2, 3]
    assert got[1]["gap_max_s"] == pytest.approx(0.4) and got[0]["since_send_s"] == pytest.approx(0.1)


def test_the_long_prompt_is_the_same_text_of_about_its_tokens() -> None:
    from labkit.models.tokenizers import smollm2_tokenizer

    text = burst.long_prompt(1000)
    assert text == burst.long_prompt(1000) and abs(len(smollm2_tokenizer().encode(text)) - 1000) <= 10


# --------------------------------------------------------------------------- against labkit processes


@pytest.mark.slow
def test_the_ci_notebooks_measurements_against_labkit_processes_alone(tmp_path, monkeypatch, tiny_llama) -> None:
    """labkit at three budgets in processes of their own, no peer: every checked line of the load,
    the burst and the stop probe holds, and the missing peers were never asked for. The engine
    alone (this process's model) takes turns with labkit's one stream, each round."""
    monkeypatch.setenv("LABKIT_OUT", str(tmp_path))
    with LocalLab(tiny_llama) as here:
        group = peers.start("tiny-llama", (16, 64, None), peers=(), engine=here, num_blocks=128, log_dir=tmp_path)
    try:
        assert set(group.servers) == {peers.LABKIT, "labkit, budget 16", "labkit, budget 64", peers.UNCHUNKED}
        assert not group.missing
        load = run(peers.LOAD, group, profile=CI, show=False)
        arrival = run(burst.BURST, group, profile=CI, show=False, servers=(peers.LABKIT, peers.UNCHUNKED))
        stops = peers.each(disconnect.STOP, group, repetitions=1)
    finally:
        group.close()
    assert not any(s.proc for s in group.servers.values())  # type: ignore[attr-defined]
    for result in (load, arrival, stops[peers.LABKIT]):
        assert "falsified" not in result.checked() and "unclear" not in result.checked(), result.checked()
    assert (tmp_path / "data" / "peers" / "load" / "beside.csv").exists()  # the lab's own run, not target-peers
    rows = load.table()
    alone = rows[rows.server == peers.ENGINE]
    assert list(alone.level) == [1] * 3 and (alone.whole == 1).all() and (alone.tokens_per_s > 0).all()
    pairs = load.table("pairs")  # the one-stream verdict's units: an HTTP launch and the engine beside it
    assert sorted(pairs.repetition) == [0, 1, 2]
    assert (pairs.http_tokens_per_s > 0).all() and (pairs.alone_tokens_per_s > 0).all()
    assert set(peers.side_by_side(stops).index.get_level_values("server")) == {peers.LABKIT}
