"""What does writing an action's outputs into a slot of the lowering's pools cost?

The pipeline's tick loop writes what an action produces (F's residuals and activations, B's
stash and cotangents) into one slot of a pool that holds several microbatches: XLA computes
each output into a buffer of its own and copies it into the slot. ``zbjax.profile.looped``
times an action that way (``slots=2``, the default); with ``slots=1`` the pool is one slot and
XLA writes the outputs in place, as an action timed alone would. This script times every
stage's F, B, W and BW both ways, alternating, on one core (as one pipeline device runs), for
``step_time``'s MLP and a GPT middle stage, and reports the ratio: how much the costs the
planner gets grow from modelling the slot writes. Writes the section "slot_writes" of
``benchmarks/RESULTS.md``.

Run: ``python benchmarks/slot_writes.py [--repeats N]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

import jax

from zbjax.partition import partition
from zbjax.profile import LOOP_RUNS, LOOP_SLOTS, stage_cost_calls
from zbjax.split import split

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import step_time
from _results import machine_load, pin_to_one_core, write_section

from models import gpt, mlp

COMMAND = "python benchmarks/slot_writes.py"
ACTIONS = ("F", "B", "W", "BW")


@dataclass(frozen=True)
class Case:
    """A model cut into stages, and one microbatch."""

    label: str
    loss_fn: object
    params: object
    microbatch: object
    num_stages: int


@dataclass(frozen=True)
class Row:
    """One action of one stage: ms per run written whole and into slots, median ratio."""

    case: str
    stage: int
    action: str
    whole_ms: float
    slots_ms: float
    ratio: float


def cases(small: bool = False) -> list[Case]:
    """Returns step_time's MLP (2 stages of 8 Dense(128), 1024 rows) and a GPT cut into 3
    stages (d 256, seq 128, batch 8); toy sizes when ``small``."""
    setup = step_time.SMOKE_SETUP if small else step_time.Setup()
    cfg = step_time.mlp_config(setup, step_time.NUM_DEVICES)
    key = jax.random.key(0)
    mlp_case = Case(
        f"MLP ({step_time.NUM_DEVICES} stages of {setup.layers_per_stage} "
        f"Dense({setup.width}), {setup.microbatch_rows} rows)",
        mlp.make_loss_fn(cfg),
        mlp.init_params(key, cfg),
        mlp.make_batch(jax.random.key(1), cfg, setup.microbatch_rows),
        step_time.NUM_DEVICES,
    )
    d, seq, batch = (16, 8, 2) if small else (256, 128, 8)
    gcfg = gpt.GPTConfig(vocab_size=256, seq_len=seq, d_model=d, num_heads=4, num_layers=6)
    gpt_case = Case(
        f"GPT linen (3 stages, d {d}, seq {seq}, batch {batch})",
        gpt.make_loss_fn(gcfg),
        gpt.init_params(key, gcfg),
        gpt.make_batch(jax.random.key(1), gcfg, batch),
        3,
    )
    return [mlp_case, gpt_case]


def measure(case: Case, repeats: int) -> list[Row]:
    """Returns a row per stage and action: both ways alternating in every round."""
    graph = partition(case.loss_fn, case.params, case.microbatch, num_stages=case.num_stages)
    programs = split(graph)
    params = jax.tree_util.tree_leaves(case.params)
    batch = jax.tree_util.tree_leaves(case.microbatch)
    whole = stage_cost_calls(graph, programs, params, batch, slots=1)
    slotted = stage_cost_calls(graph, programs, params, batch, slots=LOOP_SLOTS)
    for fn, args in whole + slotted:  # compile and warm up
        jax.block_until_ready(fn(*args))
    times: list[list[tuple[float, float]]] = [[] for _ in whole]
    for r in range(repeats):
        for k, (a, b) in enumerate(zip(whole, slotted, strict=True)):
            pair = []
            # Alternate which goes first, so that drift in machine load hits both alike.
            for fn, args in (a, b) if r % 2 == 0 else (b, a):
                began = time.perf_counter()
                jax.block_until_ready(fn(*args))
                pair.append((time.perf_counter() - began) / LOOP_RUNS)
            times[k].append((pair[0], pair[1]) if r % 2 == 0 else (pair[1], pair[0]))
    rows = []
    for k, pairs in enumerate(times):
        stage, action = divmod(k, len(ACTIONS))
        rows.append(
            Row(
                case.label,
                stage,
                ACTIONS[action],
                1e3 * statistics.median(w for w, _ in pairs),
                1e3 * statistics.median(s for _, s in pairs),
                statistics.median(s / w for w, s in pairs),
            )
        )
    return rows


def table(rows: Sequence[Row]) -> str:
    """Returns the markdown table of ``rows``."""
    lines = [
        "| model | stage | action | written whole (ms) | into slots (ms) | "
        "ratio (median of pairs) |",
        "|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r.case} | {r.stage} | {r.action} | {r.whole_ms:.2f} | {r.slots_ms:.2f} | "
        f"{r.ratio:.3f} |"
        for r in rows
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Returns 0 after timing every case on one core and writing the "slot_writes" section."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=21, help="timed pairs per action")
    args = parser.parse_args(argv)
    pin_to_one_core()
    began = time.perf_counter()
    load_before = machine_load()
    rows = [row for case in cases() for row in measure(case, args.repeats)]
    load_after = machine_load()
    body = "\n".join(
        [
            "## Slot writes: an action's outputs written into pool slots versus written whole",
            "",
            f"Made by `{COMMAND} --repeats {args.repeats}`, pinned to one core "
            f"({jax.devices()[0].device_kind}, jax {jax.__version__}).",
            "Each stage's F, B, W and fused BW (as `zbjax.profile.stage_cost_calls` times them "
            f"for `pipe.measure_costs`) run {LOOP_RUNS} times per timed call in a loop that "
            f"writes each run's outputs into a slot of pools of {LOOP_SLOTS} slots kept between "
            "calls (*into slots*, how the tick loop writes its pools and how the costs are "
            "measured) or of 1 slot (*written whole*: XLA computes the outputs in place, as "
            f"an action timed alone would). The two alternate {args.repeats} times after "
            "warm-up; times are per run, medians; the ratio is the median over pairs. F and B "
            "write the most (residuals, activations; the stash, cotangents), W and BW little "
            "(the weight gradients).",
            "",
            table(rows),
            "",
            f"Machine load before: `{load_before}`; after: `{load_after}`.",
            f"Took {time.perf_counter() - began:.0f} s.",
        ]
    )
    print(write_section("slot_writes", body))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
