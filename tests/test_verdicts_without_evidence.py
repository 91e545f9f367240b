"""A verdict with nothing to judge is unclear: no rows for a condition, a record that never came,
a witness the target does not offer. Comparing a missing value with a bar gives False, and "all of
none" gives True, so each of these once came out falsified or held on no evidence (found by an
audit of every verdict function; each case is one a target or a size override can produce)."""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import Any

import numpy as np
import pandas as pd
import pytest

from labkit.experiments import (
    buffers,
    deadline,
    disconnect,
    edge,
    edge_browser,
    extensions,
    isolation,
    overlap,
    production,
    slowclient,
    wire,
)
from labkit.lab.verdict import every

nan = np.nan


def _wire() -> Any:
    rows = pd.DataFrame({c: [True] * 3 for c, _ in wire.CHECKS[:6]} | {
        "tokens": [16] * 3, "finish": ["stop"] * 3, "bytes": [900] * 3, "token_event_bytes": [600] * 3,
        "empty_deltas": [0] * 3, "failure": [None] * 3, "prompt": [0, 1, 2], "repetition": [0] * 3})  # fmt: skip
    s = wire.CONTRACT.sizes_for("ci")
    t = {"rows": rows}
    t.update(wire.contract_tables(t, s))
    return wire.contract_verdicts(t, s)


def _flood() -> Any:
    n = 3
    rows = pd.DataFrame({"event_bytes": [1024, 16384, 65536], "repetition": [0] * n, "blocked": [True] * n,
                         "bytes_accepted": [9e9] * n, "events_accepted": [10] * n, "client_unread_bytes": [None] * n,
                         "client_rcvbuf": [None] * n, "server_finished": [True] * n, "token_event_bytes": [100.0] * n,
                         "same_machine": [True] * n, "tcp_wmem_min": [4096] * n, "tcp_wmem_default": [16384] * n,
                         "tcp_wmem_max": [4194304] * n, "tcp_rmem_min": [4096] * n, "tcp_rmem_default": [131072] * n,
                         "tcp_rmem_max": [6291456] * n})  # fmt: skip
    t = {"rows": rows}
    t.update(buffers.flood_tables(t, None))
    return buffers.flood_verdicts(t, None)


def _moments() -> Any:
    rows = pd.DataFrame({"response_class": ["starlette"] * 2 + ["write_only"] * 2, "leave_by": ["fin"] * 4,
                         "moment": ["waiting", "mid", "mid", "mid"], "release_steps": [nan] * 4,
                         "ever_admitted": [nan] * 4, "engine_finish": [nan] * 4, "tokens_generated": [nan] * 4})  # fmt: skip
    return disconnect.moment_verdicts({"rows": rows}, disconnect.MOMENTS.sizes_for("ci"))


def _eager() -> Any:
    s = extensions.EAGER.sizes_for("ci")
    rows = pd.DataFrame({"reader": [0, 1], "tokens": [64, 64], "queued": [0, 0], "lazy_bytes": [120, 120],
                         "eager_bytes": [200, 200], "eager_unpadded_bytes": [150, 150]})  # fmt: skip
    t = {"rows": rows}
    t.update(extensions.eager_tables(t, s))
    return extensions.eager_verdicts(t, s)


def _sampling() -> Any:
    rows = pd.DataFrame({"comparison": ["all at once vs alone", "sampled vs greedy"], "prompt": [0, 0],
                         "first_diff": [None, 3], "failed": [False, True]})  # fmt: skip
    return extensions.sampling_verdicts({"rows": rows}, extensions.SAMPLING.sizes_for("ci"))


def _full_batch() -> Any:
    rows = pd.DataFrame({"policy": ["pause"], "stall_steps": [np.inf], "stalled_paused": [2], "others_failed": [0],
                         "stalled_dropped": [0], "stalled_slot_steps": [40]})  # fmt: skip
    return extensions.full_batch_verdicts({"rows": rows}, extensions.FULL_BATCH.sizes_for("ci"))


def _slow() -> Any:
    rows = pd.DataFrame({"policy": ["naive"] * 2, "slow": [0, 1], "repetition": [0, 0], "healthy_not_whole": [0, 0],
                         "done_vs_k0": [1.0, 2.0], "healthy_steps": [nan, nan]})  # fmt: skip
    slow = pd.DataFrame({"policy": ["naive"], "slow": [1], "ratio": [nan], "server_end": [nan], "max_queue": [nan],
                         "pauses": [nan], "end": ["cut"]})  # fmt: skip
    return slowclient.verdicts({"rows": rows, "slow": slow}, slowclient.POLICIES.sizes_for("ci"))


def _browser() -> Any:
    rows = pd.DataFrame({"cut_after": [0], "retry_ms": [0], "repetition": [0], "connections": [1],
                         "first_id_after": [None], "same_as_uninterrupted": [True], "ids_once_in_order": [True],
                         "ended_by": ["done"], "reconnect_ms": [None]})  # fmt: skip
    return production.browser_verdicts({"rows": rows}, production.BROWSER.sizes_for("ci"))


def _drain() -> Any:
    t = {"rows": pd.DataFrame({"exit_code": [0], "exited_s": [1.0], "drain_grace_s": [3.0]}),
         "streams": pd.DataFrame({"stream": [0, 1], "resumable": [False, False], "tokens": [3, 3],
                                  "ended_by": ["shutdown"] * 2}),
         "probes": pd.DataFrame({"sent_s": [0.1], "status": [503], "retry_after": ["1"], "type": ["draining"]}),
         "resumes": pd.DataFrame([])}  # fmt: skip
    return production.drain_verdicts(t, production.DRAIN.sizes_for("ci"))


def _close() -> Any:
    rows = pd.DataFrame({"moment": ["streaming"] * 2 + ["queued"] * 2, "abort": ["off", "on", "off", "on"],
                         "tokens_at_close": [8, 8, 3, 3], "tokens": [None, None, 0, 100]})  # fmt: skip
    return edge_browser.close_verdicts({"rows": rows}, edge_browser.CLOSE.sizes_for("ci"))


def _isolation() -> Any:
    rows = pd.DataFrame({"mode": ["invariant"] * 2, "level": [2, 2], "identical": [True, True], "failure": [None] * 2})
    return isolation.stream_verdicts({"rows": rows}, None)


def _joiners() -> Any:
    rows = pd.DataFrame({"background": [0, 0, 4, 4], "repetition": [0] * 4, "ttft_s": [0.1] * 4, "failed": [False] * 4,
                         "running_at_send": [0, 0, 4, 4], "ttft_in_steps": [1.0, 1.0, nan, nan],
                         "server_ttft_s": [0.1, 0.1, nan, nan]})  # fmt: skip
    return overlap.joiner_verdicts({"rows": rows}, None)


def _levels_without_one() -> Any:  # run(OVERLAP, target, levels=[8, 32])
    rows = pd.DataFrame({"level": [8, 32] * 3, "repetition": [0, 0, 1, 1, 2, 2], "tokens_per_s": [80.0, 300.0] * 3,
                         "gap_p50_s": [0.02, 0.03] * 3, "failed": [0] * 6, "tokens": [16] * 6})  # fmt: skip
    return overlap.level_verdicts({"rows": rows}, overlap.LEVELS.sizes_for("ci", levels=(8, 32)))


def _delivery_one_mode() -> Any:  # a run of step-end delivery alone
    rows = pd.DataFrame({"first_token": ["step_end"] * 3, "repetition": [0, 1, 2], "failed": [0] * 3}
                        | {f"ttft_{q}_s": [0.1, 0.2, 0.3] for q in overlap.QUANTILES})  # fmt: skip
    t = {"rows": rows}
    t.update(overlap.delivery_tables(t, None))
    return overlap.delivery_verdicts(t, None)


def _share_one_server() -> Any:
    rows = pd.DataFrame({"server": ["thread"] * 3, "repetition": [0, 1, 2], "tokens_per_s": [300.0] * 3})
    return overlap.share_verdicts({"rows": rows}, None)


def _goodput_gate_on_only() -> Any:
    rows = pd.DataFrame({"repetition": [0, 1, 2], "load": [1.5, 2.0, 3.0], "gate": [True] * 3,
                         "goodput": [2.0] * 3, "met": [8] * 3})  # fmt: skip
    t = {"rows": rows}
    t.update(deadline.goodput_tables(t, None))
    return deadline.goodput_verdicts(t, deadline.GOODPUT.sizes_for("ci"))


def _storm_fixed_only() -> Any:
    rows = pd.DataFrame({"policy": ["fixed"] * 2, "repetition": [0, 1], "peak_per_100ms": [120, 110],
                         "refused_503": [30, 40], "whole": [200, 200]})  # fmt: skip
    return edge.storm_verdicts({"rows": rows}, edge.STORM.sizes_for("ci"))


CASES: dict[str, tuple[Callable[[], Any], list[str]]] = {
    "overlap: levels without level 1": (_levels_without_one, ["overlap", "per-stream gap"]),
    "overlap: delivery with one mode": (_delivery_one_mode, ["one pass, one moment: the median",
                                                             "one pass, one moment: the last"]),
    "overlap: client share with one server": (_share_one_server, ["the client costs the in-thread server"]),
    "production: goodput with the gate on only": (_goodput_gate_on_only, ["the gate raises goodput above the service rate"]),
    "edge: storm with the fixed delay only": (_storm_fixed_only, ["jitter flattens the herd", "jitter meets fewer refusals"]),
    "wire: no stream ran to its limit": (_wire, ["token events carry most of a stream's bytes"]),
    "buffers: the client's buffer unknown": (_flood, ["bounded by the kernel", "the send buffer grows"]),
    "disconnect: no record came": (_moments, ["listening releases within two steps", "waiting never admitted",
                                             "write-only runs to the limit"]),
    "extensions: no reader held an event": (_eager, ["the padding is what eager holds",
                                                     "unpadded, eager is no heavier"]),
    "extensions: the only sampled pair failed": (_sampling, ["sampling takes effect"]),
    "extensions: no stall timeout asked for": (_full_batch, ["pause_then_drop gives them back"]),
    "slow clients: no step or record came": (_slow, ["same steps", "policies act", "slow is slow"]),
    "production: no cut run": (_browser, ["the browser resumes exactly", "retry: sets the reconnect delay"]),
    "production: no resumable stream": (_drain, ["a restarted process answers the resume with 404"]),
    "edge: no record, nothing queued": (_close, ["streaming: stopped, off or on", "queued, off: never admitted"]),
    "isolation: no level 1": (_isolation, ["alone equals solo"]),
    "overlap: no busy joiner timed": (_joiners, ["a joiner waits about a step"]),
}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_nothing_to_judge_is_unclear(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    for module in (wire, buffers):
        monkeypatch.setattr(module, "published", lambda section: defaultdict(lambda: "—"))  # the chapter's figures
    judge, names = CASES[case]
    said = {v.name: v.outcome for v in judge()}
    assert {name: said[name] for name in names} == {name: "unclear" for name in names}, said


def test_every_of_nothing_is_unclear() -> None:
    assert every([]) is None and every(pd.Series([nan, nan])) is None and every([True, nan]) is True
