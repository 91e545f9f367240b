"""A target is probed, not named: a server without ``[DONE]`` or usage is reported as such and
still measured; one that cannot be measured is refused in one line, with a non-zero exit."""
from __future__ import annotations

import subprocess
import sys

import pandas as pd
import pytest
from target_helpers import (
    REPO,
    STUB_MODEL,
    BatchingStub,
    broken_api,
    free_port,
    quirky_stub,
    uvicorn_in_thread,
    web_site,
)

from labkit.cli import main
from labkit.experiments.profiles import Profile
from labkit.experiments.target import Target, TargetError
from labkit.experiments.target_cli import measure_target
from labkit.experiments.target_probe import connect, quirks_table


@pytest.fixture(scope="module")
def stub_url():
    with uvicorn_in_thread(quirky_stub()) as url:
        yield url


@pytest.fixture
def out(tmp_path, monkeypatch):
    monkeypatch.setenv("LABKIT_OUT", str(tmp_path))
    return tmp_path


def answers(target: Target) -> dict[str, str]:
    return dict(quirks_table(target).itertuples(index=False))


def test_the_probe_reports_no_done_no_usage_and_finds_min_tokens(stub_url) -> None:
    target = connect(stub_url)
    quirks = target.quirks
    assert target.model == STUB_MODEL and quirks.models == (STUB_MODEL,)
    assert not quirks.sends_done and not quirks.usage_when_asked and not quirks.usage_unasked
    assert quirks.stream_options_accepted and quirks.stream_options == "ignored (no usage either way)"
    assert quirks.eos_reached_without_flag
    assert quirks.eos_flags["ignore_eos"].startswith("refused (HTTP 400: Unrecognized request argument")
    assert quirks.eos_flags["min_tokens"] == "works (ran past eos)" and quirks.eos_flag == "min_tokens"
    table = answers(target)
    assert table["ends streams with data: [DONE]"] == "no"
    assert table["usage in streams with stream_options.include_usage"] == "no"
    assert table["used to ignore eos"] == "min_tokens"
    assert table["labkit internals (GET /stats block counts)"] == "not available"


def test_overlap_against_the_stub_completes_with_every_round(stub_url, out) -> None:
    tables = measure_target("overlap", connect(stub_url), Profile("ci"), levels=(1, 2), max_tokens=5)
    runs, levels = tables["runs"], tables["levels"]
    assert list(runs.level) == [1, 2] * 3  # interleaved: every level once per round
    assert runs.errors.sum() == 0 and runs.short_streams.sum() == 0
    assert (runs.tokens == runs.level * 5).all()
    assert list(levels.streams) == [1, 2] and (levels.rounds == 3).all()
    assert set(tables["unavailable"].status) == {"not available"}


def test_the_command_line_prints_the_quirks_and_exits_zero(stub_url, out, capsys) -> None:
    assert main(["run", "wire", "--target", stub_url + "/v1"]) == 0
    printed = capsys.readouterr().out
    assert f"target {stub_url}, model {STUB_MODEL}" in printed
    assert "ends streams with data: [DONE]" in printed and "not available" in printed


def refusal(argv: list[str], capsys) -> str:
    assert main(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in captured.err, captured.err
    return lines[0]


def test_a_closed_port_is_refused_in_one_line(out, capsys) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    assert refusal(["run", "overlap", "--target", url], capsys) == f"labkit: target {url}: cannot connect (connection refused)"


def test_a_web_site_is_refused_as_not_an_openai_api(out, capsys) -> None:
    with uvicorn_in_thread(web_site()) as url:
        line = refusal(["run", "wire", "--target", url], capsys)
    assert line.startswith(f"labkit: target {url}: POST /v1/completions (stream) failed: HTTP 404")
    assert "not an OpenAI-compatible API?" in line


def test_a_server_whose_completions_fail_is_refused_with_its_message(out, capsys) -> None:
    with uvicorn_in_thread(broken_api()) as url:
        line = refusal(["run", "overlap", "--target", url], capsys)
    assert line == f"labkit: target {url}: POST /v1/completions (stream) failed: HTTP 500: CUDA out of memory"


def test_an_experiment_that_needs_the_lab_s_own_server_is_refused(out, capsys) -> None:
    assert "needs the lab's own server" in refusal(["run", "buffers", "--target", "http://127.0.0.1:9"], capsys)


@pytest.mark.parametrize("url, why", [("ftp://gpu-node:8000", "not an http"), ("gpu-node:8000", "not an http")])
def test_a_url_that_is_not_http_is_refused(url: str, why: str) -> None:
    with pytest.raises(TargetError, match=why):
        Target(url)


def test_remote_urls_are_kept_as_given_without_the_v1_suffix() -> None:
    """No connection is made here: remote hosts are only named, the tests' traffic stays on loopback."""
    target = Target("https://gpu-node-3.cluster.example:8000/v1/", model="meta-llama/Llama-3.1-70B", api="openai-chat")
    assert target.url == "https://gpu-node-3.cluster.example:8000"
    assert target.path == "/v1/chat/completions"
    assert target.body("hi", 4)["messages"] == [{"role": "user", "content": "hi"}]


@pytest.mark.slow
def test_the_labkit_process_exits_non_zero_without_a_traceback(out) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    done = subprocess.run([sys.executable, "-m", "labkit.cli", "run", "wire", "--target", url], check=False, cwd=REPO,
                          capture_output=True, text=True, timeout=120, env={"PYTHONPATH": str(REPO), "PATH": ""})
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip() == f"labkit: target {url}: cannot connect (connection refused)"


@pytest.mark.slow
@pytest.mark.parametrize("stops, verdict", [(True, "stopped generating"),
                                            (False, "kept generating after the client left")])
def test_disconnect_tells_a_server_that_stops_from_one_that_carries_on(stops: bool, verdict: str, out) -> None:
    """No pid here: the witness is a follow-up request's pace, which abandoned streams slow down."""
    with uvicorn_in_thread(BatchingStub(stops_on_disconnect=stops).app()) as url:
        tables = measure_target("disconnect", connect(url), Profile("ci"), streams=4, max_tokens=300, hold_s=0.4,
                                window_s=0.1, follow_up_tokens=8, repetitions=3)
    verdicts = tables["verdicts"].set_index("leave_by")
    assert list(verdicts.index) == ["fin", "rst"]
    assert (verdicts.witness == "follow-up latency").all(), verdicts
    assert (verdicts.verdict == verdict).all(), tables["runs"].T


def test_levels_from_the_command_line_may_exceed_the_prompt_set(stub_url, out) -> None:
    assert main(["run", "overlap", "--target", stub_url, "--levels", "1,40"]) == 0
    runs = pd.read_csv(out / "data" / "target-overlap" / "runs.csv")
    assert list(runs.level) == [1, 40] * 3 and runs.errors.sum() == 0


@pytest.mark.parametrize("levels", ["4,16", "1,x"])
def test_bad_levels_are_refused_before_connecting(levels: str, out, capsys) -> None:
    line = refusal(["run", "overlap", "--target", "http://127.0.0.1:9", "--levels", levels], capsys)
    assert "levels" in line


def test_an_event_stream_that_is_not_openai_s_is_refused(out, capsys) -> None:
    """Right media type, wrong content: events without ``choices`` are not completion chunks."""
    from starlette.applications import Starlette
    from starlette.responses import Response
    from starlette.routing import Route

    async def other(request) -> Response:
        return Response(b"event: token\ndata: {\"text\": \"hi\"}\n\n", media_type="text/event-stream")

    with uvicorn_in_thread(Starlette(routes=[Route("/v1/completions", other, methods=["POST"])])) as url:
        line = refusal(["run", "wire", "--target", url], capsys)
    assert line == f"labkit: target {url}: POST /v1/completions streamed no completion chunks (not an OpenAI stream?)"


def test_a_model_the_target_does_not_serve_is_refused_with_the_ones_it_lists(stub_url, out, capsys) -> None:
    line = refusal(["run", "wire", "--target", stub_url, "--model", "llama-70b"], capsys)
    assert line == (f"labkit: target {stub_url}: POST /v1/completions (stream) failed: HTTP 404: "
                    f"The model `llama-70b` does not exist.; GET /v1/models lists: {STUB_MODEL}")


def test_a_target_behind_a_key_is_refused_without_it_and_measured_with_it(out, capsys, monkeypatch) -> None:
    monkeypatch.setenv("STUB_KEY", "s3cret")
    with uvicorn_in_thread(quirky_stub(api_key="s3cret")) as url:
        line = refusal(["run", "wire", "--target", url], capsys)
        assert main(["run", "wire", "--target", url, "--api-key-env", "STUB_KEY"]) == 0
    assert line == f"labkit: target {url}: POST /v1/completions (stream) failed: HTTP 401: Incorrect API key provided."
    assert "s3cret" not in capsys.readouterr().out
    assert "s3cret" not in (out / "data" / "target-wire" / "results.json").read_text()


def test_an_unset_key_variable_is_refused(out, capsys) -> None:
    line = refusal(["run", "wire", "--target", "http://127.0.0.1:9", "--api-key-env", "NO_SUCH_VARIABLE_HERE"], capsys)
    assert line == "labkit: target http://127.0.0.1:9: --api-key-env NO_SUCH_VARIABLE_HERE: that environment variable is not set"
