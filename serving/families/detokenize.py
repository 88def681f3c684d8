"""/detokenize: vLLM's own route, token ids' text from one vLLM engine of the model (as /tokenize is served)."""

from __future__ import annotations

from serving.families.tokenize import Tokenize
from serving.protocol.tokenize import DetokenizeRequest


class Detokenize(Tokenize):
    route = "/detokenize"
    request_model = DetokenizeRequest


DETOKENIZE = Detokenize()
