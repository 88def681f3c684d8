"""Tracing (tracer_config): the OTLP http/protobuf export received on a loopback HTTP server, decoded with
opentelemetry-proto, and checked: one span per client request under the client's traceparent, a child span per
engine attempt (retries included) with the request's model, instances, tokens, TTFT and TPOT, and each engine
given the traceparent of the attempt that called it."""

from __future__ import annotations

import gzip
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.trace.v1.trace_pb2 import Span
from opentelemetry.sdk.trace.sampling import Decision

from config import TracerConfig
from harness.bodies import chat_body, sse_events
from harness.configs import coordinator_config, instance
from harness.coordinator import Coordinator
from harness.loopback import wait_until
from serving.tracing import sampler_of

MODEL = "traced"
TRACE_ID, CLIENT_SPAN = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"


class Collector:
    """An OTLP/HTTP receiver on loopback: every span it was sent, decoded."""

    def __init__(self):
        self.spans: list[Span] = []
        self.paths: set[str] = set()
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                req = ExportTraceServiceRequest.FromString(body)
                collector.paths.add(self.path)
                for rs in req.resource_spans:
                    for ss in rs.scope_spans:
                        collector.spans.extend(ss.spans)
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def of_trace(self, trace_id: str) -> list[Span]:
        return [s for s in self.spans if s.trace_id.hex() == trace_id]


def attrs(span: Span) -> dict:
    out = {}
    for kv in span.attributes:
        v = kv.value
        out[kv.key] = getattr(v, v.WhichOneof("value"))
    return out


def engine_traceparent(sim, request_id_prefix: str) -> list[str]:
    """The traceparent of each request the engine got for a client request (its engine request ids start with
    the client's)."""
    heads = [{k.lower(): v for k, v in r["headers"].items()} for r in sim.requests()]
    return [h.get("traceparent", "") for h in heads if h.get("x-request-id", "").startswith(request_id_prefix)]


@pytest.fixture(scope="module")
def traced(module_sims):
    collector = Collector()
    p1, p2, d = (
        module_sims("prefill", model=MODEL),
        module_sims("prefill", model=MODEL),
        module_sims("decode", model=MODEL),
    )
    cfg = coordinator_config(
        [
            instance(1, "prefill", MODEL, p1.address),
            instance(2, "prefill", MODEL, p2.address),
            instance(3, "decode", MODEL, d.address),
        ],
        tracer_config={"endpoint": collector.endpoint, "root_sampling_rate": 1.0},
    )
    with Coordinator(cfg) as coord:
        yield coord, collector, (p1, p2, d)
    collector.server.shutdown()


def test_a_pd_stream_is_one_span_tree_under_the_clients_traceparent(traced):
    coord, collector, (p1, p2, d) = traced
    headers = {"traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-01", "X-Request-Id": "trace-one"}
    with httpx.stream(
        "POST",
        coord.url + "/v1/chat/completions",
        json=chat_body(MODEL, max_tokens=5, stream=True),
        headers=headers,
        timeout=30,
    ) as r:
        assert r.status_code == 200
        events = sse_events(r.read())
    assert events
    assert wait_until(lambda: any(s.kind == Span.SPAN_KIND_SERVER for s in collector.of_trace(TRACE_ID)), timeout_s=10)
    spans = collector.of_trace(TRACE_ID)
    (root,) = [s for s in spans if s.kind == Span.SPAN_KIND_SERVER]
    assert root.parent_span_id.hex() == CLIENT_SPAN and root.name == "POST /v1/chat/completions"
    a = attrs(root)
    assert a["motor.request_id"] == "trace-one" and a["gen_ai.request.model"] == MODEL
    assert a["http.response.status_code"] == 200 and a["motor.stream"] is True
    assert a["gen_ai.usage.input_tokens"] > 0 and a["gen_ai.usage.output_tokens"] == 5
    assert a["motor.ttft_ms"] > 0 and a["motor.tpot_ms"] > 0
    assert a["motor.instance"].startswith("3/") and a["motor.prefill_instance"][0] in "12"
    legs = sorted((s for s in spans if s.parent_span_id == root.span_id), key=lambda s: s.start_time_unix_nano)
    assert [s.name for s in legs] == ["prefill", "decode"]
    assert all(s.kind == Span.SPAN_KIND_CLIENT and attrs(s)["motor.attempt"] == 0 for s in legs)
    assert legs[0].end_time_unix_nano <= legs[1].end_time_unix_nano <= root.end_time_unix_nano
    # Each engine was given the traceparent of the attempt span that called it: vLLM's spans join under it.
    prefill_sim = p1 if attrs(legs[0])["motor.instance"].startswith("1/") else p2
    assert engine_traceparent(prefill_sim, "trace-one") == [f"00-{TRACE_ID}-{legs[0].span_id.hex()}-01"]
    assert engine_traceparent(d, "trace-one") == [f"00-{TRACE_ID}-{legs[1].span_id.hex()}-01"]
    assert collector.paths == {"/v1/traces"}


def test_a_retry_is_one_more_attempt_span_and_a_request_without_parent_starts_a_trace(traced):
    coord, collector, (p1, p2, d) = traced
    for p in (p1, p2):
        p.set_faults(fail_first_n=1)  # whichever P is tried first fails once
    try:
        r = httpx.post(
            coord.url + "/v1/chat/completions",
            json=chat_body(MODEL, max_tokens=2),
            headers={"X-Request-Id": "trace-two"},
            timeout=30,
        )
    finally:
        for p in (p1, p2):
            p.clear_faults()
    assert r.status_code == 200

    def root_of_two():
        return [
            s
            for s in collector.spans
            if s.kind == Span.SPAN_KIND_SERVER and attrs(s)["motor.request_id"] == "trace-two"
        ]

    assert wait_until(lambda: len(root_of_two()) == 1, timeout_s=10)
    (root,) = root_of_two()
    assert root.parent_span_id == b"" and root.trace_id.hex() != TRACE_ID
    time.sleep(0.2)  # the attempt spans ended before the request's: they were in the same or an earlier batch
    children = sorted(
        (s for s in collector.spans if s.parent_span_id == root.span_id), key=lambda s: s.start_time_unix_nano
    )
    prefills = [s for s in children if s.name == "prefill"]
    assert [attrs(s)["motor.attempt"] for s in prefills] >= [0, 1]
    assert prefills[0].status.code == 2  # STATUS_CODE_ERROR: the failed try
    assert [s.name for s in children][-1] == "decode" and attrs(root)["motor.retries"] >= 1
    sent = engine_traceparent(p1, "trace-two") + engine_traceparent(p2, "trace-two")
    # (the SDK's own trace ids carry W3C's "random" flag too: 03)
    assert sorted(sent) == sorted(f"00-{root.trace_id.hex()}-{s.span_id.hex()}-03" for s in prefills)


def test_sampling_follows_the_five_ratios():
    from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags, set_span_in_context

    cfg = TracerConfig(root_sampling_rate=0.0, remote_parent_sampled=1.0, remote_parent_not_sampled=0.0)
    sampler = sampler_of(cfg)
    trace_id = int(TRACE_ID, 16)
    assert sampler.should_sample(None, trace_id, "r").decision == Decision.DROP

    def remote(flags: int):
        ctx = SpanContext(trace_id, int(CLIENT_SPAN, 16), is_remote=True, trace_flags=TraceFlags(flags))
        return set_span_in_context(NonRecordingSpan(ctx))

    assert sampler.should_sample(remote(1), trace_id, "r").decision == Decision.RECORD_AND_SAMPLE
    assert sampler.should_sample(remote(0), trace_id, "r").decision == Decision.DROP
