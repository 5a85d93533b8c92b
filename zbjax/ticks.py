"""Lockstep tick tables of a schedule: what every device does at every tick, and where data lives.

The lowering runs a schedule as a loop over *ticks*. At tick ``t`` every device runs at most one
action in its main lane; an action may run there once every action it depends on ran at a tick
before ``t`` (data produced during tick ``t`` is moved at the end of tick ``t`` and usable from
``t + 1``). A tick lasts as long as its slowest device, so when costs are known a device that
finishes early may run its next actions in *lanes* after the main one (``pack_ticks``): W
(which sends nothing and needs only its own stage's B), and also F, B or BW whose messages
arrived at an earlier tick, so the time the tick spends anyway goes to work. ``segment_ticks``
may lay the ticks out the other way round: first where the devices meet (the exchanges), then
each device's actions between them. This module turns a ``Schedule`` into
integer tables indexed ``[tick, device, lane]``, routes the messages between devices through
slots, and places the data that outlives a tick. Pure Python and NumPy, no JAX.

Data that outlives a tick has a life per (stage, microbatch), on the device that runs it:

- **residuals**: from its F until its B (or BW), or until its W when W reads some of them
  (``residuals_until_weight``). F writes the residuals, B (or BW) reads them.
- **kept residuals**: from its F until its W (or BW), for the stages that have any
  (``kept``): F writes the residuals W reads too (the ``x`` of ``x @ A``), B and W both read
  them there, so B copies nothing for W.
- **stash**: from its B until its W: B writes what W needs that F did not store (the output
  cotangents of the weight matmuls), W reads it.

The lowering keeps these in *arenas* (``arenas``): flat buffers where each item takes its own
stage's size, packed with the items alive at the same time (``pack_intervals``). The tables
count the most items of each kind a device holds at once.

Messages take **message slots**: one per *message* from the tick it is sent until the tick it
is read. A message is one stage-graph edge's values for one microbatch (sent by F of the edge's
source to F of its destination) or their cotangents (sent by B/BW of the destination to B/BW
of the source). Same-device edges are messages with shift 0 (a local copy). Tables name the
index one past the last message slot (a *spare*) where an action reads nothing or nothing
arrives: every tick stores whatever arrives.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import heapq
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from zbjax import schedules
from zbjax.errors import ScheduleError
from zbjax.schedules.dag import topological
from zbjax.schedules.ir import Action, Costs, Schedule
from zbjax.schedules.simulate import backward_kinds, deadlock, dependencies

#: Codes of the ``kind`` table; 0 means the device idles at that tick.
IDLE, FORWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, BACKWARD = 0, 1, 2, 3, 4
KIND_CODES: dict[str, int] = {
    "F": FORWARD,
    "B": BACKWARD_INPUT,
    "W": BACKWARD_WEIGHT,
    "BW": BACKWARD,
}
KIND_NAMES: dict[int, str] = {code: name for name, code in KIND_CODES.items()}
#: The order in which a device runs the actions of one tick, by kind (lanes in order within a
#: kind): every F first, then B, W and BW. A tick's actions depend on each other only within a
#: stage (F before its B or BW, B before its W), which this order keeps, and every arena is
#: then written (F: residuals and kept residuals, B: stash) before it is read, so XLA updates
#: the arenas in place instead of copying one that a later lane would write after an earlier
#: lane read it.
PHASES: dict[str, int] = {"F": 0, "B": 1, "W": 2, "BW": 3}


@dataclass(frozen=True)
class MessageEdge:
    """A stage-graph edge as the tables see it: its stages and whether cotangents flow back."""

    src: int
    dst: int
    has_cotangent: bool = True


@dataclass(frozen=True)
class TickTables:
    """Integer tables ``[num_ticks, num_devices, num_lanes, ...]`` that drive the tick loop.

    Lane 0 of a tick is a device's main action, lanes 1.. the actions packed after it
    (``pack_ticks``); the device runs them by ``PHASES`` (every F, then B, W, BW; lanes in
    order within a kind). ``kind``/``stage``/``microbatch`` say which
    action runs in a lane (kind ``IDLE`` = none); where its data lies between actions is the
    arenas' business (``arenas``), and ``num_residual_slots``, ``num_kept_slots`` and
    ``num_stash_slots`` count the most (stage, microbatch) items of each kind a device holds at
    once. ``message_read[t, d, lane, j]`` is the message slot holding the j-th input of
    the action: F's in-edges or B/BW's out-edge cotangents, in edge order (the spare slot past
    the last). ``send_position[t, d, lane, j]`` is where in its shift's payload the j-th message
    the lane's action sends (``outgoing_messages`` order) goes: the messages a device sends over
    one shift in one tick, from every lane, take consecutive positions and travel in one
    exchange. ``message_write[t, d, k, j]`` is where device ``d`` stores the message at
    position ``j`` that arrives over ``shifts[k]`` at the end of tick ``t`` (the spare slot when
    none arrives). A message sent over shift ``k`` goes from device ``d`` to device ``(d +
    shifts[k]) % num_devices``.
    """

    kind: np.ndarray
    stage: np.ndarray
    microbatch: np.ndarray
    message_read: np.ndarray
    message_write: np.ndarray
    send_position: np.ndarray
    shifts: tuple[int, ...]
    messages_per_shift: tuple[int, ...]
    num_residual_slots: int
    num_kept_slots: int
    num_stash_slots: int
    num_message_slots: int
    edges: tuple[MessageEdge, ...]
    placement: tuple[int, ...]

    @property
    def num_ticks(self) -> int:
        """Returns the number of ticks of the loop."""
        return int(self.kind.shape[0])

    @property
    def num_devices(self) -> int:
        """Returns the number of pipeline devices (columns of the tables)."""
        return int(self.kind.shape[1])

    @property
    def num_lanes(self) -> int:
        """Returns the number of lanes per tick: the main one and those packed after it."""
        return int(self.kind.shape[2])

    @property
    def exchanges(self) -> np.ndarray:
        """Returns ``[num_ticks, shifts]`` booleans: whether any message travels over
        ``shifts[k]`` at the end of tick ``t``. The lowering skips the ``ppermute`` (and with it
        the devices' wait for each other) in the ticks where this is False."""
        return self.payload_blocks > 0

    @property
    def payload_blocks(self) -> np.ndarray:
        """Returns ``[num_ticks, shifts]``: how many leading positions of ``shifts[k]``'s
        payload travel at the end of tick ``t`` (0 where nothing does, or for shift 0, a local
        copy). The lowering sends those and no more."""
        arrives = self.message_write != self.num_message_slots
        positions = np.arange(1, arrives.shape[3] + 1)
        blocks = np.where(arrives, positions, 0).max(axis=(1, 3), initial=0)
        return np.where(np.asarray(self.shifts) != 0, blocks, 0)

    @property
    def num_packed(self) -> int:
        """Returns the number of actions that run after another in their tick (lanes 1..)."""
        return int((self.kind[:, :, 1:] != IDLE).sum())

    @functools.cached_property
    def action_times(self) -> dict[Action, int]:
        """Returns every action's time on the clock its device runs them by: (tick, phase,
        lane), as one integer (``PHASES``; lanes in order within a phase)."""
        num_phases, num_lanes = len(PHASES), self.num_lanes
        times = {}
        for t, d, lane in zip(*np.nonzero(self.kind != IDLE), strict=True):
            name = KIND_NAMES[int(self.kind[t, d, lane])]
            action = Action(name, int(self.stage[t, d, lane]), int(self.microbatch[t, d, lane]))
            times[action] = (int(t) * num_phases + PHASES[name]) * num_lanes + int(lane)
        return times


def with_lives(
    tables: TickTables, kept: Sequence[bool], residuals_until_weight: Sequence[bool]
) -> TickTables:
    """Returns ``tables`` with the item counts (``num_residual_slots`` ...) of the lives that
    ``kept`` and ``residuals_until_weight`` give (as ``tick_tables`` takes them); nothing else in
    the tables depends on them."""
    lives = _lifetimes(
        tables.action_times, tables.placement, tables.num_devices, kept, residuals_until_weight
    )
    # Within a kind, items start only at their writer's phase and end at a later one, so the
    # most alive at once on this clock is the most alive on any clock that keeps the phases.
    residual, kept_count, stash = (
        max((_most_alive([(a, b, 1) for a, b, _ in per_device]) for per_device in group), default=0)
        for group in lives
    )
    counted = dataclasses.replace(
        tables, num_residual_slots=residual, num_kept_slots=kept_count, num_stash_slots=stash
    )
    counted.__dict__["action_times"] = tables.action_times  # the same actions: keep the cache
    return counted


def lockstep_ticks(schedule: Schedule) -> dict[Action, int]:
    """Returns the tick at which each action runs when all devices advance in lockstep.

    Each device runs its actions in order, one per tick; an action runs at the first tick after
    every one of its dependencies. Raises ``ScheduleError`` when an action is placed on the
    wrong device, a dependency is never scheduled, or the order deadlocks.
    """
    return {action: tick for action, (tick, _) in pack_ticks(schedule).items()}


def _checked_dependencies(schedule: Schedule) -> dict[Action, tuple[Action, ...]]:
    """Returns every action's dependencies, raising ``ScheduleError`` on a malformed schedule."""
    scheduled: set[Action] = set()
    for device, _, action in schedule.all_actions():
        if action.stage >= schedule.num_stages:
            raise ScheduleError(
                f"action {action} on device {device} names stage {action.stage}, but the "
                f"schedule has {schedule.num_stages} stages"
            )
        if schedule.placement[action.stage] != device:
            raise ScheduleError(
                f"placement rule: action {action} runs on device {device} but stage "
                f"{action.stage} is placed on device {schedule.placement[action.stage]}; "
                "run each stage's actions on its own device"
            )
        if action in scheduled:
            raise ScheduleError(f"action {action} appears twice; run every action once")
        scheduled.add(action)
    kinds = backward_kinds(schedule)
    deps = {a: dependencies(schedule, a, kinds) for a in scheduled}
    for action, needs in deps.items():
        for dep in needs:
            if dep not in scheduled:
                raise ScheduleError(
                    f"dependency rule: {action} needs {dep}, which no device runs; "
                    "add it to the schedule"
                )
    return deps


def _data_ready(action: Action, dep: Action, dep_at: tuple[int, int], at: tuple[int, int]) -> bool:
    """Returns whether ``action`` at (tick, lane) ``at`` finds the data of its dependency
    ``dep`` run at ``dep_at``: another stage's moves at the end of its tick (an earlier tick);
    its own stage's stays on the device (an earlier tick or lane)."""
    return dep_at < at if dep.stage == action.stage else dep_at[0] < at[0]


def _message_counts(schedule: Schedule) -> dict[tuple[int, bool], dict[int, int]]:
    """Returns, per (stage, backward), how many messages its F (backward False) or its B/BW
    (True) sends over each shift (``outgoing_messages``; shift 0 stays on the device), every
    edge counted as carrying cotangents."""
    edges = [MessageEdge(src, dst) for src, dst in schedule.edges]
    counts: dict[tuple[int, bool], dict[int, int]] = {}
    for stage in range(schedule.num_stages):
        for backward in (False, True):
            count: dict[int, int] = {}
            for shift, _, _ in outgoing_messages(
                edges, schedule.placement, schedule.num_devices, stage, backward
            ):
                count[shift] = count.get(shift, 0) + 1
            counts[(stage, backward)] = count
    return counts


def _messages_of(counts: dict[tuple[int, bool], dict[int, int]], action: Action) -> dict[int, int]:
    """Returns how many messages ``action`` sends over each shift (none for W)."""
    if action.kind == "W":
        return {}
    return counts.get((action.stage, action.kind != "F"), {})


def _sends(counts: dict[tuple[int, bool], dict[int, int]], action: Action) -> frozenset[int]:
    """Returns the shifts ``action``'s messages travel over (none for W)."""
    return frozenset(_messages_of(counts, action))


#: Kinds of action ``pack_ticks`` may run after a device's main action by default: W only.
WEIGHT_ONLY = ("W",)
#: Every kind of action.
ANY_KIND = ("F", "B", "W", "BW")


def pack_ticks(
    schedule: Schedule,
    costs: Costs | None = None,
    slack: float = 0.0,
    lanes: int = 1,
    kinds: Sequence[str] = WEIGHT_ONLY,
    share_exchanges: bool = False,
) -> dict[Action, tuple[int, int]]:
    """Returns (tick, lane) of every action: lockstep ticks, with more actions packed into lanes.

    Each device runs its actions in order. At every tick each device whose next action has all
    its dependencies done at earlier ticks runs it in lane 0 (the main lane). With ``costs``,
    the tick lasts as long as the longest of those actions; a device then also runs its next
    actions in lanes ``1..lanes``, while each is of one of ``kinds``, can run (a dependency on
    another stage done at an earlier tick, since messages move at the end of a tick; one on
    its own stage done earlier, at an earlier tick or lane), sends over no shift another of
    the device's actions sends over in this tick unless ``share_exchanges`` (then their
    messages travel together in the tick's exchange), and the device's time in the tick stays
    within the tick's length times ``1 + slack``. Packing greedily, a tick that takes every
    sender that fits tends to run late for the next; that is why sharing is optional and
    ``choose_ticks`` tries both. Without ``costs`` nothing is packed (every lane is 0). Raises
    ``ScheduleError`` when an action is placed on the wrong device, a dependency is never
    scheduled, or the order deadlocks.
    """
    deps = _checked_dependencies(schedule)
    counts = _message_counts(schedule)
    num_stages = schedule.num_stages
    position: dict[Action, tuple[int, int]] = {}
    cursor = [0] * schedule.num_devices
    remaining = len(deps)
    tick = 0

    def packable(action: Action, lane: int) -> bool:
        return action.kind in kinds and all(
            dep in position and _data_ready(action, dep, position[dep], (tick, lane))
            for dep in deps[action]
        )

    while remaining:
        main = {}
        for device, program in enumerate(schedule.actions):
            if cursor[device] < len(program):
                action = program[cursor[device]]
                if all(position.get(dep, (tick,))[0] < tick for dep in deps[action]):
                    main[device] = action
        if not main:
            raise deadlock(schedule, cursor)
        for device, action in main.items():
            position[action] = (tick, 0)
            cursor[device] += 1
        remaining -= len(main)
        if costs is not None:
            limit = max(costs.of(a, num_stages) for a in main.values()) * (1.0 + slack)
            for device, action in main.items():
                program = schedule.actions[device]
                used = costs.of(action, num_stages)
                sent = _sends(counts, action)
                for lane in range(1, lanes + 1):
                    if cursor[device] == len(program):
                        break
                    nxt = program[cursor[device]]
                    cost = costs.of(nxt, num_stages)
                    if (
                        not packable(nxt, lane)
                        or (sent & _sends(counts, nxt) and not share_exchanges)
                        or used + cost > limit * (1.0 + 1e-9)
                    ):
                        break
                    position[nxt] = (tick, lane)
                    used += cost
                    sent |= _sends(counts, nxt)
                    cursor[device] += 1
                    remaining -= 1
        tick += 1
    return position


def _stretch_time(
    schedule: Schedule,
    positions: dict[Action, tuple[int, int]],
    costs: Costs,
    every_tick: bool,
    contention: float = 1.0,
) -> float:
    """Returns the time of the ticks ``positions`` run ``schedule`` in when the devices wait for
    each other at the end of every tick (``every_tick``) or of the ticks that exchange
    (``exchange_messages``), paying the tick's exchange (``Costs.exchange`` of its largest
    payload; one message where nothing is sent): between two waits every device runs its
    actions (all lanes) back to back, and the stretch lasts as long as the busiest device's,
    times ``contention`` when more than one device computes in it."""
    messages = exchange_messages(schedule, positions)
    busy: dict[int, dict[int, float]] = {}
    for action, (tick, _) in positions.items():
        devices = busy.setdefault(tick, {})
        device = schedule.placement[action.stage]
        devices[device] = devices.get(device, 0.0) + costs.of(action, schedule.num_stages)
    total, stretch = 0.0, {}
    last = max(busy, default=-1)
    for tick in range(last + 1):
        for device, seconds in busy.get(tick, {}).items():
            stretch[device] = stretch.get(device, 0.0) + seconds
        waited = every_tick or tick in messages
        if waited or tick == last:
            total += max(stretch.values(), default=0.0) * (contention if len(stretch) > 1 else 1)
            total += costs.exchange(messages.get(tick, 1)) if waited else 0.0
            stretch = {}
    return total


def tick_time(schedule: Schedule, positions: dict[Action, tuple[int, int]], costs: Costs) -> float:
    """Returns the time of the ticks ``positions`` run ``schedule`` in if every tick ended in an
    exchange: each tick as long as its busiest device's actions, every lane counted, plus its
    exchange (``Costs.exchange``)."""
    return _stretch_time(schedule, positions, costs, every_tick=True)


def exchange_ticks(schedule: Schedule, positions: dict[Action, tuple[int, int]]) -> set[int]:
    """Returns the ticks that end in an exchange: those in which an action sends a message to
    another device (``TickTables.exchanges``); the lowering skips the ``ppermute`` elsewhere."""
    return set(exchange_messages(schedule, positions))


def exchange_messages(
    schedule: Schedule, positions: dict[Action, tuple[int, int]]
) -> dict[int, int]:
    """Returns, per tick that ends in an exchange, the most messages one device sends over one
    shift in it: the messages its largest payload carries (``TickTables.payload_blocks``)."""
    counts = _message_counts(schedule)
    sent: dict[tuple[int, int, int], int] = {}
    for action, (tick, _) in positions.items():
        device = schedule.placement[action.stage]
        for shift, n in _messages_of(counts, action).items():
            if shift:  # shift 0 stays on the device
                key = (tick, device, shift)
                sent[key] = sent.get(key, 0) + n
    most: dict[int, int] = {}
    for (tick, _, _), n in sent.items():
        most[tick] = max(most.get(tick, 0), n)
    return most


def barrier_time(
    schedule: Schedule,
    positions: dict[Action, tuple[int, int]],
    costs: Costs,
    contention: float = 1.0,
) -> float:
    """Returns the time of the ticks ``positions`` run ``schedule`` in, the devices waiting for
    each other only at exchanges (``exchange_ticks``), as the lowering runs them: between two
    exchanges every device runs its actions back to back, and the stretch lasts as long as the
    busiest device's; every exchange adds ``Costs.exchange`` of its largest payload (the
    messages one device sends over one shift in the tick). At most ``tick_time``, which waits at
    every tick. ``contention`` stretches the stretches in which more than one device computes
    (devices that share a host's cores run slower together than alone)."""
    return _stretch_time(schedule, positions, costs, every_tick=False, contention=contention)


#: The most (device 0, device 1) frontier pairs ``segment_ticks`` searches on two devices; past
#: it (about m = 70 microbatches of a one-stage-per-device schedule) ``choose_ticks`` does
#: without it.
SEGMENT_STATES = 50_000
#: The frontiers ``segment_ticks`` expands on more than two devices per weight of
#: ``SEGMENT_WEIGHTS`` (about 60 us each at 8 devices): a search that has not ended after the
#: first share goes on with the next weight, and past the last one ``choose_ticks`` does
#: without it.
SEGMENT_EXPANSIONS = 5_000
#: How much the search on more than two devices trusts its estimate of the time left, share by
#: share: 1 is exact A* (the least time); a larger weight w reaches the end sooner and costs at
#: most w times the least.
SEGMENT_WEIGHTS = (1.0, 1.05, 1.25, 2.0)
#: The most lanes ``segment_ticks`` gives a tick (the main one and those after it), as many as
#: ``PACKINGS`` use: each lane adds a conditional per (kind, stage) to the compiled tick.
SEGMENT_LANES = 3

#: A device's run in a segment: (end, busy seconds, whether it sends, the most messages it
#: sends over one shift).
_Run = tuple[int, float, bool, int]


class _Segments:
    """The model ``segment_ticks`` searches: each device's programs cut into runs, the devices
    waiting for each other after each segment (one run per device)."""

    def __init__(self, schedule: Schedule, costs: Costs, lanes: int):
        self.schedule, self.costs, self.lanes = schedule, costs, lanes
        programs = schedule.actions
        self.sizes = tuple(len(p) for p in programs)
        deps = _checked_dependencies(schedule)
        counts = _message_counts(schedule)
        index = {a: (d, i) for d, p in enumerate(programs) for i, a in enumerate(p)}
        self.index = index
        # need[d][i]: how far other devices' programs must have run in earlier segments for
        # action i of device d, as (device, one past its last dependency there).
        self.need: list[list[tuple[tuple[int, int], ...]]] = []
        for program in programs:
            rows = []
            for action in program:
                needed: dict[int, int] = {}
                for dep in deps[action]:
                    if dep.stage != action.stage:
                        other, j = index[dep]
                        needed[other] = max(needed.get(other, 0), j + 1)
                rows.append(tuple(needed.items()))
            self.need.append(rows)
        # How many messages each action sends over each shift to another device.
        self.messages = [
            [{s: n for s, n in _messages_of(counts, a).items() if s} for a in p] for p in programs
        ]
        self.sends = [[bool(m) for m in p] for p in self.messages]
        self.seconds = [[costs.of(a, schedule.num_stages) for a in p] for p in programs]
        self.deps = deps

    def extents(self, d: int, frontier: tuple[int, ...]) -> list[_Run]:
        """Returns every run device d may take from ``frontier``, shortest first: while what
        each action needs from other stages ran in earlier segments, and for at most ``lanes``
        actions from its first that sends a message on (every message it sends in the segment
        travels in the segment's one exchange)."""
        out, busy, sender = [(frontier[d], 0.0, False, 0)], 0.0, None
        per_shift: dict[int, int] = {}
        for i in range(frontier[d], self.sizes[d]):
            if any(frontier[o] < j for o, j in self.need[d][i]):
                break
            if self.sends[d][i] and sender is None:
                sender = i
            if sender is not None and i - sender >= self.lanes:
                break
            busy += self.seconds[d][i]
            for shift, n in self.messages[d][i].items():
                per_shift[shift] = per_shift.get(shift, 0) + n
            out.append((i + 1, busy, sender is not None, max(per_shift.values(), default=0)))
        return out

    def segment_cost(
        self, runs: Sequence[_Run], end: tuple[int, ...]
    ) -> tuple[float, float] | None:
        """Returns what a segment of ``runs`` ending at ``end`` costs, as its busiest device's
        time and its exchange's, or None where it may not end there: devices wait for each other
        only at exchanges, so a segment without one would run on into the next; only the last
        may go without."""
        exchange = any(r[2] for r in runs)
        if not exchange and end != self.sizes:
            return None
        comm = self.costs.exchange(max(r[3] for r in runs)) if exchange else 0.0
        return max(r[1] for r in runs), comm

    def pairs(self) -> list[tuple[int, ...]] | None:
        """Returns the frontiers after each segment of the least-time cutting of two devices'
        programs: exact dynamic programming over every pair of frontiers."""
        sizes = self.sizes
        best: dict[tuple[int, ...], tuple[float, tuple[int, ...] | None]] = {(0, 0): (0.0, None)}
        for c0 in range(sizes[0] + 1):
            for c1 in range(sizes[1] + 1):
                if (c0, c1) not in best:
                    continue
                base = best[(c0, c1)][0]
                runs1 = self.extents(1, (c0, c1))
                for run0 in self.extents(0, (c0, c1)):
                    for run1 in runs1:
                        end = (run0[0], run1[0])
                        if end == (c0, c1):
                            continue
                        cost = self.segment_cost((run0, run1), end)
                        if cost is None:
                            continue
                        total = base + cost[0] + cost[1]
                        if total < best.get(end, (float("inf"),))[0]:
                            best[end] = (total, (c0, c1))
        return _frontiers(best, sizes)

    def time_left(self) -> list[list[float]]:
        """Returns, per device and program index, a lower bound on the time from that action's
        start to the step's end: the longest chain of actions from it (the device's next
        actions, and what depends on it on other stages, each such message costing at least one
        exchange)."""
        users: dict[Action, list[Action]] = {a: [] for a in self.index}
        for action, needs in self.deps.items():
            for dep in needs:
                if dep.stage != action.stage:
                    users[dep].append(action)
        comm = self.costs.exchange(1)
        left = [[0.0] * (n + 1) for n in self.sizes]
        # Every action after the device's earlier actions and what it needs from other stages;
        # then walked backwards, each action after its device's next and its users.
        actions = list(self.index)
        number = {a: n for n, a in enumerate(actions)}
        after: list[list[int]] = [[number[u] for u in users[a]] for a in actions]
        for program in self.schedule.actions:
            for a, b in zip(program, program[1:], strict=False):
                after[number[a]].append(number[b])
        for action in (actions[n] for n in reversed(topological(after))):
            d, i = self.index[action]
            rest = left[d][i + 1]
            for user in users[action]:
                u, j = self.index[user]
                rest = max(rest, comm + left[u][j])
            left[d][i] = self.seconds[d][i] + rest
        return left

    def best_first(self) -> list[tuple[int, ...]] | None:
        """Returns the frontiers after each segment of a least-time cutting of the devices'
        programs, found by best-first search (A*) over frontiers: from each frontier, for each
        segment length (the time of one of the devices' runs), every device takes its longest
        run that fits, which loses nothing where an exchange costs the same whatever it carries
        (a frontier further on every device, reached as soon, is as good). Estimates the time
        left by ``time_left`` (never more than it is, so the first search is exact); after
        ``SEGMENT_EXPANSIONS`` frontiers it weights the estimate by the next of
        ``SEGMENT_WEIGHTS``, and gives up (None) after the last."""
        sizes = self.sizes
        left = self.time_left()

        def estimate(frontier: tuple[int, ...]) -> float:
            return max(left[d][i] for d, i in enumerate(frontier))

        start = tuple(0 for _ in sizes)
        best: dict[tuple[int, ...], tuple[float, tuple[int, ...] | None]] = {start: (0.0, None)}
        heap = [(estimate(start), 0.0, start)]
        expanded, weight = 0, SEGMENT_WEIGHTS[0]
        while heap:
            _, base, frontier = heapq.heappop(heap)
            if base > best[frontier][0]:
                continue  # reached sooner since it was queued
            if frontier == sizes:
                return _frontiers(best, sizes)
            expanded += 1
            if expanded % SEGMENT_EXPANSIONS == 0:
                share = expanded // SEGMENT_EXPANSIONS
                if share == len(SEGMENT_WEIGHTS):
                    return None
                weight = SEGMENT_WEIGHTS[share]
                heap = [(g + weight * estimate(f), g, f) for _, g, f in heap if g <= best[f][0]]
                heapq.heapify(heap)
            runs = [self.extents(d, frontier) for d in range(len(sizes))]
            # Every device's longest run within each limit, ascending: a run's time grows with
            # its length, so each device's pick only moves on as the limit grows.
            at = [0] * len(sizes)
            for limit in sorted({r[1] for device_runs in runs for r in device_runs[1:]}):
                bound = limit * (1 + 1e-9)
                for d, device_runs in enumerate(runs):
                    k = at[d]
                    while k + 1 < len(device_runs) and device_runs[k + 1][1] <= bound:
                        k += 1
                    at[d] = k
                picks = [device_runs[k] for device_runs, k in zip(runs, at, strict=True)]
                end = tuple(r[0] for r in picks)
                if end == frontier:
                    continue
                cost = self.segment_cost(picks, end)
                if cost is None:
                    continue
                total = base + cost[0] + cost[1]
                if total < best.get(end, (float("inf"),))[0] * (1 - 1e-12):
                    best[end] = (total, frontier)
                    heapq.heappush(heap, (total + weight * estimate(end), total, end))
        return None

    def positions(self, frontiers: Sequence[tuple[int, ...]]) -> dict[Action, tuple[int, int]]:
        """Returns (tick, lane) of every action, the segments between ``frontiers`` becoming as
        few ticks as their senders and ``lanes`` allow: each device's actions one per tick, its
        first sender in the segment's last tick (the only one that exchanges), and what comes
        after it (or, without a sender, what does not fit before) in lanes of that tick."""
        programs, lanes = self.schedule.actions, self.lanes
        positions: dict[Action, tuple[int, int]] = {}
        tick = 0
        for start, end in zip(frontiers, frontiers[1:], strict=False):
            runs = [programs[d][start[d] : end[d]] for d in range(len(programs))]
            senders = [  # a run's first sender, if any
                next((k for k in range(len(run)) if self.sends[d][start[d] + k]), None)
                for d, run in enumerate(runs)
            ]
            length = max(
                1,
                *(
                    len(run) - lanes + 1 if k is None else k + 1
                    for run, k in zip(runs, senders, strict=True)
                ),
            )
            last = tick + length - 1
            for run, sender in zip(runs, senders, strict=True):
                first = tick if sender is None else last - sender
                for k, action in enumerate(run):
                    positions[action] = (
                        (first + k, 0) if first + k <= last else (last, first + k - last)
                    )
            tick += length
        return positions


def _frontiers(
    best: dict[tuple[int, ...], tuple[float, tuple[int, ...] | None]], sizes: tuple[int, ...]
) -> list[tuple[int, ...]] | None:
    """Returns the frontiers from the start to ``sizes`` along ``best``'s back links."""
    if sizes not in best:
        return None
    frontiers = [sizes]
    while best[frontiers[-1]][1] is not None:
        frontiers.append(best[frontiers[-1]][1])
    return frontiers[::-1]


def segment_ticks(
    schedule: Schedule, costs: Costs, lanes: int = SEGMENT_LANES
) -> dict[Action, tuple[int, int]] | None:
    """Returns (tick, lane) of every action of ``schedule`` placed so that the devices meet at
    the fewest, best-placed exchanges: the least ``barrier_time`` over the ways of cutting the
    devices' programs into *segments* (each device's next run of actions, the devices waiting
    for each other after each segment). None on one device, for a stage graph with an edge
    inside a device (a V placement: its local messages need a tick, not an exchange, between
    sender and reader), and where the search gives up (``SEGMENT_STATES`` on two devices,
    ``SEGMENT_EXPANSIONS`` on more).

    A segment may hold an action only when everything it needs from another stage ran in an
    earlier segment, and at most ``lanes`` actions per device from its first action that sends a
    message on (every message a device sends in the segment travels in its one exchange); every
    segment but the last ends in an exchange (some action sends to another device). It costs
    its busiest device's time plus, when it exchanges, ``Costs.exchange`` of the most messages
    one device sends over one shift in it, which is what ``barrier_time`` charges its ticks. On
    two devices the search is exact (dynamic programming over the pairs of frontiers); on more,
    best-first over frontiers (``_Segments.best_first``: exact where an exchange costs the same
    whatever it carries, and within its first ``SEGMENT_EXPANSIONS``). A segment becomes as few
    ticks as its senders and ``lanes`` allow (``_Segments.positions``). ``pack_ticks`` fixes the
    ticks first and packs into them; this places the exchanges first.
    """
    placement = schedule.placement
    if schedule.num_devices < 2 or any(placement[a] == placement[b] for a, b in schedule.edges):
        return None
    model = _Segments(schedule, costs, lanes)
    if schedule.num_devices == 2:
        if (model.sizes[0] + 1) * (model.sizes[1] + 1) > SEGMENT_STATES:
            return None
        frontiers = model.pairs()
    else:
        frontiers = model.best_first()
    return None if frontiers is None else model.positions(frontiers)


#: How far past the tick's longest main action ``choose_ticks`` tries letting packed actions run.
PACKING_SLACKS = (0.0, 0.1, 0.2, 0.3, 0.5, 1.0, 1.5, 2.0, 3.0)
#: The (kinds, lanes) ``choose_ticks`` tries, in order: W in one lane after the main action,
#: then any action in one lane, then any action in two lanes.
PACKINGS = ((WEIGHT_ONLY, 1), (ANY_KIND, 1), (ANY_KIND, 2))


def packings(schedule: Schedule, costs: Costs) -> Iterator[dict[Action, tuple[int, int]]]:
    """Yields the packings of fixed ticks ``choose_ticks`` tries, in its order: plain lockstep
    ticks, then ``pack_ticks`` with each of ``PACKINGS`` and ``PACKING_SLACKS``, first keeping
    a tick's senders on distinct shifts, then letting them share the exchange."""
    yield pack_ticks(schedule)
    for share in (False, True):
        for kinds, lanes in PACKINGS:
            if share and kinds == WEIGHT_ONLY:
                continue  # W sends nothing: the same packing
            for slack in PACKING_SLACKS:
                yield pack_ticks(schedule, costs, slack, lanes, kinds, share)


def choose_ticks(
    schedule: Schedule, costs: Costs | None, segments: bool = True
) -> dict[Action, tuple[int, int]]:
    """Returns the packing of ``schedule`` with the least ``barrier_time`` under ``costs``.

    Candidates are the ``packings`` of fixed ticks, then ``segment_ticks`` (unless
    ``segments`` is False: its search takes most of the time, seconds on 8 devices); a
    candidate must be faster than the earlier ones to win, so plain ticks stay unless packing
    pays, and fewer lanes unless more pay. Without ``costs``: plain lockstep ticks.
    """
    if costs is None:
        return pack_ticks(schedule)
    best, best_time = None, float("inf")
    found = segment_ticks(schedule, costs) if segments else None
    for candidate in (*packings(schedule, costs), found):
        if candidate is None:
            continue
        seconds = barrier_time(schedule, candidate, costs)
        if seconds < best_time * (1.0 - 1e-9):
            best, best_time = candidate, seconds
    return best


def fuse_backward(schedule: Schedule, stages: Sequence[int]) -> Schedule:
    """Returns ``schedule`` with the backward of ``stages`` fused: each B becomes a BW where it
    stands and its W is dropped. Meant for stages whose B computes nothing (no differentiable
    input to send a cotangent to): split, they spend a tick on an empty B and hold W's inputs
    until W; fused, their whole backward runs where B did."""
    fused = set(stages)
    return schedule.with_actions(
        [
            [
                Action("BW", a.stage, a.microbatch) if a.kind == "B" and a.stage in fused else a
                for a in program
                if not (a.kind == "W" and a.stage in fused)
            ]
            for program in schedule.actions
        ]
    )


#: The most stages ``plan_ticks`` tries fusing one by one (more are tried all at once).
FUSE_ONE_BY_ONE = 4


def plan_ticks(
    schedule: Schedule,
    costs: Costs | None,
    empty_backward: Sequence[int] = (),
    segments: bool = True,
) -> tuple[Schedule, dict[Action, tuple[int, int]]]:
    """Returns the schedule to run and its ticks (``choose_ticks``): ``schedule``, or it with
    the backward of some stages fused (``fuse_backward``) where ``costs`` say the ticks get
    shorter. Always ``schedule`` without ``costs``.

    First the stages in ``empty_backward`` (those whose B computes nothing), fused when that
    runs in no more ``barrier_time`` (fused, such a stage writes no stash for W and frees its
    residuals at once). Then, one by one (the largest saving first), every other split stage
    whose fused backward costs less than its B and W (``Costs.bw`` below ``b + w``: the fused
    backward neither writes W's stash nor reads it back), fused when that makes the ticks
    strictly shorter: where splitting costs more than deferring W saves, the stage runs its
    backward whole, as 1f1b would. Past ``FUSE_ONE_BY_ONE`` such stages, they are tried all at
    once instead (each try plans the ticks anew, up to a second on 8 devices). Costs without
    ``bw`` (``b + w``) fuse none of these. ``segments`` goes to ``choose_ticks``.

    The fusing is greedy, so the plan with the segment search can come out slower than the
    one without it (a stage fused or not on the way); with ``segments``, both are made and the
    faster returned."""
    screened = _planned(schedule, costs, empty_backward, False)
    if not segments or costs is None:
        return screened
    return _with_segments(schedule, costs, empty_backward, screened)


def _with_segments(
    schedule: Schedule,
    costs: Costs,
    empty_backward: Sequence[int],
    screened: tuple[Schedule, dict[Action, tuple[int, int]]],
) -> tuple[Schedule, dict[Action, tuple[int, int]]]:
    """Returns the faster of ``screened`` (the plan without the segment search) and the plan
    with it."""
    searched = _planned(schedule, costs, empty_backward, True)
    faster = barrier_time(*searched, costs) < barrier_time(*screened, costs)
    return searched if faster else screened


def _planned(
    schedule: Schedule, costs: Costs | None, empty_backward: Sequence[int], segments: bool
) -> tuple[Schedule, dict[Action, tuple[int, int]]]:
    positions = choose_ticks(schedule, costs, segments)
    if costs is None:
        return schedule, positions
    split = {a.stage for _, _, a in schedule.all_actions() if a.kind == "W"}
    best = (barrier_time(schedule, positions, costs), schedule, positions)

    def fused_if(stages: Sequence[int], strictly: bool) -> None:
        nonlocal best
        fused = fuse_backward(best[1], stages)
        fused_positions = choose_ticks(fused, costs, segments)
        seconds = barrier_time(fused, fused_positions, costs)
        if seconds < best[0] * (1.0 - 1e-9) or (not strictly and seconds <= best[0] * (1 + 1e-9)):
            best = (seconds, fused, fused_positions)

    empty = [s for s in empty_backward if s in split]
    if empty:
        fused_if(empty, strictly=False)
    num_stages = schedule.num_stages
    b, w = (costs.per_stage(num_stages)[i] for i in (1, 2))
    bw = costs.fused_per_stage(num_stages)
    saving = {s: b[s] + w[s] - bw[s] for s in split - set(empty)}
    costly = [
        s for s in sorted(saving, key=lambda s: (-saving[s], s)) if saving[s] > 1e-9 * (b[s] + w[s])
    ]
    if len(costly) > FUSE_ONE_BY_ONE:
        fused_if(costly, strictly=True)  # all at once: each try plans the ticks anew
    else:
        for stage in costly:
            fused_if([stage], strictly=True)
    return best[1], best[2]


class Fastest(NamedTuple):
    """``fastest_in_ticks``'s answer."""

    index: int  # the fastest candidate (the earliest of equals)
    times: tuple[float, ...]  # each candidate's planned ticks' barrier_time
    full: tuple[bool, ...]  # whether that time is the full plan's (else the screened one's)
    plan: tuple[Schedule, dict[Action, tuple[int, int]]]  # plan_ticks's result for the fastest


def fastest_in_ticks(
    candidates: Sequence[Schedule], costs: Costs, empty_backward: Sequence[int] = ()
) -> Fastest:
    """Returns the candidate whose planned ticks (``plan_ticks``) take the least
    ``barrier_time``, with every candidate's time. The schedules were searched or built for
    event-driven time, where exchanges overlap compute and B and W always run split; the
    compiled step runs ticks, may fuse a stage's backward, and waits at exchanges, so an order
    that loses in the simulator can win there.

    Each candidate is screened first, planned without the segment search (a fifth of the time
    on 8 devices); those within ``SCREEN_MARGIN`` of the best screened time are then planned
    in full (never slower than screened), the rest keep their screened time."""
    if not candidates:
        raise ScheduleError("fastest_in_ticks: no candidate schedules were given")
    plans = [plan_ticks(schedule, costs, empty_backward, segments=False) for schedule in candidates]
    times = [barrier_time(*plan, costs) for plan in plans]
    cut = min(times) * (1.0 + SCREEN_MARGIN)
    full = [t <= cut for t in times]
    for i, schedule in enumerate(candidates):
        if full[i]:  # plan_ticks in full, its screened half already made
            plans[i] = _with_segments(schedule, costs, empty_backward, plans[i])
            times[i] = barrier_time(*plans[i], costs)
    least = min(times)
    best = next(i for i, t in enumerate(times) if t <= least * (1 + 1e-9))
    return Fastest(best, tuple(times), tuple(full), plans[best])


def zb_auto_in_ticks(
    searched: Schedule, costs: Costs, empty_backward: Sequence[int] = ()
) -> tuple[Schedule, tuple[tuple[str, float], ...], tuple[Schedule, dict[Action, tuple[int, int]]]]:
    """Returns the order a zb-auto pipeline planned with ``costs`` runs, each candidate's time
    in ticks (the chosen one first; "(screened)" where ``fastest_in_ticks`` did not plan it in
    full), and the chosen order's plan (``plan_ticks``).

    zb-auto's search (``searched``) scores orders by event-driven time with B and W split; the
    step runs them in ticks, waiting at exchanges and fusing a stage's backward where its
    ``bw`` undercuts B + W. There a named order can win (helper HD, session 43: zb-h2 67.8
    against the search's 73.5 at p = 4, m = 16), so on a chain the search's order competes
    with zb-h1, zb-h2 and 1f1b, each within the search's memory limit, by
    ``fastest_in_ticks``. A named winner is renamed "zb-auto (zb-h2's order)" and keeps the
    search's memory limit."""
    candidates = [("search", searched)]
    if searched.edges == schedules.chain_edges(searched.num_stages):
        p, m = searched.num_stages, searched.num_microbatches
        for name in ("zb-h1", "zb-h2", "1f1b"):
            options = {"w_mem": searched.w_mem}
            if name != "1f1b":
                options["mem_limit"] = searched.mem_limit
            try:
                other = schedules.build(name, p, m, **options)
            except ScheduleError:
                continue  # it cannot fit the limit
            if max(schedules.peak_memory(other)) <= searched.mem_limit + 1e-9:
                renamed = dataclasses.replace(
                    other, name=f"zb-auto ({name}'s order)", mem_limit=searched.mem_limit
                )
                candidates.append((name, renamed))
    orders = [order for _, order in candidates]
    fastest = fastest_in_ticks(orders, costs, empty_backward)
    ranked = [
        (name if full else f"{name} (screened)", t)
        for (name, _), t, full in zip(candidates, fastest.times, fastest.full, strict=True)
    ]
    ranked.insert(0, ranked.pop(fastest.index))
    return orders[fastest.index], tuple(ranked), fastest.plan


#: ``fastest_in_ticks`` plans in full the candidates whose ticks without the segment search
#: come within this fraction of the best candidate's.
SCREEN_MARGIN = 0.05


def outgoing_messages(
    edges: Sequence[MessageEdge],
    placement: Sequence[int],
    num_devices: int,
    stage: int,
    backward: bool,
) -> tuple[tuple[int, int, int], ...]:
    """Returns (shift, position, edge index) of every message F (or B/BW) of ``stage`` sends.

    F sends each out-edge's values to the edge's destination; B/BW sends each in-edge's
    cotangents (when it has any) back to its source. ``position`` numbers the action's
    messages that share a shift, in edge order; ``tick_tables`` puts them in that order into
    the shift's payload, after those of the device's earlier lanes in the tick
    (``TickTables.send_position``).
    """
    sends = []
    count: dict[int, int] = {}
    for index, edge in enumerate(edges):
        if backward:
            if edge.dst != stage or not edge.has_cotangent:
                continue
            src_device, dst_device = placement[edge.dst], placement[edge.src]
        else:
            if edge.src != stage:
                continue
            src_device, dst_device = placement[edge.src], placement[edge.dst]
        shift = (dst_device - src_device) % num_devices
        sends.append((shift, count.get(shift, 0), index))
        count[shift] = count.get(shift, 0) + 1
    return tuple(sends)


def incoming_messages(edges: Sequence[MessageEdge], stage: int, backward: bool) -> tuple[int, ...]:
    """Returns the edge indices whose messages F (or B/BW) of ``stage`` reads, in read order."""
    if backward:
        return tuple(i for i, e in enumerate(edges) if e.src == stage and e.has_cotangent)
    return tuple(i for i, e in enumerate(edges) if e.dst == stage)


def _lifetimes(
    tick_of: dict[Action, int],
    placement: Sequence[int],
    num_devices: int,
    kept: Sequence[bool],
    residuals_until_weight: Sequence[bool],
) -> tuple[list[list], list[list], list[list]]:
    """Returns per device the half-open intervals ``(start, end, (stage, microbatch))`` of the
    residual, kept and stash data of every (stage, microbatch) run there, on the clock of
    ``tick_of`` (times in the order the device runs its actions).

    Residuals live from F until B or BW (until W where ``residuals_until_weight``), kept
    residuals from F until W or BW (stages with ``kept``), the stash from B until W. In a
    schedule of forwards only (``Schedule.forwards``), F's residuals live for its tick."""
    residual: list[list] = [[] for _ in range(num_devices)]
    kept_out: list[list] = [[] for _ in range(num_devices)]
    stash: list[list] = [[] for _ in range(num_devices)]
    at = {(a.kind, a.stage, a.microbatch): tick for a, tick in tick_of.items()}
    forwards_only = all(kind == "F" for kind, _, _ in at)
    for (kind, s, i), tick in at.items():
        if kind != "F":
            continue
        if forwards_only:
            residual[placement[s]].append((tick, tick + 1, (s, i)))
            continue
        last = ("W", s, i) if ("B", s, i) in at else ("BW", s, i)
        if last not in at:
            raise ScheduleError(
                f"dependency rule: {Action(kind, s, i)} has no backward ({Action(*last)}) in "
                "the schedule; every forward needs a backward"
            )
        if kept[s]:
            kept_out[placement[s]].append((tick, at[last], (s, i)))
        if last[0] == "W":
            stash[placement[s]].append((at[("B", s, i)], at[last], (s, i)))
            if not residuals_until_weight[s]:
                last = ("B", s, i)
        residual[placement[s]].append((tick, at[last], (s, i)))
    return residual, kept_out, stash


def pack_intervals(
    intervals: Sequence[tuple[int, int, object]],
    size_of: Callable[[object], int],
    align: int = 1,
    bank: int | None = None,
) -> tuple[dict, int]:
    """Returns (owner -> offset, total size) placing each half-open interval ``(start, end,
    owner)``'s ``size_of(owner)`` elements (rounded up to a multiple of ``align``) in one
    buffer so that no two intervals that overlap in time overlap in it, and none crosses a
    multiple of ``bank`` (if given).

    First fit (the lowest offset that is free over the interval's whole life), tried in order
    of start and, where sizes differ, in order of decreasing size, beside slots of the largest
    size (``_colour_intervals``); the smallest buffer wins, so this never needs more than such
    slots would hold. In start order, equal sizes are placed as slots are (optimal for
    intervals)."""
    items = [
        (start, end, owner, -(-int(size_of(owner)) // align) * align)
        for start, end, owner in intervals
    ]
    items = [item for item in items if item[3]]
    if bank is not None and items and max(item[3] for item in items) > bank:
        raise ValueError(
            f"an item of {max(item[3] for item in items)} elements cannot fit a bank of {bank}"
        )
    orders = [sorted(items, key=lambda x: (x[0], x[1]))]
    if len({item[3] for item in items}) > 1:
        orders.append(sorted(items, key=lambda x: (-x[3], x[0], x[1])))
    # No placement needs less than what is alive at once: one that needs that is the best.
    least = _most_alive([(start, end, size) for start, end, _, size in items])
    best: tuple[dict, int] = ({owner: 0 for _, _, owner in intervals}, 0)
    for n, order in enumerate(orders):
        lows = _first_fit_in_start_order(order, bank) if n == 0 else _first_fit(order, bank)
        total = max((low + item[3] for low, item in zip(lows, order, strict=True)), default=0)
        if n == 0 or total < best[1]:
            where = {owner: 0 for _, _, owner in intervals}
            where.update({x[2]: low for x, low in zip(order, lows, strict=True)})
            best = (where, total)
        if total <= least and bank is None:
            return best
    if items and bank is None:
        largest = max(size for *_, size in items)
        slot_of, num_slots = _colour_intervals([item[:3] for item in items])
        if num_slots * largest < best[1]:
            where = {owner: 0 for _, _, owner in intervals}
            where.update({owner: slot * largest for owner, slot in slot_of.items()})
            best = (where, num_slots * largest)
    return best


def _most_alive(lives: Sequence[tuple[int, int, int]]) -> int:
    """Returns the largest total size of half-open lives ``(start, end, size)`` alive at one
    time (a life that ends when another starts is not alive with it)."""
    events = sorted([(end, -size) for _, end, size in lives] + [(s, n) for s, _, n in lives])
    return int(np.cumsum([n for _, n in events]).max()) if events else 0


def _lowest_gap(taken: Sequence[tuple[int, int, int]], size: int, bank: int | None) -> int:
    """Returns the lowest offset at which ``size`` elements miss every ``[low, high)`` range of
    ``taken``, triples ``(low, high, _)`` sorted by ``low``, and cross no multiple of ``bank``
    (if given)."""
    floor = 0
    while True:
        offset = floor
        for low, high, _ in taken:
            if offset + size <= low:
                break
            if high > offset:
                offset = high
        if bank is None or offset // bank == (offset + size - 1) // bank:
            return offset
        floor = (offset // bank + 1) * bank  # into the next bank


def _first_fit_in_start_order(order: Sequence[tuple], bank: int | None) -> list[int]:
    """Returns first-fit offsets for items ``(start, end, owner, size)`` sorted by start: an
    item can clash only with the placed ones still alive at its start, so the sweep keeps
    just those, sorted by offset (at most as many as are alive at once)."""
    lows = []
    alive: list[tuple[int, int, int]] = []  # (low, high, end), sorted by low
    for start, end, _, size in order:
        alive = [taken for taken in alive if taken[2] > start]
        low = _lowest_gap(alive, size, bank)
        bisect.insort(alive, (low, low + size, end))
        lows.append(low)
    return lows


def _first_fit(order: Sequence[tuple], bank: int | None) -> list[int]:
    """Returns first-fit offsets for items ``(start, end, owner, size)`` placed in ``order``:
    each at the lowest offset free over its whole life."""
    starts = np.array([x[0] for x in order], np.int64)
    ends = np.array([x[1] for x in order], np.int64)
    lows = np.zeros(len(order), np.int64)
    highs = np.zeros(len(order), np.int64)
    for j, (start, end, _, size) in enumerate(order):
        clash = np.flatnonzero((starts[:j] < end) & (start < ends[:j]))
        clash = clash[np.argsort(lows[clash], kind="stable")]
        taken = zip(lows[clash].tolist(), highs[clash].tolist(), clash.tolist(), strict=True)
        lows[j] = _lowest_gap(list(taken), size, bank)
        highs[j] = lows[j] + size
    return lows.tolist()


#: The groups of an arena's items: what F stores for B (until B, or W), what it stores that W
#: reads too (until W), and what B stashes for W.
ARENA_GROUPS = ("residual", "kept", "stash")


@dataclass(frozen=True)
class Arenas:
    """Where the lowering keeps each (stage, microbatch)'s data between its actions.

    ``sizes[b][k]`` is the elements of slot dtype ``k`` in buffer ``b`` on every device (the
    most any device needs); group ``g`` (``ARENA_GROUPS``) lives in buffer ``group_buffer[g]``:
    one buffer for all three (``shared``) or one each. ``offsets[t, d, lane, g, k]`` is where
    the group-``g`` data of dtype ``k`` of the (stage, microbatch) whose action runs in that
    lane starts in its buffer (0 where the lane idles or the action has none).

    Unlike slot pools (every slot as large as the largest stage's data, as many as the busiest
    device holds at once), each item takes its own stage's size and the space of items whose
    lives do not overlap (``pack_intervals``); in one shared buffer, a device whose residuals
    take the most room and one whose kept residuals and stashes do need no room for each
    other's peaks."""

    sizes: tuple[tuple[int, ...], ...]
    group_buffer: tuple[int, ...]
    offsets: np.ndarray
    #: ``banks[b][k]``: buffer ``b``'s dtype-``k`` elements are ``banks[b][k]`` rows of
    #: ``sizes[b][k] // banks[b][k]`` (1 unless it would hold more than ``ARENA_BANK``
    #: elements, which int32 indices cannot address); no item crosses a row.
    banks: tuple[tuple[int, ...], ...]

    @property
    def shared(self) -> bool:
        """Returns whether the three groups share one buffer (B then writes where it reads)."""
        return len(self.sizes) == 1

    def shape(self, buffer: int, k: int) -> tuple[int, int]:
        """Returns (rows, elements per row) of buffer ``buffer``'s dtype-``k`` arena."""
        rows = self.banks[buffer][k]
        return rows, self.sizes[buffer][k] // rows

    def row_offsets(self) -> tuple[np.ndarray, np.ndarray]:
        """Returns ``offsets`` as (row, offset within the row) tables, int32."""
        length = np.ones(self.offsets.shape[-2:], np.int64)
        for g, b in enumerate(self.group_buffer):
            for k in range(self.offsets.shape[-1]):
                length[g, k] = max(self.shape(b, k)[1], 1)
        rows, within = np.divmod(self.offsets, length)
        return rows.astype(np.int32), within.astype(np.int32)


#: The most elements one row of an arena holds: int32 indices address no more.
ARENA_BANK = 2**31 - 2**16


def arena_floor(
    tables: TickTables,
    size_of: Callable[[str, int, int, bool], int],
    num_dtypes: int,
    kept: Sequence[bool],
    residuals_until_weight: Sequence[bool],
    align: Sequence[int] | None = None,
    shared: bool = False,
) -> tuple[tuple[int, ...], ...]:
    """Returns, per buffer and dtype, a size no arrangement of ``arenas`` (same arguments) can
    go below: the most elements alive at once on any device (each item rounded up to its
    alignment). Cheap beside packing, so that a caller weighing several layouts packs only
    those that could hold fewer bytes than the best packed so far."""
    split, lives = _arena_lives(tables, kept, residuals_until_weight)
    align = align or (1,) * num_dtypes
    return tuple(
        tuple(
            max(
                _most_alive(
                    [
                        (start, end, -(-int(size) // align[k]) * align[k])
                        for g in members
                        for start, end, owner in lives[g][d]
                        if (size := size_of(ARENA_GROUPS[g], owner[0], k, owner in split))
                    ]
                )
                for d in range(tables.num_devices)
            )
            for k in range(num_dtypes)
        )
        for members in _arena_buffers(shared)
    )


def _arena_lives(
    tables: TickTables, kept: Sequence[bool], residuals_until_weight: Sequence[bool]
) -> tuple[set[tuple[int, int]], tuple[list[list], list[list], list[list]]]:
    """Returns the (stage, microbatch) items whose backward is split and, per ``ARENA_GROUPS``
    group and device, the items' lives on ``tables``'s (tick, phase, lane) clock."""
    tick_of = tables.action_times
    split = {(a.stage, a.microbatch) for a in tick_of if a.kind == "W"}
    lives = _lifetimes(tick_of, tables.placement, tables.num_devices, kept, residuals_until_weight)
    return split, lives


def _arena_buffers(shared: bool) -> list[tuple[int, ...]]:
    """Returns the ``ARENA_GROUPS`` groups each arena buffer holds: all in one, or one each."""
    groups = tuple(range(len(ARENA_GROUPS)))
    return [groups] if shared else [(g,) for g in groups]


def arenas(
    tables: TickTables,
    size_of: Callable[[str, int, int, bool], int],
    num_dtypes: int,
    kept: Sequence[bool],
    residuals_until_weight: Sequence[bool],
    align: Sequence[int] | None = None,
    shared: bool = False,
    limit: int | None = None,
) -> Arenas:
    """Returns the arenas that hold the data of ``tables``'s actions.

    ``size_of(group, stage, dtype, split)`` is how many elements of slot dtype ``dtype`` the
    group's data of one microbatch of ``stage`` takes (``split``: whether that microbatch's
    backward runs as B and W); ``kept`` and ``residuals_until_weight`` as for ``tick_tables``
    (the same lives). ``align[k]``: the multiple of elements every item of dtype ``k`` starts
    at. ``shared``: one buffer for the three groups, else one per group. ``limit``: the most
    elements a row of a buffer may hold (``ARENA_BANK`` by default).

    Lives are measured on a clock of (tick, phase, lane): an item a device's action reads for
    the last time is free for an item the same action writes (B's stash over its own
    residuals), never for one another action writes in the same tick.
    """
    limit = ARENA_BANK if limit is None else limit
    split, lives = _arena_lives(tables, kept, residuals_until_weight)
    # Each lane's (stage, microbatch) item, numbered stage * num_microbatches + microbatch.
    busy = tables.kind != IDLE
    num_microbatches = int(tables.microbatch.max(initial=0)) + 1
    item_count = (int(tables.stage.max(initial=0)) + 1) * num_microbatches
    item_of = tables.stage.astype(np.int64) * num_microbatches + tables.microbatch
    align = align or (1,) * num_dtypes
    groups = range(len(ARENA_GROUPS))
    buffers = _arena_buffers(shared)
    offsets = np.zeros(tables.kind.shape + (len(ARENA_GROUPS), num_dtypes), np.int64)
    sizes, banks = [], []
    for members in buffers:
        buffer_sizes, buffer_banks = [], []
        for k in range(num_dtypes):

            def pack(bank, members=members, k=k):
                # Per device: where each item goes, and the most any device needs.
                packed = [
                    pack_intervals(
                        [(a, b, (g, owner)) for g in members for a, b, owner in lives[g][d]],
                        lambda item: size_of(
                            ARENA_GROUPS[item[0]], item[1][0], k, item[1] in split
                        ),
                        align[k],
                        bank,
                    )
                    for d in range(tables.num_devices)
                ]
                return packed, max((total for _, total in packed), default=0)

            packed, largest = pack(None)
            rows = 1
            if largest > limit:
                # Past what int32 indices address: rows of equal length no item crosses.
                biggest, group, stage = max(
                    (size_of(ARENA_GROUPS[g], owner[0], k, owner in split), g, owner[0])
                    for g in members
                    for device in lives[g]
                    for _, _, owner in device
                )
                if biggest > limit:
                    raise ScheduleError(
                        f"one microbatch's {ARENA_GROUPS[group]} data of stage {stage} takes "
                        f"{biggest} elements of one dtype, more than int32 indices address "
                        f"({limit}); use more, smaller microbatches or more stages"
                    )
                rows, unbanked = -(-largest // limit), largest
                while True:
                    length = max(-(-unbanked // rows), biggest)
                    length = min(-(-length // align[k]) * align[k], limit)
                    packed, largest = pack(length)
                    if largest <= rows * length:
                        largest = rows * length
                        break
                    rows += 1
            by_item = np.zeros((len(ARENA_GROUPS), item_count), np.int64)
            for where, _ in packed:
                for (g, (s, i)), offset in where.items():
                    by_item[g, s * num_microbatches + i] = offset
            for g in members:
                offsets[..., g, k] = np.where(busy, by_item[g][item_of], 0)
            buffer_sizes.append(largest)
            buffer_banks.append(rows)
        sizes.append(tuple(buffer_sizes))
        banks.append(tuple(buffer_banks))
    group_buffer = tuple(next(b for b, m in enumerate(buffers) if g in m) for g in groups)
    return Arenas(tuple(sizes), group_buffer, offsets, tuple(banks))


def _colour_intervals(intervals: Sequence[tuple[int, int, object]]) -> tuple[dict, int]:
    """Returns (owner -> slot, number of slots) for half-open tick intervals [start, end).

    Greedy by start time, reusing the lowest free slot, which is optimal for intervals.
    """
    slot_of: dict = {}
    busy: list[tuple[int, int]] = []  # (end, slot)
    free: list[int] = []
    num_slots = 0
    for start, end, owner in sorted(intervals, key=lambda x: (x[0], x[1])):
        while busy and busy[0][0] <= start:
            heapq.heappush(free, heapq.heappop(busy)[1])
        if free:
            slot = heapq.heappop(free)
        else:
            slot = num_slots
            num_slots += 1
        slot_of[owner] = slot
        heapq.heappush(busy, (end, slot))
    return slot_of, num_slots


def _check_positions(schedule: Schedule, positions: dict[Action, tuple[int, int]]) -> None:
    """Raises ``ScheduleError`` unless ``positions`` places every action of ``schedule`` once,
    each device's in its order, one per (tick, lane), after its data (see ``tick_tables``)."""
    deps = _checked_dependencies(schedule)
    if set(positions) != set(deps):
        extra = sorted(set(positions) ^ set(deps), key=str)[:3]
        raise ScheduleError(
            f"positions: {extra} are not the schedule's actions; give every action of the "
            "schedule a (tick, lane)"
        )
    for device, program in enumerate(schedule.actions):
        places = [positions[a] for a in program]
        if any(a >= b for a, b in zip(places, places[1:], strict=False)):
            raise ScheduleError(
                f"positions: device {device} does not run its actions in the schedule's order "
                "at distinct (tick, lane); keep each device's order"
            )
    for action, (tick, lane) in positions.items():
        for dep in deps[action]:
            if not _data_ready(action, dep, positions[dep], (tick, lane)):
                raise ScheduleError(
                    f"positions: {action} at tick {tick}, lane {lane} needs {dep} at "
                    f"{positions[dep]}, whose data is not there yet (another stage's data moves "
                    "at the end of its tick); run it at a later tick"
                )


def tick_tables(
    schedule: Schedule,
    edges: Sequence[MessageEdge] | None = None,
    kept: Sequence[bool] | None = None,
    residuals_until_weight: Sequence[bool] | None = None,
    positions: dict[Action, tuple[int, int]] | None = None,
) -> TickTables:
    """Returns the lockstep tables that run ``schedule``, message slots allocated.

    ``edges`` are the stage graph's edges (one message each per microbatch and direction);
    by default one edge per ``schedule.edges`` pair, every one carrying cotangents.
    ``kept[s]`` says whether stage ``s`` stores residuals that W reads too (kept residuals,
    which live until W); by default every stage does. ``residuals_until_weight[s]`` says
    whether stage ``s``'s W reads its residuals (which then live until W, else until B); by
    default none does. ``positions`` gives every action's (tick, lane), actions packed after a
    tick's main one (``choose_ticks``, ``plan_ticks``); by default every tick runs one action
    per device (``pack_ticks`` without costs). Raises ``ScheduleError`` when ``positions``
    runs an action before its data (another stage's at an earlier tick, its own stage's at an
    earlier tick or lane), runs a device's actions out of the schedule's order, or puts two
    actions of a device in one lane of a tick.
    """
    if edges is None:
        edges = tuple(MessageEdge(a, b) for a, b in schedule.edges)
    edges = tuple(edges)
    for edge in edges:
        if (edge.src, edge.dst) not in schedule.edges:
            raise ScheduleError(
                f"the stage graph has edge {edge.src}->{edge.dst} but the schedule's edges are "
                f"{list(schedule.edges)}; build the schedule from the same stage graph"
            )
    if positions is None:
        positions = pack_ticks(schedule)
    else:
        _check_positions(schedule, positions)
    num_devices = schedule.num_devices
    placement = schedule.placement
    num_ticks = max((t for t, _ in positions.values()), default=-1) + 1
    num_lanes = max((lane for _, lane in positions.values()), default=0) + 1
    kinds = backward_kinds(schedule)
    # Lives are measured on a finer clock than ticks: within a tick a device runs its actions
    # phase by phase (``PHASES``), so time t * len(PHASES) + phase orders its writes and
    # reads. A message is stored after the tick's last phase.
    num_phases = len(PHASES)
    tick_of = {a: t * num_phases + PHASES[a.kind] for a, (t, _) in positions.items()}

    if kept is None:
        kept = (True,) * schedule.num_stages
    if residuals_until_weight is None:
        residuals_until_weight = (False,) * schedule.num_stages

    # Messages live from the tick they are sent until the tick they are read, on the reader.
    # The messages a device sends over one shift in one tick take the payload's positions in
    # lane order (within an action, in ``outgoing_messages`` order).
    sends: dict[tuple[int, int, int], tuple[int, int, int, int]] = {}
    send_at: dict[tuple[int, int, int, int], int] = {}  # (tick, device, lane, j) -> position
    taken: dict[tuple[int, int, int], int] = {}  # (tick, device, shift) -> positions taken
    message_intervals: list[list] = [[] for _ in range(num_devices)]
    max_sends = 0
    for action, (sent, lane) in sorted(positions.items(), key=lambda item: item[1]):
        if action.kind == "W":
            continue
        backward = action.kind != "F"
        sender = placement[action.stage]
        outgoing = outgoing_messages(edges, placement, num_devices, action.stage, backward)
        max_sends = max(max_sends, len(outgoing))
        for j, (shift, _, e) in enumerate(outgoing):
            edge = edges[e]
            reader_stage = edge.src if backward else edge.dst
            reader_kind = kinds.get((reader_stage, action.microbatch), "B") if backward else "F"
            reader = Action(reader_kind, reader_stage, action.microbatch)
            key = (e, action.microbatch, int(backward))
            position = taken.get((sent, sender, shift), 0)
            taken[(sent, sender, shift)] = position + 1
            send_at[(sent, sender, lane, j)] = position
            sends[key] = (sent, shift, position, placement[reader_stage])
            stored = sent * num_phases + num_phases - 1
            message_intervals[placement[reader_stage]].append((stored, tick_of[reader], key))
    message_slots = [_colour_intervals(iv) for iv in message_intervals]
    num_message_slots = max((n for _, n in message_slots), default=0)

    shifts = tuple(sorted({shift for _, shift, _, _ in sends.values()}))
    shift_index = {shift: k for k, shift in enumerate(shifts)}
    messages_per_shift = [0] * len(shifts)
    for _, shift, position, _ in sends.values():
        messages_per_shift[shift_index[shift]] = max(
            messages_per_shift[shift_index[shift]], position + 1
        )
    max_per_shift = max(messages_per_shift, default=0)
    max_reads = max(
        (
            len(incoming_messages(edges, s, backward))
            for s in range(schedule.num_stages)
            for backward in (False, True)
        ),
        default=0,
    )

    shape = (num_ticks, num_devices, num_lanes)
    kind = np.zeros(shape, np.int32)
    stage = np.zeros(shape, np.int32)
    microbatch = np.zeros(shape, np.int32)
    message_read = np.full(shape + (max_reads,), num_message_slots, np.int32)
    message_write = np.full(
        (num_ticks, num_devices, len(shifts), max_per_shift), num_message_slots, np.int32
    )
    send_position = np.zeros(shape + (max_sends,), np.int32)
    for at, position in send_at.items():
        send_position[at] = position
    for action, (tick, lane) in positions.items():
        s, i = action.stage, action.microbatch
        at = (tick, placement[s], lane)
        kind[at] = KIND_CODES[action.kind]
        stage[at] = s
        microbatch[at] = i
        if action.kind != "W":
            backward = action.kind != "F"
            for j, e in enumerate(incoming_messages(edges, s, backward)):
                message_read[at + (j,)] = message_slots[placement[s]][0][(e, i, int(backward))]
    for key, (tick, shift, position, reader_device) in sends.items():
        slot = message_slots[reader_device][0][key]
        message_write[tick, reader_device, shift_index[shift], position] = slot
    tables = TickTables(
        kind=kind,
        stage=stage,
        microbatch=microbatch,
        message_read=message_read,
        message_write=message_write,
        send_position=send_position,
        shifts=shifts,
        messages_per_shift=tuple(messages_per_shift),
        num_residual_slots=0,
        num_kept_slots=0,
        num_stash_slots=0,
        num_message_slots=num_message_slots,
        edges=edges,
        placement=tuple(placement),
    )
    return with_lives(tables, kept, residuals_until_weight)


def decode_actions(tables: TickTables) -> tuple[tuple[Action, ...], ...]:
    """Returns each device's actions in the order the tables run them (idle lanes skipped,
    a tick's lanes in order)."""
    programs = []
    for d in range(tables.num_devices):
        program = []
        for t in range(tables.num_ticks):
            for lane in range(tables.num_lanes):
                code = int(tables.kind[t, d, lane])
                if code != IDLE:
                    s, i = int(tables.stage[t, d, lane]), int(tables.microbatch[t, d, lane])
                    program.append(Action(KIND_NAMES[code], s, i))
        programs.append(tuple(program))
    return tuple(programs)
