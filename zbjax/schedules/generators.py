"""Fixed pipeline schedules: gpipe, 1f1b, interleaved-1f1b, zb-h1, zb-h2 and zb-v (no JAX here).

Each generator returns a ``Schedule`` for a chain of stages. What each one achieves, with
F = B = W = 1 per stage and no communication (bubble rate as ``simulate`` defines it; memory in
M_B units of one stage, ``w_mem`` = 0.5; m microbatches, p devices):

- ``gpipe``: all F, then all fused BW. Bubble (p-1)/(m+p-1); peak memory m.
- ``1f1b``: device d runs p-d-1 warm-up F, then F/BW pairs. Bubble (p-1)/(m+p-1); peak p.
- ``interleaved-1f1b``: v stages per device in loop placement (stage s on device s % p),
  Megatron-LM's order: microbatches in rounds of p, each round through every local stage.
  Bubble (p-1)/(v*m+p-1) when m is a multiple of p. Other m >= 1 run the order built for
  the next multiple of p with the extra microbatches left out (a larger bubble).
- ``zb-h1``: the F/B order of 1F1B with one more warm-up F, W split out and run whenever the
  next F/B is not ready yet or an F would pass p M_B. Bubble (p-1)/(3m+p-1) for m >= p;
  peak p.
- ``zb-h2``: the same with 2(p-d)-1 warm-up F on device d and limit 2p-1. For m >= 2p every
  device is busy without a gap from its first action to its last (the paper's zero bubble:
  only the start offset of the F chain, p-1, remains, and the lower bound 3m+p-1 is reached);
  peak 2p-1.
- ``zb-v``: 2p stages, V placement (stage s on device s for s < p, on 2p-1-s otherwise).
  Each device runs whatever is ready in the order F then B of its second stage, F then B of
  its first stage, W when nothing is, keeping at most 2p stage units (= p units of a whole
  device's model, the paper's p M_B). For m >= p and w_mem < 1 (checked at 0.5 and 0.75)
  the makespan is the lower bound 6m+p-1 (device p-1 cannot start before p-1 forwards), so
  the bubble is (p-1)/(6m+p-1); at w_mem = 1 (W frees all of M_B) it can exceed it (p = 8,
  m = 9: 67 instead of 61); for
  m >= 2p and w_mem = 0.5 no device idles between its first and last action (checked for
  p <= 12, m <= 5p; a larger w_mem leaves some gaps). Peak 2p stage units.

The ZB schedules are built by a small list scheduler run at unit costs (the paper's
handcrafted schedules assume equal costs); ``zb-auto`` adapts to real costs instead.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from zbjax.errors import ScheduleError
from zbjax.schedules.ir import Action, Schedule, chain_edges, count
from zbjax.schedules.simulate import memory_delta

#: One step of a device's F/B order: (kind, stage, microbatch), kind "F" or "B".
Step = tuple[str, int, int]


def _check_sizes(name: str, num_stages: int, num_microbatches: int, num_devices: int) -> None:
    """Raises ScheduleError unless stages, microbatches and devices are positive integers."""
    for label, value in (
        ("num_stages", num_stages),
        ("num_microbatches", num_microbatches),
        ("num_devices", num_devices),
    ):
        count(f"{name}: {label}", value)


def _single_stage_devices(name: str, num_stages: int, num_devices: int | None) -> int:
    """Returns num_devices for schedules that put one stage on each device."""
    devices = num_stages if num_devices is None else num_devices
    if devices != num_stages:
        raise ScheduleError(
            f"{name} runs one stage per device, but num_stages = {num_stages} and "
            f"num_devices = {devices}; use num_devices = num_stages, or 'interleaved-1f1b' "
            "(or 'zb-v') to put several stages on a device"
        )
    return devices


def gpipe(num_stages: int, num_microbatches: int, num_devices: int | None = None) -> Schedule:
    """Returns GPipe: every device runs all forwards, then all fused backwards."""
    p = _single_stage_devices("gpipe", num_stages, num_devices)
    _check_sizes("gpipe", num_stages, num_microbatches, p)
    m = num_microbatches
    actions = [
        [Action("F", d, i) for i in range(m)] + [Action("BW", d, i) for i in range(m)]
        for d in range(p)
    ]
    return Schedule("gpipe", num_stages, m, tuple(range(p)), actions)


def _one_f_one_b_order(
    stage: int, num_microbatches: int, warmup: int, backward: str
) -> list[Action]:
    """Returns warm-up forwards, then alternating backward/forward, then the last backwards."""
    m = num_microbatches
    warm = min(warmup, m)
    order = [Action("F", stage, i) for i in range(warm)]
    for j in range(m - warm):
        order += [Action("F", stage, warm + j), Action(backward, stage, j)]
    order += [Action(backward, stage, j) for j in range(m - warm, m)]
    return order


def one_f_one_b(num_stages: int, num_microbatches: int, num_devices: int | None = None) -> Schedule:
    """Returns 1F1B: device d runs p-d-1 warm-up forwards, then forward/backward pairs."""
    p = _single_stage_devices("1f1b", num_stages, num_devices)
    _check_sizes("1f1b", num_stages, num_microbatches, p)
    actions = [_one_f_one_b_order(d, num_microbatches, p - d - 1, "BW") for d in range(p)]
    return Schedule("1f1b", num_stages, num_microbatches, tuple(range(p)), actions)


def _interleaved_orders(
    device: int, num_devices: int, stages_per_device: int, num_rounds: int
) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Returns device's (stage, microbatch) forward order and backward order.

    Microbatches go in rounds of p; each round visits the device's stages in forward order
    for F and in reverse for BW.
    """
    p, v = num_devices, stages_per_device
    forward, backward = [], []
    for first in range(0, num_rounds * p, p):
        round_ = range(first, first + p)
        for chunk in range(v):
            forward += [(chunk * p + device, i) for i in round_]
        for chunk in reversed(range(v)):
            backward += [(chunk * p + device, i) for i in round_]
    return forward, backward


def interleaved_one_f_one_b(
    num_stages: int, num_microbatches: int, num_devices: int | None = None
) -> Schedule:
    """Returns Megatron-style interleaved 1F1B with v = num_stages / num_devices stages each.

    Stage s runs on device s % p (loop placement). ``num_devices`` defaults to num_stages / 2
    (two stages per device) and must divide num_stages.
    """
    name = "interleaved-1f1b"
    if num_devices is None:
        if not isinstance(num_stages, int) or num_stages < 2 or num_stages % 2:
            raise ScheduleError(
                f"{name}: num_stages = {num_stages!r} is not an even number >= 2, so the "
                "default of 2 stages per device does not apply; pass num_devices (a divisor "
                "of num_stages)"
            )
        num_devices = num_stages // 2
    _check_sizes(name, num_stages, num_microbatches, num_devices)
    if num_stages % num_devices:
        raise ScheduleError(
            f"{name}: num_stages = {num_stages} is not a multiple of num_devices = "
            f"{num_devices}; every device needs the same number of stages, so choose "
            "num_stages = v * num_devices"
        )
    p, m = num_devices, num_microbatches
    v = num_stages // p
    # Megatron-LM's order needs whole rounds of p microbatches. For other m, build it for
    # whole rounds and drop the microbatches past m: dependencies only join actions of one
    # microbatch, so dropping every action of some microbatches cannot create a deadlock.
    rounds = -(-m // p)
    total = rounds * p * v
    actions = []
    for d in range(p):
        forward, backward = _interleaved_orders(d, p, v, rounds)
        # Megatron-LM's warm-up: enough forwards that the first backward's inputs are on their
        # way (a full round through v-1 stages) plus 2 per device downstream to keep them busy.
        warmup = min(p - d - 1 if v == 1 else 2 * (p - d - 1) + (v - 1) * p, total)
        order = [("F", s, i) for s, i in forward[:warmup]]
        for j in range(total - warmup):
            order += [("F", *forward[warmup + j]), ("BW", *backward[j])]
        order += [("BW", s, i) for s, i in backward[total - warmup :]]
        actions.append([Action(*step) for step in order if step[2] < m])
    placement = tuple(s % p for s in range(num_stages))
    return Schedule(name, num_stages, m, placement, actions)


def _list_schedule(
    name: str,
    num_stages: int,
    num_microbatches: int,
    placement: Sequence[int],
    limit: float,
    w_mem: float,
    next_step: Callable[[int, Callable[[Step], bool], float], Step | None],
) -> tuple[tuple[Action, ...], ...]:
    """Returns per-device actions from a unit-cost list scheduler that adds W into gaps.

    Each tick, every device asks ``next_step(device, ready, level)`` for an F or B to run
    (``ready`` says whether a step's inputs exist; ``level`` is the device's memory). When it
    gets none, the device runs its oldest pending W, if any. Raises ScheduleError when no
    device can move (the memory limit is too small for this schedule).
    """
    edges = chain_edges(num_stages)
    preds = {s: [a for a, b in edges if b == s] for s in range(num_stages)}
    succs = {s: [b for a, b in edges if a == s] for s in range(num_stages)}
    num_devices = max(placement) + 1
    done: set[Step] = set()
    pending_w: list[list[tuple[int, int]]] = [[] for _ in range(num_devices)]
    level = [0.0] * num_devices
    out: list[list[Action]] = [[] for _ in range(num_devices)]
    remaining = 3 * num_stages * num_microbatches

    def ready(step: Step) -> bool:
        kind, s, i = step
        if kind == "F":
            return all(("F", q, i) in done for q in preds[s])
        return ("F", s, i) in done and all(("B", q, i) in done for q in succs[s])

    while remaining:
        started: list[Step] = []
        for d in range(num_devices):
            step = next_step(d, ready, level[d])
            if step is not None:
                kind, s, i = step
                if kind == "B":
                    pending_w[d].append((s, i))
            elif pending_w[d]:
                s, i = pending_w[d].pop(0)
                step = ("W", s, i)
            else:
                continue
            action = Action(*step)
            out[d].append(action)
            level[d] += memory_delta(action, w_mem)
            started.append(step)
        if not started:
            raise ScheduleError(
                f"{name}: memory limit {limit:g} M_B per device is too small for this "
                f"schedule (p = {num_devices}, m = {num_microbatches}, w_mem = {w_mem:g}): "
                "no device can start an action; raise mem_limit"
                # zb-auto places one stage per device, not zb-v's two.
                + (" or use 'zb-auto'" if name != "zb-v" else "")
            )
        # Unit costs: what starts this tick ends before the next tick begins.
        done.update(started)
        remaining -= len(started)
    return tuple(tuple(program) for program in out)


def _zero_bubble_handcrafted(
    name: str,
    num_stages: int,
    num_microbatches: int,
    num_devices: int | None,
    w_mem: float,
    mem_limit: float | None,
    default_limit: float,
    warmup: Callable[[int], int],
) -> Schedule:
    """Returns 1F1B's F/B order with ``warmup(d)`` forwards and W in the gaps, under a limit."""
    p = _single_stage_devices(name, num_stages, num_devices)
    _check_sizes(name, num_stages, num_microbatches, p)
    limit = default_limit if mem_limit is None else min(default_limit, mem_limit)
    # Never warm up past the limit: the next step would be an F that cannot start.
    orders = [
        [
            (a.kind, a.stage, a.microbatch)
            for a in _one_f_one_b_order(
                d, num_microbatches, max(1, min(warmup(d), math.floor(limit + 1e-9))) - 1, "B"
            )
        ]
        for d in range(p)
    ]
    position = [0] * p

    def next_step(d: int, ready: Callable[[Step], bool], level: float) -> Step | None:
        if position[d] == len(orders[d]):
            return None
        step = orders[d][position[d]]
        if not ready(step) or (step[0] == "F" and level + 1.0 > limit + 1e-9):
            return None
        position[d] += 1
        return step

    actions = _list_schedule(name, num_stages, num_microbatches, range(p), limit, w_mem, next_step)
    return Schedule(name, num_stages, num_microbatches, tuple(range(p)), actions, w_mem=w_mem)


def zb_h1(
    num_stages: int,
    num_microbatches: int,
    num_devices: int | None = None,
    w_mem: float = 0.5,
    mem_limit: float | None = None,
) -> Schedule:
    """Returns ZB-H1: 1F1B's memory (p M_B) with W split out and moved into the bubbles.

    Device d warms up with p-d forwards; a ``mem_limit`` below p lowers the limit (and the
    warm-up) at the cost of a larger bubble.
    """
    p = num_stages
    return _zero_bubble_handcrafted(
        "zb-h1", num_stages, num_microbatches, num_devices, w_mem, mem_limit, p, lambda d: p - d
    )


def zb_h2(
    num_stages: int,
    num_microbatches: int,
    num_devices: int | None = None,
    w_mem: float = 0.5,
    mem_limit: float | None = None,
) -> Schedule:
    """Returns ZB-H2: 2(p-d)-1 warm-up forwards so that no device waits once it has started.

    Needs 2p-1 M_B; a smaller ``mem_limit`` lowers the limit and the warm-up.
    """
    p = num_stages
    return _zero_bubble_handcrafted(
        "zb-h2",
        num_stages,
        num_microbatches,
        num_devices,
        w_mem,
        mem_limit,
        2 * p - 1,
        lambda d: 2 * (p - d) - 1,
    )


def v_placement(num_devices: int) -> tuple[int, ...]:
    """Returns the V placement of 2p stages: s on device s, then back down to device 0."""
    return tuple(range(num_devices)) + tuple(reversed(range(num_devices)))


def zb_v(
    num_stages: int,
    num_microbatches: int,
    num_devices: int | None = None,
    w_mem: float = 0.5,
    mem_limit: float | None = None,
) -> Schedule:
    """Returns ZB-V: two stages per device in a V; a device runs its second stage before its
    first, F before B within a stage, and W whenever nothing else is ready.

    Memory is counted per stage (one stage is half a device's model), so the default limit
    of 2p stage units equals the paper's p M_B; ``mem_limit`` lowers it.
    """
    name = "zb-v"
    if num_devices is None and isinstance(num_stages, int):
        num_devices = max(num_stages // 2, 1)
    _check_sizes(name, num_stages, num_microbatches, num_devices)
    if num_stages != 2 * num_devices:
        raise ScheduleError(
            f"zb-v needs exactly 2 stages per device (num_stages = 2 * num_devices), but "
            f"num_stages = {num_stages} and num_devices = {num_devices}; use an even "
            f"num_stages with num_devices = num_stages / 2"
        )
    p, m = num_devices, num_microbatches
    placement = v_placement(p)
    local = [[s for s in range(num_stages) if placement[s] == d] for d in range(p)]
    limit = 2.0 * p if mem_limit is None else min(2.0 * p, mem_limit)
    if limit < 2.0 - 1e-9:
        raise ScheduleError(
            f"zb-v: mem_limit = {limit:g} is too small: zb-v counts memory in stage units "
            f"(one stage's activation of a microbatch; its default 2p = {2 * p} units is the "
            "paper's p M_B) and needs at least 2, the forwards of the last device's two "
            "stages before its first backward; raise mem_limit to 2 or more"
        )
    next_forward = [0] * num_stages
    next_backward = [0] * num_stages

    # Device d's second stage (2p-1-d, on the V's way back) before its first (d), and F
    # before B within a stage. Among the orders of these four that keep memory at 2p, this
    # one (with four others) reaches the makespan lower bound with no gap inside any device's
    # span for p <= 12, 2p <= m <= 5p (found by trying all 24 at unit costs).
    priority = [(kind, local[d][k]) for d in range(p) for k in (1, 0) for kind in ("F", "B")]

    def next_step(d: int, ready: Callable[[Step], bool], level: float) -> Step | None:
        for kind, s in priority[4 * d : 4 * d + 4]:
            if kind == "B":
                i = next_backward[s]
                if i < m and ready(("B", s, i)):
                    next_backward[s] += 1
                    return ("B", s, i)
                continue
            i = next_forward[s]
            # An F of the first stage leaves room for the same microbatch's F of the second,
            # without which the first stage's B could never start.
            room = 1.0 if s >= p else 2.0
            if i < m and level + room <= limit + 1e-9 and ready(("F", s, i)):
                next_forward[s] += 1
                return ("F", s, i)
        return None

    actions = _list_schedule(name, num_stages, m, placement, limit, w_mem, next_step)
    return Schedule(name, num_stages, m, placement, actions, w_mem=w_mem)
