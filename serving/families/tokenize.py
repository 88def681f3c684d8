"""/tokenize: vLLM's own route, answered by one vLLM engine of the model (nothing generated)."""

from __future__ import annotations

from serving.families.base import Family
from serving.protocol.tokenize import TokenizeRequest


class Tokenize(Family):
    route = "/tokenize"  # at the root, as vLLM serves it
    request_model = TokenizeRequest
    streams = False
    vllm_only = True
    counts_only = True
    usage_chunk_option = False


TOKENIZE = Tokenize()
