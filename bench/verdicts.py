"""The scheduling benchmarks' verdicts (bench/scheduling.py, bench/wallclock.py): each figure against its target,
printed PASS, FAIL (a checked figure missed) or miss (a figure reported only), and `--check`'s exit."""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

# The aims for admission's goodput, reported: against round robin's and against the best other policy's.
AIM_VS_ROUND_ROBIN = 1.5
AIM_VS_BEST_OTHER = 1.15


@dataclass
class Verdict:
    text: str  # the figure and its target
    ok: bool
    checked: bool  # `--check` fails the run when it misses; the others are reported only


def add_args(parser: argparse.ArgumentParser) -> None:
    """--floor, --least-ratio (the checked targets) and --check."""
    parser.add_argument("--floor", type=float, default=0.95, help="the least share of admitted requests on time")
    parser.add_argument(
        "--least-ratio", type=float, default=0.95, help="the least goodput of admission against each other policy's"
    )
    parser.add_argument("--check", action="store_true", help="exit 1 when a checked verdict misses its target")


def report(verdicts: list[Verdict], check: bool, command: str) -> int:
    """Print each verdict; 1 when `check` and a checked one missed (said on stderr, naming `command`), else 0."""
    for v in verdicts:
        print(f"{'PASS' if v.ok else 'FAIL' if v.checked else 'miss'} {v.text}")
    failed = [v for v in verdicts if v.checked and not v.ok]
    if check and failed:
        print(f"{command}: {len(failed)} checked figure(s) missed", file=sys.stderr)
        return 1
    return 0
