"""schemathesis against the live Coordinator's /docs/openapi.json: the document is valid, and every answer is
the one it documents.

One Coordinator with API keys on serves a union model and a PD model (simulator engines on loopback, zero
latency, short contexts so that any max_tokens stays quick). Each documented operation gets a fixed,
derandomized set of cases (valid and invalid bodies and headers); every answer must be no 5xx, a documented
status with a documented content type and a body that fits its schema, and a route that declares a key
must refuse the same call without one or with a wrong one.
"""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings  # (schemathesis brings hypothesis)
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    ignored_auth,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from config import ApiKeyConfig
from handlers.docs import ANTHROPIC_KEY, EXAMPLE_MODEL, OPENAI_KEY, security_schemes
from harness.configs import api_keys, coordinator_config, instance
from harness.coordinator import Coordinator

UNION, PD = "fuzz-union", "fuzz-pd"
KEY = "sk-fuzz-0123456789"
BOUNDED = {"n": 4, "logprobs": 5, "top_logprobs": 5}  # (see test_every_answer_is_documented)
EXAMPLES = 60  # per operation; with schemathesis's own coverage cases and key probes, about 300 calls each
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    ignored_auth,
]
STREAMING = ("/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/metaserver", "/v1/responses")

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def coordinator(module_sims):
    kw = {"zero_latency": True, "max_model_len": 256}
    u = module_sims("union", model=UNION, **kw)
    p, d = module_sims("prefill", model=PD, **kw), module_sims("decode", model=PD, **kw)
    instances = [
        instance(1, "union", UNION, u.address),
        instance(2, "prefill", PD, p.address),
        instance(3, "decode", PD, d.address),
    ]
    with Coordinator(coordinator_config(instances, api_key_config=api_keys(KEY))) as coord:
        yield coord


@pytest.fixture(scope="module")
def api(coordinator):
    return schemathesis.openapi.from_url(coordinator.url + "/docs/openapi.json")


@pytest.fixture(scope="module")
def spec(coordinator) -> dict:
    return httpx.get(coordinator.url + "/docs/openapi.json").json()


schema = schemathesis.pytest.from_fixture("api")


def _served(name: object) -> object:
    """The document's examples ask for the PD model; a generated model name is made one of the served ones
    two times in three (the third stays unknown: a 404)."""
    if name == EXAMPLE_MODEL:
        return PD
    if not isinstance(name, str):
        return name
    return (UNION, PD, name)[len(name) % 3]


@schema.parametrize()
@settings(
    max_examples=EXAMPLES, derandomize=True, database=None, deadline=None, suppress_health_check=list(HealthCheck)
)
def test_every_answer_is_documented(case, coordinator):
    if isinstance(case.body, dict):
        if "model" in case.body:
            case.body["model"] = _served(case.body["model"])
        # The simulator does real work per sequence and per top logprob, and bounds neither as vLLM bounds
        # logprobs (max_logprobs): a generated n of 90,000 or logprobs of 10**9 would keep it busy past its
        # health checks. What an engine does with them is not the document's to say.
        for name, most in BOUNDED.items():
            if type(case.body.get(name)) is int and case.body[name] > most:
                case.body[name] = most
    if case.path_parameters and "model" in case.path_parameters:
        case.path_parameters["model"] = _served(case.path_parameters["model"])
    case.call_and_validate(
        base_url=coordinator.url, headers={"Authorization": f"Bearer {KEY}"}, checks=CHECKS, timeout=30
    )


def test_the_document_is_valid_openapi(api):
    api.validate()  # against the OpenAPI 3.0 meta-schema; raises on the first fault


def test_each_route_declares_the_keys_it_takes(spec):
    assert spec["components"]["securitySchemes"] == security_schemes(ApiKeyConfig())
    assert spec["components"]["securitySchemes"][OPENAI_KEY]["scheme"] == "bearer"
    assert spec["components"]["securitySchemes"][ANTHROPIC_KEY]["name"] == "x-api-key"
    security = {path: op["security"] for path, ops in spec["paths"].items() for op in ops.values()}
    openai_key, anthropic_key = {OPENAI_KEY: []}, {ANTHROPIC_KEY: []}
    assert security == {
        "/v1/chat/completions": [openai_key],
        "/v1/completions": [openai_key],
        "/v1/models": [openai_key],
        "/v1/models/{model}": [openai_key],
        "/v1/messages": [openai_key, anthropic_key],
        "/v1/messages/count_tokens": [openai_key, anthropic_key],
        "/v1/metaserver": [openai_key, {}],  # an engine's call needs no key
        "/v1/responses": [openai_key],
        "/v1/responses/{response_id}": [openai_key],
        "/v1/responses/{response_id}/cancel": [openai_key],
        "/tokenize": [openai_key],
        "/detokenize": [openai_key],
    }


def test_a_configured_key_header_is_an_api_key_scheme():
    cfg = ApiKeyConfig(enable_api_key=True, valid_keys=["k"], header_name="X-Api-Token", key_prefix="")
    assert security_schemes(cfg)[OPENAI_KEY] == {
        "type": "apiKey",
        "in": "header",
        "name": "X-Api-Token",
        "description": "api_key_config.valid_keys, in X-Api-Token",
    }
    cfg = ApiKeyConfig(enable_api_key=True, valid_keys=["k"], key_prefix="Token ")
    assert security_schemes(cfg)[OPENAI_KEY]["name"] == "Authorization"


def test_without_keys_no_route_declares_one(union_cluster):
    spec = httpx.get(union_cluster.url + "/docs/openapi.json").json()
    assert "securitySchemes" not in spec.get("components", {})
    assert not [path for path, ops in spec["paths"].items() for op in ops.values() if op.get("security")]


def test_answers_are_documented_with_what_they_always_carry(spec):
    def ok(path: str, method: str = "post") -> dict:
        return spec["paths"][path][method]["responses"]["200"]["content"]

    for path in STREAMING:
        assert "text/event-stream" in ok(path), path
    assert set(ok("/v1/models/{model}", "get")) == {"application/json"}
    chat = ok("/v1/chat/completions")["application/json"]["schema"]
    assert {"id", "object", "created", "model", "choices", "usage"} <= set(chat["required"])
    usage = chat["properties"]["usage"]
    assert usage["properties"]["prompt_tokens_details"]["nullable"] is True
    assert usage["properties"]["prompt_tokens_details"]["additionalProperties"]["nullable"] is True  # vLLM's nulls
    message = ok("/v1/messages")["application/json"]["schema"]
    assert {"id", "type", "role", "model", "content", "stop_reason", "usage"} <= set(message["required"])
    error = spec["paths"]["/v1/chat/completions"]["post"]["responses"]["400"]["content"]["application/json"]
    code = error["schema"]["properties"]["error"]["properties"]["code"]
    assert code["nullable"] is True and code["anyOf"] == [{"type": "string"}, {"type": "integer"}]
