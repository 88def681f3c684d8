"""serving/usage.py without a server: the SSE block fix-up touches exactly the events that carry usage or a ticket."""

from __future__ import annotations

import json

import pytest

from serving.families import CHAT, MESSAGES, RESPONSES
from serving.observe import answer_prompt_tokens
from serving.usage import EventSplitter, UsageFix

P_USAGE = {
    "prompt_tokens": 40,
    "total_tokens": 41,
    "completion_tokens": 1,
    "prompt_tokens_details": {"cached_tokens": 8},
}


def chunk(i: int) -> bytes:
    return b'data: {"id":"c","choices":[{"index":0,"delta":{"content":"t%d"}}]}' % i


USAGE_EVENT = (
    b'data: {"id":"c","choices":[],"usage":{"prompt_tokens":40,"completion_tokens":16,"total_tokens":56,'
    b'"prompt_tokens_details":{"cached_tokens":40}},"kv_transfer_params":null}'
)
TICKET_EVENT = (
    b'data: {"id":"c","choices":[{"index":0,"delta":{"content":"x"}}],"kv_transfer_params": {"remote_block_ids":[1]}}'
)
ANTHROPIC_START = (
    b'event: message_start\ndata: {"type":"message_start","message":{"id":"m","usage":{"input_tokens":3,'
    b'"cache_read_input_tokens":40,"output_tokens":1}}}'
)


@pytest.mark.parametrize(
    "events, family",
    [
        ([chunk(i) for i in range(5)], CHAT),  # nothing to fix: the same bytes come back
        ([chunk(0), chunk(1), USAGE_EVENT, b"data: [DONE]"], CHAT),
        ([USAGE_EVENT, chunk(1), TICKET_EVENT, chunk(2), USAGE_EVENT], CHAT),
        ([ANTHROPIC_START, b'event: ping\ndata: {"type":"ping"}'], MESSAGES),
    ],
)
def test_a_blocks_fix_is_each_events_fix(events, family):
    fix = UsageFix(P_USAGE, family)
    block = b"".join(e + b"\n\n" for e in events)
    want = b"".join(fix.event(e) + b"\n\n" for e in events)
    got = fix.events(block)
    assert got == want
    if block == want:
        assert got is block  # untouched blocks are not copied


def test_usage_event_takes_the_prompt_side_from_prefill():
    p_usage = {**P_USAGE, "prompt_tokens": 30}  # P's count differs from D's 40: the client is billed P's
    fixed = UsageFix(p_usage, CHAT).events(b"".join(e + b"\n\n" for e in (chunk(0), USAGE_EVENT)))
    usage = json.loads(fixed.split(b"\n\n")[1][len(b"data: ") :])["usage"]
    assert usage["prompt_tokens"] == 30 and usage["total_tokens"] == 46
    assert usage["prompt_tokens_details"] == {"cached_tokens": 8}
    assert b"kv_transfer_params" not in fixed


def test_usage_with_blanks_is_fixed_and_null_usage_or_the_key_in_text_is_relayed_as_is():
    spaced = (
        b'data: {"id":"c","choices":[],"usage" :  {"prompt_tokens":40,"completion_tokens":2,"total_tokens":42}}\n\n'
    )
    fixed = UsageFix({"prompt_tokens": 30}, CHAT).events(spaced)
    assert json.loads(fixed.strip()[len(b"data: ") :])["usage"] == {
        "prompt_tokens": 30,
        "completion_tokens": 2,
        "total_tokens": 32,
    }
    untouched = (
        b'data: {"id":"c","choices":[{"delta":{"content":"\\"usage\\": {"}}],"usage":null}\n\n' + chunk(3) + b"\n\n"
    )
    assert UsageFix(P_USAGE, CHAT).events(untouched) is untouched


def test_splitter_keeps_partial_events_for_the_next_chunk():
    splitter = EventSplitter()
    stream = b"".join(e + b"\r\n\r\n" for e in (chunk(0), USAGE_EVENT, b"data: [DONE]"))
    blocks = []
    for i in range(0, len(stream), 7):  # cut anywhere, even inside "\r\n\r\n"
        block = splitter.complete(stream[i : i + 7])
        assert block == b"" or block.endswith(b"\n\n")  # whole events only
        blocks.append(block)
    assert splitter.tail == b""
    assert b"".join(blocks) == stream.replace(b"\r\n", b"\n")
    lf = stream.replace(b"\r\n", b"\n")
    assert splitter.complete(lf) is lf  # whole LF-framed events: passed on as they are


def test_answer_prompt_tokens_reads_a_json_answers_usage_from_its_bytes():
    """The prompt count calibration takes from a whole request's answer, found from the end without parsing:
    a key inside the text (its quotes escaped) is not the usage's."""
    chat = (
        b'{"choices":[{"message":{"content":"say \\"prompt_tokens\\": 7"}}],'
        b'"usage":{"prompt_tokens":40,"completion_tokens":3,"prompt_tokens_details":{"cached_tokens":16}}}'
    )
    assert json.loads(chat)["usage"]["prompt_tokens"] == 40
    assert answer_prompt_tokens(chat, CHAT) == 40
    responses = (
        b'{"output":[],"usage":{"input_tokens":40,"input_tokens_details":{"cached_tokens":16},"output_tokens":3}}'
    )
    assert answer_prompt_tokens(responses, RESPONSES) == 40
    messages = b'{"content":[],"usage":{"input_tokens":4,"cache_read_input_tokens":32,"cache_creation_input_tokens":4}}'
    assert answer_prompt_tokens(messages, MESSAGES) == 40
    assert answer_prompt_tokens(b'{"usage":{"input_tokens":40,"output_tokens":3}}', MESSAGES) == 40
    assert answer_prompt_tokens(b'{"choices":[]}', CHAT) == -1
    assert answer_prompt_tokens(b'{"content":[]}', MESSAGES) == -1
