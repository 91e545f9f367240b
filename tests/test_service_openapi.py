"""The OpenAPI schema says what the service does, and a schema-driven fuzz holds the two together.

schemathesis reads ``/openapi.json`` from a real server on 127.0.0.1 and sends what it generates
from it, valid bodies and invalid ones, a bounded number per operation; every answer must be
documented (status, content type, body schema) and none may be a 5xx. The lab's own ``/lab``
routes are left out: they are a measuring device, mounted on request, and ``/lab/flood`` sends
whatever it is asked to.
"""
from __future__ import annotations

from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode, checks
from service_helpers import TIMEOUT

CHECKS = [checks.not_a_server_error, checks.status_code_conformance, checks.content_type_conformance,
          checks.response_schema_conformance]
WITH_INPUT = ["POST /v1/stream", "POST /v1/generate", "POST /v1/completions", "POST /v1/chat/completions",
              "GET /v1/streams/{request_id}/events"]
WITHOUT_INPUT = ["GET /v1/models", "GET /stats", "GET /healthz", "GET /health", "HEAD /healthz", "HEAD /health",
                 "GET /metrics"]


@pytest.fixture(scope="module")
def server_settings() -> dict[str, Any]:
    # A 128-token cache and 16 tokens for a chat that names no limit: any request that fits is
    # short, so the fuzz stays fast; one that does not is a documented 422.
    # The schema is served only when asked for (docs).
    return {"block_size": 16, "num_blocks": 8, "max_batch": 2, "default_max_tokens": 16, "docs": True}


@pytest.fixture(scope="module")
def api_schema(server: Any) -> Any:
    return schemathesis.openapi.from_url(server.url + "/openapi.json")


@pytest.fixture(scope="module")
def spec(server: Any) -> dict[str, Any]:
    return httpx.get(server.url + "/openapi.json", timeout=TIMEOUT).json()


def test_every_operation_but_the_lab_routes_is_fuzzed(api_schema: Any) -> None:
    labels = {result.ok().label for result in api_schema.get_all_operations()}
    assert {label for label in labels if " /lab/" not in label} == set(WITH_INPUT + WITHOUT_INPUT)


# Valid inputs (positive) exercise serving; invalid ones (negative) exercise the refusals.
@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
@pytest.mark.parametrize("label", WITH_INPUT + WITHOUT_INPUT)
def test_every_answer_is_documented_and_none_is_a_server_error(api_schema: Any, label: str,
                                                               mode: GenerationMode) -> None:
    if label in WITHOUT_INPUT and mode is GenerationMode.NEGATIVE:
        pytest.skip("nothing to make invalid")
    operation = api_schema.find_operation_by_label(label)

    @given(case=operation.as_strategy(mode))
    @settings(max_examples=12, deadline=None, phases=[Phase.explicit, Phase.generate],
              suppress_health_check=list(HealthCheck))
    def fuzz(case: Any) -> None:
        case.call_and_validate(checks=CHECKS, timeout=TIMEOUT)

    fuzz()


def body_schema(spec: dict[str, Any], path: str) -> dict[str, Any]:
    ref = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    return spec["components"]["schemas"][ref.rsplit("/", 1)[1]]


def test_the_schema_states_what_the_routes_refuse(spec: dict[str, Any]) -> None:
    generate = body_schema(spec, "/v1/generate")
    assert "resumable" not in generate["properties"] and "resumable" in body_schema(spec, "/v1/stream")["properties"]
    assert generate["properties"]["prompt"]["minLength"] == 1
    tools = body_schema(spec, "/v1/chat/completions")["properties"]["tools"]
    assert [branch.get("maxItems") for branch in tools["anyOf"] if branch["type"] == "array"] == [0], tools


@pytest.mark.parametrize("path, method, statuses", [
    ("/v1/stream", "post", {"200", "413", "415", "422", "429", "503"}),
    ("/v1/generate", "post", {"200", "413", "415", "422", "429", "503"}),
    ("/v1/completions", "post", {"200", "413", "415", "422", "429", "503"}),
    ("/v1/chat/completions", "post", {"200", "413", "415", "422", "429", "503"}),
    ("/v1/streams/{request_id}/events", "get", {"200", "204", "404", "410", "422"}),
    ("/healthz", "get", {"200", "503"}),
    ("/health", "get", {"200", "503"}),
])
def test_every_status_a_route_answers_is_documented_with_the_envelope(
        spec: dict[str, Any], path: str, method: str, statuses: set[str]) -> None:
    responses = spec["paths"][path][method]["responses"]
    assert set(responses) == statuses
    for status in statuses - {"200", "204"}:
        assert responses[status]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/ErrorBody"}


def test_streams_and_metrics_are_documented_with_their_content_types(spec: dict[str, Any]) -> None:
    def types(path: str, method: str) -> set[str]:
        return set(spec["paths"][path][method]["responses"]["200"]["content"])

    assert types("/v1/stream", "post") == {"text/event-stream; charset=utf-8"}
    assert types("/v1/streams/{request_id}/events", "get") == {"text/event-stream; charset=utf-8"}
    assert types("/v1/chat/completions", "post") == {"application/json", "text/event-stream; charset=utf-8"}
    assert types("/metrics", "get") == {"text/plain"}
