"""How much memory does each schedule take per device, and does it follow the schedule's peak?

For every schedule on a 4-device CPU mesh and m in {4, 8, 16}, a GPT pipeline step (staged
params) is compiled and ``compiled.memory_analysis()`` read: ``argument_size_in_bytes`` (the
device's parameter row plus the batch) and ``temp_size_in_bytes`` (activation buffers,
arenas, gradient accumulators). Next to them: the schedule's simulated peak activation memory
(in M_B units, ``simulate(...).peak_memory``) times the stage program's ``activation_bytes``,
and the arenas the lowering keeps activations in between actions. Writes the section
"memory" of ``benchmarks/RESULTS.md`` and ``benchmarks/figures/memory.png``.

Run: ``python benchmarks/memory.py [--microbatches 4 8 16]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import jax
import numpy as np

import zbjax
from zbjax import lower as zlower
from zbjax import schedules
from zbjax.lower import Lowering, lower
from zbjax.partition import partition
from zbjax.split import split, split_stage
from zbjax.stages import StageProgram
from zbjax.ticks import choose_ticks, tick_tables

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _results import machine_load, save_figure, write_section

from models import gpt

COMMAND = "python benchmarks/memory.py"
FIGURES = Path(__file__).resolve().parent / "figures"
AXIS = "pp"
NUM_DEVICES = 4
SCHEDULE_NAMES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zb-v", "zb-auto")
TWO_STAGES_PER_DEVICE = ("interleaved-1f1b", "zb-v")


@dataclass(frozen=True)
class Model:
    """The GPT's sizes and rows per microbatch."""

    d_model: int = 128
    num_heads: int = 4
    seq_len: int = 64
    vocab_size: int = 128
    num_layers: int = 8
    microbatch_rows: int = 4


SMOKE_MODEL = Model(
    d_model=16, num_heads=2, seq_len=8, vocab_size=16, num_layers=8, microbatch_rows=1
)


@dataclass(frozen=True)
class Row:
    """Memory of one schedule at one m: compiled figures and the predictions, in bytes."""

    name: str
    m: int
    param_bytes: int  # this device's staged parameter row
    argument_bytes: int
    temp_bytes: int
    peak_units: float  # simulated peak activation memory, M_B units, largest device
    predicted_bytes: float  # peak_units x that device's stage activation_bytes
    ring_bytes: int  # the arenas the lowering allocates per device (residuals, kept, stash)
    slot_bytes: int  # what pools of equal slots would hold for the same layout
    ring_slots: int
    kept_slots: int
    stash_slots: int


def gpt_config(model: Model, num_stages: int) -> gpt.GPTConfig:
    """Returns the GPT config cut into ``num_stages`` cost-balanced stages."""
    cfg = gpt.GPTConfig(
        vocab_size=model.vocab_size,
        seq_len=model.seq_len,
        d_model=model.d_model,
        num_heads=model.num_heads,
        num_layers=model.num_layers,
    )
    return gpt.GPTConfig(
        **{**cfg.__dict__, "stage_boundaries": gpt.balanced_boundaries(cfg, num_stages)}
    )


def program_costs(programs: Sequence[StageProgram]) -> schedules.Costs:
    """Returns the stage programs' estimated F, B, W costs (what zb-auto schedules with)."""
    return schedules.Costs(
        tuple(p.cost_forward for p in programs),
        tuple(p.cost_backward_input for p in programs),
        tuple(p.cost_backward_weight for p in programs),
        0.0,
    )


def predicted_peak(
    schedule: schedules.Schedule, programs: Sequence[StageProgram]
) -> tuple[float, float]:
    """Returns (largest per-device peak in M_B units, the same in bytes) from the simulator.

    A device's M_B is the largest ``activation_bytes`` among its stages (of two stages on a
    device, the larger one's microbatches may be the ones in flight at the peak).
    """
    result = schedules.simulate(schedule, program_costs(programs))
    best_units, best_bytes = 0.0, 0.0
    for device, units in enumerate(result.peak_memory):
        unit = max(
            p.activation_bytes for s, p in enumerate(programs) if schedule.placement[s] == device
        )
        if units * unit >= best_bytes:
            best_units, best_bytes = units, units * unit
    return best_units, best_bytes


def measure(
    name: str,
    m: int,
    model: Model,
    mesh: jax.sharding.Mesh,
) -> Row:
    """Returns the compiled memory of ``name`` at ``m`` microbatches next to its predictions."""
    stages = 2 * NUM_DEVICES if name in TWO_STAGES_PER_DEVICE else NUM_DEVICES
    cfg = gpt_config(model, stages)
    params = gpt.init_params(jax.random.key(0), cfg)
    batch = gpt.make_batch(jax.random.key(1), cfg, m * model.microbatch_rows)
    microbatch = jax.tree.map(lambda x: x[: model.microbatch_rows], batch)
    loss_fn = gpt.make_loss_fn(cfg)
    graph = partition(loss_fn, params, microbatch)
    programs = split(graph)
    schedule = schedules.build(
        name, stages, m, num_devices=NUM_DEVICES, costs=program_costs(programs)
    )
    lowering = lower(graph, programs, schedule, mesh, AXIS)
    peak_units, peak_bytes = predicted_peak(schedule, programs)
    pipe = zbjax.pipeline(loss_fn, mesh=mesh, axis_name=AXIS, schedule=schedule, num_microbatches=m)
    staged = pipe.stage(params, batch)  # builds from the batch's shapes; nothing compiled
    analysis = pipe.lower(staged, batch).compile().memory_analysis()
    tables = lowering.tables
    return Row(
        name,
        m,
        lowering.layout.bytes_per_device(),
        int(analysis.argument_size_in_bytes),
        int(analysis.temp_size_in_bytes),
        peak_units,
        peak_bytes,
        lowering.slot_pool_bytes(),
        equal_slot_bytes(lowering),
        tables.num_residual_slots,
        tables.num_kept_slots,
        tables.num_stash_slots if lowering.slot_bytes()[2] else 0,  # none when overlaid
    )


def equal_slot_bytes(lowering: Lowering) -> int:
    """Returns the bytes the lowering held before its arenas, in pools of equal slots: per
    kind as many slots as the busiest device holds at once, each as large as the largest
    stage's item, the layout of ``SLOT_CANDIDATES`` with the fewest such bytes (overlaid only
    where that saves ``OVERLAY_MIN_SAVING``), as ``_slots_and_tables`` chose it then."""
    schedule, dtypes = lowering.schedule, lowering.slot_dtypes
    positions = choose_ticks(schedule, None)
    separate_w = any(a.kind == "W" for *_, a in schedule.all_actions())
    best: dict[bool, int] = {}
    for whole, overlay in zlower.SLOT_CANDIDATES:
        if overlay and not separate_w:
            continue
        layouts = [zlower.slot_layout(p, dtypes, whole, overlay) for p in lowering.programs]
        tables = tick_tables(
            schedule,
            zlower.message_edges(lowering.graph),
            kept=[s.has_kept for s in layouts],
            residuals_until_weight=[s.weight_reads_residuals for s in layouts],
            positions=positions,
        )
        capacities = zlower._capacities(layouts, tables)
        counts = (tables.num_residual_slots, tables.num_kept_slots, tables.num_stash_slots)
        size = sum(
            zlower._slot_bytes(dtypes, c) * n for c, n in zip(capacities[:3], counts, strict=True)
        )
        best[overlay] = min(size, best.get(overlay, size))
    plain, overlaid = best.get(False), best.get(True)
    if overlaid is not None and (
        plain is None or overlaid <= (1 - zlower.OVERLAY_MIN_SAVING) * plain
    ):
        return overlaid
    return plain if plain is not None else 0


def stage_sizes(model: Model, num_stages: int) -> str:
    """Returns one line per stage: parameter, M_B (activation) and M_W (stash) bytes."""
    cfg = gpt_config(model, num_stages)
    params = gpt.init_params(jax.random.key(0), cfg)
    microbatch = gpt.make_batch(jax.random.key(1), cfg, model.microbatch_rows)
    programs = split(partition(gpt.make_loss_fn(cfg), params, microbatch))
    return "; ".join(
        f"stage {i}: params {p.param_bytes / 1e3:.0f} kB, M_B {p.activation_bytes / 1e3:.0f} kB, "
        f"M_W {p.stash_bytes / 1e3:.0f} kB"
        for i, p in enumerate(programs)
    )


def _activation_bytes_both_ways(cfg: gpt.GPTConfig, model: Model, flag: str):
    """Returns each stage's ``activation_bytes`` with ``split_stage(**{flag: True})`` and with
    ``{flag: False}``."""
    params = gpt.init_params(jax.random.key(0), cfg)
    microbatch = gpt.make_batch(jax.random.key(1), cfg, model.microbatch_rows)
    graph = partition(gpt.make_loss_fn(cfg), params, microbatch)
    return (
        [split_stage(s, **{flag: value}).activation_bytes for s in graph.stages]
        for value in (True, False)
    )


def _percent_range(fractions: Sequence[float]) -> str:
    low, high = f"{min(fractions):.0%}", f"{max(fractions):.0%}"
    return low if low == high else f"{low}–{high}"


def _kbs(sizes: Sequence[int]) -> str:
    return " / ".join(f"{b / 1e3:.0f}" for b in sizes)


def mixed_precision_sizes(model: Model) -> str:
    """Returns a sentence on M_B per stage of the same GPT computing in bfloat16, with each
    weight's bfloat16 copy cast again in the backward (as zbjax does) and stored instead."""
    cfg = dataclasses.replace(gpt_config(model, NUM_DEVICES), dtype="bfloat16")
    recast, stored = _activation_bytes_both_ways(cfg, model, "recompute_parameter_casts")
    saved = [1 - a / b for a, b in zip(recast, stored, strict=True)]
    return (
        f'The same GPT computing in bfloat16 on float32 params (`GPTConfig(dtype="bfloat16")`), '
        f"{NUM_DEVICES} stages: M_B {_kbs(recast)} kB per "
        "stage, where F storing each weight's bfloat16 copy for B (as `jax.vjp` leaves it; "
        "`split_stage(recompute_parameter_casts=False)`) would take "
        f"{_kbs(stored)} kB: "
        f"{_percent_range(saved)} less, the backward casting the weights again instead."
    )


def mask_sizes(model: Model) -> str:
    """Returns a sentence on M_B per stage of the table's GPT with each block's causal mask
    computed again in the backward (as zbjax does) and stored instead."""
    recomputed, stored = _activation_bytes_both_ways(
        gpt_config(model, NUM_DEVICES), model, "recompute_constants"
    )
    return (
        f"Each block's causal mask (`jnp.tril` of ones, which `jnp.where` broadcasts over the "
        f"sequences and heads) is computed again in the backward from `iota`s: F storing it "
        "for B (as `jax.vjp` leaves it; `split_stage(recompute_constants=False)`) would make "
        f"M_B {_kbs(stored)} kB per stage instead of {_kbs(recomputed)} kB "
        f"({(stored[0] - recomputed[0]) / 1e3:.1f} kB more at stage 0, "
        f"{stored[0] / recomputed[0] - 1:.1%})."
    )


def table(rows: Sequence[Row]) -> str:
    """Returns the markdown table (kB per device)."""
    lines = [
        "| schedule | m | staged params (kB) | arguments (kB) | temp (kB) | predicted peak "
        "(M_B) | predicted activations (kB) | arenas (kB; in flight F→B + F→W + B→W) "
        "| as equal slots (kB) | temp − arenas (kB) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.name} | {r.m} | {r.param_bytes / 1e3:.0f} | {r.argument_bytes / 1e3:.0f} | "
            f"{r.temp_bytes / 1e3:.0f} | {r.peak_units:.3g} | {r.predicted_bytes / 1e3:.0f} | "
            f"{r.ring_bytes / 1e3:.0f} ({r.ring_slots} + {r.kept_slots} + {r.stash_slots}) | "
            f"{r.slot_bytes / 1e3:.0f} | {(r.temp_bytes - r.ring_bytes) / 1e3:.0f} |"
        )
    return "\n".join(lines)


def growth(rows: Sequence[Row]) -> str:
    """Returns, per schedule, how temp and the predicted peak grow from the smallest to the
    largest m measured."""
    parts = []
    for name in dict.fromkeys(r.name for r in rows):
        mine = sorted((r for r in rows if r.name == name), key=lambda r: r.m)
        if len(mine) < 2:
            continue
        first, last = mine[0], mine[-1]
        parts.append(
            f"{name} {(last.temp_bytes - first.temp_bytes) / 1e6:+.1f} MB temp "
            f"(predicted {(last.predicted_bytes - first.predicted_bytes) / 1e6:+.1f} MB, "
            f"arenas {first.ring_bytes / 1e6:.1f} → {last.ring_bytes / 1e6:.1f} MB)"
        )
    return "; ".join(parts)


def plot(rows: Sequence[Row], path: Path) -> Path:
    """Returns ``path`` after drawing temp bytes and predicted activation bytes against m."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name in dict.fromkeys(r.name for r in rows):
        mine = [r for r in rows if r.name == name]
        ms = [r.m for r in mine]
        axes[0].plot(ms, [r.temp_bytes / 1e6 for r in mine], marker="o", label=name)
        axes[1].plot(ms, [r.predicted_bytes / 1e6 for r in mine], marker="o", label=name)
    axes[0].set_title("compiled temp_size_in_bytes per device (MB)")
    axes[1].set_title("predicted peak activations per device (MB)")
    for ax in axes:
        ax.set_xlabel("microbatches m")
        ax.set_xscale("log", base=2)
    axes[0].legend(fontsize=8)
    return save_figure(fig, path)


def scan_params_per_device(model: Model) -> tuple[str, dict[int, int]]:
    """Returns a sentence on the staged params per device of the same GPT run by ``nn.scan``,
    and those bytes per pipeline size p.

    Each stage of the auto cut runs some of the scan's iterations and holds only those layers'
    rows of the stacked params (``Stage.param_rows``); the compiled step's arguments confirm it.
    """
    from models import gpt_scan

    cfg = dataclasses.replace(gpt_config(model, 1), stage_boundaries=())
    params = gpt_scan.init_params(jax.random.key(0), cfg)
    batch = gpt.make_batch(jax.random.key(1), cfg, 4 * model.microbatch_rows)
    total = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    parts, held_by_p = [], {}
    for p in (2, NUM_DEVICES):
        sub = jax.sharding.Mesh(np.array(jax.devices()[:p]), (AXIS,))
        pipe = zbjax.pipeline(
            gpt_scan.make_loss_fn(cfg),
            mesh=sub,
            axis_name=AXIS,
            schedule="zb-h1",
            num_microbatches=4,
        )
        staged = pipe.stage(params, batch)
        held = held_by_p[p] = pipe.lowering.layout.bytes_per_device()
        compiled = pipe.lower(staged, batch).compile().memory_analysis()
        batch_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(batch))
        parts.append(
            f"p = {p}: {held / 1e3:.0f} kB staged params per device "
            f"(compiled arguments {compiled.argument_size_in_bytes / 1e3:.0f} kB, of which "
            f"{batch_bytes / 1e3:.0f} kB batch)"
        )
    return (
        f"The same GPT with its {model.num_layers} blocks in one `nn.scan` "
        f"({total / 1e3:.0f} kB of params, auto cut, zb-h1, m = 4): " + "; ".join(parts) + ". "
        "Each stage holds only its own layers' rows of the stacked block params."
    ), held_by_p


def main(argv: Sequence[str] | None = None) -> int:
    """Returns 0 after compiling every schedule and m and writing the "memory" section."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--microbatches", type=int, nargs="+", default=[4, 8, 16])
    args = parser.parse_args(argv)
    jax.config.update("jax_num_cpu_devices", NUM_DEVICES)  # before any JAX computation
    began = time.perf_counter()
    model = Model()
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:NUM_DEVICES]), (AXIS,))
    rows, errors = [], []
    for name in SCHEDULE_NAMES:
        for m in args.microbatches:
            try:
                rows.append(measure(name, m, model, mesh))
            except ValueError as err:  # a schedule that cannot run at this m: say so
                errors.append(f"{name} m={m}: {err}")
                continue
            print(table(rows[-1:]).splitlines()[-1], flush=True)
    figure = plot(rows, FIGURES / "memory.png")
    body = [
        "## Memory per device: compiled memory analysis versus the schedule's peak",
        "",
        f"Made by `{COMMAND} --microbatches {' '.join(map(str, args.microbatches))}` "
        f"(jax {jax.__version__}, {NUM_DEVICES} fake CPU devices). Every number is read from "
        "`pipe.lower(staged_params, batch).compile().memory_analysis()` (one SPMD program, so "
        "the figures are per device) or computed from the schedule; nothing is typed in.",
        f"Model: GPT (linen, tied head), d_model {model.d_model}, {model.num_layers} blocks, "
        f"seq {model.seq_len}, vocab {model.vocab_size}, {model.microbatch_rows} sequences per "
        f"microbatch, cut into {NUM_DEVICES} cost-balanced stages "
        f"({2 * NUM_DEVICES} for {' and '.join(TWO_STAGES_PER_DEVICE)}).",
        f"4 stages: {stage_sizes(model, NUM_DEVICES)}.",
        f"8 stages: {stage_sizes(model, 2 * NUM_DEVICES)}.",
        "",
        "Columns: *staged params* = this device's row of the staged parameter layout; "
        "*arguments* = `argument_size_in_bytes` (staged params plus the whole batch, which "
        "every device receives); *temp* = `temp_size_in_bytes` (arenas, messages, "
        "gradient accumulators, the stage programs' scratch); *predicted peak* = "
        "`max(simulate(schedule).peak_memory)` in M_B (F adds 1, B frees 1 − w_mem, W frees "
        "w_mem = 0.5); *predicted activations* = that times the device's stage "
        "`activation_bytes`; *arenas* = the buffers the lowering keeps data in between "
        "actions (`Lowering.slot_pool_bytes`, `zbjax.ticks.arenas`): each (stage, microbatch) "
        "stores what F stores for B alone from F until B, what F stores that W reads too (the "
        "inputs of the weight matmuls) from F until W, and what B computes for W from B until "
        "W, each at its own stage's size and packed with the items alive at the same time "
        "(first fit over the lockstep ticks), in one buffer shared by the three or one each, "
        "whichever holds fewer bytes (shared only where that saves at least 10 %, since B then "
        "writes where it reads); in brackets the most items of each kind any device holds at "
        "once. Where that holds fewer bytes, a stage keeps its whole residuals until W instead "
        "of keeping W's apart, and B writes W's stash over the residuals only B read. *As equal "
        "slots* is what the lowering held before its arenas: pools of equal slots, per kind as "
        "many as the busiest device holds at once and each as large as the largest stage's "
        "item, laid out as it chose then (`equal_slot_bytes`; the same items, the slots' "
        "layout).",
        "",
        table(rows),
        "",
        f"From m = {min(args.microbatches)} to m = {max(args.microbatches)}: {growth(rows)}.",
        "",
        scan_params_per_device(model)[0],
        "",
        mixed_precision_sizes(model),
        "",
        mask_sizes(model),
        "",
        "The arenas can hold more than the predicted peak in M_B for three reasons: every "
        "device's arena is as large as the busiest device's, what W keeps is not exactly the "
        "simulator's w_mem = 0.5 M_B, and the lockstep tick loop can keep more microbatches in "
        "flight than the event-driven simulation. *temp − arenas* is what the compiled program "
        "holds besides them (messages, gradient accumulators, batch slices, scratch).",
        "",
    ]
    if errors:
        body += ["Not measured:", ""] + [f"- {e}" for e in errors] + [""]
    body += [
        f"Figure: [memory.png](figures/{figure.name}).",
        f"Machine load at the end: `{machine_load()}`. Took {time.perf_counter() - began:.0f} s.",
    ]
    path = write_section("memory", "\n".join(body))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
