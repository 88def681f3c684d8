"""Request ids: the one a client sends (X-Request-Id) when it is safe to log, else a fresh one."""

from __future__ import annotations

from random import getrandbits

from sanic import Request

from errors import REQUEST_ID
from serving.protocol import VISIBLE


def request_id(request: Request) -> str:
    rid = request.headers.get(REQUEST_ID)
    # A client's id is taken when it is at most 128 characters of printable ASCII without spaces: it goes into
    # every log line of the request as a `key=value` field, which spaces or line breaks in it would forge.
    # Otherwise 128 random bits, like uuid4().hex: an id must be unique, not unguessable, so no getrandom
    # syscall (each worker's generator is seeded from the OS when it starts).
    return rid if rid and len(rid) <= 128 and VISIBLE.fullmatch(rid) else "%032x" % getrandbits(128)
