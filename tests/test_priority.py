"""x-priority classes (tenant_config's max_priority): the header's refusals, the class capped at the tenant's
max_priority, vLLM's `priority` field only to instances whose object says "scheduling_policy": "priority", and the
simulator's priority scheduling (an FCFS engine refuses a non-zero priority, as vLLM 0.32 does). The admission
queue's order and the batch headroom are tests/test_fairness.py."""

from __future__ import annotations

import asyncio

import anthropic
import httpx
import openai
import pytest

from config import ConfigError, settings_from_dict
from harness.clients import anthropic_client, openai_client
from harness.configs import api_keys, coordinator_config, instance
from harness.coordinator import Coordinator
from tests.conftest import MODEL

FCFS_MODEL = "fcfs-model"
KEY_A, KEY_B = "sk-team-a-1", "sk-team-b-1"
TENANTS = {
    "tenants": [
        {"name": "team-a", "keys": [KEY_A]},
        {"name": "team-b", "keys": [KEY_B], "max_priority": "standard"},
    ]
}
HI = [{"role": "user", "content": "hi"}]


def sent_priorities(*engines) -> list:
    """The `priority` each engine's last recorded request carried (None: none)."""
    return [e.requests()[-1]["body"].get("priority") for e in engines]


def test_the_class_reaches_priority_engines_only_capped_at_the_tenants_max_priority(sims):
    p = sims("prefill", scheduling_policy="priority")
    d = sims("decode", scheduling_policy="priority")
    u = sims("union", model=FCFS_MODEL)  # vLLM's default FCFS: it would refuse a non-zero priority
    cfg = coordinator_config(
        [
            instance(1, "prefill", MODEL, p.address, scheduling_policy="priority"),
            instance(2, "decode", MODEL, d.address, scheduling_policy="priority"),
            instance(3, "union", FCFS_MODEL, u.address),
        ],
        api_key_config=api_keys(),
    )
    with Coordinator({**cfg, "tenant_config": TENANTS}) as coord:
        a, b = openai_client(coord, KEY_A), openai_client(coord, KEY_B)

        def ask(sdk, header: str | None, model: str = MODEL, **kw):
            headers = {"x-priority": header} if header is not None else {}
            return sdk.chat.completions.create(model=model, messages=HI, max_tokens=3, extra_headers=headers, **kw)

        for header, want in ((None, 1), ("interactive", 0), ("standard", 1), ("batch", 2), ("BATCH", 2)):
            ask(a, header)
            assert sent_priorities(p, d) == [want, want], header
        ask(b, "interactive")  # team-b's max_priority is standard
        assert sent_priorities(p, d) == [1, 1]
        # A client's own `priority` field never outranks its class (the Coordinator's comes last in the body).
        ask(b, "batch", extra_body={"priority": -100})
        assert sent_priorities(p, d) == [2, 2]
        stream = ask(a, "batch", stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert sent_priorities(p, d) == [2, 2]
        ask(a, "batch", model=FCFS_MODEL)  # served: an FCFS instance gets no priority
        assert sent_priorities(u) == [None]
        # Anthropic's route: vLLM's Messages makes its own chat request, without the field; nothing is sent.
        msg = anthropic_client(coord, api_key=KEY_A).messages.create(
            model=MODEL, max_tokens=3, messages=HI, extra_headers={"x-priority": "batch"}
        )
        assert msg.content and sent_priorities(p, d) == [None, None]


def test_an_unknown_class_is_a_400_in_the_apis_own_envelope(sims):
    u = sims("union")
    with Coordinator(coordinator_config([instance(1, "union", MODEL, u.address)])) as coord:
        with pytest.raises(openai.BadRequestError) as e:
            openai_client(coord).chat.completions.create(
                model=MODEL, messages=HI, max_tokens=2, extra_headers={"x-priority": "urgent"}
            )
        assert e.value.body["type"] == "invalid_request_error" and "x-priority" in e.value.body["message"]
        with pytest.raises(anthropic.BadRequestError) as e:
            anthropic_client(coord).messages.create(
                model=MODEL, max_tokens=2, messages=HI, extra_headers={"x-priority": "0"}
            )
        assert e.value.body["error"]["type"] == "invalid_request_error" and "x-priority" in e.value.message
        assert not u.requests()  # refused before any engine


def test_scheduling_policy_is_validated_and_a_refresh_keeps_it(sims):
    with pytest.raises(ConfigError, match=r"instances\[0\]\.scheduling_policy"):
        settings_from_dict({"instances": [instance(1, "union", MODEL, "127.0.0.1:9", scheduling_policy="lifo")]})
    u, v = sims("union", scheduling_policy="priority"), sims("union")
    with Coordinator(coordinator_config([instance(1, "union", MODEL, u.address)])) as coord:
        sdk = openai_client(coord)
        sdk.chat.completions.create(model=MODEL, messages=HI, max_tokens=2, extra_headers={"x-priority": "batch"})
        assert sent_priorities(u) == [None]  # the config does not say priority: nothing is sent
        body = instance(1, "union", MODEL, u.address, scheduling_policy="priority")
        assert coord.refresh("set", [body, instance(2, "union", "other", v.address)]).status_code == 200
        listed = {i["id"]: i for i in httpx.get(coord.mgmt + "/instances", timeout=5).json()["instances"]}
        assert listed[1]["scheduling_policy"] == "priority" and listed[2]["scheduling_policy"] == "fcfs"
        sdk.chat.completions.create(model=MODEL, messages=HI, max_tokens=2, extra_headers={"x-priority": "batch"})
        assert sent_priorities(u) == [2]
        bad = instance(3, "union", "third", v.address, scheduling_policy="priority-ish")
        r = coord.refresh("add", [bad])
        assert r.status_code == 400 and "scheduling_policy" in r.text


# -- the simulator -------------------------------------------------------------------------------------------


def test_an_fcfs_engine_refuses_a_non_zero_priority_as_vllm_does(sims):
    u = sims("union")
    body = {"model": MODEL, "messages": HI, "max_tokens": 2}
    assert httpx.post(u.url + "/v1/chat/completions", json={**body, "priority": 0}, timeout=5).status_code == 200
    r = httpx.post(u.url + "/v1/chat/completions", json={**body, "priority": 2}, timeout=5)
    assert r.status_code == 400
    assert r.json()["error"]["message"] == "Got priority 2 but Priority scheduling is not enabled."


def test_a_priority_engine_runs_the_lowest_priority_value_first(sims):
    """One sequence at a time: behind a running request, a batch (2) one then an interactive (0) one wait; the
    interactive one runs first. FCFS runs them as they came."""

    async def finish_order(url: str, priorities: bool) -> list[str]:
        done: list[str] = []
        async with httpx.AsyncClient(timeout=30) as client:

            async def one(name: str, priority: int, tokens: int) -> None:
                body = {"model": MODEL, "messages": HI, "max_tokens": tokens, "ignore_eos": True}
                if priorities:
                    body["priority"] = priority
                r = await client.post(url + "/v1/chat/completions", json=body)
                assert r.status_code == 200, r.text
                done.append(name)

            first = asyncio.ensure_future(one("running", 1, 40))
            await asyncio.sleep(0.05)
            batch = asyncio.ensure_future(one("batch", 2, 2))
            await asyncio.sleep(0.05)
            await asyncio.gather(first, batch, one("interactive", 0, 2))
        return done

    kw = {"max_num_seqs": 1, "speedup": 1.0, "decode_step_ms": 5.0}
    prio, fcfs = sims(scheduling_policy="priority", **kw), sims(**kw)
    assert asyncio.run(finish_order(prio.url, True)) == ["running", "interactive", "batch"]
    assert asyncio.run(finish_order(fcfs.url, False)) == ["running", "batch", "interactive"]


def test_engine_sim_takes_scheduling_policy_on_its_command_line():
    from engine_sim.__main__ import parse_args

    assert parse_args(["--scheduling-policy", "priority"]).scheduling_policy == "priority"
    assert parse_args([]).scheduling_policy == "fcfs"
