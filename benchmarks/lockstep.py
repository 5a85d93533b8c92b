"""How much of each schedule's simulated step survives the lowering's lockstep ticks (no JAX).

The simulator runs a schedule event-driven: an action starts as soon as its inputs arrive. The
compiled step runs it in ticks, the devices waiting for each other at every tick that sends a
message (``zbjax.ticks.barrier_time``). This script compares, for the profiled costs of
``schedules.py`` on 4 and 8 devices, the event-driven makespan with the time of the ticks the
lowering would run: plain lockstep ticks (no costs given), the best packing of fixed ticks
(``pack_ticks``, what ``choose_ticks`` chose before it searched segments on more than two
devices), and ``choose_ticks`` itself, which also lays the ticks out around the exchanges
(``segment_ticks``). It also reports how long ``segment_ticks`` took, the planning time a
pipeline pays once when it is built with costs. Writes the section "lockstep" of
``benchmarks/RESULTS.md``.

Run: ``python benchmarks/lockstep.py``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

from _results import write_section
from schedules import COST_SETS, chunk_costs

from zbjax import schedules, ticks
from zbjax.cli import default_num_stages

COMMAND = "python benchmarks/lockstep.py"
#: The schedules whose ticks may be segmented (zb-v's V placement has an edge inside a device,
#: so it always gets packed ticks; zb-auto's orders are those of zb-h1/zb-h2 or between).
SCHEDULE_NAMES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-h2")
DEVICE_COUNTS = (4, 8)
MICROBATCHES_PER_DEVICE = (1, 2, 4)


@dataclass(frozen=True)
class Row:
    """Lockstep times of one schedule, as ratios to its event-driven makespan."""

    name: str
    num_devices: int
    num_microbatches: int
    plain: float
    packed: float
    chosen: float
    segmented: bool  # the segments beat every packing
    search_s: float


def best_packing(schedule: schedules.Schedule, costs: schedules.Costs) -> float:
    """Returns the least ``barrier_time`` of ``choose_ticks``'s packings of fixed ticks (its
    candidates but ``segment_ticks``)."""
    return min(ticks.barrier_time(schedule, p, costs) for p in ticks.packings(schedule, costs))


def measure(name: str, p: int, m: int, costs: schedules.Costs) -> Row:
    """Returns the lockstep times of schedule ``name`` on ``p`` devices and ``m`` microbatches
    under ``costs`` (per device-sized stage; chunked as ``schedules.py`` does)."""
    num_stages = default_num_stages(name, p)
    per_chunk = chunk_costs(costs, p, num_stages)
    schedule = schedules.build(name, num_stages, m, num_devices=p)
    makespan = schedules.simulate(schedule, per_chunk).makespan
    plain = ticks.barrier_time(schedule, ticks.pack_ticks(schedule), per_chunk)
    began = time.perf_counter()
    segments = ticks.segment_ticks(schedule, per_chunk)
    search_s = time.perf_counter() - began
    chosen = ticks.barrier_time(schedule, ticks.choose_ticks(schedule, per_chunk), per_chunk)
    packed = best_packing(schedule, per_chunk)
    return Row(
        name,
        p,
        m,
        plain / makespan,
        packed / makespan,
        chosen / makespan,
        segments is not None and chosen < packed * (1 - 1e-9),
        search_s,
    )


def table(rows: Sequence[Row]) -> str:
    """Returns the markdown table of ``rows`` (one profile)."""
    lines = [
        "| p | m | schedule | plain ticks | best packing | chosen (with segments) | "
        "chosen / best packing | segments faster | segment search (s) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.num_devices} | {r.num_microbatches} | {r.name} | {r.plain:.3f} | "
            f"{r.packed:.3f} | {r.chosen:.3f} | {r.chosen / r.packed:.3f} | "
            f"{'yes' if r.segmented else 'no'} | {r.search_s:.2f} |"
        )
    return "\n".join(lines)


def run(
    cost_sets: dict[str, schedules.Costs],
    device_counts: Sequence[int] = DEVICE_COUNTS,
    per_device: Sequence[int] = MICROBATCHES_PER_DEVICE,
    names: Sequence[str] = SCHEDULE_NAMES,
) -> dict[str, list[Row]]:
    """Returns the rows of every profile in ``cost_sets``."""
    return {
        label: [
            measure(name, p, k * p, costs)
            for p in device_counts
            for k in per_device
            for name in names
        ]
        for label, costs in cost_sets.items()
    }


def section(results: dict[str, list[Row]], took: float) -> str:
    """Returns the RESULTS.md section for ``results``."""
    every = [r for rows in results.values() for r in rows]
    gains = [r.chosen / r.packed for r in every]
    parts = [
        "## Lockstep ticks versus the event-driven schedule (simulated)",
        "",
        f"Made by `{COMMAND}` (no JAX, no devices). Each cell is the time of the ticks the "
        "lowering would run divided by the schedule's event-driven makespan "
        "(`zbjax.schedules.simulate`, the same costs): the devices run their actions of a tick "
        "back to back and wait for each other only at the ticks that send a message, each of "
        "which costs `comm` (`zbjax.ticks.barrier_time`). *plain ticks*: one action per device "
        "per tick, as built (no costs given). *best packing*: the least over `choose_ticks`'s "
        "packings of fixed ticks (`pack_ticks`: W, then any action, in the spare time of a tick "
        "after a short one). *chosen*: `choose_ticks`, which also tries laying the ticks out "
        "around the exchanges (`segment_ticks`: exact on two devices; on more, a best-first "
        "search over how far each device has run, exact within its first "
        f"{ticks.SEGMENT_EXPANSIONS} frontiers and weighted after); *segments faster* says "
        "whether that beat every packing. *segment search* is how long `segment_ticks` took "
        "(planning a pipeline built with costs pays it once). Costs are `schedules.py`'s profiles, "
        "interleaved-1f1b running 2p chunks of half a stage each.",
        "",
        f"Over all {len(every)} rows: chosen / best packing median {statistics.median(gains):.3f},"
        f" least {min(gains):.3f}; segments faster in "
        f"{sum(r.segmented for r in every)}; the longest segment search "
        f"{max(r.search_s for r in every):.2f} s.",
        "",
    ]
    for label, rows in results.items():
        parts += [f"### {label}", "", table(rows), ""]
    parts.append(f"Took {took:.1f} s.")
    return "\n".join(parts)


def main() -> int:
    began = time.perf_counter()
    results = run(COST_SETS)
    path = write_section("lockstep", section(results, time.perf_counter() - began))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
