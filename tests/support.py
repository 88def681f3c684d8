"""The names the tests have always imported from here, now kept in the loopback harness (harness/) that the
benchmarks share: import new helpers from harness directly.

`Coordinator` runs `python app.py --config FILE` on free loopback ports (harness/coordinator.py).
"""

from harness import ROOT
from harness.bodies import sse_events
from harness.configs import coordinator_config, instance
from harness.coordinator import Coordinator
from harness.loopback import free_port, free_ports, wait_until

__all__ = [
    "ROOT",
    "Coordinator",
    "coordinator_config",
    "free_port",
    "free_ports",
    "instance",
    "sse_events",
    "wait_until",
]
