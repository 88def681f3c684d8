"""`dumps`: the compact JSON text of every body and SSE payload the simulator writes (ujson when installed)."""

from __future__ import annotations

import json

try:
    import ujson as _fastjson

    def dumps(o) -> str:
        return _fastjson.dumps(o, ensure_ascii=False, escape_forward_slashes=False)
except Exception:  # pragma: no cover

    def dumps(o) -> str:
        return json.dumps(o, ensure_ascii=False, separators=(",", ":"))
