"""One inference request as the Coordinator sees it: the parsed body, its endpoint family and what routing needs.

The body is checked against its family's model (serving/protocol/): what routing and the prefill-leg
rewrite need, and what the spec marks required; everything else is the engine's to judge (unknown fields
pass through untouched).
"""

from __future__ import annotations

from dataclasses import dataclass

import orjson
import ujson

from config import DEFAULT_TENANT, STANDARD
from errors import InvalidRequest, unreadable_json
from serving.families import Family
from serving.protocol import Request
from serving.protocol.openai import PlainChat


@dataclass
class Job:
    family: Family  # its endpoint family (serving/families/), which every step asks what differs
    raw: bytes  # the client's body, forwarded as is when nothing changes
    body: dict
    model: str
    stream: bool
    request_id: str
    max_tokens: int
    slo_ttft_ms: float = 0.0
    slo_tpot_ms: float = 0.0
    metaserver: dict | None = None  # the PD control object of a /v1/metaserver call
    request: Request | PlainChat | None = None  # the body as its family's model (or the plain chat reader) read it
    tenant: str = DEFAULT_TENANT  # who sent it, as its API key says (handlers/auth.py)
    priority: int = STANDARD  # its x-priority class, capped at its tenant's max_priority (serving/tenants.py)
    weight: float = 1.0  # its tenant's share of the tokens served when requests wait (tenant_config's weight)
    # The `cache_salt` its engine-bound bodies carry (serving/tenants.py: its tenant's prefix-cache scope); None:
    # the body's own, if any, goes as it is
    cache_salt: str | None = None

    @property
    def salt(self) -> str | None:
        """The salt its engines see (`cache_salt`, else the body's own): what its prompt's blocks are keyed by."""
        return self.cache_salt if self.cache_salt is not None else self.body.get("cache_salt")

    @property
    def prompt_body(self) -> dict:
        """The body whose prompt the scheduler counts (a Responses body's as a chat body)."""
        return self.family.prompt_body(self.body, self.request)

    @property
    def response_id(self) -> str:
        """A Responses request's id: the one `job_from_body` gave it (never the client's)."""
        return self.body["request_id"]

    @property
    def include_usage(self) -> bool:
        opts = self.body.get("stream_options")
        return isinstance(opts, dict) and bool(opts.get("include_usage"))

    @property
    def decode_computes_prompt(self) -> bool:
        """A request that vLLM's KV handoff cannot serve: one ticket carries one prompt's KV to one sequence.

        Several prompts in one completions request get the first prompt's ticket on every prompt (wrong
        text after the first); `n` or `best_of` above 1 makes every child sequence pull the same blocks, which
        P frees after the first; prompt logprobs (asked for directly, or by `echo` with `logprobs`) skip
        reading the transferred KV, so P's would stay pinned; `echo` with `max_tokens` 0 generates nothing to
        hand over to. D computes the prompt of these itself.
        """
        return self.family.decode_computes_prompt(self.request)


_INT64 = float(2**63)


def parse_body(raw: bytes) -> dict:
    if not raw:
        raise InvalidRequest("request body is empty: expected a JSON object")
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        body = _read_lax(raw)
    else:
        if isinstance(body, dict) and any(type(v) is float and not -_INT64 <= v < _INT64 for v in body.values()):
            body = _read_lax(raw)  # orjson reads an integer beyond 64 bits as a float: 10**30 is no 1e30
    if not isinstance(body, dict):
        raise InvalidRequest("request body must be a JSON object")
    return body


def _read_lax(raw: bytes) -> object:
    """A body orjson refuses, read as Python's and vLLM's JSON readers read it: ujson takes a lone UTF-16
    surrogate (a client cut an emoji in two), NaN and Infinity, and refuses the rest, saying why.

    orjson reads a body at about twice ujson's speed (0.7 against 1.6 µs per KiB), which is most of what a long
    prompt costs the Coordinator. It reads an integer beyond 64 bits as a float: a body with such a number at
    its top level (a `max_tokens` of 10**30) is read again here, so that the field stays the integer it is."""
    try:
        return ujson.loads(raw)
    except (ValueError, TypeError) as e:
        raise InvalidRequest(f"request body is not valid JSON: {unreadable_json(e)}") from None


def job_from_body(family: Family, raw: bytes, body: dict, request_id: str, from_engine: bool = False) -> Job:
    """`from_engine`: a metaserver call's body, the engine's rewrite of a client body (checked already)."""
    call = family.call(body)
    if call is not None:  # a metaserver call: its chat or completions body, and the PD control object
        family, control, request_id = call
        job = job_from_body(family, raw, body, request_id, from_engine=True)
        job.metaserver = control
        return job
    request = family.read(body, from_engine)
    stream = family.streams and bool(request.stream)
    raw, body = family.identified(raw, body, request)
    model = request.model or ""  # (only /tokenize and /detokenize may leave it out: serving/dispatch.py)
    return Job(family, raw, body, model, stream, request_id, request.max_output, request=request)
