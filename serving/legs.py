"""The prefill and decode legs of a disaggregated request (vLLM NixlConnector protocol).

The prefill leg must finish *because of the length cap*, or vLLM returns no `kv_transfer_params` and D
silently recomputes the prompt: one token, `ignore_eos`, no stop conditions, no `min_tokens`, `n` 1,
non-streaming, no `stream_options` (each dropped field set to what the engine reads when it is absent). On /v1/responses the cap is `max_output_tokens`, and P neither stores
its one-token response (`store`: vLLM never frees a stored one) nor answers it in the background (a
`queued` answer carries no ticket). On /v1/messages a named tool choice becomes `{"type": "any"}`: with
a named tool vLLM takes P's one token as the whole call's arguments and json.loads them (a 400), while
"any" ("required") lets an unparsable call go; the tools stay, so P renders the prompt D renders (vLLM's
generic chat renderer does not pass the tool choice to the template). The decode leg is the client's
own body plus P's ticket, unchanged.
"""

from __future__ import annotations

from engines import Body
from errors import json_bytes
from serving.job import MESSAGES, RESPONSES, Job

# A ticket is vLLM's `kv_transfer_params`: in P's body it asks P to keep the prompt's KV for a remote decode
# (these fields, which P fills in its answer: where the blocks are); D's body carries P's answered ticket so
# that D pulls that KV instead of computing the prompt.
PREFILL_TICKET = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}

# The client's fields a prefill leg must not carry, as what the engine reads when they are absent: the leg's
# body is the client's bytes with its changes appended (JSON readers keep a key's last value, Python's and so
# vLLM's among them), so a dropped field is overridden rather than cut out of a prompt of megabytes.
_OPENAI_DROPPED = {"stream_options": None, "min_tokens": 0, "stop": None, "stop_token_ids": None}
_ANTHROPIC_DROPPED = {"stop_sequences": None}
_RESPONSES_SET = {"max_output_tokens": 1, "store": False, "background": False, "ignore_eos": True}


def prefill_changes(job: Job, ticket: dict | None = None) -> dict:
    """The fields the prefill leg sets in the client's body (a dropped one at its engine default)."""
    body = job.body
    if job.route == MESSAGES:
        changes = {key: value for key, value in _ANTHROPIC_DROPPED.items() if key in body}
        choice = body.get("tool_choice")
        if isinstance(choice, dict) and choice.get("type") == "tool":
            changes["tool_choice"] = {"type": "any"}
            if "disable_parallel_tool_use" in choice:
                changes["tool_choice"]["disable_parallel_tool_use"] = choice["disable_parallel_tool_use"]
    else:
        changes = {key: value for key, value in _OPENAI_DROPPED.items() if key in body}
        if job.route == RESPONSES:
            changes.update(_RESPONSES_SET)
        else:
            changes["ignore_eos"] = True
            if "max_completion_tokens" in body:
                changes["max_completion_tokens"] = 1
            if "n" in body:
                changes["n"] = 1
    changes["stream"] = False
    if job.route != RESPONSES:
        changes["max_tokens"] = 1
    changes["kv_transfer_params"] = dict(PREFILL_TICKET) if ticket is None else ticket
    return changes


def prefill_body(job: Job, ticket: dict | None = None) -> dict:
    """The prefill leg's body as an object, the dropped fields left out."""
    dropped = _ANTHROPIC_DROPPED if job.route == MESSAGES else _OPENAI_DROPPED
    body = {key: value for key, value in job.body.items() if key not in dropped}
    body.update((key, value) for key, value in prefill_changes(job, ticket).items() if key not in dropped)
    return body


def prefill_wire(job: Job) -> Body:
    """The client's bytes with the prefill leg's changes appended, as parts: the prompt is neither re-encoded nor
    copied."""
    raw = job.raw
    changes = json_bytes(prefill_changes(job))  # b'{"stream":false,...}': one encoding for every change
    return memoryview(raw)[: raw.rindex(b"}")], b",", memoryview(changes)[1:]


def decode_wire(job: Job, ticket: dict | None) -> Body:
    if "kv_transfer_params" not in job.body:
        # The client's own bytes with the ticket put in front: no copy and re-serialisation of a body
        # that may hold a long conversation. (The key is absent from the parsed body, so whatever the
        # client wrote cannot add a second one.)
        if ticket is None:
            return job.raw
        raw = job.raw
        return b'{"kv_transfer_params":' + json_bytes(ticket) + b",", memoryview(raw)[raw.index(b"{") + 1 :]
    body = dict(job.body)
    if ticket is None:
        body.pop("kv_transfer_params", None)
    else:
        body["kv_transfer_params"] = ticket
    return json_bytes(body)
