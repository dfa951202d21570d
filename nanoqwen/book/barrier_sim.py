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
  `p` has completed (so waiting on parity 1 passes at once on a fresh barrier). It lives in
  shared memory and must be initialized before anyone touches it;
* a **bulk copy** is an actor of its own: issued by a thread, it lands later, at a moment the
  scheduler picks, writing its page into shared memory and completing bytes on an mbarrier;
* a **named barrier** (`bar.arrive` / `bar.sync` with an id and a thread count) is a hardware
  counter that needs no initialization and has no phases to name. Its instructions are
  warp-wide: a warp's arrival counts once all of its live lanes have executed the
  instruction, and then counts the warp's 32 threads. `bar.arrive` goes on, `bar.sync` waits;
  when the count is reached every waiter is released and the counter starts over. Arrivals
  still pending when the block ends are reported (nothing synchronized with them);
* a **block barrier** (`__syncthreads`, `bar.sync 0`) releases when every thread of the block
  that has not exited has arrived. That is what the hardware does (warps that exited count as
  arrived); CUDA calls it undefined unless every thread reaches the *same* barrier, and the
  model reports any release that breaks that rule;
* a **warp barrier** (`__syncwarp`) releases when every lane group of one warp has arrived.

A consumer warp is two actors, lane 0 and lanes 1-31, because a hand-off may let lane 0
alone tell the producer that a stage is free: without a warp barrier first, the other lanes
may still be reading it. Every read records whether it saw the page it expected; a stale read
is the bug.

    >>> result = explore(FIXED, num_pages=3, stages=2, consumers=1)
    >>> result.stale_reads, result.deadlocks, result.barrier_errors, result.unmatched_arrivals
    (0, 0, 0, 0)
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field, replace

__all__ = [
    "BROKEN",
    "EMPTY_SIGNALS",
    "FIXED",
    "LANE_ARRIVALS",
    "LANE0_MBARRIER",
    "NO_SETUP_BARRIER",
    "NO_SYNCWARP",
    "RELEASE_EVERY_PAGE",
    "SYNC_FIRST_ROUND",
    "Exploration",
    "Programs",
    "Protocol",
    "Run",
    "build_programs",
    "explore",
    "random_runs",
    "reads_released_by_others",
    "run_schedule",
    "shortest_failing_schedule",
]

SLICE_BYTES = 4096  # one page slice: 16 rows x 128 dims x fp16
SLOTS = ("K", "V")
WARP_SIZE = 32
STAGE_BARRIER_THREADS = 2 * WARP_SIZE  # a stage's named barrier: the producer warp + one consumer warp
# How a consumer warp tells the producer that it has read a stage ("empty"):
EMPTY_SIGNALS = {
    "named": "bar.arrive by the consumer warp, bar.sync by the producer warp (64 threads)",
    "lane0": "__syncwarp, then lane 0 arrives on the mbarrier empty[s] (1 arrival)",
    "lanes": "every lane arrives on the mbarrier empty[s] (32 arrivals)",
}


@dataclass(frozen=True)
class Protocol:
    """How the producer and consumers hand a shared-memory stage to each other.

    The hooks match the four macros of kernels/paged_attention.cu; the fixed kernel and
    kernels/paged_attention_broken.cu differ only in them. `empty` says which signal carries
    "stage read" (EMPTY_SIGNALS); "stage holds its page" is always the mbarrier full[s].
    """

    name: str
    empty: str = "named"
    setup_barrier: bool = True  # block-wide barrier after thread 0 initializes the mbarriers
    producer_waits_empty: bool = True  # PRODUCER_WAIT_STAGE_FREE
    producer_block_barrier: bool = False  # PRODUCER_AFTER_ISSUE: wait full[s] + __syncthreads()
    consumer_waits_full: bool = True  # CONSUMER_WAIT_STAGE_FULL: mbarrier wait on full[s]
    consumer_releases: bool = True  # CONSUMER_RELEASE_STAGE
    consumer_syncwarp: bool = True  # __syncwarp() after the reads (the consumer loop has one after decode_page)
    producer_skips_first_round: bool = True  # named: a fresh stage is free, no bar.sync in round 0
    release_only_refilled: bool = True  # named: no bar.arrive for a stage that is not refilled

    def __post_init__(self):
        if self.empty not in EMPTY_SIGNALS:
            raise ValueError(f"unknown empty signal {self.empty!r}; one of {sorted(EMPTY_SIGNALS)}")


# The kernel: empty[s] is the named barrier 2 + s, as in kernels/paged_attention.cu.
FIXED = Protocol("fixed")
# A second mbarrier empty[s], on which lane 0 arrives after a __syncwarp: correct on the hardware
# (the __syncwarp orders lanes 1-31's reads before lane 0's arrival), but racecheck 2025.3 does not
# follow that chain (chapter 5, "Why a named barrier"). Every stage is released.
LANE0_MBARRIER = Protocol("empty mbarrier, lane 0 arrives", empty="lane0", release_only_refilled=False)
# A second mbarrier on which every lane arrives itself: no lane's read is released by another.
LANE_ARRIVALS = Protocol("empty mbarrier, every lane arrives", empty="lanes", release_only_refilled=False)
# The bug: the synchronous kernel's one __syncthreads() moved inside the producer's branch.
BROKEN = Protocol(
    "broken",
    producer_waits_empty=False,
    producer_block_barrier=True,
    consumer_waits_full=False,
    consumer_releases=False,
)
NO_SYNCWARP = replace(LANE0_MBARRIER, name="lane 0 arrives without __syncwarp", consumer_syncwarp=False)
NO_SETUP_BARRIER = replace(FIXED, name="no barrier after mbarrier init", setup_barrier=False)
SYNC_FIRST_ROUND = replace(FIXED, name="producer bar.sync before a stage's first fill", producer_skips_first_round=False)
RELEASE_EVERY_PAGE = replace(FIXED, name="bar.arrive for a stage nobody refills", release_only_refilled=False)


# An instruction is a tuple: (opcode, *operands). Opcodes:
#   ("init",)                       thread 0 initializes every mbarrier
#   ("bar", site)                   __syncthreads() written at `site`
#   ("syncwarp",)                   __syncwarp()
#   ("wait", barrier, parity)       spin on mbarrier.try_wait.parity
#   ("arrive", barrier, threads)    mbarrier.arrive by `threads` threads of the actor
#   ("expect_tx", barrier, nbytes)  mbarrier.arrive.expect_tx (one thread)
#   ("copy", stage, slot, page, barrier)  cp.async.bulk ... complete_tx on `barrier`
#   ("read", stage, slot, page)     load shared memory, expecting `page`
#   ("bar_arrive", barrier)         bar.arrive on a named barrier (warp-wide)
#   ("bar_sync", barrier)           bar.sync on a named barrier (warp-wide)


@dataclass(frozen=True)
class Actor:
    name: str
    warp: int
    threads: int  # how many of the warp's threads this actor stands for
    program: tuple


@dataclass(frozen=True)
class Programs:
    actors: tuple  # the producer, then each consumer warp's lane 0 and lanes 1-31
    mbarriers: dict  # name -> arrivals that complete a phase
    named: dict  # name -> threads that complete the named barrier


def build_programs(protocol: Protocol, num_pages: int, stages: int, consumers: int) -> Programs:
    """The producer's and every consumer lane group's straight-line program.

    Consumer warp `w` takes pages w, w + consumers, ...; page `i` goes to stage `i % stages`
    in round `i // stages`.
    """
    if num_pages < 1 or stages < 1 or consumers < 1:
        raise ValueError(f"need at least one page, stage and consumer, got {num_pages}, {stages}, {consumers}")
    p = protocol
    named = p.empty == "named"
    mbarriers = {f"full{s}": 1 for s in range(stages)}  # the producer's arrive.expect_tx
    if not named:
        mbarriers.update({f"empty{s}": 1 if p.empty == "lane0" else WARP_SIZE for s in range(stages)})
    named_barriers = {f"empty{s}": STAGE_BARRIER_THREADS for s in range(stages)} if named else {}

    producer = [("init",)]
    if p.setup_barrier:
        producer.append(("bar", "setup"))
    for i in range(num_pages):
        s, r = i % stages, i // stages
        if p.producer_waits_empty:
            if not named:
                producer.append(("wait", f"empty{s}", (r & 1) ^ 1))  # lane 0 spins; the fresh phase passes
            elif r > 0 or not p.producer_skips_first_round:
                producer.append(("bar_sync", f"empty{s}"))
        producer.append(("expect_tx", f"full{s}", len(SLOTS) * SLICE_BYTES))
        producer += [("copy", s, slot, i, f"full{s}") for slot in SLOTS]
        if p.producer_block_barrier:
            producer += [("wait", f"full{s}", r & 1), ("bar", "producer branch")]
        else:
            producer.append(("syncwarp",))
    actors = [Actor("producer", 0, WARP_SIZE, tuple(producer))]
    for w in range(consumers):
        for lanes, threads in (("lane 0", 1), ("lanes 1-31", WARP_SIZE - 1)):
            program = [("bar", "setup")] if p.setup_barrier else []
            for i in range(w, num_pages, consumers):
                s, r = i % stages, i // stages
                if p.consumer_waits_full:
                    program.append(("wait", f"full{s}", r & 1))
                program += [("read", s, slot, i) for slot in SLOTS]
                if p.consumer_syncwarp:
                    program.append(("syncwarp",))
                if not p.consumer_releases or (p.release_only_refilled and i + stages >= num_pages):
                    continue
                if named:
                    program.append(("bar_arrive", f"empty{s}"))
                elif p.empty == "lanes":
                    program.append(("arrive", f"empty{s}", threads))
                elif lanes == "lane 0":
                    program.append(("arrive", f"empty{s}", 1))
            actors.append(Actor(f"consumer {w} {lanes}", w + 1, threads, tuple(program)))
    return Programs(tuple(actors), mbarriers, named_barriers)


def reads_released_by_others(protocol: Protocol, num_pages: int, stages: int, consumers: int) -> list:
    """(actor, page) for every page a consumer lane group reads, that the producer refills
    later, and after which that lane group takes no part in a release of the stage itself.

    Such reads are ordered before the refill only through someone else's release: lanes
    1-31 reach lane 0's arrival through __syncwarp. The hardware (and this model) follows
    that chain; compute-sanitizer's racecheck 2025.3 reports a WAR on exactly these reads,
    lanes 1-31 and never lane 0, on every small bulk-copy ring released that way
    (chapter 5, "Why a named barrier").
    """
    found = []
    for actor in build_programs(protocol, num_pages, stages, consumers).actors[1:]:
        program = actor.program
        last_read = {op[3]: k for k, op in enumerate(program) if op[0] == "read"}
        for page, k in sorted(last_read.items()):
            if page + stages >= num_pages:
                continue  # never overwritten: nothing to order
            released = False
            for op in program[k + 1 :]:
                if op[0] == "read":
                    break
                released |= op[0] in ("arrive", "bar_arrive") and op[1] == f"empty{page % stages}"
            if not released:
                found.append((actor.name, page))
    return found


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


# Indices into State.flags: a condition that, once reached, stays true for the rest of the run.
STALE, BARRIER_ERROR, UNINITIALIZED, UNMATCHED = range(4)


@dataclass(frozen=True)
class State:
    pcs: tuple  # next instruction of each actor; len(program) once it exited
    at_bar: frozenset  # actors waiting at the block barrier
    at_warp: frozenset  # actors waiting at their warp barrier
    mbar: tuple  # (name, MBarrier) pairs, sorted by name
    smem: tuple  # smem[stage][slot] = page last landed there; None = left by an earlier block
    copies: tuple  # bulk copies in flight: (stage, slot, page, barrier)
    named: tuple = ()  # (name, threads arrived since the barrier last completed), sorted by name
    at_named: frozenset = frozenset()  # actors at bar.arrive/bar.sync, waiting for their warp's lanes
    named_waiting: frozenset = frozenset()  # actors counted at a bar.sync, waiting for it to complete
    flags: tuple = (False, False, False, False)  # see STALE, BARRIER_ERROR, UNINITIALIZED, UNMATCHED


@dataclass
class Run:
    """One schedule played to the end, with its trace."""

    protocol: str
    stale_reads: list = field(default_factory=list)  # (step, actor, stage, slot, expected, seen)
    barrier_errors: list = field(default_factory=list)
    uninitialized_waits: list = field(default_factory=list)
    unmatched_arrivals: list = field(default_factory=list)  # (step, barrier, threads) left at the end
    deadlock: bool = False
    trace: list = field(default_factory=list)  # (step, who, what)

    @property
    def ok(self) -> bool:
        return not (self.stale_reads or self.barrier_errors or self.uninitialized_waits or self.unmatched_arrivals
                    or self.deadlock)


def _set(flags: tuple, index: int) -> tuple:
    return flags[:index] + (True,) + flags[index + 1 :]


class Machine:
    """The model: `enabled(state)` lists who may step, `step(state, who)` runs one step."""

    def __init__(self, protocol: Protocol, num_pages: int, stages: int, consumers: int):
        self.protocol = protocol
        programs = build_programs(protocol, num_pages, stages, consumers)
        self.actors, self.counts, self.named_counts = programs.actors, programs.mbarriers, programs.named
        self.stages = stages
        self.warps = sorted({a.warp for a in self.actors})

    def initial(self) -> State:
        return State(
            pcs=tuple(0 for _ in self.actors),
            at_bar=frozenset(),
            at_warp=frozenset(),
            mbar=tuple(sorted((name, MBarrier()) for name in self.counts)),
            smem=tuple((None, None) for _ in range(self.stages)),
            copies=(),
            named=tuple(sorted((name, 0) for name in self.named_counts)),
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
        held = state.at_bar | state.at_warp | state.at_named | state.named_waiting  # released only by others
        ready = []
        for a in self.live(state):
            if a in held:
                continue
            op = self._op(state, a)
            if op[0] == "wait":
                barrier = mbar[op[1]]
                if barrier.initialized and not barrier.parity_done(op[2]):
                    continue
            ready.append(a)
        return ready + [("copy", k) for k in range(len(state.copies))]

    def step(self, state: State, who, events: Run | None = None) -> State:
        """Execute one step of actor `who` (an index) or land copy `who` = ("copy", k)."""
        flags = state.flags
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
        at_bar, at_warp, at_named, copies = state.at_bar, state.at_warp, state.at_named, state.copies
        name = self.actors[a].name
        kind = op[0]
        if kind == "init":
            for key in mbar:
                mbar[key] = MBarrier(initialized=True, pending=self.counts[key])
            self._log(events, name, "initializes every mbarrier")
        elif kind == "wait":
            b = mbar[op[1]]
            if not b.initialized:
                flags = _set(flags, UNINITIALIZED)
                if events is not None:
                    events.uninitialized_waits.append((len(events.trace), name, op[1]))
            self._log(events, name, f"passes try_wait.parity({op[2]}) on {op[1]} (phase {b.phase})")
        elif kind in ("arrive", "expect_tx"):
            b = mbar[op[1]]
            arrivals = op[2] if kind == "arrive" else 1
            if b.initialized:
                tx = b.tx + (op[2] if kind == "expect_tx" else 0)
                mbar[op[1]] = replace(b, tx=tx, pending=b.pending - arrivals).completes(self.counts[op[1]])
            what = f"arrive ({arrivals} thread{'s' * (arrivals > 1)})" if kind == "arrive" else f"arrive.expect_tx({op[2]} B)"
            self._log(events, name, f"{what} on {op[1]}")
        elif kind == "copy":
            copies = copies + ((op[1], op[2], op[3], op[4]),)
            self._log(events, name, f"issues bulk copy of page {op[3]} {op[2]} into stage {op[1]}")
        elif kind == "read":
            seen = state.smem[op[1]][SLOTS.index(op[2])]
            in_flight = any(c[0] == op[1] and c[1] == op[2] for c in copies)
            if seen != op[3]:
                flags = _set(flags, STALE)
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
        elif kind in ("bar_arrive", "bar_sync"):
            pcs[a] -= 1  # the warp's arrival counts once all its lanes are here
            at_named = at_named | {a}
            self._log(events, name, f"reaches {kind.replace('_', '.')} on named barrier {op[1]}")
        new = replace(state, pcs=tuple(pcs), at_bar=at_bar, at_warp=at_warp, at_named=at_named,
                      mbar=tuple(sorted(mbar.items())), copies=copies, flags=flags)
        return self._release(new, events)

    def _release(self, state: State, events: Run | None) -> State:
        """Open every barrier whose participants have all arrived: the block barrier, warp
        barriers, and named barriers (first counting each warp whose lanes have all reached
        its bar.arrive/bar.sync, then completing each barrier whose count is reached)."""
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
                    flags = _set(flags, BARRIER_ERROR)
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
                gathered = state.at_named & members
                if gathered and gathered >= members:
                    state = self._warp_arrives(state, w, gathered, events)
                    changed = True
            for name, count in state.named:
                if count >= self.named_counts[name]:
                    state = self._named_completes(state, name, count, events)
                    changed = True
        if not self.live(state) and not state.flags[UNMATCHED] and any(count for _, count in state.named):
            left = [(name, count) for name, count in state.named if count]
            if events is not None:
                events.unmatched_arrivals += [(len(events.trace), name, count) for name, count in left]
            self._log(events, "block", f"ends with arrivals nobody synchronized with: {left}")
            state = replace(state, flags=_set(state.flags, UNMATCHED))
        return state

    def _warp_arrives(self, state: State, warp: int, gathered: frozenset, events: Run | None) -> State:
        ops = {self._op(state, a) for a in gathered}
        flags = state.flags
        if len(ops) > 1:  # the lanes of one warp at different named-barrier instructions
            flags = _set(flags, BARRIER_ERROR)
            if events is not None:
                events.barrier_errors.append((len(events.trace), f"warp {warp} lanes at {sorted(ops)}"))
        kind, name = min(ops)
        threads = sum(self.actors[a].threads for a in gathered)
        named = dict(state.named)
        named[name] += threads
        pcs, waiting = list(state.pcs), state.named_waiting
        if kind == "bar_arrive":
            for a in gathered:
                pcs[a] += 1
        else:
            waiting = waiting | gathered
        self._log(events, f"warp {warp}", f"{kind.replace('_', '.')} counts {threads} threads on {name}: "
                                          f"{named[name]} of {self.named_counts[name]}")
        return replace(state, pcs=tuple(pcs), at_named=state.at_named - gathered, named_waiting=waiting,
                       named=tuple(sorted(named.items())), flags=flags)

    def _named_completes(self, state: State, name: str, count: int, events: Run | None) -> State:
        flags = state.flags
        if count > self.named_counts[name]:  # more threads than the barrier's count arrived
            flags = _set(flags, BARRIER_ERROR)
            if events is not None:
                events.barrier_errors.append((len(events.trace), f"{count} threads on {name}"))
        released = frozenset(a for a in state.named_waiting if self._op(state, a)[1] == name)
        pcs = list(state.pcs)
        for a in released:
            pcs[a] += 1
        named = dict(state.named)
        named[name] = 0
        who = ", ".join(self.actors[a].name for a in sorted(released)) or "nobody"
        self._log(events, f"named barrier {name}", f"completes ({count} threads), releases {who}")
        return replace(state, pcs=tuple(pcs), named_waiting=state.named_waiting - released,
                       named=tuple(sorted(named.items())), flags=flags)

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
    unmatched_arrivals: int  # reachable states after the block ended with named-barrier arrivals pending


def explore(protocol: Protocol, num_pages: int, stages: int, consumers: int, max_states: int = 2_000_000) -> Exploration:
    """Visit every reachable state (depth-first, each once) and count the bad ones."""
    machine = Machine(protocol, num_pages, stages, consumers)
    start = machine.initial()
    seen = {start}
    stack = [start]
    finals = stale = errors = uninit = deadlocks = unmatched = 0
    while stack:
        state = stack.pop()
        stale += state.flags[STALE]
        errors += state.flags[BARRIER_ERROR]
        uninit += state.flags[UNINITIALIZED]
        unmatched += state.flags[UNMATCHED]
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
    return Exploration(len(seen), finals, stale, errors, uninit, deadlocks, unmatched)


def shortest_failing_schedule(protocol: Protocol, num_pages: int = 3, stages: int = 2, consumers: int = 1):
    """Breadth-first search for the fewest steps that end in a stale read; None if none does."""
    machine = Machine(protocol, num_pages, stages, consumers)
    start = machine.initial()
    parent = {start: None}
    queue = deque([start])
    while queue:
        state = queue.popleft()
        if state.flags[STALE]:
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
