"""Where each stored Responses API response was served, and whose it is: vLLM keeps a stored response in the
memory of the instance that made it, so a follow-up turn (`previous_response_id`), GET, DELETE and cancel must go
there; and it belongs to the tenant that made it (its `state.shared.tenant_hash`), to whom alone its id is known.

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

from state.shared import RESPONSE_HOME_SETS, ResponseHome, SharedState


class ResponseHomes(Protocol):
    """Response id -> the (instance id, endpoint id) of the engine that served it, for its owner only."""

    def remember(self, response_id: str, instance_id: int, endpoint_id: int, owner: int) -> None: ...

    def home(self, response_id: str, owner: int) -> tuple[int, int] | None:
        """Where `response_id` was served; None: never here, forgotten, evicted, or another owner's."""

    def forget(self, response_id: str) -> None: ...


class SharedResponseHomes:
    """ResponseHomes in the shared-memory table `SharedState.response_homes` (see the module docstring)."""

    def __init__(self, shared: SharedState):
        self.sets, self.lock = shared.response_homes, shared.hot_lock

    @staticmethod
    def _place(response_id: str) -> tuple[int, int]:
        """(key, its set): a hash stable across processes; the key is never 0 (a free way)."""
        h = int.from_bytes(hashlib.blake2b(response_id.encode(), digest_size=8).digest(), "little")
        return h >> 2 | 1, h % RESPONSE_HOME_SETS

    def remember(self, response_id: str, instance_id: int, endpoint_id: int, owner: int) -> None:
        key, at = self._place(response_id)
        ways: list[ResponseHome] = list(self.sets[at].ways)
        with self.lock:
            way = next((w for w in ways if w.key == key), None)
            if way is None:
                way = min(ways, key=lambda w: (w.key != 0, w.written_ns))  # free, else the oldest
            way.key = 0
            way.instance_id = instance_id
            way.endpoint_id = endpoint_id
            way.owner = owner
            way.written_ns = time.monotonic_ns()
            way.key = key

    def home(self, response_id: str, owner: int) -> tuple[int, int] | None:
        key, at = self._place(response_id)
        for way in self.sets[at].ways:
            if way.key == key:
                found, whose = (way.instance_id, way.endpoint_id), way.owner
                if way.key == key:
                    return found if whose == owner else None
        return None

    def forget(self, response_id: str) -> None:
        key, at = self._place(response_id)
        with self.lock:
            for way in self.sets[at].ways:
                if way.key == key:
                    way.key = 0
