"""``build``: a schedule by name, checked against its inputs and validated (no JAX here).

Defaults for ``num_devices``: ``num_stages`` for gpipe, 1f1b, zb-h1, zb-h2 and zb-auto;
``num_stages / 2`` for zb-v (two stages per device, V placement) and for interleaved-1f1b
(two stages per device, loop placement; pass ``num_devices`` for other ratios).
The DAG schedules ``dag-1f1b`` and ``dag-zb`` (``DAG_SCHEDULE_NAMES``) take the stage graph
as options: ``edges=[(src, dst), ...]`` and ``placement=(device of each stage, ...)``, with
``num_stages = len(placement)``.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any

from zbjax.errors import ScheduleError
from zbjax.schedules import dag, generators
from zbjax.schedules.ir import Costs, Schedule, count, placement_tuple, real_number
from zbjax.schedules.simulate import peak_memory
from zbjax.schedules.validate import validate

#: Every name ``build`` accepts.
SCHEDULE_NAMES: tuple[str, ...] = (
    "gpipe",
    "1f1b",
    "interleaved-1f1b",
    "zb-h1",
    "zb-h2",
    "zb-v",
    "zb-auto",
)

#: Schedules on a stage DAG (graph pipelines): they take ``edges=`` and ``placement=``.
DAG_SCHEDULE_NAMES: tuple[str, ...] = ("dag-1f1b", "dag-zb")

# Schedules whose construction adapts to a memory limit (the others have a fixed peak).
_LIMITED = {"zb-h1": generators.zb_h1, "zb-h2": generators.zb_h2, "zb-v": generators.zb_v}
_FIXED = {
    "gpipe": generators.gpipe,
    "1f1b": generators.one_f_one_b,
    "interleaved-1f1b": generators.interleaved_one_f_one_b,
}


def _check_number(label: str, value: Any, low: float, high: float | None = None) -> float:
    """Returns ``value`` as a float after checking it is a number in [low, high]."""
    number = real_number(value)  # a Python, NumPy or 0-d JAX number; not a bool or a string
    if number is None or number != number:
        raise ScheduleError(f"{label} = {value!r} is not a number")
    if number < low or (high is not None and number > high):
        span = f">= {low:g}" if high is None else f"in [{low:g}, {high:g}]"
        raise ScheduleError(f"{label} = {value!r} is out of range; it must be {span}")
    return number


def _zb_auto(
    num_stages: int,
    num_microbatches: int,
    num_devices: int | None,
    costs: Costs | None,
    mem_limit: float | None,
    w_mem: float,
    options: dict[str, Any],
) -> Schedule:
    """Returns zb-auto's schedule, imported only when asked for (it is a separate module)."""
    try:
        auto = importlib.import_module("zbjax.schedules.auto")
    except ModuleNotFoundError as error:
        if error.name != "zbjax.schedules.auto":
            raise
        raise ScheduleError(
            "zb-auto is not available in this installation (zbjax.schedules.auto is missing); "
            f"choose one of the fixed schedules: {', '.join(SCHEDULE_NAMES[:-1])}"
        ) from error
    devices = num_stages if num_devices is None else num_devices
    unknown = set(options) - {"edges", "time_limit", "objective"}
    if unknown:
        raise ScheduleError(
            f"zb-auto does not take options {sorted(unknown)}; it takes edges, time_limit and "
            "objective ('makespan' for one step, 'span' for back-to-back steps)"
        )
    return auto.zb_auto(
        num_stages, num_microbatches, devices, costs or Costs(), mem_limit, w_mem, **options
    )


def _dag(
    name: str,
    num_stages: int,
    num_microbatches: int,
    num_devices: int | None,
    costs: Costs | None,
    mem_limit: float | None,
    w_mem: float,
    options: dict[str, Any],
) -> Schedule:
    """Returns dag-1f1b or dag-zb for the ``edges`` and ``placement`` options."""
    unknown = set(options) - {"edges", "placement", "stage_names"}
    missing = {"edges", "placement"} - set(options)
    if unknown or missing:
        raise ScheduleError(
            f"{name} takes the options edges=[(src, dst), ...] and placement=(device of each "
            "stage, ...), and optionally stage_names; "
            + (f"missing {sorted(missing)}" if missing else f"unknown {sorted(unknown)}")
        )
    placement = placement_tuple(options["placement"])
    if len(placement) != num_stages:
        raise ScheduleError(
            f"{name}: num_stages = {num_stages} but placement has {len(placement)} entries; "
            "pass num_stages=len(placement)"
        )
    if num_devices is not None and num_devices != max(placement, default=-1) + 1:
        raise ScheduleError(
            f"{name}: num_devices = {num_devices} but placement {placement} uses "
            f"{max(placement, default=-1) + 1} devices; leave num_devices out"
        )
    edges, names = options["edges"], options.get("stage_names")
    if name == "dag-1f1b":
        schedule = dag.dag_1f1b(edges, placement, num_microbatches, names)
        if mem_limit is not None and max(peak_memory(schedule)) > mem_limit + 1e-9:
            raise ScheduleError(
                f"dag-1f1b needs {max(peak_memory(schedule)):g} M_B per device, above "
                f"mem_limit = {mem_limit:g}; raise mem_limit or use dag-zb, which fits a limit"
            )
        return schedule
    return dag.dag_zb(edges, placement, num_microbatches, mem_limit, w_mem, costs, names)


def check_options(
    costs: Costs | None, mem_limit: float | None, w_mem: float | None
) -> tuple[Costs | None, float | None, float]:
    """Returns (costs, mem_limit, w_mem) as ``build`` takes them (w_mem None: 0.5) after
    checking their types and ranges; raises ScheduleError naming a bad one."""
    w_mem = _check_number("w_mem", 0.5 if w_mem is None else w_mem, 0.0, 1.0)
    if costs is not None and not isinstance(costs, Costs):
        raise ScheduleError(
            f"costs = {costs!r} is not a zbjax.schedules.Costs; pass "
            "Costs(f=..., b=..., w=..., comm=...)"
        )
    if mem_limit is not None:
        mem_limit = _check_number("mem_limit", mem_limit, 0.0)
        if mem_limit < 1.0:
            raise ScheduleError(
                f"mem_limit = {mem_limit:g} M_B is below 1 M_B, the activation of the single "
                "forward every schedule must hold; raise mem_limit to at least 1"
            )
    return costs, mem_limit, w_mem


def build(
    name: str,
    num_stages: int,
    num_microbatches: int,
    num_devices: int | None = None,
    costs: Costs | None = None,
    mem_limit: float | None = None,
    w_mem: float = 0.5,
    **options: Any,
) -> Schedule:
    """Returns the validated schedule ``name`` for the given sizes, costs and memory limit.

    ``num_devices`` defaults to ``num_stages`` (interleaved-1f1b and zb-v: half of it).
    ``mem_limit`` (M_B per device, when given) is recorded on the schedule; zb-h1, zb-h2 and
    zb-v shrink their warm-up to fit it, the fixed schedules raise ScheduleError when their
    peak is above it. ``costs`` is used by zb-auto and dag-zb and checked for every name; the
    fixed schedules are the papers' handcrafted orders for equal costs.

    ``options``: zb-auto takes ``edges`` (a stage DAG's ``(src, dst)`` pairs; a chain when
    absent), ``time_limit`` (seconds of search instead of the default budget of evaluations,
    which gives the same schedule on every machine) and ``objective`` (``"makespan"``, the
    default: one step; ``"span"``: back-to-back steps, the Zero Bubble paper's measure);
    dag-1f1b and dag-zb need ``edges`` and ``placement`` (the device of each stage) and take
    ``stage_names``; the other names take none.
    """
    if name not in SCHEDULE_NAMES + DAG_SCHEDULE_NAMES:
        raise ScheduleError(
            f"unknown schedule {name!r}; choose one of: "
            f"{', '.join(SCHEDULE_NAMES + DAG_SCHEDULE_NAMES)}"
        )
    num_stages = count(f"{name}: num_stages", num_stages)
    num_microbatches = count(f"{name}: num_microbatches", num_microbatches)
    if num_devices is not None:
        num_devices = count(f"{name}: num_devices", num_devices)
    costs, mem_limit, w_mem = check_options(costs, mem_limit, w_mem)
    if costs is not None:
        costs.per_stage(num_stages)  # raises on wrong lengths and negative costs
        costs.fused_per_stage(num_stages)  # and so does the fused backward's, bw
    if name in DAG_SCHEDULE_NAMES:
        schedule = _dag(
            name, num_stages, num_microbatches, num_devices, costs, mem_limit, w_mem, options
        )
    elif name == "zb-auto":
        schedule = _zb_auto(
            num_stages, num_microbatches, num_devices, costs, mem_limit, w_mem, options
        )
    else:
        if options:
            raise ScheduleError(f"{name} takes no options, but got {sorted(options)}")
        if name in _LIMITED:
            schedule = _LIMITED[name](
                num_stages, num_microbatches, num_devices, w_mem=w_mem, mem_limit=mem_limit
            )
        else:
            schedule = _FIXED[name](num_stages, num_microbatches, num_devices)
            if mem_limit is not None:
                needed = max(peak_memory(schedule))
                if needed > mem_limit + 1e-9:
                    # gpipe holds every microbatch; 1f1b's peak is fixed by the stage count.
                    fewer = "use fewer microbatches, " if name == "gpipe" else ""
                    raise ScheduleError(
                        f"{name} with {num_stages} stages and {num_microbatches} microbatches "
                        f"needs {needed:g} M_B per device, above mem_limit = {mem_limit:g}; "
                        f"{name} does not adapt to a limit: raise mem_limit to {needed:g}, "
                        f"{fewer}or choose a schedule that shapes itself to the limit "
                        "(zb-h1, zb-h2, zb-auto; zb-v with two stages per device)"
                    )
    schedule = dataclasses.replace(
        schedule, w_mem=w_mem, mem_limit=mem_limit if mem_limit is not None else schedule.mem_limit
    )
    return validate(schedule)
