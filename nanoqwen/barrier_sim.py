"""A step-by-step CPU model of a warp-specialized pipeline, to find its races by search.

The decode attention kernel (kernels/paged_attention.cu) has one producer warp that asks the
copy engine for K and V page slices, and consumer warps that read them from shared memory.
Whether the hand-off is correct depends on the order in which warps and copies happen to run,
which a GPU run samples only a few ways. This module runs the same protocol as tiny programs
on a model machine and lets a scheduler choose every step: replay one schedule, draw random
ones, or explore every reachable state.

The model follows the hardware rules the kernel relies on:

* an **mbarrier** (`MBarrier`) counts arrivals and expected transaction bytes; a phase
  completes when both reach zero, and `try_wait.parity(p)` passes once the phase of parity
  `p` has completed (so waiting on parity 1 passes at once on a fresh barrier);
* a **bulk copy** is an actor of its own: issued by a thread, it lands later, at a moment the
  scheduler picks, writing its page into shared memory and completing bytes on an mbarrier;
* a **block barrier** (`__syncthreads`, `bar.sync 0`) releases when every thread of the block
  that has not exited has arrived. That is what the hardware does (warps that exited count as
  arrived); CUDA calls it undefined unless every thread reaches the *same* barrier, and the
  model reports any release that breaks that rule, as `compute-sanitizer --tool synccheck`
  does;
* a **warp barrier** (`__syncwarp`) releases when every lane group of one warp has arrived.

A consumer warp is two actors, lane 0 and lanes 1-31, because lane 0 alone tells the producer
that a stage is free: without a warp barrier first, the other lanes may still be reading it.
Every read records whether it saw the page it expected; a stale read is the bug.

    >>> result = explore(FIXED, num_pages=3, stages=2, consumers=1)
    >>> result.stale_reads, result.deadlocks, result.barrier_errors
    (0, 0, 0)
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field, replace

__all__ = [
    "BROKEN",
    "FIXED",
    "NO_SETUP_BARRIER",
    "NO_SYNCWARP",
    "Exploration",
    "Protocol",
    "Run",
    "build_programs",
    "explore",
    "random_runs",
    "run_schedule",
    "shortest_failing_schedule",
]

SLICE_BYTES = 4096  # one page slice: 16 rows x 128 dims x fp16
SLOTS = ("K", "V")


@dataclass(frozen=True)
class Protocol:
    """How the producer and consumers hand a shared-memory stage to each other.

    The four hooks match the four macros of kernels/paged_attention.cu; the fixed kernel and
    kernels/paged_attention_broken.cu differ only in them.
    """

    name: str
    setup_barrier: bool = True  # block-wide barrier after thread 0 initializes the mbarriers
    producer_waits_empty: bool = True  # PRODUCER_WAIT_STAGE_FREE: mbarrier wait on empty[s]
    producer_block_barrier: bool = False  # PRODUCER_AFTER_ISSUE: wait full[s] + __syncthreads()
    consumer_waits_full: bool = True  # CONSUMER_WAIT_STAGE_FULL: mbarrier wait on full[s]
    consumer_releases: bool = True  # CONSUMER_RELEASE_STAGE: arrive on empty[s] (lane 0)
    consumer_syncwarp: bool = True  # ... after a __syncwarp() so every lane has finished


FIXED = Protocol("fixed")
# The bug: the synchronous kernel's one __syncthreads() moved inside the producer's branch.
BROKEN = Protocol(
    "broken",
    producer_waits_empty=False,
    producer_block_barrier=True,
    consumer_waits_full=False,
    consumer_releases=False,
)
NO_SYNCWARP = replace(FIXED, name="no __syncwarp before release", consumer_syncwarp=False)
NO_SETUP_BARRIER = replace(FIXED, name="no barrier after mbarrier init", setup_barrier=False)


# An instruction is a tuple: (opcode, *operands). Opcodes:
#   ("init",)                       thread 0 initializes every mbarrier
#   ("bar", site)                   __syncthreads() written at `site`
#   ("syncwarp",)                   __syncwarp()
#   ("wait", barrier, parity)       spin on mbarrier.try_wait.parity
#   ("arrive", barrier)             mbarrier.arrive
#   ("expect_tx", barrier, nbytes)  mbarrier.arrive.expect_tx
#   ("copy", stage, slot, page, barrier)  cp.async.bulk ... complete_tx on `barrier`
#   ("read", stage, slot, page)     load shared memory, expecting `page`


@dataclass(frozen=True)
class Actor:
    name: str
    warp: int
    program: tuple


def build_programs(protocol: Protocol, num_pages: int, stages: int, consumers: int) -> tuple[tuple[Actor, ...], dict[str, int]]:
    """The producer's and every consumer lane group's straight-line program.

    Consumer warp `w` takes pages w, w + consumers, ...; page `i` goes to stage `i % stages`
    in round `i // stages`. Returns the actors and each mbarrier's arrival count.
    """
    if num_pages < 1 or stages < 1 or consumers < 1:
        raise ValueError(f"need at least one page, stage and consumer, got {num_pages}, {stages}, {consumers}")
    counts = {}
    for s in range(stages):
        counts[f"full{s}"] = 1  # the producer's arrive.expect_tx
        counts[f"empty{s}"] = 1  # lane 0 of the consumer warp that read the stage
    p = protocol
    producer = [("init",)]
    if p.setup_barrier:
        producer.append(("bar", "setup"))
    for i in range(num_pages):
        s, r = i % stages, i // stages
        if p.producer_waits_empty:
            producer.append(("wait", f"empty{s}", (r & 1) ^ 1))
        producer.append(("expect_tx", f"full{s}", len(SLOTS) * SLICE_BYTES))
        producer += [("copy", s, slot, i, f"full{s}") for slot in SLOTS]
        if p.producer_block_barrier:
            producer += [("wait", f"full{s}", r & 1), ("bar", "producer branch")]
        else:
            producer.append(("syncwarp",))
    actors = [Actor("producer", 0, tuple(producer))]
    for w in range(consumers):
        for lanes in ("lane 0", "lanes 1-31"):
            program = [("bar", "setup")] if p.setup_barrier else []
            for i in range(w, num_pages, consumers):
                s, r = i % stages, i // stages
                if p.consumer_waits_full:
                    program.append(("wait", f"full{s}", r & 1))
                program += [("read", s, slot, i) for slot in SLOTS]
                if p.consumer_syncwarp:
                    program.append(("syncwarp",))
                if p.consumer_releases and lanes == "lane 0":
                    program.append(("arrive", f"empty{s}"))
            actors.append(Actor(f"consumer {w} {lanes}", w + 1, tuple(program)))
    return tuple(actors), counts


# ------------------------------------------------------------------------------- machine


@dataclass(frozen=True)
class MBarrier:
    """An mbarrier's observable state: `phase` counts completed phases."""

    initialized: bool = False
    phase: int = 0
    pending: int = 0  # arrivals still expected in the current phase
    tx: int = 0  # transaction bytes still expected in the current phase

    def completes(self, count: int) -> "MBarrier":
        if self.pending == 0 and self.tx == 0:
            return replace(self, phase=self.phase + 1, pending=count)
        return self

    def parity_done(self, parity: int) -> bool:
        """What try_wait.parity sees: the phase of this parity has completed."""
        return (self.phase & 1) != parity


@dataclass(frozen=True)
class State:
    pcs: tuple  # next instruction of each actor; len(program) once it exited
    at_bar: frozenset  # actors waiting at the block barrier
    at_warp: frozenset  # actors waiting at their warp barrier
    mbar: tuple  # (name, MBarrier) pairs, sorted by name
    smem: tuple  # smem[stage][slot] = page last landed there; None = left by an earlier block
    copies: tuple  # bulk copies in flight: (stage, slot, page, barrier)
    flags: tuple = (False, False, False)  # (stale read, barrier error, wait on uninitialized mbarrier)


@dataclass
class Run:
    """One schedule played to the end, with its trace."""

    protocol: str
    stale_reads: list = field(default_factory=list)  # (step, actor, stage, slot, expected, seen)
    barrier_errors: list = field(default_factory=list)
    uninitialized_waits: list = field(default_factory=list)
    deadlock: bool = False
    trace: list = field(default_factory=list)  # (step, who, what)

    @property
    def ok(self) -> bool:
        return not (self.stale_reads or self.barrier_errors or self.uninitialized_waits or self.deadlock)


class Machine:
    """The model: `enabled(state)` lists who may step, `step(state, who)` runs one step."""

    def __init__(self, protocol: Protocol, num_pages: int, stages: int, consumers: int):
        self.protocol = protocol
        self.actors, self.counts = build_programs(protocol, num_pages, stages, consumers)
        self.stages = stages
        self.warps = {a.warp for a in self.actors}

    def initial(self) -> State:
        return State(
            pcs=tuple(0 for _ in self.actors),
            at_bar=frozenset(),
            at_warp=frozenset(),
            mbar=tuple(sorted((name, MBarrier()) for name in self.counts)),
            smem=tuple((None, None) for _ in range(self.stages)),
            copies=(),
        )

    def _op(self, state: State, a: int):
        program = self.actors[a].program
        return program[state.pcs[a]] if state.pcs[a] < len(program) else None

    def live(self, state: State) -> list[int]:
        return [a for a in range(len(self.actors)) if self._op(state, a) is not None]

    def enabled(self, state: State) -> list:
        """Actor indices that can execute their next instruction, then ("copy", k) for
        each bulk copy in flight (any of them may land next)."""
        mbar = dict(state.mbar)
        ready = []
        for a in self.live(state):
            if a in state.at_bar or a in state.at_warp:
                continue  # released only by the last arrival
            op = self._op(state, a)
            if op[0] == "wait":
                barrier = mbar[op[1]]
                if barrier.initialized and not barrier.parity_done(op[2]):
                    continue
            ready.append(a)
        return ready + [("copy", k) for k in range(len(state.copies))]

    def step(self, state: State, who, events: Run | None = None) -> State:
        """Execute one step of actor `who` (an index) or land copy `who` = ("copy", k)."""
        stale, barrier_error, uninit = state.flags
        mbar = dict(state.mbar)
        if isinstance(who, tuple):  # the copy engine writes a page slice and completes bytes
            stage, slot, page, name = state.copies[who[1]]
            smem = [list(row) for row in state.smem]
            smem[stage][SLOTS.index(slot)] = page
            b = mbar[name]
            mbar[name] = replace(b, tx=b.tx - SLICE_BYTES).completes(self.counts[name]) if b.initialized else b
            copies = state.copies[: who[1]] + state.copies[who[1] + 1 :]
            self._log(events, "copy engine", f"lands page {page} {slot} in stage {stage}, completes {SLICE_BYTES} B on {name}")
            return replace(state, smem=tuple(tuple(r) for r in smem), copies=copies, mbar=tuple(sorted(mbar.items())))

        a = who
        op = self._op(state, a)
        pcs = list(state.pcs)
        pcs[a] += 1
        at_bar, at_warp, copies = state.at_bar, state.at_warp, state.copies
        name = self.actors[a].name
        kind = op[0]
        if kind == "init":
            for key in mbar:
                mbar[key] = MBarrier(initialized=True, pending=self.counts[key])
            self._log(events, name, "initializes every mbarrier")
        elif kind == "wait":
            b = mbar[op[1]]
            if not b.initialized:
                uninit = True
                if events is not None:
                    events.uninitialized_waits.append((len(events.trace), name, op[1]))
            self._log(events, name, f"passes try_wait.parity({op[2]}) on {op[1]} (phase {b.phase})")
        elif kind in ("arrive", "expect_tx"):
            b = mbar[op[1]]
            if b.initialized:
                tx = b.tx + (op[2] if kind == "expect_tx" else 0)
                mbar[op[1]] = replace(b, tx=tx, pending=b.pending - 1).completes(self.counts[op[1]])
            what = "arrive" if kind == "arrive" else f"arrive.expect_tx({op[2]} B)"
            self._log(events, name, f"{what} on {op[1]}")
        elif kind == "copy":
            copies = copies + ((op[1], op[2], op[3], op[4]),)
            self._log(events, name, f"issues bulk copy of page {op[3]} {op[2]} into stage {op[1]}")
        elif kind == "read":
            seen = state.smem[op[1]][SLOTS.index(op[2])]
            in_flight = any(c[0] == op[1] and c[1] == op[2] for c in copies)
            if seen != op[3]:
                stale = True
                if events is not None:
                    events.stale_reads.append((len(events.trace), name, op[1], op[2], op[3], seen))
            note = "" if seen == op[3] else f"  <-- STALE: expected page {op[3]}"
            note += "  (a copy into it is in flight)" if in_flight else ""
            self._log(events, name, f"reads stage {op[1]} {op[2]}: page {seen}{note}")
        elif kind == "bar":
            pcs[a] -= 1  # stays on the barrier until it is released
            at_bar = at_bar | {a}
            self._log(events, name, f"arrives at __syncthreads() ({op[1]})")
        elif kind == "syncwarp":
            pcs[a] -= 1
            at_warp = at_warp | {a}
            self._log(events, name, "arrives at __syncwarp()")
        new = State(tuple(pcs), at_bar, at_warp, tuple(sorted(mbar.items())), state.smem, copies, (stale, barrier_error, uninit))
        return self._release(new, events)

    def _release(self, state: State, events: Run | None) -> State:
        """Open the block barrier and any warp barrier whose every live participant arrived."""
        changed = True
        while changed:
            changed = False
            live = set(self.live(state))
            if state.at_bar and state.at_bar >= live:
                sites = {self._op(state, a)[1] for a in state.at_bar}
                exited = len(self.actors) - len(live)
                pcs = list(state.pcs)
                for a in state.at_bar:
                    pcs[a] += 1
                flags = state.flags
                if len(sites) > 1 or exited:
                    why = f"sites {sorted(sites)}" if len(sites) > 1 else f"{exited} actor(s) exited without arriving"
                    flags = (flags[0], True, flags[2])
                    if events is not None:
                        events.barrier_errors.append((len(events.trace), why))
                    self._log(events, "block barrier", f"releases, but not every thread reached it: {why}")
                else:
                    self._log(events, "block barrier", "releases: every thread arrived")
                state = replace(state, pcs=tuple(pcs), at_bar=frozenset(), flags=flags)
                changed = True
            for w in self.warps:
                members = {a for a in live if self.actors[a].warp == w}
                waiting = state.at_warp & members
                if waiting and waiting >= members:
                    pcs = list(state.pcs)
                    for a in waiting:
                        pcs[a] += 1
                    state = replace(state, pcs=tuple(pcs), at_warp=state.at_warp - waiting)
                    self._log(events, f"warp {w} barrier", "releases")
                    changed = True
        return state

    @staticmethod
    def _log(events: Run | None, who: str, what: str) -> None:
        if events is not None:
            events.trace.append((len(events.trace), who, what))


# ----------------------------------------------------------------------------- schedules


def _play(machine: Machine, choose) -> tuple[Run, list]:
    run = Run(machine.protocol.name)
    state, schedule = machine.initial(), []
    while machine.live(state) or state.copies:
        options = machine.enabled(state)
        if not options:
            run.deadlock = True
            Machine._log(run, "scheduler", "DEADLOCK: nobody can step")
            break
        who = choose(options, state)
        schedule.append(who)
        state = machine.step(state, who, run)
    return run, schedule


def run_schedule(protocol: Protocol, schedule, num_pages: int = 3, stages: int = 2, consumers: int = 1) -> Run:
    """Replay a schedule: a list of choices, each an actor index or ("copy", k). When the
    list runs out, the lowest enabled actor steps (copies land last), deterministically."""
    machine = Machine(protocol, num_pages, stages, consumers)
    queue = deque(schedule)

    def choose(options, state):
        if queue:
            who = queue.popleft()
            if who not in options:
                raise ValueError(f"schedule step {who!r} is not enabled; enabled: {options}")
            return who
        return options[0]

    return _play(machine, choose)[0]


def random_runs(protocol: Protocol, runs: int, num_pages: int, stages: int, consumers: int, seed: int = 0) -> list[Run]:
    """`runs` schedules drawn uniformly among the enabled steps, reproducible from `seed`."""
    machine = Machine(protocol, num_pages, stages, consumers)
    rng = random.Random(seed)
    return [_play(machine, lambda options, state: rng.choice(options))[0] for _ in range(runs)]


@dataclass
class Exploration:
    """Every state reachable from the start, under every schedule."""

    states: int
    final_states: int
    stale_reads: int  # reachable states in which a stale read has happened
    barrier_errors: int
    uninitialized_waits: int
    deadlocks: int


def explore(protocol: Protocol, num_pages: int, stages: int, consumers: int, max_states: int = 2_000_000) -> Exploration:
    """Visit every reachable state (depth-first, each once) and count the bad ones."""
    machine = Machine(protocol, num_pages, stages, consumers)
    start = machine.initial()
    seen = {start}
    stack = [start]
    finals = stale = errors = uninit = deadlocks = 0
    while stack:
        state = stack.pop()
        stale += state.flags[0]
        errors += state.flags[1]
        uninit += state.flags[2]
        options = machine.enabled(state)
        if not options:
            if machine.live(state):
                deadlocks += 1
            else:
                finals += 1
            continue
        for who in options:
            nxt = machine.step(state, who)
            if nxt not in seen:
                if len(seen) >= max_states:
                    raise RuntimeError(f"more than {max_states} states: use fewer pages or consumers")
                seen.add(nxt)
                stack.append(nxt)
    return Exploration(len(seen), finals, stale, errors, uninit, deadlocks)


def shortest_failing_schedule(protocol: Protocol, num_pages: int = 3, stages: int = 2, consumers: int = 1):
    """Breadth-first search for the fewest steps that end in a stale read; None if none does."""
    machine = Machine(protocol, num_pages, stages, consumers)
    start = machine.initial()
    parent = {start: None}
    queue = deque([start])
    while queue:
        state = queue.popleft()
        if state.flags[0]:
            schedule = []
            while parent[state] is not None:
                state, who = parent[state]
                schedule.append(who)
            return schedule[::-1]
        for who in machine.enabled(state):
            nxt = machine.step(state, who)
            if nxt not in parent:
                parent[nxt] = (state, who)
                queue.append(nxt)
    return None
