"""The Coordinator's ledger as its management API shows it: the load columns of every endpoint
(/instances), and whether a test's requests have all given theirs back."""

from __future__ import annotations

# The columns a request adds to while it is in flight (held decode slots are a separate count).
IN_FLIGHT = ("inflight_requests", "inflight_prompt_tokens", "inflight_decode_tokens", "prefilling_requests")


def ledger(coord) -> list[dict]:
    """The `load` object of every endpoint of every instance, in /instances order."""
    doc = coord.instances()
    return [ep["load"] for inst in doc["instances"] for ep in inst["endpoints"]]


def ledger_is_zero(coord) -> bool:
    """No endpoint has a request in flight in its ledger columns."""
    return all(load[k] == 0 for load in ledger(coord) for k in IN_FLIGHT)
