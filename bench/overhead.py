"""Gateway overhead benchmark: what the Coordinator costs per request, next to direct access and vllm-router.

    python bench/overhead.py            # full run, about 4 minutes
    python bench/overhead.py --quick    # about 1 minute
    python bench/overhead.py --profile  # py-spy profiles of the chat and PD-streamed cells (1 worker)

docs/performance.md explains the columns, the figures and a run's results; on a machine others load, add
`--nice -10` (as root) or the gateway gets only a share of its core.

A fast fake vLLM engine (bench/fastfake.c, compiled here with gcc) answers in microseconds, so what the
load generator sees beyond direct access is the gateway's own cost. The load generator (`wrk`) and the
fakes share core 0; the gateway gets core 1 alone (with N workers and enough cores, cores 1..N). Cells:

    chat              non-streaming chat, 16 output tokens
    chat_stream       the same streamed: role chunk, 16 token chunks, usage chunk, [DONE]
    pd_chat           PD: a prefill leg (one token + kv_transfer_params ticket), then the decode leg
    pd_chat_stream    PD with a streamed decode leg

and, when asked for (`--cells`; bench/prompts.py does), the Anthropic Messages cells, an agent's request: a
system prompt, four tools with input schemas and a user message (`--prompt-kib` pads the system prompt by a
quarter and the user message by three quarters), sent with `anthropic-version` and `x-api-key`:

    messages            non-streaming /v1/messages, 16 output tokens
    pd_messages_stream  PD /v1/messages streamed, as an agent on a PD cluster sends it: the prefill leg is a
                        /v1/messages request too; message_start, 16 content_block_delta, message_delta,
                        message_stop
vllm-router 0.1.17 has no /v1/messages route and the floor relays chat only: both skip these cells.

The Coordinator (1 worker, log INFO), the floor and vllm-router run side by side and are measured cell by
cell in turn, so each ratio compares cells measured seconds apart; the other Coordinator runs follow.
Each cell runs at `-c 32` (throughput, CPU per request) and at concurrency 1 (added latency = gateway p50 minus
direct p50; for PD the direct figure is the prefill leg's p50 plus the decode leg's). Direct PD
throughput drives one fake with alternating prefill and decode bodies and counts two legs as one request.
CPU per request is the gateway's process-tree CPU time (utime+stime of the main process and every
descendant, workers included, from /proc, before and after the cell) over the requests wrk completed.

The "floor" rows (bench/sanic_floor.py: Sanic relaying chat through the project's engine client, with
nothing else) show what the framework and the relay cost in the same run; the Coordinator's own work is
what it adds to them.

Needs `wrk` (`apt-get update && apt-get install -y wrk`), gcc and taskset. vllm-router is measured side
by side when installed (`pip install vllm-router==0.1.17`; not a project dependency). --profile needs
py-spy (`pip install py-spy==0.4.3`).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field, replace

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from harness import processes  # noqa: E402
from harness.bodies import chat_body  # noqa: E402
from harness.configs import api_config, api_keys, instance  # noqa: E402
from harness.loopback import free_port, free_ports  # noqa: E402
from harness.processes import tree  # noqa: E402
from harness.redis import RedisServer  # noqa: E402

OUT = os.path.join(HERE, "out")
CLK_TCK = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")

TOKEN_TEXT = "The quick brown fox jumps over the lazy dog and runs far into the green hills"
MESSAGES = [{"role": "user", "content": "Hello, how are you?"}]
CELLS = ("chat", "chat_stream", "pd_chat", "pd_chat_stream")  # the default run's
MESSAGES_CELLS = ("messages", "pd_messages_stream")  # Anthropic /v1/messages: only when --cells names them
ALL_CELLS = CELLS + MESSAGES_CELLS
STREAMED = {"chat_stream", "pd_chat_stream", "pd_messages_stream"}
PD = {"pd_chat", "pd_chat_stream", "pd_messages_stream"}
ANTHROPIC_HEADERS = {"anthropic-version": "2023-06-01", "x-api-key": "bench"}  # as the anthropic SDK sends them

# The issue's reference figures (one run on a 2-core machine, not this run): gateway CPU per request, µs.
REFERENCE_US = {
    "vllm-router 0.1.17 (issue)": {"chat": 71, "chat_stream": 261, "pd_chat": 145, "pd_chat_stream": 298},
    "MindIE-PyMotor (issue)": {"chat": 3900, "chat_stream": 5200, "pd_chat": 6700, "pd_chat_stream": 8000},
    "LiteLLM 1.82.6 (issue)": {"chat": 3700, "chat_stream": 15000},
}


# `--prompt-kib`: every cell's user message padded to this size, as an agent's long prompt (code-like text).
PAD = {"text": ""}


def padding(kib: int) -> str:
    line = "    total += compute(item, weight=0.5)  # the agent's context, line after line\n"
    return (line * (kib * 1024 // len(line) + 1))[: kib * 1024]


def body(model: str, stream: bool, **extra) -> str:
    b = chat_body(model, stream, 16, MESSAGES[0]["content"] + PAD["text"], usage=True, **extra)
    return json.dumps(b, separators=(",", ":"))


# An agent's system prompt and tools (Claude Code-like): with `--prompt-kib`, the system prompt takes a quarter
# of the padding and the user message the rest, so the body is about the size plus these 3 KiB.
SYSTEM = (
    "You are a coding agent working in the user's repository. Read the code before changing it, make the "
    "smallest change that solves the task, run the tests, and report what you did and what you left alone. "
    "Use the tools to read, search and edit files and to run commands; never guess a file's contents. "
    "Keep answers short; quote file paths and line numbers. Do not commit unless asked.\n"
)
TOOLS = [
    {
        "name": "read_file",
        "description": "Read a file of the repository, or the lines offset..offset+limit of it.",
        "input_schema": {
            "type": "object",
            "properties": {
                "path": {"type": "string", "description": "the file's path, relative to the repository root"},
                "offset": {"type": "integer", "minimum": 0},
                "limit": {"type": "integer", "minimum": 1},
            },
            "required": ["path"],
        },
    },
    {
        "name": "grep",
        "description": "Search the repository's files for a regular expression; returns matching lines.",
        "input_schema": {
            "type": "object",
            "properties": {
                "pattern": {"type": "string"},
                "path": {"type": "string", "description": "a folder or file to search (default: everywhere)"},
                "case_insensitive": {"type": "boolean"},
            },
            "required": ["pattern"],
        },
    },
    {
        "name": "edit_file",
        "description": "Replace one exact, unique occurrence of old_text in a file with new_text.",
        "input_schema": {
            "type": "object",
            "properties": {
                "path": {"type": "string"},
                "old_text": {"type": "string"},
                "new_text": {"type": "string"},
            },
            "required": ["path", "old_text", "new_text"],
        },
    },
    {
        "name": "bash",
        "description": "Run a shell command in the repository root and return its output and exit status.",
        "input_schema": {
            "type": "object",
            "properties": {
                "command": {"type": "string"},
                "timeout_s": {"type": "number", "minimum": 1, "maximum": 600},
            },
            "required": ["command"],
        },
    },
]


def messages_body(model: str, stream: bool, **extra) -> str:
    """An Anthropic Messages body: the system prompt (one text block, cached as agents mark it), the tools and
    one user message, the padding split between the system prompt (a quarter) and the user message."""
    pad = PAD["text"]
    cut = pad.rfind("\n", 0, len(pad) // 4) + 1  # on a line boundary
    b = {
        "model": model,
        "max_tokens": 16,
        "system": [{"type": "text", "text": SYSTEM + pad[:cut], "cache_control": {"type": "ephemeral"}}],
        "tools": TOOLS,
        "messages": [{"role": "user", "content": MESSAGES[0]["content"] + pad[cut:]}],
        **({"stream": True} if stream else {}),
        **extra,
    }
    return json.dumps(b, separators=(",", ":"))


def cell_path(cell: str) -> str:
    return "/v1/messages" if cell in MESSAGES_CELLS else "/v1/chat/completions"


BENCH_KEY = "sk-bench-tenant"
KEY_HEADERS: dict[str, str] = {}  # --tenants: every request presents BENCH_KEY (gateways without keys ignore it)


def tenant_runs() -> list[tuple[str, dict]]:
    """--tenants' two Coordinators, (label, config sections): BENCH_KEY in valid_keys (its own tenant), and BENCH_KEY a
    tenant_config tenant's with rpm, tpm and max_inflight never reached. Every request presents the key from now on."""
    KEY_HEADERS["Authorization"] = f"Bearer {BENCH_KEY}"
    quota = {"rpm": 10**9, "tpm": 10**12, "max_inflight": 10**6}
    tenants = {
        "api_key_config": api_keys("sk-bench-other"),
        "tenant_config": {"tenants": [{"name": "bench", "keys": [BENCH_KEY], **quota}]},
    }
    return [("keys", {"api_key_config": api_keys(BENCH_KEY)}), ("keys + tenant quotas", tenants)]


def cell_headers(cell: str) -> dict[str, str]:
    return {**(ANTHROPIC_HEADERS if cell in MESSAGES_CELLS else {}), **KEY_HEADERS}


PREFILL_LEG = {"kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False}, "ignore_eos": True}
MESSAGES_PREFILL_LEG = {"kv_transfer_params": PREFILL_LEG["kv_transfer_params"], "max_tokens": 1}
DECODE_LEG = {
    "kv_transfer_params": {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [[2, 3]],
        "remote_engine_id": "fastfake",
        "remote_request_id": "cmpl-fastfake",
        "remote_host": "127.0.0.1",
        "remote_port": 1,
        "remote_num_tokens": 12,
    }
}


# -- processes ------------------------------------------------------------------------------------


def tree_label(tree: str) -> str:
    """A source tree as its commit (short hash), or its path when it is not a git checkout."""
    try:
        out = subprocess.run(["git", "-C", tree, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    except OSError:
        return tree
    return out.stdout.strip() or tree


def python_version(python: str) -> str:
    """The interpreter's version ("3.11.2"); how it was built (PGO, LTO) matters as much: docs/performance.md."""
    out = subprocess.run(
        [python, "-c", "import platform; print(platform.python_version())"], capture_output=True, text=True, check=True
    )
    return out.stdout.strip()


NICE = 0  # --nice: the niceness of everything the bench starts (negative needs root)


def set_autogroup_nice(pid: int | str) -> None:
    """With the kernel's autogroup scheduling every session shares CPU as one group whatever its processes'
    nice values, so --nice also sets the niceness of the session's group (`pid`'s, or "self")."""
    if NICE:
        try:
            with open(f"/proc/{pid}/autogroup", "w") as f:
                f.write(str(NICE))
        except OSError:
            pass


def pinned(cores: str | None, args: list[str]) -> list[str]:
    """`args` on `cores` (taskset) at the bench's niceness."""
    if cores and shutil.which("taskset"):
        args = ["taskset", "-c", cores, *args]
    return ["nice", "-n", str(NICE), *args] if NICE else args


def cpu_seconds(root: int) -> float:
    total = 0
    for pid in tree(root):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)
        except (OSError, IndexError, ValueError):
            continue
    return total / CLK_TCK


def peak_rss_mb(pids: list[int]) -> list[float]:
    out = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("VmHWM:"):
                        out.append(int(line.split()[1]) / 1024)
        except OSError:
            continue
    return out


def wait_http(port: int, path: str, timeout_s: float, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[:4]} exited with {proc.returncode}")
        try:
            status, _, _ = request(port, "GET", path, None, timeout_s=1)
            if status == 200:
                return
        except OSError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"nothing answered 200 on 127.0.0.1:{port}{path} within {timeout_s:.0f}s")


class Proc(processes.Proc):
    """harness's child process (own session, log file, SIGTERM then SIGKILL), in the bench's autogroup niceness."""

    def __init__(self, args: list[str], log_path: str, env: dict | None = None):
        super().__init__(args, log_path, env=env)
        set_autogroup_nice(self.pid)


def engine_sims(args: list[list[str]], workdir: str) -> list[tuple[Proc, str]]:
    """engine_sim processes, one per entry of `args` (its arguments after `--port`), started together on free
    ports, each answering /health: each with its host:port. When one does not start, all are stopped and its log
    raised."""
    procs = []
    for port, more in zip(free_ports(len(args)), args, strict=True):
        argv = [sys.executable, "-m", "engine_sim", "--port", str(port), *more]
        procs.append((Proc(argv, os.path.join(workdir, f"engine_sim-{port}.log")), port))
    try:
        for proc, port in procs:
            try:
                wait_http(port, "/health", 30, proc)
            except RuntimeError as e:
                raise RuntimeError(f"engine_sim on port {port} did not start ({e}):\n{proc.output()}") from None
    except RuntimeError:
        for proc, _ in procs:
            proc.stop(5.0)
        raise
    return [(proc, f"127.0.0.1:{port}") for proc, port in procs]


def build_fake(workdir: str) -> str:
    exe = os.path.join(workdir, "fastfake")
    subprocess.run(["gcc", "-O2", "-o", exe, os.path.join(HERE, "fastfake.c")], check=True)
    return exe


# -- HTTP checks (correctness of each cell before it is timed) ------------------------------------


def request(
    port: int, method: str, path: str, data: str | None, timeout_s: float = 10, headers: dict | None = None
) -> tuple[int, dict, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    try:
        headers = {**({"Content-Type": "application/json"} if data is not None else {}), **(headers or {})}
        conn.request(method, path, body=data, headers=headers)
        resp = conn.getresponse()
        return resp.status, dict(resp.getheaders()), resp.read()
    finally:
        conn.close()


def check_answer(port: int, data: str, stream: bool) -> str:
    """'' when the answer is a complete, faithful relay of the fake's; else what is wrong."""
    status, _, raw = request(port, "POST", "/v1/chat/completions", data, headers=KEY_HEADERS)
    if status != 200:
        return f"HTTP {status}: {raw[:200]!r}"
    try:
        if not stream:
            obj = json.loads(raw)
            text = obj["choices"][0]["message"]["content"]
            usage = obj["usage"]
        else:
            events = [line[5:].strip() for line in raw.decode().splitlines() if line.startswith("data:")]
            if events[-1:] != ["[DONE]"]:
                return f"stream does not end with [DONE]: {events[-2:]}"
            objs = [json.loads(e) for e in events[:-1]]
            text = "".join(o["choices"][0]["delta"].get("content") or "" for o in objs if o.get("choices"))
            usage = objs[-1].get("usage") or {}
    except (ValueError, KeyError, IndexError) as e:
        return f"unparsable answer ({type(e).__name__}: {e}): {raw[:200]!r}"
    if text != TOKEN_TEXT:
        return f"content {text!r} is not the engine's"
    if usage.get("completion_tokens") != 16 or usage.get("prompt_tokens") != 12:
        return f"usage {usage} is not 12 prompt + 16 completion tokens"
    return ""


MESSAGES_EVENTS = (
    ["message_start", "content_block_start"]
    + ["content_block_delta"] * 16
    + ["content_block_stop", "message_delta", "message_stop"]
)


def check_messages(port: int, data: str, stream: bool) -> str:
    """'' when /v1/messages answered a complete, faithful relay of the fake's Message (or its events); else
    what is wrong. The client's usage is the whole prompt's, none of it read from a cache (PD: P's counts)."""
    status, _, raw = request(port, "POST", "/v1/messages", data, headers=ANTHROPIC_HEADERS)
    if status != 200:
        return f"HTTP {status}: {raw[:200]!r}"
    if b"kv_transfer_params" in raw:
        return "the answer carries kv_transfer_params"
    try:
        if not stream:
            obj = json.loads(raw)
            if (obj["type"], obj["role"], obj["stop_reason"]) != ("message", "assistant", "max_tokens"):
                return f"not a finished assistant message: {raw[:200]!r}"
            text = "".join(b["text"] for b in obj["content"] if b["type"] == "text")
            usage, prompt = obj["usage"], obj["usage"]["input_tokens"]
        else:
            names, objs = [], []
            for frame in raw.decode().split("\n\n"):
                if not frame.strip():
                    continue
                lines = frame.split("\n")
                if not (lines[0].startswith("event: ") and lines[1].startswith("data: ")):
                    return f"not an Anthropic SSE event: {frame[:200]!r}"
                names.append(lines[0][7:])
                objs.append(json.loads(lines[1][6:]))
            if names != MESSAGES_EVENTS or any(o["type"] != n for o, n in zip(objs, names)):
                return f"events {names} are not the Message's"
            text = "".join(o["delta"]["text"] for o in objs if o["type"] == "content_block_delta")
            prompt, usage = objs[0]["message"]["usage"]["input_tokens"], objs[-2]["usage"]
            if objs[-2]["delta"]["stop_reason"] != "max_tokens":
                return f"message_delta {objs[-2]} does not stop on max_tokens"
    except (ValueError, KeyError, IndexError, TypeError) as e:
        return f"unparsable answer ({type(e).__name__}: {e}): {raw[:200]!r}"
    if text != TOKEN_TEXT:
        return f"content {text!r} is not the engine's"
    if prompt != 12 or usage.get("output_tokens") != 16 or usage.get("cache_read_input_tokens", 0):
        return f"usage {usage} (input {prompt}) is not 12 input tokens, none cached, and 16 output tokens"
    return ""


def check_cell(port: int, cell: str, data: str) -> str:
    check = check_messages if cell in MESSAGES_CELLS else check_answer
    return check(port, data, cell in STREAMED)


# -- wrk ------------------------------------------------------------------------------------------

WRK_DONE = r"""
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format('BENCH {"requests":%d,"duration_us":%d,"connect":%d,"read":%d,"write":%d,"status":%d,' ..
    '"timeout":%d,"p50_us":%d,"p99_us":%d,"mean_us":%.1f}\n', summary.requests, summary.duration, e.connect,
    e.read, e.write, e.status, e.timeout, latency:percentile(50), latency:percentile(99), latency.mean))
end
"""


def wrk_script(bodies: list[str], headers: dict[str, str] | None = None) -> str:
    """One body for every request, or bodies taken in turn (the direct PD cells' prefill/decode legs)."""
    head = 'wrk.method = "POST"\nwrk.headers["Content-Type"] = "application/json"\n'
    head += "".join(f'wrk.headers["{k}"] = "{v}"\n' for k, v in (headers or {}).items())
    if len(bodies) == 1:
        return head + f"wrk.body = [==[{bodies[0]}]==]\n" + WRK_DONE
    items = ", ".join(f"[==[{b}]==]" for b in bodies)
    return (
        head
        + (
            f"local bodies = {{{items}}}\nlocal n = 0\n"
            "request = function()\n  n = n + 1\n"
            '  return wrk.format("POST", nil, nil, bodies[(n - 1) % #bodies + 1])\nend\n'
        )
        + WRK_DONE
    )


def run_wrk(
    port: int,
    bodies: list[str],
    seconds: float,
    connections: int,
    threads: int,
    cores: str,
    workdir: str,
    url_path: str = "/v1/chat/completions",
    headers: dict[str, str] | None = None,
) -> dict:
    path = os.path.join(workdir, f"wrk-{abs(hash((*bodies, url_path)))}.lua")
    with open(path, "w") as f:
        f.write(wrk_script(bodies, headers))
    args = pinned(
        cores,
        [
            "wrk",
            f"-t{min(threads, connections)}",
            f"-c{connections}",
            f"-d{max(1, round(seconds))}s",
            "--timeout",
            "10s",
            "-s",
            path,
            f"http://127.0.0.1:{port}{url_path}",
        ],
    )
    out = subprocess.run(args, capture_output=True, text=True, timeout=seconds + 60)
    for line in out.stdout.splitlines():
        if line.startswith("BENCH "):
            return json.loads(line[6:])
    raise RuntimeError(f"wrk printed no result:\n{out.stdout}\n{out.stderr}")


# -- gateways -------------------------------------------------------------------------------------


@dataclass
class Engines:
    union: int
    prefill: int
    decode: int
    reads: int = 0  # counters() calls so far: each costs every fake one request on a connection of its own

    def counters(self) -> tuple[int, int]:
        """(requests served, connections accepted) by the three fakes, not counting those of these calls."""
        self.reads += 1
        reqs = conns = 0
        for port in (self.union, self.prefill, self.decode):
            _, _, raw = request(port, "GET", "/metrics", None)
            for line in raw.decode().splitlines():
                if line.startswith("fastfake_requests_total "):
                    reqs += int(line.split()[1]) - self.reads
                elif line.startswith("fastfake_connections_total "):
                    conns += int(line.split()[1]) - self.reads
        return reqs, conns


class Gateway:
    """A gateway under test: its process (tree), the port serving each cell and how to tell its workers."""

    name = ""
    label = ""
    cells = CELLS
    logs_requests = False  # writes one log line per request (with its status) that log_statuses() reads
    proc: Proc  # the gateway's root process (subclasses that start it lazily override root_pid and stop)

    def port(self, cell: str) -> int:
        raise NotImplementedError

    def body(self, cell: str) -> str:
        raise NotImplementedError

    def root_pid(self, cell: str) -> int:
        return self.proc.pid

    def worker_pids(self) -> list[int]:
        raise NotImplementedError

    def log_statuses(self) -> dict[str, int]:
        """Request statuses the gateway logged since the last call ({} when it does not log them)."""
        return {}

    def stop(self) -> None:
        self.proc.stop()


class StatusPoller:
    """A browser showing the status page: GET /status.json every `interval_s` on its own connection (as the
    page's fetch does), in a thread, while the `with` block runs; `polls` counts the 200s."""

    def __init__(self, port: int, interval_s: float = 1.0):
        self.port, self.interval_s, self.polls = port, interval_s, 0
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        while not self.stop_event.wait(self.interval_s):
            try:
                conn.request("GET", "/status.json")
                response = conn.getresponse()
                if response.status == 200 and response.read():
                    self.polls += 1
            except (OSError, http.client.HTTPException):  # as a browser, on a new connection next time
                conn.close()

    def __enter__(self) -> StatusPoller:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop_event.set()
        self.thread.join(timeout=35)


class Coordinator(Gateway):
    name = "coordinator"
    cells = ALL_CELLS

    def __init__(
        self,
        engines: Engines,
        workers: int,
        log_level: str,
        cores: str,
        workdir: str,
        root: str = ROOT,
        launcher: tuple[str, ...] = (),
        start_timeout_s: float = 60,
        python: str = sys.executable,
        python_label: str = "",
        sections: dict | None = None,
    ):
        """`root`: the source tree whose app.py runs; `launcher`: a command that runs it (bench/instructions.py's
        valgrind); `python`: the interpreter that runs it, named in the label when `python_label` is given;
        `sections`: more config sections (cluster mode's), named in the label by `python_label` too."""
        self.workers, self.log_level = workers, log_level
        self.logs_requests = log_level in ("DEBUG", "INFO")
        self.label = f"Coordinator, {workers} worker{'s' if workers > 1 else ''}, log {log_level}"
        if python_label:
            self.label += f", {python_label}"
        api = api_config()
        self.infer_port, mgmt = api["coordinator_api_infer_port"], api["coordinator_api_mgmt_port"]
        self.obs_port = api["coordinator_obs_port"]
        config = {
            "motor_coordinator_config": {
                "api_config": api,
                "inference_workers_config": {"num_workers": workers},
                "log_config": {"log_level": log_level},
                "shutdown_config": {"drain_timeout": 2},
                "models": [{"id": "bench"}, {"id": "bench-pd"}],
                "instances": [
                    instance(1, "union", "bench", f"127.0.0.1:{engines.union}"),
                    instance(2, "prefill", "bench-pd", f"127.0.0.1:{engines.prefill}"),
                    instance(3, "decode", "bench-pd", f"127.0.0.1:{engines.decode}"),
                ],
                **(sections or {}),
            }
        }
        tag = "".join(ch if ch.isalnum() else "-" for ch in python_label)
        path = os.path.join(workdir, f"coordinator-{workers}-{log_level}{'-' + tag if tag else ''}.json")
        with open(path, "w") as f:
            json.dump(config, f)
        self.proc = Proc(
            pinned(cores, [*launcher, python, os.path.join(root, "app.py"), "--config", path]),
            path + ".log",
        )
        self.log_offset = 0
        try:
            wait_http(mgmt, "/readiness", start_timeout_s, self.proc)
            # Every worker must be serving before a SIGTERM is safe (sanic #2997) and before timing starts.
            deadline = time.monotonic() + start_timeout_s
            while len(self.worker_pids()) < workers and time.monotonic() < deadline:
                time.sleep(0.1)
            time.sleep(0.5)
        except Exception:
            self.stop()
            raise

    def port(self, cell: str) -> int:
        return self.infer_port

    def body(self, cell: str) -> str:
        make = messages_body if cell in MESSAGES_CELLS else body
        return make("bench-pd" if cell in PD else "bench", cell in STREAMED)

    def worker_pids(self) -> list[int]:
        """Sanic's server workers (started with SANIC_WORKER_NAME=Sanic-Server-*), not its other helpers."""
        return [p for p in tree(self.proc.pid) if processes.sanic_server_name(p)]

    def log_statuses(self) -> dict[str, int]:
        with open(self.proc.log_path, "rb") as f:
            f.seek(self.log_offset)
            data = f.read()
        self.log_offset += len(data)
        counts: dict[str, int] = {}
        for line in data.split(b"\n"):
            i = line.find(b" status=")
            if i >= 0 and b"request_id=" in line:
                status = line[i + 8 :].split(b" ", 1)[0].decode()
                counts[status] = counts.get(status, 0) + 1
        return counts


class VllmRouter(Gateway):
    """vllm-router 0.1.17: one process in regular mode (union engine), another in PD mode, started in turn."""

    name = "vllm-router"
    label = "vllm-router 0.1.17 (Rust)"

    def __init__(self, engines: Engines, cores: str, workdir: str):
        self.engines, self.cores, self.workdir = engines, cores, workdir
        self.mode: str | None = None
        self.proc: Proc | None = None
        self.router_port = 0

    def _ensure(self, cell: str) -> None:
        mode = "pd" if cell in PD else "regular"
        if self.mode == mode:
            return
        self.stop()
        self.router_port = free_port()
        e = self.engines
        if mode == "pd":
            workers = [
                "--vllm-pd-disaggregation",
                "--prefill",
                f"http://127.0.0.1:{e.prefill}",
                "--decode",
                f"http://127.0.0.1:{e.decode}",
            ]
        else:
            workers = ["--worker-urls", f"http://127.0.0.1:{e.union}"]
        args = [
            shutil.which("vllm-router"),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.router_port),
            *workers,
            "--policy",
            "round_robin",
            "--log-level",
            "warning",
            "--prometheus-host",
            "127.0.0.1",
            "--prometheus-port",
            str(free_port()),
        ]
        self.proc = Proc(pinned(self.cores, args), os.path.join(self.workdir, f"vllm-router-{mode}.log"))
        self.mode = mode
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # ready when a real request goes through
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm-router exited with {self.proc.returncode}")
            try:
                if request(self.router_port, "POST", "/v1/chat/completions", self.body(cell), timeout_s=2)[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.2)
        raise RuntimeError("vllm-router did not serve within 60 s")

    def port(self, cell: str) -> int:
        self._ensure(cell)
        return self.router_port

    def body(self, cell: str) -> str:
        return body("bench", cell in STREAMED)

    def root_pid(self, cell: str) -> int:
        self._ensure(cell)
        return self.proc.pid

    def worker_pids(self) -> list[int]:
        return [self.proc.pid] if self.proc else []

    def stop(self) -> None:
        if self.proc:
            self.proc.stop()
        self.proc, self.mode = None, None


class OneProcessGateway(Gateway):
    """A gateway of one process tree serving the union fake's cells on one port (the floor, LiteLLM)."""

    def _start(
        self, args: list[str], cores: str, log_path: str, ready_path: str, timeout_s: float, env: dict | None = None
    ) -> None:
        self.proc = Proc(pinned(cores, args), log_path, env=env)
        try:
            wait_http(self.gw_port, ready_path, timeout_s, self.proc)
        except Exception:
            self.stop()
            raise

    def port(self, cell: str) -> int:
        return self.gw_port

    def body(self, cell: str) -> str:
        return body("bench", cell in STREAMED)

    def worker_pids(self) -> list[int]:
        return [self.proc.pid]


class SanicFloor(OneProcessGateway):
    """bench/sanic_floor.py: Sanic and the engine client relaying to the union fake, nothing else (no PD)."""

    name = "sanic-floor"
    label = "Sanic + engine client only (floor)"
    cells = ("chat", "chat_stream")

    def __init__(self, engines: Engines, cores: str, workdir: str, python: str = sys.executable):
        self.gw_port = free_port()
        args = [
            python,
            os.path.join(HERE, "sanic_floor.py"),
            str(self.gw_port),
            f"http://127.0.0.1:{engines.union}/v1/chat/completions",
        ]
        self._start(args, cores, os.path.join(workdir, "sanic-floor.log"), "/health", 60)


class LiteLLM(OneProcessGateway):
    """LiteLLM's proxy (`litellm[proxy]==1.82.6`, one uvicorn worker) in front of the union fake, as
    `hosted_vllm/bench`; it has no PD mode. Its model cost map is read from the package (no network)."""

    name = "litellm"
    label = "LiteLLM 1.82.6 (Python)"
    cells = ("chat", "chat_stream")

    def __init__(self, engines: Engines, cores: str, workdir: str, exe: str):
        self.gw_port = free_port()
        path = os.path.join(workdir, "litellm.yaml")
        with open(path, "w") as f:
            f.write(
                "model_list:\n  - model_name: bench\n    litellm_params:\n      model: hosted_vllm/bench\n"
                f"      api_base: http://127.0.0.1:{engines.union}/v1\n      api_key: none\n"
                "litellm_settings:\n  telemetry: false\n"
            )
        args = [exe, "--config", path, "--host", "127.0.0.1", "--port", str(self.gw_port), "--num_workers", "1"]
        env = {"LITELLM_LOCAL_MODEL_COST_MAP": "True"}  # the cost map from the package, not the network
        self._start(args, cores, os.path.join(workdir, "litellm.log"), "/health/liveliness", 120, env)


# -- measuring ------------------------------------------------------------------------------------


@dataclass
class Cell:
    gateway: str
    cell: str
    rps: float = 0.0
    p50_us: float = 0.0
    p99_us: float = 0.0
    requests: int = 0
    errors: int = 0
    cpu_us_per_req: float | None = None
    cpu_util: float | None = None  # gateway CPU seconds per wall second: below its cores' count = not saturated
    ratio_to_direct: float | None = None
    upstream_per_req: float | None = None  # engine requests per client request (PD: 2)
    upstream_conns_per_1k: float | None = None  # engine connections opened per 1,000 requests (0 with reuse)
    c1_p50_us: float | None = None
    c1_p99_us: float | None = None
    added_p50_us: float | None = None
    rss_mb: list[float] = field(default_factory=list)  # peak RSS of each worker process
    error_kinds: dict[str, int] = field(default_factory=dict)
    note: str = ""

    def add_errors(self, kinds: dict[str, int]) -> None:
        for k, n in kinds.items():
            if n:
                self.error_kinds[k] = self.error_kinds.get(k, 0) + n
        self.errors = sum(self.error_kinds.values())

    def add_note(self, text: str) -> None:
        self.note = f"{self.note}; {text}" if self.note else text


def wrk_errors(res: dict) -> dict[str, int]:
    """wrk's error counts by kind ("status" is non-2xx/3xx answers)."""
    return {f"wrk {k}": res[k] for k in ("connect", "read", "write", "status", "timeout")}


def settled_statuses(gw: Gateway, connections: int) -> tuple[dict[str, int], int]:
    """Error statuses the gateway logged for the last run, once its log is quiet, and all lines logged.

    wrk stops at its deadline with up to `connections` requests in flight, which the gateway logs as
    499 (client gone): those are the load generator's doing and are not counted."""
    counts: dict[str, int] = {}
    quiet_since, deadline = time.monotonic(), time.monotonic() + 10
    while time.monotonic() < deadline and time.monotonic() - quiet_since < 0.5:
        new = gw.log_statuses()
        if new:
            quiet_since = time.monotonic()
        for k, n in new.items():
            counts[k] = counts.get(k, 0) + n
        time.sleep(0.1)
    bad = {f"logged {k}": n for k, n in counts.items() if not k.startswith("2") and k != "499"}
    if counts.get("499", 0) > connections:
        bad["logged 499 beyond wrk's in-flight"] = counts["499"] - connections
    return bad, sum(counts.values())


def direct_bodies(cell: str) -> list[str]:
    if cell in MESSAGES_CELLS:
        if cell in PD:
            return [messages_body("bench", False, **MESSAGES_PREFILL_LEG), messages_body("bench", True, **DECODE_LEG)]
        return [messages_body("bench", cell in STREAMED)]
    if cell in PD:
        return [body("bench", False, **PREFILL_LEG), body("bench", cell in STREAMED, **DECODE_LEG)]
    return [body("bench", cell in STREAMED)]


def measure_direct(
    engines: Engines, opts, load_cores: str, workdir: str, cells: tuple[str, ...] = CELLS
) -> dict[str, Cell]:
    out = {}
    # Concurrency 1: each leg alone (a PD cell's figure is its prefill leg's plus its decode leg's), every
    # distinct leg of the cells measured once, before the throughput cells.
    legs_c1: dict[str, dict] = {}
    if opts.latency > 0:
        for cell in cells:
            for data in direct_bodies(cell):
                if data not in legs_c1:
                    legs_c1[data] = run_wrk(
                        engines.union,
                        [data],
                        opts.latency,
                        1,
                        1,
                        load_cores,
                        workdir,
                        cell_path(cell),
                        cell_headers(cell),
                    )
    for cell in cells:
        bodies = direct_bodies(cell)
        res = run_wrk(
            engines.union,
            bodies,
            opts.duration,
            opts.connections,
            opts.threads,
            load_cores,
            workdir,
            cell_path(cell),
            cell_headers(cell),
        )
        legs = len(bodies)
        c = Cell("direct", cell)
        c.requests = res["requests"] // legs
        c.rps = c.requests / (res["duration_us"] / 1e6)
        c.add_errors(wrk_errors(res))
        c.p50_us, c.p99_us = res["p50_us"], res["p99_us"]
        if legs > 1:
            c.note = "2 legs per request: req/s counts pairs, loaded latency is per leg"
        if legs_c1:
            c.c1_p50_us = sum(legs_c1[b]["p50_us"] for b in bodies)
            c.c1_p99_us = sum(legs_c1[b]["p99_us"] for b in bodies)
        out[cell] = c
        print(f"  direct {cell:15s} {c.rps:9.0f} req/s  p50 {c.p50_us / 1000:.2f} ms  errors {c.errors}", flush=True)
    return out


def measure_gateway(
    gw: Gateway,
    engines: Engines,
    opts,
    direct: dict[str, Cell],
    load_cores: str,
    gw_cores: int,
    workdir: str,
    latency: bool,
    cells: tuple[str, ...] = (),
) -> dict[str, Cell]:
    """Measure `cells` (default: all the gateway serves) through `gw`."""
    out = {}
    for cell in cells or gw.cells:
        c = Cell(gw.label, cell)
        port = gw.port(cell)
        data = gw.body(cell)
        wrk_to = (cell_path(cell), cell_headers(cell))
        problem = check_cell(port, cell, data)
        if problem:
            c.note = f"wrong answer: {problem}"
            c.add_errors({"wrong answer": 1})
            print(f"  {gw.name} {cell}: {c.note}", flush=True)
            out[cell] = c
            continue
        run_wrk(port, [data], opts.warmup, opts.connections, opts.threads, load_cores, workdir, *wrk_to)
        settled_statuses(gw, opts.connections)
        root = gw.root_pid(cell)
        up0 = engines.counters()
        cpu0, t0 = cpu_seconds(root), time.monotonic()
        res = run_wrk(port, [data], opts.duration, opts.connections, opts.threads, load_cores, workdir, *wrk_to)
        cpu1, t1 = cpu_seconds(root), time.monotonic()
        up1 = engines.counters()
        c.requests = res["requests"]
        c.rps = c.requests / (res["duration_us"] / 1e6)
        c.p50_us, c.p99_us = res["p50_us"], res["p99_us"]
        c.add_errors(wrk_errors(res))
        bad, logged = settled_statuses(gw, opts.connections)
        c.add_errors(bad)
        if gw.logs_requests and logged < c.requests:
            c.add_note(f"only {logged} request log lines for {c.requests} requests at log INFO")
        if c.requests:
            c.cpu_us_per_req = (cpu1 - cpu0) / c.requests * 1e6
            c.upstream_per_req = (up1[0] - up0[0]) / c.requests
            c.upstream_conns_per_1k = (up1[1] - up0[1]) / c.requests * 1000
        c.cpu_util = (cpu1 - cpu0) / (t1 - t0)
        if c.cpu_util < 0.85 * gw_cores:
            c.add_note(f"gateway not saturated ({c.cpu_util:.2f} of {gw_cores} core(s))")
        d = direct.get(cell)
        if d and d.rps:
            c.ratio_to_direct = c.rps / d.rps
        if latency and opts.latency > 0:
            res1 = run_wrk(port, [data], opts.latency, 1, 1, load_cores, workdir, *wrk_to)
            c.c1_p50_us, c.c1_p99_us = res1["p50_us"], res1["p99_us"]
            if d and d.c1_p50_us is not None:
                c.added_p50_us = c.c1_p50_us - d.c1_p50_us
            c.add_errors(wrk_errors(res1))
            c.add_errors(settled_statuses(gw, 1)[0])
        c.rss_mb = peak_rss_mb(gw.worker_pids())
        print(
            f"  {gw.name} {cell:15s} {c.rps:9.0f} req/s  {c.cpu_us_per_req or 0:7.0f} µs CPU/req  "
            f"p50 {c.p50_us / 1000:.2f} ms  errors {c.errors}{'  ' + c.note if c.note else ''}",
            flush=True,
        )
        out[cell] = c
    return out


def median_round(cells: list[Cell]) -> Cell:
    """The round whose CPU per request is the median, with every round's errors and the first round's latency."""
    if len(cells) == 1:
        return cells[0]
    first = cells[0]
    mid = sorted(cells, key=lambda c: c.cpu_us_per_req or 0.0)[len(cells) // 2]
    out = replace(
        mid,
        error_kinds={},
        errors=0,
        c1_p50_us=first.c1_p50_us,
        c1_p99_us=first.c1_p99_us,
        added_p50_us=first.added_p50_us,
    )
    for c in cells:
        out.add_errors(c.error_kinds)
    out.add_note(
        f"median of {len(cells)} rounds: " + " / ".join(f"{c.cpu_us_per_req or 0:.0f}" for c in cells) + " µs CPU/req"
    )
    return out


# -- report ---------------------------------------------------------------------------------------


def fmt(v, spec: str, scale: float = 1.0) -> str:
    return "-" if v is None else format(v * scale, spec)


def report(results: list[list[Cell]], header: str) -> str:
    lines = [header, ""]
    lines.append(
        "| gateway | cell | req/s | x direct | p50 ms | p99 ms | CPU µs/req | CPU s/1k req "
        "| gateway cores busy | c=1 p50 ms | c=1 p99 ms | added p50 ms | peak RSS MB | engine req/req "
        "| engine conns/1k req | errors |"
    )
    lines.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    notes = []
    for group in results:
        for c in group:
            rss = "/".join(f"{m:.0f}" for m in c.rss_mb) if c.rss_mb else "-"
            lines.append(
                f"| {c.gateway} | {c.cell} | {c.rps:,.0f} | {fmt(c.ratio_to_direct, '.2f')} | {c.p50_us / 1000:.2f} | "
                f"{c.p99_us / 1000:.2f} | {fmt(c.cpu_us_per_req, ',.0f')} | {fmt(c.cpu_us_per_req, '.3f', 1e-3)} | "
                f"{fmt(c.cpu_util, '.2f')} | "
                f"{fmt(c.c1_p50_us, '.3f', 1e-3)} | {fmt(c.c1_p99_us, '.3f', 1e-3)} | {fmt(c.added_p50_us, '.3f', 1e-3)} | "
                f"{rss} | {fmt(c.upstream_per_req, '.2f')} | {fmt(c.upstream_conns_per_1k, '.1f')} | {c.errors} |"
            )
            if c.error_kinds:
                c.add_note("errors: " + ", ".join(f"{k} {n}" for k, n in c.error_kinds.items()))
            if c.note:
                notes.append(f"- {c.gateway}, {c.cell}: {c.note}")
    if notes:
        lines += ["", *notes]
    return "\n".join(lines)


def verdicts(results: list[list[Cell]]) -> str:
    """The issue's figures, read from this run's table (1 worker, log INFO)."""
    by = {(c.gateway, c.cell): c for g in results for c in g}
    ours = {c.cell: c for g in results for c in g if c.gateway == "Coordinator, 1 worker, log INFO"}
    router = {c.cell: c for g in results for c in g if c.gateway.startswith("vllm-router")}
    litellm = {c.cell: c for g in results for c in g if c.gateway.startswith("LiteLLM")}
    lines = ["", "Figures (Coordinator, 1 worker on 1 core, log INFO):"]

    def check(ok: bool | None, text: str) -> None:
        lines.append(f"- [{'pass' if ok else 'FAIL' if ok is not None else 'n/a '}] {text}")

    for cell, c in ours.items():
        r = router.get(cell)
        limit = 1.0 if cell in STREAMED else 2.0
        if r and r.cpu_us_per_req and c.cpu_us_per_req:
            ratio = c.cpu_us_per_req / r.cpu_us_per_req
            check(
                ratio <= limit,
                f"{cell}: CPU/req {c.cpu_us_per_req:.0f} µs = {ratio:.2f}x vllm-router's "
                f"{r.cpu_us_per_req:.0f} µs (limit {limit:g}x, same run)",
            )
        elif cell in MESSAGES_CELLS:
            check(None, f"{cell}: vllm-router 0.1.17 has no /v1/messages")
        else:
            check(None, f"{cell}: vllm-router not measured in this run")
        for ref, cells in REFERENCE_US.items():
            if ref.startswith("vllm-router") or cell not in cells or c.cpu_us_per_req is None:
                continue
            check(
                c.cpu_us_per_req * 20 <= cells[cell],
                f"{cell}: {c.cpu_us_per_req:.0f} µs x20 <= {ref} {cells[cell]} µs (their figure, another run)",
            )
        peer = litellm.get(cell)
        if peer and peer.cpu_us_per_req and c.cpu_us_per_req:
            check(
                c.cpu_us_per_req * 20 <= peer.cpu_us_per_req,
                f"{cell}: {c.cpu_us_per_req:.0f} µs x20 <= LiteLLM's {peer.cpu_us_per_req:.0f} µs "
                f"({peer.cpu_us_per_req / c.cpu_us_per_req:.1f}x, same run)",
            )
        if cell not in STREAMED and c.added_p50_us is not None:
            limit_us = 2000 if cell in PD else 1000
            check(
                c.added_p50_us < limit_us,
                f"{cell}: c=1 added p50 {c.added_p50_us / 1000:.3f} ms < {limit_us / 1000:g} ms",
            )
    bad = [k for k, c in by.items() if c.errors]
    check(not bad, "no cell with errors or non-2xx answers" + (f" (errors in {bad})" if bad else ""))
    return "\n".join(lines)


# -- profile --------------------------------------------------------------------------------------


def top_frames(raw_path: str, n: int = 25) -> str:
    """Self and inclusive sample shares per frame from py-spy's collapsed ('raw') output."""
    self_s: dict[str, int] = {}
    incl: dict[str, int] = {}
    total = 0
    with open(raw_path, errors="replace") as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not stack or not (count.isascii() and count.isdigit()):
                continue  # py-spy now and then writes a garbled line
            k = int(count)
            total += k
            frames = stack.split(";")
            self_s[frames[-1]] = self_s.get(frames[-1], 0) + k
            for fr in set(frames):
                incl[fr] = incl.get(fr, 0) + k
    if not total:
        return "no samples"
    out = [f"{total} samples", "", "self %  frame"]
    out += [f"{v * 100 / total:6.1f}  {k}" for k, v in sorted(self_s.items(), key=lambda kv: -kv[1])[:n]]
    out += ["", "incl %  frame"]
    out += [f"{v * 100 / total:6.1f}  {k}" for k, v in sorted(incl.items(), key=lambda kv: -kv[1])[:n]]
    return "\n".join(out)


def profile(engines: Engines, opts, load_cores: str, gw_cores: str, workdir: str) -> None:
    spy = shutil.which("py-spy")
    if not spy:
        sys.exit("--profile needs py-spy: pip install py-spy==0.4.3")
    os.makedirs(OUT, exist_ok=True)
    gw = Coordinator(engines, 1, "INFO", gw_cores, workdir, python=opts.python)
    try:
        worker = gw.worker_pids()[0]
        for cell in opts.profile_cells.split(","):
            data = gw.body(cell)
            wrk_to = (cell_path(cell), cell_headers(cell))
            run_wrk(gw.infer_port, [data], opts.warmup, opts.connections, opts.threads, load_cores, workdir, *wrk_to)
            raw = os.path.join(OUT, f"profile-{cell}.txt")
            if os.path.exists(raw):
                os.unlink(raw)
            spy_proc = subprocess.Popen(
                pinned(
                    load_cores,
                    [
                        spy,
                        "record",
                        "--pid",
                        str(worker),
                        "--duration",
                        str(int(opts.duration)),
                        "--format",
                        "raw",
                        *([] if opts.profile_lines else ["--function"]),
                        "--output",
                        raw,
                        # Native stacks need the target paused per sample: fewer samples keep it from crawling.
                        *(["--native", "--rate", "50"] if opts.native else ["--nonblocking", "--rate", str(opts.rate)]),
                    ],
                ),
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
            )
            time.sleep(0.5)
            cpu0 = cpu_seconds(gw.proc.pid)
            res = run_wrk(
                gw.infer_port, [data], opts.duration, opts.connections, opts.threads, load_cores, workdir, *wrk_to
            )
            cpu1 = cpu_seconds(gw.proc.pid)
            _, err = spy_proc.communicate(timeout=60)
            print(
                f"\n## {cell}: {res['requests'] / (res['duration_us'] / 1e6):,.0f} req/s, "
                f"{(cpu1 - cpu0) / max(res['requests'], 1) * 1e6:.0f} µs CPU/req while profiled; "
                f"collapsed stacks in {os.path.relpath(raw, ROOT)} (speedscope.app opens them)\n"
            )
            print(top_frames(raw) if os.path.exists(raw) else f"py-spy failed: {err.decode()[-500:]}")
    finally:
        gw.stop()


# -- main -----------------------------------------------------------------------------------------


@contextmanager
def redis_server(cores: str | None):
    """Debian's redis-server on a free loopback port, pinned to `cores` (the load core, beside the fakes)."""
    server = RedisServer()
    if cores:
        subprocess.run(["taskset", "-pc", cores, str(server.proc.pid)], check=True, capture_output=True)
    try:
        yield server
    finally:
        server.stop()


@contextmanager
def fakes(exe: str, cores: str, workdir: str):
    procs = []
    try:
        ports = free_ports(3)
        for role, port in zip(("union", "prefill", "decode"), ports):
            procs.append(Proc(pinned(cores, [exe, str(port), "bench"]), os.path.join(workdir, f"fake-{role}.log")))
        for p, port in zip(procs, ports):
            wait_http(port, "/health", 10, p)
        yield Engines(*ports)
    finally:
        for p in procs:
            p.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="short cells (2 s), for a smoke run")
    ap.add_argument("--duration", type=float, help="seconds per throughput cell (default 6; --quick 2)")
    ap.add_argument("--latency", type=float, help="seconds per concurrency-1 cell (default 3; --quick 1; 0 skips)")
    ap.add_argument("--warmup", type=float, help="seconds of load before each timed cell (default 1)")
    ap.add_argument("--connections", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="measure the side-by-side gateways' cells this many times, interleaved, and report the median round",
    )
    ap.add_argument("--workers", default="1,2", help="worker counts to measure (log INFO), e.g. 1 or 1,2")
    ap.add_argument("--no-warning", action="store_true", help="skip the 1-worker run at log level WARNING")
    ap.add_argument("--no-router", action="store_true", help="skip vllm-router even when installed")
    ap.add_argument("--no-floor", action="store_true", help="skip the Sanic floor (bench/sanic_floor.py)")
    ap.add_argument("--json", help="also write the results to this file")
    ap.add_argument("--prompt-kib", type=int, default=0, help="pad every cell's user message to this many KiB")
    ap.add_argument(
        "--cells",
        default=",".join(CELLS),
        help=f"the cells measured, comma-separated, of {', '.join(ALL_CELLS)} (default {','.join(CELLS)})",
    )
    ap.add_argument("--profile", action="store_true", help="profile the Coordinator's worker with py-spy instead")
    ap.add_argument("--native", action="store_true", help="with --profile: include native (C) frames")
    ap.add_argument("--rate", type=int, default=100, help="with --profile: py-spy samples per second (default 100)")
    ap.add_argument("--profile-lines", action="store_true", help="with --profile: frames by line, not by function")
    ap.add_argument(
        "--profile-cells",
        default="chat,pd_chat_stream",
        help="with --profile: the cells profiled, comma-separated (default chat,pd_chat_stream)",
    )
    ap.add_argument(
        "--python",
        default=sys.executable,
        help="the interpreter that runs the Coordinator and the floor (default: this one); it needs "
        "requirements.txt installed",
    )
    ap.add_argument(
        "--python-also",
        metavar="PYTHON",
        help="one more Coordinator (1 worker, log INFO) on this interpreter, measured side by side",
    )
    ap.add_argument(
        "--tree-also",
        metavar="DIR",
        action="append",
        default=[],
        help="one more Coordinator (1 worker, log INFO) from this source tree (e.g. a `git worktree` of the "
        "previous commit), measured side by side: a change's cost in one run; may be given more than once",
    )
    ap.add_argument(
        "--cluster",
        action="store_true",
        help="two more Coordinators (1 worker, log INFO) side by side, in cluster mode against a redis-server on the "
        "load core: one without limits (the background sync only), one with max_inflight_requests, which costs a "
        "round trip to Redis per request",
    )
    ap.add_argument(
        "--tenants",
        action="store_true",
        help="two more Coordinators (1 worker, log INFO) side by side, every request with an API key: one with the key "
        "in valid_keys, one with it a tenant's of tenant_config with rpm, tpm and max_inflight never reached",
    )
    ap.add_argument(
        "--litellm",
        metavar="EXE",
        help="LiteLLM's `litellm` command (from an environment with litellm[proxy]==1.82.6): measured "
        "side by side in the chat cells",
    )
    ap.add_argument(
        "--nice",
        type=int,
        default=0,
        help="run gateway, fakes and wrk at this niceness (e.g. -10 as root) on a machine others share",
    )
    opts = ap.parse_args(argv)
    global NICE
    NICE = opts.nice
    PAD["text"] = padding(opts.prompt_kib)
    tenants = tenant_runs() if opts.tenants else []
    set_autogroup_nice("self")  # wrk runs in the bench's own session
    opts.duration = opts.duration or (2.0 if opts.quick else 6.0)
    opts.latency = opts.latency if opts.latency is not None else (1.0 if opts.quick else 3.0)
    opts.warmup = opts.warmup if opts.warmup is not None else 1.0
    workers = [int(w) for w in opts.workers.split(",") if w]
    cells = tuple(c for c in opts.cells.split(",") if c)
    unknown = [c for c in cells if c not in ALL_CELLS]
    if unknown or not cells:
        print(
            f"--cells: unknown {', '.join(unknown) or '(none given)'}; known: {', '.join(ALL_CELLS)}", file=sys.stderr
        )
        return 2

    missing = [t for t in ("wrk", "gcc") if not shutil.which(t)]
    if missing:
        print(
            f"missing: {', '.join(missing)}. Install with: apt-get update && apt-get install -y wrk gcc",
            file=sys.stderr,
        )
        return 2
    ncpu = len(os.sched_getaffinity(0))
    if ncpu < 2 or not shutil.which("taskset"):
        load_cores, gw_core_sets = None, dict.fromkeys(workers)
        layout = "no pinning (needs 2+ cores and taskset): gateway and load share the CPUs"
    else:
        cpus = sorted(os.sched_getaffinity(0))
        load_cores = str(cpus[0])
        gw_core_sets = {
            w: ",".join(map(str, cpus[1 : 1 + w])) if ncpu >= 1 + w else str(cpus[1]) for w in workers + [1]
        }
        layout = f"wrk and fakes on core {load_cores}; gateway on core(s) " + ", ".join(
            f"{gw_core_sets[w]} ({w} worker{'s' if w > 1 else ''})" for w in sorted(set(workers + [1]))
        )

    workdir = tempfile.mkdtemp(prefix="motor-bench-")
    try:
        exe = build_fake(workdir)
        with fakes(exe, load_cores, workdir) as engines, ExitStack() as stack:
            if opts.profile:
                profile(engines, opts, load_cores, gw_core_sets[1], workdir)
                return 0
            t_start = time.monotonic()
            print(f"# {layout}; wrk -t{opts.threads} -c{opts.connections}, {opts.duration:g} s per cell", flush=True)
            direct = measure_direct(engines, opts, load_cores, workdir, cells)
            results = [list(direct.values())]
            # The gateways the verdicts compare run side by side, measured cell by cell in turn: on a shared
            # machine whose speed drifts over minutes, each ratio then compares neighbours in time.
            pair = (
                [Coordinator(engines, 1, "INFO", gw_core_sets[1], workdir, python=opts.python)] if 1 in workers else []
            )
            try:
                # One more Coordinator on another interpreter, or from another source tree.
                also = []
                if opts.python_also:
                    also.append((opts.python_also, ROOT, f"python {python_version(opts.python_also)}"))
                for tree in map(os.path.abspath, opts.tree_also):
                    also.append((opts.python, tree, f"tree {tree_label(tree)}"))
                for python, root, label in also:
                    pair.append(
                        Coordinator(
                            engines, 1, "INFO", gw_core_sets[1], workdir, root=root, python=python, python_label=label
                        )
                    )
                # Coordinators with more config sections, each labelled.
                variants: list[tuple[str, dict]] = []
                if opts.cluster:
                    redis = stack.enter_context(redis_server(load_cores))
                    cluster = {"cluster_config": {"redis_url": redis.url}}
                    cap = {"rate_limit_config": {"max_inflight_requests": 100_000}}
                    variants += [("cluster", cluster), ("cluster + cap", {**cluster, **cap})]
                variants += tenants
                for label, sections in variants:
                    pair.append(
                        Coordinator(engines, 1, "INFO", gw_core_sets[1], workdir, python_label=label, sections=sections)
                    )
                if not opts.no_floor:
                    pair.append(SanicFloor(engines, gw_core_sets[1], workdir, python=opts.python))
                if not opts.no_router and shutil.which("vllm-router"):
                    pair.append(VllmRouter(engines, gw_core_sets[1], workdir))
                    if any(c in MESSAGES_CELLS for c in cells):
                        print("  vllm-router 0.1.17 has no /v1/messages route: its Messages cells skipped", flush=True)
                elif not opts.no_router:
                    print("  vllm-router not installed (pip install vllm-router==0.1.17): not compared", flush=True)
                if opts.litellm:
                    pair.append(LiteLLM(engines, gw_core_sets[1], workdir, opts.litellm))
                rounds: dict[int, dict[str, list[Cell]]] = {id(gw): {} for gw in pair}
                for r in range(opts.rounds):
                    for cell in cells:
                        for gw in pair:
                            if cell in gw.cells:
                                # Concurrency-1 latency is measured in the first round only.
                                got = measure_gateway(
                                    gw, engines, opts, direct, load_cores, 1, workdir, r == 0, (cell,)
                                )
                                rounds[id(gw)].setdefault(cell, []).append(got[cell])
            finally:
                for gw in pair:
                    gw.stop()
            by_label = {gw.label: [median_round(cells) for cells in rounds[id(gw)].values()] for gw in pair}
            runs = [(w, "INFO", True) for w in workers if w != 1]
            if not opts.no_warning:
                runs.insert(0, (1, "WARNING", False))
            for w, level, latency in runs:
                cores = gw_core_sets[w]
                gw = Coordinator(engines, w, level, cores, workdir, python=opts.python)
                try:
                    n_cores = len(cores.split(",")) if cores else ncpu
                    by_label[gw.label] = list(
                        measure_gateway(
                            gw,
                            engines,
                            opts,
                            direct,
                            load_cores,
                            n_cores,
                            workdir,
                            latency and w == 1,
                            tuple(c for c in cells if c in gw.cells),
                        ).values()
                    )
                finally:
                    gw.stop()
            # Coordinator rows first (1 worker, WARNING, more workers), then the floor and vllm-router.
            results += [by_label[k] for k in sorted(by_label, key=lambda k: (not k.startswith("Coordinator"), k))]
            pythons = ", ".join(
                f"{label} {python_version(py)} ({py})"
                for label, py in (("python", opts.python), ("also", opts.python_also))
                if py
            )
            header = (
                f"# Gateway overhead, {time.strftime('%Y-%m-%d %H:%M')}, {ncpu} CPUs, load average "
                f"{os.getloadavg()[0]:.1f}; {pythons}; {layout}{f', nice {NICE}' if NICE else ''}; wrk -t{opts.threads} -c{opts.connections}, "
                f"{opts.duration:g} s per cell{f' (median of {opts.rounds} interleaved rounds)' if opts.rounds > 1 else ''}, "
                f"concurrency-1 cells {opts.latency:g} s; "
                f"total {time.monotonic() - t_start:.0f} s"
            )
            print()
            print(report(results, header))
            print(verdicts(results))
            if opts.json:
                with open(opts.json, "w") as f:
                    json.dump({"header": header, "cells": [asdict(c) for g in results for c in g]}, f, indent=1)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
