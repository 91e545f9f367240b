"""The engine and the server on a CUDA device, through torch's ops (the kernels are CPU-only).

Why: the notebooks could not be pointed at a GPU. ``EngineConfig(device="cuda")`` and
``serve_in_thread(..., device="cuda")`` exist; these tests say they run there, that ``auto``
takes the torch path on CUDA and says so, and that a request's greedy tokens still do not depend
on its neighbours. They skip on a machine where torch sees no CUDA device.
"""

from __future__ import annotations

import httpx
import pytest
import torch
from engine_helpers import PROMPTS, drain, make_engine
from service_helpers import TIMEOUT, lab_server, sse_post, tokens_of

from labkit import default_device
from labkit.machine import pin_threads

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (torch sees none here)")


def test_on_cuda_auto_takes_torchs_ops_and_says_why(tiny_llama) -> None:
    assert default_device() == "cuda"
    runner = make_engine(tiny_llama, device="cuda").runner
    assert runner.attention.mode == "gather" and "CPU-only; device is cuda" in runner.attention.reason
    assert runner.matmul.mode == "library" and "CPU-only; device is cuda" in runner.matmul.reason
    assert not runner.network.native_ops and runner.pool.kv.is_cuda
    with pytest.raises(ValueError, match="CPU-only"):
        make_engine(tiny_llama, device="cuda", attention="kernel")


@pytest.mark.parametrize("model", ["tiny_gpt2", "tiny_llama"])
def test_on_cuda_concurrent_requests_each_equal_their_solo_run(model: str, request: pytest.FixtureRequest) -> None:
    loaded = request.getfixturevalue(model)
    prompts = PROMPTS[:8]
    alone = {}
    for prompt in prompts:
        engine = make_engine(loaded, device="cuda")
        rid = engine.submit(prompt, max_new_tokens=8, ignore_eos=True)
        alone[prompt] = drain(engine)[rid].tokens
    engine = make_engine(loaded, device="cuda")
    rids = {engine.submit(p, max_new_tokens=8, ignore_eos=True): p for p in prompts}
    together = drain(engine)
    for rid, prompt in rids.items():
        assert together[rid].tokens == alone[prompt] and len(alone[prompt]) == 8, prompt


def test_a_stream_is_served_from_cuda(tiny_gpt2) -> None:
    said = pin_threads("cuda")
    assert "left at" in said
    with lab_server(tiny_gpt2, device="cuda") as server:
        assert server.engine.runner.device.type == "cuda"
        with httpx.Client(base_url=server.url, timeout=TIMEOUT) as client:
            body = {"prompt": PROMPTS[0], "max_new_tokens": 8, "ignore_eos": True}
            response, events = sse_post(client, "/v1/stream", body)
    assert response.status_code == 200
    assert events[0][0] == "start" and events[-1][0] == "done" and len(tokens_of(events)) == 8
