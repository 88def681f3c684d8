"""The instance registry without a server: which slot a new endpoint gets, and what a refused refresh leaves.

Slots are the columns of the load ledger and the rows of the health table; an endpoint removed while its
requests are still in flight must not hand those requests' load and failures to the next engine added.
"""

from __future__ import annotations

import pytest

from config import Endpoint, Instance, Live, Settings
from scheduling.health import Health
from scheduling.ledger import Ledger
from scheduling.registry import RefreshError, Registry
from state.shared import MAX_SLOTS, SharedState
from tests.test_scheduling import load_left

MODEL = "m"


def inst(iid: int, port: int | None = None, role: str = "union") -> Instance:
    return Instance(iid, role, MODEL, (Endpoint(0, f"127.0.0.1:{port or 10000 + iid}"),))


def slot_of(registry: Registry, iid: int) -> int:
    return next(t.slot for t in registry.view().targets if t.instance_id == iid)


@pytest.fixture
def world():
    shared = SharedState.create()
    registry = Registry(shared)
    ledger = Ledger(shared, 0, 2)
    health = Health(shared, Live(Settings(breaker_failure_threshold=1, breaker_open_s=60)))
    return registry, ledger, health


def test_a_deleted_endpoints_slot_goes_last_and_its_late_load_and_failures_stay_off_the_new_instance(world):
    registry, ledger, health = world
    registry.apply("set", [inst(i) for i in (1, 2, 3, 4)])
    old = slot_of(registry, 4)
    lease = ledger.lease(old, 100, 10)  # a request to instance 4, still in flight
    registry.apply("del", [4])
    registry.apply("add", [inst(5)])
    new = slot_of(registry, 5)
    assert new != old
    assert ledger.requests(new) == 0
    health.record_failure(old)  # the old request fails late: threshold 1 opens that slot's breaker
    lease.release()
    assert health.breaker(new) == "closed" and health.usable(new)
    assert not load_left(registry.shared)  # no worker holds anything on any slot


def test_the_same_holds_when_a_set_replaces_the_instance(world):
    registry, ledger, health = world
    registry.apply("set", [inst(i) for i in (1, 2, 3, 4)])
    old = slot_of(registry, 4)
    hold = ledger.hold(old)  # a decode slot promised on instance 4
    registry.apply("set", [inst(i) for i in (1, 2, 3, 5)])
    assert slot_of(registry, 5) not in {old, *(slot_of(registry, i) for i in (1, 2, 3))}
    hold.release()


def test_free_slots_are_handed_out_least_recently_freed_first(world):
    registry, _, _ = world
    registry.apply("set", [inst(1), inst(2)])
    first = slot_of(registry, 1)
    registry.apply("del", [1])
    # Every other slot (never used, or freed before) comes before the one freed just now.
    for iid in range(3, 3 + MAX_SLOTS - 2):
        registry.apply("add", [inst(iid)])
        assert slot_of(registry, iid) != first
    registry.apply("add", [inst(9999)])
    assert slot_of(registry, 9999) == first


def test_when_only_busy_slots_are_free_the_refresh_waits_for_them(world):
    registry, ledger, health = world
    registry.apply("set", [inst(i) for i in range(MAX_SLOTS)])
    busy = slot_of(registry, 7)
    health.record_failure(busy)
    lease = ledger.lease(busy, 10, 10)
    registry.apply("del", [7])
    with pytest.raises(RefreshError) as info:
        registry.apply("add", [inst(1000)])
    assert info.value.status == 409 and "try again" in str(info.value)
    assert health.breaker(busy) == "open"  # a refused refresh reset nothing
    lease.release()
    registry.apply("add", [inst(1000)])
    assert slot_of(registry, 1000) == busy and health.breaker(busy) == "closed"  # given out afresh
    with pytest.raises(RefreshError) as info:
        registry.apply("add", [inst(1001)])
    assert info.value.status == 413


def test_a_refused_set_leaves_every_health_row_as_it_was(world):
    registry, _, health = world
    registry.apply("set", [inst(1), inst(2)])
    dead = slot_of(registry, 2)
    health.set_healthy(dead, False)
    health.record_failure(dead)
    before = bytes(registry.shared.endpoints)
    # Instance 3 at instance 1's address: refused (409) after its slot was chosen, maybe one that 2 holds.
    with pytest.raises(RefreshError) as info:
        registry.apply("set", [inst(1), inst(3, port=10001)])
    assert info.value.status == 409
    assert bytes(registry.shared.endpoints) == before
    assert not health.is_healthy(dead) and health.breaker(dead) == "open"
    assert sorted(registry.view().instances) == [1, 2]


@pytest.mark.parametrize(
    "taken, again",
    [
        ("engine-0.svc:8000", "HTTP://Engine-0.SVC:8000"),
        ("[::1]:8000", "[0:0::1]:8000"),
        ("http://10.0.0.5:8000", "https://10.0.0.5:8000"),
    ],
)
def test_one_engine_spelt_two_ways_is_one_address(world, taken, again):
    """Load, health and breakers key on the engine: a second spelling of a taken address is refused, not a
    second instance sending to the same socket with its own ledger column."""
    registry, _, _ = world
    registry.apply("set", [Instance(1, "union", MODEL, (Endpoint(0, taken),))])
    with pytest.raises(RefreshError) as info:
        registry.apply("add", [Instance(2, "union", MODEL, (Endpoint(0, again),))])
    assert info.value.status == 409 and "registered twice" in str(info.value)
    assert [t.instance_id for t in registry.view().targets] == [1]
