"""serving/legs.py without a server: the decode leg is the client's body plus P's ticket, and nothing else."""

from __future__ import annotations

import json

import pytest

from engines import joined
from serving.families import CHAT, MESSAGES
from serving.job import job_from_body, parse_body
from serving.legs import PREFILL_TICKET, decode_wire, prefill_body, prefill_wire

TICKET = {"do_remote_prefill": True, "remote_block_ids": [[1, 2]], "remote_host": "10.0.0.7", "remote_port": 5600}


def job(raw: bytes):
    return job_from_body(CHAT, raw, parse_body(raw), "rid-1")


@pytest.mark.parametrize(
    "raw",
    [
        b'{"model":"m","messages":[{"role":"user","content":"hi \\u00e9"}],"max_tokens":4,"stream":true}',
        b'  \n {"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": 0.5}  ',
    ],
)
def test_decode_leg_is_the_client_body_plus_the_ticket(raw):
    out = joined(decode_wire(job(raw), TICKET))
    assert json.loads(out) == {**json.loads(raw), "kv_transfer_params": TICKET}
    assert out.endswith(raw[raw.index(b"{") + 1 :])  # the client's own bytes, not a re-encoding of them
    assert decode_wire(job(raw), None) == raw  # no ticket (missed handoff): the body as the client sent it


def test_a_client_ticket_is_replaced_or_dropped():
    raw = b'{"model":"m","messages":[{"role":"user","content":"x"}],"kv_transfer_params":{"remote_host":"evil"}}'
    sent = joined(decode_wire(job(raw), TICKET))
    assert sent.count(b"kv_transfer_params") == 1 and json.loads(sent)["kv_transfer_params"] == TICKET
    assert "kv_transfer_params" not in json.loads(joined(decode_wire(job(raw), None)))


def test_an_escaped_key_is_still_the_client_ticket():
    # JSON escapes spell the same key: it must not survive next to (and after) the real ticket.
    raw = b'{"model":"m","messages":[{"role":"user","content":"x"}],"kv_transfer\\u005fparams":{"remote_host":"evil"}}'
    sent = json.loads(joined(decode_wire(job(raw), TICKET)))
    assert sent["kv_transfer_params"] == TICKET


@pytest.mark.parametrize(
    "choice,prefill_choice",
    [
        ({"type": "tool", "name": "t"}, {"type": "any"}),
        (
            {"type": "tool", "name": "t", "disable_parallel_tool_use": False},
            {"type": "any", "disable_parallel_tool_use": False},
        ),
        ({"type": "auto"}, {"type": "auto"}),
        ({"type": "any", "disable_parallel_tool_use": True}, {"type": "any", "disable_parallel_tool_use": True}),
        ({"type": "none"}, {"type": "none"}),
    ],
)
def test_messages_prefill_leg_turns_a_named_tool_choice_into_any(choice, prefill_choice):
    raw = json.dumps(
        {
            "model": "m",
            "max_tokens": 9,
            "messages": [{"role": "user", "content": "x"}],
            "tools": [{"name": "t", "input_schema": {"type": "object"}}],
            "tool_choice": choice,
        }
    ).encode()
    j = job_from_body(MESSAGES, raw, parse_body(raw), "rid-1")
    assert prefill_body(j)["tool_choice"] == prefill_choice and prefill_body(j)["tools"] == j.body["tools"]
    assert j.body["tool_choice"] == choice and json.loads(joined(decode_wire(j, TICKET)))["tool_choice"] == choice


@pytest.mark.parametrize(
    "raw",
    [
        b'{"model":"m","messages":[{"role":"user","content":"' + b"long prompt \\u00e9 " * 60000 + b'"}],"stream":true,'
        b'"stream_options":{"include_usage":true},"stop":["x"],"stop_token_ids":[3],"min_tokens":2,"n":1,'
        b'"max_completion_tokens":9,"kv_transfer_params":{"remote_host":"evil"}}',
        b' {"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": 0.5 }\n',
    ],
)
def test_the_prefill_leg_is_the_client_bytes_with_its_changes_appended(raw):
    j = job(raw)
    out = joined(prefill_wire(j))
    assert out.startswith(raw[: raw.rindex(b"}")])  # the prompt copied as it came, not re-encoded
    read = json.loads(out)  # (a key's last value is the one read, as vLLM's JSON reader reads it)
    neutral = {"stream_options": None, "stop": None, "stop_token_ids": None, "min_tokens": 0}
    assert read == {**prefill_body(j), **{k: v for k, v in neutral.items() if k in j.body}}
    assert read["kv_transfer_params"] == PREFILL_TICKET and read["stream"] is False and read["max_tokens"] == 1
    assert read["ignore_eos"] is True and read["messages"] == j.body["messages"]


def test_the_legs_send_the_clients_bytes_without_a_copy():
    """A prompt of megabytes is sent from the client's own bytes: each leg's prompt part is a view of them."""
    raw = b'{"model":"m","messages":[{"role":"user","content":"' + b"x" * 300_000 + b'"}],"stop":["y"]}'
    j = job(raw)
    for body in (prefill_wire(j), decode_wire(j, TICKET)):
        views = [p for p in body if isinstance(p, memoryview)]
        assert any(v.obj is raw and v.nbytes > 299_000 for v in views)
        assert sum(len(p) for p in body if not (isinstance(p, memoryview) and p.obj is raw)) < 400
