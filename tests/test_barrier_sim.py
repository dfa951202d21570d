"""The CPU model of the decode kernel's producer/consumer hand-off (nanoqwen/barrier_sim.py).

Exhaustive search on small pipelines, random schedules on the kernel's own shape (8 stages,
4 consumer warps, a tail of pages that wraps the stages twice).
"""

from __future__ import annotations

import pytest

from nanoqwen import barrier_sim as sim
from nanoqwen.barrier_sim import BROKEN, FIXED, NO_SETUP_BARRIER, NO_SYNCWARP


@pytest.mark.parametrize("num_pages,stages,consumers", [(1, 2, 1), (3, 2, 1), (7, 2, 1), (5, 2, 2), (4, 4, 2)])
def test_fixed_protocol_is_clean_under_every_schedule(num_pages, stages, consumers):
    result = sim.explore(FIXED, num_pages, stages, consumers)
    assert (result.stale_reads, result.barrier_errors, result.uninitialized_waits, result.deadlocks) == (0, 0, 0, 0)
    assert result.final_states == 1  # every schedule ends in the same state


def test_fixed_protocol_on_the_kernels_shape_random_schedules():
    runs = sim.random_runs(FIXED, runs=150, num_pages=19, stages=8, consumers=4, seed=1)
    assert all(run.ok for run in runs), [run for run in runs if not run.ok][:1]


def test_broken_protocol_reads_stale_shared_memory():
    result = sim.explore(BROKEN, num_pages=3, stages=2, consumers=1)
    assert result.stale_reads > 0 and result.barrier_errors > 0
    assert result.deadlocks == 0  # it does not hang: the barrier opens once the consumers exit


def test_the_shortest_failing_schedule_replays_deterministically():
    schedule = sim.shortest_failing_schedule(BROKEN, num_pages=3, stages=2, consumers=1)
    assert schedule is not None and len(schedule) <= 6
    first = sim.run_schedule(BROKEN, schedule, num_pages=3, stages=2, consumers=1)
    second = sim.run_schedule(BROKEN, schedule, num_pages=3, stages=2, consumers=1)
    assert first.trace == second.trace
    step, actor, stage, slot, expected, seen = first.stale_reads[0]
    assert actor.startswith("consumer") and seen != expected
    # The consumer's first read happens before the producer has even issued the copy.
    assert first.trace.index(next(t for t in first.trace if "issues bulk copy" in t[2])) > step
    assert any("not every thread reached it" in what for _, _, what in first.trace)


def test_fixed_protocol_never_fails_the_same_schedule_prefix():
    # The broken protocol's failing schedule, in spirit: consumers first, the copy engine last.
    run = sim.run_schedule(FIXED, [], num_pages=3, stages=2, consumers=1)  # lowest actor first throughout
    assert run.ok and not run.stale_reads


def test_a_single_page_races_only_sometimes():
    """One page, one copy: whether the consumer beats the copy engine is up to the schedule,
    which is how the bug hides on short sequences."""
    runs = sim.random_runs(BROKEN, runs=400, num_pages=1, stages=8, consumers=4, seed=2)
    stale = sum(bool(run.stale_reads) for run in runs)
    assert 0 < stale < len(runs)


def test_warp_scope_barrier_before_release_is_needed():
    result = sim.explore(NO_SYNCWARP, num_pages=3, stages=2, consumers=1)
    assert result.stale_reads > 0
    schedule = sim.shortest_failing_schedule(NO_SYNCWARP, num_pages=3, stages=2, consumers=1)
    run = sim.run_schedule(NO_SYNCWARP, schedule, num_pages=3, stages=2, consumers=1)
    _, actor, _, _, expected, seen = run.stale_reads[0]
    # lanes 1-31 read the page of the next round: lane 0 released the stage too early.
    assert actor.endswith("lanes 1-31") and seen == expected + 2


def test_block_barrier_after_mbarrier_init_is_needed():
    result = sim.explore(NO_SETUP_BARRIER, num_pages=1, stages=2, consumers=1)
    assert result.uninitialized_waits > 0


def test_parity_aliases_when_stages_are_shared_between_consumer_warps():
    """Why the kernel requires DECODE_STAGES % DECODE_CONSUMER_WARPS == 0: with 3 stages and 2
    consumer warps a warp can wait for round 1 of a stage before round 0 completed, and parity
    1 reads as 'done' on a fresh barrier."""
    result = sim.explore(FIXED, num_pages=4, stages=3, consumers=2)
    assert result.stale_reads > 0


def test_mbarrier_phase_needs_arrivals_and_bytes():
    b = sim.MBarrier(initialized=True, pending=1)
    assert b.parity_done(1) and not b.parity_done(0)  # a fresh barrier: "phase -1" counts as done
    armed = sim.MBarrier(initialized=True, pending=0, tx=8192).completes(1)  # arrived, bytes outstanding
    assert armed.phase == 0
    landed = sim.MBarrier(initialized=True, pending=0, tx=0).completes(1)
    assert landed.phase == 1 and landed.pending == 1 and landed.parity_done(0)


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="at least one page"):
        sim.build_programs(FIXED, 0, 2, 1)
    with pytest.raises(ValueError, match="not enabled"):
        sim.run_schedule(FIXED, [("copy", 0)], num_pages=1, stages=1, consumers=1)
