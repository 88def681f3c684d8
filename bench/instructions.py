"""Instructions per request: what the Coordinator's worker executes per request, counted by callgrind.

    python bench/instructions.py                          # the four cells of bench/overhead.py, this tree
    python bench/instructions.py --tree /tmp/base         # the same, then another checkout, side by side
    python bench/instructions.py --cells chat --seconds 5
    python bench/instructions.py --status-poll            # each cell without, then with a browser on the status page
    python bench/instructions.py --tenants --tree /tmp/base  # each tree with keys, then with tenant quotas not reached
    python bench/instructions.py --keep /tmp/cg           # each cell's callgrind dumps kept, for callgrind_annotate

CPU time per request on a shared machine moves by 10-30 % between runs (bench/overhead.py's figures);
instruction counts do not. Each tree's Coordinator (1 worker, log INFO, the configuration bench/overhead.py
uses, on the same fake engines) runs under `valgrind --tool=callgrind` with instrumentation off; for each
cell, after a warm-up, the worker is counted (`callgrind_control -i on`) while wrk sends requests over one
connection for `--seconds`, then its counters are dumped; the requests are those wrk completed, and a
cell with any wrk error or non-2xx answer stops the run. The count includes the worker's background work
meanwhile (health checks and metrics scrapes of the three fakes, once a second: well under 1 % at the
60-odd requests a second valgrind allows; on a loaded machine, where fewer requests share them, compare
trees with `--no-background`, which leaves out what the worker does without requests). One connection keeps
the count free of batching: with many connections a slower server handles more requests per event-loop
pass, and each pass's fixed work is shared by more of them. What timers do (the request log's and metrics'
50 ms flushes) is shared by the requests of 50 ms, so it weighs more here than at full load: trees compared
should run at about the same rate (on a loaded machine, one run each at the same time). Repeated runs agree
within about 1-2 %.

With `--status-poll` the status page's document is first asked for back to back (`GET /status.json` on one
connection, as a browser's polls come), which gives one poll's instructions; then each cell is counted twice in
turn, without and then with a browser showing the page (overhead.StatusPoller: a poll every second). A poll a
second costs each request one poll's instructions over the requests served in that second: the table gives that
share at each cell's rate here, and the count with the poller running beside it.

With `--tenants` each tree runs twice, as bench/overhead.py --tenants runs it: every request with an API key, once
in `valid_keys` and once a `tenant_config` tenant's with quotas never reached.

Under callgrind the Coordinator runs some 50 times slower: a tree takes about 2.5 minutes. Needs valgrind
(with callgrind_control), wrk and gcc. Compare trees with a git worktree: `git worktree add /tmp/base HEAD~3`.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import TypeVar

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from bench import overhead  # noqa: E402

START_TIMEOUT_S = 600  # Python's imports under valgrind
POLLED = "+status"  # a cell counted while a browser polls the status page
POLL = "status.json"  # the polls alone
T = TypeVar("T")
# Runs app.py (the argument after the interpreter's) with Sanic's wait for its workers' first ack raised from 30 s to
# START_TIMEOUT_S: under callgrind on a loaded machine a worker takes longer to start, and Sanic then kills the whole
# process group.
STARTER = (
    "import os, runpy, sys; from sanic.worker.manager import WorkerManager; "
    f"WorkerManager.THRESHOLD = {START_TIMEOUT_S * 10}; "
    "sys.argv = sys.argv[2:]; sys.path.insert(0, os.path.dirname(sys.argv[0])); "
    "runpy.run_path(sys.argv[0], run_name='__main__')"
)


def count(out_dir: str, pid: int, keep: str = "") -> int:
    """The instructions in the worker's dumps since the last call (the dump files are removed, or moved to `keep`
    + a number, for callgrind_annotate)."""
    total = 0
    for n, path in enumerate(sorted(glob.glob(os.path.join(out_dir, f"callgrind.{pid}.*")))):
        with open(path) as f:
            for line in f:
                if line.startswith("totals:"):
                    total += int(line.split()[1])
        if keep:
            shutil.move(path, f"{keep}.{n}")
        else:
            os.unlink(path)
    return total


def _counted(
    worker: str, out_dir: str, idle_per_s: float, run: Callable[[], T], keep: str = ""
) -> tuple[T, float, float]:
    """`run()` with the worker counted: its result, the worker's instructions meanwhile less `idle_per_s` for each
    second counted, and those seconds (the dumps kept at `keep`, if given)."""
    subprocess.run(["callgrind_control", "-i", "on", worker], check=True, capture_output=True)
    started = time.monotonic()
    result = run()
    subprocess.run(["callgrind_control", "-d", worker], check=True, capture_output=True)
    subprocess.run(["callgrind_control", "-i", "off", worker], check=True, capture_output=True)
    seconds = time.monotonic() - started
    time.sleep(0.5)  # the dump is written by the worker
    return result, count(out_dir, int(worker), keep) - idle_per_s * seconds, seconds


# `--no-background`: what the worker does without requests (health checks, scrapes, the heartbeat, the event loop's
# own timers) is left out of the counts. Its cost per request is its cost per second over the requests a second,
# which on a loaded machine changes from run to run: it is counted for IDLE_S seconds without requests, and its
# rate taken off each cell's count for the cell's seconds.
IDLE_S = 8.0


def measure_tree(
    root: str,
    engines: overhead.Engines,
    cells: list[str],
    seconds: float,
    workdir: str,
    no_background: bool = False,
    status_poll: bool = False,
    sections: dict | None = None,
    label: str = "",
    keep: str = "",
) -> dict[str, dict]:
    """Per cell its requests and instructions; with `status_poll` also per `cell + POLLED`, a browser polling.
    `sections`: more config sections (`label` names them); `keep`: a directory where each cell's dumps are kept."""
    out_dir = tempfile.mkdtemp(prefix="callgrind-", dir=workdir)
    launcher = (
        "valgrind",
        "--tool=callgrind",
        "--trace-children=yes",
        "--instr-atstart=no",
        f"--callgrind-out-file={out_dir}/callgrind.%p",
        sys.executable,
        "-c",
        STARTER,
    )
    gw = overhead.Coordinator(
        engines,
        1,
        "INFO",
        None,
        workdir,
        root=root,
        launcher=launcher,
        start_timeout_s=START_TIMEOUT_S,
        python_label=label,
        sections=sections,
    )
    results = {}
    try:
        worker = str(gw.worker_pids()[0])
        idle_per_s = 0.0
        if no_background:
            _, idle, idle_s = _counted(worker, out_dir, 0.0, lambda: time.sleep(IDLE_S))
            idle_per_s = idle / idle_s
            print(f"  {root} idle: {idle_per_s / 1000:.1f} k instructions a second, left out", flush=True)
        if status_poll:  # what one poll of the page costs the worker, counted over many
            results[POLL] = count_polls(gw, root, seconds, out_dir, worker, idle_per_s)
            print(f"  {root} {POLL}: {results[POLL]['per_request'] / 1000:.1f} k instructions each", flush=True)
        for cell in cells:
            for polled in (False, True) if status_poll else (False,):
                with overhead.StatusPoller(gw.obs_port) if polled else contextlib.nullcontext() as poller:
                    name = cell + POLLED if polled else cell
                    kept = os.path.join(keep, slug(f"{root}-{label}-{name}")) if keep else ""
                    results[name] = count_cell(gw, root, cell, seconds, workdir, out_dir, worker, idle_per_s, kept)
                if poller is not None:
                    results[name]["polls"] = poller.polls
                print(
                    f"  {root} {name}: {results[name]['requests']:.0f} requests, "
                    f"{results[name]['per_request'] / 1000:.1f} k instructions each",
                    flush=True,
                )
    finally:
        gw.stop()
    return results


def slug(text: str) -> str:
    """`text` as a file name: its letters and digits, every other run of characters one `-`."""
    return "-".join("".join(ch if ch.isalnum() else " " for ch in text).split())


def wrk_failures(stdout: str) -> list[str]:
    """The lines of wrk's summary that count socket errors or error answers (wrk prints them only when not 0)."""
    return [line.strip() for line in stdout.splitlines() if "Socket errors:" in line or "Non-2xx" in line]


def count_polls(
    gw: overhead.Coordinator, root: str, seconds: float, out_dir: str, worker: str, idle_per_s: float
) -> dict:
    """GET /status.json back to back on one connection, as a browser's polls come: instructions per poll."""
    url = f"http://127.0.0.1:{gw.obs_port}/status.json"

    def wrk(duration: str) -> str:
        out = subprocess.run(["wrk", "-t1", "-c1", f"-d{duration}", url], check=True, capture_output=True, text=True)
        failures = wrk_failures(out.stdout)
        if failures:
            raise RuntimeError(f"{root} {POLL}: wrk saw errors: {'; '.join(failures)}")
        return out.stdout

    wrk("2s")  # warm-up
    stdout, instructions, _ = _counted(worker, out_dir, idle_per_s, lambda: wrk(f"{seconds:g}s"))
    polls = int(next(line for line in stdout.splitlines() if "requests in" in line).split()[0])
    return {"requests": polls, "instructions": instructions, "per_request": instructions / max(polls, 1)}


def count_cell(
    gw: overhead.Coordinator,
    root: str,
    cell: str,
    seconds: float,
    workdir: str,
    out_dir: str,
    worker: str,
    idle_per_s: float,
    keep: str = "",
) -> dict:
    """One cell's requests and the worker's instructions for them (less its idle rate, `idle_per_s`, if counted; its
    dumps kept at `keep`, if given)."""
    data = gw.body(cell)
    wrk_to = (overhead.cell_path(cell), overhead.cell_headers(cell))  # its route, and the key with --tenants
    overhead.run_wrk(gw.infer_port, [data], 3, 1, 1, None, workdir, *wrk_to)  # warm-up, not counted
    res, instructions, _ = _counted(
        worker,
        out_dir,
        idle_per_s,
        lambda: overhead.run_wrk(gw.infer_port, [data], seconds, 1, 1, None, workdir, *wrk_to),
        keep,
    )
    errors = overhead.wrk_errors(res)
    if any(errors.values()):
        raise RuntimeError(f"{root} {cell}: wrk saw errors {errors}")
    requests = res["requests"]
    return {"requests": requests, "instructions": instructions, "per_request": instructions / max(requests, 1)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tree", action="append", default=[], help="another source tree to count after this one")
    ap.add_argument("--cells", default=",".join(overhead.CELLS), help="comma-separated cells (default: all four)")
    ap.add_argument("--seconds", type=float, default=8, help="counted seconds per cell (default 8)")
    ap.add_argument(
        "--no-background",
        action="store_true",
        help="leave out what the worker does without requests (a loaded machine)",
    )
    ap.add_argument(
        "--status-poll", action="store_true", help="count each cell again with a browser polling the status page"
    )
    ap.add_argument(
        "--tenants",
        action="store_true",
        help="count each tree with keys (no tenant_config), then with a tenant_config whose quotas are not reached",
    )
    ap.add_argument(
        "--keep",
        default="",
        help="a directory to keep each cell's callgrind dumps in (for callgrind_annotate --inclusive=yes)",
    )
    opts = ap.parse_args(argv)
    cells = [c for c in opts.cells.split(",") if c]
    unknown = set(cells) - set(overhead.CELLS)
    if unknown:
        ap.error(f"unknown cells: {', '.join(sorted(unknown))}")
    missing = [t for t in ("valgrind", "callgrind_control", "wrk", "gcc") if not shutil.which(t)]
    if missing:
        print(f"missing: {', '.join(missing)}. Install with: apt-get install -y valgrind wrk gcc", file=sys.stderr)
        return 2
    roots = [overhead.ROOT] + [os.path.abspath(t) for t in opts.tree]
    variants: list[tuple[str, dict | None]] = [("", None)]
    if opts.tenants:  # (bench/overhead.py --tenants' Coordinators; every request presents the tenant's key)
        overhead.KEY_HEADERS["Authorization"] = f"Bearer {overhead.BENCH_KEY}"
        variants = list(overhead.tenant_variants())
    # A variant's trees one after the other, so that they are counted as close together as can be.
    runs = [(label, sections, root) for label, sections in variants for root in roots]
    trees = [f"{root} ({label})" if label else root for label, _, root in runs]
    if opts.keep:
        os.makedirs(opts.keep, exist_ok=True)
    workdir = tempfile.mkdtemp(prefix="motor-instructions-")
    try:
        with overhead.fakes(overhead.build_fake(workdir), None, workdir) as engines:
            results = [
                measure_tree(
                    root,
                    engines,
                    cells,
                    opts.seconds,
                    workdir,
                    opts.no_background,
                    opts.status_poll,
                    sections,
                    label,
                    opts.keep,
                )
                for label, sections, root in runs
            ]
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print()
    print(
        "| cell | "
        + " | ".join(f"k instructions/request: {t}" for t in trees)
        + " | first / second" * len(variants) * (len(roots) > 1)
        + " |"
    )
    print("|---" * (len(trees) + 1 + len(variants) * (len(roots) > 1)) + "|")
    for cell in cells:
        per = [r[cell]["per_request"] for r in results]
        pairs = [per[i : i + len(roots)] for i in range(0, len(per), len(roots))] if len(roots) > 1 else []
        ratios = "".join(f" | {p[0] / p[1]:.3f}" if p[1] else " | -" for p in pairs)  # each variant's first two trees
        print(f"| {cell} | " + " | ".join(f"{p / 1000:.1f}" for p in per) + ratios + " |")
    if opts.status_poll:
        # A browser polling every second costs each request one poll's instructions over the requests served in a
        # second: the share below, at the rate each cell ran at here. The count with the poller running is the same
        # figure measured directly, with the tool's noise (1-2 %) on top.
        print()
        print(
            "| cell | tree | k instructions/request | requests/s | a poll, k instructions | a poll a second, per request"
            " | counted with the poller |"
        )
        print("|---|---|---|---|---|---|---|")
        for root, r in zip(trees, results, strict=True):
            poll = r[POLL]["per_request"]
            for cell in cells:
                bare, polled = r[cell], r[cell + POLLED]
                rate = bare["requests"] / opts.seconds
                share = poll / rate / bare["per_request"]
                print(
                    f"| {cell} | {root} | {bare['per_request'] / 1000:.1f} | {rate:.0f} | {poll / 1000:.1f} |"
                    f" +{100 * share:.2f} % | {polled['per_request'] / 1000:.1f} k ({polled['polls']} polls) |"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
