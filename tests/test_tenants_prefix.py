"""Tenants and the engines' prefix cache (tenant_config.prefix_cache): with keys on, a tenant's prompts carry its
own `cache_salt`, so no tenant reads from `cached_tokens` what another asked. On every family that computes KV, on
union engines and on both legs of PD (handoff and trigger mode), and on a broken stream's continuation; a client's
own salt stays inside its tenant; "shared" and keys off send what the client sent, and a reload switches between
them; the Coordinator's KV-event predictions follow the salt. Real SDKs, engine_sim engines."""

from __future__ import annotations

import json
import os
import re

import httpx
import openai
import pytest

from config import ConfigError, settings_from_dict
from engine_sim import launch
from harness.clients import anthropic_client, openai_client
from harness.configs import api_keys, coordinator_config, instance
from harness.coordinator import Coordinator
from harness.loopback import wait_until
from serving.tenants import CLIENT_SALT_MAX, tenant_salt
from tests.conftest import MODEL
from tests.test_failover import continuations_sent
from tests.test_kv_events import BLOCK, PROMPT_A, _kv_blocks, _kv_states, engines_with_events, ids_of

PD = "qwen3-pd"
KEY_A, KEY_B = "sk-team-a-1", "sk-team-b-1"
TENANTS = {"tenants": [{"name": "team-a", "keys": [KEY_A]}, {"name": "team-b", "keys": [KEY_B]}]}
SALT_A, SALT_B = tenant_salt("team-a"), tenant_salt("team-b")
FAMILIES = ("chat", "completions", "responses", "messages")


def prompt(tag: str, sentences: int = 40) -> str:
    """A prompt of many blocks, its own for each `tag` (the engines' caches outlive a test)."""
    return f"[{tag}] " + "The tenants' secrets stay their own, however long the prompt. " * sentences


def cached(coord: Coordinator, key: str, family: str, model: str, text: str, salt: str | None = None) -> int:
    """The cached tokens the engine reported for one request of `family` with `key`, through its SDK."""
    extra = {"cache_salt": salt} if salt is not None else None
    if family == "messages":
        sdk = anthropic_client(coord, api_key=key)
        m = sdk.messages.create(
            model=model, max_tokens=2, messages=[{"role": "user", "content": text}], extra_body=extra
        )
        return m.usage.cache_read_input_tokens
    sdk = openai_client(coord, key)
    if family == "chat":
        r = sdk.chat.completions.create(
            model=model, max_tokens=2, messages=[{"role": "user", "content": text}], extra_body=extra
        )
        return r.usage.prompt_tokens_details.cached_tokens
    if family == "completions":
        r = sdk.completions.create(model=model, max_tokens=2, prompt=text, extra_body=extra)
        return r.usage.prompt_tokens_details.cached_tokens
    r = sdk.responses.create(model=model, max_output_tokens=2, input=text, extra_body=extra)
    return r.usage.input_tokens_details.cached_tokens


def salts_sent(*engines) -> list:
    """The `cache_salt` of every body the engines were sent (None: none), in order, and the records forgotten."""
    out = []
    for e in engines:
        out.extend(r["body"].get("cache_salt") for r in e.requests() if isinstance(r.get("body"), dict))
        e.reset()
    return out


@pytest.fixture(scope="module")
def world(module_sims):
    """A two-worker Coordinator with two tenants, a union engine (MODEL) and a prefill and a decode one (PD)."""
    u = module_sims("union", anthropic_cache_usage=True)
    p, d = module_sims("prefill", model=PD, anthropic_cache_usage=True), module_sims("decode", model=PD)
    cfg = coordinator_config(
        [
            instance(1, "union", MODEL, u.address),
            instance(2, "prefill", PD, p.address),
            instance(3, "decode", PD, d.address),
        ],
        inference_workers_config={"num_workers": 2},
        api_key_config=api_keys(),
        tenant_config=TENANTS,
    )
    with Coordinator(cfg, workers=2) as coord:
        coord.engines = {MODEL: (u,), PD: (p, d)}
        yield coord


@pytest.mark.parametrize("model", [MODEL, PD], ids=["union", "pd"])
@pytest.mark.parametrize("family", FAMILIES)
def test_a_tenant_reads_nothing_of_anothers_prompt_from_the_prefix_cache(world, family, model):
    text, engines = prompt(f"{family}-{model}"), world.engines[model]
    salts_sent(*engines)
    assert cached(world, KEY_A, family, model, text) == 0
    assert cached(world, KEY_A, family, model, text) > 0  # its own repeat is cached
    assert cached(world, KEY_B, family, model, text) == 0  # the other tenant's same prompt is not
    assert cached(world, KEY_B, family, model, text) > 0
    # Every leg went salted with its tenant's digest (PD: prefill and decode each).
    assert salts_sent(*engines) == ([SALT_A] * 2 + [SALT_B] * 2) * len(engines)


@pytest.mark.parametrize("model", [MODEL, PD], ids=["union", "pd"])
@pytest.mark.parametrize("family", FAMILIES)
def test_a_body_with_whitespace_after_its_object_is_salted_and_served(world, family, model):
    """JSON lets any whitespace follow the object: the salt goes in before the closing brace however much follows
    it (a decode leg's body is the client's bytes, whitespace and all; past 64 bytes of it every PD request was a
    500)."""
    route, body = {
        "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
        "completions": ("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
        "responses": ("/v1/responses", {"input": "hi", "max_output_tokens": 2}),
        "messages": ("/v1/messages", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
    }[family]
    engines = world.engines[model]
    salts_sent(*engines)
    for trailing in (b" " * 65, b"\r\n" * 3000):
        for stream in (False, True):
            raw = json.dumps({"model": model, "stream": stream, **body}).encode() + trailing
            headers = {"authorization": f"Bearer {KEY_A}", "x-api-key": KEY_A, "content-type": "application/json"}
            r = httpx.post(world.url + route, content=raw, headers=headers, timeout=10)
            assert r.status_code == 200, r.text
    assert salts_sent(*engines) == [SALT_A] * 4 * len(engines)


@pytest.mark.parametrize("model", [MODEL, PD], ids=["union", "pd"])
def test_a_client_salt_is_a_scope_inside_its_tenant_and_cannot_name_another(world, model):
    text, engines = prompt(f"client-salt-{model}"), world.engines[model]
    assert cached(world, KEY_A, "chat", model, text) == 0
    assert cached(world, KEY_A, "chat", model, text, salt="mine") == 0  # a scope of its own within team-a
    assert cached(world, KEY_A, "chat", model, text, salt="mine") > 0
    salts_sent(*engines)
    # team-b names team-a's digest, and team-a's client salt: neither is team-a's scope.
    assert cached(world, KEY_B, "chat", model, text, salt=SALT_A) == 0
    assert cached(world, KEY_B, "chat", model, text, salt="mine") == 0
    assert cached(world, KEY_B, "chat", model, text, salt=f"{SALT_A}:mine") == 0
    assert set(salts_sent(*engines)) == {f"{SALT_B}:{SALT_A}", f"{SALT_B}:mine", f"{SALT_B}:{SALT_A}:mine"}
    # A salt too long to fit behind the digest within vLLM's 128 characters is refused, naming the field.
    with pytest.raises(openai.BadRequestError) as e:
        cached(world, KEY_A, "chat", model, text, salt="x" * (CLIENT_SALT_MAX + 1))
    assert e.value.body["param"] == "cache_salt"


def test_in_trigger_mode_p_is_salted_through_the_metaserver_call(sims):
    """Trigger mode (MindIE's metaserver protocol): D gets the salt in its body, and P's leg, which is D's call to
    the Coordinator's /v1/metaserver (the engine's rewrite of the body: engine_sim's carries only the model and
    the prompt), gets it from the ticket's metaserver URL."""
    p, d = sims("prefill", model=PD), sims("decode", model=PD)
    cfg = coordinator_config(
        [instance(1, "prefill", PD, p.address), instance(2, "decode", PD, d.address)],
        scheduler_config={"pd_dispatch": "trigger"},
        api_key_config=api_keys(),
        tenant_config=TENANTS,
    )
    with Coordinator(cfg) as coord:
        text = prompt("trigger")
        assert cached(coord, KEY_A, "chat", PD, text) == 0
        assert cached(coord, KEY_A, "chat", PD, text) > 0
        assert cached(coord, KEY_B, "chat", PD, text) == 0
        assert salts_sent(p) == [SALT_A, SALT_A, SALT_B] and salts_sent(d) == [SALT_A, SALT_A, SALT_B]


def test_a_broken_streams_continuation_carries_its_tenants_salt(sims):
    """A stream whose engine fails after its first tokens goes on on the other engine (reschedule_config) as a
    completions request of token ids: that body is salted as the first was."""
    engines = [sims("union", speedup=5) for _ in range(2)]
    cfg = coordinator_config(
        [instance(i + 1, "union", MODEL, e.address) for i, e in enumerate(engines)],
        exception_config={"reschedule_config": {"enable": True}, "retry_delay": 0.01},
        api_key_config=api_keys(),
        tenant_config=TENANTS,
    )
    with Coordinator(cfg) as coord:
        for e in engines:
            e.set_faults(mid_stream_fault="reset", mid_stream_fault_after_tokens=4)
        stream = openai_client(coord, KEY_A).chat.completions.create(
            model=MODEL,
            max_tokens=8,
            messages=[{"role": "user", "content": "Tell me about rivers."}],
            stream=True,
            extra_body={"ignore_eos": True},
        )
        assert sum(len(ch.choices[0].delta.content or "") > 0 for ch in stream if ch.choices) > 4
        assert len(continuations_sent(engines)) == 1
        assert salts_sent(*engines) == [SALT_A, SALT_A]  # the first engine's request, and the continuation


def test_counting_routes_compute_no_kv_and_carry_no_salt(world):
    """/tokenize, /detokenize and count_tokens compute no KV: nothing is added, and a client's own salt (however
    long) goes to the engine as it is."""
    u = world.engines[MODEL][0]
    salts_sent(u)
    long_salt = "x" * (CLIENT_SALT_MAX + 1)
    count = anthropic_client(world, api_key=KEY_A).messages.count_tokens(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], extra_body={"cache_salt": long_salt}
    )
    assert count.input_tokens > 0
    for route, body in (
        ("/tokenize", {"model": MODEL, "prompt": "hi"}),
        ("/detokenize", {"model": MODEL, "tokens": [1]}),
    ):
        r = httpx.post(world.url + route, json=body, headers={"Authorization": f"Bearer {KEY_A}"})
        assert r.status_code == 200, r.text
    assert salts_sent(u) == [long_salt, None, None]


def test_shared_prefix_cache_shares_and_keys_off_adds_nothing(sims):
    u = sims("union", anthropic_cache_usage=True)
    instances = [instance(1, "union", MODEL, u.address)]
    shared = {**TENANTS, "prefix_cache": "shared"}
    with Coordinator(coordinator_config(instances, api_key_config=api_keys(), tenant_config=shared)) as coord:
        text = prompt("shared")
        assert cached(coord, KEY_A, "chat", MODEL, text) == 0
        assert cached(coord, KEY_B, "chat", MODEL, text) > 0  # today's behaviour: what A asked, B finds cached
        assert cached(coord, KEY_B, "chat", MODEL, text, salt="theirs") == 0
        assert salts_sent(u) == [None, None, "theirs"]  # the client's own salt passes as it is
    with Coordinator(coordinator_config(instances)) as coord:  # keys off: one tenant, nothing added
        text = prompt("keys-off")
        assert cached(coord, "none", "chat", MODEL, text) == 0
        assert cached(coord, "none", "chat", MODEL, text) > 0
        assert cached(coord, "none", "messages", MODEL, text, salt="own") == 0
        assert salts_sent(u) == [None, None, "own"]


def test_a_reload_switches_prefix_cache_and_a_bad_value_changes_nothing(sims):
    """tenant_config is live: a reloaded file's prefix_cache takes effect from the next requests on; one whose value
    is neither is refused in one line naming the key, and the Coordinator runs on as it did."""
    u = sims("union")
    cfg = coordinator_config([instance(1, "union", MODEL, u.address)], api_key_config=api_keys(), tenant_config=TENANTS)
    turns = iter(range(1000))

    def b_reads_as(want_shared: bool) -> bool:
        text = prompt(f"reload-{next(turns)}")
        cached(coord, KEY_A, "completions", MODEL, text)
        return (cached(coord, KEY_B, "completions", MODEL, text) > 0) == want_shared

    def reload(prefix_cache: str) -> None:
        whole = {"motor_coordinator_config": {**cfg, "tenant_config": {**TENANTS, "prefix_cache": prefix_cache}}}
        with open(coord.config_path + ".new", "w") as f:
            json.dump(whole, f)
        os.replace(coord.config_path + ".new", coord.config_path)

    with Coordinator(cfg) as coord:
        assert b_reads_as(want_shared=False)
        reload("shared")
        assert wait_until(lambda: b_reads_as(want_shared=True), 10)
        reload("open")
        assert wait_until(lambda: "tenant_config.prefix_cache: must be one of isolated, shared" in coord.output(), 10)
        assert b_reads_as(want_shared=True)  # as before


def test_prefix_cache_takes_isolated_or_shared_only():
    cfg = {"api_key_config": api_keys(KEY_A), "tenant_config": {"prefix_cache": "open"}}
    with pytest.raises(ConfigError, match=re.escape("motor_coordinator_config.tenant_config.prefix_cache: must be")):
        settings_from_dict(cfg)
    assert settings_from_dict({"api_key_config": api_keys(KEY_A)}).isolated_prefixes  # each key its own tenant
    assert not settings_from_dict({"api_key_config": {"enable_api_key": False}}).isolated_prefixes


# -- the Coordinator's predictions follow the salt (KV events) ------------------------------------------------


def line_of(coord: Coordinator, rid: str) -> str:
    found: list[str] = []
    assert wait_until(
        lambda: found.extend(ln for ln in coord.output().splitlines() if f"request_id={rid} " in ln) or found
    )
    return found[0]


def predicted_and_reported(coord: Coordinator, key: str, rid: str, ids: list[int]) -> tuple[str, str]:
    r = httpx.post(
        coord.url + "/v1/completions",
        json={"model": "m", "prompt": ids, "max_tokens": 2},
        headers={"Authorization": f"Bearer {key}", "X-Request-Id": rid},
        timeout=10,
    )
    assert r.status_code == 200, r.text
    m = re.search(r" cached_tokens_predicted=(\S+) cached_tokens=(\S+)", line_of(coord, rid))
    assert m[2] == str(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
    return m[1], m[2]


@pytest.mark.parametrize("role", ["union", "prefill"], ids=["union", "pd"])
def test_the_kv_event_index_predicts_no_other_tenants_blocks(role):
    engines, instances = engines_with_events(1, role)
    if role == "prefill":
        decode = launch(role="decode", model="m", zero_latency=True, block_size=BLOCK)
        engines.append(decode)
        instances.append(instance(9, "decode", "m", decode.address))
    cfg = coordinator_config(
        instances,
        scheduler_config={"scheduler_type": "kv_cache_affinity"},
        kv_event_config={"enable": True},
        api_key_config=api_keys(),
        tenant_config=TENANTS,
    )
    turn = PROMPT_A + ids_of(" and one turn more")
    try:
        with Coordinator(cfg) as coord:
            assert wait_until(lambda: _kv_states(coord)[0] == "live", 10)
            assert predicted_and_reported(coord, KEY_A, f"{role}-a1", turn) == ("0", "0")
            assert wait_until(lambda: _kv_blocks(coord)[0] >= 8, 5)
            held = str(8 * BLOCK)
            assert predicted_and_reported(coord, KEY_A, f"{role}-a2", turn) == (held, held)
            assert predicted_and_reported(coord, KEY_B, f"{role}-b1", turn) == ("0", "0")
            assert wait_until(lambda: _kv_blocks(coord)[0] >= 16, 5)  # B's blocks are others: the engine holds both
            assert predicted_and_reported(coord, KEY_B, f"{role}-b2", turn) == (held, held)
    finally:
        for e in engines:
            e.stop()
