"""The lab's core: a target probed once, experiments as data, one runner, one client.

A notebook cell reads ``run(overlap.LEVELS, target, levels=(1, 64))``: one measurement at the
profile's sizes (overrides by name) against a target (labkit in a background thread, labkit in
its own process, or any OpenAI-compatible URL), returning a :class:`Result` whose tables,
verdicts and figures the cells below show without measuring again.
"""

from labkit.lab.client import Launch, Request, run_sync
from labkit.lab.experiment import Experiment, Sizes, Trial
from labkit.lab.notebook import setup, target_for
from labkit.lab.probe import connect, quirks_table
from labkit.lab.profiles import Profile, get_profile
from labkit.lab.runner import Result, load, run
from labkit.lab.stream import ReadOptions, Stream
from labkit.lab.target import Caps, LocalLab, NotMeasurable, Process, Target, TargetError
from labkit.lab.verdict import Interval, Verdict, every, interval, judge, seen, side, span, spread, tell, verdict_table

__all__ = [
    "Caps", "Experiment", "Interval", "Launch", "LocalLab", "NotMeasurable", "Process", "Profile", "ReadOptions",
    "Request", "Result", "Sizes", "Stream", "Target", "TargetError", "Trial", "Verdict", "connect", "get_profile",
    "every", "interval", "judge", "load", "seen", "side", "quirks_table", "run", "run_sync", "setup", "span", "spread",
    "target_for", "tell", "verdict_table",
]  # fmt: skip
