"""Instructions per request: what the Coordinator's worker executes per request, counted by callgrind.

    python bench/instructions.py                          # the four cells of bench/overhead.py, this tree
    python bench/instructions.py --tree /tmp/base         # the same, then another checkout, side by side
    python bench/instructions.py --cells chat --seconds 5

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

Under callgrind the Coordinator runs some 50 times slower: a tree takes about 2.5 minutes. Needs valgrind
(with callgrind_control), wrk and gcc. Compare trees with a git worktree: `git worktree add /tmp/base HEAD~3`.
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from bench import overhead  # noqa: E402

START_TIMEOUT_S = 600  # Python's imports under valgrind


def _counting(worker: str) -> float:
    """Start counting in the worker; when it started."""
    subprocess.run(["callgrind_control", "-i", "on", worker], check=True, capture_output=True)
    return time.monotonic()


def _dumped(worker: str) -> None:
    """The worker's counts dumped, and counting stopped (the dump is written by the worker meanwhile)."""
    subprocess.run(["callgrind_control", "-d", worker], check=True, capture_output=True)
    subprocess.run(["callgrind_control", "-i", "off", worker], check=True, capture_output=True)


def count(out_dir: str, pid: int) -> int:
    """The instructions in the worker's dumps since the last call (the dump files are removed)."""
    total = 0
    for path in glob.glob(os.path.join(out_dir, f"callgrind.{pid}.*")):
        with open(path) as f:
            for line in f:
                if line.startswith("totals:"):
                    total += int(line.split()[1])
        os.unlink(path)
    return total


# `--no-background`: what the worker does without requests (health checks, scrapes, the heartbeat, the event loop's
# own timers) is left out of the counts. Its cost per request is its cost per second over the requests a second,
# which on a loaded machine changes from run to run: it is counted for IDLE_S seconds without requests, and its
# rate taken off each cell's count for the cell's seconds.
IDLE_S = 8.0


def measure_tree(
    root: str, engines: overhead.Engines, cells: list[str], seconds: float, workdir: str, quiet: bool = False
) -> dict[str, dict]:
    out_dir = tempfile.mkdtemp(prefix="callgrind-", dir=workdir)
    launcher = (
        "valgrind",
        "--tool=callgrind",
        "--trace-children=yes",
        "--instr-atstart=no",
        f"--callgrind-out-file={out_dir}/callgrind.%p",
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
    )
    results = {}
    try:
        worker = str(gw.worker_pids()[0])
        idle_per_s = 0.0
        if quiet:
            started = _counting(worker)
            time.sleep(IDLE_S)
            _dumped(worker)
            idle_s = time.monotonic() - started
            time.sleep(0.5)
            idle_per_s = count(out_dir, int(worker)) / idle_s
            print(f"  {root} idle: {idle_per_s / 1000:.1f} k instructions a second, left out", flush=True)
        for cell in cells:
            data = gw.body(cell)
            overhead.run_wrk(gw.infer_port, [data], 3, 1, 1, None, workdir)  # warm-up, not counted
            started = _counting(worker)
            res = overhead.run_wrk(gw.infer_port, [data], seconds, 1, 1, None, workdir)
            _dumped(worker)
            counted_s = time.monotonic() - started
            time.sleep(0.5)  # the dump is written by the worker
            errors = overhead.wrk_errors(res)
            if any(errors.values()):
                raise RuntimeError(f"{root} {cell}: wrk saw errors {errors}")
            requests = res["requests"]
            instructions = count(out_dir, int(worker)) - idle_per_s * counted_s
            results[cell] = {
                "requests": requests,
                "instructions": instructions,
                "per_request": instructions / max(requests, 1),
            }
            print(
                f"  {root} {cell}: {requests:.0f} requests, {instructions / max(requests, 1) / 1000:.1f} k instructions each",
                flush=True,
            )
    finally:
        gw.stop()
    return results


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
    opts = ap.parse_args(argv)
    cells = [c for c in opts.cells.split(",") if c]
    unknown = set(cells) - set(overhead.CELLS)
    if unknown:
        ap.error(f"unknown cells: {', '.join(sorted(unknown))}")
    missing = [t for t in ("valgrind", "callgrind_control", "wrk", "gcc") if not shutil.which(t)]
    if missing:
        print(f"missing: {', '.join(missing)}. Install with: apt-get install -y valgrind wrk gcc", file=sys.stderr)
        return 2
    trees = [overhead.ROOT] + [os.path.abspath(t) for t in opts.tree]
    workdir = tempfile.mkdtemp(prefix="motor-instructions-")
    try:
        with overhead.fakes(overhead.build_fake(workdir), None, workdir) as engines:
            results = [measure_tree(root, engines, cells, opts.seconds, workdir, opts.no_background) for root in trees]
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print()
    print(
        "| cell | "
        + " | ".join(f"k instructions/request: {t}" for t in trees)
        + (" | first / second |" if len(trees) > 1 else " |")
    )
    print("|---" * (len(trees) + 1 + (len(trees) > 1)) + "|")
    for cell in cells:
        per = [r[cell]["per_request"] for r in results]
        ratio = f" | {per[0] / per[1]:.3f}" if len(per) > 1 and per[1] else ""
        print(f"| {cell} | " + " | ".join(f"{p / 1000:.1f}" for p in per) + ratio + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
