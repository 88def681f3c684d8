"""Where each stored Responses API response was served: vLLM keeps a stored response in the memory of the
instance that made it, so a follow-up turn (`previous_response_id`), GET, DELETE and cancel must go there.

`ResponseHomes` is the interface the serving layer uses; `SharedResponseHomes` implements it for one pod in
shared memory (every worker reads what any worker wrote). Cluster mode (a store shared by replicas) is a
second implementation of the same three methods.

The shared table is set-associative: an id's hash picks a set of RESPONSE_HOME_WAYS ways; a new id takes a
free way, else the way written longest ago. So it holds at least the last RESPONSE_HOME_WAYS ids of every set
and about the last RESPONSE_HOME_SETS * RESPONSE_HOME_WAYS (65,536) responses in all; an older id is evicted
and then unknown, as is an id whose 62-bit hash another id shares (the later one wins). Writes take the shared
lock (one per stored response); reads take none: a way's key is zeroed first and written last, and checked
again after its fields are read, so a reader never takes one id's key with another's instance.
"""

from __future__ import annotations

import hashlib
import time
from typing import Protocol

from state.shared import RESPONSE_HOME_FIELDS, RESPONSE_HOME_SETS, RESPONSE_HOME_WAYS, SharedState

_KEY, _INSTANCE, _ENDPOINT, _STAMP = range(RESPONSE_HOME_FIELDS)
_SET_WORDS = RESPONSE_HOME_WAYS * RESPONSE_HOME_FIELDS


class ResponseHomes(Protocol):
    """Response id -> the (instance id, endpoint id) of the engine that served it."""

    def remember(self, response_id: str, instance_id: int, endpoint_id: int) -> None: ...

    def home(self, response_id: str) -> tuple[int, int] | None:
        """Where `response_id` was served; None: never here, forgotten, or evicted."""

    def forget(self, response_id: str) -> None: ...


class SharedResponseHomes:
    """ResponseHomes in the shared-memory table `SharedState.response_homes` (see the module docstring)."""

    def __init__(self, shared: SharedState):
        self.arr, self.lock = shared.response_homes, shared.hot_lock

    @staticmethod
    def _place(response_id: str) -> tuple[int, int]:
        """(key, offset of its set): a hash stable across processes; the key is never 0 (a free way)."""
        h = int.from_bytes(hashlib.blake2b(response_id.encode(), digest_size=8).digest(), "little")
        return h >> 2 | 1, h % RESPONSE_HOME_SETS * _SET_WORDS

    def remember(self, response_id: str, instance_id: int, endpoint_id: int) -> None:
        key, base = self._place(response_id)
        arr = self.arr
        with self.lock:
            ways = range(base, base + _SET_WORDS, RESPONSE_HOME_FIELDS)
            at = next((w for w in ways if arr[w + _KEY] == key), None)
            if at is None:
                at = min(ways, key=lambda w: (arr[w + _KEY] != 0, arr[w + _STAMP]))  # free, else the oldest
            arr[at + _KEY] = 0
            arr[at + _INSTANCE] = instance_id
            arr[at + _ENDPOINT] = endpoint_id
            arr[at + _STAMP] = time.monotonic_ns()
            arr[at + _KEY] = key

    def home(self, response_id: str) -> tuple[int, int] | None:
        key, base = self._place(response_id)
        arr = self.arr
        for at in range(base, base + _SET_WORDS, RESPONSE_HOME_FIELDS):
            if arr[at + _KEY] == key:
                found = arr[at + _INSTANCE], arr[at + _ENDPOINT]
                if arr[at + _KEY] == key:
                    return found
        return None

    def forget(self, response_id: str) -> None:
        key, base = self._place(response_id)
        arr = self.arr
        with self.lock:
            for at in range(base, base + _SET_WORDS, RESPONSE_HOME_FIELDS):
                if arr[at + _KEY] == key:
                    arr[at + _KEY] = 0
