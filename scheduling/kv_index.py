"""The index of what each engine's KV cache holds, from the engines' own KV events (scheduling/kv_events.py).

**Keys.** A block's key is the Coordinator's own hash of the prompt up to that block's end, in token ids: a
CRC-32 running over the ids (4 bytes each, little-endian: vocabularies are under 2^32; a larger id, the
simulator's, is taken modulo 2^32) from the prompt's start, beside the block count
(`(crc << 32) | blocks`). vLLM's block hashes are not reproduced: an event's `token_ids` give the key, chained
from its parent block's key, and a request's prompt ids give the same keys (`PromptKeys`), so a prompt's cached
prefix on an engine is its longest run of leading keys the engine holds. The CRC continues from any earlier
point (`zlib.crc32(more, crc)`), so a prompt's key at any block is one C call from the nearest key already
computed, and a lookup touches each byte of the prompt about once whichever engines it asks about.

**Scope.** Blocks computed under a LoRA adapter or with extra keys (vLLM's `extra_keys`: a cache salt on the
first block, multimodal identifiers) are kept apart: the adapter's name starts the chain, and a block's other
extra keys are hashed in before its tokens. A request's `cache_salt` is its prompt's seed the same way; its
multimodal blocks cannot be keyed here, so a prompt's prediction stops before its first image.

**The table.** One open-addressed table in shared memory (state/shared.py `KvBlockTable`, KV_ENTRIES
entries), written by the replica's one subscriber and read by every worker: an entry is a key mixed with its
slot and that slot's epoch, and the count of the slot's blocks that extend it (what tells a prefix several
conversations share from one conversation's own history). Forgetting an engine's blocks (AllBlocksCleared, a restart, lost events) bumps its
epoch: its old entries match nothing and count as free for the next writes, so clearing costs nothing. A key
whose probe window is full takes the entry of a victim (whose slot's count goes down): the table is a cap, and
what it drops only makes a prediction low. Readers take no lock; a torn or stale entry makes one hint wrong.
"""

from __future__ import annotations

import json
import zlib
from bisect import bisect_right
from collections import OrderedDict, deque

from scheduling import clock
from scheduling.policies import JobInfo
from scheduling.registry import Target
from state.shared import KvEndpointRow, SharedState

PROBES = 8
_M64 = (1 << 64) - 1
_ODD = 0x9E3779B97F4A7C15
_SLOT_MIX, _EPOCH_MIX = 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9
TOKEN_BYTES = 4  # a token id's bytes in a key: half the CRC of 8

# A slot's subscription (KvEndpointRow.state).
KV_OFF, KV_LIVE, KV_REPLAYING, KV_LOST = 0, 1, 2, 3
STATE_NAMES = {KV_OFF: "off", KV_LIVE: "live", KV_REPLAYING: "replaying", KV_LOST: "lost"}


def extra_bytes(extra: object) -> bytes:
    """A scope value (LoRA name, a block's extra keys) as the bytes hashed into a chain."""
    return b"\x00" + json.dumps(extra, separators=(",", ":"), default=str).encode()


def block_key(crc: int, blocks: int) -> int:
    return (crc << 32) | (blocks & 0xFFFFFFFF)


def mixed(key: int, slot: int, epoch: int) -> int:
    """A 64-bit key (or an engine's block hash) as a BlockTable holds it for `slot` in `epoch`: its entries of
    an earlier epoch match nothing. Never 0 (a free entry)."""
    return (((key ^ ((slot + 1) * _SLOT_MIX + epoch * _EPOCH_MIX)) & _M64) * _ODD) & _M64 or 1


class BlockTable:
    """An open-addressed table of mixed keys with their owners (slot + 1, epoch), and optionally a value each:
    the shared index (no values), or the subscriber's own map from an engine's block hash to its key."""

    def __init__(self, keys, owners, values=None, epochs=None):
        self.keys, self.owners, self.values = keys, owners, values
        self.size = len(keys)
        self.shift = 64 - (self.size.bit_length() - 1)
        self.epochs = epochs  # slot -> its current epoch (a view of KvEndpointRow, or a list)

    def _live(self, owner: int) -> bool:
        return owner != 0 and (owner >> 16) == self.epochs[(owner & 0xFFFF) - 1].epoch

    def find(self, tag: int) -> int:
        keys, size = self.keys, self.size
        i = tag >> self.shift if self.shift < 64 else 0
        for _ in range(PROBES):
            if keys[i] == tag:
                return i
            i = (i + 1) % size
        return -1

    def put(self, tag: int, owner: int, value: int = 0) -> tuple[int, bool, int]:
        """Store `tag`: (its entry, True if it was not there, the slot whose live entry it displaced or -1)."""
        keys, owners, size = self.keys, self.owners, self.size
        i = tag >> self.shift if self.shift < 64 else 0
        free = -1
        for _ in range(PROBES):
            k = keys[i]
            if k == tag:
                if self.values is not None:
                    self.values[i] = value
                return i, False, -1
            if free < 0 and (k == 0 or not self._live(owners[i])):
                free = i
            i = (i + 1) % size
        lost = -1
        if free < 0:  # the window is full of live entries: one of them goes, picked by the tag's low bits
            free = ((tag >> self.shift if self.shift < 64 else 0) + tag % PROBES) % size
            lost = (owners[free] & 0xFFFF) - 1
        keys[free], owners[free] = tag, owner
        if self.values is not None:
            self.values[free] = value
        return free, True, lost

    def drop(self, i: int) -> None:
        self.keys[i], self.owners[i] = 0, 0


class KvIndex:
    """The shared table of the engines' blocks (state/shared.py), by slot, with each block's count of the slot's
    blocks that extend it: a block none extends (a leaf) ends a chain, one conversation's history or a prompt
    computed once; a slot's `leaves` count its chains."""

    def __init__(self, shared: SharedState):
        table = shared.kv_blocks
        self.rows: list[KvEndpointRow] = [shared.kv_endpoints[s] for s in range(len(shared.kv_endpoints))]
        self.table = BlockTable(table.key, table.owner, epochs=self.rows)
        self.children = table.children

    # -- the subscriber's writes ---------------------------------------------------------------------

    def add(self, slot: int, key: int, parent: int = 0, parent_at: int = -1) -> int:
        """`slot` stored the block `key`, extending the block `parent` (0: it starts a chain; `parent_at`: its
        entry, when the caller has just added it): the block's entry."""
        row = self.rows[slot]
        i, new, lost = self.table.put(mixed(key, slot, row.epoch), (row.epoch << 16) | (slot + 1))
        if not new:
            return i
        row.blocks += 1
        row.peak = max(row.peak, row.blocks)
        row.leaves += 1
        if lost >= 0:  # the entry was another block's, dropped for want of room (perhaps the parent's)
            self.rows[lost].blocks -= 1
            if self.children[i] == 0:
                self.rows[lost].leaves -= 1
        self.children[i] = 0
        if parent_at < 0 and parent:
            parent_at = self.table.find(mixed(parent, slot, row.epoch))
        if parent_at >= 0 and parent_at != i:
            if self.children[parent_at] == 0:
                row.leaves -= 1
            self.children[parent_at] += 1
        return i

    def remove(self, slot: int, key: int, parent: int = 0) -> None:
        row = self.rows[slot]
        i = self.table.find(mixed(key, slot, row.epoch))
        if i < 0:
            return
        if self.children[i] == 0:
            row.leaves -= 1
        self.table.drop(i)
        row.blocks -= 1
        row.evicted += 1
        p = self.table.find(mixed(parent, slot, row.epoch)) if parent else -1
        if p >= 0 and self.children[p] > 0:
            self.children[p] -= 1
            if self.children[p] == 0:
                row.leaves += 1

    def forget(self, slot: int) -> None:
        """Every block of `slot` is gone: its epoch moves on (its entries are dead, reused by later writes)."""
        row = self.rows[slot]
        row.epoch = (row.epoch + 1) & 0xFFFFFFFFFFFF
        row.blocks = row.peak = row.evicted = row.leaves = 0
        row.clears += 1

    # -- lookups ---------------------------------------------------------------------------------

    def cached_blocks(self, slot: int, prompt: PromptKeys) -> int:
        """The leading blocks of the prompt `slot` holds (a binary search: an engine's cache is prefix-closed
        to within its evictions, and vLLM's own match stops at the first block it lacks)."""
        row = self.rows[slot]
        size = row.block_size
        if size <= 0:
            return 0
        lo, hi = 0, prompt.blocks(size)
        find, epoch = self.table.find, row.epoch
        if hi and find(mixed(prompt.key(size, 1), slot, epoch)) < 0:  # the head evicted: nothing is a hit
            return 0
        while lo < hi:  # the first lo blocks are held; none past hi
            mid = (lo + hi + 1) // 2
            if find(mixed(prompt.key(size, mid), slot, epoch)) >= 0:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def cached_tokens_at(self, slot: int, prompt: PromptKeys) -> int:
        return self.cached_blocks(slot, prompt) * self.rows[slot].block_size

    def children_at(self, slot: int, prompt: PromptKeys, blocks: int) -> int:
        """How many of `slot`'s blocks extend the prompt's first `blocks` blocks (-1: it does not hold them)."""
        return self.children_of(slot, prompt.key(self.rows[slot].block_size, blocks))

    def children_of(self, slot: int, key: int) -> int:
        row = self.rows[slot]
        i = self.table.find(mixed(key, slot, row.epoch))
        return self.children[i] if i >= 0 else -1


class PromptKeys:
    """A prompt's block keys, computed on demand and kept: each from the nearest earlier one already known.
    `data`: its ids as TOKEN_BYTES-byte integers (scheduling/tokens.py `ids_bytes`, or scheduling/exact.py's
    encodings, which are made in that form off the loop)."""

    __slots__ = ("crcs", "data", "n_tokens", "offsets")

    def __init__(self, data: bytes, seed: bytes = b""):
        self.data = memoryview(seed + data if seed else data)
        self.n_tokens = len(data) // TOKEN_BYTES
        start = len(seed)
        self.offsets = [start]  # sorted byte offsets whose CRC is known
        self.crcs = {start: zlib.crc32(self.data[:start])}

    def blocks(self, block_size: int) -> int:
        """The blocks an engine's cache can serve it: vLLM computes at least the prompt's last token, so its
        hits are the full blocks of the first n - 1 tokens (a prompt of whole blocks reuses all but its last)."""
        return max(self.n_tokens - 1, 0) // block_size

    def key(self, block_size: int, blocks: int) -> int:
        return block_key(self._crc(self.offsets[0] + blocks * block_size * TOKEN_BYTES), blocks)

    def head(self, tokens: int) -> tuple[int, int]:
        """Its first `tokens` tokens, in its scope, as (their count, a CRC of them): equal for two prompts that
        begin alike."""
        return tokens, self._crc(self.offsets[0] + tokens * TOKEN_BYTES) ^ (self.offsets[0] << 32)

    def _crc(self, end: int) -> int:
        """The CRC of the bytes before `end`, from the nearest earlier one known."""
        crc = self.crcs.get(end)
        if crc is None:
            offsets = self.offsets
            j = bisect_right(offsets, end) - 1
            start = offsets[j]
            crc = self.crcs[end] = zlib.crc32(self.data[start:end], self.crcs[start])
            offsets.insert(j + 1, end)
        return crc


def prompt_seed(cache_salt: object = None) -> bytes:
    """The bytes a request's chain starts from: its cache salt, as vLLM puts it in its first block's extra keys."""
    return extra_bytes([cache_salt]) if cache_salt else b""


# How long a finished request's prompt still counts as in flight while its events do not show it stored: they may
# trail its answer (the subscriber thread shares the process, and the cores, with the workers).
INFLIGHT_GRACE_S = 1.0
INFLIGHT_MAX = 256  # per slot and worker, the latest: what a lookup compares with stays bounded
BRANCHES_MAX = 1024  # side branches remembered per slot and worker, the latest
TURNS_MAX = 4096  # prompts remembered per slot and worker by the key their full blocks end at, the latest ...
TURNS_PER_KEY = 16  # ... and of those ending at one key (a shared system prompt's), the latest
UNKEYED_MAX = 64  # per slot and worker, the latest prompts sent before its first events


def _flying(flight: Flight) -> bool:
    lease = flight.lease
    return not lease.released or clock.now() - lease.ended < INFLIGHT_GRACE_S


class Flight:
    """A prompt this worker sent to an engine: its lease, its keys, whether it was placed as a new conversation,
    and whether the engine's events have shown its blocks stored (from then on the index says what is left of
    them: another prefill may evict them before the grace is over)."""

    __slots__ = ("keys", "lease", "opens", "stored")

    def __init__(self, lease, keys: PromptKeys, opens: bool):
        self.lease, self.keys, self.opens, self.stored = lease, keys, opens, False


class KvEventSource:
    """The policies' PrefixSource from the engines' KV events, for requests whose prompt ids are known
    (`JobInfo.token_ids`: a model with a tokenizer_path, or a token-id prompt); for the others, and for engines
    whose events are not live, the estimate it wraps (scheduling/affinity.py) answers."""

    def __init__(self, index: KvIndex, estimate):
        self.index, self.estimate = index, estimate
        # This worker's prompts in flight per slot: an engine computing a prompt holds its blocks for the requests
        # after it before its events can say so (vLLM shares them even within one step), and a new conversation's
        # chain is there before its events.
        self.inflight: dict[int, list[Flight]] = {}
        # Per slot, the keys of blocks where a conversation this worker kept there left a side branch: the engine
        # cached a turn's answer as it generated it, and the next prompt rendered it otherwise. That branch's end
        # is a leaf of no conversation of its own once the next turn's blocks are stored beside it.
        self.branches: dict[int, dict[int, None]] = {}
        # Per slot, this worker's prompts sent there by the key their full blocks end at, with a running stamp: a
        # short first turn has no full block past the system prompt it opens with, so no block shows where its
        # conversation went; its next turn extends it token for token.
        self.turns: dict[int, OrderedDict[int, deque[tuple[int, tuple[int, int]]]]] = {}
        self.unkeyed: dict[int, list[tuple[int, PromptKeys]]] = {}  # sent before the slot's block size was known
        self.stamp = 0
        self.needs_hashes = estimate.needs_hashes
        self.needs_ids = True
        self.tells_conversations = True
        self.block_tokens = estimate.block_tokens

    def _live(self, slot: int) -> bool:
        row = self.index.rows[slot]
        return row.state == KV_LIVE or row.state == KV_REPLAYING

    def _in_flight(self, slot: int) -> list[Flight]:
        flying = self.inflight.get(slot)
        if not flying:
            return []
        flying[:] = [f for f in flying if _flying(f)]
        return flying

    def cached_tokens(self, job: JobInfo, target: Target) -> int:
        prompt = job.prompt_keys
        if prompt is None or not self._live(target.slot):
            return self.estimate.cached_tokens(job, target)
        held = self.index.cached_tokens_at(target.slot, prompt)
        return max(held, self._inflight_tokens(target.slot, prompt))

    def _inflight_tokens(self, slot: int, prompt: PromptKeys) -> int:
        """The leading tokens of `prompt` that a prompt in flight on `slot` shares (whole blocks of it)."""
        size = self.index.rows[slot].block_size
        if size <= 0:
            return 0
        best = 0
        row = self.index.rows[slot]
        for flight in self._in_flight(slot):
            other = flight.keys
            full = other.n_tokens // size
            if not flight.stored and full:
                flight.stored = self.index.table.find(mixed(other.key(size, full), slot, row.epoch)) >= 0
            if flight.stored:  # its events are in: what the index holds of it is what is left
                continue
            lo, hi = best, min(prompt.blocks(size), full)  # all its full blocks get cached
            if lo >= hi or other.key(size, lo + 1) != prompt.key(size, lo + 1):
                continue
            while lo < hi:  # the first lo blocks are shared; none past hi
                mid = (lo + hi + 1) // 2
                if other.key(size, mid) == prompt.key(size, mid):
                    lo = mid
                else:
                    hi = mid - 1
            best = lo
        return best * size

    def placed(self, lease, job: JobInfo) -> None:
        if job.prompt_keys is not None:
            flying = self.inflight.setdefault(lease.slot, [])
            flying[:] = [f for f in flying if _flying(f)][-INFLIGHT_MAX + 1 :]
            flying.append(Flight(lease, job.prompt_keys, job.opens))
            self._remember(lease.slot, job.prompt_keys)

    def _remember(self, slot: int, prompt: PromptKeys) -> None:
        self.stamp += 1
        unkeyed = self.unkeyed.setdefault(slot, [])
        unkeyed.append((self.stamp, prompt))
        del unkeyed[:-UNKEYED_MAX]
        self._key_turns(slot)

    def _key_turns(self, slot: int) -> None:
        """Files `slot`'s remembered prompts by the key their full blocks end at, once its block size is known (from
        its first events; until then they wait)."""
        size, unkeyed = self.index.rows[slot].block_size, self.unkeyed.get(slot)
        if size <= 0 or not unkeyed:
            return
        turns = self.turns.setdefault(slot, OrderedDict())
        for stamp, prompt in unkeyed:
            key = prompt.key(size, prompt.n_tokens // size)
            at = turns.pop(key, None) or deque(maxlen=TURNS_PER_KEY)
            at.append((stamp, prompt.head(prompt.n_tokens)))
            turns[key] = at
        unkeyed.clear()
        while len(turns) > TURNS_MAX:
            turns.popitem(last=False)

    def previous_turn(self, job: JobInfo, tokens: int) -> int:
        prompt = job.prompt_keys
        if prompt is None or tokens <= 0:
            return -1
        slot, latest = -1, 0
        for s in [s for s, unkeyed in self.unkeyed.items() if unkeyed]:
            self._key_turns(s)
        for s, turns in self.turns.items():
            size = self.index.rows[s].block_size
            if size <= 0 or tokens % size:
                continue
            for stamp, head in turns.get(prompt.key(size, tokens // size), ()):
                n = head[0]
                if stamp > latest and tokens < n <= prompt.n_tokens and prompt.head(n) == head:
                    slot, latest = s, stamp
        return slot

    def starts(self, job: JobInfo, target: Target, tokens: int) -> bool | None:
        """Whether `job` starts a conversation rather than continues one, judged where it holds `tokens` (its
        longest cached prefix): nothing held, or a prefix that at least two chains go on from (a shared system
        prompt), starts one; a prefix that no chain or one goes on from is a conversation's own history (one:
        the engine cached the last answer as it generated it, which the next prompt may render otherwise).
        None: not known (no exact ids, or the engine's events are not live)."""
        prompt, slot = job.prompt_keys, target.slot
        size = self.index.rows[slot].block_size
        if prompt is None or not self._live(slot) or size <= 0:
            return None
        blocks = tokens // size
        if blocks > self.index.cached_blocks(slot, prompt):
            # Held through a prompt in flight there, its events not in yet: a conversation's next turn comes after
            # its last one is answered, so it continues only a finished prompt whose full blocks it shares all of.
            return not any(
                f.lease.released
                and f.keys.n_tokens // size == blocks
                and f.keys.key(size, blocks) == prompt.key(size, blocks)
                for f in self._in_flight(slot)
            )
        return blocks == 0 or self.index.children_at(slot, prompt, blocks) > 1

    def kept(self, job: JobInfo, target: Target, tokens: int) -> None:
        """`job` continues its conversation on `target`, which holds its first `tokens` tokens: a branch there
        off its history is its last answer as generated, to be counted as no conversation of its own."""
        size = self.index.rows[target.slot].block_size
        if job.prompt_keys is None or size <= 0 or tokens < size:
            return
        key = job.prompt_keys.key(size, tokens // size)
        if self.index.children_of(target.slot, key) == 1:
            branches = self.branches.setdefault(target.slot, {})
            branches[key] = None
            if len(branches) > BRANCHES_MAX:
                del branches[next(iter(branches))]

    def chains(self, target: Target) -> int:
        """The conversations `target` holds: its chains' ends from the events less the side branches its
        conversations left, and the new conversations this worker placed there whose blocks the events do not
        show yet (-1: not known)."""
        slot = target.slot
        if not self._live(slot):
            return -1
        row = self.index.rows[slot]
        size, epoch, find = row.block_size, row.epoch, self.index.table.find
        n = row.leaves
        branches = self.branches.get(slot, {})
        for key in list(branches):
            children = self.index.children_of(slot, key)
            if children < 1:  # gone, or what went on from it is
                del branches[key]
            elif children > 1:  # the next turn's blocks beside the answer as generated
                n -= 1
        for f in self._in_flight(slot):
            full = f.keys.n_tokens // size if size > 0 else 0
            if f.opens and full and find(mixed(f.keys.key(size, full), slot, epoch)) < 0:
                n += 1
        return max(n, 0)

    def cache_fill(self, target: Target) -> tuple[int, int]:
        if not self._live(target.slot):
            return 0, 0
        row = self.index.rows[target.slot]
        return row.blocks, row.peak if row.evicted else 0

    def last_holder(self, job: JobInfo, tokens: int) -> int:
        # The events say who holds a block, not who came to hold it last: among equal holders, the policy's order.
        return -1 if job.prompt_keys is not None else self.estimate.last_holder(job, tokens)

    def record(self, hashes: list[int], slot: int) -> None:
        self.estimate.record(hashes, slot)
