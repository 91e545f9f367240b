"""A target is probed, not named: what it does differently is found by asking, what it cannot
witness is said, and one that cannot be measured is refused in one line with exit status 2."""
from __future__ import annotations

import re
import subprocess
import sys

import httpx
import pytest
from target_helpers import REPO, STUB_MODEL, broken_api, free_port, quirky_stub, uvicorn_in_thread, web_site

from labkit.cli import main
from labkit.lab import LocalLab, NotMeasurable, Process, Target, TargetError, connect, quirks_table, run
from labkit.lab.profiles import Profile


@pytest.fixture(scope="module")
def stub_url():
    with uvicorn_in_thread(quirky_stub()) as url:
        yield url


@pytest.fixture
def out(tmp_path, monkeypatch):
    monkeypatch.setenv("LABKIT_OUT", str(tmp_path))
    return tmp_path


def refusal(argv: list[str], capsys) -> str:
    assert main(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in captured.err, captured.err
    return lines[0]


def test_the_probe_reports_no_done_no_usage_and_finds_min_tokens(stub_url):
    target = connect(stub_url)
    q = target.quirks
    assert target.model == STUB_MODEL and q.models == (STUB_MODEL,)
    assert not q.sends_done and not q.usage_when_asked and not q.usage_unasked and q.stream_options_accepted
    assert q.eos_flags["ignore_eos"].startswith("refused (HTTP 400: Unrecognized request argument")
    assert q.eos_flags["min_tokens"] == "works (ran past eos)" and q.eos_flag == "min_tokens"
    answers = dict(quirks_table(target).itertuples(index=False))
    assert answers["used to ignore eos"] == "min_tokens"
    assert answers["witness: lab"].startswith("no: it has no lab routes")
    assert target.request("hi", 9).body["min_tokens"] == 9


def test_requests_are_built_in_the_target_s_dialect():
    chat = Target("https://gpu-node-3.cluster.example:8000/v1/", model="llama", api="openai-chat")
    assert chat.url == "https://gpu-node-3.cluster.example:8000"  # named only: no traffic leaves loopback
    request = chat.request("hi", 4)
    assert request.path == "/v1/chat/completions" and request.body["messages"] == [{"role": "user", "content": "hi"}]
    assert request.body["model"] == "llama" and request.body["ignore_eos"] is True
    native = Target("http://127.0.0.1:1", api="labkit").request("hi", 4, ignore_eos=False, seed=3)
    assert (native.path, native.body) == ("/v1/stream", {"prompt": "hi", "max_new_tokens": 4, "ignore_eos": False, "seed": 3})


def test_a_resume_request_carries_the_stream_s_token_and_its_last_id():
    from labkit.lab.stream import Stream, TimedEvent

    stream = Stream(request_id="req-1", last_event_id="7")
    stream.add(TimedEvent(0.0, 10, "start", "1", '{"request_id": "req-1", "resume_token": "secret"}'))
    target = Target("http://127.0.0.1:1", api="labkit", api_key="key")
    request = target.resume_request(stream)
    assert (request.method, request.path, request.body) == ("GET", "/v1/streams/req-1/events", None)
    assert request.headers == {"Authorization": "Bearer key", "Last-Event-ID": "7", "X-Resume-Token": "secret"}
    assert target.resume_request(stream, after="3").headers["Last-Event-ID"] == "3"


@pytest.mark.parametrize("url", ["ftp://gpu-node:8000", "gpu-node:8000"])
def test_a_url_that_is_not_http_is_refused(url):
    with pytest.raises(TargetError, match="not an http"):
        Target(url)


def test_a_remote_target_refuses_settings_by_name_and_reason():
    with pytest.raises(NotMeasurable, match="its settings are fixed"):
        Target("http://127.0.0.1:1").variant(policy="drop")


def test_a_local_lab_shares_its_model_with_its_variants_and_stops_them(tiny_gpt2):
    with LocalLab(tiny_gpt2) as lab:
        assert lab.variant(max_batch=lab.server.config.engine.max_batch) is lab
        other = lab.variant(policy="drop")
        assert other is not lab and other.loaded is lab.loaded and other.variant(policy="drop") is other
        assert lab.read(lab.request("hello", 3)).tokens == 3 and other.read(other.request("hello", 3)).ok
    assert lab._context is None and other._context is None


@pytest.mark.slow
def test_labkit_in_its_own_process_is_probed_restarted_and_stopped():
    target = Process.labkit("tiny-gpt2")
    try:
        assert target.caps.cpu and target.caps.lab and target.caps.restart and not target.caps.engine
        first = target.read(target.request("hello", 4))
        assert first.ok and first.tokens == 4 and target.cpu_seconds() > 0
        target.restart()
        assert target.read(target.request("hello", 4)).token_ids == first.token_ids
        probed = connect(target.url)
        assert probed.caps.stats and probed.caps.lab and probed.caps.metrics and probed.quirks.sends_done
        # labkit serve froze its startup heap (the model, torch's modules): no full collection walks it
        frozen = re.search(r"^python_gc_frozen_objects (\S+)$", httpx.get(target.url + "/metrics").text, re.M)
        assert frozen and float(frozen.group(1)) > 50_000
    finally:
        assert target.stop() == 0


def test_an_experiment_runs_against_a_target_without_a_step_log(stub_url, out):
    from labkit.experiments import overlap

    result = run(overlap.LEVELS, connect(stub_url), profile=Profile("ci"), show=False, levels=(1, 2), tokens=5)
    rows = result.table()
    assert list(rows.level) == [1, 2] * 3 and rows.failed.sum() == 0 and (rows.tokens == rows.level * 5).all()
    assert "steps" not in rows and [v.name for v in result.verdicts if v.checked] == ["every stream whole"]
    assert (out / "data" / "target-overlap" / "levels" / "results.json").exists()


def test_the_command_line_prints_the_quirks_and_exits_zero(stub_url, out, capsys):
    assert main(["run", "overlap.levels", "--target", stub_url + "/v1", "--set", "levels=(1, 2)", "--set", "tokens=4"]) == 0
    printed = capsys.readouterr().out
    assert f"target {stub_url}, model {STUB_MODEL}" in printed and "ends streams with data: [DONE]" in printed


def test_a_closed_port_is_refused_in_one_line(out, capsys):
    url = f"http://127.0.0.1:{free_port()}"
    assert refusal(["run", "overlap", "--target", url], capsys) == f"labkit: target {url}: cannot connect (connection refused)"


def test_a_web_site_is_refused_as_not_an_openai_api(out, capsys):
    with uvicorn_in_thread(web_site()) as url:
        line = refusal(["run", "overlap", "--target", url], capsys)
    assert line.startswith(f"labkit: target {url}: POST /v1/completions (stream) failed: HTTP 404")
    assert line.endswith("not an OpenAI-compatible API?")


def test_a_server_whose_completions_fail_is_refused_with_its_message(out, capsys):
    with uvicorn_in_thread(broken_api()) as url:
        line = refusal(["run", "overlap", "--target", url], capsys)
    assert line == f"labkit: target {url}: POST /v1/completions (stream) failed: HTTP 500: CUDA out of memory"


def test_what_needs_labkit_s_engine_is_refused_by_name_and_reason(stub_url, out, capsys):
    line = refusal(["run", "overlap.step_cost", "--target", stub_url], capsys)
    assert line == "labkit: overlap.step_cost needs labkit's own server: its engine is not in this process (a LocalLab only)"


def test_a_run_whose_every_stream_failed_exits_2(out, capsys):
    """A server that answers the probe and then cuts every stream: the run must not exit 0."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    calls = {"n": 0}

    async def completions(request):
        calls["n"] += 1
        body = await request.json()

        async def chunks():
            yield b'data: {"choices": [{"index": 0, "text": "a", "finish_reason": null}]}\n\n'
            if calls["n"] <= 5:  # the probe's five requests end properly
                yield b'data: {"choices": [{"index": 0, "text": "", "finish_reason": "length"}]}\n\ndata: [DONE]\n\n'
            else:
                raise RuntimeError("cut")

        return StreamingResponse(chunks(), media_type="text/event-stream") if body.get("stream") else JSONResponse({})

    app = Starlette(routes=[Route("/v1/completions", completions, methods=["POST"])])
    with uvicorn_in_thread(app) as url:
        assert main(["run", "overlap.levels", "--target", url, "--set", "levels=(1, 2)"]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]  # after the progress bar and the stub's own log
    assert last.startswith(f"labkit: target {url}: every stream of overlap.levels failed (RemoteProtocolError")


def test_a_model_the_target_does_not_serve_is_refused(stub_url, out, capsys):
    line = refusal(["run", "overlap", "--target", stub_url, "--model", "llama-70b"], capsys)
    assert line == (f"labkit: target {stub_url}: POST /v1/completions (stream) failed: HTTP 404: "
                    f"The model `llama-70b` does not exist.")


def test_a_target_behind_a_key_is_refused_without_it_and_measured_with_it(out, capsys, monkeypatch):
    monkeypatch.setenv("STUB_KEY", "s3cret")
    args = ["run", "overlap.levels", "--set", "levels=(1,)", "--set", "tokens=3"]
    with uvicorn_in_thread(quirky_stub(api_key="s3cret")) as url:
        line = refusal([*args, "--target", url], capsys)
        assert main([*args, "--target", url, "--api-key-env", "STUB_KEY"]) == 0
    assert line == f"labkit: target {url}: POST /v1/completions (stream) failed: HTTP 401: Incorrect API key provided."
    assert "s3cret" not in capsys.readouterr().out
    assert "s3cret" not in (out / "data" / "target-overlap" / "levels" / "results.json").read_text()


def test_an_unknown_size_or_experiment_is_refused_before_connecting(out, capsys):
    assert "no size named 'levls'" in refusal(["run", "overlap.levels", "--set", "levls=1"], capsys)
    assert refusal(["run", "overlapp"], capsys).startswith("labkit: unknown experiment 'overlapp'")


@pytest.mark.slow
def test_the_labkit_process_exits_2_without_a_traceback(out):
    url = f"http://127.0.0.1:{free_port()}"
    done = subprocess.run([sys.executable, "-m", "labkit.cli", "run", "overlap", "--target", url], check=False,
                          cwd=REPO, capture_output=True, text=True, timeout=120, env={"PYTHONPATH": str(REPO), "PATH": ""})
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip() == f"labkit: target {url}: cannot connect (connection refused)"
