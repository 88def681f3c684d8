"""The instance set: a versioned JSON document in shared memory, and each worker's parsed view of it.

A refresh (`set`, `add`, `del`, `pause`, `resume`) rewrites the document under the shared lock and bumps
its version; every worker compares the version on each request and re-parses when it changed, so all
workers route by the new set at once. Each endpoint of each instance gets a slot (see shared.py);
slots of deleted endpoints are reused last, so a late release of a removed endpoint's load cannot land
on a fresh one.
"""

from __future__ import annotations

from dataclasses import dataclass

import ujson

from config import Endpoint, Instance, parse_instance
from scheduling.shared import (
    BREAKER_CLOSED,
    H_BREAKER,
    H_FAILURES,
    H_HEALTHY,
    HEALTH_FIELDS,
    MAX_SLOTS,
    G_DOC_LEN,
    G_DOC_VERSION,
    DOC_BYTES,
    SharedState,
)


class RefreshError(ValueError):
    """A refresh request that cannot be applied; `status` is the HTTP status to answer."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Target:
    """One schedulable endpoint of one instance."""

    instance_id: int
    endpoint_id: int
    slot: int
    role: str
    model: str
    engine_type: str
    url: str  # base URL, e.g. http://127.0.0.1:8000
    address: str  # host:port as configured
    paused: bool


class Topology:
    """An immutable per-worker view of one version of the document: pools by (model, role)."""

    def __init__(self, version: int, entries: list[dict]):
        self.version = version
        self.entries = entries
        self.instances: dict[int, Instance] = {}
        self.paused: set[int] = set()
        self.targets: list[Target] = []
        self.pools: dict[tuple[str, str], list[Target]] = {}
        self.by_address: dict[str, Target] = {}
        for e in entries:
            inst = parse_instance("instance", e)
            self.instances[inst.id] = inst
            if e.get("paused"):
                self.paused.add(inst.id)
            for ep, slot in zip(inst.endpoints, e["slots"]):
                t = Target(
                    inst.id, ep.id, slot, inst.role, inst.model_name, inst.engine_type, ep.base_url.rstrip("/"),
                    ep.address, bool(e.get("paused")),
                )
                self.targets.append(t)
                self.pools.setdefault((inst.model_name, inst.role), []).append(t)
                self.by_address[_hostport(ep.address)] = t

    def models(self) -> list[str]:
        return list(dict.fromkeys(t.model for t in self.targets))

    def pool(self, model: str, role: str) -> list[Target]:
        return self.pools.get((model, role), [])

    def find_address(self, host: str, port: str | int | None) -> Target | None:
        return self.by_address.get(f"{host}:{port}") if port is not None else None


def _hostport(address: str) -> str:
    return address.split("://", 1)[-1].rstrip("/")


class Registry:
    """Reads and writes the shared instance document."""

    def __init__(self, shared: SharedState):
        self.shared = shared
        self._view: Topology | None = None

    # -- reading (hot path) ------------------------------------------------------------------

    def view(self) -> Topology:
        version = self.shared.globals[G_DOC_VERSION]
        view = self._view
        if view is None or view.version != version:
            view = self._view = self._load()
        return view

    def _load(self) -> Topology:
        with self.shared.lock:
            version = self.shared.globals[G_DOC_VERSION]
            n = self.shared.globals[G_DOC_LEN]
            raw = bytes(self.shared.doc[:n]) if n else b"[]"
        return Topology(version, ujson.loads(raw))

    # -- writing (management plane, rare) ----------------------------------------------------

    def _write(self, entries: list[dict]) -> None:
        raw = ujson.dumps(entries).encode()
        if len(raw) > DOC_BYTES:
            raise RefreshError("instance document too large", 413)
        self.shared.doc[: len(raw)] = raw
        self.shared.globals[G_DOC_LEN] = len(raw)
        self.shared.globals[G_DOC_VERSION] += 1

    def _entries(self) -> list[dict]:
        n = self.shared.globals[G_DOC_LEN]
        return ujson.loads(bytes(self.shared.doc[:n])) if n else []

    def apply(self, event: str, instances: list[Instance | int]) -> int:
        """Apply one refresh event; returns the number of instances it touched."""
        with self.shared.lock:
            entries = self._entries()
            by_id = {e["id"]: e for e in entries}
            if event == "set":
                keep = [by_id[i.id] for i in instances if i.id in by_id and _same(by_id[i.id], i)]
                keep_ids = {e["id"] for e in keep}
                fresh: list[dict] = []
                for inst in instances:
                    fresh.append(by_id[inst.id] if inst.id in keep_ids else self._entry(inst, keep + fresh))
                entries = fresh
            elif event == "add":
                for inst in instances:
                    old = by_id.get(inst.id)
                    if old is not None:
                        if not _same(old, inst):
                            raise RefreshError(f"instance {inst.id} exists with a different role, model or endpoints", 409)
                        continue
                    entry = self._entry(inst, entries)
                    entries.append(entry)
                    by_id[inst.id] = entry
            elif event == "del":
                ids = {_id(i) for i in instances}
                entries = [e for e in entries if e["id"] not in ids]
            elif event in ("pause", "resume"):
                ids = {_id(i) for i in instances}
                missing = ids - set(by_id)
                if missing:
                    raise RefreshError(f"unknown instance ids: {sorted(missing)}", 404)
                for iid in ids:
                    by_id[iid]["paused"] = event == "pause"
            else:
                raise RefreshError(f"unknown event {event!r}: use set, add, del, pause or resume")
            self._write(entries)
            return len(instances)

    def _entry(self, inst: Instance, live: list[dict]) -> dict:
        used = {s for e in live for s in e["slots"]}
        slots = []
        for _ in inst.endpoints:
            slot = self._free_slot(used)
            used.add(slot)
            slots.append(slot)
            self._reset_slot(slot)
        return {**inst.to_json(), "slots": slots, "paused": False}

    def _free_slot(self, used: set[int]) -> int:
        # Take the slot whose last release is oldest: rotate through the table rather than reuse at once.
        g = self.shared.globals
        start = g[G_DOC_VERSION] % MAX_SLOTS
        for k in range(MAX_SLOTS):
            slot = (start + k) % MAX_SLOTS
            if slot not in used:
                return slot
        raise RefreshError(f"too many endpoints (at most {MAX_SLOTS})", 413)

    def _reset_slot(self, slot: int) -> None:
        h = self.shared.health
        base = slot * HEALTH_FIELDS
        for k in range(HEALTH_FIELDS):
            h[base + k] = 0.0
        h[base + H_HEALTHY] = 1.0
        h[base + H_BREAKER] = BREAKER_CLOSED
        h[base + H_FAILURES] = 0


def _id(item: Instance | int) -> int:
    return item if isinstance(item, int) else item.id


def _same(entry: dict, inst: Instance) -> bool:
    return (
        entry["role"] == inst.role
        and entry["model_name"] == inst.model_name
        and [(e["id"], e["address"]) for e in entry["endpoints"]] == [(e.id, e.address) for e in inst.endpoints]
    )


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
            if isinstance(iid, bool) or not isinstance(iid, int):
                raise RefreshError(f"instances[{i}]: must be an instance id or an object with an integer id")
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


__all__ = ["Registry", "Topology", "Target", "RefreshError", "parse_refresh_body", "Endpoint"]
