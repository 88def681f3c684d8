"""Every live key, in both workers: one row per key of `config.live.LIVE`, each changed in one running two-worker
Coordinator by rewriting its config file, and each seen to take effect over HTTP in both workers (each probe is
sent on fresh connections until the request log shows both workers served one). A key added to LIVE without a
row here fails the test. Cluster mode, whose rate refusals a replica words itself, is checked apart (one key, with
a real redis-server).

Each row's file is the base file with the row's change (the previous row's change undone in the same reload).
Where a key's effect cannot be told without a clock, the row looks at a lower bound (a retry's delay) or at what
the Coordinator says about the file (a key with one accepted value is refused otherwise, naming it).
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import json
import os
import re
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from config.live import LIVE
from config.sections import ApiKeyConfig, MgmtApiKeyConfig, RateLimitConfig
from harness.bodies import chat_body
from harness.configs import coordinator_config, instance
from harness.coordinator import Coordinator, logged_request_pids
from harness.loopback import wait_until
from harness.redis import RedisServer
from harness.tokenizer import tiny_tokenizer
from tests.test_faults import FloodEngine
from tests.test_reload import every_key

KEY, MGMT_KEY = "sk-live-1", "m-live-1"
LIVE_MODEL, FLAKY, PD, DOWN, SILENT, LATE, FLOOD, CONT = (
    "live",
    "flaky",
    "pd",
    "down",
    "silent",
    "late",
    "flood",
    "cont",
)
BIG = "x" * 12000  # a 12 KB prompt
_ids = itertools.count()


@dataclass
class Env:
    coord: Coordinator
    faulty: dict  # the simulators whose faults a row sets, by name
    tokenizer_dir: str

    def ask(self, model: str = LIVE_MODEL, key: str | None = None, timeout_s: float = 30, **body) -> httpx.Response:
        """A chat request on a fresh connection (the kernel picks the worker), with a request id of its own."""
        headers = {"X-Request-Id": f"live-{next(_ids)}"}
        if key:
            headers["Authorization"] = f"Bearer {key}"
        body.setdefault("max_tokens", 1)
        with httpx.Client(timeout=timeout_s) as c:
            return c.post(self.coord.url + "/v1/chat/completions", json=chat_body(model, **body), headers=headers)

    def line(self, r: httpx.Response) -> dict[str, str]:
        """The request log line of the request `r` answers."""
        rid = r.request.headers["X-Request-Id"]
        found: list[str] = []
        assert wait_until(
            lambda: found.extend(ln for ln in self.coord.output().splitlines() if f"request_id={rid} route=" in ln)
            or found,
            timeout_s=10,
        ), rid
        return {**dict(re.findall(r"(\w+)=(\S+)", found[0])), "pid": re.search(r"request\[(\d+)\]", found[0])[1]}

    def instances(self) -> list[dict]:
        return httpx.get(self.coord.mgmt + "/instances", timeout=10).json()["instances"]


@dataclass
class Row:
    change: dict  # {section: {config key: value}}, merged into the base file's sections
    probe: Callable[[Env], bool]  # one request's worth: does it show the new value?
    faults: dict = field(default_factory=dict)  # the faults of the engines `on` while the row is probed
    on: tuple[str, ...] = ("flaky",)
    refused: str = ""  # the key a refused file names: the row's effect is the refusal
    logged: bool = True  # its probes are inference requests, whose log lines name the worker


def status(code: int, model: str = LIVE_MODEL, **body) -> Callable[[Env], bool]:
    def probe(env: Env) -> bool:
        r = env.ask(model, **body)
        return r.status_code == code

    return probe


def limited(code: int = 429, text: str = "") -> Callable[[Env], bool]:
    """Refused by the rate limit once the bucket's few first tokens (shared by the workers) are taken."""

    def probe(env: Env) -> bool:
        for _ in range(5):
            r = env.ask()
            if r.status_code != 200:
                return r.status_code == code and text in r.text
        return False

    return probe


def retries(n: int) -> Callable[[Env], bool]:
    return lambda env: env.line(env.ask(FLAKY))["retries"] == str(n)


def within(ms: float, model: str = FLAKY, **body) -> Callable[[Env], bool]:
    """A request that fails within `ms` (an error answer, not the client's own timeout)."""

    def probe(env: Env) -> bool:
        try:
            r = env.ask(model, timeout_s=ms / 1000, **body)
        except httpx.TimeoutException:
            return False
        return r.status_code >= 500 or "error" in r.text

    return probe


def stream_says(text: str, model: str = FLAKY, **body) -> Callable[[Env], bool]:
    """A stream that says `text` (read until it does, or it ends)."""

    def probe(env: Env) -> bool:
        seen = ""
        with httpx.Client(timeout=20) as c:
            url = env.coord.url + "/v1/chat/completions"
            with c.stream("POST", url, json=chat_body(model, stream=True, **body)) as r:
                try:
                    for chunk in r.iter_text():
                        seen += chunk
                        if text in seen:
                            return True
                except httpx.TimeoutException:
                    return False
        return False

    return probe


def retry_after(seconds: int) -> Callable[[Env], bool]:
    def probe(env: Env) -> bool:
        r = env.ask(DOWN)
        return r.status_code == 503 and r.headers.get("Retry-After") == str(seconds)

    return probe


def slo_ttft(ms: int) -> Callable[[Env], bool]:
    def probe(env: Env) -> bool:
        models = httpx.get(env.coord.url + "/v1/models", timeout=10).json()["data"]
        # The model's tokenizer counts the prompt (a few hundred tokens for 400 bytes of an unseen letter),
        # where the estimate says a quarter of its bytes: what the request line reports of a stream without usage.
        counted = int(env.line(env.ask(stream=True, content="q" * 400))["prompt_tokens"])
        return {m["id"]: m["slo_ttft"] for m in models}[LIVE_MODEL] == ms and counted > 300

    return probe


def breaker_opens(env: Env) -> bool:
    env.ask(FLAKY)  # fails (500): one failure opens the breaker
    return any(e["breaker"] == "open" for i in env.instances() if i["model_name"] == FLAKY for e in i["endpoints"])


def scraped(env: Env) -> bool:
    """Minimal: the engines' scraped load is still reported. (A shorter interval is seen only after the wait in
    progress ends, so a longer one in the base file would make this row slow; the interval is read live each
    time, serving/background.py.)"""
    return all("engine_running" in e["load"] for i in env.instances() for e in i["endpoints"])


def slow_reader_cut(env: Env) -> bool:
    """A stream whose client reads nothing (a small receive buffer) is cut once the bytes waiting for it pass the
    new bound, which the warning names; the request line says which worker cut it."""
    rid = f"live-{next(_ids)}"
    body = json.dumps(chat_body(FLOOD, stream=True)).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"X-Request-Id: {rid}\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect((env.coord.host, env.coord.infer_port))
        sock.sendall(head + body)
        said = f"request_id={rid}: the client's stream is cut: it reads slower than the engine writes"
        cut = wait_until(lambda: said in env.coord.output(), timeout_s=20)
    return cut and "over max_stream_buffer_size (16384)" in env.coord.output().split(said, 1)[1].split("\n", 1)[0]


def total_cut(env: Env) -> bool:
    """A stream that outlasts the new total is cut (the client's connection dropped); the warning says why."""
    rid = f"live-{next(_ids)}"
    url, body = env.coord.url + "/v1/chat/completions", chat_body(LATE, stream=True, max_tokens=2000, ignore_eos=True)
    try:
        with httpx.Client(timeout=30) as c, c.stream("POST", url, json=body, headers={"X-Request-Id": rid}) as r:
            r.read()
    except httpx.HTTPError:
        pass
    said = f"request_id={rid}: the client's stream is cut: its stream ran past stream_total_timeout (0.3 s)"
    return wait_until(lambda: said in env.coord.output(), timeout_s=10)


def down_late(env: Env) -> bool:
    """LATE's engine answers its health checks late: after one, it is taken out (503)."""
    return wait_until(lambda: env.ask(LATE).status_code == 503, timeout_s=10)


def debug_logged(env: Env) -> bool:
    """The worker that served the request said at DEBUG that the model's chat template refused the prompt."""
    mark = len(env.coord.output())
    pid = env.line(env.ask())["pid"]
    return wait_until(lambda: f"DEBUG coordinator.tokens[{pid}]: chat template failed" in env.coord.output()[mark:], 5)


def continued(env: Env) -> bool:
    """A stream whose engine drops it goes on on the model's other engine (which drops it too, later)."""
    return int(env.line(env.ask(CONT, stream=True, max_tokens=40))["continuations"]) >= 1


def short_error_body(env: Env) -> bool:
    r = env.ask(FLAKY)
    return r.status_code == 400 and len(r.content) < 2000


def pd_refused(env: Env) -> bool:
    r = env.ask(PD)
    return r.status_code == 503 and "enable_pd_separation_fallback_to_hybrid" in r.text


def mgmt_refused(env: Env) -> bool:
    return httpx.get(env.coord.mgmt + "/instances", timeout=10).status_code == 401


def slow_retry(env: Env) -> bool:
    return float(env.line(env.ask(FLAKY))["duration_ms"]) >= 2000  # a lower bound: the retry waited its delay


def bucket(max_requests: int, window_s: float, per_s: float) -> dict:
    return {
        "enable_rate_limit": True,
        "max_requests": max_requests,
        "window_size": window_s,
        "requests_per_second": per_s,
    }


FAIL_500 = {"fail_status": 500, "fail_first_n": 10**6}
SLOW_FIRST = {"slow_first_byte_s": 30}
STALL = {"stall_mid_stream_after_n": 2}
DROP = ({"close_mid_stream_after_n": 3}, ("c1", "c2"))  # both of CONT's engines drop a stream after 3 events
ROWS: dict[str, Row] = {
    "api_key": Row({"api_key_config": {"enable_api_key": True, "valid_keys": [KEY]}}, status(401)),
    "tenants": Row({"tenant_config": {"default": {"rpm": 1}}}, limited()),  # keys off: every request is `default`
    "mgmt_api_key": Row(
        {"mgmt_api_key_config": {"enable_api_key": True, "valid_keys": [MGMT_KEY]}}, mgmt_refused, logged=False
    ),
    "models": Row({"models": {"slo_ttft": 700, "tokenizer_path": "TOKENIZER"}}, slo_ttft(700)),
    "log_level": Row({"log_config": {"log_level": "DEBUG"}, "models": {"tokenizer_path": "RAISING"}}, debug_logged),
    "max_request_body_bytes": Row({"rate_limit_config": {"max_request_body_size": 8192}}, status(413, content=BIG)),
    "max_inflight_requests": Row({"rate_limit_config": {"max_inflight_requests": 1}}, status(429)),
    # The bucket's keys change together: a file that writes requests_per_second and enable_rate_limit must make
    # them agree (config.pymotor), and a reload may not leave out one the running file writes.
    "requests_per_second": Row({"rate_limit_config": bucket(3, 3000, 0.001)}, limited()),
    "enable_rate_limit": Row({"rate_limit_config": bucket(1, 1000, 0.001)}, limited()),
    "max_requests": Row({"rate_limit_config": bucket(2, 2000, 0.001)}, limited()),
    "window_size_s": Row({"rate_limit_config": bucket(1, 10_000, 0.0001)}, limited()),
    "error_message": Row(
        {"rate_limit_config": {**bucket(1, 1000, 0.001), "error_message": "slow down, live"}},
        limited(text="slow down, live"),
    ),
    "error_status_code": Row({"rate_limit_config": {**bucket(1, 1000, 0.001), "error_status_code": 503}}, limited(503)),
    "provider": Row({"rate_limit_config": {"provider": "olc"}}, None, refused="rate_limit_config.provider"),
    "scope": Row({"rate_limit_config": {"scope": "local"}}, None, refused="rate_limit_config.scope"),
    "skip_paths": Row(
        {"rate_limit_config": {"skip_paths": ["/v1/chat/completions"]}}, None, refused="rate_limit_config.skip_paths"
    ),
    "max_retry": Row({"exception_config": {"max_retry": 2}}, retries(2), FAIL_500),
    "transport_max_retry": Row({"exception_config": {"transport_max_retry": 1}}, retries(1), FAIL_500),
    "retry_delay_s": Row({"exception_config": {"max_retry": 1, "retry_delay": 2}}, slow_retry, FAIL_500),
    "first_token_timeout_s": Row(
        {"exception_config": {"first_token_timeout": 0.3}}, within(3000, stream=True), SLOW_FIRST
    ),
    "infer_timeout_s": Row({"exception_config": {"infer_timeout": 0.3}}, within(3000), SLOW_FIRST),
    "connect_timeout_s": Row({"exception_config": {"connect_timeout": 0.3}}, within(3000, SILENT)),
    "stream_idle_timeout_s": Row(
        {"exception_config": {"stream_idle_timeout": 0.3}},
        stream_says("idle", max_tokens=40),
        STALL,
    ),
    "stream_keepalive_interval_s": Row(
        {"exception_config": {"stream_keepalive_interval": 0.1}}, stream_says(": keep-alive", max_tokens=40), STALL
    ),
    "max_stream_buffer_bytes": Row({"exception_config": {"max_stream_buffer_size": 16384}}, slow_reader_cut),
    "stream_total_timeout_s": Row({"exception_config": {"stream_total_timeout": 0.3}}, total_cut),
    "reschedule": Row(
        {"exception_config": {"reschedule_config": {"enable": True}, "recompute_enabled": None}}, continued, *DROP
    ),
    "upstream_error_body_max_bytes": Row(
        {"exception_config": {"upstream_error_body_max_bytes": 300}},
        short_error_body,
        {"fail_status": 400, "fail_first_n": 10**6, "fail_body": "y" * 100_000},
    ),
    # Not next to `reschedule`: the same value twice in a row changes nothing, and nothing is reloaded.
    "recompute_enabled": Row({"exception_config": {"recompute_enabled": True}}, continued, *DROP),
    "health_check_interval_s": Row({"scheduler_config": {"health_check_interval": 7}}, retry_after(7)),
    "health_check_timeout_failures": Row({"scheduler_config": {"health_check_timeout_failures": 1}}, down_late),
    "metrics_scrape_interval_s": Row({"scheduler_config": {"metrics_scrape_interval": 0.3}}, scraped, logged=False),
    "breaker_failure_threshold": Row({"scheduler_config": {"breaker_failure_threshold": 1}}, breaker_opens, FAIL_500),
    "breaker_open_s": Row({"scheduler_config": {"breaker_open_time": 9}}, retry_after(9)),
    "breaker_max_open_s": Row(
        {"scheduler_config": {"breaker_failure_threshold": 1, "breaker_max_open_time": 60}}, breaker_opens, FAIL_500
    ),
    "enable_pd_separation_fallback_to_hybrid": Row(
        {"scheduler_config": {"enable_pd_separation_fallback_to_hybrid": False}}, pd_refused
    ),
}


def base_file(engines: dict[str, str], silent: str) -> dict:
    """The file every row changes: every key of the guarded sections written (a reload may not leave one out)."""
    models = [
        {"id": m, "slo_ttft": 1000, "slo_tpot": 50} for m in (LIVE_MODEL, FLAKY, PD, DOWN, SILENT, LATE, FLOOD, CONT)
    ]
    return {
        "motor_coordinator_config": coordinator_config(
            [
                instance(1, "union", LIVE_MODEL, engines["live"]),
                instance(2, "union", FLAKY, engines["flaky"]),
                instance(3, "prefill", PD, engines["p"]),
                instance(4, "decode", PD, engines["d"]),
                instance(5, "union", DOWN, engines["down"]),
                instance(6, "union", SILENT, f"https://{silent}"),
                instance(7, "union", LATE, engines["late"]),
                instance(8, "union", FLOOD, engines["flood"]),
                instance(9, "union", CONT, engines["c1"]),
                instance(10, "union", CONT, engines["c2"]),
            ],
            models=models,
            inference_workers_config={"num_workers": 2},
            api_key_config=every_key(ApiKeyConfig, enable_api_key=False),
            mgmt_api_key_config=every_key(MgmtApiKeyConfig, enable_api_key=False),
            rate_limit_config=every_key(RateLimitConfig),
            tenant_config={"tenants": [], "default": {"rpm": 0}},
            scheduler_config={
                "scheduler_type": "round_robin",
                "health_check_interval": 0.5,
                "health_check_timeout_failures": 10**6,
                "breaker_failure_threshold": 10**6,
                "breaker_open_time": 1,
                "breaker_max_open_time": 0,
                "enable_pd_separation_fallback_to_hybrid": True,
            },
            exception_config={"max_retry": 0, "retry_delay": 0, "recompute_enabled": False},
        )
    }


def with_change(base: dict, change: dict, tokenizer_dir: str) -> dict:
    whole = copy.deepcopy(base)
    cfg = whole["motor_coordinator_config"]
    for section, values in change.items():
        if section == "models":  # the live model's entry
            entry = next(m for m in cfg["models"] if m["id"] == LIVE_MODEL)
            paths = {"TOKENIZER": tokenizer_dir, "RAISING": os.path.join(tokenizer_dir, "raising")}
            entry.update({k: paths.get(v, v) for k, v in values.items()})
            continue
        target = cfg.setdefault(section, {})
        for k, v in values.items():
            if v is None:
                target.pop(k, None)
            else:
                target[k] = v
    return whole


def in_both_workers(env: Env, key: str, probe: Callable[[Env], bool], logged: bool) -> None:
    """`probe` holds on fresh connections until the request log shows both workers served one of them (`logged`:
    the management port logs no request line, so its probe holds on 20 fresh connections instead)."""
    mark = len(env.coord.output())
    for n in range(1, 101):
        assert probe(env), f"{key}: not in effect (probe {n})"
        if (n >= 2 and len(logged_request_pids(env.coord, mark)) == 2) or (not logged and n == 20):
            return
    raise AssertionError(f"{key}: the probes never reached both workers")


@contextlib.contextmanager
def shut_down(server: FloodEngine):
    try:
        yield server
    finally:
        server.shutdown()


def save(path: str, whole: dict) -> None:
    with open(path + ".new", "w") as f:
        json.dump(whole, f)
    os.replace(path + ".new", path)


def test_the_table_has_a_row_for_every_live_key():
    assert set(ROWS) == LIVE, f"missing rows: {sorted(LIVE - set(ROWS))}; stale rows: {sorted(set(ROWS) - LIVE)}"


def test_every_live_key_takes_effect_in_both_workers(sims, tmp_path):
    assert set(ROWS) == LIVE
    tiny_tokenizer(str(tmp_path))
    os.mkdir(tmp_path / "raising")  # a model whose chat template refuses every prompt (said at DEBUG)
    tiny_tokenizer(str(tmp_path / "raising"))
    with open(tmp_path / "raising" / "tokenizer_config.json", "w") as f:
        json.dump({"chat_template": "{{ raise_exception('no') }}"}, f)
    engines = {
        "live": sims("union", model=LIVE_MODEL),
        "flaky": sims("union", model=FLAKY),
        "p": sims("prefill", model=PD, faults={"health_status": 500}),  # no usable pair: whole on D, or refused
        "d": sims("decode", model=PD),
        "down": sims("union", model=DOWN, faults={"health_status": 500}),
        "late": sims("union", model=LATE, speedup=1.0, faults={"slow_health_s": 3}),
        "c1": sims("union", model=CONT),
        "c2": sims("union", model=CONT),
    }
    flood = FloodEngine()  # streams without end: what waits for a client that reads nothing grows
    engines_at = {k: h.address for k, h in engines.items()} | {"flood": f"127.0.0.1:{flood.server_address[1]}"}
    silent = socket.create_server(("127.0.0.1", 0), backlog=64)  # takes connections, never answers a TLS hello
    base = base_file(engines_at, f"127.0.0.1:{silent.getsockname()[1]}")
    with silent, shut_down(flood), Coordinator(base, wrap=False) as coord:
        env = Env(coord, {k: engines[k] for k in ("flaky", "c1", "c2")}, str(tmp_path))
        assert env.ask().status_code == 200 and env.ask(PD).status_code == 200
        reloads = refusals = 0
        for key, row in ROWS.items():
            whole = with_change(base, row.change, env.tokenizer_dir)
            save(coord.config_path, whole)
            if row.refused:
                refusals += 1
                said = refusals
                assert wait_until(lambda n=said: coord.output().count("not reloaded, nothing changed") == n, 10), key
                (line,) = [ln for ln in coord.output().splitlines() if "not reloaded" in ln][-1:]
                assert f"motor_coordinator_config.{row.refused}" in line, line
                continue
            reloads += 2
            done = reloads
            assert wait_until(lambda n=done: coord.output().count("reloaded in worker") == n, 10), (
                key,
                coord.output()[-3000:],
            )
            for name, sim in env.faulty.items():
                sim.clear_faults()
                if row.faults and name in row.on:
                    sim.set_faults(**row.faults)
            held = None
            if key == "max_inflight_requests":
                held = Held(env)
            try:
                in_both_workers(env, key, row.probe, row.logged)
            except AssertionError as e:
                raise AssertionError(f"{e} (held stream: {held and held.status})") from None
            finally:
                if held is not None:
                    held.end()
            print(f"{key}: in effect in both workers")


class Held:
    """A long stream on LATE's engine, held open while a row is probed."""

    def __init__(self, env: Env):
        self.stop, self.started, self.status = threading.Event(), threading.Event(), None
        self.thread = threading.Thread(target=self._run, args=(env,), daemon=True)
        self.thread.start()
        assert wait_until(lambda: self.started.is_set(), timeout_s=10)

    def _run(self, env: Env) -> None:
        url, body = (
            env.coord.url + "/v1/chat/completions",
            chat_body(LATE, stream=True, max_tokens=3000, ignore_eos=True),
        )
        with httpx.Client(timeout=60) as c, c.stream("POST", url, json=body) as r:
            self.status = r.status_code
            for _ in r.iter_raw():
                self.started.set()
                if self.stop.is_set():
                    return
            self.status = "ended"

    def end(self) -> None:
        self.stop.set()
        self.thread.join(30)


def test_cluster_mode_refusals_follow_a_reload_in_both_workers(sims):
    """In cluster mode the rate check is the cluster store's, and its refusal is worded by the replica's side
    (serving/cluster.py): a reload's message and status reach it in both workers."""
    server = RedisServer()
    try:
        u = sims("union", model=LIVE_MODEL)
        limits = {**bucket(1, 1000, 0.001), "error_message": "first words"}
        whole = {
            "motor_coordinator_config": coordinator_config(
                [instance(1, "union", LIVE_MODEL, u.address)],
                inference_workers_config={"num_workers": 2},
                rate_limit_config=limits,
                cluster_config={"redis_url": server.url, "key_prefix": "live:"},
            )
        }
        with Coordinator(whole, wrap=False) as coord:
            env = Env(coord, {}, "")
            in_both_workers(env, "error_message", limited(429, "first words"), logged=True)
            whole["motor_coordinator_config"]["rate_limit_config"] |= {
                "error_message": "new words",
                "error_status_code": 503,
            }
            save(coord.config_path, whole)
            assert wait_until(lambda: coord.output().count("reloaded in worker") == 2, timeout_s=10)
            in_both_workers(env, "error_message", limited(503, "new words"), logged=True)
    finally:
        server.stop()
