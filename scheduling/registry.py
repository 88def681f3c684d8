"""The instance set: a versioned JSON document in shared memory, and each worker's parsed view of it.

A refresh (`set`, `add`, `del`, `pause`, `resume`) rewrites the document under the shared lock and bumps
its version; every worker compares the version on each request and re-parses when it changed, so all
workers route by the new set at once. An instance id names one engine for as long as it is registered:
`set` and `add` keep a registered instance that comes again unchanged (its slots, load and pause state)
and refuse one that comes back with another role, model or endpoints (409). Paused instances stay in the
set and keep their in-flight requests; the scheduler gives them no new ones.

Each endpoint of each instance gets a slot (see shared.py). The document keeps the free slots in the
order they were freed, and a new endpoint takes the least recently freed one whose ledger column is
empty (no request, no held decode slot): a removed endpoint's requests still in flight release their
load, and report their failures to the breaker, on a slot that nobody else holds. When the only free
slots still carry such requests, the refresh is refused (409) rather than mixing two engines' load.
A slot's health row is reset only when a refresh that hands it out is applied.

Where the set comes from: the static config at start, a change from outside (POST /instances/refresh; a
discovery of engines would be one more caller of `change`), and, in cluster mode, the set another replica
stored (`adopt`, on the cluster's sync). Every one of them ends in `apply`, the one write; `change` is the way
in for a new writer: in cluster mode it goes through the store (`SetStore`) so that every replica applies it.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Protocol

import ujson

from config import MAX_ID, Endpoint, Instance, address_key, parse_instance
from scheduling.ledger import Ledger
from state.shared import (
    BREAKER_CLOSED,
    DOC_BYTES,
    MAX_SLOTS,
    MAX_WORKERS,
    EndpointRow,
    SharedState,
)


class RefreshError(ValueError):
    """A refresh request that cannot be applied; `status` is the HTTP status to answer."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Target:
    """One schedulable endpoint of one instance: an engine a leg of a request can be sent to."""

    instance_id: int
    endpoint_id: int
    slot: int  # its column in the shared tables (ledger load, health, breaker), for as long as it is registered
    role: str
    model: str
    engine_type: str
    url: str  # base URL, e.g. http://127.0.0.1:8000
    address: str  # host:port as configured
    paused: bool
    priority: bool = False  # its engine runs vLLM's priority scheduling: requests carry their class as `priority`

    @cached_property
    def label(self) -> str:
        """How logs name it: instance/endpoint@address (made once: every request line names one or two)."""
        return f"{self.instance_id}/{self.endpoint_id}@{self.address}"


@dataclass(frozen=True)
class RefreshResult:
    event: str
    instance_count: int  # instances the request named
    message: str  # what changed


class Topology:
    """An immutable per-worker view of one version of the document: pools by (model, role)."""

    def __init__(self, version: int, entries: list[dict]):
        self.version = version
        self.entries = entries
        self.instances: dict[int, Instance] = {}
        self.paused: set[int] = set()
        self.targets: list[Target] = []
        self.by_slot: dict[int, Target] = {}
        self.pools: dict[tuple[str, str], list[Target]] = {}
        for e in entries:
            inst = parse_instance("instance", e)
            self.instances[inst.id] = inst
            if e.get("paused"):
                self.paused.add(inst.id)
            for ep, slot in zip(inst.endpoints, e["slots"]):
                t = Target(
                    inst.id,
                    ep.id,
                    slot,
                    inst.role,
                    inst.model_name,
                    inst.engine_type,
                    ep.base_url.rstrip("/"),
                    ep.address,
                    bool(e.get("paused")),
                    inst.scheduling_policy == "priority",
                )
                self.targets.append(t)
                self.by_slot[slot] = t
                self.pools.setdefault((inst.model_name, inst.role), []).append(t)
        self.model_names = frozenset(model for model, _ in self.pools)

    def models(self) -> list[str]:
        return list(dict.fromkeys(t.model for t in self.targets))

    def pool(self, model: str, role: str) -> list[Target]:
        return self.pools.get((model, role), [])


class SetStore(Protocol):
    """Where a change of the instance set goes to reach every replica (cluster mode: serving/cluster.py), which
    applies it here too (`Registry.apply`)."""

    async def refresh(self, event: str, items: list) -> RefreshResult: ...


class Registry:
    """Reads and writes the shared instance document."""

    def __init__(self, shared: SharedState):
        self.shared = shared
        self._view: Topology | None = None
        self.store: SetStore | None = None  # cluster mode: a change goes through it to every replica

    async def change(self, event: str, items: list[Instance | int]) -> RefreshResult:
        """A change of the set from outside (see the module docstring): on every replica in cluster mode, else
        here. Raises RefreshError as `apply` does."""
        if self.store is not None:
            return await self.store.refresh(event, items)
        return self.apply(event, items)

    # -- reading (hot path) ------------------------------------------------------------------

    def view(self) -> Topology:
        version = self.shared.globals.doc_version
        view = self._view
        if view is None or view.version != version:
            view = self._view = self._load()
        return view

    def _load(self) -> Topology:
        with self.shared.lock:
            version = self.shared.globals.doc_version
            entries, _ = self._read()
        return Topology(version, entries)

    # -- writing (management plane, rare) ----------------------------------------------------

    def _read(self) -> tuple[list[dict], list[int]]:
        """(instance entries, free slots least recently freed first); call with the lock held."""
        n = self.shared.globals.doc_len
        if not n:
            return [], list(range(MAX_SLOTS))
        doc = ujson.loads(bytes(self.shared.doc[:n]))
        return doc["instances"], doc["free"]

    def apply(self, event: str, items: list[Instance | int], paused: frozenset[int] | None = None) -> RefreshResult:
        """Apply one refresh event atomically: it is applied whole or, on a RefreshError, not at all.

        `paused` (a `set` only): the ids paused afterwards, the others resumed (another replica's set, adopted)."""
        with self.shared.lock:
            entries, free = self._read()
            by_id = {e["id"]: e for e in entries}
            fresh: list[Instance] = []
            if event in ("set", "add"):
                changed = {inst.id for inst in items if inst.id in by_id and not _same(by_id[inst.id], inst)}
                if changed and event == "add":
                    raise RefreshError(
                        f"instance {min(changed)} is registered with a different role, model or endpoints; "
                        "an id names one engine: set replaces it, or del it first, or use a new id",
                        409,
                    )
                fresh = [inst for inst in items if inst.id not in by_id or inst.id in changed]
            if event == "set":
                # `set` makes the registered set exactly the listed one: an id listed with another role, model
                # or endpoints (its pod moved, say) is a new engine under that id, as if deleted and added.
                listed = {inst.id for inst in items}
                removed = [e for e in entries if e["id"] not in listed or e["id"] in changed]
                free = free + [slot for e in removed for slot in e["slots"]]  # freed now: handed out last
                new_slots = self._take(free, fresh)
                kept = listed - {inst.id for inst in fresh}
                entries = [by_id[inst.id] if inst.id in kept else _entry(inst, new_slots[inst.id]) for inst in items]
                message = (
                    f"{len(entries)} instances registered: {len(fresh) - len(changed)} added, {len(changed)} replaced, "
                    f"{len(removed) - len(changed)} removed, {len(items) - len(fresh)} unchanged"
                )
            elif event == "add":
                new_slots = self._take(free, fresh)
                entries = entries + [_entry(inst, new_slots[inst.id]) for inst in fresh]
                message = f"{len(fresh)} added, {len(items) - len(fresh)} already registered"
            elif event == "del":
                ids = {_id(i) for i in items}
                removed = [e for e in entries if e["id"] in ids]
                entries = [e for e in entries if e["id"] not in ids]
                free = free + [slot for e in removed for slot in e["slots"]]
                message = f"{len(removed)} removed, {len(ids) - len(removed)} not registered"
            elif event in ("pause", "resume"):
                ids = {_id(i) for i in items}
                missing = ids - set(by_id)
                if missing:
                    raise RefreshError(f"unknown instance ids: {sorted(missing)}", 404)
                for iid in ids:
                    by_id[iid]["paused"] = event == "pause"
                message = f"{len(ids)} {'paused: they take no new requests and finish what they hold' if event == 'pause' else 'resumed'}"
            else:
                raise RefreshError(f"unknown event {event!r}: use set, add, del, pause or resume")
            if paused is not None and event == "set":
                for e in entries:
                    e["paused"] = e["id"] in paused
            if event in ("set", "add"):
                _check_addresses(entries)
            raw = ujson.dumps({"instances": entries, "free": free}).encode()
            if len(raw) > DOC_BYTES:
                raise RefreshError("instance document too large", 413)
            # Validated: from here on nothing refuses. Only now do the new endpoints' slots start afresh.
            for inst in fresh:
                for slot in new_slots[inst.id]:
                    self._reset_slot(slot)
            self.shared.doc[: len(raw)] = raw
            self.shared.globals.doc_len = len(raw)
            self.shared.globals.doc_version += 1
            return RefreshResult(event, len(items), message)

    def export(self) -> list[dict]:
        """The registered instances as a refresh would list them, each with its pause state (no slots: those are
        this replica's own)."""
        return [{k: v for k, v in e.items() if k != "slots"} for e in self.view().entries]

    def adopt(self, entries: list[dict]) -> RefreshResult:
        """Make the registered set `export()`'s output of another replica."""
        items = [
            parse_instance(f"instances[{i}]", {k: v for k, v in e.items() if k != "paused"})
            for i, e in enumerate(entries)
        ]
        return self.apply("set", items, paused=frozenset(e["id"] for e in entries if e.get("paused")))

    def _take(self, free: list[int], fresh: list[Instance]) -> dict[int, list[int]]:
        """Slots for the endpoints of `fresh`, taken out of `free` (least recently freed first), by instance id.

        A slot whose ledger column still counts a request or a held decode slot (a removed endpoint's
        requests still in flight) is skipped: handing it out would put that load, and those requests'
        failures, on the new engine."""
        needed = sum(len(inst.endpoints) for inst in fresh)
        if not needed:
            return {}
        if needed > len(free):
            raise RefreshError(f"too many endpoints (at most {MAX_SLOTS})", 413)
        ledger = Ledger(self.shared, 0, MAX_WORKERS, remote=True)
        idle = [slot for slot in free if not ledger.requests(slot) and not ledger.held(slot)]
        if needed > len(idle):
            raise RefreshError(
                f"no free slot for {needed - len(idle)} more endpoints yet: {len(free) - len(idle)} free slots still "
                "carry requests of removed endpoints; try again when they finish",
                409,
            )
        taken = idle[:needed]
        chosen = set(taken)
        free[:] = [slot for slot in free if slot not in chosen]
        out: dict[int, list[int]] = {}
        it = iter(taken)
        for inst in fresh:
            out[inst.id] = [next(it) for _ in inst.endpoints]
        return out

    def _reset_slot(self, slot: int) -> None:
        self.shared.endpoints[slot] = EndpointRow(healthy=1.0, breaker=BREAKER_CLOSED)


def _entry(inst: Instance, slots: list[int]) -> dict:
    return {**inst.to_json(), "slots": slots, "paused": False}


def _id(item: Instance | int) -> int:
    return item if isinstance(item, int) else item.id


def _same(entry: dict, inst: Instance) -> bool:
    return (
        entry["role"] == inst.role
        and entry["model_name"] == inst.model_name
        and entry.get("engine_type", "vllm") == inst.engine_type
        and entry.get("scheduling_policy", "fcfs") == inst.scheduling_policy
        and [(e["id"], e["address"]) for e in entry["endpoints"]] == [(e.id, e.address) for e in inst.endpoints]
    )


def _check_addresses(entries: list[dict]) -> None:
    """One engine address belongs to one endpoint of one instance: load, health and metaserver lookups key on it."""
    owner: dict[str, int] = {}
    for e in entries:
        for ep in e["endpoints"]:
            addr = address_key(ep["address"])
            if addr in owner:
                raise RefreshError(
                    f"endpoint address {addr} is registered twice (instances {owner[addr]} and {e['id']})", 409
                )
            owner[addr] = e["id"]


def parse_refresh_body(body: object) -> tuple[str, list]:
    """Validate a /instances/refresh body; `del`/`pause`/`resume` accept ids or instance objects."""
    if not isinstance(body, dict):
        raise RefreshError("body must be a JSON object with 'event' and 'instances'")
    event = body.get("event")
    if event not in ("set", "add", "del", "pause", "resume"):
        raise RefreshError("event: must be one of set, add, del, pause, resume")
    raw = body.get("instances")
    if not isinstance(raw, list):
        raise RefreshError("instances: must be a list")
    items: list = []
    for i, item in enumerate(raw):
        if event in ("del", "pause", "resume") and not (isinstance(item, dict) and "endpoints" in item):
            iid = item.get("id") if isinstance(item, dict) else item
            if isinstance(iid, bool) or not isinstance(iid, int) or not 0 <= iid <= MAX_ID:
                raise RefreshError(f"instances[{i}]: must be an instance id (0..{MAX_ID}) or an object with one")
            items.append(iid)
        else:
            try:
                items.append(parse_instance(f"instances[{i}]", item))
            except ValueError as e:
                raise RefreshError(str(e).replace("motor_coordinator_config.", "")) from None
    ids = [_id(x) for x in items]
    if len(ids) != len(set(ids)):
        raise RefreshError("instances: duplicate instance ids in one request")
    return event, items


__all__ = [
    "Endpoint",
    "RefreshError",
    "RefreshResult",
    "Registry",
    "SetStore",
    "Target",
    "Topology",
    "parse_refresh_body",
]
