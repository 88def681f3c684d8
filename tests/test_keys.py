"""The trust boundary on every path: each route of the app's own route table, on the inference, management and
observability ports, refuses a missing key, a wrong one and a hashed entry's own text, under plain, hashed and
mixed key sets; only the routes meant to be open (the probes, /health, /metrics, the docs, skip_paths) answer
without one."""

from __future__ import annotations

import re

import httpx
import pytest

from config.keys import hash_key
from harness.clients import openai_client
from harness.configs import coordinator_config, instance
from harness.coordinator import Coordinator
from tests.conftest import MODEL

MGMT_HEADER = "X-Motor-Management-Key"
ANTHROPIC = {"anthropic-version": "2023-06-01"}  # /v1/models reads x-api-key only for an Anthropic client
# Routes meant to take no key, by path: the Kubernetes probes, the scrape, the status page, the API's documentation.
OPEN = {
    "/startup",
    "/liveness",
    "/readiness",
    "/health",
    "/metrics",
    "/",
    "/status.json",
    "/docs",
    "/docs/openapi.json",
    "/docs/redoc",
}

KEY, MGMT_KEY = "sk-client-1", "m-operator-1"
KEY_HASHED, MGMT_HASHED = hash_key(KEY, iterations=1000), hash_key(MGMT_KEY, iterations=1000)
OTHER, MGMT_OTHER = "sk-client-2", "m-operator-2"  # the mixed set's plain keys
KEY_SETS = {
    "plain": ([KEY], [MGMT_KEY], set()),
    "hashed": ([KEY_HASHED], [MGMT_HASHED], set()),
    "mixed": ([KEY_HASHED, OTHER], [MGMT_HASHED, MGMT_OTHER], {"/v1/models", "/instances"}),
}


def keys_section(valid: list[str], skip: set[str]) -> dict:
    return {"enable_api_key": True, "valid_keys": valid, "skip_paths": sorted(skip)}


def concrete(path: str) -> str:
    """A URL path for a route's pattern: each parameter (`<response_id:str>`, `<model:path>`) a sample value."""
    return re.sub(r"<[^>]+>", "resp_x", path)


def presenting(plane: str, key: str) -> list[dict]:
    """The ways a client presents `key` on a port: the configured header, and on the inference port x-api-key."""
    if plane == "infer":
        return [{"Authorization": f"Bearer {key}"}, {"x-api-key": key, **ANTHROPIC}]
    return [{MGMT_HEADER: key}]


@pytest.mark.parametrize("key_set", list(KEY_SETS))
def test_every_route_refuses_a_missing_or_wrong_key_and_a_hashed_entrys_text(key_set):
    valid, mgmt_valid, skip = KEY_SETS[key_set]
    # Its one engine does not resolve: a key let in shows as anything but 401. Loopback is not an engine's
    # address, so /v1/metaserver asks this caller for a key as well.
    cfg = coordinator_config(
        [instance(1, "union", MODEL, "union-0.invalid:8000")],
        api_key_config=keys_section(valid, skip & {"/v1/models"}),
        mgmt_api_key_config=keys_section(mgmt_valid, skip & {"/instances"}),
    )
    with Coordinator(cfg) as coord, httpx.Client(timeout=30) as http:
        routes = coord.routes()
        base = {"infer": coord.url, "mgmt": coord.mgmt, "obs": coord.obs}
        assert {plane for _, _, plane in routes} == set(base)
        keyed = [(m, p, plane) for m, p, plane in routes if p not in OPEN | skip]
        assert len(keyed) >= 11  # the inference routes and /instances* at least (the table was read)

        def ask(method: str, path: str, plane: str, headers: dict) -> httpx.Response:
            body = {"json": {}} if method == "POST" else {}
            return http.request(method, base[plane] + concrete(path), headers=headers, **body)

        for method, path, plane in routes:
            good, hashed = (valid, KEY_HASHED) if plane == "infer" else (mgmt_valid, MGMT_HASHED)
            wrong = [{}, *presenting(plane, "totally-wrong")]
            if hashed in good:
                wrong += presenting(plane, hashed)  # the stored hash is no key
            for headers in wrong:
                r = ask(method, path, plane, headers)
                where = (key_set, method, path, headers)
                if path in OPEN | skip:
                    assert r.status_code == 200, (where, r.status_code, r.text[:200])
                    # An open route shows no key, nor a hashed entry's text.
                    assert not any(k in r.text for k in (*valid, *mgmt_valid, KEY, MGMT_KEY)), where
                    continue
                assert r.status_code == 401, (where, r.status_code, r.text[:200])
                assert r.headers["www-authenticate"] == "Bearer", where
                refusal = r.json()
                if plane == "infer":  # the OpenAI or Anthropic envelope
                    assert refusal["error"]["type"] == "authentication_error", where
                else:  # MindIE-PyMotor's management answer
                    assert refusal["status"] == "failed", where
            if path in OPEN | skip:
                continue
            for key in [{KEY_HASHED: KEY, MGMT_HASHED: MGMT_KEY}.get(k, k) for k in good]:
                r = ask(method, path, plane, presenting(plane, key)[0])
                assert r.status_code != 401, (key_set, method, path, key, r.text[:200])


def test_a_wrong_key_reaches_no_stored_response(sims):
    """With a hashed key configured, a wrong key (or the hash itself) neither reads, deletes nor cancels a
    stored response: nothing reaches the engine that holds it."""
    u = sims("union")
    cfg = coordinator_config(
        [instance(1, "union", MODEL, u.address)],
        api_key_config=keys_section([KEY_HASHED], set()),
    )
    with Coordinator(cfg) as coord:
        stored = openai_client(coord, key=KEY).responses.create(model=MODEL, input="keep me", max_output_tokens=2)
        before = len(u.requests())
        for wrong in ("totally-wrong", KEY_HASHED):
            for method, tail in (("GET", ""), ("DELETE", ""), ("POST", "/cancel")):
                r = httpx.request(
                    method, f"{coord.url}/v1/responses/{stored.id}{tail}", headers={"Authorization": f"Bearer {wrong}"}
                )
                assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", (method, tail)
        assert len(u.requests()) == before
        again = openai_client(coord, key=KEY).responses.retrieve(stored.id)
        assert again.id == stored.id and again.output_text == stored.output_text
