"""OpenTelemetry traces of client requests (`tracer_config`), exported over OTLP by the official SDK.

One SERVER span per client request, its parent the client's W3C `traceparent` (and `tracestate`) when it sent
one; under it a `queue` span for a wait in SLO admission, and one span per engine attempt (`prefill`, `decode`,
`whole`, `count_tokens`: the leg), a retry being one more attempt span with `motor.attempt` > 0. Each attempt's
own `traceparent` goes to its engine (engines.TRACE_HEADERS), so vLLM's spans (`--otlp-traces-endpoint`) join
the trace under the attempt that called them. The request span carries the model, request id, status, the
instances, token counts, TTFT and TPOT (the figures serving/observe.py logs).

Sampling is parent-based with the five ratios of tracer_config. Export: OTLP http/protobuf to `endpoint`
(`/v1/traces` appended when it has no path), or gRPC when `OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=grpc` and
opentelemetry-exporter-otlp-proto-grpc is installed; a batch span processor per worker, so exporting never
waits on the request path.

Off (no endpoint): `Tracing.of(settings)` is None, and the callers' one `is None` check is all it costs.
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar
from urllib.parse import urlsplit

from opentelemetry import context as otel_context, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from config import Settings, TracerConfig
from engines import TRACE_HEADERS
from scheduling.registry import Target

from .observe import RequestRecord

T = TypeVar("T")
PROTOCOL_ENV = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"


def exporter_of(cfg: TracerConfig) -> Any:
    """The OTLP span exporter tracer_config asks for; ValueError says why there is none."""
    protocol = os.environ.get(PROTOCOL_ENV, "http/protobuf")
    if protocol == "grpc":
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter
        except ImportError:
            raise ValueError(
                f"{PROTOCOL_ENV}=grpc needs opentelemetry-exporter-otlp-proto-grpc, which is not installed"
            ) from None
        return GrpcExporter(endpoint=cfg.endpoint)
    if protocol != "http/protobuf":
        raise ValueError(f"{PROTOCOL_ENV}={protocol!r}: must be http/protobuf or grpc")
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    url = cfg.endpoint if "://" in cfg.endpoint else f"http://{cfg.endpoint}"
    if urlsplit(url).path in ("", "/"):
        url = url.rstrip("/") + "/v1/traces"
    return OTLPSpanExporter(endpoint=url)


def sampler_of(cfg: TracerConfig) -> ParentBased:
    return ParentBased(
        root=TraceIdRatioBased(cfg.root_sampling_rate),
        remote_parent_sampled=TraceIdRatioBased(cfg.remote_parent_sampled),
        remote_parent_not_sampled=TraceIdRatioBased(cfg.remote_parent_not_sampled),
        local_parent_sampled=TraceIdRatioBased(cfg.local_parent_sampled),
        local_parent_not_sampled=TraceIdRatioBased(cfg.local_parent_not_sampled),
    )


class Tracing:
    """One worker's tracer: made at its start when tracer_config has an endpoint, shut down (flushed) at its end."""

    def __init__(self, cfg: TracerConfig):
        self.provider = TracerProvider(
            resource=Resource.create({"service.name": "motor-coordinator"}), sampler=sampler_of(cfg)
        )
        self.provider.add_span_processor(BatchSpanProcessor(exporter_of(cfg), schedule_delay_millis=500))
        self.tracer = self.provider.get_tracer("motor.coordinator")
        self.propagator = TraceContextTextMapPropagator()

    @classmethod
    def of(cls, settings: Settings) -> Tracing | None:
        return cls(settings.tracer) if settings.tracer.endpoint else None

    def shutdown(self) -> None:
        self.provider.shutdown()

    # -- the request span -------------------------------------------------------------------------------

    def start_request(self, method: str, path: str, headers: Mapping[str, str], rid: str) -> tuple[Any, object]:
        """The request's span, current in this task until `end_request`: (span, the context token)."""
        parent = self.propagator.extract(carrier=headers)
        span = self.tracer.start_span(
            f"{method} {path}",
            context=parent,
            kind=SpanKind.SERVER,
            attributes={"http.request.method": method, "url.path": path, "motor.request_id": rid},
        )
        return span, otel_context.attach(trace.set_span_in_context(span, parent))

    def end_request(self, span: Any, token: object, rec: RequestRecord) -> None:
        otel_context.detach(token)
        if span.is_recording():
            tokens = rec.generated_tokens
            attributes: dict[str, Any] = {
                "gen_ai.request.model": rec.model,
                "motor.stream": rec.stream,
                "http.response.status_code": rec.status,
                "gen_ai.usage.input_tokens": rec.prompt_tokens,
                "gen_ai.usage.output_tokens": tokens,
                "motor.retries": rec.retries,
            }
            if rec.prefill is not None:
                attributes["motor.prefill_instance"] = rec.prefill.label
            if rec.target is not None:
                attributes["motor.instance"] = rec.target.label
            if rec.ttft_s is not None:
                attributes["motor.ttft_ms"] = rec.ttft_s * 1000
                if tokens > 1:
                    attributes["motor.tpot_ms"] = (rec.duration_s - rec.ttft_s) * 1000 / (tokens - 1)
            if rec.missed_handoff:
                attributes["motor.missed_handoff"] = True
            span.set_attributes(attributes)
            if rec.status >= 500:
                span.set_status(Status(StatusCode.ERROR, rec.error[:256]))
        span.end()

    # -- child spans ------------------------------------------------------------------------------------

    async def queued(self, wait: Awaitable[T]) -> T:
        """A wait in the SLO admission queue, as a `queue` span."""
        with self.tracer.start_as_current_span("queue", kind=SpanKind.INTERNAL):
            return await wait

    async def attempt(self, leg: str, target: Target, attempt: int, rid: str, start: Callable[[], Awaitable[T]]) -> T:
        """One engine attempt of a leg, as a CLIENT span whose traceparent the engine gets."""
        span = self.tracer.start_span(
            leg,
            kind=SpanKind.CLIENT,
            attributes={
                "motor.leg": leg,
                "motor.attempt": attempt,
                "motor.instance": target.label,
                "server.address": target.address,
                "motor.engine_request_id": rid,
                "gen_ai.request.model": target.model,
            },
        )
        carrier: dict[str, str] = {}
        self.propagator.inject(carrier, context=trace.set_span_in_context(span))
        token = TRACE_HEADERS.set("".join(f"{k}: {v}\r\n" for k, v in carrier.items()).encode("latin-1"))
        try:
            return await start()
        except BaseException as e:
            span.set_status(Status(StatusCode.ERROR, f"{type(e).__name__}: {e}"[:256]))
            raise
        finally:
            TRACE_HEADERS.reset(token)
            span.end()
