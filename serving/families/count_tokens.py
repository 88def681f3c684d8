"""/v1/messages/count_tokens: Anthropic's prompt count, answered by one vLLM engine (nothing is generated)."""

from __future__ import annotations

from errors import ANTHROPIC
from serving.families.base import Family
from serving.protocol.anthropic import CountTokensRequest


class CountTokens(Family):
    route = "/v1/messages/count_tokens"
    api = ANTHROPIC
    request_model = CountTokensRequest
    streams = False
    vllm_only = True
    counts_only = True
    usage_chunk_option = False


COUNT_TOKENS = CountTokens()
