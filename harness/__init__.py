"""Loopback harness shared by the tests and the benchmarks: nothing the Coordinator itself imports.

    loopback         free ports, polling until something holds
    processes        child processes in their own session, and the /proc reading that finds their workers
    configs          motor_coordinator_config objects on loopback ports
    coordinator      `python app.py` as a process, ready when its probes answer and its workers run
    bodies           request bodies (chat), the SSE reader and the benchmarks' vocabulary
    clients          the OpenAI and Anthropic SDK clients pointed at a Coordinator
    ledger           the load columns /instances shows, and whether they are back at zero
    predictor        a learned model taught engine speeds, as if it had served them long ago

It sits beside tests/ and bench/ (both import it) so that neither imports the other's helpers; import-linter
keeps it free of tests/ and out of the Coordinator's packages (pyproject.toml).
"""

import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
