"""Does compile time stay flat as the number of microbatches grows? Compile time vs m and p.

A GPT cut into p stages (one per device, zb-h1) is lowered with ``pipe.lower(params, batch)``
and compiled with ``.compile()`` for m in {8, 16, 32, 64} and p in {2, 4, 8} (fake CPU
devices). The tick loop is a ``lax.scan``, so the program should not grow with m; the target is
compile(m=64) / compile(m=8) <= 1.5. Writes the section "compile_time" of
``benchmarks/RESULTS.md`` and ``benchmarks/figures/compile_time.png``.

Run: ``python benchmarks/compile_time.py [--repeats N]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import jax
import numpy as np

import zbjax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _results import machine_load, save_figure, write_section

from models import gpt

COMMAND = "python benchmarks/compile_time.py"
FIGURES = Path(__file__).resolve().parent / "figures"
AXIS = "pp"
SCHEDULE = "zb-h1"
DEVICE_COUNTS = (2, 4, 8)
MICROBATCHES = (8, 16, 32, 64)
TARGET_RATIO = 1.5


@dataclass(frozen=True)
class Timing:
    """Seconds to trace and lower, and to compile, one pipeline (medians over repeats)."""

    p: int
    m: int
    lower_s: float
    compile_s: float
    ticks: int


def gpt_config(num_stages: int) -> gpt.GPTConfig:
    """Returns a small GPT (8 blocks) cut into ``num_stages`` cost-balanced stages."""
    cfg = gpt.GPTConfig(vocab_size=64, seq_len=16, d_model=32, num_heads=2, num_layers=8)
    cuts = gpt.balanced_boundaries(cfg, num_stages)
    return gpt.GPTConfig(**{**cfg.__dict__, "stage_boundaries": cuts})


def time_compile(p: int, m: int, rows_per_microbatch: int = 2) -> Timing:
    """Returns how long a fresh pipeline for ``p`` devices and ``m`` microbatches takes to
    lower (trace, partition, split, schedule, lower to StableHLO) and to compile."""
    cfg = gpt_config(p)
    params = gpt.init_params(jax.random.key(0), cfg)
    batch = gpt.make_batch(jax.random.key(1), cfg, m * rows_per_microbatch)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:p]), (AXIS,))
    pipe = zbjax.pipeline(
        gpt.make_loss_fn(cfg), mesh=mesh, axis_name=AXIS, schedule=SCHEDULE, num_microbatches=m
    )
    began = time.perf_counter()
    lowered = pipe.lower(params, batch)
    lowered_at = time.perf_counter()
    lowered.compile()
    done = time.perf_counter()
    # The loop's ticks as lowered (one action per device per tick: no costs are given).
    return Timing(p, m, lowered_at - began, done - lowered_at, pipe.lowering.tables.num_ticks)


def measure(repeats: int) -> list[Timing]:
    """Returns median timings for every (p, m); each repeat builds fresh pipelines, visiting
    the m values in a different order so load drift does not favour one m."""
    samples: dict[tuple[int, int], list[Timing]] = {}
    for r in range(repeats):
        for p in DEVICE_COUNTS:
            order = MICROBATCHES if r % 2 == 0 else MICROBATCHES[::-1]
            for m in order:
                t = time_compile(p, m)
                samples.setdefault((p, m), []).append(t)
                print(
                    f"p={p} m={m}: lower {t.lower_s:.2f} s, compile {t.compile_s:.2f} s", flush=True
                )
    return [
        Timing(
            p,
            m,
            statistics.median(t.lower_s for t in ts),
            statistics.median(t.compile_s for t in ts),
            ts[0].ticks,
        )
        for (p, m), ts in sorted(samples.items())
    ]


def table(timings: Sequence[Timing]) -> str:
    """Returns the markdown table: rows p, columns m, cells 'compile s (lower s)'."""
    lines = [
        "| p | " + " | ".join(f"m = {m}" for m in MICROBATCHES) + " | compile m=64 / m=8 |",
        "|---|" + "---|" * (len(MICROBATCHES) + 1),
    ]
    for p in DEVICE_COUNTS:
        row = {t.m: t for t in timings if t.p == p}
        cells = [
            f"{row[m].compile_s:.2f} s ({row[m].lower_s:.2f} s, {row[m].ticks} ticks)"
            for m in MICROBATCHES
        ]
        ratio = row[MICROBATCHES[-1]].compile_s / row[MICROBATCHES[0]].compile_s
        lines.append(f"| {p} | " + " | ".join(cells) + f" | {ratio:.2f} |")
    return "\n".join(lines)


def plot(timings: Sequence[Timing], path: Path) -> Path:
    """Returns ``path`` after drawing compile time against m, one line per p."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 4))
    for p in DEVICE_COUNTS:
        mine = [t for t in timings if t.p == p]
        ax.plot([t.m for t in mine], [t.compile_s for t in mine], marker="o", label=f"p = {p}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("microbatches m")
    ax.set_ylabel("compile time (s)")
    ax.set_ylim(bottom=0)
    ax.set_title(f"{SCHEDULE}: lowered.compile() time")
    ax.legend()
    return save_figure(fig, path)


def main(argv: Sequence[str] | None = None) -> int:
    """Returns 0 after timing every (p, m) and writing the "compile_time" section."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=1, help="fresh builds per (p, m)")
    args = parser.parse_args(argv)
    jax.config.update("jax_num_cpu_devices", max(DEVICE_COUNTS))  # before any computation
    began = time.perf_counter()
    load_before = machine_load()
    timings = measure(args.repeats)
    figure = plot(timings, FIGURES / "compile_time.png")
    worst = max(
        next(t for t in timings if t.p == p and t.m == MICROBATCHES[-1]).compile_s
        / next(t for t in timings if t.p == p and t.m == MICROBATCHES[0]).compile_s
        for p in DEVICE_COUNTS
    )
    body = "\n".join(
        [
            "## Compile time versus microbatches m and devices p",
            "",
            f"Made by `{COMMAND} --repeats {args.repeats}` (jax {jax.__version__}, fake CPU "
            "devices). Each cell is the time of `lowered.compile()` for a freshly built "
            f"`zbjax.pipeline(..., schedule={SCHEDULE!r})`; in brackets the time of "
            "`pipe.lower(params, batch)` (trace, partition, split, schedule, lower) and the "
            "number of ticks of the lowered loop (one action per device per tick: no costs are "
            "given, so nothing is packed). Model: GPT d_model 32, 8 blocks, seq 16, cut into p "
            "cost-balanced stages; 2 sequences per microbatch. "
            f"{'Medians over repeats; ' if args.repeats > 1 else ''}m values were visited in "
            "alternating order.",
            "",
            table(timings),
            "",
            f"Target: compile(m=64) / compile(m=8) ≤ {TARGET_RATIO}; worst over p: {worst:.2f} "
            f"({'met' if worst <= TARGET_RATIO else 'NOT met'}).",
            "",
            f"Figure: [compile_time.png](figures/{figure.name}).",
            f"Machine load before: `{load_before}`; after: `{machine_load()}` (compile times "
            "on this shared machine scale with its load; compare within a row).",
            f"Took {time.perf_counter() - began:.0f} s.",
        ]
    )
    path = write_section("compile_time", body)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
