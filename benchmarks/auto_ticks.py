"""Which order a zb-auto pipeline planned with costs runs, in the ticks it compiles to (no JAX).

zb-auto's search scores orders by event-driven time with B and W split. The compiled step runs
them in ticks: devices wait for each other at every exchange, and a stage whose fused backward
costs less than its B and W may run it fused (``zbjax.ticks.plan_ticks``). A pipeline built
with ``costs=`` and ``schedule="zb-auto"`` therefore lets the search's order compete with
zb-h1, zb-h2 and 1f1b (within the same memory limit) by the time of their planned ticks
(``zbjax.ticks.zb_auto_in_ticks``). This script measures, for seeded random per-stage costs
(the fused backward ``bw`` 0.8-1.0 of B + W, as measured costs have it) and for the Zero Bubble
paper's profiles (no ``bw``: B + W), how the search's order fares in ticks against the best
named one, and how long the choice takes. Writes the section "auto_ticks" of
``benchmarks/RESULTS.md``.

Run: ``python benchmarks/auto_ticks.py``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

from _results import machine_load, write_section
from schedules import COST_SETS

from zbjax import schedules, ticks

COMMAND = "python benchmarks/auto_ticks.py"
#: (devices, microbatches) of the random cases, each with SEEDS cost draws.
SHAPES = ((2, 4), (2, 8), (4, 8), (4, 16), (8, 16))
SEEDS = 6


@dataclass(frozen=True)
class Row:
    """One case: the candidates' planned tick times and the choice."""

    label: str
    num_devices: int
    num_microbatches: int
    search: float  # the search's order, planned in ticks
    best_named: float  # the fastest of zb-h1 / zb-h2 / 1f1b that fit the limit
    chosen: str  # the order that runs
    chosen_time: float
    choice_s: float  # seconds zb_auto_in_ticks took


def random_costs(rng: random.Random, p: int) -> schedules.Costs:
    """Returns per-stage costs drawn like helper HD's: F, B in [0.5, 2], W in [0.2, 2], the
    fused backward 0.8-1.0 of B + W, comm in [0, 0.5]."""

    def draw(low: float, high: float) -> tuple[float, ...]:
        return tuple(round(rng.uniform(low, high), 3) for _ in range(p))

    f, b, w = draw(0.5, 2.0), draw(0.5, 2.0), draw(0.2, 2.0)
    bw = tuple(round(rng.uniform(0.8, 1.0) * (x + y), 3) for x, y in zip(b, w, strict=True))
    return schedules.Costs(f=f, b=b, w=w, comm=round(rng.uniform(0.0, 0.5), 3), bw=bw)


def measure(label: str, p: int, m: int, costs: schedules.Costs) -> Row:
    """Returns the row of zb-auto on ``p`` stages and ``m`` microbatches under ``costs`` (its
    first stage's B empty, as a chain's first stage has it)."""
    searched = schedules.build("zb-auto", p, m, costs=costs)
    began = time.perf_counter()
    order, ranked, _ = ticks.zb_auto_in_ticks(searched, costs, [0])
    took = time.perf_counter() - began
    times = {name.removesuffix(" (screened)"): t for name, t in ranked}
    named = [t for name, t in times.items() if name != "search"]
    return Row(
        label,
        p,
        m,
        times["search"],
        min(named) if named else float("nan"),
        ranked[0][0],
        ranked[0][1],
        took,
    )


def run(
    shapes: Sequence[tuple[int, int]] = SHAPES, seeds: int = SEEDS, profiles: bool = True
) -> list[Row]:
    """Returns the rows of the random cases (and of the paper's profiles at p = 4, m = 8 / 16)."""
    rows = []
    for p, m in shapes:
        for seed in range(seeds):
            costs = random_costs(random.Random(f"{p}-{m}-{seed}"), p)
            rows.append(measure(f"random, seed {seed}", p, m, costs))
    if profiles:
        for label, costs in COST_SETS.items():
            for m in (8, 16):
                rows.append(measure(label, 4, m, costs))
    return rows


def section(rows: Sequence[Row], took: float, load: str = "", command: str = COMMAND) -> str:
    """Returns the RESULTS.md section for ``rows``."""
    lost = [r.search / r.best_named for r in rows if r.search > 1.01 * r.best_named]
    gain = [r.search / r.chosen_time for r in rows]
    lines = [
        "## zb-auto in ticks: the search's order against the named ones (simulated)",
        "",
        f"Made by `{command}` (no JAX, no devices). Each row plans zb-auto's order (searched "
        "for event-driven time, B and W split, memory limit 2p) and zb-h1, zb-h2 and 1f1b "
        "(those within the limit) in the ticks the lowering runs (`zbjax.ticks.plan_ticks`: "
        "waits at exchanges only, a stage's backward fused where `bw` undercuts B + W and that "
        "shortens the ticks), and gives their `barrier_time`; *runs* is the order a pipeline "
        "built with `costs=` and `schedule='zb-auto'` runs (`zbjax.ticks.zb_auto_in_ticks`: "
        "the fastest; orders whose ticks planned without the segment search came 5 % or more "
        "behind keep that time). Random costs: F, B in [0.5, 2], W in [0.2, 2], bw 0.8-1.0 of "
        "B + W, comm in [0, 0.5], seeded; the paper's profiles have no bw (fused = B + W).",
        "",
        f"The search's order was more than 1 % slower in ticks than the best named order in "
        f"{len(lost)} of {len(rows)} rows"
        + (f" (by up to {max(lost) - 1:.1%})" if lost else "")
        + f"; the order that runs is {statistics.median(gain):.3f}x faster than the search's "
        f"(median; at most {max(gain):.3f}x). The choice took at most "
        f"{max(r.choice_s for r in rows):.1f} s (planning the ticks of 2-4 candidates; the "
        "lowering reuses the winner's plan).",
        "",
        "| costs | p | m | search's order | best named | runs | its time | search / runs | "
        "choice (s) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.label} | {r.num_devices} | {r.num_microbatches} | {r.search:.4g} | "
            f"{r.best_named:.4g} | {r.chosen} | {r.chosen_time:.4g} | "
            f"{r.search / r.chosen_time:.3f} | {r.choice_s:.2f} |"
        )
    lines += ["", f"Took {took:.1f} s." + (f" Machine load after: `{load}`." if load else "")]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.parse_args(argv)
    began = time.perf_counter()
    rows = run()
    took = time.perf_counter() - began
    path = write_section("auto_ticks", section(rows, took, machine_load()))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
