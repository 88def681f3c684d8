"""What an outside probe found in the serving layer (issue 26): billing keyed by a client's request id in
trigger mode, metaserver targets resolved and echoed as the caller sent them, slow readers pinning capacity."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from config import Endpoint, Instance
from scheduling.registry import Registry
from serving.resolve import InstanceAddresses, normal
from state.shared import SharedState
from tests.conftest import MODEL
from tests.support import Coordinator, coordinator_config, instance, wait_until


@pytest.fixture(scope="module")
def pd_once(module_sims):
    p, d = module_sims("prefill"), module_sims("decode")
    cfg = coordinator_config(
        [instance(1, "prefill", MODEL, p.address), instance(2, "decode", MODEL, d.address)],
        scheduler_config={"pd_dispatch": "trigger"},
    )
    with Coordinator(cfg) as coord:
        coord.p, coord.d = p, d
        yield coord


@pytest.fixture
def fresh_pd(pd_once):
    pd_once.p.reset(), pd_once.d.reset()
    return pd_once


LONG = [{"role": "user", "content": "a long prompt to bill " * 450}]  # about 2,500 tokens
SHORT = [{"role": "user", "content": "short"}]  # about 13


async def _prompt_tokens(c: openai.AsyncOpenAI, messages: list, stream: bool, rid: str) -> int:
    headers = {"X-Request-Id": rid}
    if not stream:
        resp = await c.chat.completions.create(model=MODEL, messages=messages, max_tokens=3, extra_headers=headers)
        return resp.usage.prompt_tokens
    chunks = await c.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=3,
        stream=True,
        stream_options={"include_usage": True},
        extra_headers=headers,
    )
    return [chunk async for chunk in chunks][-1].usage.prompt_tokens


@pytest.mark.parametrize("mode", ["trigger", "handoff"])
def test_two_clients_with_one_request_id_are_each_billed_their_own_prompt(sims, mode):
    """A client chooses its X-Request-Id: two at once with the same one (a long prompt and a short one) got
    each other's usage in trigger mode, where P's usage was kept under that id for the decode leg."""
    p, d = sims("prefill"), sims("decode")
    cfg = coordinator_config(
        [instance(1, "prefill", MODEL, p.address), instance(2, "decode", MODEL, d.address)],
        scheduler_config={"pd_dispatch": mode},
        inference_workers_config={"num_workers": 2},
    )

    async def run(url: str) -> list[tuple[int, int]]:
        c = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=30)
        async with c:
            own = (await _prompt_tokens(c, LONG, False, "solo"), await _prompt_tokens(c, SHORT, False, "solo"))
            assert own[0] > 2000 and own[1] < 20, own
            seen = []
            for i in range(60):
                stream = i % 2 == 1
                got = await asyncio.gather(*(_prompt_tokens(c, m, stream, "same-id") for m in (LONG, SHORT)))
                seen.append(tuple(got))
            return [own, *seen]

    with Coordinator(cfg) as coord:
        own, *seen = asyncio.run(run(coord.url))
    crossed = [pair for pair in seen if pair != own]
    assert not crossed, f"{len(crossed)} of {len(seen)} pairs billed another prompt: {crossed[:5]}"


def test_caller_named_hosts_are_never_resolved_nor_kept():
    """Every distinct remote_host a caller sent was resolved and cached forever (60 names of 1 MB: +68 MB).
    Only the registered instances' names are in the table, whatever is asked."""
    registry = Registry(SharedState.create())
    registry.apply("set", [Instance(1, "prefill", MODEL, (Endpoint(0, "localhost:8000"),))])
    addresses = InstanceAddresses(registry)
    targets = registry.view().targets

    async def ask() -> list[list]:
        return [await addresses.at(normal(f"{i}.example.invalid" + "x" * 10_000), targets) for i in range(500)] + [
            await addresses.at(normal(f"10.0.{i // 256}.{i % 256}"), targets) for i in range(500)
        ]

    assert not any(asyncio.run(ask()))
    assert set(addresses.by_host) == {"localhost"} and "127.0.0.1" in addresses.by_host["localhost"]


def test_a_refused_metaserver_target_is_not_echoed_whole(fresh_pd):
    """The 403 put the whole remote_host into the answer and the log line (60 MB of log for 60 calls)."""
    coord = fresh_pd
    before = len(coord.output())
    for i in range(20):
        host = f"h{i}-" + "x" * 200_000
        r = httpx.post(
            coord.url + "/v1/metaserver",
            json={
                "model": MODEL,
                "messages": [{"role": "user", "content": "x"}],
                "kv_transfer_params": {
                    "request_id": f"echo-{i}",
                    "do_remote_prefill": True,
                    "remote_host": host,
                    "remote_port": "8000",
                },
            },
            timeout=30,
        )
        message = r.json()["error"]["message"]
        assert r.status_code == 403 and "not a registered prefill instance" in message, message[:300]
        assert len(r.content) < 2048 and f"h{i}-xxx" in message and "more characters" in message
    assert wait_until(lambda: coord.output()[before:].count("route=/v1/metaserver") == 20)
    assert len(coord.output()) - before < 20 * 2048
    assert coord.p.stats()["received"] == 0
