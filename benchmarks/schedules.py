"""Bubble rate and peak activation memory of every schedule, from the simulator (no JAX).

Writes the section "schedules" of ``benchmarks/RESULTS.md`` and one Gantt chart per schedule
(p=4, m=8, equal costs) to ``benchmarks/figures/``. Run: ``python benchmarks/schedules.py``.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path

from _results import write_section

from zbjax import schedules
from zbjax.cli import default_num_stages
from zbjax.schedules.plot import gantt

COMMAND = "python benchmarks/schedules.py"
FIGURES = Path(__file__).resolve().parent / "figures"

#: Per-stage (T_F, T_B, T_W, T_comm): unit costs, and the profiled costs PAPERS.md quotes.
COST_SETS: dict[str, schedules.Costs] = {
    "equal costs (F = B = W = 1, comm 0)": schedules.Costs(1.0, 1.0, 1.0, 0.0),
    "1.5B profile (18522, 18086, 9337, comm 601)": schedules.Costs(18522, 18086, 9337, 601),
    "6.2B profile (29802, 29428, 19530, comm 577)": schedules.Costs(29802, 29428, 19530, 577),
    "14.6B profile (11347, 11248, 8132, comm 377)": schedules.Costs(11347, 11248, 8132, 377),
}
DEVICE_COUNTS = (4, 8, 16)
MICROBATCHES_PER_DEVICE = (1, 2, 4)


@dataclass(frozen=True)
class Variant:
    """One column of the table: a schedule name and, for zb-auto, its memory limit in p's."""

    label: str
    name: str
    mem_limit_per_device: int | None = None
    objective: str | None = None


VARIANTS: tuple[Variant, ...] = (
    Variant("gpipe", "gpipe"),
    Variant("1f1b", "1f1b"),
    Variant("interleaved-1f1b", "interleaved-1f1b"),
    Variant("zb-h1", "zb-h1"),
    Variant("zb-h2", "zb-h2"),
    Variant("zb-v", "zb-v"),
    Variant("zb-auto (limit p)", "zb-auto", 1),
    Variant("zb-auto (limit 2p)", "zb-auto", 2),
    Variant("zb-auto (limit 2p, span objective)", "zb-auto", 2, "span"),
)


@dataclass(frozen=True)
class Outcome:
    """Simulated bubble rate and peak memory (in whole-stage M_B) of one variant, or why not."""

    bubble_rate: float | None
    span_bubble_rate: float | None
    peak_memory: float | None
    error: str | None = None

    def cell(self) -> str:
        """Returns the markdown table cell: ``bubble% / span bubble% / peak`` or ``n/a``."""
        if self.error is not None:
            return "n/a"
        return f"{self.bubble_rate:.1%} / {self.span_bubble_rate:.1%} / {self.peak_memory:.3g}"


def chunk_costs(costs: schedules.Costs, num_devices: int, num_stages: int) -> schedules.Costs:
    """Returns ``costs`` for one of ``num_stages`` chunks of a model spread on ``num_devices``.

    The profiled costs are per device-sized stage; a schedule with two chunks per device
    (interleaved-1f1b, zb-v) runs half of that stage per chunk, so F, B and W shrink in
    proportion while a send still costs ``comm``. Every schedule then does the same work.
    """
    scale = num_devices / num_stages
    return schedules.Costs(costs.f * scale, costs.b * scale, costs.w * scale, costs.comm)


def run_variant(variant: Variant, p: int, m: int, costs: schedules.Costs) -> Outcome:
    """Returns the simulated outcome of ``variant`` on ``p`` devices and ``m`` microbatches."""
    num_stages = default_num_stages(variant.name, p)
    per_chunk = chunk_costs(costs, p, num_stages)
    limit = None if variant.mem_limit_per_device is None else variant.mem_limit_per_device * p
    options = {} if variant.objective is None else {"objective": variant.objective}
    try:
        schedule = schedules.build(
            variant.name, num_stages, m, num_devices=p, costs=per_chunk, mem_limit=limit, **options
        )
        schedules.validate(schedule)
        result = schedules.simulate(schedule, per_chunk)
    except ValueError as err:
        return Outcome(None, None, None, f"{variant.label} p={p} m={m}: {err}")
    # A chunk's activation is num_devices / num_stages of a whole stage's M_B.
    peak = max(result.peak_memory) * p / num_stages
    return Outcome(result.bubble_rate, schedules.span_bubble_rate(schedule, result), peak)


def table(costs: schedules.Costs) -> tuple[str, list[str]]:
    """Returns one markdown table (rows p, m; columns variants) and the errors met."""
    header = "| p | m | " + " | ".join(v.label for v in VARIANTS) + " |"
    rule = "|---|---|" + "---|" * len(VARIANTS)
    rows, errors = [header, rule], []
    for p in DEVICE_COUNTS:
        for k in MICROBATCHES_PER_DEVICE:
            outcomes = [run_variant(v, p, k * p, costs) for v in VARIANTS]
            errors += [o.error for o in outcomes if o.error is not None]
            rows.append(f"| {p} | {k * p} | " + " | ".join(o.cell() for o in outcomes) + " |")
    return "\n".join(rows), errors


def draw_figures(p: int = 4, m: int = 8) -> list[Path]:
    """Returns the PNG Gantt charts written for every variant at ``p``, ``m``, equal costs."""
    FIGURES.mkdir(parents=True, exist_ok=True)
    written = []
    for variant in VARIANTS:
        if variant.objective is not None:
            continue
        num_stages = default_num_stages(variant.name, p)
        limit = None if variant.mem_limit_per_device is None else variant.mem_limit_per_device * p
        schedule = schedules.build(variant.name, num_stages, m, num_devices=p, mem_limit=limit)
        suffix = "" if limit is None else f"-limit{variant.mem_limit_per_device}p"
        path = FIGURES / f"schedule-{variant.name}{suffix}.png"
        gantt(schedule, path=path, title=variant.label)
        written.append(path)
    return written


def main() -> int:
    """Returns 0 after writing the tables and figures (1 if some schedule could not be built)."""
    began = time.perf_counter()
    parts = [
        "## Schedules: simulated bubble rate and peak activation memory",
        "",
        f"Made by `{COMMAND}` (the simulator in `zbjax.schedules`, no JAX, no devices).",
        "Each cell is `bubble rate / span bubble rate / peak activation memory`: bubble rate = "
        "1 − (compute time of all devices) / (devices × makespan) of one step; span bubble "
        "rate = the same over the longest device span (first start to last end), the period of "
        "back-to-back steps when each stage steps its own optimizer, which is the measure the "
        "Zero Bubble paper reports (`zbjax.schedules.span_bubble_rate`); peak memory is the "
        "largest over devices, in M_B "
        "of a whole device-sized stage, with W keeping half of M_B after B (w_mem = 0.5).",
        "p = devices. interleaved-1f1b and zb-v run 2p chunks of half a stage each (F, B, W "
        "costs halved per chunk, comm unchanged), so every schedule does the same work and "
        "the throughput of X relative to 1f1b is (1 − bubble X) / (1 − bubble 1f1b). "
        "zb-auto runs under a memory limit of p or 2p M_B per device. gpipe, 1f1b and "
        "interleaved-1f1b fuse B and W (BW).",
        "The one-step bubble rate includes the (p − 1)·T_F ramp before the first forward "
        "reaches the last device, so no schedule reaches 0 on it; the span measure leaves that "
        "ramp out (steps overlap there), and on it zb-h2 and zb-v reach 0 for m ≥ 2p. "
        "Cells list bubble rates as the simulator computes them; nothing here is typed in.",
        "",
    ]
    all_errors: list[str] = []
    for label, costs in COST_SETS.items():
        body, errors = table(costs)
        all_errors += errors
        parts += [f"### {label}", "", body, ""]
    if all_errors:
        parts += ["Cells marked n/a could not be built:", ""]
        parts += [f"- {e}" for e in all_errors]
        parts.append("")
    figures = draw_figures()
    parts.append(
        "Gantt charts (p = 4, m = 8, equal costs): "
        + ", ".join(f"[{f.stem}](figures/{f.name})" for f in figures)
        + "."
    )
    elapsed = time.perf_counter() - began
    parts.append(f"\nTook {elapsed:.1f} s.")
    path = write_section("schedules", "\n".join(parts))
    print(f"wrote {path} and {len(figures)} figures in {FIGURES} ({elapsed:.1f} s)")
    for error in all_errors:
        print(f"n/a: {error}", file=sys.stderr)
    return 1 if all_errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
