"""Pictures of a schedule: a terminal grid, a matplotlib Gantt chart and a Chrome/Perfetto trace.

All three draw the times that ``simulate`` gives, so what you see is what the simulator
predicts. matplotlib is imported only inside ``gantt`` (install it with
``pip install 'zbjax[plot]'``); the grid and the trace need nothing beyond the standard library.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from zbjax.errors import ScheduleError
from zbjax.schedules.ir import Action, Costs, Schedule, SimResult, check_schedule, real_number
from zbjax.schedules.simulate import check_result, simulate

#: Fill colour per action kind in ``gantt`` (colour-blind-friendly "deep" palette).
KIND_COLORS: dict[str, str] = {"F": "#4C72B0", "B": "#DD8452", "W": "#55A868", "BW": "#C44E52"}

_HATCHES: tuple[str, ...] = ("", "///", "\\\\\\", "xxx", "...", "ooo", "---", "+++", "|||", "**")

#: Trace time of one unit of cost, in microseconds.
TRACE_US_PER_UNIT = 1000.0


def _holds_several_stages(schedule: Schedule) -> bool:
    return any(len(schedule.stages_on(d)) > 1 for d in range(schedule.num_devices))


def _is_dag(schedule: Schedule) -> bool:
    """Returns whether the stage graph branches (some stage has two successors or predecessors)."""
    return any(
        len(schedule.successors(s)) > 1 or len(schedule.predecessors(s)) > 1
        for s in range(schedule.num_stages)
    )


def stage_label(schedule: Schedule, stage: int) -> str:
    """Returns the name of ``stage``: its ``Schedule.stage_names`` entry, else ``s{stage}``."""
    if schedule.stage_names is not None and stage < len(schedule.stage_names):
        return schedule.stage_names[stage]
    return f"s{stage}"


def _cell_label(action: Action, with_stage: bool) -> str:
    prefix = str(action.stage) if with_stage else ""
    return f"{prefix}{action.kind}{action.microbatch}"


def _fmt_time(t: float) -> str:
    # Whole numbers short, as their digits; a large one in the notation .4g gives others.
    return str(int(t)) if t == int(t) and abs(t) < 1e6 else f"{t:.4g}"


def _slot_unit(schedule: Schedule, result: SimResult) -> float:
    """Returns the time one grid column stands for.

    The shortest action gets one column, so equal costs give one column per action. When some
    action is tiny next to the makespan (e.g. W costs 0.01), that would make thousands of
    columns; past 64 columns (or 3 per action of the longest program) the unit is raised to
    that many.
    """
    durations = [result.end[a] - result.start[a] for _, _, a in schedule.all_actions()]
    positive = [d for d in durations if d > 0]
    if not positive:
        return 1.0
    columns = max(3 * max(len(p) for p in schedule.actions), 64)
    return max(min(positive), result.makespan / columns)


def _slot(t: float, unit: float) -> int:
    """Returns the column time ``t`` falls at, halves rounded up: an action that starts half a
    column after another is drawn after it, not beside it (Python's round() halves to even)."""
    return math.floor(t / unit + 0.5)


def _grid_rows(schedule: Schedule, result: SimResult, unit: float) -> list[list[str | None]]:
    """Returns per device one cell per slot: a label where an action starts, "" where it
    continues, None where the device idles."""
    with_stage = _holds_several_stages(schedule)
    rows: list[list[str | None]] = []
    for program in schedule.actions:
        row: list[str | None] = []
        for action in program:
            if result.end[action] <= result.start[action]:
                continue  # takes no time (a cost of 0): no column, which would shift the rest
            # Rounding can make two neighbours share a slot; push the later one right so every
            # action keeps at least one visible cell, in program order.
            first = max(_slot(result.start[action], unit), len(row))
            last = max(_slot(result.end[action], unit), first + 1)
            row.extend([None] * (first - len(row)))
            row.append(_cell_label(action, with_stage))
            row.extend([""] * (last - first - 1))
        rows.append(row)
    num_slots = max((len(r) for r in rows), default=0)
    for row in rows:
        row.extend([None] * (num_slots - len(row)))
    return rows


def output_path(
    path: str | Path, what: str, suffix: str, add_suffix: bool = False, make_folder: bool = True
) -> Path:
    """Returns where a file ``path`` given for ``what`` is written (``suffix`` added when
    ``add_suffix`` and the name has none, as matplotlib does for a PNG), its folder made if
    missing (with ``make_folder``); raises ScheduleError for an empty path, a directory, or a
    folder that cannot be made."""
    if not isinstance(path, str | Path) or not str(path):
        raise ScheduleError(f"{what} path {path!r} is not a file name; give e.g. 'out{suffix}'")
    # A trailing separator names a folder even where none exists yet (Path drops it).
    folder = str(path).endswith(("/", os.sep))
    path = Path(path)
    if path.is_dir() or folder:
        raise ScheduleError(
            f"{what} path {str(path) + ('/' if folder else '')!r} is a directory; give a file "
            f"name, e.g. {str(path / ('schedule' + suffix))!r}"
        )
    if make_folder:
        make_parent_folder(path, what)
    return path.with_name(path.name + suffix) if add_suffix and not path.suffix else path


def make_parent_folder(path: Path, what: str) -> None:
    """Makes the folder of a file ``path`` given for ``what``, or raises ScheduleError."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ScheduleError(
            f"{what} path {str(path)!r}: its folder {str(path.parent)!r} cannot be made "
            f"({err.strerror or err}); give a file in a folder you can write to"
        ) from None


def text_grid(schedule: Schedule, result: SimResult | Costs | None = None, width: int = 120) -> str:
    """Returns a terminal picture of ``schedule``: one row per device, one column per time slot.

    Cells read ``F3``/``B3``/``W3``/``BW3`` (kind and microbatch), prefixed by the stage when a
    device holds several stages (``1F3``); ``.`` is idle and ``-`` continues an action longer
    than one slot. Times come from ``result`` (default: ``simulate(schedule)``). Lines longer
    than ``width`` characters wrap into blocks, each headed by the time its columns start at.
    ``result`` may also be a ``Costs``: the schedule is simulated with them, as ``gantt`` does.
    """
    if result is None or isinstance(result, Costs):
        result = simulate(schedule, result)
    check_result(schedule, result, "text_grid")
    if isinstance(width, bool) or not isinstance(width, int) or width < 1:
        raise ScheduleError(f"text_grid width = {width!r}; give a positive int of characters")
    unit = _slot_unit(schedule, result)
    rows = _grid_rows(schedule, result, unit)
    num_slots = len(rows[0]) if rows else 0
    labels = [c for row in rows for c in row if c]
    cell = max((len(c) for c in labels), default=1)
    row_names = [f"d{d}" for d in range(schedule.num_devices)]
    if _is_dag(schedule) or schedule.stage_names is not None:
        # On a stage DAG the branch a row belongs to matters more than the device number.
        row_names = [
            f"d{d} " + "/".join(stage_label(schedule, s) for s in schedule.stages_on(d))
            for d in range(schedule.num_devices)
        ]
    name_width = max((len(n) for n in row_names), default=1) + 1
    per_block = max(1, (width - name_width) // (cell + 1))
    # A time mark every `mark_every` slots, far enough apart for the longest mark to fit (a
    # fraction such as 0.25 is longer than the last time, a whole number).
    longest_mark = max(len(_fmt_time(slot * unit)) for slot in range(num_slots + 1)) + 1
    mark_every = max(1, math.ceil(longest_mark / (cell + 1)))
    mark_every = next(k for k in (1, 2, 5, 10, 20, 50, 100, 10**9) if k >= mark_every)

    def render(c: str | None) -> str:
        if c is None:
            return ".".ljust(cell)
        return c.ljust(cell) if c else "-" * cell

    blocks = []
    for begin in range(0, max(num_slots, 1), per_block):
        end = min(begin + per_block, num_slots)
        ruler = [" "] * ((end - begin) * (cell + 1))
        free = 0  # the first position after the last mark and its space
        for slot in range(begin, end):
            if slot % mark_every == 0:
                mark = _fmt_time(slot * unit)
                pos = (slot - begin) * (cell + 1)
                # A cut-off mark, or one run into the last, would read as another time.
                if pos >= free and pos + len(mark) <= len(ruler):
                    ruler[pos : pos + len(mark)] = list(mark)
                    free = pos + len(mark) + 1
        lines = [" " * name_width + "".join(ruler).rstrip()]
        for device, row in enumerate(rows):
            body = " ".join(render(c) for c in row[begin:end])
            lines.append(row_names[device].ljust(name_width) + body.rstrip())
        blocks.append("\n".join(lines))
    header = f"(one column = {_fmt_time(unit)} time units)" if unit != 1.0 else ""
    text = "\n\n".join(blocks)
    # Which actions take no time, by kind and stage (a first stage's B, say, not every B).
    instant: dict[str, set[int]] = {}
    for _, _, a in schedule.all_actions():
        if result.end[a] <= result.start[a]:
            instant.setdefault(a.kind, set()).add(a.stage)
    if instant:
        named = [
            f"{kind} of stage{'s' if len(stages) > 1 else ''} "
            + ", ".join(str(s) for s in sorted(stages))
            for kind, stages in sorted(instant.items())
        ]
        text += f"\n({'; '.join(named)}: no time, not drawn)"
    return f"{header}\n{text}" if header else text


def _lighten(color: str, amount: float) -> tuple[float, float, float]:
    rgb = [int(color[i : i + 2], 16) / 255 for i in (1, 3, 5)]
    return tuple(c + (1 - c) * amount for c in rgb)  # type: ignore[return-value]


def gantt(
    schedule: Schedule,
    costs: Costs | None = None,
    path: str | Path | None = None,
    title: str | None = None,
) -> Any:
    """Returns a matplotlib ``Figure`` of ``schedule`` as simulated with ``costs``; saves a PNG
    to ``path`` when given.

    One row per device, F/B/W/BW in distinct colours, microbatch numbers in the boxes that have
    room. When a device holds several stages, its later stages are drawn lighter and the box
    says the stage (``s5:3``); when the stage graph branches (a DAG) each stage also gets its own
    hatch and its name (``Schedule.stage_names``) in the box and the legend. A ``path`` without
    a suffix gets ".png" (``output_path``).
    """
    check_schedule(schedule, "gantt")
    Costs.check(costs, "gantt's costs")
    if path is not None:
        path = output_path(path, "gantt", ".png", add_suffix=True)
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError as err:
        raise ImportError(
            "zbjax.schedules.gantt needs matplotlib; install it with pip install 'zbjax[plot]'"
        ) from err

    result = simulate(schedule, costs)
    several = _holds_several_stages(schedule)
    dag = _is_dag(schedule) or schedule.stage_names is not None
    makespan = result.makespan if result.makespan > 0 else 1.0

    fig_width = 13.0
    fig = Figure(figsize=(fig_width, 1.4 + 0.45 * max(schedule.num_devices, 1)), dpi=110)
    FigureCanvasAgg(fig)  # draw with Agg whatever pyplot's backend is
    ax = fig.add_axes((0.07, 0.18, 0.74, 0.70))
    axes_px = fig_width * fig.dpi * 0.74
    px_per_unit = axes_px / makespan
    fontsize = 7 if schedule.num_devices <= 16 else 5
    char_px = 0.62 * fontsize * fig.dpi / 72

    for device, program in enumerate(schedule.actions):
        stages_here = schedule.stages_on(device)
        for action in program:
            start = result.start[action]
            length = result.end[action] - start
            chunk = stages_here.index(action.stage) if action.stage in stages_here else 0
            color = _lighten(
                KIND_COLORS[action.kind], 0.45 * min(chunk, 1) + 0.15 * max(chunk - 1, 0)
            )
            hatch = _HATCHES[action.stage % len(_HATCHES)] if dag else ""
            ax.barh(
                device,
                length,
                left=start,
                height=0.8,
                color=color,
                edgecolor="black",
                linewidth=0.3,
                hatch=hatch or None,
            )
            # The longest label that fits: stage and microbatch, else the microbatch alone
            # (the shade or hatch still tells the stage).
            labels = [str(action.microbatch)]
            if dag:
                labels.insert(0, f"{stage_label(schedule, action.stage)}:{action.microbatch}")
            elif several:
                labels.insert(0, f"s{action.stage}:{action.microbatch}")
            fitting = [t for t in labels if length * px_per_unit >= (len(t) + 0.5) * char_px]
            if fitting:
                label = fitting[0]
                ax.text(
                    start + length / 2,
                    device,
                    label,
                    ha="center",
                    va="center",
                    fontsize=fontsize,
                    bbox={"facecolor": "white", "alpha": 0.6, "pad": 0.5, "lw": 0} if dag else None,
                )

    ax.set_xlim(0, makespan)
    ax.set_ylim(schedule.num_devices - 0.5, -0.5)  # device 0 on top
    ax.set_yticks(range(schedule.num_devices))
    ax.set_yticklabels([f"device {d}" for d in range(schedule.num_devices)], fontsize=8)
    ax.set_xlabel("time (cost units)")
    used = {a.kind for _, _, a in schedule.all_actions()}
    names = {"F": "F forward", "B": "B input grad", "W": "W weight grad", "BW": "BW fused"}
    handles = [Patch(facecolor=KIND_COLORS[k], edgecolor="black", label=names[k]) for k in used]
    handles.sort(key=lambda h: list(names.values()).index(h.get_label()))
    if several:
        handles.append(
            Patch(
                facecolor=_lighten("#808080", 0.45),
                edgecolor="black",
                label="later stage on device",
            )
        )
    if dag:
        handles += [
            Patch(
                facecolor="white",
                edgecolor="black",
                hatch=_HATCHES[s % len(_HATCHES)] or None,
                label=stage_label(schedule, s),
            )
            for s in range(schedule.num_stages)
        ]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    heading = title if title is not None else schedule.name
    ax.set_title(
        f"{heading}: p={schedule.num_devices} devices, {schedule.num_stages} stages, "
        f"m={schedule.num_microbatches}, bubble rate {result.bubble_rate:.1%}, "
        f"makespan {_fmt_time(result.makespan)}",
        fontsize=10,
    )
    if path is not None:
        fig.savefig(path, dpi=fig.dpi, bbox_inches="tight")
    return fig


def chrome_trace(
    schedule: Schedule, costs: Costs | None = None, unit_us: float = TRACE_US_PER_UNIT
) -> dict[str, Any]:
    """Returns a Chrome/Perfetto trace (``{"traceEvents": [...]}``) of the simulated schedule.

    One complete event (``ph: "X"``) per action on thread ``tid = device`` of process 0, named
    like ``"F s2 mb3"``, with ``ts``/``dur`` in microseconds where one cost unit is ``unit_us``
    microseconds (default 1000; pass ``unit_us=1e6`` for costs in seconds, as
    ``pipe.measure_costs`` returns them), and ``args`` holding kind, stage and microbatch.
    Metadata events name each thread ``device d``; ``otherData`` holds the schedule's sizes,
    makespan (in cost units), bubble rate and ``us_per_cost_unit``.
    """
    check_schedule(schedule, "chrome_trace")
    Costs.check(costs, "chrome_trace's costs")
    scale = real_number(unit_us)
    if scale is None or not 0 < scale < math.inf:
        raise ScheduleError(
            f"chrome_trace's unit_us={unit_us!r}: pass the microseconds one cost unit stands "
            "for, a positive finite number (1e6 for costs in seconds)"
        )
    result = simulate(schedule, costs)
    events: list[dict[str, Any]] = [
        {"name": "process_name", "ph": "M", "pid": 0, "args": {"name": schedule.name}}
    ]
    events += [
        {"name": "thread_name", "ph": "M", "pid": 0, "tid": d, "args": {"name": f"device {d}"}}
        for d in range(schedule.num_devices)
    ]
    for device, _, action in schedule.all_actions():
        start = result.start[action]
        events.append(
            {
                "name": f"{action.kind} s{action.stage} mb{action.microbatch}",
                "cat": action.kind,
                "ph": "X",
                "pid": 0,
                "tid": device,
                "ts": start * scale,
                "dur": (result.end[action] - start) * scale,
                "args": {
                    "kind": action.kind,
                    "stage": action.stage,
                    "microbatch": action.microbatch,
                    "action": str(action),
                },
            }
        )
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "schedule": schedule.name,
            "num_stages": schedule.num_stages,
            "num_devices": schedule.num_devices,
            "num_microbatches": schedule.num_microbatches,
            "makespan": result.makespan,
            "bubble_rate": result.bubble_rate,
            # Says what the times mean: Perfetto shows microseconds whatever the costs were.
            "us_per_cost_unit": scale,
        },
    }


def write_trace(
    schedule: Schedule,
    path: str | Path,
    costs: Costs | None = None,
    unit_us: float = TRACE_US_PER_UNIT,
) -> Path:
    """Returns ``path`` after writing ``chrome_trace(schedule, costs, unit_us)`` there as JSON."""
    path = output_path(path, "write_trace", ".json")
    path.write_text(json.dumps(chrome_trace(schedule, costs, unit_us)))
    return path
