"""Cluster mode: one worker's bookkeeping of its tenants' quotas in the cluster store (state/cluster.py's ADMIT,
SETTLE and REWRITE scripts; serving/cluster.py makes the calls).

Per tenant with a quota (by its name's hash, as the store keys it) a worker keeps: its requests of that tenant the
store counted; what it still has to tell the store (requests ended, and tokens served beyond those taken: the output
as it streams, the prompt's count once made), sent in one batch at its next call or tick, never per request or per
chunk; and the store's last word on the tenant's buckets (every reply says it), which it writes back if the store
loses its data, so that the restart gives no tenant a fresh minute.
"""

from __future__ import annotations

NO_VIEW = (0, 0, 0, 0, 0, 0, 0)  # a tenant this worker has no word of (the store's time 0: nothing to write back)


class StoreQuotas:
    """One worker's side of its tenants' quotas in the cluster store (see the module docstring)."""

    def __init__(self):
        self.admitted: dict[str, int] = {}  # tenant -> its requests in flight the store counted, from this worker
        self.pending: dict[str, list[int]] = {}  # tenant -> [ended, tokens, its tpm] still to send
        # tenant -> (rq, rq_at, tk, tk_at, the store's time, rpm, tpm): its buckets as the store last said
        self.views: dict[str, tuple[int, ...]] = {}

    def admit(self, key: str) -> None:
        self.admitted[key] = self.admitted.get(key, 0) + 1

    def left(self, key: str, tokens: int, tpm: int) -> None:
        """A request of tenant `key` the store counted ended, `tokens` served beyond those taken."""
        self.admitted[key] -= 1
        self._add(key, 1, tokens, tpm)

    def charge(self, key: str, tokens: int, tpm: int) -> None:
        """Tokens tenant `key`'s requests were served beyond those taken."""
        self._add(key, 0, tokens, tpm)

    def _add(self, key: str, ended: int, tokens: int, tpm: int) -> None:
        pending = self.pending.get(key)
        if pending is None:
            self.pending[key] = [ended, tokens, tpm]
        else:
            pending[0] += ended
            pending[1] += tokens
            pending[2] = tpm

    def batch(self) -> tuple:
        """What is pending, flat (hash, ended, tokens, tpm per tenant), taken."""
        if not self.pending:
            return ()
        pending, self.pending = self.pending, {}
        return tuple(v for key, (ended, tokens, tpm) in pending.items() for v in (key, ended, tokens, tpm))

    def restore(self, batch: tuple) -> None:
        """A batch the store did not take: pending again."""
        for i in range(0, len(batch), 4):
            key, ended, tokens, tpm = batch[i : i + 4]
            self._add(key, ended, tokens, tpm)

    def seen(self, key: str, state: list, rpm: int, tpm: int) -> None:
        """A tenant's buckets as a reply said (rq, rq_at, tk, tk_at, the store's time)."""
        self.views[key] = (*(int(v) for v in state[:5]), rpm, tpm)

    def settled(self, reply: list) -> None:
        """A settlement's reply (the store's time, then hash, tk, tk_at per tenant charged): the tpm buckets."""
        at = int(reply[0])
        for i in range(1, len(reply), 3):
            key = reply[i].decode()
            view = self.views.get(key)
            if view is not None and view[4] < at:
                self.views[key] = (view[0], view[1], int(reply[i + 1]), int(reply[i + 2]), at, *view[5:])

    def written(self) -> tuple:
        """What this worker writes again after the store lost its data: per tenant its hash, its requests in flight
        and its view (REWRITE's nine values); the ended requests pending are in the counts, no longer pending."""
        for pending in self.pending.values():
            pending[0] = 0
        flat: list = []
        for key in self.admitted.keys() | self.views.keys():
            flat += (key, self.admitted.get(key, 0), *self.views.get(key, NO_VIEW))
        return tuple(flat)
