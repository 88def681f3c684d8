"""The x-ratelimit-* headers of error answers, through the real SDKs: a request its tenant's quota counted is told
the quota's levels whatever it is answered (an engine's 4xx relayed, the Coordinator's 502, 503 or 504 after
admission), on OpenAI's and Anthropic's routes, union and PD, as OpenAI tells them; an error before the quota is
taken tells none. The answers of a request served, and the quota's own refusals: tests/test_quotas.py."""

from __future__ import annotations

import re

import anthropic
import httpx
import openai
import pytest

from harness.clients import anthropic_client, openai_client
from harness.configs import api_keys, coordinator_config, instance
from harness.coordinator import Coordinator
from harness.loopback import free_port, wait_until
from tests.conftest import MODEL
from tests.test_quotas import RATELIMIT_HEADERS

KEY_Q, KEY_T, KEY_M, KEY_N = "sk-rlerr-q", "sk-rlerr-t", "sk-rlerr-m", "sk-rlerr-n"
RPM, TPM, TPM_T = 1000, 1_000_000, 6000
TPM_M = 10**12  # full again within a microsecond: each answer's remaining tokens are the quota less its reservation
PD = "qwen3-pd"
MODELS = {"union": MODEL, "pd": PD}  # served, by layout; "gone" and "gone-pd": their engines listen nowhere
GONE = {"union": "gone", "pd": "gone-pd"}
LONG = "many words " * 200  # 550 tokens, over the engines' max_model_len: their 400


@pytest.fixture(scope="module")
def coord(module_sims):
    short = {"max_model_len": 256}
    u = module_sims("union", **short)
    p, d = module_sims("prefill", model=PD, **short), module_sims("decode", model=PD, **short)
    cfg = coordinator_config(
        [
            instance(1, "union", MODEL, u.address),
            instance(2, "prefill", PD, p.address),
            instance(3, "decode", PD, d.address),
            instance(4, "union", "gone", f"127.0.0.1:{free_port()}"),
            instance(5, "prefill", "gone-pd", f"127.0.0.1:{free_port()}"),
            instance(6, "decode", "gone-pd", f"127.0.0.1:{free_port()}"),
        ],
        api_key_config=api_keys(KEY_N),
        # (a deadline of 1 s: an engine that never answers is a 504 after two attempts)
        exception_config={"retry_delay": 0.01, "max_retry": 1, "first_token_timeout": 1.0, "infer_timeout": 1.0},
        scheduler_config={"breaker_failure_threshold": 100},  # the engines' 5xx leave them schedulable
    )
    cfg["tenant_config"] = {
        "tenants": [
            {"name": "team-q", "keys": [KEY_Q], "rpm": RPM, "tpm": TPM},
            {"name": "team-t", "keys": [KEY_T], "tpm": TPM_T},
            {"name": "team-m", "keys": [KEY_M], "tpm": TPM_M},
        ]
    }
    with Coordinator(cfg) as c:

        def gone_are_down() -> bool:
            models = {m["id"]: m for m in httpx.get(c.url + "/v1/models", headers=auth(KEY_N)).json()["data"]}
            return all(models[m]["p_instances_num"] + models[m]["d_instances_num"] == 0 for m in GONE.values())

        assert wait_until(gone_are_down, timeout_s=15)
        c.engines = {"union": [u], "pd": [p, d]}
        yield c


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def ask(coord, route: str, key: str, model: str, content: str = "hi", max_tokens: int = 2, **kw):
    """(status, headers) of one request through the route's SDK: its answer's, or its error's."""
    messages = [{"role": "user", "content": content}]
    try:
        if route == "openai":
            raw = openai_client(coord, key).chat.completions.with_raw_response.create(
                model=model, messages=messages, max_tokens=max_tokens, **kw
            )
        else:
            raw = anthropic_client(coord, api_key=key).messages.with_raw_response.create(
                model=model, messages=messages, max_tokens=max_tokens, **kw
            )
    except (openai.APIStatusError, anthropic.APIStatusError) as e:
        return e.status_code, e.response.headers
    return raw.status_code, raw.headers


def quota_told(headers: httpx.Headers) -> list[tuple[str, str]]:
    return [(k, v) for k, v in headers.multi_items() if k.startswith("x-ratelimit-")]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("layout", ["union", "pd"])
@pytest.mark.parametrize("route", ["openai", "anthropic"])
@pytest.mark.parametrize(
    "failure,status",
    [("engine_400", 400), ("engines_fail", 502), ("no_engine", 503), ("engines_hang", 504)],
)
def test_an_admitted_requests_error_tells_its_quota(coord, failure, status, route, layout, stream):
    """The engine's 400 for a prompt over its context, relayed; every engine answering 500, the Coordinator's 502
    once its retry is spent; no engine up, its 503; no engine answering, its 504: each answer carries the six
    headers, each once, the request's own count among what they say is gone."""
    model, content = MODELS[layout], "hi"
    if failure == "engine_400":
        content = LONG
    elif failure == "no_engine":
        model = GONE[layout]
    else:
        fault = {"fail_status": 500} if failure == "engines_fail" else {"hang_before_first_byte": True}
        for engine in coord.engines[layout]:
            engine.set_faults(**fault)
    try:
        got, headers = ask(coord, route, KEY_Q, model, content, stream=stream)
    finally:
        for engine in coord.engines[layout]:
            engine.clear_faults()
    assert got == status
    told = quota_told(headers)
    assert sorted(k for k, _ in told) == sorted(RATELIMIT_HEADERS), told
    assert headers["x-ratelimit-limit-requests"] == str(RPM) and headers["x-ratelimit-limit-tokens"] == str(TPM)
    assert RPM - 100 <= int(headers["x-ratelimit-remaining-requests"]) < RPM
    assert TPM - 100_000 <= int(headers["x-ratelimit-remaining-tokens"]) < TPM
    for kind in ("requests", "tokens"):
        assert re.fullmatch(r"\d+ms|\d+(\.\d+)?s", headers[f"x-ratelimit-reset-{kind}"])


def test_an_errors_tokens_are_the_levels_its_admission_left(coord):
    """An error tells the levels its admission left, as its 200 would have: its reservation (its prompt's estimate and
    all of max_tokens, the tenant having no mean output yet) taken. The end gives back what no engine served, so the
    same request again finds the bucket as full as the first did, and is told the same."""
    first, second = (ask(coord, "openai", KEY_T, "gone", max_tokens=500) for _ in range(2))
    assert first[0] == second[0] == 503
    assert first[1]["x-ratelimit-limit-tokens"] == str(TPM_T) and "x-ratelimit-limit-requests" not in first[1]
    left = [int(headers["x-ratelimit-remaining-tokens"]) for _, headers in (first, second)]
    assert left[0] == left[1] <= TPM_T - 500 - 10, left  # (and its prompt's estimate: some 30 tokens)


def test_an_engines_error_leaves_its_tenants_output_reservation_as_it_was(coord):
    """A request reserves its tenant's mean output (what its answered requests were served). An engine's error relayed
    served no output, and says nothing of the tenant's usual one: the next request reserves what it would have
    without it. A request to a model no engine serves shows the reservation: refused at once, the bucket as full."""

    def reserved() -> int:
        status, headers = ask(coord, "openai", KEY_M, "gone", max_tokens=500)
        assert status == 503
        return TPM_M - int(headers["x-ratelimit-remaining-tokens"])

    assert ask(coord, "openai", KEY_M, MODEL, max_tokens=40, extra_body={"ignore_eos": True})[0] == 200
    before = reserved()
    assert before - 40 < 20, before  # its output's mean, 40, and the prompt's estimate
    for _ in range(4):
        assert ask(coord, "openai", KEY_M, MODEL, LONG, max_tokens=40)[0] == 400
    assert reserved() == before


def test_an_error_before_the_quota_is_taken_tells_none(coord):
    """A wrong key, a body that is no JSON, an x-priority that is no class, a model not served: refused before the
    tenant's quota is taken, so told nothing of it; the same key's next request is."""
    for key, route in ((KEY_Q + "-wrong", "openai"), (KEY_Q + "-wrong", "anthropic")):
        status, headers = ask(coord, route, key, MODEL)
        assert status == 401 and not quota_told(headers)
    status, headers = ask(coord, "openai", KEY_Q, MODEL, extra_headers={"x-priority": "urgent"})
    assert status == 400 and not quota_told(headers)
    status, headers = ask(coord, "anthropic", KEY_Q, MODEL, extra_headers={"x-priority": "urgent"})
    assert status == 400 and not quota_told(headers)
    for route in ("openai", "anthropic"):  # a model not served here
        status, headers = ask(coord, route, KEY_Q, "no-such-model")
        assert status == 404 and not quota_told(headers)
    r = httpx.post(
        coord.url + "/v1/chat/completions",
        content=b"{not json",
        headers={**auth(KEY_Q), "Content-Type": "application/json"},
    )
    assert r.status_code == 400 and not quota_told(r.headers)
    status, headers = ask(coord, "openai", KEY_Q, MODEL)
    assert status == 200 and len(quota_told(headers)) == 6
    # A tenant without a quota is told none, whatever its answer.
    status, headers = ask(coord, "openai", KEY_N, "gone")
    assert status == 503 and not quota_told(headers)
