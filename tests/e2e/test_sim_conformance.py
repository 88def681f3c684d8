"""The engine simulator answers like vLLM: the same requests to both, compared field by field.

Each case goes to the real engine and to an `engine_sim` of the same role and model. JSON bodies, SSE
event sequences (event names and each event's data) and error bodies must have the same structure:
the same keys at every level, the same JSON types, lists of the same length; the fields a client or
the Coordinator branches on (`object`, `type`, `finish_reason`, error `code`...) must also have the same
value. Generated text, ids, timestamps and numbers may differ. All differences are reported at once.
"""

from __future__ import annotations

import json

import httpx
import pytest

from engine_sim import SimConfig, launch

pytestmark = pytest.mark.vllm

# Fields whose values must match too, wherever they appear.
SAME_VALUE = {
    "object",
    "type",
    "role",
    "finish_reason",
    "stop_reason",
    "stop_sequence",
    "code",
    "param",
    "model",
    "index",
    "do_remote_prefill",
    "do_remote_decode",
    "transfer_mode",
    "tp_size",
    "dcp_size",
    "pp_size",
    "remote_host",
    "remote_blocks_expiry_time",
    "remote_prefill_cached_tokens",
}
CHAT = [{"role": "user", "content": "Compare these two answers, please."}]
FIXED = {"max_tokens": 4, "temperature": 0, "ignore_eos": True}
RESPONSE = {"max_output_tokens": 4, "temperature": 0, "ignore_eos": True}
PREFILL_TICKET = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def _kind(v) -> str:
    return (
        "null"
        if v is None
        else {bool: "bool", int: "number", float: "number", str: "str"}.get(type(v), type(v).__name__)
    )


def _kinds(items: list) -> list[str]:
    return sorted({_kind(v) for v in items})


def diff(real, sim, path: str = "$") -> list[str]:
    """Structural differences between a real vLLM JSON value and the simulator's."""
    if isinstance(real, dict) and isinstance(sim, dict):
        out = []
        for key in sorted(set(real) | set(sim)):
            where = f"{path}.{key}"
            if key not in sim:
                out.append(f"{where}: vllm has it ({json.dumps(real[key])[:60]}), sim does not")
            elif key not in real:
                out.append(f"{where}: sim has it ({json.dumps(sim[key])[:60]}), vllm does not")
            elif key in SAME_VALUE and not isinstance(real[key], (dict, list)) and real[key] != sim[key]:
                out.append(f"{where}: vllm {real[key]!r}, sim {sim[key]!r}")
            else:
                out += diff(real[key], sim[key], where)
        return out
    if isinstance(real, list) and isinstance(sim, list):
        if all(not isinstance(v, (dict, list)) for v in real + sim):  # a token's bytes: values, not structure
            if real and sim and _kinds(real) != _kinds(sim):
                return [f"{path}: vllm {_kinds(real)}, sim {_kinds(sim)}"]
            return []
        if len(real) != len(sim):
            return [f"{path}: vllm has {len(real)} items, sim {len(sim)}"]
        return [d for i, (a, b) in enumerate(zip(real, sim)) for d in diff(a, b, f"{path}[{i}]")]
    if _kind(real) != _kind(sim):
        return [f"{path}: vllm {_kind(real)} ({json.dumps(real)[:60]}), sim {_kind(sim)} ({json.dumps(sim)[:60]})"]
    return []


def sse(text: str) -> list[dict]:
    """Each SSE event as {"event": name or None, "data": parsed JSON or the raw string}."""
    events = []
    for block in text.replace("\r\n", "\n").split("\n\n"):
        name, data = None, []
        for line in block.split("\n"):
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                data.append(line[5:].strip())
        if data:
            raw = "\n".join(data)
            try:
                payload = json.loads(raw)
            except ValueError:
                payload = raw
            events.append({"event": name, "data": payload})
    return events


def _token_delta(event: dict) -> bool:
    """A stream event that carries generated text and nothing else: an OpenAI chunk with no role, finish or
    usage, or an Anthropic content_block_delta."""
    data = event["data"]
    if event["event"] in ("content_block_delta", "response.output_text.delta"):
        return True
    if event["event"] is not None or not isinstance(data, dict) or data.get("usage"):
        return False
    choices = data.get("choices")
    if not isinstance(choices, list) or len(choices) != 1 or choices[0].get("finish_reason") is not None:
        return False
    delta = choices[0].get("delta")
    return ("text" in choices[0]) if delta is None else (set(delta) == {"content"})


def token_runs_collapsed(events: list[dict]) -> list[dict]:
    """The stream with each run of consecutive text-only events of one shape as its first event.

    vLLM merges the deltas of a request that its API server has not sent yet (v1 RequestOutputCollector),
    so on a loaded machine two tokens can arrive as one event: how many text events there are depends on
    timing, what each looks like does not (an event of another shape in the run is kept, and compared).
    """
    out = []
    for event in events:
        if out and _token_delta(event) and _token_delta(out[-1]) and not diff(out[-1], event):
            continue
        out.append(event)
    return out


def exchange(url: str, path: str, body) -> dict:
    kw = {"content": body} if isinstance(body, (str, bytes)) else {"json": body}
    r = httpx.post(url + path, headers={"content-type": "application/json"}, timeout=120, **kw)
    ctype = r.headers.get("content-type", "").split(";")[0]
    parsed = token_runs_collapsed(sse(r.text)) if ctype == "text/event-stream" else r.json()
    return {"status": r.status_code, "content-type": ctype, "body": parsed}


@pytest.fixture(scope="module")
def sims(model):
    # vLLM's CPU backend uses 128-token KV blocks (16 on GPUs, the simulator's default).
    cfg = dict(model=model, max_model_len=512, block_size=128, anthropic_cache_usage=True, speedup=50)
    handles = {role: launch(SimConfig(role=role, **cfg)) for role in ("union", "prefill")}
    yield handles
    for h in handles.values():
        h.stop()


def cases(model: str) -> dict:
    too_long = "word " * 600
    return {
        "chat json": ("/v1/chat/completions", {"model": model, "messages": CHAT, **FIXED}),
        "chat json logprobs": (
            "/v1/chat/completions",
            {"model": model, "messages": CHAT, "logprobs": True, "top_logprobs": 2, **FIXED},
        ),
        "chat stream": ("/v1/chat/completions", {"model": model, "messages": CHAT, "stream": True, **FIXED}),
        "chat stream usage": (
            "/v1/chat/completions",
            {"model": model, "messages": CHAT, "stream": True, "stream_options": {"include_usage": True}, **FIXED},
        ),
        "completions json": ("/v1/completions", {"model": model, "prompt": "def f(x):", **FIXED}),
        "completions stream usage": (
            "/v1/completions",
            {"model": model, "prompt": "def f(x):", "stream": True, "stream_options": {"include_usage": True}, **FIXED},
        ),
        "completions echo without generation": (
            "/v1/completions",
            {"model": model, "prompt": "def f(x):", **FIXED, "echo": True, "max_tokens": 0},
        ),
        "messages json": ("/v1/messages", {"model": model, "messages": CHAT, "max_tokens": 4, "temperature": 0}),
        "messages stream": (
            "/v1/messages",
            {"model": model, "messages": CHAT, "max_tokens": 4, "temperature": 0, "stream": True},
        ),
        "messages system": ("/v1/messages", {"model": model, "system": "Be brief.", "messages": CHAT, "max_tokens": 2}),
        "count_tokens": ("/v1/messages/count_tokens", {"model": model, "messages": CHAT}),
        "error unknown model": ("/v1/chat/completions", {"model": "no-such-model", "messages": CHAT, "max_tokens": 2}),
        "error no messages": ("/v1/chat/completions", {"model": model, "max_tokens": 2}),
        "error bad json": ("/v1/chat/completions", b'{"model": '),
        "error prompt too long": ("/v1/completions", {"model": model, "prompt": too_long, "max_tokens": 2}),
        "error completions max_tokens 0": ("/v1/completions", {"model": model, "prompt": "def f(x):", "max_tokens": 0}),
        "error max_tokens over context": (
            "/v1/chat/completions",
            {"model": model, "messages": CHAT, "max_tokens": 100000},
        ),
        "error messages unknown model": ("/v1/messages", {"model": "no-such-model", "messages": CHAT, "max_tokens": 2}),
        "error messages no max_tokens": ("/v1/messages", {"model": model, "messages": CHAT}),
        "responses json": ("/v1/responses", {"model": model, "input": "Compare these.", **RESPONSE}),
        "responses stream": ("/v1/responses", {"model": model, "input": "Compare these.", "stream": True, **RESPONSE}),
        "responses items and instructions": (
            "/v1/responses",
            {"model": model, "input": [{"role": "user", "content": "Hi"}], "instructions": "Be brief.", **RESPONSE},
        ),
        "responses unstored": ("/v1/responses", {"model": model, "input": "Compare.", "store": False, **RESPONSE}),
        "error responses no input": ("/v1/responses", {"model": model, "max_output_tokens": 2}),
        "error responses prompt too long": ("/v1/responses", {"model": model, "input": too_long, **RESPONSE}),
        "error responses unknown previous": (
            "/v1/responses",
            {"model": model, "input": "x", "previous_response_id": "resp_never", **RESPONSE},
        ),
    }


CASE_NAMES = list(cases("m"))


@pytest.mark.parametrize("case", CASE_NAMES)
def test_union_engine_and_sim_answer_alike(case, engines, sims, model):
    path, body = cases(model)[case]
    real = exchange(engines["union"].url, path, body)
    sim = exchange(sims["union"].url, path, body)
    differences = diff(real, sim)
    assert not differences, f"{case}: the simulator differs from vLLM:\n" + "\n".join(differences)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses"])
def test_prefill_leg_answer_and_ticket_alike(path, engines, sims, model):
    body = {"model": model, "max_tokens": 1, "stream": False, "kv_transfer_params": PREFILL_TICKET}
    if path == "/v1/completions":
        body["prompt"] = "def f(x):"
    elif path == "/v1/responses":  # as serving/legs.py sends it
        del body["max_tokens"]
        body.update(input="Compare these.", max_output_tokens=1, store=False, background=False)
    else:
        body["messages"] = CHAT
    if path != "/v1/messages":
        body["ignore_eos"] = True
    real = exchange(engines["prefill"].url, path, body)
    sim = exchange(sims["prefill"].url, path, body)
    assert real["status"] == 200 and isinstance(real["body"].get("kv_transfer_params"), dict), real
    differences = diff(real, sim)
    assert not differences, "the simulator's prefill answer differs from vLLM:\n" + "\n".join(differences)


def test_stored_responses_alike(engines, sims, model):
    """GET, cancel, DELETE and a follow-up of a stored response (the engines run with
    VLLM_ENABLE_RESPONSES_API_STORE=1), and of an unknown id: same statuses, same bodies' structure."""
    answers = {}
    for who, url in (("vllm", engines["union"].url), ("sim", sims["union"].url)):
        first = httpx.post(
            url + "/v1/responses", json={"model": model, "input": "Remember me.", **RESPONSE}, timeout=120
        )
        rid = first.json()["id"]
        calls = {
            "get": httpx.get(f"{url}/v1/responses/{rid}", timeout=30),
            "get unknown": httpx.get(f"{url}/v1/responses/resp_never", timeout=30),
            "cancel finished": httpx.post(f"{url}/v1/responses/{rid}/cancel", timeout=30),
            "cancel unknown": httpx.post(f"{url}/v1/responses/resp_never/cancel", timeout=30),
            "delete": httpx.delete(f"{url}/v1/responses/{rid}", timeout=30),
            "follow-up": httpx.post(
                url + "/v1/responses",
                json={"model": model, "input": "Again.", "previous_response_id": rid, **RESPONSE},
                timeout=120,
            ),
        }
        answers[who] = {name: {"status": r.status_code, "body": r.json()} for name, r in calls.items()}
    real, sim = answers["vllm"], answers["sim"]
    assert {k: v["status"] for k, v in real.items()} == {k: v["status"] for k, v in sim.items()}
    differences = diff(real, sim)
    assert not differences, "the simulator's stored responses differ from vLLM:\n" + "\n".join(differences)
