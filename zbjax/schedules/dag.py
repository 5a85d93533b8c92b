"""Schedules on a stage DAG (graph pipelines, GraphPipe): dag-1f1b and dag-zb (no JAX here).

A graph pipeline's stages form a DAG (``edges``): a fan-out stage feeds several successors, a
fan-in stage waits for microbatch i from every predecessor. ``placement[s]`` is the device of
stage s; a device may hold several stages.

- ``dag_1f1b``: 1F1B generalised to the DAG (GraphPipe's schedule). A stage keeps at most
  ``depth(s)`` microbatches in flight, where ``depth(s)`` is the number of stages on the
  longest path from s to a sink (the chain's p - d). With one stage per device every device
  runs ``depth(s) - 1`` warm-up forwards, then forward / fused-backward pairs, then the
  remaining backwards: on a chain this is exactly ``1f1b``. With several stages on a device,
  the order comes from a list scheduler at unit costs that keeps the same in-flight bound and
  runs a ready backward before a forward (so it cannot deadlock: the backward of the oldest
  microbatch in flight always becomes ready).
- ``dag_zb``: zero bubble on the DAG. B and W are split; a list scheduler over the DAG with
  a memory limit per device lets each device run a ready B first, then an F (within the
  in-flight bound and the memory limit), and fills gaps with W, as ZB-H1/ZB-H2 do on a chain.
  Several variants (warm-up depth, tie rule, when to run W) are simulated with the given
  costs, together with dag-1f1b's order with each BW cut into B then W, when every device
  holds one stage ``zb_auto`` on the same edges, dag-1f1b's order itself (backwards fused:
  it wins where the costs' fused backward undercuts B + W by more than the split saves), and
  orders that run a group of microbatches at a time (one at a time needs the least memory:
  the fallback under a tight limit, where the list scheduler can stall when a device holds
  two stages of one path). The result is the candidate with the least
  makespan among those at least as good as dag-1f1b in both makespan and longest device span,
  so dag-zb is never slower than dag-1f1b. The default memory limit is dag-1f1b's peak.
  With one stage per device and m >= 2 x depth it is faster whenever the DAG has an edge and
  the step is not set by one stage's own busy time (checked on random DAGs and costs in the
  tests; a DAG without edges has no bubble to fill, and where a heavier stage with no edges
  is busy the whole step, both schedules take that time). Where a device holds several
  stages, dag-1f1b may already keep it busy, and dag-zb ties.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

from zbjax.errors import ScheduleError
from zbjax.schedules.ir import (
    Action,
    Costs,
    Schedule,
    SimResult,
    count,
    edge_pairs,
    placement_tuple,
    real_number,
)
from zbjax.schedules.simulate import peak_memory, simulate
from zbjax.schedules.validate import validate

_EPS = 1e-9

#: Per stage: predecessors and successors.
Graph = tuple[tuple[tuple[int, ...], ...], tuple[tuple[int, ...], ...]]


def check_stage_dag(
    edges: Sequence[tuple[int, int]], placement: Sequence[int], num_microbatches: int
) -> tuple[tuple[tuple[int, int], ...], tuple[int, ...]]:
    """Returns (edges, placement) as int tuples after checking they describe a stage DAG.

    Raises ScheduleError when an edge names a missing stage, the edges have a cycle, the
    placement leaves a device without a stage, or num_microbatches is not a positive integer.
    """
    placement = placement_tuple(placement)
    if not placement:
        raise ScheduleError("placement is empty; give one device per stage, e.g. (0, 1, 2, 3)")
    count("num_microbatches", num_microbatches)
    num_stages = len(placement)
    used = set(placement)
    if min(placement) < 0 or used != set(range(max(placement) + 1)):
        raise ScheduleError(
            f"placement {placement} must use every device 0..{max(placement)} and no negative "
            "device; renumber the devices so that each one holds at least one stage"
        )
    edges = edge_pairs(edges)
    for a, b in edges:
        if not (0 <= a < num_stages and 0 <= b < num_stages) or a == b:
            raise ScheduleError(
                f"edge ({a}, {b}) does not join two different stages of 0..{num_stages - 1} "
                f"(num_stages = len(placement) = {num_stages}); fix edges or placement"
            )
    if len(topological_order(num_stages, edges)) != num_stages:
        raise ScheduleError(f"edges {edges} have a cycle; a stage graph must be a DAG")
    return edges, placement


def topological(successors: Sequence[Sequence[int]]) -> list[int]:
    """Returns the nodes ``0..len(successors) - 1`` in an order where every edge (node to each
    of its ``successors``) goes forward, the smallest ready node first; fewer on a cycle."""
    indegree = [0] * len(successors)
    for targets in successors:
        for q in targets:
            indegree[q] += 1
    ready = [s for s in range(len(successors)) if not indegree[s]]
    heapq.heapify(ready)
    order = []
    while ready:
        node = heapq.heappop(ready)
        order.append(node)
        for q in successors[node]:
            indegree[q] -= 1
            if not indegree[q]:
                heapq.heappush(ready, q)
    return order


def topological_order(num_stages: int, edges: Sequence[tuple[int, int]]) -> list[int]:
    """Returns the stages in an order where every edge goes forward, the smallest ready stage
    first (fewer on a cycle)."""
    successors: list[list[int]] = [[] for _ in range(num_stages)]
    for a, b in edges:
        successors[a].append(b)
    return topological(successors)


def depth_to_sink(num_stages: int, edges: Sequence[tuple[int, int]]) -> tuple[int, ...]:
    """Returns, per stage, the number of stages on the longest path from it to a sink."""
    successors = _graph(num_stages, edges)[1]
    depth = [1] * num_stages
    for stage in reversed(topological_order(num_stages, edges)):
        depth[stage] = 1 + max((depth[q] for q in successors[stage]), default=0)
    return tuple(depth)


def _graph(num_stages: int, edges: Sequence[tuple[int, int]]) -> Graph:
    preds = tuple(tuple(a for a, b in edges if b == s) for s in range(num_stages))
    succs = tuple(tuple(b for a, b in edges if a == s) for s in range(num_stages))
    return preds, succs


def _one_f_one_b_order(stage: int, m: int, warmup: int) -> list[Action]:
    """Returns ``warmup`` forwards, then forward / fused-backward pairs, then the last BW."""
    warm = min(warmup, m)
    order = [Action("F", stage, i) for i in range(warm)]
    for j in range(m - warm):
        order += [Action("F", stage, warm + j), Action("BW", stage, j)]
    return order + [Action("BW", stage, j) for j in range(m - warm, m)]


def _list_schedule(
    edges: tuple[tuple[int, int], ...],
    placement: tuple[int, ...],
    m: int,
    costs: Costs,
    *,
    split: bool,
    caps: Sequence[int],
    mem_limit: float,
    w_mem: float,
    prefer_forward: bool = False,
    fill_w: bool = True,
) -> list[list[Action]] | None:
    """Returns per-device orders from an event-driven list scheduler, or None on a stall.

    The device that is free earliest runs, among its stages' next actions whose inputs have
    ended: a B (BW when not ``split``) of the oldest microbatch; else an F when the stage has
    fewer than ``caps[s]`` microbatches in flight and memory allows (``prefer_forward`` swaps
    the two); else a W when one is pending and ``fill_w`` is set or the W frees memory an F
    needs or ends before the next F/B can start. Otherwise it waits for the next event.
    """
    num_stages, num_devices = len(placement), max(placement) + 1
    preds, succs = _graph(num_stages, edges)
    f, b, w = costs.per_stage(num_stages)
    fused = costs.fused_per_stage(num_stages)
    comm = costs.comm
    backward = "B" if split else "BW"
    stages_on = [[s for s in range(num_stages) if placement[s] == d] for d in range(num_devices)]
    end: dict[tuple[str, int, int], float] = {}
    # The same end times, a min-heap: ``now`` never decreases (it is the earliest free time of
    # the devices with work left), so times up to it are dropped for good and the next event
    # after it is at the top (scanning ``end`` at every wait made the search quadratic).
    ends: list[float] = []
    counts = [[0, 0, 0] for _ in range(num_stages)]  # F, B, W done per stage
    memory = [0.0] * num_devices
    free = [0.0] * num_devices
    orders: list[list[Action]] = [[] for _ in range(num_devices)]
    per_stage = 3 if split else 2
    remaining = [per_stage * m * len(stages_on[d]) for d in range(num_devices)]
    release = {"F": 1.0, "B": 1.0 - w_mem, "W": w_mem, "BW": 1.0}

    def ready_at(kind: str, s: int, i: int) -> float | None:
        # None while an input has not been scheduled yet.
        if kind == "F":
            deps = [("F", q, i, comm) for q in preds[s]]
        elif kind == "W":
            deps = [("B", s, i, 0.0)]
        else:
            deps = [("F", s, i, 0.0)] + [(backward, q, i, comm) for q in succs[s]]
        at = 0.0
        for dep_kind, q, j, delay in deps:
            t = end.get((dep_kind, q, j))
            if t is None:
                return None
            at = max(at, t + (delay if placement[q] != placement[s] else 0.0))
        return at

    def options(d: int) -> tuple[list, list, list]:
        # Candidate (ready time, sort key, kind, stage, microbatch) per kind for device d.
        back, fwd, wgt = [], [], []
        for s in stages_on[d]:
            n_f, n_b, n_w = counts[s]
            if n_b < n_f:
                t = ready_at(backward, s, n_b)
                back.append((t, (n_b, -s), backward, s, n_b))
            if n_f < m and n_f - n_b < caps[s] and memory[d] + 1.0 <= mem_limit + _EPS:
                t = ready_at("F", s, n_f)
                fwd.append((t, (n_f, -s), "F", s, n_f))
            if split and n_w < n_b:
                wgt.append((end[("B", s, n_w)], (n_w, s), "W", s, n_w))
        return back, fwd, wgt

    def duration(kind: str, s: int) -> float:
        return {"F": f[s], "B": b[s], "W": w[s], "BW": fused[s]}[kind]

    stalled_rounds = 0
    # The devices with work left, by (free time, device): the one to run next is at the top.
    queue = [(free[x], x) for x in range(num_devices) if remaining[x]]
    heapq.heapify(queue)
    while queue:
        now, d = heapq.heappop(queue)
        back, fwd, wgt = options(d)
        ready_back = sorted(o[1:] for o in back if o[0] is not None and o[0] <= now + _EPS)
        ready_fwd = sorted(o[1:] for o in fwd if o[0] is not None and o[0] <= now + _EPS)
        first, second = (ready_fwd, ready_back) if prefer_forward else (ready_back, ready_fwd)
        choice = first[0] if first else second[0] if second else None
        if choice is None and wgt:
            upcoming = [o[0] for o in back + fwd if o[0] is not None]
            next_ready = min(upcoming, default=math.inf)
            memory_bound = any(
                counts[s][0] < m and memory[d] + 1.0 > mem_limit + _EPS for s in stages_on[d]
            )
            w_first = min(wgt)
            if (
                fill_w
                or memory_bound
                or now + w[w_first[3]] <= next_ready + _EPS
                or not (back or fwd)
            ):
                choice = w_first[1:]
        if choice is None:
            # Wait for the next event: an input ending, or another device moving on.
            later = [o[0] for o in back + fwd if o[0] is not None and o[0] > now + _EPS]
            later += [t for t, _ in queue if t > now + _EPS]  # the other devices
            while ends and ends[0] <= now + _EPS:
                heapq.heappop(ends)
            later += ends[:1]
            if not later:
                stalled_rounds += 1
                if stalled_rounds > num_devices:
                    return None
                free[d] = now + _EPS  # let the other devices at this time move first
            else:
                free[d] = min(later)
            heapq.heappush(queue, (free[d], d))
            continue
        stalled_rounds = 0
        _, kind, s, i = choice
        end[(kind, s, i)] = free[d] = now + duration(kind, s)
        heapq.heappush(ends, free[d])
        counts[s][{"F": 0, "B": 1, "BW": 1, "W": 2}[kind]] += 1
        if kind == "BW":
            counts[s][2] += 1
        memory[d] += release[kind] if kind == "F" else -release[kind]
        orders[d].append(Action(kind, s, i))
        remaining[d] -= 1
        if remaining[d]:
            heapq.heappush(queue, (free[d], d))
    return orders


def dag_1f1b(
    edges: Sequence[tuple[int, int]],
    placement: Sequence[int],
    num_microbatches: int,
    stage_names: Sequence[str] | None = None,
) -> Schedule:
    """Returns 1F1B on a stage DAG: at most depth-to-sink microbatches in flight per stage.

    With one stage per device, stage s runs depth(s) - 1 warm-up forwards, then F/BW pairs
    (on a chain: ``1f1b``). With several stages per device, a unit-cost list scheduler keeps
    the same bound and runs ready backwards first. Backwards are fused (BW).
    """
    edges, placement = check_stage_dag(edges, placement, num_microbatches)
    num_stages, m = len(placement), num_microbatches
    depth = depth_to_sink(num_stages, edges)
    num_devices = max(placement) + 1
    if num_devices == num_stages:
        actions: list[list[Action]] = [[] for _ in range(num_devices)]
        for s in range(num_stages):
            actions[placement[s]] = _one_f_one_b_order(s, m, depth[s] - 1)
    else:
        orders = _list_schedule(
            edges,
            placement,
            m,
            Costs(1.0, 1.0, 1.0, 0.0),
            split=False,
            caps=depth,
            mem_limit=math.inf,
            w_mem=0.5,
        )
        if orders is None:  # the bound on forwards in flight always lets a backward run
            raise ScheduleError(f"dag-1f1b stalled on edges {edges}, placement {placement}")
        actions = orders
    schedule = Schedule(
        name="dag-1f1b",
        num_stages=num_stages,
        num_microbatches=m,
        placement=placement,
        actions=actions,
        edges=edges,
        stage_names=_names(stage_names, num_stages),
    )
    return validate(schedule)


def _names(stage_names: Sequence[str] | None, num_stages: int) -> tuple[str, ...] | None:
    if stage_names is None:
        return None
    if isinstance(stage_names, str | bytes):  # would be split into letters
        raise ScheduleError(
            f"stage_names = {stage_names!r} is one string; give one name per stage, e.g. "
            "('vision', 'text', 'head')"
        )
    names = tuple(str(n) for n in stage_names)
    if len(names) != num_stages:
        raise ScheduleError(
            f"stage_names has {len(names)} names but there are {num_stages} stages; give one "
            "name per stage"
        )
    return names


def longest_span(schedule: Schedule, result: SimResult) -> float:
    """Returns the longest time any device spends from its first action's start to its last end."""
    return max((result.end[p[-1]] - result.start[p[0]] for p in schedule.actions if p), default=0.0)


def _split_backwards(schedule: Schedule) -> list[list[Action]]:
    """Returns the schedule's orders with every BW replaced by B immediately followed by W."""
    return [
        [
            x
            for a in program
            for x in (
                (Action("B", a.stage, a.microbatch), Action("W", a.stage, a.microbatch))
                if a.kind == "BW"
                else (a,)
            )
        ]
        for program in schedule.actions
    ]


def _grouped_orders(
    edges: tuple[tuple[int, int], ...], placement: tuple[int, ...], m: int, group: int
) -> list[list[Action]]:
    """Returns the orders that run ``group`` microbatches at a time (GPipe-like within a
    group): their forwards stage by stage in a topological order, then each stage's B and W
    in the reverse order. With ``group = 1`` it is the order within the least memory: a device
    holds one microbatch's activations of its own stages. A fallback where the list scheduler
    finds no order within a memory limit (a device holding two stages of one path)."""
    actions: list[list[Action]] = [[] for _ in range(max(placement) + 1)]
    order = topological_order(len(placement), edges)
    for first in range(0, m, group):
        batch = range(first, min(first + group, m))
        for s in order:
            actions[placement[s]] += [Action("F", s, i) for i in batch]
        for s in reversed(order):
            for i in batch:
                actions[placement[s]] += [Action("B", s, i), Action("W", s, i)]
    return actions


def _auto_orders(
    edges: tuple[tuple[int, int], ...],
    placement: tuple[int, ...],
    m: int,
    costs: Costs,
    mem_limit: float,
    w_mem: float,
    time_limit: float | None,
) -> list[list[Action]] | None:
    """Returns zb-auto's orders mapped onto ``placement`` (one stage per device), or None."""
    from zbjax.schedules.auto import zb_auto  # imported here: auto is a larger module

    try:
        found = zb_auto(
            len(placement),
            m,
            costs=costs,
            mem_limit=mem_limit,
            w_mem=w_mem,
            edges=edges,
            time_limit=time_limit,
        )
    except ScheduleError:
        return None
    orders: list[list[Action]] = [[] for _ in placement]
    for s, program in enumerate(found.actions):
        orders[placement[s]] = list(program)
    return orders


def dag_zb(
    edges: Sequence[tuple[int, int]],
    placement: Sequence[int],
    num_microbatches: int,
    mem_limit: float | None = None,
    w_mem: float = 0.5,
    costs: Costs | None = None,
    stage_names: Sequence[str] | None = None,
    search_time: float | None = None,
) -> Schedule:
    """Returns a zero-bubble schedule on a stage DAG: B and W split, W filling the gaps.

    ``costs`` (default F = B = W = 1, no comm) are what the candidates are simulated with;
    ``mem_limit`` (M_B per device) defaults to dag-1f1b's peak, so memory is not worse.
    The result is never slower than dag-1f1b (makespan and longest device span) for
    ``costs``. zb-auto's search (used when each device holds one stage) spends its
    evaluation budget, the same for the same request; ``search_time`` bounds it in seconds
    instead (0 skips it).
    """
    edges, placement = check_stage_dag(edges, placement, num_microbatches)
    num_stages, m = len(placement), num_microbatches
    costs = costs or Costs()
    costs.per_stage(num_stages)
    if not 0.0 <= w_mem <= 1.0:
        raise ScheduleError(f"w_mem = {w_mem} must lie in [0, 1] (a fraction of M_B)")
    seconds = None if search_time is None else real_number(search_time)
    if search_time is not None and not (seconds is not None and seconds >= 0.0):
        raise ScheduleError(f"search_time = {search_time!r} s; give a number of seconds >= 0")
    reference = dag_1f1b(edges, placement, m)
    limit = max(peak_memory(reference)) if mem_limit is None else float(mem_limit)
    if limit < 1.0:
        raise ScheduleError(
            f"mem_limit = {limit:g} M_B is below the 1 M_B one forward keeps until its "
            "backward; raise mem_limit to at least 1"
        )

    def make(orders: Sequence[Sequence[Action]]) -> Schedule:
        return Schedule(
            name="dag-zb",
            num_stages=num_stages,
            num_microbatches=m,
            placement=placement,
            actions=orders,
            edges=edges,
            mem_limit=limit,
            w_mem=w_mem,
            stage_names=_names(stage_names, num_stages),
        )

    reference_run = simulate(reference, costs)
    bound = (reference_run.makespan + _EPS, longest_span(reference, reference_run) + _EPS)
    if limit < max(peak_memory(reference)) - _EPS:
        bound = (math.inf, math.inf)  # below dag-1f1b's memory, dag-1f1b is no yardstick
    depth = depth_to_sink(num_stages, edges)
    candidates: list[list[list[Action]]] = []
    split_reference = _split_backwards(reference)
    if max(peak_memory(make(split_reference))) <= limit + _EPS:
        candidates.append(split_reference)
    extras = sorted({0, 1, 2, max(depth) // 2, max(depth), m})
    for extra in extras:
        caps = [d + extra for d in depth]
        for prefer_forward in (False, True):
            for fill_w in (True, False):
                orders = _list_schedule(
                    edges,
                    placement,
                    m,
                    costs,
                    split=True,
                    caps=caps,
                    mem_limit=limit,
                    w_mem=w_mem,
                    prefer_forward=prefer_forward,
                    fill_w=fill_w,
                )
                if orders is not None:
                    candidates.append(orders)
    if (search_time is None or search_time > 0) and max(placement) + 1 == num_stages:
        orders = _auto_orders(edges, placement, m, costs, limit, w_mem, search_time)
        if orders is not None:
            candidates.append(orders)
    # dag-1f1b's own order, backwards fused: the best when the costs' fused backward is
    # cheaper than B + W by more than splitting saves (measured costs often say so on CPU).
    # After the split candidates, which win a tie.
    candidates.append([list(program) for program in reference.actions])
    serial = _grouped_orders(edges, placement, m, 1)
    candidates.append(serial)
    for group in range(2, m + 1):
        orders = _grouped_orders(edges, placement, m, group)
        if max(peak_memory(make(orders))) > limit + _EPS:
            break  # each microbatch more in a group holds as much again
        candidates.append(orders)
    best, best_key = None, None
    for orders in candidates:
        schedule = make(orders)
        if max(peak_memory(schedule)) > limit + _EPS:
            continue
        run = simulate(schedule, costs)
        key = (run.makespan, longest_span(schedule, run))
        if key[0] > bound[0] or key[1] > bound[1]:
            continue
        if best_key is None or key < best_key:
            best, best_key = schedule, key
    if best is None:
        # dag-1f1b's order meets its own peak and bound, so the limit is below its peak, and
        # below what one microbatch at a time needs.
        need = peak_memory(make(serial))
        device = max(range(len(need)), key=need.__getitem__)
        stages = [s for s in range(num_stages) if placement[s] == device]
        raise ScheduleError(
            f"dag-zb found no order within mem_limit = {limit:g} M_B per device: running one "
            f"microbatch at a time needs {need[device]:g} M_B on device {device} (stages "
            f"{stages}, each keeping its activation until its backward; dag-1f1b peaks at "
            f"{max(peak_memory(reference)):g} M_B); raise mem_limit to at least "
            f"{need[device]:g} or leave it out"
        )
    return validate(best)
