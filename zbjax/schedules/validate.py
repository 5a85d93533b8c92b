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
from collections.abc import Callable

from zbjax.errors import ScheduleError
from zbjax.schedules.ir import Action, Schedule, check_schedule
from zbjax.schedules.simulate import backward_kinds, memory_delta, neighbours

#: An action as a plain tuple (kind, stage, microbatch): hashing it is cheap.
Key = tuple[str, int, int]
#: Returns the actions one action waits for (the rule of ``simulate.dependencies``).
Dependencies = Callable[[Key], tuple[Key, ...]]


def _key(action: Action) -> Key:
    """Returns ``action`` as a (kind, stage, microbatch) tuple."""
    return (action.kind, action.stage, action.microbatch)


def _name(key: Key) -> str:
    """Returns the text form of an action key, e.g. ``"2F0"``."""
    return f"{key[1]}{key[0]}{key[2]}"


def _dependency_rule(schedule: Schedule) -> Dependencies:
    """Returns ``simulate.dependencies`` for this schedule, with the stage graph looked up once.

    The same rule: F needs F of every predecessor; B or BW needs F of its stage and the
    backward (B or BW, as scheduled) of every successor; W needs B.
    """
    kinds = backward_kinds(schedule)
    preds, succs = neighbours(schedule)

    def rule(key: Key) -> tuple[Key, ...]:
        kind, s, i = key
        if kind == "F":
            return tuple(("F", q, i) for q in preds[s])
        if kind == "W":
            return (("B", s, i),)
        return (("F", s, i),) + tuple((kinds.get((q, i), "B"), q, i) for q in succs[s])

    return rule


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
    counts = Counter(_key(a) for _, _, a in schedule.all_actions())
    for key, count in counts.items():
        if count > 1:
            raise ScheduleError(
                f"completeness rule: {_name(key)} appears {count} times; each action runs once"
            )
    kinds: dict[tuple[int, int], set[str]] = {}
    for kind, s, i in counts:
        kinds.setdefault((s, i), set()).add(kind)
    for s in range(schedule.num_stages):
        for i in range(schedule.num_microbatches):
            has = kinds.get((s, i), set())
            if has in ({"F", "BW"}, {"F", "B", "W"}):
                continue
            if "F" not in has:
                raise ScheduleError(
                    f"completeness rule: {_name(('F', s, i))} is missing; add it to device "
                    f"{schedule.placement[s]}"
                )
            if "BW" in has:
                extra = " and ".join(_name((k, s, i)) for k in ("B", "W") if k in has)
                raise ScheduleError(
                    f"completeness rule: {_name(('BW', s, i))} and {extra} both run the "
                    "backward; keep either BW alone or B and W"
                )
            missing = " and ".join(_name((k, s, i)) for k in ("B", "W") if k not in has)
            raise ScheduleError(
                f"completeness rule: {missing} is missing; a stage's backward is one BW or "
                f"one B and one W (add it to device {schedule.placement[s]})"
            )


def _check_order(schedule: Schedule, dependencies: Dependencies) -> None:
    """Raises if an action comes before a dependency that its own device runs later."""
    for device, program in enumerate(schedule.actions):
        keys = [_key(a) for a in program]
        position = {key: k for k, key in enumerate(keys)}
        for k, key in enumerate(keys):
            for dep in dependencies(key):
                later = position.get(dep)
                if later is not None and later > k:
                    action, needed = _name(key), _name(dep)
                    raise ScheduleError(
                        f"order rule: {action} on device {device} (position {k}) runs before "
                        f"{needed} (position {later}), which it needs; move {action} after "
                        f"{needed}"
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


def _check_deadlock(schedule: Schedule, dependencies: Dependencies) -> None:
    """Raises if running each device's list in order gets stuck."""
    done: set[Key] = set()
    keys = [[_key(a) for a in program] for program in schedule.actions]
    cursor = [0] * schedule.num_devices
    waiting_on: dict[Key, list[int]] = {}
    waits_for: dict[int, Key] = {}
    runnable = deque(range(schedule.num_devices))
    while runnable:
        device = runnable.popleft()
        program = keys[device]
        while cursor[device] < len(program):
            action = program[cursor[device]]
            missing = next((d for d in dependencies(action) if d not in done), None)
            if missing is not None:
                waiting_on.setdefault(missing, []).append(device)
                waits_for[device] = missing
                break
            done.add(action)
            cursor[device] += 1
            runnable.extend(waiting_on.pop(action, ()))
    stuck = [
        f"device {d} waits at {schedule.actions[d][cursor[d]]} for {_name(waits_for[d])}"
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
    check_schedule(schedule, "validate")
    _check_graph(schedule)
    _check_placement_and_devices(schedule)
    _check_completeness(schedule)
    dependencies = _dependency_rule(schedule)
    _check_order(schedule, dependencies)
    _check_memory(schedule)
    _check_deadlock(schedule, dependencies)
    return schedule
