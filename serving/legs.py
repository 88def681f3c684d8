"""The prefill and decode legs of a disaggregated request (vLLM NixlConnector protocol).

The prefill leg must finish *because of the length cap*, or vLLM returns no `kv_transfer_params` and D
silently recomputes the prompt: one token, `ignore_eos`, no stop conditions, no `min_tokens`, `n` 1,
non-streaming, no `stream_options` (each dropped field set to what the engine reads when it is absent). What
differs by family (the Responses API's cap, Messages' tool choice) is its family's `cap_prefill`
(serving/families/). The decode leg is the client's own body plus P's ticket, unchanged. Every leg's body gets
the tenant's prefix-cache salt and the x-priority class as it goes to its engine (`engine_body`).
"""

from __future__ import annotations

from functools import lru_cache

from engines import Body, parts_of
from errors import json_bytes
from scheduling.registry import Target
from serving.job import Job

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


def prefill_changes(job: Job, ticket: dict | None = None) -> dict:
    """The fields the prefill leg sets in the client's body (a dropped one at its engine default): its family's
    (serving/families/), then the ticket."""
    changes = job.family.prefill_changes(job.body)
    changes["kv_transfer_params"] = dict(PREFILL_TICKET) if ticket is None else ticket
    return changes


def prefill_body(job: Job, ticket: dict | None = None) -> dict:
    """The prefill leg's body as an object, the dropped fields left out."""
    dropped = job.family.dropped
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


def engine_body(body: Body, job: Job, target: Target) -> Body:
    """`body` as it goes to `target`, with what the Coordinator sets appended, as the last of a key is what JSON
    readers keep (a client's own field never wins): its tenant's `cache_salt` (`job.cache_salt`, serving/tenants.py)
    when it has one, and the request's x-priority class as vLLM's `priority` field (0 interactive, 1 standard,
    2 batch) when the engine runs vLLM's priority scheduling and the family's route reads the field (an FCFS engine
    refuses a non-zero one). Else as it is. An engine's metaserver call carries what its engine sent (salted when
    its client request was)."""
    salt = job.cache_salt
    ranked = target.priority and job.family.priority_field and job.metaserver is None
    if salt is None and not ranked:
        return body
    added = _salt_field(salt) if salt is not None else b""
    if ranked:
        added += b',"priority":%d' % job.priority
    parts = parts_of(body)
    last = parts[-1]
    return (*parts[:-1], memoryview(last)[: closing_brace(last)], added + b"}")


def closing_brace(part: bytes | memoryview) -> int:
    """Where the last `}` of a body's last part is: searched in a window from the end that grows until it holds one
    (JSON lets any whitespace follow the object; a view's bytes are copied a window at a time, never all at once
    for a long prompt)."""
    window = 64
    while True:
        tail = bytes(part[-window:])
        at = tail.rfind(b"}")
        if at >= 0:
            return len(part) - len(tail) + at
        if window >= len(part):
            raise ValueError("a body's last part without its object's closing brace")
        window *= 64


@lru_cache(maxsize=4096)
def _salt_field(salt: str) -> bytes:
    """`,"cache_salt":...` as JSON writes it: made once per tenant (a client's own salt, once per salt)."""
    return b',"cache_salt":' + json_bytes(salt)
