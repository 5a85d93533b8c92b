"""zb-auto: a zero-bubble schedule searched for given costs and a memory limit (no JAX here).

Algorithm (the Zero Bubble paper's automatic scheduler, then two searches on top of it):

1. **Greedy list scheduling, several variants.** An event simulation lets the device that is
   free earliest pick its next action: B when its inputs are there (B is on the critical
   path), else F while the stage has fewer than ``warmup`` forwards in flight and memory
   allows, else W to fill what would be idle time or to free memory for the next F. Variants
   differ in ``warmup`` per stage (1F1B's depth plus a margin, as many as fit before the first
   B comes back, or as many as memory allows), in whether a ready F goes before a ready B, and
   in what a stage does when only a W could run but it would delay a soon-ready F or B: run
   it, wait, or wait only while the stage has idled less than the most idle stage.
2. **Reference schedules.** zb-h1 and zb-h2 from ``generators``, built for the same memory
   limit, join the candidates, so zb-auto is never worse than either.
3. **Per-stage tuning.** From the best few greedy variants, coordinate descent changes one
   stage's setting at a time (warm-up +-1, tie rule, late-W rule) and keeps what improves.
4. **Local search on the order.** Walk the critical path back from the action that ends last;
   where an action waited for the previous action on its device, move that one behind it;
   move W into idle gaps. Each move is re-simulated and kept when the objective improves.

Searches stop early when the key reaches a lower bound (each device's busy time plus the idle
it cannot avoid: waiting for its first B with memory for only floor(mem_limit) F, and waiting
after its last F for that microbatch's B), which proves the schedule optimal; on the paper's
profiles at limit p this is what happens.

The objective is the makespan of one step (what a zbjax pipeline runs), ties broken by the
longest per-device span; ``objective="span"`` swaps the two (the paper's measure, which sets the
step time when consecutive steps overlap). Searches stop when nothing improves or at a budget
of schedule evaluations (``SEARCH_BUDGET``: a count, so the same request gives the same
schedule on every machine, under any load and in every process of a multi-host job), or at
``time_limit`` seconds when one is given. Every candidate is checked against ``mem_limit``
with ``peak_memory``'s rule (F adds 1, B frees 1 - w_mem, W frees w_mem), so the result never
exceeds it.
"""

from __future__ import annotations

import heapq
import math
import numbers
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import cached_property

from zbjax.errors import ScheduleError
from zbjax.schedules.dag import topological
from zbjax.schedules.ir import Action, Costs, Schedule, chain_edges, count, edge_pairs

_F, _B, _W = 0, 1, 2
_KIND_NAMES = ("F", "B", "W")
_EPS = 1e-9


@dataclass(frozen=True)
class _Problem:
    """Stage DAG, costs and memory rule of one zb-auto request.

    Actions are ints: ``(kind * num_stages + stage) * num_microbatches + microbatch``; the
    cached tables below are indexed by them.
    """

    num_stages: int
    num_microbatches: int
    f: tuple[float, ...]
    b: tuple[float, ...]
    w: tuple[float, ...]
    comm: float
    mem_limit: float
    w_mem: float
    edges: tuple[tuple[int, int], ...]
    predecessors: tuple[tuple[int, ...], ...]
    successors: tuple[tuple[int, ...], ...]

    @property
    def num_actions(self) -> int:
        return 3 * self.num_stages * self.num_microbatches

    def action_id(self, kind: int, stage: int, microbatch: int) -> int:
        return (kind * self.num_stages + stage) * self.num_microbatches + microbatch

    def decode(self, action: int) -> tuple[int, int, int]:
        """Returns (kind, stage, microbatch) of ``action``."""
        rest, microbatch = divmod(action, self.num_microbatches)
        kind, stage = divmod(rest, self.num_stages)
        return kind, stage, microbatch

    @cached_property
    def kind_of(self) -> tuple[int, ...]:
        return tuple(self.decode(a)[0] for a in range(self.num_actions))

    @cached_property
    def duration(self) -> tuple[float, ...]:
        costs = (self.f, self.b, self.w)
        return tuple(costs[k][s] for k, s, _ in map(self.decode, range(self.num_actions)))

    @cached_property
    def memory_delta(self) -> tuple[float, float, float]:
        """Returns the memory change of F, B and W (same rule as ``peak_memory``)."""
        return (1.0, -(1.0 - self.w_mem), -self.w_mem)

    @cached_property
    def inputs(self) -> tuple[tuple[tuple[int, float], ...], ...]:
        """Returns, per action, (dependency, delay) pairs: the delay is comm across devices.

        F(s, i) needs F of every predecessor; B(s, i) needs F(s, i) and B of every successor;
        W(s, i) needs B(s, i) (the rule ``simulate`` uses).
        """
        table = []
        for action in range(self.num_actions):
            kind, s, i = self.decode(action)
            if kind == _F:
                deps = [(self.action_id(_F, p, i), self.comm) for p in self.predecessors[s]]
            elif kind == _B:
                deps = [(self.action_id(_F, s, i), 0.0)]
                deps += [(self.action_id(_B, q, i), self.comm) for q in self.successors[s]]
            else:
                deps = [(self.action_id(_B, s, i), 0.0)]
            table.append(tuple(deps))
        return tuple(table)


@dataclass(frozen=True)
class _Timeline:
    """Simulated times of one candidate: per-action start/end, makespan, longest span."""

    start: list[float]
    end: list[float]
    makespan: float
    span: float


def _timeline(problem: _Problem, orders: Sequence[Sequence[int]]) -> _Timeline | None:
    """Returns the simulated timeline of per-device orders, or None when they deadlock."""
    start = [0.0] * problem.num_actions
    end = [-1.0] * problem.num_actions
    inputs, duration = problem.inputs, problem.duration
    position = [0] * len(orders)
    free = [0.0] * len(orders)
    # Each device runs until an input is missing, then waits on that input's action.
    waiting: dict[int, list[int]] = {}
    pending = sum(len(program) for program in orders)
    stack = [d for d, program in enumerate(orders) if program]
    while stack:
        device = stack.pop()
        program = orders[device]
        while position[device] < len(program):
            action = program[position[device]]
            ready = free[device]
            missing = -1
            for dep, delay in inputs[action]:
                if end[dep] < 0:
                    missing = dep
                    break
                ready = max(ready, end[dep] + delay)
            if missing >= 0:
                waiting.setdefault(missing, []).append(device)
                break
            start[action] = ready
            free[device] = end[action] = ready + duration[action]
            position[device] += 1
            pending -= 1
            stack.extend(waiting.pop(action, ()))
    if pending:
        return None
    span = max((end[p[-1]] - start[p[0]] for p in orders if p), default=0.0)
    return _Timeline(start, end, max(free, default=0.0), span)


def _key(timeline: _Timeline, objective: str) -> tuple[float, float]:
    """Returns the sort key of a timeline (smaller is better): the objective, then the other."""
    pair = (round(timeline.makespan, 6), round(timeline.span, 6))
    return pair[::-1] if objective == "span" else pair


def _fits(problem: _Problem, program: Sequence[int]) -> bool:
    """Returns whether a device's program stays within the memory limit."""
    delta, kind_of = problem.memory_delta, problem.kind_of
    level = 0.0
    for action in program:
        level += delta[kind_of[action]]
        if level > problem.mem_limit + _EPS:
            return False
    return True


#: What a stage does when only W could run now but it would delay a soon-ready F or B.
_IDLE, _FILL, _BALANCE = 0, 1, 2


@dataclass(frozen=True)
class _Policy:
    """One greedy variant, per stage: forwards in flight, tie rule, and the late-W rule.

    ``late_w`` is _IDLE (wait, keep the W for later), _FILL (run the W anyway) or _BALANCE
    (wait only while this stage has idled less than the most idle stage, as the paper does).
    """

    warmup: tuple[int, ...]
    prefer_forward: tuple[bool, ...]
    late_w: tuple[int, ...]


def _greedy(problem: _Problem, policy: _Policy) -> list[list[int]] | None:
    """Returns per-device orders built by event-driven list scheduling, or None on a stall."""
    num_stages, m = problem.num_stages, problem.num_microbatches
    inputs, duration, delta = problem.inputs, problem.duration, problem.memory_delta
    end = [-1.0] * problem.num_actions
    clock = [0.0] * num_stages  # when each device decides next
    last_end = [-1.0] * num_stages
    idle = [0.0] * num_stages
    counts = [[0, 0, 0] for _ in range(num_stages)]
    memory = [0.0] * num_stages
    orders: list[list[int]] = [[] for _ in range(num_stages)]

    def ready(action: int) -> float | None:
        # None while an input is not scheduled yet.
        at = 0.0
        for dep, delay in inputs[action]:
            if end[dep] < 0:
                return None
            at = max(at, end[dep] + delay)
        return at

    def earliest_start(action: int, memo: dict[int, float]) -> float:
        # A lower bound from device clocks on when an action's inputs can all be there.
        at = 0.0
        for dep, delay in inputs[action]:
            if end[dep] >= 0:
                at = max(at, end[dep] + delay)
                continue
            if dep not in memo:
                dep_stage = problem.decode(dep)[1]
                memo[dep] = max(clock[dep_stage], earliest_start(dep, memo)) + duration[dep]
            at = max(at, memo[dep] + delay)
        return at

    def choose(stage: int, now: float) -> int | float:
        # Returns an action to run now, or (as a float) the time to look again.
        n_f, n_b, n_w = counts[stage]
        f_id = problem.action_id(_F, stage, n_f) if n_f < m else -1
        b_id = problem.action_id(_B, stage, n_b) if n_b < n_f else -1
        w_id = problem.action_id(_W, stage, n_w) if n_w < n_b else -1
        memory_ok = memory[stage] + 1.0 <= problem.mem_limit + _EPS
        f_allowed = f_id >= 0 and memory_ok and n_f - n_b < policy.warmup[stage]
        r_b = ready(b_id) if b_id >= 0 else None
        r_f = ready(f_id) if f_id >= 0 and memory_ok else None
        b_now = r_b is not None and r_b <= now + _EPS
        f_now = f_allowed and r_f is not None and r_f <= now + _EPS
        if b_now and (not f_now or not policy.prefer_forward[stage]):
            return b_id
        if f_now:
            return f_id
        memo: dict[int, float] = {}
        wake = math.inf
        if b_id >= 0:
            wake = earliest_start(b_id, memo)
        if f_allowed:
            wake = min(wake, earliest_start(f_id, memo))
        if w_id >= 0:
            if (
                (f_id >= 0 and not memory_ok)  # W frees the memory the next F needs
                or now + problem.w[stage] <= wake + _EPS  # W ends before F or B can start
                or wake == math.inf
                or policy.late_w[stage] == _FILL
                or (
                    policy.late_w[stage] == _BALANCE and idle[stage] + wake - now > max(idle) + _EPS
                )
            ):
                return w_id
        elif r_f is not None and r_f <= now + _EPS and now + problem.f[stage] <= wake + _EPS:
            # Past the warm-up depth an F still beats idling when it ends before B can start.
            return f_id
        return max(wake, now)

    # Devices by next decision time, then stage; a device whose inputs may come at this very
    # time (zero-length actions) is stalled: it lets the others at that time go first.
    queue = [(0.0, 0, stage, stage) for stage in range(num_stages)]
    stalls = turns = 0
    while queue:
        now, _, _, stage = heapq.heappop(queue)
        choice = choose(stage, now)
        if isinstance(choice, float):
            stalled = choice <= now + _EPS
            stalls = stalls + 1 if stalled else 0
            if stalls > len(queue):
                return None  # every device waits on another at this time: no progress
            clock[stage] = choice
            # A stalled device goes behind the other stalled ones, so each gets a turn.
            turns += 1
            heapq.heappush(
                queue, (choice, 1, turns, stage) if stalled else (choice, 0, stage, stage)
            )
            continue
        stalls = 0
        kind = choice // (num_stages * m)
        if last_end[stage] >= 0:
            idle[stage] += now - last_end[stage]
        end[choice] = last_end[stage] = clock[stage] = now + duration[choice]
        counts[stage][kind] += 1
        memory[stage] += delta[kind]
        orders[stage].append(choice)
        if len(orders[stage]) < 3 * m:
            heapq.heappush(queue, (end[choice], 0, stage, stage))
    return orders


def _critical_links(
    problem: _Problem, orders: Sequence[Sequence[int]], timeline: _Timeline, objective: str
) -> list[tuple[int, int]]:
    """Returns (device, position) of actions on the path that decides the objective which
    waited for the previous action on their device (not for an input), latest first."""
    start, end = timeline.start, timeline.end
    if objective == "span":
        device = max(
            (d for d in range(len(orders)) if orders[d]),
            key=lambda d: end[orders[d][-1]] - start[orders[d][0]],
        )
    else:
        device = max((d for d in range(len(orders)) if orders[d]), key=lambda d: end[orders[d][-1]])
    position_of = {a: (d, k) for d, program in enumerate(orders) for k, a in enumerate(program)}
    links = []
    position = len(orders[device]) - 1
    while position >= 0:
        action = orders[device][position]
        data_ready, data_dep = 0.0, -1
        for dep, delay in problem.inputs[action]:
            if end[dep] + delay > data_ready:
                data_ready, data_dep = end[dep] + delay, dep
        previous_end = end[orders[device][position - 1]] if position else 0.0
        if position and previous_end >= start[action] - _EPS and previous_end > data_ready + _EPS:
            links.append((device, position))
            position -= 1
        elif data_dep >= 0 and data_ready >= start[action] - _EPS:
            device, position = position_of[data_dep]
        else:
            position -= 1
    return links


def _moves(
    problem: _Problem, orders: Sequence[Sequence[int]], timeline: _Timeline, objective: str
) -> list[tuple[int, int, int]]:
    """Returns candidate moves (device, from position, to position), most promising first."""
    kind_of = problem.kind_of
    moves = []
    for device, position in _critical_links(problem, orders, timeline, objective):
        program = orders[device]
        blocker, blocked = program[position - 1], program[position]
        if any(dep == blocker for dep, _ in problem.inputs[blocked]):
            continue
        # Put the action that made a critical one wait behind it (a W, which nobody waits
        # for, up to a few places further); each kind keeps its microbatch order.
        reach = 4 if kind_of[blocker] == _W else 1
        for target in range(position, min(position + reach, len(program))):
            if kind_of[program[target]] == kind_of[blocker]:
                break
            moves.append((device, position - 1, target))
    for device, program in enumerate(orders):
        for position in range(1, len(program)):
            gap_start = timeline.end[program[position - 1]]
            gap = timeline.start[program[position]] - gap_start
            if gap <= _EPS:
                continue
            # Pull the next W into the idle gap when it fits: nothing starts later for it.
            for later in range(position, len(program)):
                action = program[later]
                if kind_of[action] == _W:
                    b_end = timeline.end[problem.inputs[action][0][0]]
                    if b_end <= gap_start + _EPS and problem.duration[action] <= gap + _EPS:
                        moves.append((device, later, position))
                    break
            # Or push the last earlier W into it, so what ran after that W starts sooner.
            for earlier in range(position - 2, -1, -1):
                if kind_of[program[earlier]] == _W:
                    moves.append((device, earlier, position - 1))
                    break
    return moves


def _moved(orders: Sequence[Sequence[int]], device: int, source: int, target: int) -> list:
    program = list(orders[device])
    program.insert(target, program.pop(source))
    return [program if d == device else orders[d] for d in range(len(orders))]


#: Schedule evaluations a search may spend without ``time_limit``, in actions evaluated: each
#: greedy fill or timeline simulation of the candidates costs its ``num_actions`` (3 p m).
#: A problem of 96 actions (p = 4, m = 8) gets 625 evaluations, more than its search needs; on
#: the Zero Bubble paper's 1.5B profile the result equals the unbounded search's at p = 8,
#: m = 24 (104 evaluations, 0.3 s on a 2-core Xeon) and is within 0.01 % of its makespan at
#: p = 16, m = 32 (39 evaluations, 0.5 s).
SEARCH_BUDGET = 60_000


class _Budget:
    """What a search may still spend: evaluations (a count) and, with a time limit, time."""

    def __init__(self, problem: _Problem, time_limit: float | None) -> None:
        if time_limit is None:
            self.left = max(8, SEARCH_BUDGET // problem.num_actions)
            self.deadline = math.inf
        else:
            self.left = math.inf
            self.deadline = time.perf_counter() + time_limit

    def spend(self) -> bool:
        """Takes one evaluation; False (taking none) once the budget is spent."""
        if self.left <= 0 or time.perf_counter() > self.deadline:
            return False
        self.left -= 1
        return True


def _local_search(
    problem: _Problem, orders: list[list[int]], objective: str, budget: _Budget, rounds: int
) -> list[list[int]]:
    """Returns orders improved by first-improvement moves around the critical path."""
    timeline = _timeline(problem, orders)
    assert timeline is not None, "local search starts from a schedule that runs"
    key = _key(timeline, objective)
    for _ in range(rounds):
        for device, source, target in _moves(problem, orders, timeline, objective):
            if not budget.spend():
                return orders
            candidate = _moved(orders, device, source, target)
            if not _fits(problem, candidate[device]):
                continue
            candidate_timeline = _timeline(problem, candidate)
            if candidate_timeline is not None and _key(candidate_timeline, objective) < key:
                orders, timeline = candidate, candidate_timeline
                key = _key(timeline, objective)
                break
        else:
            break
    return orders


def _stage_graph(
    num_stages: int, edges: Sequence[tuple[int, int]] | None
) -> tuple[tuple[tuple[int, int], ...], tuple[tuple[int, ...], ...], tuple[tuple[int, ...], ...]]:
    """Returns (edges, predecessors, successors), checking the edges form a DAG."""
    edges = chain_edges(num_stages) if edges is None else edge_pairs(edges)
    for a, b in edges:
        if not (0 <= a < num_stages and 0 <= b < num_stages) or a == b:
            raise ScheduleError(
                f"edge ({a}, {b}) is not between two different stages of 0..{num_stages - 1}; "
                "give edges as (src, dst) stage pairs"
            )
    predecessors = tuple(tuple(a for a, b in edges if b == s) for s in range(num_stages))
    successors = tuple(tuple(b for a, b in edges if a == s) for s in range(num_stages))
    if len(topological(successors)) != num_stages:
        raise ScheduleError(f"edges {edges} contain a cycle; the stage graph must be a DAG")
    return edges, predecessors, successors


def _depth_to_sink(successors: Sequence[Sequence[int]]) -> list[int]:
    """Returns, per stage, the number of stages on the longest path from it to a sink."""
    depth = [1] * len(successors)
    for stage in reversed(topological(successors)):
        depth[stage] += max((depth[q] for q in successors[stage]), default=0)
    return depth


def _earliest_forward(problem: _Problem) -> list[float]:
    """Returns, per stage, the earliest time any of its forwards can start."""
    ready = [0.0] * problem.num_stages
    for stage in topological(problem.successors):
        for q in problem.successors[stage]:
            ready[q] = max(ready[q], ready[stage] + problem.f[stage] + problem.comm)
    return ready


def _round_trip(problem: _Problem) -> list[float]:
    """Returns, per stage, the least time from the start of F(s, i) until B(s, i) can start:
    F of every stage below s, then B back up (any microbatch i)."""
    trip = list(problem.f)
    for stage in reversed(topological(problem.successors)):
        for q in problem.successors[stage]:
            via = problem.f[stage] + problem.comm + trip[q] + problem.b[q] + problem.comm
            trip[stage] = max(trip[stage], via)
    return trip


def _first_backward_gap(problem: _Problem) -> list[float]:
    """Returns, per stage, how many forwards fit before its first B can start: the paper's
    warm-up rule ("as many F as fit before the first B arrives")."""
    trip = _round_trip(problem)
    return [trip[s] / f if (f := problem.f[s]) > 0 else math.inf for s in range(len(trip))]


def _bound(problem: _Problem, objective: str) -> tuple[float, float]:
    """Returns a key no schedule can beat, from each device's unavoidable idle time.

    Until its first B can start, a device can only run F, at most floor(mem_limit) of them.
    After its last F starts, B of that microbatch is a round trip away, and all the device
    can run meanwhile is B and W of the k - 1 other microbatches in flight and j earlier W,
    with k + j * w_mem within the limit. When m > floor(mem_limit) the two windows are
    disjoint (the last F needs memory a B freed), so their idle times add up. Nor can a
    device end before the last B of a stage below it has come back, plus one W.
    """
    m, limit = problem.num_microbatches, problem.mem_limit
    most_forwards = min(m, _forward_cap(problem))
    f_ready, trip = _earliest_forward(problem), _round_trip(problem)
    # From a stage's first F to the end of its last B: all its own F and B, or a successor's
    # (whose first F comes f + comm later) and the last B coming back; one W follows.
    last_backward = [m * (problem.f[s] + problem.b[s]) for s in range(problem.num_stages)]
    for s in reversed(topological(problem.successors)):
        for q in problem.successors[s]:
            via = problem.f[s] + 2 * problem.comm + last_backward[q] + problem.b[s]
            last_backward[s] = max(last_backward[s], via)
    makespan = span = 0.0
    for s in range(problem.num_stages):
        f, b, w = problem.f[s], problem.b[s], problem.w[s]
        start_idle = max(0.0, trip[s] - most_forwards * f)
        tail_work = 0.0
        for k in range(1, most_forwards + 1):
            spare = m - k if problem.w_mem <= 0 else int((limit - k) / problem.w_mem + _EPS)
            j = max(0, min(m - k, spare))
            tail_work = max(tail_work, (k - 1) * b + (k - 1 + j) * w)
        tail_idle = max(0.0, trip[s] - f - tail_work)
        idle = start_idle + tail_idle if m > most_forwards else max(start_idle, tail_idle)
        length = max(m * (f + b + w) + idle, last_backward[s] + w)
        makespan = max(makespan, f_ready[s] + length)
        span = max(span, length)
    return _key(_Timeline([], [], makespan, span), objective)


def _policies(problem: _Problem) -> list[_Policy]:
    """Returns the greedy variants: warm-up shapes times the tie and late-W rules."""
    depth = _depth_to_sink(problem.successors)
    gap = _first_backward_gap(problem)
    cap = _forward_cap(problem)
    longest = max(depth)
    # As many F as fit before the first B comes back (scaled), 1F1B's depth (plus a margin),
    # or as many as memory allows. The first shapes win most often, so they go first for
    # when the time limit cuts this list short.
    shapes = [
        [math.ceil(scale * g - _EPS) if g < math.inf else cap for g in gap]
        for scale in (1.0, 0.75, 1.25, 0.5)
    ]
    shapes += [[d + extra for d in depth] for extra in (0, 1, 2, longest // 2, longest)]
    shapes.append([cap] * problem.num_stages)
    warmups = []
    for shape in shapes:
        warmup = tuple(max(1, min(cap, k)) for k in shape)
        if warmup not in warmups:
            warmups.append(warmup)
    num_stages = problem.num_stages
    return [
        _Policy(warmup, (prefer_forward,) * num_stages, (late_w,) * num_stages)
        for warmup in warmups
        for late_w in (_FILL, _IDLE, _BALANCE)
        for prefer_forward in (False, True)
    ]


def _forward_cap(problem: _Problem) -> int:
    """Returns the most forwards a stage can hold at once under the memory limit."""
    return max(1, int(math.floor(problem.mem_limit + _EPS)))


def _neighbours(policy: _Policy, cap: int) -> list[_Policy]:
    """Returns the policies that differ from ``policy`` in one setting of one stage."""
    found = []
    for stage in range(len(policy.warmup)):
        for step in (1, -1):
            warmup = list(policy.warmup)
            warmup[stage] += step
            if 1 <= warmup[stage] <= cap:
                found.append(replace(policy, warmup=tuple(warmup)))
        prefer_forward = list(policy.prefer_forward)
        prefer_forward[stage] = not prefer_forward[stage]
        found.append(replace(policy, prefer_forward=tuple(prefer_forward)))
        for rule in (_IDLE, _FILL, _BALANCE):
            if rule != policy.late_w[stage]:
                late_w = list(policy.late_w)
                late_w[stage] = rule
                found.append(replace(policy, late_w=tuple(late_w)))
    return found


def _tune(
    problem: _Problem, policy: _Policy, key: tuple[float, float], objective: str, budget: _Budget
) -> tuple[tuple[float, float], list[list[int]] | None]:
    """Returns the key and orders of the policy reached by cyclic coordinate descent
    (orders None when nothing beat ``policy``)."""
    cap = _forward_cap(problem)
    best_orders = None
    index = unchanged = 0
    neighbours = _neighbours(policy, cap)
    bound = _bound(problem, objective)
    while unchanged < len(neighbours) and key > bound and budget.spend():
        candidate = neighbours[index % len(neighbours)]
        index += 1
        unchanged += 1
        orders = _greedy(problem, candidate)
        if orders is None or not all(_fits(problem, program) for program in orders):
            continue
        timeline = _timeline(problem, orders)
        if timeline is not None and _key(timeline, objective) < key:
            key, best_orders, unchanged = _key(timeline, objective), orders, 0
            neighbours = _neighbours(candidate, cap)
    return key, best_orders


def _reference_orders(problem: _Problem) -> list[list[list[int]]]:
    """Returns the zb-h1 and zb-h2 orders (built for the same memory limit) on a chain."""
    if problem.edges != chain_edges(problem.num_stages):
        return []
    from zbjax.schedules import generators  # imported here: the registry imports zb-auto

    kinds = {"F": _F, "B": _B, "W": _W}
    found = []
    for generator in (generators.zb_h1, generators.zb_h2):
        try:
            schedule = generator(
                problem.num_stages,
                problem.num_microbatches,
                w_mem=problem.w_mem,
                mem_limit=problem.mem_limit,
            )
        except ScheduleError:
            continue  # this generator cannot fit the limit; the greedy variants still can
        orders = [
            [problem.action_id(kinds[a.kind], a.stage, a.microbatch) for a in program]
            for program in schedule.actions
        ]
        if all(_fits(problem, program) for program in orders):
            found.append(orders)
    return found


def _check_request(
    num_stages: int,
    num_microbatches: int,
    num_devices: int | None,
    mem_limit: float,
    w_mem: float,
    time_limit: float | None,
) -> None:
    for name, value in (("num_stages", num_stages), ("num_microbatches", num_microbatches)):
        count(f"zb-auto: {name}", value)
    if num_devices is not None and num_devices != num_stages:
        raise ScheduleError(
            f"zb-auto places one stage per device, but num_devices = {num_devices} and "
            f"num_stages = {num_stages}; pass num_devices={num_stages} or leave it out"
        )
    if not 0.0 <= w_mem <= 1.0:
        raise ScheduleError(f"w_mem = {w_mem} must lie in [0, 1] (a fraction of M_B)")
    if not mem_limit >= 1.0:
        raise ScheduleError(
            f"mem_limit = {mem_limit} M_B is below the 1 M_B that one forward keeps on its "
            "device until its backward; no schedule fits it. Use mem_limit >= 1"
        )
    if time_limit is not None and not time_limit >= 0.0:
        raise ScheduleError(f"time_limit = {time_limit} s; give a number of seconds >= 0")


def _search(problem: _Problem, objective: str, budget: _Budget) -> list[list[int]]:
    """Returns the best per-device orders found by steps 1-4 of the module docstring."""
    scored = [(orders, None) for orders in _reference_orders(problem)]
    for policy in _policies(problem):
        if scored and not budget.spend():
            break
        orders = _greedy(problem, policy)
        if orders is not None and all(_fits(problem, program) for program in orders):
            scored.append((orders, policy))
    timelines = [_timeline(problem, orders) for orders, _ in scored]
    scored = [(t, o, p) for t, (o, p) in zip(timelines, scored, strict=True) if t is not None]
    if not scored:
        raise ScheduleError(
            f"zb-auto found no schedule within mem_limit = {problem.mem_limit} M_B for "
            f"{problem.num_stages} stages; raise mem_limit"
        )
    key, best = min(((_key(t, objective), o) for t, o, _ in scored), key=lambda item: item[0])
    # Tune the best few greedy variants stage by stage, by the objective and (since the
    # descent is path-dependent) by the other measure too; keep whatever beats the best.
    other = "span" if objective == "makespan" else "makespan"
    bound = _bound(problem, objective)
    for measure, tries in ((objective, 3), (other, 3)):
        ranked = sorted(
            ((_key(t, measure), p) for t, _, p in scored if p is not None),
            key=lambda item: item[0],
        )
        for start_key, policy in ranked[:tries]:
            if key <= bound:
                break  # provably optimal already
            _, tuned = _tune(problem, policy, start_key, measure, budget)
            timeline = _timeline(problem, tuned) if tuned is not None else None
            if timeline is not None and _key(timeline, objective) < key:
                key, best = _key(timeline, objective), tuned
    if key > bound:
        best = _local_search(problem, best, objective, budget, rounds=20 * problem.num_stages)
    return best


def zb_auto(
    num_stages: int,
    num_microbatches: int,
    num_devices: int | None = None,
    costs: Costs | None = None,
    mem_limit: float | None = None,
    w_mem: float = 0.5,
    edges: Sequence[tuple[int, int]] | None = None,
    time_limit: float | None = None,
    objective: str = "makespan",
) -> Schedule:
    """Returns a zb-auto schedule: F/B/W orders searched for ``costs`` under ``mem_limit``.

    ``costs`` defaults to F = B = W = 1 with no comm; ``mem_limit`` (M_B units per device)
    defaults to 2 * num_stages; ``edges`` defaults to the chain 0 -> 1 -> ...; stage s runs
    on device s. ``objective`` is "makespan" (one training step, the time until the last
    device finishes: what a zbjax pipeline runs) or "span" (the paper's measure: the longest
    time any one device is busy from its first to its last action, which sets the step time
    when consecutive steps overlap). Ties on one are broken by the other. The search stops
    when nothing improves, the result meets the lower bound, or its budget is spent: by
    default ``SEARCH_BUDGET`` evaluations, so the same request always gives the same
    schedule; with ``time_limit``, that many seconds instead (the result then depends on the
    machine's speed and load). Raises ScheduleError naming the bad value for sizes < 1,
    negative costs, mem_limit < 1, w_mem outside [0, 1] or edges that are not a DAG.
    """
    if objective not in ("makespan", "span"):
        raise ScheduleError(f"objective = {objective!r}; use 'makespan' or 'span'")
    num_stages = count("zb-auto: num_stages", num_stages)
    num_microbatches = count("zb-auto: num_microbatches", num_microbatches)
    for label, value in (("mem_limit", mem_limit), ("w_mem", w_mem), ("time_limit", time_limit)):
        if value is not None and (
            not isinstance(value, numbers.Real) or isinstance(value, bool) or value != value
        ):
            raise ScheduleError(f"zb-auto: {label} = {value!r} is not a number")
    mem_limit = 2.0 * num_stages if mem_limit is None else float(mem_limit)
    _check_request(num_stages, num_microbatches, num_devices, mem_limit, w_mem, time_limit)
    costs = costs or Costs()
    f, b, w = costs.per_stage(num_stages)
    costs.fused_per_stage(num_stages)  # raises on a bw of the wrong length or sign
    edges, predecessors, successors = _stage_graph(num_stages, edges)
    problem = _Problem(
        num_stages,
        num_microbatches,
        f,
        b,
        w,
        float(costs.comm),
        min(mem_limit, float(num_microbatches)),  # no schedule holds more than m forwards
        float(w_mem),
        edges,
        predecessors,
        successors,
    )
    best = _search(problem, objective, _Budget(problem, time_limit))

    actions = tuple(
        tuple(
            Action(_KIND_NAMES[kind], stage, microbatch)
            for kind, stage, microbatch in map(problem.decode, program)
        )
        for program in best
    )
    return Schedule(
        name="zb-auto",
        num_stages=num_stages,
        num_microbatches=num_microbatches,
        placement=tuple(range(num_stages)),
        actions=actions,
        edges=edges,
        mem_limit=mem_limit,
        w_mem=w_mem,
    )
