"""/v1/responses: OpenAI's Responses API (its stored responses' other calls: serving/responses.py)."""

from __future__ import annotations

import uuid

from errors import json_bytes
from scheduling.tokens import MESSAGES as MESSAGES_PROMPT
from serving.families.base import Family
from serving.protocol import Request
from serving.protocol.responses import ResponsesRequest

# Its prefill leg's cap is `max_output_tokens`, and P neither stores its one-token response (`store`: vLLM never
# frees a stored one) nor answers it in the background (a `queued` answer carries no ticket).
_PREFILL_SET = {"max_output_tokens": 1, "store": False, "background": False, "ignore_eos": True}


def fix_responses_usage(usage: dict, p_usage: dict | None) -> None:
    """A Responses usage: the input side (count and details, the cached tokens among them) is P's."""
    if not p_usage:
        return
    prompt = p_usage.get("input_tokens")
    if isinstance(prompt, int):
        usage["input_tokens"] = prompt
    if isinstance(p_usage.get("input_tokens_details"), dict):
        usage["input_tokens_details"] = p_usage["input_tokens_details"]
    usage["total_tokens"] = usage.get("input_tokens", 0) + (usage.get("output_tokens") or 0)


class Responses(Family):
    route = "/v1/responses"
    request_model = ResponsesRequest
    prompt_kind = MESSAGES_PROMPT  # its prompt_body: a chat body with its instructions as the system prompt
    stored = True
    # created, in_progress, the item's and part's added and done, the text's done, completed carry no token;
    # its count is response.completed's usage.
    stream_framing = 8
    final_usage_event = b'"response.completed"'
    last_event = b"event: response.completed"
    usage_in_stream = True
    nests = "response"  # an event nests the response (response.completed's holds the usage)

    def identified(self, raw: bytes, body: dict, request: Request) -> tuple[bytes, dict]:
        """The body with a response id of the Coordinator's (vLLM's own shape, `resp_<hex>`), so that it knows
        the response's id before any engine answers, every leg and retry gives the response that one id, and no
        client chooses it (a client's `request_id` is written over: else it could name, and overwrite, another's)."""
        response_id = "resp_" + uuid.uuid4().hex
        new = {**body, "request_id": response_id}
        if "request_id" in body:
            return json_bytes(new), new
        # Put in front of the client's own bytes (no re-serialisation); the key is absent, so this is its one value.
        return b'{"request_id":' + json_bytes(response_id) + b"," + raw[raw.index(b"{") + 1 :], new

    def prompt_body(self, body: dict, request: Request) -> dict:
        return request.conversation()

    def cap_prefill(self, body: dict, changes: dict) -> None:
        changes.update(_PREFILL_SET)

    def cap_tokens(self, changes: dict) -> None:
        pass  # (its cap is max_output_tokens, set above)

    def fix_usage(self, usage: dict, p_usage: dict | None) -> None:
        fix_responses_usage(usage, p_usage)


RESPONSES = Responses()
