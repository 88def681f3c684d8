"""vLLM's /tokenize and /detokenize through the Coordinator: sent to one engine of the body's model (a PD pair's
prefill or decode engine, a union engine), answered as that engine answers them, with keys as for inference and
refusals in OpenAI's envelope. Asked through the openai SDK's raw client and as `vllm bench serve`'s aiohttp
requests are made."""

from __future__ import annotations

import asyncio

import aiohttp
import httpx
import openai
import pytest

from harness.configs import api_keys, coordinator_config, instance
from harness.coordinator import Coordinator

PD_MODEL, UNION_MODEL = "tok-pd", "tok-union"
KEY = "sk-tokenize-1"
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Héllo, how long is this?"}]
PROMPT = "The quick brown fox jumps over the lazy dog 🦊."


@pytest.fixture(scope="module")
def served(module_sims):
    p, d = module_sims("prefill", model=PD_MODEL), module_sims("decode", model=PD_MODEL)
    u = module_sims("union", model=UNION_MODEL, max_model_len=4096)
    instances = [
        instance(1, "prefill", PD_MODEL, p.address),
        instance(2, "decode", PD_MODEL, d.address),
        instance(3, "union", UNION_MODEL, u.address),
    ]
    with Coordinator(coordinator_config(instances, api_key_config=api_keys(KEY))) as coord:
        coord.engines = {PD_MODEL: (p, d), UNION_MODEL: (u,)}
        yield coord


def sdk(coord) -> openai.OpenAI:
    return openai.OpenAI(base_url=coord.url + "/v1", api_key=KEY, max_retries=0, timeout=30)


def ask(coord, route: str, body: dict) -> dict:
    """The SDK's raw client: vLLM's routes sit at the root, beside /v1."""
    return sdk(coord).post(coord.url + route, cast_to=object, body=body)


@pytest.mark.parametrize("model", [PD_MODEL, UNION_MODEL])
@pytest.mark.parametrize(
    "body",
    [
        {"prompt": PROMPT},
        {"prompt": PROMPT, "add_special_tokens": False, "return_token_strs": True},
        {"messages": CHAT},
        {"messages": CHAT, "add_generation_prompt": False, "return_token_strs": True},
        {"messages": CHAT, "continue_final_message": True, "add_generation_prompt": False},
    ],
    ids=["prompt", "prompt-strs", "chat", "chat-no-generation-prompt", "chat-continue"],
)
def test_tokenize_answers_as_the_engine(served, model, body):
    body = {"model": model, **body}
    engines = served.engines[model]
    before = [len(e.requests()) for e in engines]
    got = ask(served, "/tokenize", body)
    # One engine of the model got the client's body as it was sent, on vLLM's own route.
    sent = [r for e, n in zip(engines, before, strict=True) for r in e.requests()[n:]]
    assert [(r["path"], r["body"]) for r in sent] == [("/tokenize", body)]
    direct = httpx.post(engines[0].url + "/tokenize", json=body).json()
    assert got == direct
    assert set(got) == {"count", "max_model_len", "tokens", "token_strs"}
    assert got["count"] == len(got["tokens"]) > 5
    assert got["max_model_len"] == (4096 if model == UNION_MODEL else 8192)
    if body.get("return_token_strs"):
        assert len(got["token_strs"]) == got["count"]
    else:
        assert got["token_strs"] is None
    back = ask(served, "/detokenize", {"model": model, "tokens": got["tokens"]})
    assert set(back) == {"prompt"}
    if "prompt" in body:
        assert back["prompt"] == PROMPT
    else:
        assert "Héllo, how long is this?" in back["prompt"]


def test_a_chat_and_its_prompt_count_alike_and_the_generation_prompt_counts(served):
    with_turn = ask(served, "/tokenize", {"model": PD_MODEL, "messages": CHAT})
    without = ask(served, "/tokenize", {"model": PD_MODEL, "messages": CHAT, "add_generation_prompt": False})
    assert without["count"] < with_turn["count"]
    text = ask(served, "/detokenize", {"model": PD_MODEL, "tokens": with_turn["tokens"]})["prompt"]
    assert ask(served, "/tokenize", {"model": PD_MODEL, "prompt": text})["tokens"] == with_turn["tokens"]


def test_refusals_are_openai_errors(served):
    client = sdk(served)
    with pytest.raises(openai.NotFoundError) as e:
        ask(served, "/tokenize", {"model": "no-such-model", "prompt": "x"})
    assert e.value.body["message"] == "The model `no-such-model` does not exist." and e.value.body["param"] == "model"
    with pytest.raises(openai.NotFoundError) as chat:  # as chat answers the same model
        client.chat.completions.create(model="no-such-model", messages=CHAT)
    assert chat.value.body == e.value.body
    with pytest.raises(openai.NotFoundError):
        ask(served, "/detokenize", {"model": "no-such-model", "tokens": [1]})
    for route, body, param in [
        ("/tokenize", {"model": PD_MODEL}, "prompt"),
        ("/tokenize", {"model": PD_MODEL, "prompt": 7}, "prompt"),
        ("/tokenize", {"prompt": "two models are served here"}, "model"),
        ("/detokenize", {"model": PD_MODEL, "tokens": [-1]}, "tokens"),
        ("/detokenize", {"model": PD_MODEL}, "tokens"),
    ]:
        with pytest.raises(openai.BadRequestError) as bad:
            ask(served, route, body)
        assert bad.value.body["param"] == param, (route, body, bad.value.body)
        assert bad.value.body["type"] == "invalid_request_error"
    for route in ("/tokenize", "/detokenize"):
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            r = httpx.post(served.url + route, json={"model": PD_MODEL, "prompt": "x", "tokens": [1]}, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    r = httpx.post(served.url + "/tokenize", content=b'{"prompt": "x"}', headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 415 and "error" in r.json()


def test_a_body_without_a_model_goes_to_the_one_model_served(sims):
    u = sims("union")
    with Coordinator(coordinator_config([instance(1, "union", "only", u.address)])) as coord:
        got = sdk(coord).post(coord.url + "/tokenize", cast_to=object, body={"prompt": PROMPT})
        assert got == httpx.post(u.url + "/tokenize", json={"prompt": PROMPT}).json()
        assert u.requests()[-1]["body"] == {"prompt": PROMPT}
        back = sdk(coord).post(coord.url + "/detokenize", cast_to=object, body={"tokens": got["tokens"]})
        assert back == {"prompt": PROMPT}


def test_vllm_bench_serve_style_requests(served):
    """As vllm's benchmark clients post: one aiohttp session, JSON bodies, the key as a bearer token; many at
    once."""

    async def run() -> list[tuple[int, dict]]:
        headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:

            async def post(route: str, payload: dict) -> tuple[int, dict]:
                async with session.post(served.url + route, json=payload, headers=headers) as r:
                    return r.status, await r.json()

            bodies = [
                ("/tokenize", {"model": model, "prompt": f"{PROMPT} {i}"})
                for i in range(8)
                for model in (PD_MODEL, UNION_MODEL)
            ] + [("/tokenize", {"model": UNION_MODEL, "messages": CHAT})]
            answers = await asyncio.gather(*(post(route, payload) for route, payload in bodies))
            ids = answers[0][1]["tokens"]
            answers.append(await post("/detokenize", {"model": PD_MODEL, "tokens": ids}))
            return answers

    answers = asyncio.run(run())
    assert all(status == 200 for status, _ in answers), answers
    assert all(a["count"] == len(a["tokens"]) > 0 for _, a in answers[:-1])
    assert answers[-1][1] == {"prompt": f"{PROMPT} 0"}
