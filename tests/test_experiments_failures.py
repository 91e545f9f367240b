"""The old workload helper the failure experiments used: long prompts that run to their limit.

Notebooks 05 and 06 are specs on the lab core now (tests/test_exp_slowclient.py,
test_exp_disconnect.py, test_exp_leak.py).
"""

from __future__ import annotations

from labkit.experiments.workload import long_prompts


def test_long_prompts_run_to_their_limit(tiny_gpt2):
    chosen = long_prompts(tiny_gpt2, 16)
    assert chosen and all(0 <= i < 32 for i in chosen)
