"""The prefix index: which engine slots hold the KV of which prompt prefixes, shared by all workers.

After a prefill succeeds on a slot, every chained prefix hash of its prompt (scheduling/tokens.py) is
recorded with that slot's bit. A prompt's cached prefix on a slot is then its longest run of leading
hashes carrying the slot's bit: since each hash covers the prompt up to its prefix's end, the recorded
hashes of one slot form a prefix-closed set and a binary search finds the run's end in about
log2(hashes) probes.

It is the policies' `PrefixSource` (scheduling/policies.py) without KV events, and behind them for prompts whose
token ids are not known (scheduling/kv_index.py): `cached_tokens` and `last_holder` answer in prompt tokens
(blocks of `block_tokens`), `record` learns from each prefill.

The table lives in shared memory (made in the main process with the other shared arrays), so every
worker routes by the prefills of every worker. It is an open-addressed hash table of fixed size
(`PREFIX_ENTRIES`) with a few probes per key; when a key's probes are all taken, the entry of the
probe position picked by the key's high bits is overwritten. Writers take no lock: a torn or
overwritten entry only makes one routing hint wrong, and the engine's own prefix cache is what
really decides hits. Slot bits are `slot % 64`, so with more than 64 endpoints two slots can share
a bit. The index does not see engine evictions; a stale hint sends a request to an engine that
recomputes the prefix, after which that engine holds it again.
"""

from __future__ import annotations

from collections.abc import Callable

from scheduling.policies import JobInfo
from scheduling.registry import Target
from scheduling.tokens import blocks_covered, hashes_covering
from state.shared import PREFIX_ENTRIES, SharedState

PROBES = 4
_MASK = PREFIX_ENTRIES - 1


def _home(key: int) -> int:
    """A key's first probe position. A key is a prefix's CRC-32 above its length in blocks (scheduling/tokens.py):
    its low bits are the length, the same for every prompt's hash at one boundary, so the CRC half picks the entry
    (the length alone put every prompt's k-th hash in the same four entries, each new prompt overwriting the last
    ones' prefixes)."""
    return ((key >> 32) ^ key) & _MASK


class PrefixIndex:
    needs_hashes = True  # it knows prompts by their block hashes (scheduling/tokens.py)
    needs_ids = False
    tells_conversations = False  # it knows what was sent where, not which prompts other prompts extend

    def __init__(self, shared: SharedState, block_tokens: int = 16):
        # The table's columns (views made once): an entry's key, its bit mask of slots, and its last slot.
        self.key, self.slots, self.last = shared.prefix.key, shared.prefix.slots, shared.prefix.last
        self.block_tokens = block_tokens  # the tokens of one block (kv_affinity_block_size)
        # Cluster mode: what this worker records, to the other replicas too (serving/cluster.py batches it).
        self.share: Callable[[list[int], int], None] | None = None

    def _find(self, key: int) -> int:
        """The entry index holding `key`, or -1."""
        keys, i = self.key, _home(key)
        for _ in range(PROBES):
            k = keys[i]
            if k == key:
                return i
            if k == 0:
                return -1
            i = (i + 1) & _MASK
        return -1

    def placed(self, lease, job) -> None:
        """The estimate learns a prompt when its engine has computed it (`record`), not when it is sent."""

    def record(self, hashes: list[int], slot: int) -> None:
        """`slot` has just prefilled a prompt with these block hashes."""
        self.write(hashes, slot)
        if self.share is not None:
            self.share(hashes, slot)

    def write(self, hashes: list[int], slot: int) -> None:
        """The hashes into the table (what `record` does here, and what another replica recorded)."""
        keys, slots, last, bit = self.key, self.slots, self.last, 1 << (slot % 64)
        for key in hashes:
            key = key or 1  # 0 marks an empty entry
            i, victim = _home(key), -1
            for p in range(PROBES):
                k = keys[i]
                if k == key:
                    slots[i] |= bit
                    last[i] = slot
                    break
                if k == 0:
                    keys[i], slots[i], last[i] = key, bit, slot
                    break
                if p == (key >> 60) % PROBES:
                    victim = i
                i = (i + 1) & _MASK
            else:
                keys[victim], slots[victim], last[victim] = key, bit, slot

    def _has(self, key: int, bit: int) -> bool:
        i = self._find(key or 1)
        return i >= 0 and bool(self.slots[i] & bit)

    def cached_blocks(self, hashes: list[int], slot: int) -> int:
        """How many leading blocks of the prompt `slot` is believed to hold."""
        if not hashes:
            return 0
        bit = 1 << (slot % 64)
        lo, hi = 0, len(hashes)
        if self._has(hashes[-1], bit):
            return blocks_covered(hi)
        while lo < hi:  # invariant: the first lo hashes are held, hash hi (if any) is not
            mid = (lo + hi + 1) // 2
            if self._has(hashes[mid - 1], bit):
                lo = mid
            else:
                hi = mid - 1
        return blocks_covered(lo)

    def last_owner(self, hashes: list[int], blocks: int) -> int:
        """The slot that most recently prefilled the first `blocks` blocks (-1 when unknown)."""
        if blocks <= 0:
            return -1
        i = self._find(hashes[hashes_covering(blocks) - 1] or 1)
        return int(self.last[i]) if i >= 0 else -1

    # -- as the policies' PrefixSource ------------------------------------------------------------

    def cached_tokens(self, job: JobInfo, target: Target) -> int:
        return self.cached_blocks(job.block_hashes, target.slot) * self.block_tokens

    def cache_fill(self, target: Target) -> tuple[int, int]:
        return 0, 0  # it never sees an eviction, so it cannot tell a full cache from one with room

    def last_holder(self, job: JobInfo, tokens: int) -> int:
        return self.last_owner(job.block_hashes, tokens // self.block_tokens)

    def starts(self, job: JobInfo, target: Target, tokens: int) -> bool | None:
        return None  # it knows what was sent where, not which prompts other prompts extend

    def chains(self, target: Target) -> int:
        return -1

    def previous_turn(self, job: JobInfo, tokens: int) -> int:
        return -1  # it does not tell conversations

    def kept(self, job: JobInfo, target: Target, tokens: int) -> None:
        pass
