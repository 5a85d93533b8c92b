"""Event simulation of a schedule: start/end of every action, makespan, bubble rate, memory."""

from __future__ import annotations

import collections
import math
from collections.abc import Sequence

from zbjax.errors import ScheduleError
from zbjax.schedules.ir import Action, Costs, Schedule, SimResult, check_schedule


def backward_kinds(schedule: Schedule) -> dict[tuple[int, int], str]:
    """Returns, per (stage, microbatch), whether the schedule runs its backward as B or BW."""
    check_schedule(schedule, "backward_kinds")
    return {
        (a.stage, a.microbatch): a.kind
        for _, _, a in schedule.all_actions()
        if a.kind in ("B", "BW")
    }


#: Per stage, its predecessors and its successors (see ``neighbours``).
Neighbours = tuple[dict[int, tuple[int, ...]], dict[int, tuple[int, ...]]]


def neighbours(schedule: Schedule) -> Neighbours:
    """Returns (predecessors, successors) of every stage, looked up once for many queries."""
    stages = range(schedule.num_stages)
    return (
        {s: schedule.predecessors(s) for s in stages},
        {s: schedule.successors(s) for s in stages},
    )


def dependencies(
    schedule: Schedule,
    action: Action,
    backward_kind: dict[tuple[int, int], str] | None = None,
    graph: Neighbours | None = None,
) -> tuple[Action, ...]:
    """Returns the actions that must end before ``action`` can start (data dependencies).

    F(s, i) needs F(p, i) of every predecessor p; B(s, i) (or BW) needs F(s, i) and the backward
    of every successor (B or BW, as ``backward_kind`` says; computed from the schedule when not
    given); W(s, i) needs B(s, i). ``graph`` (from ``neighbours``) saves looking up the stage
    graph on every call.
    """
    if graph is None:  # a user's call (the simulator passes the graph): check the inputs
        check_schedule(schedule, "dependencies")
        action = _action(action, "dependencies")
        if action.stage >= schedule.num_stages or action.microbatch >= schedule.num_microbatches:
            raise ScheduleError(
                f"dependencies: action {action} is outside schedule {schedule.name!r} "
                f"({schedule.num_stages} stages, {schedule.num_microbatches} microbatches)"
            )
    s, i = action.stage, action.microbatch
    if action.kind == "F":
        preds = graph[0][s] if graph is not None else schedule.predecessors(s)
        return tuple(Action("F", p, i) for p in preds)
    if action.kind == "W":
        return (Action("B", s, i),)
    if backward_kind is None:
        backward_kind = backward_kinds(schedule)
    succs = graph[1][s] if graph is not None else schedule.successors(s)
    return (Action("F", s, i),) + tuple(
        Action(backward_kind.get((succ, i), "B"), succ, i) for succ in succs
    )


def memory_delta(action: Action, w_mem: float) -> float:
    """Returns the change in activation memory (M_B units) that ``action`` causes."""
    if not isinstance(action, Action):
        action = _action(action, "memory_delta")
    if not 0.0 <= w_mem <= 1.0:  # NaN fails too
        raise ScheduleError(f"memory_delta: w_mem = {w_mem!r}; it must be in [0, 1]")
    return {"F": 1.0, "B": -(1.0 - w_mem), "W": -w_mem, "BW": -1.0}[action.kind]


def _action(value: object, where: str) -> Action:
    """Returns ``value`` as an Action: an Action, or its text ("1B0": stage 1's B of
    microbatch 0), else raises ScheduleError naming ``where``."""
    if isinstance(value, Action):
        return value
    if isinstance(value, str):
        return Action.parse(value)
    raise ScheduleError(
        f"{where} takes an Action (or its text, e.g. '1B0'), not {type(value).__name__} {value!r}"
    )


def peak_memory(schedule: Schedule) -> tuple[float, ...]:
    """Returns each device's peak activation memory (M_B units) over its action order."""
    check_schedule(schedule, "peak_memory")
    peaks = []
    for program in schedule.actions:
        level = peak = 0.0
        for action in program:
            level += memory_delta(action, schedule.w_mem)
            peak = max(peak, level)
        peaks.append(round(peak, 9))
    return tuple(peaks)


def deadlock(schedule: Schedule, cursor: Sequence[int]) -> ScheduleError:
    """Returns the error for a schedule whose devices all wait, each at its action
    ``program[cursor[device]]`` (devices that ran all theirs are left out)."""
    waiting = [
        f"device {d} waits at {program[cursor[d]]}"
        for d, program in enumerate(schedule.actions)
        if cursor[d] < len(program)
    ]
    return ScheduleError(
        "deadlock: no device can make progress (" + "; ".join(waiting) + "); "
        "reorder the actions so every dependency can run first"
    )


def simulate(schedule: Schedule, costs: Costs | None = None) -> SimResult:
    """Returns the timing of ``schedule`` run with ``costs`` (default: F = B = W = 1, no comm).

    Each device runs its actions in order; an action starts when its device is free and every
    dependency has ended (plus ``costs.comm`` when the dependency ran on another device).
    Raises ``ScheduleError`` when the order deadlocks or a dependency is never scheduled.
    """
    check_schedule(schedule, "simulate")
    Costs.check(costs, "simulate's costs")
    costs = costs or Costs()
    f, b, w = costs.per_stage(schedule.num_stages)
    duration = {"F": f, "B": b, "W": w, "BW": costs.fused_per_stage(schedule.num_stages)}
    placement = schedule.placement
    scheduled = {a for _, _, a in schedule.all_actions()}
    kinds = backward_kinds(schedule)
    graph = neighbours(schedule)
    start: dict[Action, float] = {}
    end: dict[Action, float] = {}
    free = [0.0] * schedule.num_devices
    cursor = [0] * schedule.num_devices
    remaining = sum(len(p) for p in schedule.actions)
    # Devices with an action that may be ready; a blocked device waits on the dependency that
    # blocked it and is queued again when that ends (sweeping every device until none moved
    # took a pass per device of a backward wave: 41 s for 4000 stages).
    queue = collections.deque(range(schedule.num_devices))
    waiters: dict[Action, list[int]] = {}
    while queue:
        device = queue.popleft()
        program = schedule.actions[device]
        while cursor[device] < len(program):
            action = program[cursor[device]]
            ready = free[device]
            blocked = None
            for dep in dependencies(schedule, action, kinds, graph):
                if dep not in end:
                    if dep not in scheduled:
                        raise ScheduleError(
                            f"dependency rule: {action} on device {device} needs {dep}, "
                            "which no device runs; add it to the schedule"
                        )
                    blocked = dep
                    break
                delay = costs.comm if placement[dep.stage] != device else 0.0
                ready = max(ready, end[dep] + delay)
            if blocked is not None:
                waiters.setdefault(blocked, []).append(device)
                break
            length = duration[action.kind][action.stage]
            start[action] = ready
            end[action] = ready + length
            free[device] = ready + length
            cursor[device] += 1
            remaining -= 1
            queue.extend(waiters.pop(action, ()))
    if remaining:
        raise deadlock(schedule, cursor)
    makespan = max(end.values(), default=0.0)
    if not math.isfinite(makespan):
        raise ScheduleError(
            f"the simulated times overflow (makespan {makespan}): the costs are too large to "
            "add up in floating point; scale them down (only their ratios matter)"
        )
    busy = tuple(sum(end[a] - start[a] for a in program) for program in schedule.actions)
    total = schedule.num_devices * makespan
    bubble_rate = 1.0 - sum(busy) / total if total > 0 else 0.0
    return SimResult(
        start=start,
        end=end,
        makespan=makespan,
        bubble_rate=max(0.0, bubble_rate),
        peak_memory=peak_memory(schedule),
        busy=busy,
    )


def span_bubble_rate(schedule: Schedule, result: SimResult) -> float:
    """Returns the bubble rate of back-to-back training steps: idle over the longest device span.

    A device's span runs from its first start to its last end. When each stage steps its own
    optimizer (the Zero Bubble paper's post-validation), step k+1 can start on every device as
    soon as that device finishes step k, so steps repeat with period = the longest span and
    the F chain's start offset (device d cannot start before d forwards are done) overlaps the
    previous step's tail. This is the measure the paper reports (ZB-H2 and ZB-V reach 0):
    1 - (total compute of all devices) / (num_devices * longest span).
    """
    check_result(schedule, result, "span_bubble_rate")
    spans = [
        max(result.end[a] for a in program) - min(result.start[a] for a in program)
        for program in schedule.actions
        if program
    ]
    period = max(spans, default=0.0)
    total = schedule.num_devices * period
    return max(0.0, 1.0 - sum(result.busy) / total) if total > 0 else 0.0


def check_result(schedule: Schedule, result: object, where: str) -> None:
    """Raises ScheduleError unless ``result`` is ``simulate(schedule, ...)``'s: a SimResult
    that times every action of ``schedule``."""
    check_schedule(schedule, where)
    if not isinstance(result, SimResult):
        raise ScheduleError(
            f"{where} takes the SimResult of simulate(schedule, costs), not "
            f"{type(result).__name__} {result!r}"
        )
    missing = [a for _, _, a in schedule.all_actions() if a not in result.start]
    if missing or len(result.peak_memory) != schedule.num_devices:
        raise ScheduleError(
            f"{where}: the SimResult is not this schedule's ({schedule.name!r} runs "
            f"{', '.join(map(str, missing[:3])) or 'other devices'}, which it does not time); "
            "pass simulate(schedule, costs) of the same schedule"
        )
