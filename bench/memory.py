"""Long prompts' memory: how much a gateway worker grows while it serves 32 requests of 1 MiB at once.

    python bench/memory.py                      # 1024 KiB, 32 connections, chat / PD chat / PD chat streamed
    python bench/memory.py --kib 256 --connections 64 --cells chat,messages --duration 8
    python bench/memory.py --tree-also /tmp/prev --no-router   # beside an earlier commit's worktree

For each gateway (the Coordinator with 1 worker, and vllm-router 0.1.17 when installed) and each cell, a fresh
gateway process (peak RSS is a process's high-water mark) is warmed with tiny requests, its idle RSS read, then
held at `--connections` requests in flight (wrk, each body padded to `--kib` as bench/overhead.py's
`--prompt-kib` pads it) against bench/fastfake.c's engines. The table gives the idle RSS, the peak (VmHWM), and
the growth as a multiple of the bytes in flight (connections x body bytes): the issue's figure is at most 3x.
The gateway runs on core 0, the fakes and wrk on core 1.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from bench import overhead  # noqa: E402

CELLS = ("chat", "pd_chat", "pd_chat_stream")
GW_CORES, LOAD_CORES = "0", "1"


def rss_mb(pids: list[int], key: str) -> float:
    total = 0.0
    for pid in pids:
        with open(f"/proc/{pid}/status") as f:
            total += next(int(line.split()[1]) for line in f if line.startswith(key)) / 1024
    return total


def measure(gw: overhead.Gateway, cell: str, kib: int, connections: int, seconds: float, workdir: str) -> dict:
    port = gw.port(cell)
    overhead.PAD["text"] = ""
    tiny = gw.body(cell)
    overhead.PAD["text"] = overhead.padding(kib)
    data = gw.body(cell)
    route = {"url_path": overhead.cell_path(cell), "headers": overhead.cell_headers(cell)}
    overhead.run_wrk(port, [tiny], 1, 4, 1, LOAD_CORES, workdir, **route)  # warm: every code path run once
    pids = gw.worker_pids()
    idle = rss_mb(pids, "VmRSS:")
    res = overhead.run_wrk(port, [data], seconds, connections, 2, LOAD_CORES, workdir, **route)
    peak = rss_mb(pids, "VmHWM:")
    in_flight_mb = connections * len(data.encode()) / 2**20
    return {
        "idle_mb": idle,
        "peak_mb": peak,
        "growth_x": (peak - idle) / in_flight_mb,
        "requests": res["requests"],
        "errors": sum(overhead.wrk_errors(res).values()),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kib", type=int, default=1024, help="each request's prompt size (default 1024)")
    ap.add_argument("--connections", type=int, default=32, help="requests in flight (default 32)")
    ap.add_argument("--duration", type=float, default=5, help="seconds of load per cell (default 5)")
    ap.add_argument("--cells", default=",".join(CELLS))
    ap.add_argument("--no-router", action="store_true", help="skip vllm-router even when installed")
    ap.add_argument(
        "--tree-also", metavar="DIR", help="one more Coordinator from this source tree (a `git worktree` of a commit)"
    )
    opts = ap.parse_args(argv)
    cells = [c for c in opts.cells.split(",") if c]
    workdir = tempfile.mkdtemp(prefix="motor-memory-")
    exe = overhead.build_fake(workdir)
    gateways = [("coordinator", lambda e: overhead.Coordinator(e, 1, "INFO", GW_CORES, workdir))]
    if opts.tree_also:
        label = f"coordinator {overhead.tree_label(opts.tree_also)}"
        tree = opts.tree_also
        gateways.append((label, lambda e: overhead.Coordinator(e, 1, "INFO", GW_CORES, workdir, root=tree)))
    if not opts.no_router and shutil.which("vllm-router"):
        gateways.append(("vllm-router", lambda e: overhead.VllmRouter(e, GW_CORES, workdir)))
    print(f"{opts.connections} requests of {opts.kib} KiB in flight, {opts.duration:.0f} s per cell\n")
    print("| gateway | cell | idle RSS MB | peak RSS MB | growth / bytes in flight | requests | errors |")
    print("|---|---|---:|---:|---:|---:|---:|")
    with overhead.fakes(exe, LOAD_CORES, workdir) as engines:
        for name, start in gateways:
            for cell in cells:
                gw = start(engines)
                try:
                    if cell not in gw.cells:
                        continue
                    r = measure(gw, cell, opts.kib, opts.connections, opts.duration, workdir)
                finally:
                    gw.stop()
                print(
                    f"| {name} | {cell} | {r['idle_mb']:.0f} | {r['peak_mb']:.0f} | {r['growth_x']:.2f}x "
                    f"| {r['requests']} | {r['errors']} |",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
