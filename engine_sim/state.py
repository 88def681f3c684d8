"""What one simulated vLLM server holds while it runs: its configuration, batching engine and fault knobs, the
requests it received, the responses it stores, and the client session it calls other engines with.

The route modules (inference, the *_serving shapes, kv_transfer) read and change a `SimState`; `server.SimServer`
is one, with the aiohttp application and its lifecycle on top.
"""

from __future__ import annotations

import asyncio
import hashlib
import time

import aiohttp

from .config import SimConfig
from .engine import Engine
from .faults import Faults


class Stored:
    """One stored response: its object (as last answered) and the conversation a follow-up continues."""

    __slots__ = ("messages", "response", "task")

    def __init__(self, response: dict, messages: list[dict]):
        self.response, self.messages = response, messages
        self.task: asyncio.Task | None = None  # a background response still generating


class SimState:
    def __init__(self, cfg: SimConfig):
        self.cfg = cfg
        self.engine = Engine(cfg)
        self.faults = Faults(cfg.faults)
        self.records: list[dict] = []
        self.port = cfg.port
        self.created = int(time.time())
        # vLLM's `system_fingerprint`: the version and a hash of the engine's configuration
        self.fingerprint = "vllm-0.32.0-" + hashlib.sha256(cfg.engine_id.encode()).hexdigest()[:8]
        self.session: aiohttp.ClientSession | None = None  # D's pulls from P, trigger mode's metaserver calls
        self.responses: dict[str, Stored] = {}  # /v1/responses' store, by response id
