"""What does a user's jitted train step pay for its arenas, and what do donated buffers save?

The README's train step puts ``pipe.value_and_grad`` and the optimizer's update under one
``jax.jit``. There the pipeline cannot keep its residual and stash arenas between calls
(``keep_buffers`` applies to calls outside a ``jit``), so every step allocates and, on XLA:CPU,
zeroes them. ``pipe.init_buffers`` makes the pools once and ``value_and_grad(...,
buffers=)`` runs the step in them; the user's ``jit`` donates them and returns them. Three
variants of one step alternate round by round, per model:

- *jit, pools allocated in the step*: ``jax.jit`` of value_and_grad + ``optax.adamw``;
- *jit, buffers donated*: the same with ``buffers=`` donated (the README's train step);
- *value_and_grad outside jit*: ``pipe.value_and_grad`` called eagerly (its pools kept
  between calls, ``keep_buffers``), then the update jitted apart.

Models: ``step_time``'s MLP (2 devices) and the demo's GPT (8 devices, its defaults).
Writes the section "buffers" of ``benchmarks/RESULTS.md``.
Run: ``python benchmarks/buffers.py [--rounds N]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _results import machine_load, write_section
from step_time import Setup, alternate, median_ratio, mlp_config, ratio_quartiles

import zbjax
from models import gpt, mlp
from zbjax.data import CharTokenizer
from zbjax.demo import DemoConfig

COMMAND = "python benchmarks/buffers.py"
NUM_DEVICES = 8
ALLOCATED = "jit, pools allocated in the step"
DONATED = "jit, buffers donated"
EAGER = "value_and_grad outside jit (keep_buffers), update jitted"
VARIANTS = (ALLOCATED, DONATED, EAGER)


@dataclass(frozen=True)
class Case:
    """One model pipelined: its loss, params, batch, mesh size, schedule, microbatches."""

    label: str
    loss_fn: Callable[..., Any]
    params: Any
    batch: Any
    devices: int
    schedule: str
    microbatches: int


def cases(small: bool = False) -> list[Case]:
    """Returns the MLP of ``step_time`` (2 devices, zb-h2, m = 4) and the demo's GPT (8 devices,
    zb-h1, m = 8, the demo's default sizes); ``small``: toy sizes for the smoke test."""
    setup = Setup(width=8, layers_per_stage=2, microbatch_rows=4) if small else Setup()
    mcfg = mlp_config(setup, 2)
    m = 4
    mlp_case = Case(
        f"step_time MLP: 2 devices, {mcfg.depth} x Dense({setup.width}), "
        f"{setup.microbatch_rows} rows per microbatch, zb-h2, m = {m}",
        mlp.make_loss_fn(mcfg),
        mlp.init_params(jax.random.key(0), mcfg),
        mlp.make_batch(jax.random.key(1), mcfg, m * setup.microbatch_rows),
        2,
        "zb-h2",
        m,
    )
    demo = DemoConfig()
    devices = 2 if small else NUM_DEVICES
    layers, width, seq, batch = (
        (2, 8, 8, 8) if small else (demo.layers, demo.width, demo.seq_len, demo.batch_size)
    )
    base = gpt.GPTConfig(
        vocab_size=CharTokenizer().vocab_size,
        seq_len=seq,
        d_model=width,
        num_heads=2 if small else demo.heads,
        num_layers=layers,
    )
    gcfg = dataclasses.replace(base, stage_boundaries=gpt.balanced_boundaries(base, devices))
    micro = 2 if small else demo.microbatches
    gpt_case = Case(
        f"demo GPT: {devices} devices, {layers} blocks of d {width}, seq {seq}, "
        f"batch {batch}, {demo.schedule}, m = {micro}",
        gpt.make_loss_fn(gcfg),
        gpt.init_params(jax.random.key(0), gcfg),
        gpt.make_batch(jax.random.key(1), gcfg, batch),
        devices,
        demo.schedule,
        micro,
    )
    return [mlp_case, gpt_case]


@dataclass(frozen=True)
class Row:
    """One case's measurement: step times per variant, pool and temp bytes per device."""

    label: str
    times: dict[str, list[float]]
    pool_bytes: int
    temp_allocated: int
    temp_donated: int
    alias_donated: int


def measure(case: Case, rounds: int) -> Row:
    """Returns the case's three variants timed in alternating rounds, with the compiled
    per-device temp memory of the two jitted ones."""
    import optax

    mesh = jax.make_mesh((case.devices,), ("pp",), devices=jax.devices()[: case.devices])
    pipe = zbjax.pipeline(
        case.loss_fn,
        mesh=mesh,
        schedule=case.schedule,
        num_microbatches=case.microbatches,
    )
    batch = case.batch
    staged = pipe.stage(case.params, batch)
    opt = optax.adamw(1e-4)
    state = opt.init(staged)

    def update(grads, state, staged):
        updates, state = opt.update(grads, state, staged)
        return optax.apply_updates(staged, updates), state

    @jax.jit
    def allocated(staged, state, batch):
        loss, grads = pipe.value_and_grad(staged, batch)
        return (*update(grads, state, staged), loss)

    @functools.partial(jax.jit, donate_argnums=3)
    def donated(staged, state, batch, buffers):
        loss, grads, buffers = pipe.value_and_grad(staged, batch, buffers=buffers)
        return (*update(grads, state, staged), loss, buffers)

    jitted_update = jax.jit(update)
    held = [pipe.init_buffers(staged, batch)]

    def run_donated():
        *out, held[0] = donated(staged, state, batch, held[0])
        return out

    def run_eager():
        loss, grads = pipe.value_and_grad(staged, batch)
        return (*jitted_update(grads, state, staged), loss)

    variants = {
        ALLOCATED: lambda: allocated(staged, state, batch),
        DONATED: run_donated,
        EAGER: run_eager,
    }
    losses = {name: float(fn()[-1]) for name, fn in variants.items()}
    if len(set(losses.values())) != 1:
        raise AssertionError(f"the variants' losses differ: {losses}")
    times = alternate(variants, rounds)
    mem_allocated = allocated.lower(staged, state, batch).compile().memory_analysis()
    mem_donated = donated.lower(staged, state, batch, held[0]).compile().memory_analysis()
    return Row(
        case.label,
        times,
        pipe.lowering.slot_pool_bytes(),
        mem_allocated.temp_size_in_bytes,
        mem_donated.temp_size_in_bytes,
        mem_donated.alias_size_in_bytes,
    )


def table(rows: Sequence[Row]) -> str:
    """Returns the markdown table: one line per (case, variant)."""
    lines = [
        "| model | variant | step (ms) | / pools allocated | rounds' middle half | "
        "compiled temp per device (MB) | donated per device (MB) |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        for name in VARIANTS:
            q1, q3 = ratio_quartiles(row.times, name, ALLOCATED)
            temp = {ALLOCATED: row.temp_allocated, DONATED: row.temp_donated}.get(name)
            lines.append(
                f"| {row.label} | {name} | {statistics.median(row.times[name]) * 1e3:.1f} | "
                f"{median_ratio(row.times, name, ALLOCATED):.3f} | {q1:.3f}–{q3:.3f} | "
                f"{'–' if temp is None else f'{temp / 1e6:.1f}'} | "
                f"{f'{row.alias_donated / 1e6:.1f}' if name == DONATED else '–'} |"
            )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Returns 0 after timing every case and writing the "buffers" section."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=21, help="timed rounds per case")
    args = parser.parse_args(argv)
    jax.config.update("jax_num_cpu_devices", NUM_DEVICES)  # before any JAX computation
    began = time.perf_counter()
    load_before = machine_load()
    rows = [measure(case, args.rounds) for case in cases()]
    load_after = machine_load()
    pools = "; ".join(f"{r.label.split(':')[0]} {r.pool_bytes / 1e6:.1f} MB" for r in rows)
    body = "\n".join(
        [
            "## Slot pools in a user's jitted train step: allocated per step versus donated",
            "",
            f"Made by `{COMMAND} --rounds {args.rounds}` ({jax.devices()[0].device_kind}, "
            f"{os.cpu_count()} cores, `jax_num_cpu_devices={NUM_DEVICES}`, "
            f"jax {jax.__version__}).",
            "One training step (pipelined value_and_grad, then `optax.adamw`) three ways, "
            f"alternating round by round ({args.rounds} rounds after warm-up; step is the "
            "median, the ratio the median over rounds of the ratio within a round): "
            f"*{ALLOCATED}* is `jax.jit` of the whole step, in which the pipeline allocates its "
            "residual and stash arenas and XLA:CPU zeroes them; "
            f"*{DONATED}* passes `pipe.init_buffers(...)` as `value_and_grad(..., buffers=)` "
            "and donates them (`donate_argnums`), as the README's train step does; "
            f"*{EAGER}* calls `pipe.value_and_grad` outside any `jit`, where the pipeline "
            "keeps its pools between calls itself (`keep_buffers`). All three give the same "
            "loss. Compiled memory per device from `memory_analysis()`: *temp* is what the "
            "program allocates, *donated* the bytes of outputs written into donated inputs.",
            f"Arenas per device: {pools}.",
            "",
            table(rows),
            "",
            f"Machine load before: `{load_before}`; after: `{load_after}`.",
            f"Took {time.perf_counter() - began:.0f} s.",
        ]
    )
    print(write_section("buffers", body))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
