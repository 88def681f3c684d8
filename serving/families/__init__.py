"""Endpoint families: one module per family (chat, completions, messages, count_tokens, responses, metaserver, tokenize, detokenize),
each owning what differs between them (serving/families/base.py lists it). A new family is a module with a
`Family` subclass and its one instance, and a line in `FAMILIES`; its handler passes that instance to
serve_inference (handlers/)."""

from serving.families.base import Family
from serving.families.chat import CHAT
from serving.families.completions import COMPLETIONS
from serving.families.count_tokens import COUNT_TOKENS
from serving.families.detokenize import DETOKENIZE
from serving.families.messages import MESSAGES
from serving.families.metaserver import METASERVER
from serving.families.responses import RESPONSES
from serving.families.tokenize import TOKENIZE

FAMILIES: tuple[Family, ...] = (CHAT, COMPLETIONS, MESSAGES, COUNT_TOKENS, RESPONSES, METASERVER, TOKENIZE, DETOKENIZE)

__all__ = [
    "CHAT",
    "COMPLETIONS",
    "COUNT_TOKENS",
    "DETOKENIZE",
    "FAMILIES",
    "MESSAGES",
    "METASERVER",
    "RESPONSES",
    "TOKENIZE",
    "Family",
]
