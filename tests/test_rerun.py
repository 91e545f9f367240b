"""``make lab`` (labkit.rerun): notebooks run in place, a failure keeps what ran, durations are reported."""
from __future__ import annotations

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_notebook

from labkit.rerun import closing_note, run_notebook


def test_the_closing_note_lists_each_notebook_and_the_total():
    note = closing_note({"01_wire_format": 60.0, "04_buffers": 30.0}, "full")
    assert note.splitlines() == ["2 notebooks under the full profile:", "  01_wire_format    1.0 min",
                                 "  04_buffers        0.5 min", "  total             1.5 min"]


@pytest.mark.slow
def test_a_notebook_that_fails_late_is_written_with_the_outputs_before_the_failure(tmp_path):
    path = tmp_path / "99_demo.ipynb"
    nb = new_notebook(cells=[new_code_cell("print('measured before the crash')"),
                             new_code_cell("raise RuntimeError('late crash')"),
                             new_code_cell("print('never runs')")])
    nbformat.write(nb, path)
    seconds, error = run_notebook(path, timeout=120)
    assert error is not None and "late crash" in error and seconds > 0
    cells = nbformat.read(path, as_version=4).cells
    assert cells[0].outputs[0].text == "measured before the crash\n"
    assert cells[1].outputs[0].output_type == "error" and cells[2].outputs == []
