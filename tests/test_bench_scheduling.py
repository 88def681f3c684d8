"""bench/scheduling.py: the virtual-time scheduling benchmark feeds the Coordinator's scheduling code what the
Coordinator itself would, and its verdict fails when a figure misses its target."""

from __future__ import annotations

from bench import scheduling as bench
from scheduling.affinity import PrefixIndex
from state.shared import SharedState


def test_the_prefix_index_sees_a_shared_system_prompt_as_the_coordinator_hashes_it():
    """A prompt sharing a hot system prompt with one prefilled on a slot is cached there up to that system prompt
    (within the index's 1/8 granularity), never beyond: the bench's index hashes are the Coordinator's sparse
    prefix hashes, not the engine's per-block ones (which the index would read as far longer prefixes)."""
    fam = next(f for f in (bench.make_family(i, 1) for i in range(13)) if f.systems)
    system = fam.systems[0]
    first, second = bench.Req(0.0, 0, 700, 50), bench.Req(0.0, 0, 900, 50)
    index = PrefixIndex(SharedState.create(), bench.BLOCK)
    index.record(bench.hashes_of(fam, first, 1)[0], 3)
    cached = index.cached_blocks(bench.hashes_of(fam, second, 2)[0], 3) * bench.BLOCK
    assert system * 7 // 8 - bench.BLOCK <= cached <= system
    assert index.cached_blocks(bench.hashes_of(fam, second, 2)[0], 4) == 0


def test_check_fails_the_run_when_a_checked_figure_misses(capsys):
    """--check exits 1 when admitted requests on time fall under the floor (here one no run can reach), and the
    same run without --check only reports it."""
    args = ["--only", "f11", "--requests", "30", "--loads", "1.0", "--runs", "slo_aware:reject"]
    assert bench.main([*args, "--floor", "1.01"]) == 0
    assert "FAIL admitted on-time" in capsys.readouterr().out
    assert bench.main([*args, "--floor", "1.01", "--check"]) == 1
    assert bench.main([*args, "--floor", "0.5", "--check"]) == 0
