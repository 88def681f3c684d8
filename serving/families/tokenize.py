"""/tokenize and /detokenize: vLLM's own routes, answered by one vLLM engine of the model (nothing generated)."""

from __future__ import annotations

from serving.families.base import Family
from serving.protocol.tokenize import DetokenizeRequest, TokenizeRequest


class Tokenize(Family):
    route = "/tokenize"  # at the root, as vLLM serves it
    request_model = TokenizeRequest
    streams = False
    vllm_only = True
    counts_only = True
    usage_chunk_option = False


class Detokenize(Tokenize):
    route = "/detokenize"
    request_model = DetokenizeRequest


TOKENIZE = Tokenize()
DETOKENIZE = Detokenize()
