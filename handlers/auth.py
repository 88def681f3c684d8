"""API keys: the key a request presents, checked against the configured ones in constant time, and the tenant
it names (`request.ctx.tenant`: config.Settings.key_owners; `default` when no key is asked for).

`valid_keys` may hold plain keys and MindIE-PyMotor's hashed entries (PBKDF2-SHA256 `salt:iterations:hexhash`,
config.keys), whose own text is never a key. A presented key is compared with every plain key first; only when
none matches and hashed entries exist does PBKDF2 run, in a thread (hashlib lets the event loop run meanwhile)
and at most `HASH_CHECKS_AT_ONCE` at a time per worker. A key found valid is remembered per worker (its SHA-256,
at most `VERIFIED_KEYS` of them, the least recently used forgotten first), so the hot path runs PBKDF2 once per
key and worker, not per request. Keys never reach a log line.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
from collections import OrderedDict
from collections.abc import Awaitable
from functools import lru_cache

from sanic import Request

from config import DEFAULT_TENANT, ApiKeyConfig
from config.keys import HashedKey, hashed_entry
from errors import Api, Unauthorized

VERIFIED_KEYS = 1024  # per worker and key configuration
HASH_CHECKS_AT_ONCE = 2  # per worker: threads a flood of wrong keys can keep busy with PBKDF2


def presented_key(request: Request, cfg: ApiKeyConfig) -> str | None:
    """The key in the configured header after its prefix, if any. The prefix is an auth scheme ("Bearer "),
    which HTTP compares without regard to case (RFC 9110 11.1): "bearer KEY" is the same."""
    value = request.headers.get(cfg.header_name)
    if value is None:
        return None
    n = len(cfg.key_prefix)
    return value[n:] if value.startswith(cfg.key_prefix) or value[:n].lower() == cfg.key_prefix.lower() else None


class KeyCheck:
    """One key configuration's check, per worker: its plain keys, its hashed ones (each with its tenant), the keys
    found valid (with theirs)."""

    def __init__(self, owners: tuple[tuple[str, str], ...]):
        entries = [(k, hashed_entry(k), tenant) for k, tenant in owners]
        # A hashed entry is compared through PBKDF2 only: its text is no key (a leaked config leaks none).
        self.plain = [(k.encode(), tenant) for k, h, tenant in entries if h is None]
        self.hashed: list[tuple[HashedKey, str]] = [(h, tenant) for _, h, tenant in entries if h is not None]
        self.verified: OrderedDict[bytes, str] = OrderedDict()
        self.gate: asyncio.Semaphore | None = None

    def plain_match(self, presented: bytes) -> str | None:
        """The tenant of the plain key `presented` is, or None."""
        # Compare against every valid key so timing reveals neither the key nor which one matched.
        found = [tenant for valid, tenant in self.plain if hmac.compare_digest(presented, valid)]
        return found[0] if found else None

    def remembered(self, presented: bytes) -> tuple[bytes, str | None]:
        """(the key's SHA-256, its tenant when it was found valid before: else it needs PBKDF2)."""
        tag = hashlib.sha256(presented).digest()
        tenant = self.verified.get(tag)
        if tenant is not None:
            self.verified.move_to_end(tag)
        return tag, tenant

    async def hashed_match(self, presented: bytes, tag: bytes) -> str | None:
        if self.gate is None:
            self.gate = asyncio.Semaphore(HASH_CHECKS_AT_ONCE)
        async with self.gate:
            loop = asyncio.get_running_loop()
            tenant = await loop.run_in_executor(
                None, lambda: next((t for h, t in self.hashed if h.matches(presented)), None)
            )
        if tenant is not None:
            self.verified[tag] = tenant
            if len(self.verified) > VERIFIED_KEYS:
                self.verified.popitem(last=False)
        return tenant


@lru_cache(maxsize=8)  # one per configuration: a reloaded config gets a new one, its keys verified anew
def key_check(owners: tuple[tuple[str, str], ...]) -> KeyCheck:
    return KeyCheck(owners)


def _encoded(key: str) -> bytes:
    # Sanic decodes header bytes with surrogateescape: encoding back the same way gives the bytes sent
    # (a key that is not UTF-8 is simply wrong, not an error).
    return key.encode("utf-8", "surrogateescape")


def check_key(
    request: Request, cfg: ApiKeyConfig, api: Api, owners: tuple[tuple[str, str], ...]
) -> Awaitable[None] | None:
    """None when the request may go on (or raises Unauthorized); an awaitable to await when a hashed entry is
    being checked. Either way `request.ctx.tenant` is then the tenant the key names. A path in `cfg.skip_paths`
    needs no key; an Anthropic client may present it in x-api-key. `owners`: `cfg`'s valid keys with their
    tenants (Settings.key_owners, Settings.mgmt_key_owners).

    Two callers only, both of which every route passes through: handlers/__init__.py's guard (Sanic awaits what
    a middleware returns) and serve_inference, the guard of the inference routes. No handler calls it."""
    if not cfg.enable_api_key or request.path in cfg.skip_paths:
        request.ctx.tenant = DEFAULT_TENANT
        return None
    key = presented_key(request, cfg)
    presented = [] if key is None else [key]
    for header in api.key_headers:  # (Anthropic's clients may present it in x-api-key)
        if request.headers.get(header) is not None:
            presented.append(request.headers[header])
    check = key_check(owners)
    encoded = [_encoded(k) for k in presented]
    found = [check.plain_match(p) for p in encoded]
    tenant = next(filter(None, found), None)
    if tenant is not None:
        request.ctx.tenant = tenant
        return None
    if not check.hashed or not encoded:
        raise _refusal(presented)
    pending = []
    for p in encoded:
        tag, tenant = check.remembered(p)
        if tenant is not None:
            request.ctx.tenant = tenant
            return None
        pending.append((p, tag))
    return _hashed(request, check, pending, presented)


async def _hashed(request: Request, check: KeyCheck, pending: list[tuple[bytes, bytes]], presented: list[str]) -> None:
    for key, tag in pending:
        tenant = await check.hashed_match(key, tag)
        if tenant is not None:
            request.ctx.tenant = tenant
            return
    raise _refusal(presented)


def _refusal(presented: list[str]) -> Unauthorized:
    # Missing and wrong keys are both 401 (OpenAI's answer; the SDKs raise AuthenticationError); MindIE-PyMotor
    # answers a wrong key 403.
    return Unauthorized("Missing or invalid API key." if presented else "Missing API key.")
