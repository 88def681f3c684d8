"""Tenant quotas (tenant_config's rpm, tpm, max_inflight) through the real SDKs against a two-worker Coordinator:
exact under concurrent requests, OpenAI's 429 (and Anthropic's envelope on its routes) with Retry-After, the
x-ratelimit-* headers the SDKs read, one tenant's quota never another's, and the per-tenant metrics."""

from __future__ import annotations

import functools
import re
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import anthropic
import httpx
import openai
import pytest

from harness.clients import anthropic_client, openai_client
from harness.configs import api_keys, coordinator_config, instance
from harness.coordinator import Coordinator
from harness.loopback import wait_until
from serving.tenants import reset_text
from tests.conftest import MODEL

KEY_A, KEY_B, KEY_T, KEY_C = "sk-quota-a", "sk-quota-b", "sk-quota-t", "sk-quota-c"
KEY_S, KEY_K, KEY_BOTH = "sk-quota-s", "sk-quota-k", "sk-quota-both"
RPM, TPM, CAP = 20, 1000, 3
RATELIMIT_HEADERS = [
    f"x-ratelimit-{what}-{kind}" for kind in ("requests", "tokens") for what in ("limit", "remaining", "reset")
]


@pytest.fixture(scope="module")
def coord(module_sims):
    fast = module_sims("union")
    slow = module_sims("union", model="slow", speedup=1.0)  # 10 ms a token: 200 tokens hold a place 2 s
    cfg = coordinator_config(
        [instance(1, "union", MODEL, fast.address), instance(2, "union", "slow", slow.address)],
        inference_workers_config={"num_workers": 2},
        api_key_config=api_keys(KEY_B),
    )
    cfg["tenant_config"] = {
        "tenants": [
            {"name": "team-a", "keys": [KEY_A], "rpm": RPM},
            {"name": "team-t", "keys": [KEY_T], "tpm": TPM},
            {"name": "team-c", "keys": [KEY_C], "max_inflight": CAP},
            {"name": "team-s", "keys": [KEY_S], "tpm": TPM},
            {"name": "team-k", "keys": [KEY_K]},
            {"name": "team-both", "keys": [KEY_BOTH], "rpm": 1000, "tpm": 1_000_000},
        ]
    }
    with Coordinator(cfg, workers=2) as c:
        yield c


@functools.cache
def sdk_for(url: str, key: str) -> openai.OpenAI:
    """One SDK client per Coordinator and key, shared by the threads (making one per request cost a burst of 200
    some seconds of the test process's CPU)."""
    return openai_client(SimpleNamespace(url=url), key)


def chat(coord, key: str, model: str = MODEL, max_tokens: int = 2, whole: bool = False):
    """(status, the error body or None, the answer's headers) of one chat request through the openai SDK; `whole`:
    its output is all `max_tokens` (the simulator's `ignore_eos`)."""
    sdk = sdk_for(coord.url, key)
    try:
        raw = sdk.chat.completions.with_raw_response.create(
            model=model,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=max_tokens,
            extra_body={"ignore_eos": True} if whole else None,
        )
    except openai.RateLimitError as e:
        return 429, e.body, e.response.headers
    return 200, raw.parse(), raw.headers


def at_once(n: int, call):
    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(lambda _: call(), range(n)))


def test_rpm_is_exact_across_workers_under_concurrent_requests_and_costs_no_other_tenant(coord):
    started = time.monotonic()
    results = at_once(60, lambda: chat(coord, KEY_A))
    refill = int((time.monotonic() - started) * RPM / 60)  # what the bucket gained meanwhile (0 in 3 s)
    ok = [r for r in results if r[0] == 200]
    assert RPM <= len(ok) <= RPM + refill, len(ok)
    status, body, headers = next(r for r in results if r[0] == 429)
    assert body == {"message": body["message"], "type": "requests", "param": None, "code": "rate_limit_exceeded"}
    assert int(headers["retry-after"]) >= 1 and headers["x-ratelimit-limit-requests"] == str(RPM)
    assert headers["x-ratelimit-remaining-requests"] == "0"
    # The answers told the client its quota: what was left after each (all of 19..0 when nothing refilled).
    left = sorted(int(r[2]["x-ratelimit-remaining-requests"]) for r in ok)
    assert left == list(range(RPM)) if not refill else set(left) == set(range(RPM))
    assert all(re.fullmatch(r"\d+ms|\d+(\.\d+)?s|\d+m\d+(\.\d+)?s", r[2]["x-ratelimit-reset-requests"]) for r in ok)
    # Another tenant (the default one, no quota) is not refused, and its answers carry no quota headers.
    others = at_once(10, lambda: chat(coord, KEY_B))
    assert all(s == 200 for s, _, _ in others)
    assert all("x-ratelimit-limit-requests" not in h for _, _, h in others)


def test_max_inflight_is_exact_across_workers(coord):
    results = at_once(30, lambda: chat(coord, KEY_C, model="slow", max_tokens=200, whole=True))
    assert sum(s == 200 for s, _, _ in results) == CAP
    refused = [b for s, b, _ in results if s == 429]
    assert refused and all(b["code"] == "rate_limit_exceeded" and b["type"] == "requests" for b in refused)
    assert all(s == 200 for s, _, _ in at_once(CAP, lambda: chat(coord, KEY_C)))  # the places came back


def test_an_answer_tells_both_quotas_in_six_headers(coord):
    """A tenant with rpm and tpm: its JSON and streamed answers carry the six x-ratelimit-* headers, each once (they
    go out as one pre-formatted block: serving/tenants.py `_headers`), as the SDK reads them."""
    sdk = sdk_for(coord.url, KEY_BOTH)
    plain = sdk.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2
    ).headers
    with sdk.chat.completions.with_streaming_response.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2, stream=True
    ) as streamed:
        streamed_headers = streamed.headers
        assert sum(1 for _ in streamed.iter_lines()) > 2
    for headers in (plain, streamed_headers):
        got = [(k, v) for k, v in headers.multi_items() if k.startswith("x-ratelimit-")]
        assert sorted(k for k, _ in got) == sorted(RATELIMIT_HEADERS), got
        assert headers["x-ratelimit-limit-requests"] == "1000" and headers["x-ratelimit-limit-tokens"] == "1000000"
        assert 990 <= int(headers["x-ratelimit-remaining-requests"]) < 1000
        assert 990_000 <= int(headers["x-ratelimit-remaining-tokens"]) < 1_000_000
        for kind in ("requests", "tokens"):
            assert re.fullmatch(r"\d+ms|\d+(\.\d+)?s", headers[f"x-ratelimit-reset-{kind}"])


def test_a_tenant_with_max_inflight_alone_is_told_no_rate(coord):
    """max_inflight is no rate: a tenant with it alone gets no x-ratelimit-* header, admitted or refused."""
    results = at_once(12, lambda: chat(coord, KEY_C, model="slow", max_tokens=200, whole=True))
    assert {s for s, _, _ in results} == {200, 429}
    assert all(not any(k.startswith("x-ratelimit-") for k in h) for _, _, h in results)


def reset_s(text: str) -> float:
    """An x-ratelimit-reset-* header's duration (`20ms`, `1.5s`, `6m0s`) in seconds."""
    if text.endswith("ms"):
        return int(text[:-2]) / 1000
    minutes, _, seconds = text[:-1].rpartition("m")
    return int(minutes or 0) * 60 + float(seconds)


@pytest.mark.parametrize(
    ("short_milli", "per_min", "text"),
    [
        (0, 20, "0ms"),  # a full bucket
        (1000, 10**9, "1ms"),  # a part of a millisecond is one
        (1000, 3000, "20ms"),
        (1000, 40, "1.5s"),
        (1000, 20, "3s"),
        (6000, 1, "6m0s"),
        (60_500, 60, "1m0.5s"),  # a debt of half a token is waited for too
    ],
)
def test_reset_texts_are_openais(short_milli, per_min, text):
    """x-ratelimit-reset-*: the time until the bucket is full again, written as OpenAI writes it."""
    assert reset_text(short_milli, per_min) == text
    assert reset_s(text) == pytest.approx(short_milli * 60 / per_min / 1000, abs=1e-3)


def tpm_burst(coords: list, key: str, tpm: int, n: int = 20) -> tuple[int, int, float, tuple]:
    """`n` requests of at most 100 tokens at once, spread over `coords`, then one at a time until one is refused:
    the tokens served (the answers' usage), one request's most (its prompt and 100), the tokens the refusal's headers
    say the bucket was charged less its refill (its time to full again, at `tpm` a minute), and the refusal."""
    with ThreadPoolExecutor(n) as pool:
        results = list(pool.map(lambda i: chat(coords[i % len(coords)], key, max_tokens=100), range(n)))
    for i in range(40):
        results.append(chat(coords[i % len(coords)], key, max_tokens=100))
        if results[-1][0] == 429:
            break
    answers = [a for s, a, _ in results if s == 200]
    served = sum(a.usage.prompt_tokens + a.usage.completion_tokens for a in answers)
    refused = [r for r in results if r[0] == 429]
    assert refused, served
    one = max(a.usage.prompt_tokens for a in answers) + 100
    return served, one, reset_s(refused[-1][2]["x-ratelimit-reset-tokens"]) * tpm / 60, refused[-1]


def test_tpm_holds_within_one_request_and_charges_what_was_served(coord):
    """Requests at once each reserve their prompt and their tenant's mean output (all of max_tokens before it has
    one), so together they take no more than the quota; what each was served is charged as it is served and settled
    when it ends, and requests one after another then take the rest: the tokens served are the quota's to within one
    request's, and the bucket was charged what the answers' usage says, to within what it refilled meanwhile."""
    started = time.monotonic()
    served, one, charged, (status, body, headers) = tpm_burst([coord], KEY_T, TPM)
    refilled = (time.monotonic() - started) * TPM / 60
    assert TPM - one <= served <= TPM + refilled + one, served
    assert served - refilled - 2 <= charged <= served + 2, (served, charged, refilled)
    assert body["type"] == "tokens" and body["code"] == "rate_limit_exceeded" and int(headers["retry-after"]) >= 1
    assert headers["x-ratelimit-limit-tokens"] == str(TPM) and headers["x-ratelimit-remaining-tokens"] == "0"


def test_tpm_counts_the_output_as_it_streams(coord):
    """A tenant whose requests were short reserves little for its next one's output; a long stream's tokens are then
    taken from the bucket while it streams (the bucket says less left a second later), not when it ends."""
    for _ in range(4):
        assert chat(coord, KEY_S, max_tokens=2, whole=True)[0] == 200

    def stream() -> int:  # 300 tokens, 10 ms each
        chunks = sdk_for(coord.url, KEY_S).chat.completions.create(
            model="slow",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=300,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        return sum(1 for _ in chunks)

    with ThreadPoolExecutor(1) as pool:
        streamed = pool.submit(stream)
        time.sleep(0.8)
        first = chat(coord, KEY_S, max_tokens=1)[2]  # (on another connection: whichever worker, the bucket is one)
        time.sleep(1.2)
        second = chat(coord, KEY_S, max_tokens=1)[2]
        assert streamed.result() > 300
    left = [int(h["x-ratelimit-remaining-tokens"]) for h in (first, second)]
    # 120 tokens streamed in between, less the 20 the bucket refilled and the probe's own: at least 60 fewer
    assert left[0] - left[1] >= 60, left


def test_anthropic_routes_refuse_in_their_envelope(coord):
    sdk = anthropic_client(coord, api_key=KEY_C)
    with ThreadPoolExecutor(12) as pool:
        futures = [
            pool.submit(
                sdk.messages.create,
                model="slow",
                max_tokens=200,
                messages=[{"role": "user", "content": "x"}],
                extra_body={"ignore_eos": True},
            )
            for _ in range(12)
        ]
        errors = []
        for f in futures:
            try:
                f.result()
            except anthropic.RateLimitError as e:
                errors.append(e)
    assert len(errors) == 12 - CAP
    assert errors[0].body["type"] == "error" and errors[0].body["error"]["type"] == "rate_limit_error"
    assert int(errors[0].response.headers["retry-after"]) >= 1


def test_the_tenant_metrics_count_each_tenant(coord):
    time.sleep(0.2)  # the workers flush their counts 50 ms after a request

    def value(tenant: str, status: str) -> float:
        text = httpx.get(coord.obs + "/metrics", timeout=10).text
        m = re.search(rf'motor_tenant_requests_total\{{status="{status}",tenant="{tenant}"\}} (\S+)', text)
        return float(m[1]) if m else 0.0

    assert 'motor_tenant_tokens_total{kind="output",tenant="team-t"}' in httpx.get(coord.obs + "/metrics").text
    assert value("team-a", "429") >= 1 and value("team-a", "200") >= RPM and value("default", "200") >= 10


def test_the_cached_kind_counts_the_prompt_tokens_the_engines_said_they_held(coord):
    """motor_tenant_tokens_total{kind="cached"}: the engines' prompt_tokens_details.cached_tokens, of JSON answers and
    of a stream's usage chunk, whichever worker served them (no KV events: nothing predicted them)."""

    def cached() -> float:
        text = httpx.get(coord.obs + "/metrics", timeout=10).text
        m = re.search(r'motor_tenant_tokens_total\{kind="cached",tenant="team-k"\} (\S+)', text)
        return float(m[1]) if m else 0.0

    sdk = openai_client(coord, KEY_K)
    prompt = [{"role": "user", "content": "the same long prompt, cached after its first time " * 40}]
    said = 0
    for _ in range(3):
        said += sdk.chat.completions.create(
            model=MODEL, messages=prompt, max_tokens=2
        ).usage.prompt_tokens_details.cached_tokens
    for chunk in sdk.chat.completions.create(
        model=MODEL, messages=prompt, max_tokens=2, stream=True, stream_options={"include_usage": True}
    ):
        if chunk.usage:
            said += chunk.usage.prompt_tokens_details.cached_tokens
    assert said > 300
    assert wait_until(lambda: cached() == said, timeout_s=3), (cached(), said)


def test_excess_tenants_fold_into_other(sims):
    keys = [f"sk-many-{i}" for i in range(70)]
    u = sims("union")
    cfg = coordinator_config([instance(1, "union", MODEL, u.address)], api_key_config=api_keys(*keys))
    with Coordinator(cfg) as c:
        for key in (keys[0], keys[69]):
            assert chat(c, key)[0] == 200
        time.sleep(0.2)
        text = httpx.get(c.obs + "/metrics", timeout=10).text
        tenants = set(re.findall(r'motor_tenant_requests_total\{status="200",tenant="([^"]+)"\}', text))
        assert len(tenants) == 2 and "other" in tenants and any(t.startswith("key-") for t in tenants)
