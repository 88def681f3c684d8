"""The OpenAI and Anthropic SDK clients pointed at a Coordinator (anything with a `url`): no retries of
their own, so what a test sees is what the Coordinator answered."""

from __future__ import annotations

import anthropic
import openai


def openai_client(coord, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=coord.url + "/v1", api_key=key, max_retries=0, timeout=30)


def anthropic_client(coord, **kw) -> anthropic.Anthropic:
    kw.setdefault("api_key", "unused")
    return anthropic.Anthropic(base_url=coord.url, max_retries=0, timeout=30, **kw)


def async_anthropic_client(coord, **kw) -> anthropic.AsyncAnthropic:
    kw.setdefault("api_key", "unused")
    return anthropic.AsyncAnthropic(base_url=coord.url, max_retries=0, timeout=30, **kw)
