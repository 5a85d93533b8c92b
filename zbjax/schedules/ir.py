"""Schedules as plain data: actions, schedules, costs and simulation results (no JAX here).

An action is (kind, stage, microbatch) with the compact text form ``"{stage}{kind}{microbatch}"``,
e.g. ``"2F0"`` (stage 2, forward, microbatch 0) or ``"3BW5"`` (stage 3, fused backward,
microbatch 5). A schedule is a placement (stage -> device), the stage graph's edges (a chain
unless the model branches) and, per device, the ordered list of actions that device runs.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import math
import numbers
import operator
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from zbjax.errors import ScheduleError

#: Action kinds: forward, backward for inputs, backward for weights, fused backward (B and W).
KINDS: tuple[str, ...] = ("F", "B", "W", "BW")

_ACTION_RE = re.compile(r"^\s*(\d+)(BW|F|B|W)(\d+)\s*$")


def integer(value: object) -> int | None:
    """Returns ``value`` as an int if it is a Python or NumPy integer (not a bool), else None:
    a float such as 1.7 is not taken (``int()`` would truncate it, silently)."""
    if type(value) is int:
        return value
    if isinstance(value, bool | np.bool_):
        return None
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return None


def count(
    what: str, value: object, error: type[Exception] = ScheduleError, at_least: int = 1
) -> int:
    """Returns ``value`` as an int >= ``at_least`` (a Python or NumPy integer, ``integer``);
    raises ``error`` naming ``what`` for anything else (too small, a float, a bool, a string)."""
    number = integer(value)
    if number is None or number < at_least:
        raise error(f"{what} = {value!r}; it must be an integer >= {at_least}")
    return number


def real_number(value: object) -> float | None:
    """Returns ``value`` as a float if it is a real number (Python, NumPy, a 0-d array; not a
    bool or a string), else None."""
    if isinstance(value, bool | np.bool_ | str | bytes):
        return None
    if isinstance(value, np.ndarray | np.generic) and not np.issubdtype(value.dtype, np.number):
        return None
    try:
        number = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    return None if isinstance(value, complex) or np.iscomplexobj(value) else number


def as_index(what: str, value: object) -> int:
    """Returns ``value`` as an int (``integer``); raises ScheduleError naming ``what`` for
    anything else."""
    number = integer(value)
    if number is None:
        raise ScheduleError(f"{what} = {value!r} is not an integer")
    return number


@dataclass(frozen=True, order=True)
class Action:
    """One unit of pipeline work: ``kind`` of ``stage`` on ``microbatch``."""

    kind: str
    stage: int
    microbatch: int

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ScheduleError(f"action kind {self.kind!r} is not one of {KINDS}")
        if type(self.stage) is not int or type(self.microbatch) is not int:
            object.__setattr__(self, "stage", as_index(f"action {self.kind}'s stage", self.stage))
            object.__setattr__(
                self, "microbatch", as_index(f"action {self.kind}'s microbatch", self.microbatch)
            )
        if self.stage < 0 or self.microbatch < 0:
            raise ScheduleError(
                f"action {self.kind} has stage {self.stage} and microbatch {self.microbatch}; "
                "both must be >= 0"
            )

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"

    def __repr__(self) -> str:
        return f"Action({str(self)!r})"

    @classmethod
    def parse(cls, text: str) -> Action:
        """Returns the action written as ``"{stage}{kind}{microbatch}"`` (e.g. ``"2BW0"``)."""
        match = _ACTION_RE.match(text) if isinstance(text, str) else None
        if match is None:
            raise ScheduleError(
                f"cannot parse action {text!r}; write it as stage, kind, microbatch, "
                "e.g. '2F0', '1B3', '0W7' or '3BW1'"
            )
        stage, kind, microbatch = match.groups()
        return cls(kind, int(stage), int(microbatch))


def is_sequence(value: object) -> bool:
    """Returns whether ``value`` is a sequence of items: iterable, and not text (a string
    would be split into letters)."""
    return isinstance(value, Iterable) and not isinstance(value, str | bytes)


def placement_tuple(placement: object, what: str = "placement") -> tuple[int, ...]:
    """Returns ``placement`` (the device of each stage) as an int tuple; raises ScheduleError
    for anything that is not a sequence of integers."""
    if not is_sequence(placement):
        raise ScheduleError(
            f"{what} = {placement!r} is not a sequence; give the device of each stage, e.g. "
            "(0, 1, 2, 3)"
        )
    return tuple(as_index(f"{what}[{s}]", d) for s, d in enumerate(placement))


def edge_pairs(edges: object) -> tuple[tuple[int, int], ...]:
    """Returns ``edges`` as ``(src, dst)`` int pairs; raises ScheduleError naming what is not
    a sequence of pairs of stage indices."""
    if not is_sequence(edges):
        raise ScheduleError(
            f"edges = {edges!r} is not a sequence of (src, dst) stage pairs; pass e.g. "
            "[(0, 1), (0, 2), (1, 3), (2, 3)]"
        )
    pairs = []
    for edge in edges:
        pair = isinstance(edge, Sequence | np.ndarray) and is_sequence(edge)
        if not pair or len(edge) != 2:
            raise ScheduleError(
                f"edge {edge!r} is not a (src, dst) pair of stage indices; pass edges as "
                "e.g. [(0, 1), (1, 2)]"
            )
        pairs.append(
            (
                as_index(f"the source of edge {tuple(edge)!r}", edge[0]),
                as_index(f"the target of edge {tuple(edge)!r}", edge[1]),
            )
        )
    return tuple(pairs)


def chain_edges(num_stages: int) -> tuple[tuple[int, int], ...]:
    """Returns the edges of the chain 0 -> 1 -> ... -> num_stages - 1."""
    stages = count("chain_edges num_stages", num_stages)
    return tuple((s, s + 1) for s in range(stages - 1))


@dataclass(frozen=True)
class Schedule:
    """Placement of stages on devices plus each device's ordered actions.

    ``placement[s]`` is the device that runs stage ``s``; ``actions[d]`` is device ``d``'s
    program, run in order. ``edges`` are the stage graph's (src, dst) pairs: a chain unless the
    model branches (fan-out: several successors; fan-in: several predecessors). ``mem_limit``
    (in M_B units, per device) is checked by ``validate`` when set; ``w_mem`` is the part of
    M_B that W keeps after B (F adds 1, B frees 1 - w_mem, W frees w_mem, BW frees 1).
    """

    name: str
    num_stages: int
    num_microbatches: int
    placement: tuple[int, ...]
    actions: tuple[tuple[Action, ...], ...]
    edges: tuple[tuple[int, int], ...] = None  # type: ignore[assignment]
    mem_limit: float | None = None
    w_mem: float = 0.5
    stage_names: tuple[str, ...] | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        # Counts and indices must be integers: int() would truncate 0.7 to device 0, silently.
        for label in ("num_stages", "num_microbatches"):
            object.__setattr__(self, label, count(f"Schedule {label}", getattr(self, label)))
        object.__setattr__(self, "placement", placement_tuple(self.placement))
        object.__setattr__(self, "actions", _action_rows(self.actions))
        edges = chain_edges(self.num_stages) if self.edges is None else edge_pairs(self.edges)
        object.__setattr__(self, "edges", edges)
        if self.stage_names is not None:
            names = self.stage_names
            sequence = is_sequence(names)
            names = tuple(names) if sequence else ()
            if (
                not sequence
                or not all(isinstance(n, str) for n in names)
                or len(names) != self.num_stages
            ):
                raise ScheduleError(
                    f"Schedule stage_names = {self.stage_names!r} is not a sequence of "
                    f"{self.num_stages} strings (one per stage); pass e.g. "
                    f"{tuple(f's{i}' for i in range(min(self.num_stages, 3)))!r}..."
                )
            object.__setattr__(self, "stage_names", names)
        for label, low, high in (("mem_limit", 0.0, math.inf), ("w_mem", 0.0, 1.0)):
            value = getattr(self, label)
            if value is None and label == "mem_limit":
                continue
            if not isinstance(value, numbers.Real) or isinstance(value, bool) or value != value:
                raise ScheduleError(f"Schedule {label} = {value!r} is not a number")
            if not low <= value <= high:
                raise ScheduleError(
                    f"Schedule {label} = {value!r} is out of range; it must be in "
                    f"[{low:g}, {high:g}]"
                )
        if len(self.placement) != self.num_stages:
            raise ScheduleError(
                f"placement has {len(self.placement)} entries but num_stages is "
                f"{self.num_stages}; give one device per stage"
            )

    @property
    def num_devices(self) -> int:
        """Returns the number of pipeline devices (rows of ``actions``)."""
        return len(self.actions)

    def stages_on(self, device: int) -> tuple[int, ...]:
        """Returns the stages placed on ``device``, in increasing order."""
        return tuple(s for s, d in enumerate(self.placement) if d == device)

    def predecessors(self, stage: int) -> tuple[int, ...]:
        """Returns the stages whose outputs ``stage`` reads."""
        return self._neighbours[0].get(stage, ())

    def successors(self, stage: int) -> tuple[int, ...]:
        """Returns the stages that read ``stage``'s outputs."""
        return self._neighbours[1].get(stage, ())

    @functools.cached_property
    def _neighbours(self) -> tuple[dict[int, tuple[int, ...]], dict[int, tuple[int, ...]]]:
        # Per stage its predecessors and successors in ``edges`` order: scanning the edges at
        # every call made building and checking a chain of p stages take p**2 steps.
        before: dict[int, list[int]] = {}
        after: dict[int, list[int]] = {}
        for a, b in self.edges:
            before.setdefault(b, []).append(a)
            after.setdefault(a, []).append(b)
        return (
            {s: tuple(v) for s, v in before.items()},
            {s: tuple(v) for s, v in after.items()},
        )

    def all_actions(self) -> Iterable[tuple[int, int, Action]]:
        """Yields (device, position, action) for every action of the schedule."""
        for device, program in enumerate(self.actions):
            for position, action in enumerate(program):
                yield device, position, action

    def to_text(self) -> str:
        """Returns one line per device: ``"d0: 0F0 0F1 0B0 ..."``."""
        return "\n".join(
            f"d{device}: " + " ".join(str(a) for a in program)
            for device, program in enumerate(self.actions)
        )

    def forwards(self) -> Schedule:
        """Returns this schedule's forward pass, for evaluation (what ``pipe.value`` runs):
        every F on its device, without a memory limit, each device's in the order a list
        schedule of unit-time forwards starts them: whenever a device is free it runs its
        ready forward of the lowest microbatch (then stage). A chain of one stage per device
        takes m + p - 1 units, as its training order does; zb-v's V (two stages a device) 18
        for 4 stages and m = 8, where the training order's forwards take 28. Not a training
        schedule (``validate`` refuses it: every F needs its backward)."""
        stages, micro = self.num_stages, self.num_microbatches
        waiting = {(s, i): len(self.predecessors(s)) for s in range(stages) for i in range(micro)}
        ready: list[list[tuple[int, int]]] = [[] for _ in range(self.num_devices)]
        for (s, i), count in waiting.items():
            if not count:
                heapq.heappush(ready[self.placement[s]], (i, s))
        order: list[list[Action]] = [[] for _ in range(self.num_devices)]
        busy = {d for d, r in enumerate(ready) if r}
        while busy:
            started = []
            for device in sorted(busy):
                i, s = heapq.heappop(ready[device])
                order[device].append(Action("F", s, i))
                started.append((s, i))
                if not ready[device]:
                    busy.discard(device)
            for s, i in started:
                for successor in self.successors(s):
                    waiting[(successor, i)] -= 1
                    if not waiting[(successor, i)]:
                        device = self.placement[successor]
                        heapq.heappush(ready[device], (i, successor))
                        busy.add(device)
        return dataclasses.replace(self.with_actions(order), mem_limit=None)

    def with_actions(self, actions: Sequence[Sequence[Action]]) -> Schedule:
        """Returns a copy of this schedule with other per-device action lists."""
        return Schedule(
            name=self.name,
            num_stages=self.num_stages,
            num_microbatches=self.num_microbatches,
            placement=self.placement,
            actions=tuple(tuple(p) for p in actions),
            edges=self.edges,
            mem_limit=self.mem_limit,
            w_mem=self.w_mem,
            stage_names=self.stage_names,
        )


def _action_rows(actions: object) -> tuple[tuple[Action, ...], ...]:
    """Returns per-device action tuples; text such as ``"0F1"`` is parsed (``Action.parse``),
    anything else that is not an Action raises ScheduleError."""
    if not is_sequence(actions):
        raise ScheduleError(
            f"Schedule actions = {actions!r} is not a sequence of per-device action lists; "
            "pass e.g. ((Action('F', 0, 0), Action('BW', 0, 0)), ...) or "
            "parse_actions(text)"
        )
    rows = []
    for device, row in enumerate(actions):
        if not is_sequence(row):
            raise ScheduleError(
                f"Schedule actions[{device}] = {row!r} is not a sequence of actions; give "
                "each device's actions as a tuple of Action (or text such as '0F1')"
            )
        parsed = []
        for a in row:
            if isinstance(a, str):
                a = Action.parse(a)
            elif not isinstance(a, Action):
                raise ScheduleError(
                    f"Schedule actions[{device}] holds {a!r}, not an Action; write "
                    "Action('F', stage, microbatch) or its text, e.g. '0F1'"
                )
            parsed.append(a)
        rows.append(tuple(parsed))
    return tuple(rows)


def check_schedule(value: object, where: str) -> None:
    """Raises ScheduleError when ``value`` (the schedule given to ``where``) is not a
    Schedule: a name goes through ``build`` first."""
    if not isinstance(value, Schedule):
        hint = (
            f"build it first: zbjax.schedules.build({value!r}, num_stages, num_microbatches)"
            if isinstance(value, str)
            else "pass a zbjax.schedules.Schedule (from zbjax.schedules.build)"
        )
        raise ScheduleError(
            f"{where} takes a Schedule, not {type(value).__name__} {value!r}; {hint}"
        )


def parse_actions(text: str) -> tuple[tuple[Action, ...], ...]:
    """Returns per-device action lists from ``Schedule.to_text()`` output.

    A line ``"d2: ..."`` holds device 2's actions (lines may come in any order; the labels
    must name devices 0..n-1 once each); lines without labels are devices 0, 1, ... in order.
    """
    if not isinstance(text, str):
        raise ScheduleError(
            f"parse_actions takes the text of Schedule.to_text(), not {type(text).__name__} "
            f"{text!r}"
        )
    lines = [line for line in text.strip().splitlines() if line.strip()]
    labels, rows = [], []
    for line in lines:
        label, colon, body = line.partition(":")
        if not colon:
            label, body = "", line
        label = label.strip()
        if colon and not (label[:1] == "d" and label[1:].isascii() and label[1:].isdigit()):
            raise ScheduleError(
                f"parse_actions: line {line!r} starts with {label + ':'!r}, not a device "
                "label like 'd0:'; write 'd<device>: <actions>' (as Schedule.to_text() does) "
                "or the actions alone"
            )
        labels.append(int(label[1:]) if colon else None)
        rows.append(tuple(Action.parse(tok) for tok in body.split()))
    if all(k is None for k in labels):
        return tuple(rows)
    if sorted(k for k in labels if k is not None) != list(range(len(rows))):
        raise ScheduleError(
            f"parse_actions: the device labels {['?' if k is None else f'd{k}' for k in labels]} "
            f"do not name devices d0..d{len(rows) - 1} once each; label every line, one line "
            "per device"
        )
    return tuple(row for _, row in sorted(zip(labels, rows, strict=True)))


def _per_stage(name: str, value: float | Sequence[float], num_stages: int) -> tuple[float, ...]:
    if isinstance(value, int | float):
        values = (float(value),) * num_stages
    else:
        values = tuple(float(v) for v in value)
        if len(values) != num_stages:
            raise ScheduleError(
                f"costs.{name} has {len(values)} entries but there are {num_stages} stages; "
                f"give one cost per stage or a single number"
            )
    for v in values:
        if not 0 <= v < math.inf:
            raise ScheduleError(
                f"costs.{name} = {v} is negative, infinite or NaN; costs must be finite and >= 0"
            )
    return values


@functools.lru_cache(maxsize=256)
def _costs_per_stage(costs: Costs, num_stages: int) -> tuple[tuple[float, ...], ...]:
    return (
        _per_stage("f", costs.f, num_stages),
        _per_stage("b", costs.b, num_stages),
        _per_stage("w", costs.w, num_stages),
    )


@functools.lru_cache(maxsize=256)
def _fused_per_stage(costs: Costs, num_stages: int) -> tuple[float, ...]:
    if costs.bw is not None:
        return _per_stage("bw", costs.bw, num_stages)
    _, b, w = _costs_per_stage(costs, num_stages)
    return tuple(x + y for x, y in zip(b, w, strict=True))


@dataclass(frozen=True)
class Costs:
    """Time of F, B and W per stage and microbatch (scalars or per-stage lists), and comm.

    ``comm`` is the delay between an action ending on one device and a dependent action on
    another device being able to start. ``comm_message`` is what each further message adds to
    an exchange that carries several (the lowering sends a device's messages over one shift in
    a tick together, ``zbjax.ticks``): 0 (the default) where an exchange costs its latency
    whatever it carries, about ``comm`` where the link's bandwidth bounds it
    (``Pipeline.measure_costs`` times both). ``bw`` is the time of the fused backward (BW); by
    default ``b + w``. Measured, it is often less: the fused backward neither writes W's
    stash nor reads it back (``Pipeline.measure_costs`` times it).
    """

    f: float | tuple[float, ...] = 1.0
    b: float | tuple[float, ...] = 1.0
    w: float | tuple[float, ...] = 1.0
    comm: float = 0.0
    bw: float | tuple[float, ...] | None = None
    comm_message: float = 0.0

    def __post_init__(self) -> None:
        for name in ("f", "b", "w", "bw", "comm", "comm_message"):
            value = getattr(self, name)
            if value is None and name == "bw":  # the fused backward: b + w by default
                continue
            # NumPy scalars and 0-d arrays are numbers; sequences are per stage. A string
            # ("2") or a bool is neither, though float() would take it.
            number = real_number(value) if np.ndim(value) == 0 else None
            if number is None and name in ("comm", "comm_message"):
                raise ScheduleError(f"costs.{name} = {value!r} is not a number")
            per_stage = None
            if number is None and np.ndim(value) == 1 and not isinstance(value, str):
                per_stage = tuple(real_number(v) for v in value)
            if number is None and (per_stage is None or None in per_stage):
                raise ScheduleError(
                    f"costs.{name} = {value!r} is not a number or a sequence of numbers "
                    "(one per stage)"
                )
            converted = number if number is not None else per_stage
            object.__setattr__(self, name, converted)
        for name in ("comm", "comm_message"):
            if not 0 <= getattr(self, name) < math.inf:
                raise ScheduleError(
                    f"costs.{name} = {getattr(self, name)} is negative, infinite or NaN; it "
                    "must be finite and >= 0"
                )

    @staticmethod
    def check(costs: object, what: str = "costs") -> None:
        """Raises ScheduleError when ``costs`` is neither None nor a Costs."""
        if costs is not None and not isinstance(costs, Costs):
            raise ScheduleError(
                f"{what} = {costs!r} is not a zbjax.schedules.Costs; pass "
                "Costs(f=..., b=..., w=..., comm=...) or None"
            )

    def exchange(self, messages: int) -> float:
        """Returns the time of an exchange whose largest payload carries ``messages``."""
        return self.comm + self.comm_message * max(messages - 1, 0)

    def per_stage(self, num_stages: int) -> tuple[tuple[float, ...], ...]:
        """Returns (f, b, w) as per-stage tuples, checking lengths and signs (once per costs
        and number of stages: ``of`` runs on every action of every packing tried)."""
        return _costs_per_stage(self, num_stages)

    def fused_per_stage(self, num_stages: int) -> tuple[float, ...]:
        """Returns the per-stage time of BW: ``bw`` where given, else ``b + w``."""
        return _fused_per_stage(self, num_stages)

    def of(self, action: Action, num_stages: int) -> float:
        """Returns the duration of ``action``."""
        if action.kind == "BW":
            return self.fused_per_stage(num_stages)[action.stage]
        f, b, w = self.per_stage(num_stages)
        s = action.stage
        return {"F": f[s], "B": b[s], "W": w[s]}[action.kind]


@dataclass(frozen=True)
class SimResult:
    """Timing and memory of a simulated schedule.

    ``start``/``end`` map each action to its times; ``bubble_rate`` is
    1 - (total compute time of all devices) / (num_devices * makespan); ``peak_memory`` is
    per device, in M_B units.
    """

    start: dict[Action, float]
    end: dict[Action, float]
    makespan: float
    bubble_rate: float
    peak_memory: tuple[float, ...]
    busy: tuple[float, ...]
