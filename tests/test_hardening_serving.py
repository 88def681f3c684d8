"""What an outside probe found in the serving layer (issue 26): billing keyed by a client's request id in
trigger mode, metaserver targets resolved and echoed as the caller sent them, slow readers pinning capacity."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time

import httpx
import openai
import pytest

from config import Endpoint, Instance
from harness.configs import coordinator_config, instance
from harness.coordinator import Coordinator
from harness.ledger import ledger, ledger_is_zero
from harness.loopback import wait_until
from scheduling.registry import Registry
from serving.resolve import InstanceAddresses, normal
from state.shared import SharedState
from tests.conftest import MODEL


def pd(p, d, **sections) -> Coordinator:
    """A Coordinator in front of prefill engine `p` (instance 1) and decode engine `d` (instance 2)."""
    return Coordinator(
        coordinator_config(
            [instance(1, "prefill", MODEL, p.address), instance(2, "decode", MODEL, d.address)], **sections
        )
    )


@pytest.fixture(scope="module")
def pd_once(module_sims):
    p, d = module_sims("prefill"), module_sims("decode")
    with pd(p, d, scheduler_config={"pd_dispatch": "trigger"}) as coord:
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

    with pd(p, d, scheduler_config={"pd_dispatch": mode}, inference_workers_config={"num_workers": 2}) as coord:
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


def _open_stream(coord, max_tokens: int) -> socket.socket:
    """A raw client with a small receive window that asks for a long stream and has read its status line."""
    body = json.dumps(
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "slow reader"}],
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "logprobs": True,
            "top_logprobs": 20,  # about 1.6 KB an event
            "stream": True,
        }
    ).encode()
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting: the window it announces
    s.settimeout(10)
    s.connect(("127.0.0.1", coord.infer_port))
    s.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % len(body) + body
    )
    assert s.recv(16).startswith(b"HTTP/1.1 200")
    return s


def _decode_inflight(coord) -> int:
    return ledger(coord)[1]["inflight_requests"]  # instance 2, the decode engine


def _pd(sims, **exception_config):
    p, d = sims("prefill"), sims("decode", speedup=200.0)
    return d, pd(p, d, exception_config=exception_config)


def test_a_slow_reader_gives_the_engine_back_when_the_engine_is_done(sims):
    """A stream read one byte at a time held its decode engine's place (inflight_requests 1) after the engine
    had finished, for as long as the client took to read the rest. The engine's share goes back when its
    answer is whole; the client's connection alone waits, and is dropped when it stops taking bytes."""
    d, coord = _pd(sims, stream_idle_timeout=8, max_stream_buffer_size=16 << 20)
    with coord, _open_stream(coord, 4000) as s:  # 6 MB of events: more than the socket buffers hold (4 MB)
        read, released_while_reading = 0, False
        deadline = time.monotonic() + 12
        while time.monotonic() < deadline:
            got = s.recv(1)
            if not got:
                break
            read += 1
            time.sleep(0.05)
            if read % 10 == 0 and d.stats()["received"] == 1 and d.stats()["running"] == 0:
                released_while_reading = _decode_inflight(coord) == 0
                break
        assert released_while_reading, f"the decode engine finished, its place was still held ({read} bytes read)"
        assert not d.stats()["aborted_request_ids"] and "stopped reading" not in coord.output()  # it finished
        assert read < 1000  # the client has most of its stream to read still
        # It reads nothing more: its connection is dropped after stream_idle_timeout.
        assert wait_until(lambda: "stopped reading" in coord.output(), timeout_s=15)
        assert ledger_is_zero(coord)


def test_a_stalled_reader_is_cut_when_its_buffer_is_full(sims):
    """What waits for a client that reads nothing is bounded (max_stream_buffer_size): past it the stream is
    cut with a log line saying why, and the engine request with it."""
    d, coord = _pd(sims, max_stream_buffer_size=65536)
    with coord, _open_stream(coord, 4000) as s:
        assert wait_until(lambda: "max_stream_buffer_size (65536)" in coord.output(), timeout_s=15)
        assert wait_until(lambda: "status=499" in coord.output(), timeout_s=5)
        assert wait_until(lambda: ledger_is_zero(coord) and d.stats()["running"] == 0, timeout_s=5)
        s.settimeout(5)
        got = b""
        with contextlib.suppress(ConnectionResetError):  # the connection is gone: what the kernel held, then its end
            while chunk := s.recv(1 << 20):
                got += chunk
        assert got and b"[DONE]" not in got


def test_a_stream_ends_at_its_total_timeout(sims):
    """stream_total_timeout bounds a stream's whole life, however steadily the engine and the client go."""
    p, d = sims("prefill"), sims("decode", speedup=2.0)
    with pd(p, d, exception_config={"stream_total_timeout": 1.5}) as coord:
        started = time.monotonic()
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "x"}],
            "max_tokens": 4000,
            "ignore_eos": True,
            "stream": True,
        }
        with (
            pytest.raises(httpx.RemoteProtocolError),
            httpx.stream("POST", coord.url + "/v1/chat/completions", json=body, timeout=30) as r,
        ):
            assert r.status_code == 200
            for _ in r.iter_bytes():
                pass
        assert 1.4 < time.monotonic() - started < 6
        assert wait_until(lambda: "stream_total_timeout (1.5 s)" in coord.output(), timeout_s=5)
        assert wait_until(lambda: ledger_is_zero(coord) and d.stats()["running"] == 0, timeout_s=5)
