"""Checks that a schedule is complete, ordered, within memory and free of deadlock (no JAX).

The rules, each named in the ``ScheduleError`` it raises:

- **stage graph**: edges join existing stages, no self-loops, no cycles.
- **placement**: every stage sits on a device that has an action list.
- **device**: an action runs on the device its stage is placed on; stage and microbatch exist.
- **completeness**: every (stage, microbatch) has exactly one F and either one BW or one B
  and one W.
- **order**: on one device, an action comes after every dependency that device also runs:
  F after F of every predecessor stage, B (or BW) after F of its stage and after the backward
  of every successor stage, W after B.
- **memory**: with ``mem_limit`` set, no device's activation memory passes it.
- **deadlock**: running every device's list in order, each action waiting for its
  dependencies on other devices, finishes.
"""

from __future__ import annotations

from collections import Counter, deque

from zbjax.errors import ScheduleError
from zbjax.schedules.ir import Action, Schedule
from zbjax.schedules.simulate import backward_kinds, dependencies, memory_delta


def _check_graph(schedule: Schedule) -> None:
    """Raises unless the edges join existing stages and form a DAG."""
    n = schedule.num_stages
    for a, b in schedule.edges:
        if not (0 <= a < n and 0 <= b < n) or a == b:
            raise ScheduleError(
                f"stage graph rule: edge ({a}, {b}) does not join two different stages of "
                f"0..{n - 1}; fix Schedule.edges"
            )
    indegree = Counter(b for _, b in schedule.edges)
    frontier = [s for s in range(n) if indegree[s] == 0]
    seen = 0
    while frontier:
        s = frontier.pop()
        seen += 1
        for t in schedule.successors(s):
            indegree[t] -= 1
            if indegree[t] == 0:
                frontier.append(t)
    if seen != n:
        cyclic = sorted(s for s in range(n) if indegree[s] > 0)
        raise ScheduleError(
            f"stage graph rule: the edges have a cycle through stages {cyclic}; a pipeline's "
            "stage graph must be acyclic"
        )


def _check_placement_and_devices(schedule: Schedule) -> None:
    """Raises unless stages, microbatches and devices of every action exist and match."""
    if schedule.num_stages < 1 or schedule.num_microbatches < 1:
        raise ScheduleError(
            f"schedule {schedule.name!r} has {schedule.num_stages} stages and "
            f"{schedule.num_microbatches} microbatches; both must be >= 1"
        )
    for stage, device in enumerate(schedule.placement):
        if not 0 <= device < schedule.num_devices:
            raise ScheduleError(
                f"placement rule: stage {stage} is placed on device {device}, but the schedule "
                f"has action lists for devices 0..{schedule.num_devices - 1}; add the device's "
                "action list or fix the placement"
            )
    for device, position, action in schedule.all_actions():
        if action.stage >= schedule.num_stages:
            raise ScheduleError(
                f"device rule: {action} on device {device} (position {position}) names stage "
                f"{action.stage}, but there are {schedule.num_stages} stages"
            )
        if action.microbatch >= schedule.num_microbatches:
            raise ScheduleError(
                f"device rule: {action} on device {device} (position {position}) names "
                f"microbatch {action.microbatch}, but there are {schedule.num_microbatches}"
            )
        if schedule.placement[action.stage] != device:
            raise ScheduleError(
                f"device rule: {action} is on device {device} (position {position}) but stage "
                f"{action.stage} is placed on device {schedule.placement[action.stage]}; move "
                "it there"
            )


def _check_completeness(schedule: Schedule) -> None:
    """Raises unless each (stage, microbatch) has one F and one BW, or one B and one W."""
    counts = Counter(a for _, _, a in schedule.all_actions())
    for action, count in counts.items():
        if count > 1:
            raise ScheduleError(
                f"completeness rule: {action} appears {count} times; each action runs once"
            )
    for s in range(schedule.num_stages):
        for i in range(schedule.num_microbatches):
            has = {k for k in ("F", "B", "W", "BW") if Action(k, s, i) in counts}
            if "F" not in has:
                raise ScheduleError(
                    f"completeness rule: {Action('F', s, i)} is missing; add it to device "
                    f"{schedule.placement[s]}"
                )
            if "BW" in has and has & {"B", "W"}:
                extra = " and ".join(str(Action(k, s, i)) for k in ("B", "W") if k in has)
                raise ScheduleError(
                    f"completeness rule: {Action('BW', s, i)} and {extra} both run the "
                    "backward; keep either BW alone or B and W"
                )
            if "BW" not in has and has != {"F", "B", "W"}:
                missing = " and ".join(str(Action(k, s, i)) for k in ("B", "W") if k not in has)
                raise ScheduleError(
                    f"completeness rule: {missing} is missing; a stage's backward is one BW or "
                    "one B and one W"
                )


def _check_order(schedule: Schedule, kinds: dict[tuple[int, int], str]) -> None:
    """Raises if an action comes before a dependency that its own device runs later."""
    for device, program in enumerate(schedule.actions):
        position = {a: k for k, a in enumerate(program)}
        for k, action in enumerate(program):
            for dep in dependencies(schedule, action, kinds):
                later = position.get(dep)
                if later is not None and later > k:
                    raise ScheduleError(
                        f"order rule: {action} on device {device} (position {k}) runs before "
                        f"{dep} (position {later}), which it needs; move {action} after {dep}"
                    )


def _check_memory(schedule: Schedule) -> None:
    """Raises if a device's activation memory passes ``mem_limit``."""
    if schedule.mem_limit is None:
        return
    for device, program in enumerate(schedule.actions):
        level = 0.0
        for k, action in enumerate(program):
            level += memory_delta(action, schedule.w_mem)
            if level > schedule.mem_limit + 1e-9:
                raise ScheduleError(
                    f"memory rule: after {action} on device {device} (position {k}) the device "
                    f"holds {level:g} M_B, above mem_limit = {schedule.mem_limit:g}; run a W or "
                    "B earlier, warm up with fewer F, or raise mem_limit"
                )


def _check_deadlock(schedule: Schedule, kinds: dict[tuple[int, int], str]) -> None:
    """Raises if running each device's list in order gets stuck."""
    done: set[Action] = set()
    cursor = [0] * schedule.num_devices
    waiting_on: dict[Action, list[int]] = {}
    runnable = deque(range(schedule.num_devices))
    while runnable:
        device = runnable.popleft()
        program = schedule.actions[device]
        while cursor[device] < len(program):
            action = program[cursor[device]]
            missing = next(
                (d for d in dependencies(schedule, action, kinds) if d not in done), None
            )
            if missing is not None:
                waiting_on.setdefault(missing, []).append(device)
                break
            done.add(action)
            cursor[device] += 1
            runnable.extend(waiting_on.pop(action, ()))
    stuck = [
        f"device {d} waits at {schedule.actions[d][cursor[d]]}"
        for d in range(schedule.num_devices)
        if cursor[d] < len(schedule.actions[d])
    ]
    if stuck:
        raise ScheduleError(
            "deadlock: no device can make progress (" + "; ".join(stuck) + "); "
            "reorder the actions so that every dependency can run first"
        )


def validate(schedule: Schedule) -> Schedule:
    """Returns ``schedule`` unchanged when it is valid; raises ScheduleError naming the rule.

    Checks the stage graph, placement, completeness, per-device order, memory limit and that
    the order runs without deadlock, in that order, and reports the first broken rule with the
    action that breaks it.
    """
    _check_graph(schedule)
    _check_placement_and_devices(schedule)
    _check_completeness(schedule)
    kinds = backward_kinds(schedule)
    _check_order(schedule, kinds)
    _check_memory(schedule)
    _check_deadlock(schedule, kinds)
    return schedule
