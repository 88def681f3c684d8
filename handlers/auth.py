"""API keys: the key a request presents, checked against the configured ones in constant time."""

from __future__ import annotations

import hmac

from sanic import Request

from config import ApiKeyConfig
from errors import ANTHROPIC, Unauthorized


def presented_key(request: Request, cfg: ApiKeyConfig) -> str | None:
    """The key in the configured header after its prefix, if any. The prefix is an auth scheme ("Bearer "),
    which HTTP compares without regard to case (RFC 9110 11.1): "bearer KEY" is the same."""
    value = request.headers.get(cfg.header_name)
    if value is None:
        return None
    n = len(cfg.key_prefix)
    return value[n:] if value.startswith(cfg.key_prefix) or value[:n].lower() == cfg.key_prefix.lower() else None


def valid_key(cfg: ApiKeyConfig, key: str) -> bool:
    # Compare against every valid key so timing reveals neither the key nor which one matched.
    # Sanic decodes header bytes with surrogateescape: encoding back the same way gives the bytes sent
    # (a key that is not UTF-8 is simply wrong, not an error).
    presented = key.encode("utf-8", "surrogateescape")
    return any([hmac.compare_digest(presented, valid.encode()) for valid in cfg.valid_keys])  # noqa: C419 (all compared)


def check_api_key(request: Request, api: str) -> None:
    cfg = request.app.ctx.settings.api_key
    if not cfg.enable_api_key:
        return
    key = presented_key(request, cfg)
    presented = [] if key is None else [key]
    if api == ANTHROPIC and request.headers.get("x-api-key") is not None:
        presented.append(request.headers["x-api-key"])
    if any(valid_key(cfg, key) for key in presented):
        return
    raise Unauthorized("Missing or invalid API key." if presented else "Missing API key.")
