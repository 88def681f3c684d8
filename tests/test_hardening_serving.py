"""What an outside probe found in the serving layer (issue 26): billing keyed by a client's request id in
trigger mode, metaserver targets resolved and echoed as the caller sent them, slow readers pinning capacity."""

from __future__ import annotations

import asyncio

import openai
import pytest

from tests.conftest import MODEL
from tests.support import Coordinator, coordinator_config, instance

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
