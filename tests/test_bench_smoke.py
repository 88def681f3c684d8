"""Smoke test of bench/overhead.py: the C fake engine builds and speaks vLLM's shapes (chat, and /v1/messages
through the anthropic SDK), the Coordinator relays it faithfully in every benchmark cell (the Messages cells too) (and so does the Sanic floor in its two), and one short wrk cell runs
and its output and CPU figures parse.
And of bench/pick.py: a quick run times every policy on every cluster; and of bench/instructions.py: one cell counted
under callgrind."""

from __future__ import annotations

import http.server
import json
import math
import os
import re
import shutil
import socketserver
import statistics
import subprocess
import sys
import tempfile
import threading
import types

import anthropic
import openai
import pytest

from bench import overhead
from harness import ROOT


def bench_run(script: str, *args: str, timeout_s: float = 120) -> subprocess.CompletedProcess:
    """bench/<script>.py with `args`, run from the repository's root; its exit status and output."""
    path = os.path.join(ROOT, "bench", script + ".py")
    return subprocess.run([sys.executable, path, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)


@pytest.fixture(scope="module")
def bench_cluster():
    if not shutil.which("gcc"):
        pytest.skip("the fake engine is compiled with gcc")
    workdir = tempfile.mkdtemp(prefix="motor-bench-test-")
    try:
        with overhead.fakes(overhead.build_fake(workdir), None, workdir) as engines:
            gw = overhead.Coordinator(engines, 1, "INFO", None, workdir)
            try:
                yield engines, gw, workdir
            finally:
                gw.stop()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def test_fake_engine_speaks_vllm_pd(bench_cluster):
    engines, _, _ = bench_cluster
    status, _, raw = overhead.request(
        engines.prefill, "POST", "/v1/chat/completions", overhead.body("bench", False, **overhead.PREFILL_LEG)
    )
    prefill = json.loads(raw)
    assert status == 200
    assert prefill["choices"][0]["finish_reason"] == "length"
    assert prefill["usage"]["completion_tokens"] == 1
    assert prefill["kv_transfer_params"]["do_remote_prefill"] is True
    assert prefill["kv_transfer_params"]["remote_port"] == engines.prefill
    for stream in (False, True):
        assert overhead.check_answer(engines.union, overhead.body("bench", stream), stream) == ""
    assert overhead.request(engines.decode, "GET", "/health", None)[0] == 200
    status, _, metrics = overhead.request(engines.decode, "GET", "/metrics", None)
    assert status == 200 and b"vllm:num_requests_waiting{" in metrics


def test_fake_engine_speaks_vllm_messages(bench_cluster):
    """fastfake's /v1/messages through the anthropic SDK: a Message, its stream's events, and a prefill leg's ticket."""
    engines, _, _ = bench_cluster
    client = anthropic.Anthropic(
        base_url=f"http://127.0.0.1:{engines.union}", api_key="unused", max_retries=0, timeout=30
    )
    request = {"model": "bench", "max_tokens": 16, "system": overhead.SYSTEM, "tools": overhead.TOOLS}
    request["messages"] = overhead.MESSAGES
    reply = client.messages.create(**request)
    assert (reply.type, reply.role, reply.stop_reason) == ("message", "assistant", "max_tokens")
    assert [b.type for b in reply.content] == ["text"] and reply.content[0].text == overhead.TOKEN_TEXT
    assert (reply.usage.input_tokens, reply.usage.output_tokens, reply.usage.cache_read_input_tokens) == (12, 16, 0)
    with client.messages.stream(**request) as stream:
        events = [e.type for e in stream]
        final = stream.get_final_message()
    assert events[:3] == ["message_start", "content_block_start", "content_block_delta"]
    assert events[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert final.content[0].text == overhead.TOKEN_TEXT and final.stop_reason == "max_tokens"
    assert (final.usage.input_tokens, final.usage.output_tokens) == (12, 16)
    # A Messages prefill leg (the Coordinator's is a /v1/messages request): one token and the ticket.
    leg = client.messages.create(**request, extra_body=overhead.MESSAGES_PREFILL_LEG)
    assert leg.usage.output_tokens == 1 and leg.stop_reason == "max_tokens"
    assert leg.model_extra["kv_transfer_params"]["remote_port"] == engines.union
    # A decode leg counts the pulled prompt as read from the cache, as vLLM does.
    decode = client.messages.create(**request, extra_body=overhead.DECODE_LEG)
    assert (decode.usage.input_tokens, decode.usage.cache_read_input_tokens) == (0, 12)
    for stream in (False, True):
        assert overhead.check_messages(engines.union, overhead.messages_body("bench", stream), stream) == ""


def test_the_sanic_floor_relays_its_cells(bench_cluster):
    engines, _, workdir = bench_cluster
    floor = overhead.SanicFloor(engines, None, workdir)
    try:
        for cell in floor.cells:
            assert overhead.check_answer(floor.port(cell), floor.body(cell), cell in overhead.STREAMED) == "", cell
    finally:
        floor.stop()


def test_every_cell_relays_faithfully(bench_cluster):
    _, gw, _ = bench_cluster
    for cell in overhead.CELLS:
        assert overhead.check_answer(gw.infer_port, gw.body(cell), cell in overhead.STREAMED) == "", cell
    for cell in overhead.ALL_CELLS:
        assert overhead.check_cell(gw.infer_port, cell, gw.body(cell)) == "", cell
    # The SDK's view of a PD stream: usage billed once, with P's prompt count.
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{gw.infer_port}/v1", api_key="unused", max_retries=0, timeout=30)
    chunks = list(
        client.chat.completions.create(
            model="bench-pd",
            messages=overhead.MESSAGES,
            max_tokens=16,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == overhead.TOKEN_TEXT
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (12, 16)
    assert sum(1 for c in chunks if c.usage) == 1
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 0  # P's (D reports the pulled KV as cached)
    # And of the PD Messages stream (the pd_messages_stream cell's request, system prompt and tools).
    client = anthropic.Anthropic(
        base_url=f"http://127.0.0.1:{gw.infer_port}", api_key="unused", max_retries=0, timeout=30
    )
    request = {"model": "bench-pd", "max_tokens": 16, "system": overhead.SYSTEM, "tools": overhead.TOOLS}
    with client.messages.stream(**request, messages=overhead.MESSAGES) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == overhead.TOKEN_TEXT and final.stop_reason == "max_tokens"
    assert (final.usage.input_tokens, final.usage.output_tokens, final.usage.cache_read_input_tokens) == (12, 16, 0)


def test_fake_counts_engine_requests_and_connections(bench_cluster):
    engines, gw, _ = bench_cluster
    before = engines.counters()
    for _ in range(10):
        assert overhead.check_answer(gw.infer_port, gw.body("pd_chat_stream"), True) == ""
    reqs, conns = (b - a for a, b in zip(before, engines.counters()))
    # Two legs per request, plus whatever health checks and scrapes ran meanwhile; pooled connections are
    # reused (a gateway that reconnected per leg would open 20).
    assert 20 <= reqs < 60
    assert conns < 10


@pytest.mark.skipif(not shutil.which("wrk"), reason="wrk is not installed (apt-get install -y wrk)")
def test_one_short_wrk_cell(bench_cluster):
    _, gw, workdir = bench_cluster
    cpu0 = overhead.cpu_seconds(gw.proc.pid)
    res = overhead.run_wrk(gw.infer_port, [gw.body("pd_chat_stream")], 1, 4, 2, None, workdir)
    cpu1 = overhead.cpu_seconds(gw.proc.pid)
    assert res["requests"] > 0
    assert res["status"] == res["connect"] == res["read"] == res["timeout"] == 0
    assert 0 < res["p50_us"] <= res["p99_us"]
    assert cpu1 > cpu0
    assert overhead.peak_rss_mb(gw.worker_pids())[0] > 10


@pytest.mark.skipif(
    not all(shutil.which(t) for t in ("wrk", "gcc")), reason="needs wrk and gcc (apt-get install -y wrk gcc)"
)
def test_the_memory_bench_reports_a_workers_growth_over_its_bytes_in_flight():
    proc = bench_run(
        "memory",
        "--kib",
        "64",
        "--connections",
        "4",
        "--duration",
        "1",
        "--cells",
        "pd_chat,messages",
        "--no-router",
        timeout_s=180,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [line.split("|")[1:-1] for line in proc.stdout.splitlines() if line.startswith("| coordinator |")]
    assert [r[1].strip() for r in rows] == ["pd_chat", "messages"], proc.stdout
    for _, _, idle, peak, growth, requests, errors in rows:
        assert 10 < float(idle) <= float(peak), rows
        assert math.isfinite(float(growth.strip().rstrip("x"))), rows
        assert int(requests) > 0 and int(errors) == 0, rows


def test_pick_bench_times_every_policy_on_every_cluster(tmp_path):
    out = tmp_path / "pick.json"
    proc = bench_run("pick", "--quick", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "| policy | cluster | prompt | pick µs (prepare+plan) | full µs (with leases) |" in proc.stdout
    rows = json.loads(out.read_text())["rows"]
    policies = ("round_robin", "load_balance", "kv_cache_affinity", "slo_aware")
    clusters = ("1P+1D", "4P+4D", "16P+16D", "1U", "8U")
    cells = [(r["policy"], r["cluster"], r["prompt"]) for r in rows]
    assert sorted(cells) == sorted((p, c, prompt) for p in policies for c in clusters for prompt in ("short", "long"))
    for r in rows:
        assert math.isfinite(r["pick_us"]) and r["pick_us"] > 0, r
        assert math.isfinite(r["full_us"]) and r["full_us"] > 0, r


def test_cluster_sync_bench_times_refreshes_reaching_every_replica():
    proc = bench_run("cluster_sync", "--replicas", "2", "--refreshes", "2")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("2 replicas x 2 workers, sync every 50 ms, 2 refreshes"), proc.stdout
    for name, line in zip(("refresh answered", "every replica shows it"), lines[1:], strict=True):
        figures = [float(f) for f in re.findall(r"([0-9.]+) ms", line)]
        assert line.strip().startswith(name) and len(figures) == 3 and 0 < figures[0] <= figures[2], line


@pytest.mark.skipif(
    not all(shutil.which(t) for t in ("valgrind", "callgrind_control", "wrk", "gcc")),
    reason="needs valgrind, wrk and gcc (apt-get install -y valgrind wrk gcc)",
)
def test_instruction_count_of_one_cell():
    """bench/instructions.py runs the Coordinator under callgrind and counts one cell's requests and instructions."""
    proc = bench_run("instructions", "--cells", "chat", "--seconds", "2", timeout_s=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    row = [line for line in proc.stdout.splitlines() if line.startswith("| chat |")]
    assert len(row) == 1, proc.stdout
    per_request_k = float(row[0].split("|")[2])
    # A chat request through the Coordinator is hundreds of thousands of instructions: not zero (nothing
    # counted) and not tens of millions (the start-up or the whole run counted).
    assert 100 < per_request_k < 5000, row
    # The requests are wrk's completed ones (a wrk error or non-2xx answer fails the run): at least a few
    # under valgrind in 2 s, over one connection.
    requests = [line for line in proc.stdout.splitlines() if " chat: " in line and "requests" in line]
    assert requests and int(requests[0].split(" chat: ")[1].split()[0]) >= 5, proc.stdout


class _Quiet(http.server.BaseHTTPRequestHandler):
    """Answers every request 501 (no GET handler), logging nothing."""

    def log_message(self, *args) -> None:
        pass


class _Hangup(socketserver.BaseRequestHandler):
    """Closes each connection without an answer."""

    def handle(self) -> None:
        pass


@pytest.mark.skipif(not shutil.which("wrk"), reason="needs wrk (apt-get install -y wrk)")
@pytest.mark.parametrize(("handler", "seen"), [(_Quiet, "Non-2xx"), (_Hangup, "Socket errors")])
def test_counting_status_polls_fails_on_error_answers_and_socket_errors(monkeypatch, tmp_path, handler, seen):
    """bench/instructions.py's status-page polls stop the run when wrk sees an error answer or a socket error,
    as a cell's requests do, naming the tree."""
    from bench import instructions

    monkeypatch.setattr(instructions, "_counted", lambda worker, out_dir, idle_per_s, run: (run(), 0.0, 1.0))
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        gw = types.SimpleNamespace(obs_port=server.server_address[1])
        with pytest.raises(RuntimeError, match=rf"/tree status\.json: wrk saw errors: {seen}"):
            instructions.count_polls(gw, "/tree", 1, str(tmp_path), "0", 0.0)
    finally:
        server.shutdown()
        server.server_close()


def test_engine_sims_fail_when_one_exits_even_with_status_0(tmp_path):
    """An engine_sim that exits at once (`--help`: status 0) fails the start of them all, as one that crashes
    does, and its output is in the error."""
    with pytest.raises(RuntimeError, match="did not start") as raised:
        overhead.engine_sims([["--model", "up"], ["--help"]], str(tmp_path))
    assert "usage:" in str(raised.value)


def test_wallclock_replays_a_prefill_engines_chunked_steps():
    """bench/wallclock.py's attribution replays engine_sim's prefill loop: a prompt arriving during a chunked step
    waits for its end, then shares the next step with the rest of the prompt ahead of it."""
    from bench import wallclock

    rate = float(wallclock.CHUNK)  # a full step lasts 1 s
    parts = wallclock.p_schedule(rate, [(0.0, 10_000, 0, -1, "long"), (0.5, 100, 0, -1, "short")])
    step, queue, own, batch = parts["short"]
    assert step == pytest.approx(0.5) and queue == pytest.approx(0.0)
    assert own == pytest.approx((10_000 - wallclock.CHUNK + 100) / rate)
    assert batch == pytest.approx(0.0)  # a continuous queue has it finish there too
    # The long prompt shares its last step with the short one sent after it: later than a continuous queue says.
    assert parts["long"] == pytest.approx((0.0, 0.0, 1.0 + own, 100 / rate))
    # A hot system prompt computed once is cached for the next prompt that opens with it.
    cached = wallclock.p_schedule(rate, [(0.0, 1_100, 1_000, 0, "a"), (5.0, 1_100, 1_000, 0, "b")])
    assert cached["b"][2] == pytest.approx((1_100 - 992) / rate)
    # A prompt arriving while another's step runs waits for its end, as the continuous queue says it does.
    parts = wallclock.p_schedule(rate, [(0.0, 4096, 0, -1, "a"), (0.1, 4096, 0, -1, "b")])
    assert parts["b"] == pytest.approx((0.4, 0.0, 0.5, 0.0))


def test_wallclock_prompts_are_the_same_in_every_process():
    """A seed's prompts do not depend on the process's hash salt (PYTHONHASHSEED)."""
    code = (
        "import zlib; from bench import wallclock as b; w = b.draw(3); "
        "print(zlib.crc32(''.join(b.prompt_texts(w, b.requests(w, 20, 1.0, 3), 10**6)).encode()))"
    )
    out = [
        subprocess.run(
            [sys.executable, "-c", code],
            cwd=ROOT,
            env={**os.environ, "PYTHONHASHSEED": salt},
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        for salt in ("0", "1")
    ]
    assert out[0].strip() and out[0] == out[1]


def test_wallclock_fills_a_decode_bound_workload_for_a_streams_life():
    """The fill lasts as long as a stream at capacity (the mean output at the slowest engine's steady step): a
    decode batch grows to its steady size over that long, and a measured window shorter than it meets less load
    than its name (seed 894124953: 100 requests arrive in 2.2 s, streams last 5.3 s)."""
    from bench import wallclock

    w = wallclock.draw(894124953)
    cap = wallclock.capacity(w)
    life = statistics.mean(r.out for r in wallclock._sample(w)) * max(s for _, s in wallclock._steady_batches(w))
    assert 100 / cap < 0.5 * life  # the measured window alone is under half a stream's life
    w.load = 0.5
    fill = wallclock.requests(w, wallclock.fill_requests(w, cap), 0.5 * cap, 1, "poisson")
    assert 0.8 * life < fill[-1].at < 1.25 * life
    w.load = 1.5
    assert wallclock.fill_requests(w, cap) == wallclock.FILL_MAX


def test_wallclock_bench_runs_the_coordinator_against_engine_sim(tmp_path):
    """A tiny wall-clock run: the real app.py and engine_sim processes, two policies, its rows and verdicts."""
    out = tmp_path / "wallclock.json"
    proc = bench_run(
        "wallclock",
        "--seed",
        "3",
        "--requests",
        "10",
        "--warmup",
        "4",
        "--fill",
        "6",
        "--rate",
        "6",
        "--runs",
        "round_robin:off,slo_aware:reject",
        "--json",
        str(out),
        timeout_s=240,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert [r["run"] for r in rows] == ["round_robin:off", "slo_aware:reject"] and result["fill"] == 6
    for r in rows:
        assert r["answered"] + r["refused_n"] == 10, r  # the measured ones: the fill is not counted
        assert 0.0 <= r["ontime"] <= 1.0 and r["goodput"] >= 0.0, r
    assert rows[0]["answered"] == 10  # round robin refuses nothing
    assert "admitted on-time, worst admitting run" in proc.stdout
    assert "slo_aware with admission / round_robin" in proc.stdout
