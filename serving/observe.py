"""What the Coordinator records about each request: one structured log line, and the metrics hooks."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from scheduling.registry import Target

log = logging.getLogger("coordinator.request")


@dataclass
class RequestRecord:
    """Facts gathered while one request is served, for its log line and metrics."""

    request_id: str
    route: str
    model: str = ""
    stream: bool = False
    started: float = field(default_factory=time.monotonic)
    ttft_s: float | None = None
    prefill: Target | None = None
    target: Target | None = None
    prefill_s: float | None = None
    decode_s: float | None = None
    retries: int = 0
    missed_handoff: bool = False
    status: int = 200
    error: str = ""
    disconnect_phase: str = ""
    reject_reason: str = ""
    events: int = 0  # SSE events relayed (about one per token)

    def first_token(self) -> None:
        if self.ttft_s is None:
            self.ttft_s = time.monotonic() - self.started


def _name(t: Target | None) -> str:
    return f"{t.instance_id}/{t.endpoint_id}@{t.address}" if t else "-"


class Observer:
    """Logs one line per request; subclasses add metrics."""

    def request_started(self) -> None:
        """A request entered the Coordinator."""

    def request_done(self, rec: RequestRecord) -> None:
        duration = time.monotonic() - rec.started
        if log.isEnabledFor(logging.INFO):
            log.info(
                "request_id=%s route=%s model=%s stream=%s prefill=%s decode=%s status=%d ttft_ms=%s retries=%d "
                "missed_handoff=%s duration_ms=%.1f%s",
                rec.request_id, rec.route, rec.model, rec.stream, _name(rec.prefill), _name(rec.target), rec.status,
                f"{rec.ttft_s * 1000:.1f}" if rec.ttft_s is not None else "-", rec.retries, rec.missed_handoff,
                duration * 1000, f" error={rec.error!r}" if rec.error else "",
            )

    def retry(self, job, target: Target, err: Exception) -> None:
        log.warning("request_id=%s retrying after %s on %s", job.request_id, err, _name(target))

    def missed_handoff(self, job, rec: RequestRecord) -> None:
        log.warning(
            "request_id=%s missed handoff: prefill %s returned no kv_transfer_params; decode recomputes the prompt",
            job.request_id, _name(rec.prefill),
        )
