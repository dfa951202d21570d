"""The CPU model of the decode kernel's producer/consumer hand-off (nanoqwen/book/barrier_sim.py).

Exhaustive search on small pipelines, random schedules on the kernel's own shape (8 stages,
4 consumer warps, a tail of pages that wraps the stages twice).
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from nanoqwen.book import barrier_sim as sim
from nanoqwen.book.barrier_sim import (
    BROKEN,
    FIXED,
    LANE0_MBARRIER,
    LANE_ARRIVALS,
    NO_SETUP_BARRIER,
    NO_SYNCWARP,
    RELEASE_EVERY_PAGE,
    SYNC_FIRST_ROUND,
)

SHAPES = [(1, 2, 1), (3, 2, 1), (7, 2, 1), (5, 2, 2), (4, 4, 2)]  # (pages, stages, consumer warps)


def clean(result: sim.Exploration) -> bool:
    return (result.stale_reads, result.barrier_errors, result.uninitialized_waits, result.deadlocks,
            result.unmatched_arrivals, result.final_states) == (0, 0, 0, 0, 0, 1)


@pytest.mark.parametrize("num_pages,stages,consumers", SHAPES)
def test_fixed_protocol_is_clean_under_every_schedule(num_pages, stages, consumers):
    """The kernel's hand-off: full[s] an mbarrier, empty[s] a named barrier."""
    assert FIXED.empty == "named"
    assert clean(sim.explore(FIXED, num_pages, stages, consumers))  # one end state: every schedule agrees


@pytest.mark.parametrize("protocol", [LANE0_MBARRIER, LANE_ARRIVALS], ids=["lane 0 arrives", "every lane arrives"])
@pytest.mark.parametrize("num_pages,stages,consumers", SHAPES[:4])
def test_the_mbarrier_hand_offs_are_clean_too(protocol, num_pages, stages, consumers):
    """The kernel's previous hand-off and the probe's other racecheck-clean one are correct on
    the model's hardware as well: the port to named barriers was for the tool, not a bug fix."""
    assert clean(sim.explore(protocol, num_pages, stages, consumers))


@pytest.mark.parametrize("protocol", [FIXED, LANE0_MBARRIER])
def test_fixed_protocols_on_the_kernels_shape_random_schedules(protocol):
    runs = sim.random_runs(protocol, runs=150, num_pages=19, stages=8, consumers=4, seed=1)
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
    assert any("named barrier empty0" == who and "releases producer" in what for _, who, what in run.trace)


def test_a_single_page_races_only_sometimes():
    """One page, one copy: whether the consumer beats the copy engine is up to the schedule,
    which is how the bug hides on short sequences."""
    runs = sim.random_runs(BROKEN, runs=400, num_pages=1, stages=8, consumers=4, seed=2)
    stale = sum(bool(run.stale_reads) for run in runs)
    assert 0 < stale < len(runs)


def test_warp_scope_barrier_before_a_lane_0_release_is_needed():
    result = sim.explore(NO_SYNCWARP, num_pages=3, stages=2, consumers=1)
    assert result.stale_reads > 0
    schedule = sim.shortest_failing_schedule(NO_SYNCWARP, num_pages=3, stages=2, consumers=1)
    run = sim.run_schedule(NO_SYNCWARP, schedule, num_pages=3, stages=2, consumers=1)
    _, actor, _, _, expected, seen = run.stale_reads[0]
    # lanes 1-31 read the page of the next round: lane 0 released the stage too early.
    assert actor.endswith("lanes 1-31") and seen == expected + 2


def test_a_warp_arrives_at_a_named_barrier_only_with_all_its_lanes():
    """bar.arrive is warp-wide: lane 0 reaching it does not count until lanes 1-31 have too,
    so the producer's bar.sync cannot pass while they still read (here without the __syncwarp
    that the kernel's consumers execute before it, which is for the .aligned instruction's
    convergence)."""
    protocol = replace(FIXED, name="named, no __syncwarp", consumer_syncwarp=False)
    machine = sim.Machine(protocol, num_pages=3, stages=2, consumers=1)
    producer, lane0, lanes = 0, 1, 2
    state = machine.initial()
    for who in [producer] * 2 + [lane0, lanes] + [producer] * 9 + [("copy", 0), ("copy", 0)] + [lane0] * 4:
        assert who in machine.enabled(state), (who, machine.enabled(state))
        state = machine.step(state, who)
    assert dict(state.named)["empty0"] == 32  # the producer's warp only
    assert lane0 in state.at_named and producer in state.named_waiting
    assert producer not in machine.enabled(state)
    for _ in range(4):  # lanes 1-31: wait, read K, read V, reach bar.arrive
        state = machine.step(state, lanes)
    assert dict(state.named)["empty0"] == 0 and producer in machine.enabled(state)  # completed at 64
    assert clean(sim.explore(protocol, 3, 2, 1))


def test_named_barrier_counting_mistakes():
    # A named barrier has no "phase before the first": a bar.sync before a stage's first fill
    # waits for a consumer that is itself waiting for that fill.
    result = sim.explore(SYNC_FIRST_ROUND, num_pages=3, stages=2, consumers=1)
    assert result.deadlocks > 0 and result.final_states == 0
    # A release of a stage nobody refills leaves the warp's arrival pending when the block ends.
    result = sim.explore(RELEASE_EVERY_PAGE, num_pages=3, stages=2, consumers=1)
    assert result.unmatched_arrivals > 0 and result.stale_reads == 0
    run = sim.run_schedule(RELEASE_EVERY_PAGE, [], num_pages=3, stages=2, consumers=1)
    assert sorted((name, threads) for _, name, threads in run.unmatched_arrivals) == [("empty0", 32), ("empty1", 32)]


def test_which_reads_are_ordered_only_through_another_lanes_release():
    """What racecheck 2025.3 reported on the probe's rings: WAR hazards on reads by lanes 1-31,
    never lane 0, when lane 0 alone releases the stage; nothing when every lane takes part."""
    shape = (5, 2, 2)
    assert sim.reads_released_by_others(FIXED, *shape) == []
    assert sim.reads_released_by_others(LANE_ARRIVALS, *shape) == []
    flagged = sim.reads_released_by_others(LANE0_MBARRIER, *shape)
    assert flagged and all(actor.endswith("lanes 1-31") for actor, _ in flagged)
    refilled = [page for page in range(shape[0]) if page + shape[1] < shape[0]]
    assert sorted(page for _, page in flagged) == refilled


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


def test_programs_follow_the_kernels_hooks():
    programs = sim.build_programs(FIXED, num_pages=3, stages=2, consumers=1)
    assert programs.named == {"empty0": 64, "empty1": 64} and set(programs.mbarriers) == {"full0", "full1"}
    producer = programs.actors[0].program
    assert [op for op in producer if op[0] == "bar_sync"] == [("bar_sync", "empty0")]  # round 0 needs none
    for actor in programs.actors[1:]:  # page 0 is refilled (by page 2), pages 1 and 2 are not
        assert [op for op in actor.program if op[0] == "bar_arrive"] == [("bar_arrive", "empty0")]
    assert sum(a.threads for a in programs.actors if a.warp == 1) == 32
    old = sim.build_programs(LANE0_MBARRIER, num_pages=3, stages=2, consumers=1)
    assert old.named == {} and old.mbarriers["empty0"] == 1
    assert sim.build_programs(LANE_ARRIVALS, num_pages=3, stages=2, consumers=1).mbarriers["empty0"] == 32


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="at least one page"):
        sim.build_programs(FIXED, 0, 2, 1)
    with pytest.raises(ValueError, match="not enabled"):
        sim.run_schedule(FIXED, [("copy", 0)], num_pages=1, stages=1, consumers=1)
    with pytest.raises(ValueError, match="unknown empty signal"):
        sim.Protocol("typo", empty="named barrier")
