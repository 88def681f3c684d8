"""The request models (serving/protocol/) without a server: what each route refuses and how it says so, what
it reads (pydantic's lax mode, as vLLM's request models read), and the OpenAPI schemas made from the same
models."""

from __future__ import annotations

import dataclasses
import random

import pytest

from errors import InvalidRequest
from handlers.docs import openapi_schema
from serving.families import CHAT, COMPLETIONS, COUNT_TOKENS, MESSAGES, METASERVER, Family
from serving.job import job_from_body, parse_body
from serving.protocol import validate
from serving.protocol.anthropic import CountTokensRequest, MessagesRequest
from serving.protocol.metaserver import MetaserverCall
from serving.protocol.openai import (
    ChatCompletionBody,
    ChatCompletionRequest,
    CompletionBody,
    CompletionRequest,
    read_plain_chat,
)

USER = [{"role": "user", "content": "hi"}]
USER_E = [{"role": "user", "content": "\u00e9 ok"}]
VALID = {
    CHAT: {"model": "m", "messages": USER},
    COMPLETIONS: {"model": "m", "prompt": "hi"},
    MESSAGES: {"model": "m", "messages": USER, "max_tokens": 8},
    COUNT_TOKENS: {"model": "m", "messages": USER},
    METASERVER: {"model": "m", "messages": USER, "kv_transfer_params": {"request_id": "r1", "do_remote_decode": True}},
}
ABSENT = object()
TOOLS = [{"name": "get_weather", "input_schema": {"type": "object"}}]


def job(route: Family, **fields):
    body = {**VALID[route], **fields}
    for key in [k for k, v in fields.items() if v is ABSENT]:
        del body[key]
    return job_from_body(route, b"{}", body, "rid")


REFUSED = [
    (CHAT, {"model": ABSENT}, "'model' is required and must be a non-empty string", "model"),
    (CHAT, {"model": ""}, "'model' is required and must be a non-empty string", "model"),
    (CHAT, {"model": 5}, "'model' is required and must be a non-empty string", "model"),
    (CHAT, {"stream": "true"}, "'stream' must be a boolean", "stream"),
    (CHAT, {"messages": ABSENT}, "'messages' is required and must be a non-empty list", "messages"),
    (CHAT, {"messages": []}, "'messages' is required and must be a non-empty list", "messages"),
    (CHAT, {"messages": "hi"}, "'messages' is required and must be a non-empty list", "messages"),
    (CHAT, {"messages": [5]}, "messages[0] must be an object with 'role' and 'content'", "messages[0]"),
    (
        CHAT,
        {"messages": [*USER, {"content": "x"}]},
        "messages[1].role is required and must be a non-empty string",
        "messages[1].role",
    ),
    (
        CHAT,
        {"messages": [{"role": "", "content": "x"}]},
        "messages[0].role is required and must be a non-empty string",
        "messages[0].role",
    ),
    (CHAT, {"messages": [{"role": "user"}]}, "messages[0].content is required", "messages[0].content"),
    (
        CHAT,
        {"messages": [{"role": "assistant", "content": 5}]},
        "messages[0].content must be a string or a list of parts",
        "messages[0].content",
    ),
    (CHAT, {"tools": {"name": "t"}}, "'tools' must be a list", "tools"),
    (CHAT, {"max_tokens": 0}, "'max_tokens' must be a positive integer", "max_tokens"),
    (CHAT, {"max_tokens": 2.5}, "'max_tokens' must be a positive integer", "max_tokens"),
    (
        CHAT,
        {"max_completion_tokens": "x"},
        "'max_completion_tokens' must be a positive integer",
        "max_completion_tokens",
    ),
    (CHAT, {"stream_options": []}, "'stream_options' must be an object", "stream_options"),
    (
        CHAT,
        {"stream_options": {"include_usage": True}},
        "Stream options can only be defined when `stream=True`.",
        "stream_options",
    ),
    (CHAT, {"stop": 5}, "'stop' must be a string or a list of strings", "stop"),
    (CHAT, {"stop": ["ok", 7]}, "'stop' must be a string or a list of strings", "stop"),
    (CHAT, {"stop_token_ids": [1, True]}, "'stop_token_ids' must be a list of integers", "stop_token_ids"),
    (CHAT, {"stop_token_ids": [2.0]}, "'stop_token_ids' must be a list of integers", "stop_token_ids"),
    (CHAT, {"min_tokens": -1}, "'min_tokens' must be an integer >= 0", "min_tokens"),
    (CHAT, {"min_tokens": None}, "'min_tokens' must be an integer >= 0", "min_tokens"),
    (
        CHAT,
        {"min_tokens": "5", "max_tokens": "4"},
        "min_tokens must be less than or equal to max_tokens=4, got 5.",
        "min_tokens",
    ),
    (
        CHAT,
        {"min_tokens": 9, "max_completion_tokens": 4, "max_tokens": 100},
        "min_tokens must be less than or equal to max_tokens=4, got 9.",
        "min_tokens",
    ),
    # Two faults: the first in the order the fields are checked is the one reported.
    (CHAT, {"messages": [], "max_tokens": 0}, "'messages' is required and must be a non-empty list", "messages"),
    (
        CHAT,
        {"messages": [{"role": "user"}, {"content": "x"}]},
        "messages[0].content is required",
        "messages[0].content",
    ),
    (
        CHAT,
        {"stream_options": {"include_usage": True}, "stop": 5},
        "Stream options can only be defined when `stream=True`.",
        "stream_options",
    ),
    (
        CHAT,
        {"messages": [*USER, {"role": "", "content": "x"}]},
        "messages[1].role is required and must be a non-empty string",
        "messages[1].role",
    ),
    (
        CHAT,
        {"messages": [{"role": "user", "content": 5}, {"role": ""}]},
        "messages[0].content must be a string or a list of parts",
        "messages[0].content",
    ),
    (COMPLETIONS, {"prompt": ABSENT}, "'prompt' is required", "prompt"),
    (COMPLETIONS, {"prompt": []}, "'prompt' must be a string, a list of strings or a list of token ids", "prompt"),
    (COMPLETIONS, {"prompt": 5}, "'prompt' must be a string, a list of strings or a list of token ids", "prompt"),
    (COMPLETIONS, {"max_tokens": 0}, "'max_tokens' must be a positive integer", "max_tokens"),
    (COMPLETIONS, {"max_tokens": 0, "echo": "no"}, "'max_tokens' must be a positive integer", "max_tokens"),
    (
        COMPLETIONS,
        {"echo": True, "max_tokens": 0, "min_tokens": 2},
        "min_tokens must be less than or equal to max_tokens=1, got 2.",
        "min_tokens",
    ),
    (MESSAGES, {"max_tokens": ABSENT}, "'max_tokens' is required and must be a positive integer", "max_tokens"),
    (MESSAGES, {"max_tokens": None}, "'max_tokens' is required and must be a positive integer", "max_tokens"),
    (MESSAGES, {"max_tokens": "lots"}, "'max_tokens' must be a positive integer", "max_tokens"),
    (
        MESSAGES,
        {"messages": [{"role": "user", "content": None}]},
        "messages[0].content is required",
        "messages[0].content",
    ),
    (MESSAGES, {"messages": [{"role": "assistant"}]}, "messages[0].content is required", "messages[0].content"),
    (MESSAGES, {"max_tokens": 0, "messages": []}, "'max_tokens' must be a positive integer", "max_tokens"),
    (MESSAGES, {"stop_sequences": "END"}, "'stop_sequences' must be a list of strings", "stop_sequences"),
    (
        MESSAGES,
        {"tools": TOOLS, "tool_choice": {"type": "tool"}},
        "tool_choice.name is required when type is 'tool'",
        "tool_choice.name",
    ),
    (
        MESSAGES,
        {"tools": TOOLS, "tool_choice": {"type": "tool", "name": "nope"}},
        "Tool 'nope' has not been passed in `tools`.",
        "tool_choice",
    ),
    (
        MESSAGES,
        {"tool_choice": {"type": "tool", "name": "{param}"}},
        "Tool '{param}' has not been passed in `tools`.",
        "tool_choice",
    ),
    (
        MESSAGES,
        {"thinking": {"type": "enabled", "budget_tokens": "lots"}},
        "'thinking.budget_tokens' must be an integer >= 1024",
        "thinking.budget_tokens",
    ),
    (
        MESSAGES,
        {"thinking": {"type": "enabled", "budget_tokens": 1024}},
        "thinking.budget_tokens must be less than max_tokens",
        "thinking.budget_tokens",
    ),
    (COUNT_TOKENS, {"messages": [{"role": "user"}]}, "messages[0].content is required", "messages[0].content"),
    (COUNT_TOKENS, {"tools": "t"}, "'tools' must be a list", "tools"),
    (
        METASERVER,
        {"kv_transfer_params": ABSENT},
        "'kv_transfer_params' is required and must be an object",
        "kv_transfer_params",
    ),
    (
        METASERVER,
        {"kv_transfer_params": {"do_remote_decode": True}},
        "'kv_transfer_params.request_id' is required",
        "kv_transfer_params.request_id",
    ),
    (
        METASERVER,
        {"kv_transfer_params": {"request_id": "a b", "do_remote_decode": True}},
        "'kv_transfer_params.request_id' must be at most 128 characters of printable ASCII without spaces",
        "kv_transfer_params.request_id",
    ),
    (
        METASERVER,
        {"kv_transfer_params": {"request_id": "r\ud800", "do_remote_decode": True}},
        "'kv_transfer_params.request_id' must be at most 128 characters of printable ASCII without spaces",
        "kv_transfer_params.request_id",
    ),
    (
        METASERVER,
        {"kv_transfer_params": {"request_id": "r", "do_remote_decode": True, "do_remote_prefill": 1}},
        "exactly one of kv_transfer_params.do_remote_prefill and do_remote_decode must be true",
        "kv_transfer_params",
    ),
    (METASERVER, {"messages": ABSENT}, "one of 'messages' or 'prompt' is required", "messages"),
    (
        METASERVER,
        {"messages": [{"role": "user", "content": 5}]},
        "messages[0].content must be a string or a list of parts",
        "messages[0].content",
    ),
]


@pytest.mark.parametrize("route, fields, message, param", REFUSED)
def test_a_refusal_names_its_field(route, fields, message, param):
    with pytest.raises(InvalidRequest) as e:
        job(route, **fields)
    assert (e.value.status, e.value.message, e.value.param) == (400, message, param)


@pytest.mark.parametrize(
    "route, fields",
    [
        (CHAT, {"messages": [{"role": "assistant", "tool_calls": []}]}),  # an assistant turn may omit its content
        (CHAT, {"messages": [{"role": "user", "content": None}]}),  # null content: the engine's to judge
        (CHAT, {"messages": [{"role": "ipython", "content": [{"type": "text", "text": "x"}]}]}),
        (CHAT, {"max_completion_tokens": 5, "max_tokens": "x"}),  # the first one set is the cap; the other unread
        (CHAT, {"stream": None, "stream_options": {}}),  # vLLM refuses only non-empty stream options
        (CHAT, {"stream": True, "stream_options": {"include_usage": True}, "stop": "x", "stop_token_ids": [1]}),
        (CHAT, {"n": "many", "echo": 3, "top_logprobs": "x", "response_format": {"type": "json_object"}}),
        (COMPLETIONS, {"prompt": ABSENT, "prompt_embeds": "e"}),
        (COMPLETIONS, {"prompt": [1.5, {}]}),  # a non-empty list: its items are the engine's to judge
        (MESSAGES, {"messages": [{"role": "system", "content": "be brief"}, *USER]}),
        (MESSAGES, {"tools": TOOLS, "tool_choice": {"type": "tool", "name": "get_weather"}}),
        (MESSAGES, {"tool_choice": "auto", "thinking": "on", "stop_sequences": None}),
        (COUNT_TOKENS, {"stream": "not read", "max_tokens": "not read"}),
        (METASERVER, {"messages": ABSENT, "prompt": "hi", "stream_options": {"x": 1}, "min_tokens": -1}),
        # A lone surrogate (JSON may carry one): the model is then unknown (404), the message the engine's.
        (CHAT, {"model": "no-such-\ud800", "messages": [{"role": "\ud800", "content": "cut \ud83d"}]}),
        (MESSAGES, {"messages": [{"role": "user\udc00", "content": "\ud83d"}]}),
    ],
)
def test_what_is_the_engines_to_judge_passes(route, fields):
    assert job(route, **fields).model == fields.get("model", "m")


@pytest.mark.parametrize("value", ["4", 4.0, " 4 ", "4.0"])
def test_integers_are_read_in_pydantic_lax_mode(value):
    assert job(CHAT, max_tokens=value).max_tokens == 4
    assert job(MESSAGES, max_tokens=value).max_tokens == 4
    assert job(COMPLETIONS, max_tokens=value, min_tokens=value).max_tokens == 4


def test_the_output_budget_each_route_takes():
    assert job(CHAT).max_tokens == 256 and job(COMPLETIONS).max_tokens == 256
    assert job(CHAT, max_completion_tokens=7, max_tokens=9).max_tokens == 7
    assert job(COMPLETIONS, echo="yes", max_tokens=0).max_tokens == 1  # prompt scoring: vLLM runs it with 1
    assert job(MESSAGES, max_tokens="12").max_tokens == 12
    assert job(COUNT_TOKENS).max_tokens == 0 and job(COUNT_TOKENS, stream=True).stream is False


@pytest.mark.parametrize(
    "route, fields, computes",
    [
        (CHAT, {}, False),
        (CHAT, {"n": "2"}, True),
        (CHAT, {"n": 2.0}, True),
        (CHAT, {"n": "two"}, False),  # unreadable: the engine refuses it, no child sequence
        (CHAT, {"best_of": 3, "n": 1}, True),
        (CHAT, {"echo": "yes"}, True),
        (CHAT, {"echo": True, "top_logprobs": None}, False),
        (CHAT, {"echo": "maybe"}, False),
        (COMPLETIONS, {"echo": "on", "logprobs": 1}, True),
        (COMPLETIONS, {"echo": "t", "max_tokens": 0}, True),
        (COMPLETIONS, {"prompt": [1, 2, 3]}, False),
        (COMPLETIONS, {"prompt": ["a", "b"]}, True),
        (COMPLETIONS, {"prompt": ABSENT, "prompt_embeds": ["e1", "e2"]}, True),
        (MESSAGES, {"n": 2}, True),
        (MESSAGES, {"prompt_logprobs": 0}, True),
    ],
)
def test_what_one_kv_ticket_cannot_carry_is_read_as_vllm_reads_it(route, fields, computes):
    assert job(route, **fields).decode_computes_prompt is computes


# What the plain chat reader is judged on: each field's plain values and the ones it must leave to the model.
CHAT_POOLS = {
    "model": ["m", "", 5, None, "no-such-\ud800", ABSENT],
    "messages": [
        USER,
        [],
        "hi",
        [5],
        [{"role": "user", "content": None}],
        [{"role": "", "content": "x"}],
        [{"role": "\ud800", "content": "cut \ud83d", "name": "n"}],
        [{"role": "assistant", "tool_calls": []}],
        [{"role": "user", "content": [{"type": "text", "text": "x"}]}],
        [{"role": "system", "content": "be brief"}, *USER, {"role": "assistant", "content": "ok"}],
        [{"role": "user", "content": "x"}] * 40,
        ABSENT,
    ],
    "stream": [True, False, None, "true", 1, ABSENT],
    "max_tokens": [None, 1, 16, 0, -1, "4", 4.0, True, "x", ABSENT],
    "max_completion_tokens": [None, 7, 0, "x", 2.0, ABSENT],
    "stream_options": [None, {}, {"include_usage": True}, [], "x", ABSENT],
    "n": [None, 1, 2, 0, -3, "2", 2.0, True, "two", ABSENT],
    "tools": [None, [], [{"type": "function", "function": {"name": "f"}}], "x", {}, ABSENT],
    "extra": [
        {},
        {"temperature": "hot", "top_p": [], "seed": "s"},
        {"top_logprobs": None, "prompt_logprobs": 1},
        {"top_logprobs": 3},
        {"stop": "x"},
        {"stop_token_ids": [1, "2"]},
        {"min_tokens": 100},
        {"echo": True},
        {"best_of": 3},
        {"response_format": {"type": "json_object"}, "user": "u"},
    ],
}
READ = ["model", "stream", "max_output", "children", "prompt_logprobs", "echo", "top_logprobs", "best_of"]


def chat_bodies(count: int):
    rng = random.Random(1)
    yield VALID[CHAT]
    for _ in range(count):
        body = {}
        for key, pool in CHAT_POOLS.items():
            value = pool[0] if rng.random() < 0.6 else rng.choice(pool)  # a plain value, else any
            if key == "extra":
                body.update(value)
            elif value is not ABSENT:
                body[key] = value
        yield body


def test_the_plain_chat_reader_takes_only_what_the_model_takes_and_reads_it_the_same():
    taken = 0
    for body in chat_bodies(4000):
        plain = read_plain_chat(body)
        if plain is None:
            continue
        taken += 1
        model = validate(ChatCompletionRequest, body)  # raises if the reader took what the model refuses
        assert [getattr(plain, a) for a in READ] == [getattr(model, a) for a in READ], body
        fast = job_from_body(CHAT, b"{}", body, "rid")
        assert type(fast.request) is type(plain)
        slow = dataclasses.replace(fast, request=model)
        assert (fast.stream, fast.max_tokens) == (bool(model.stream), model.max_output)
        assert fast.decode_computes_prompt is slow.decode_computes_prompt
    assert taken > 500  # plain bodies do take the hot path


@pytest.mark.parametrize(
    "body",
    [
        {"model": "m", "messages": USER, "max_tokens": 16},
        {"model": "m", "messages": USER, "stream": True, "stream_options": {"include_usage": True}},
        {"model": "m", "messages": [*USER] * 32, "tools": [], "n": 1, "temperature": 0.2, "seed": 3},
    ],
)
def test_plain_chat_bodies_are_read_without_the_model(body):
    plain = read_plain_chat(body)
    assert plain is not None and plain.model == "m"


def test_a_metaserver_job_carries_the_ticket_as_it_came():
    ticket = {"request_id": "r-9", "do_remote_prefill": True, "remote_host": "10.0.0.7", "remote_port": "5600"}
    j = job(METASERVER, kv_transfer_params=ticket)
    assert j.metaserver is j.body["kv_transfer_params"] and j.request_id == "r-9" and j.family is CHAT


MODELS = [
    ChatCompletionRequest,
    CompletionRequest,
    MessagesRequest,
    CountTokensRequest,
    MetaserverCall,
    ChatCompletionBody,
    CompletionBody,
]


@pytest.mark.parametrize("model", MODELS, ids=lambda m: m.__name__)
def test_the_spec_documents_every_field_a_model_checks(model):
    schema, components = openapi_schema(model)
    assert set(schema["properties"]) == set(model.model_fields)
    assert schema["additionalProperties"] is True  # every other field passes to the engine
    assert all(sub.get("additionalProperties") is True for sub in components.values())


def test_the_request_schemas_are_valid_openapi_3_0():
    validator = pytest.importorskip("openapi_spec_validator")
    paths, components = {}, {}
    for model in MODELS:
        schema, defs = openapi_schema(model)
        components.update(defs)
        paths[f"/{model.__name__}"] = {
            "post": {
                "requestBody": {"content": {"application/json": {"schema": schema}}},
                "responses": {"200": {"description": "OK"}},
            }
        }
    validator.validate(
        {
            "openapi": "3.0.3",
            "info": {"title": "t", "version": "1"},
            "paths": paths,
            "components": {"schemas": components},
        }
    )


@pytest.mark.parametrize(
    "raw, read",
    [
        (b'{"model":"m","messages":[{"role":"user","content":"\\u00e9 ok"}]}', {"model": "m", "messages": USER_E}),
        (b'{"model":"m","content":"cut \\ud83d"}', {"model": "m", "content": "cut \ud83d"}),  # (orjson refuses it)
        (b'{"t": Infinity}', {"t": float("inf")}),
        (b'{"a": 1, "a": 2}', {"a": 2}),  # a key's last value, as Python's and vLLM's readers take it
        (b'{"max_tokens": 1000000000000000000000000000000}', {"max_tokens": 10**30}),  # (orjson: 1e30)
    ],
)
def test_a_body_is_read_as_pythons_json_reader_reads_it(raw, read):
    assert parse_body(raw) == read


@pytest.mark.parametrize("raw", [b'{"a":', b"[1, 2]", b'{"a": 1} x', b"\xff"])
def test_a_body_that_is_no_json_object_is_refused(raw):
    with pytest.raises(InvalidRequest) as e:
        parse_body(raw)
    assert e.value.status == 400 and "JSON" in e.value.message
