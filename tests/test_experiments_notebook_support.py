"""What the notebooks lean on: the profile they default to, their first tables, progress that keeps
what was measured, and the durations table that states how long each one takes."""
from __future__ import annotations

from dataclasses import dataclass, field

import pandas as pd
import pytest

from labkit.experiments import buffers, slowclient
from labkit.experiments.profiles import Profile, get_profile
from labkit.experiments.results import partial_dir
from labkit.experiments.durations import TOTAL, expected_duration, read_durations, record_durations
from labkit.experiments.notebook import SWITCH, profile_table, settings_table, setup_notebook
from labkit.experiments.progress import RunProgress, measuring


@pytest.fixture
def out(tmp_path, monkeypatch):
    monkeypatch.setenv("LABKIT_OUT", str(tmp_path))
    return tmp_path


# --------------------------------------------------------------------------- profiles


def test_notebooks_default_to_full_and_the_command_line_to_ci(monkeypatch):
    monkeypatch.delenv("LABKIT_PROFILE", raising=False)
    assert get_profile(default="full").name == "full" and get_profile().name == "ci"
    monkeypatch.setenv("LABKIT_PROFILE", "ci")
    assert get_profile(default="full").name == "ci"
    assert get_profile("full", default="ci").name == "full"  # an explicit choice beats the environment


def test_setup_notebook_prints_the_profile_table_and_how_to_switch(out, monkeypatch, capsys):
    monkeypatch.delenv("LABKIT_PROFILE", raising=False)
    profile = setup_notebook(None, "", notebook="04_buffers")
    shown = capsys.readouterr().out
    assert profile == Profile("full") and profile.model == "smollm2-135m"
    assert shown.index("smollm2-135m") < shown.index(SWITCH)
    assert "the chapter's sizes" in shown and "expected duration" in shown


def test_the_profile_table_names_profile_model_and_scale():
    table = profile_table(Profile("ci"), notebook=None)
    assert table.value.to_dict() == {"profile": "ci", "model": "tiny-gpt2", "scale": pytest.approx(table.value["scale"]),
                                     "results written to": table.value["results written to"]}
    assert "toy sizes" in table.value["scale"] and table.value["results written to"].endswith("data")


@dataclass(frozen=True)
class _Nested:
    model: str = "tiny-gpt2"
    stall_timeouts: tuple[float, ...] = (0.25,)
    slow: slowclient.Config = field(default_factory=lambda: slowclient.Config.for_profile(Profile("ci")))


def test_settings_are_one_per_row_with_nested_configs_spelled_out():
    table = settings_table(_Nested())
    values = table.value.to_dict()
    assert values["model"] == "tiny-gpt2" and values["stall_timeouts"] == "0.25"
    assert values["slow.policies"] == "naive, unbounded, pause, drop, pause_then_drop"
    assert values["slow.server_sndbuf"] == "16,384" and "slow" not in values
    assert table.index.is_unique


# --------------------------------------------------------------------------- durations


def test_recorded_durations_replace_old_rows_and_keep_a_total(out):
    profile = Profile("full")
    assert expected_duration("04_buffers", profile).startswith("not measured yet")
    record_durations(profile, {"01_wire_format": 50.0, "04_buffers": 20.0}, "abc1234def")
    record_durations(profile, {"04_buffers": 300.0}, "fedcba9876")
    table = read_durations(profile).set_index("notebook")
    assert table.seconds.to_dict() == {"01_wire_format": 50.0, "04_buffers": 300.0, TOTAL: 350.0}
    assert table.commit[TOTAL] == "fedcba9876" and table.commit["01_wire_format"] == "abc1234def"
    assert expected_duration("04_buffers", profile).startswith("about 5 min (last make lab: commit fedcba9")
    assert expected_duration("01_wire_format", profile).startswith("about 50 s")


def test_each_committed_notebook_has_a_measured_full_duration():
    from labkit.experiments.profiles import repo_root

    table = pd.read_csv(repo_root() / "data" / "durations.csv")
    full = table[table.profile == "full"].set_index("notebook").seconds
    notebooks = sorted(p.stem for p in (repo_root() / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    assert sorted(set(full.index) - {TOTAL}) == notebooks
    assert full[TOTAL] == pytest.approx(full.drop(TOTAL).sum(), abs=0.5)


# --------------------------------------------------------------------------- progress


def test_run_progress_names_the_work_and_keeps_the_rows_so_far(tmp_path):
    progress = RunProgress("demo", total=2, folder=tmp_path / "partial", show=False)
    progress.set_postfix_str("condition A, repetition 1/2")
    progress.update()
    progress.keep(rows=[{"condition": "A", "value": 1}], frame=pd.DataFrame({"x": [1, 2]}))
    assert progress.done == 1 and progress.bar.postfix == "condition A, repetition 1/2"
    assert pd.read_csv(tmp_path / "partial" / "rows.csv").to_dict("records") == [{"condition": "A", "value": 1}]
    assert len(pd.read_csv(tmp_path / "partial" / "frame.csv")) == 2


def test_a_run_stopped_after_its_first_condition_leaves_that_condition_on_disk(out, tiny_gpt2, capsys):
    """A real buffers run, interrupted (as a reader pressing stop would) after one flood."""
    from labkit.server import serve_in_thread

    config = buffers.Config(event_sizes=(1024, 65536), repetitions=1)
    profile = Profile("ci")
    with serve_in_thread(tiny_gpt2) as server:
        with pytest.raises(KeyboardInterrupt):
            with measuring(buffers, config, profile, show=False) as progress:
                real_update = progress.update

                def update(n: int = 1) -> None:
                    real_update(n)
                    if progress.done == 1:
                        raise KeyboardInterrupt

                progress.update = update  # type: ignore[method-assign]
                buffers.run(config, server=server, progress=progress)
    kept = pd.read_csv(partial_dir("buffers", profile) / "floods.csv")
    assert kept.event_bytes.tolist() == [1024] and bool(kept.blocked.iloc[0])
    printed = capsys.readouterr().out
    assert "buffers: stopped after" in printed and "1 of 2 conditions" in printed and "partial" in printed


def test_a_finished_run_prints_its_elapsed_time(capsys):
    class Module:
        NAME = "demo"

        @staticmethod
        def units(config: object) -> int:
            return 3

    with measuring(Module, None, None, show=False) as progress:
        progress.update(3)
    assert capsys.readouterr().out.startswith("demo: 3 of 3 conditions in ")
