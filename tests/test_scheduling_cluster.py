"""Scheduling through the running Coordinator: the ledger after cancelled and failed requests, spread over
instances with two workers, and SLO admission answering 429 with Retry-After."""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import subprocess
import sys

import anthropic
import httpx
import openai
import pytest

from harness import ROOT
from harness.clients import openai_client as client
from harness.configs import coordinator_config, instance
from harness.coordinator import Coordinator
from harness.loopback import wait_until
from tests.conftest import MODEL

LOAD_GAUGES = (
    "motor_instance_inflight_requests",
    "motor_instance_inflight_prompt_tokens",
    "motor_instance_inflight_decode_tokens",
)


def load_samples(coord) -> list[float]:
    text = httpx.get(coord.obs + "/metrics", timeout=5).text
    return [float(m.group(1)) for m in re.finditer(r"^(?:%s)\{[^}]*\} (\S+)$" % "|".join(LOAD_GAUGES), text, re.M)]


def chat(i: int, tokens: int = 8, words: int = 20) -> dict:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"request {i} " + "word " * words}],
        "max_tokens": tokens,
        "ignore_eos": True,
        "stream": True,
    }


def test_ledger_returns_to_zero_after_cancelled_and_failed_requests(sims):
    p1, p2 = sims("prefill", speedup=5.0), sims("prefill", speedup=5.0)
    d1, d2 = sims("decode", speedup=5.0), sims("decode", speedup=5.0)
    cfg = coordinator_config(
        [
            instance(1, "prefill", MODEL, p1.address),
            instance(2, "prefill", MODEL, p2.address),
            instance(3, "decode", MODEL, d1.address),
            instance(4, "decode", MODEL, d2.address),
        ],
        scheduler_config={"scheduler_type": "slo_aware"},
        exception_config={"max_retry": 1, "retry_delay": 0.01},
    )
    with Coordinator(cfg) as coord:
        p2.set_faults(fail_status=500)  # every prefill there fails (retried once on p1, or the request fails)
        d2.set_faults(close_mid_stream_after_n=3)  # decode streams there break after a few events

        async def burst():
            async with httpx.AsyncClient(base_url=coord.url, timeout=30) as http:

                async def cancel_after_first_chunk(i):
                    async with http.stream("POST", "/v1/chat/completions", json=chat(i, tokens=200)) as r:
                        async for _ in r.aiter_bytes():
                            break

                async def cancel_before_first_byte(i):
                    try:
                        await asyncio.wait_for(
                            http.post("/v1/chat/completions", json=chat(i, tokens=50, words=3000)), 0.05
                        )
                    except TimeoutError:
                        pass

                async def complete(i):
                    async with http.stream("POST", "/v1/chat/completions", json=chat(i, tokens=30)) as r:
                        return r.status_code, b"".join([c async for c in r.aiter_bytes()])

                jobs = []
                for i in range(12):
                    jobs += [cancel_after_first_chunk(i), cancel_before_first_byte(100 + i), complete(200 + i)]
                return await asyncio.gather(*jobs, return_exceptions=True)

        outcomes = asyncio.run(burst())
        finished = [o for o in outcomes if isinstance(o, tuple)]
        assert len(finished) == 12 and any(status == 200 for status, _ in finished)
        assert p2.stats()["received"] > 0 and d2.stats()["received"] > 0  # the faults were met
        assert wait_until(lambda: max(load_samples(coord)) == 0.0, timeout_s=15)
        assert len(load_samples(coord)) == len(LOAD_GAUGES) * 4


def test_round_robin_rotates_across_two_workers(sims):
    a, b = sims("union"), sims("union")
    cfg = coordinator_config(
        [instance(1, "union", MODEL, a.address), instance(2, "union", MODEL, b.address)],
        scheduler_config={"scheduler_type": "round_robin"},
    )
    with Coordinator(cfg, workers=2) as coord:
        for i in range(20):  # a fresh connection each time, so both workers serve some
            with httpx.Client(timeout=10) as http:
                r = http.post(coord.url + "/v1/chat/completions", json={**chat(i, tokens=2), "stream": False})
                assert r.status_code == 200
        order = sorted([(r["time"], "a") for r in a.requests()] + [(r["time"], "b") for r in b.requests()])
        engines = [name for _, name in order]
        assert len(engines) == 20
        assert all(x != y for x, y in itertools.pairwise(engines))  # strictly alternating: one shared counter
        assert re.search(r"Srv 1.*Worker ready", coord.output()) or coord.output().count("Worker ready") >= 2


@pytest.mark.parametrize("policy", ["load_balance", "slo_aware"])
def test_two_workers_spread_concurrent_load_evenly(sims, policy):
    a, b = sims("union"), sims("union")
    cfg = coordinator_config(
        [instance(1, "union", MODEL, a.address), instance(2, "union", MODEL, b.address)],
        scheduler_config={"scheduler_type": policy},
    )
    with Coordinator(cfg, workers=2) as coord:

        async def burst():
            limits = httpx.Limits(max_keepalive_connections=0)
            async with httpx.AsyncClient(base_url=coord.url, timeout=30, limits=limits) as http:

                async def one(i):
                    async with http.stream("POST", "/v1/chat/completions", json=chat(i, tokens=40)) as r:
                        return r.status_code, b"".join([c async for c in r.aiter_bytes()])

                return await asyncio.gather(*(one(i) for i in range(40)))

        results = asyncio.run(burst())
        assert all(status == 200 for status, _ in results)
        served = [a.stats()["received"], b.stats()["received"]]
        assert sum(served) == 40 and min(served) >= 12, served  # 30 %: neither engine starved


@pytest.mark.parametrize("stream", [False, True])
def test_kv_cache_affinity_sends_each_conversation_back_to_its_cache(sims, stream):
    """Streamed or not (the SDKs' default), a prompt whose prefix an engine prefilled goes back there."""
    a, b = sims("union"), sims("union")
    cfg = coordinator_config(
        [instance(1, "union", MODEL, a.address), instance(2, "union", MODEL, b.address)],
        scheduler_config={"scheduler_type": "kv_cache_affinity"},
    )
    with Coordinator(cfg) as coord:
        oa = client(coord)
        cached = []
        for turn in range(3):
            for topic in ("tides", "glaciers", "dunes"):  # odd: a rotation alone would not bring them back
                messages = [
                    {"role": "system", "content": f"You explain {topic}. " + f"Background on {topic}: " * 60},
                    {"role": "user", "content": f"question {turn}"},
                ]
                if stream:
                    chunks = list(
                        oa.chat.completions.create(
                            model=MODEL,
                            messages=messages,
                            max_tokens=2,
                            stream=True,
                            stream_options={"include_usage": True},
                        )
                    )
                    usage = chunks[-1].usage
                else:
                    usage = oa.chat.completions.create(model=MODEL, messages=messages, max_tokens=2).usage
                cached.append((turn, topic, usage.prompt_tokens_details.cached_tokens))
        assert all(n == 0 for turn, _, n in cached if turn == 0)
        misses = [(turn, topic) for turn, topic, n in cached if turn > 0 and n == 0]
        assert not misses, misses  # every later turn found its prefix in the engine that prefilled it
        served = [a.stats()["received"], b.stats()["received"]]
        assert min(served) > 0, served  # the conversations were spread, not all sent to one engine


def slo_cluster(sims, admission: str, slo_ttft: int = 1, **sched):
    p, d = sims("prefill"), sims("decode")
    cfg = coordinator_config(
        [instance(1, "prefill", MODEL, p.address), instance(2, "decode", MODEL, d.address)],
        models=[{"id": MODEL, "slo_ttft": slo_ttft, "slo_tpot": 1000}],
        scheduler_config={"scheduler_type": "slo_aware", "admission": admission, **sched},
    )
    return Coordinator(cfg)


def warm(coord, n: int = 6) -> None:
    """Requests that teach the model the engines' speeds (admitted: an unknown engine is never refused)."""
    for i in range(n):
        r = httpx.post(
            coord.url + "/v1/chat/completions", json=chat(i, tokens=12), headers={"x-slo-ttft-ms": "60000"}, timeout=30
        )
        assert r.status_code == 200


def test_reject_admission_answers_429_with_retry_after(sims):
    with slo_cluster(sims, "reject") as coord:
        models = httpx.get(coord.url + "/v1/models", timeout=5).json()["data"]
        assert models[0]["slo_ttft"] == 1 and models[0]["slo_tpot"] == 1000  # the budget the scheduler uses
        warm(coord)
        with pytest.raises(openai.RateLimitError) as e:
            client(coord).chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi " * 50}], max_tokens=8
            )
        assert int(e.value.response.headers["retry-after"]) >= 1
        assert e.value.response.json()["error"]["type"] == "rate_limit_error"
        assert "SLO" in e.value.response.json()["error"]["message"]
        # A request's own budget (x-slo-ttft-ms) replaces the model's.
        ok = client(coord).chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=4,
            extra_headers={"x-slo-ttft-ms": "60000"},
        )
        assert ok.choices[0].message.content
        with pytest.raises(anthropic.RateLimitError) as ae:
            anthropic.Anthropic(base_url=coord.url, api_key="unused", max_retries=0).messages.create(
                model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "hi " * 50}]
            )
        assert (
            ae.value.response.json()["error"]["type"] == "rate_limit_error" and ae.value.response.headers["retry-after"]
        )
        assert wait_until(lambda: max(load_samples(coord)) == 0.0)


def test_queue_admission_serves_what_fits_and_refuses_what_cannot(sims):
    with slo_cluster(sims, "queue", admission_queue_size=4) as coord:
        warm(coord)
        r = httpx.post(coord.url + "/v1/chat/completions", json=chat(1, tokens=4), timeout=30)
        assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
        assert "ran out" in r.json()["error"]["message"]

        async def burst():
            async with httpx.AsyncClient(base_url=coord.url, timeout=30) as http:
                return await asyncio.gather(
                    *(
                        http.post("/v1/chat/completions", json=chat(i, tokens=20), headers={"x-slo-ttft-ms": "20000"})
                        for i in range(8)
                    )
                )

        assert [r.status_code for r in asyncio.run(burst())] == [200] * 8
        assert wait_until(lambda: max(load_samples(coord)) == 0.0)


SINGLE_PROCESS = """
import json, sys
from app import create_app
from config import settings_from_dict, with_models_for_instances
settings = with_models_for_instances(settings_from_dict(json.loads(sys.argv[1])))
create_app(settings).run(host="127.0.0.1", port=settings.infer_port, single_process=True, motd=False)
"""


def test_single_process_mode_makes_its_own_shared_state(sims):
    """Sanic's single_process mode skips main_process_start: the worker makes the shared state itself."""
    u = sims("union")
    cfg = coordinator_config([instance(1, "union", MODEL, u.address)])
    url = f"http://127.0.0.1:{cfg['api_config']['coordinator_api_infer_port']}"
    proc = subprocess.Popen(
        [sys.executable, "-c", SINGLE_PROCESS, json.dumps(cfg)],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:

        def up() -> bool:
            try:
                return httpx.get(url + "/v1/models", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        assert wait_until(up, timeout_s=60)
        r = httpx.post(url + "/v1/chat/completions", json={**chat(1, tokens=3), "stream": False}, timeout=30)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
        assert u.stats()["completed"] == 1
    finally:
        proc.terminate()
        proc.wait(30)
