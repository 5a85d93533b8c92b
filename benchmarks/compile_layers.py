"""Compile time against depth: the pipelined step and ``per_leaf`` beside their unpipelined twins.

An MLP of L ``tanh(Dense(16))`` layers, cut into 4 stages by markers, 1f1b with 4 microbatches
on 4 fake CPU devices. For each L the script times ``jax.jit(...).lower(...).compile()`` of

- the pipelined step, ``pipe.value_and_grad(staged, batch)``, and the unpipelined
  ``jax.value_and_grad(loss_fn)(params, batch)``;
- ``pipe.per_leaf(optax.adamw(mask=...)).update`` on the staged rows, and the same optax
  update on the user's tree;

and counts the kernels (fused computations) of the compiled step and how many distinct ones
there are, with and without their constants: XLA:CPU compiles a kernel once however often it
appears, and a pipelined layer reads its params at its own offsets in the staged rows.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import jax

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import machine_load, write_section  # noqa: E402

COMMAND = "python benchmarks/compile_layers.py"
LAYERS = (8, 32, 128)
WIDTH = 16
STAGES = 4
MICROBATCHES = 4


@dataclass(frozen=True)
class Row:
    layers: int
    pipelined_s: float
    unpipelined_s: float
    per_leaf_s: float
    optax_s: float
    kernels: int
    distinct: int
    distinct_but_constants: int


def mlp_case(layers: int):
    """Returns (loss_fn, params, batch): ``layers`` tanh layers, markers between 4 stages."""
    import jax.numpy as jnp

    import zbjax

    cuts = {layers * s // STAGES - 1 for s in range(1, STAGES)}

    def loss_fn(p, batch):
        x = batch["x"]
        for i in range(layers):
            x = jnp.tanh(x @ p[f"w{i}"] + p[f"b{i}"])
            if i in cuts:
                x = zbjax.stage_boundary(x)
        return jnp.mean(x**2)

    keys = jax.random.split(jax.random.key(0), layers + 1)
    params = {f"w{i}": 0.3 * jax.random.normal(keys[i], (WIDTH, WIDTH)) for i in range(layers)}
    params |= {f"b{i}": jnp.zeros(WIDTH) for i in range(layers)}
    return loss_fn, params, {"x": jax.random.normal(keys[-1], (8, WIDTH))}


def compile_seconds(fn, *args) -> tuple[float, object]:
    start = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile()
    return time.perf_counter() - start, compiled


def kernel_counts(hlo: str) -> tuple[int, int, int]:
    """Returns the fused computations of an optimized HLO module, the distinct ones (names
    and metadata dropped) and the distinct ones once constants and slice bounds are too."""
    bodies = [c for c in hlo.split("\n\n") if c.startswith("%fused_computation")]

    def body(text: str, constants: bool) -> str:
        lines = [line.split(", metadata")[0] for line in text.split("\n")[1:]]
        out = re.sub(r"%[\w.\-]+", "%", "\n".join(lines))
        if not constants:
            out = re.sub(r"constant\([^)]*\)", "constant(C)", out)
            out = re.sub(r"slice=\{[^}]*\}", "slice={S}", out)
        return out

    exact = {body(b, True) for b in bodies}
    loose = {body(b, False) for b in bodies}
    return len(bodies), len(exact), len(loose)


def measure_once(layers: int) -> Row:
    import optax

    import zbjax

    loss_fn, params, batch = mlp_case(layers)
    mesh = jax.make_mesh((STAGES,), ("pp",), devices=jax.devices()[:STAGES])
    pipe = zbjax.pipeline(
        loss_fn, mesh=mesh, axis_name="pp", schedule="1f1b", num_microbatches=MICROBATCHES
    )
    staged = pipe.stage(params, batch)
    pipelined, compiled = compile_seconds(lambda s, b: pipe.value_and_grad(s, b), staged, batch)
    kernels = kernel_counts(compiled.as_text())
    unpipelined, _ = compile_seconds(jax.value_and_grad(loss_fn), params, batch)

    def make():
        return optax.adamw(1e-3, mask=jax.tree.map(lambda x: x.ndim == 2, params))

    tx = pipe.per_leaf(make())
    with jax.set_mesh(mesh):
        state = jax.jit(tx.init)(staged)
        per_leaf, _ = compile_seconds(tx.update, staged, state, staged)
    ref = make()
    on_tree, _ = compile_seconds(ref.update, params, ref.init(params), params)
    return Row(layers, pipelined, unpipelined, per_leaf, on_tree, *kernels)


def slices_against_arrays(count: int = 64, size: int = 256) -> tuple[float, float]:
    """Returns the compile seconds of ``count`` kernels ``2 * x`` over separate arrays, and of
    the same kernels over slices of one array (each then distinct by its offset)."""
    import jax.numpy as jnp

    arrays = [jnp.ones(size) for _ in range(count)]
    row = jnp.ones(count * size)
    separate, _ = compile_seconds(lambda xs: [2.0 * x for x in xs], arrays)
    sliced, _ = compile_seconds(
        lambda r: [2.0 * r[i * size : (i + 1) * size] for i in range(count)], row
    )
    return separate, sliced


def measure(layers: Sequence[int], repeats: int) -> list[Row]:
    rows = []
    for count in layers:
        runs = [measure_once(count) for _ in range(repeats)]

        def median(field: str, runs=runs) -> float:
            return statistics.median(getattr(r, field) for r in runs)

        rows.append(
            Row(
                count,
                median("pipelined_s"),
                median("unpipelined_s"),
                median("per_leaf_s"),
                median("optax_s"),
                *(getattr(runs[0], f) for f in ("kernels", "distinct", "distinct_but_constants")),
            )
        )
    return rows


def table(rows: Sequence[Row]) -> str:
    lines = [
        "| layers | pipelined step (s) | unpipelined (s) | ratio | per_leaf adamw (s) | "
        "optax on the tree (s) | ratio | kernels: all / distinct / distinct but constants |",
        "|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.layers} | {r.pipelined_s:.2f} | {r.unpipelined_s:.2f} | "
            f"{r.pipelined_s / r.unpipelined_s:.1f}x | {r.per_leaf_s:.2f} | {r.optax_s:.2f} | "
            f"{r.per_leaf_s / r.optax_s:.1f}x | {r.kernels} / {r.distinct} / "
            f"{r.distinct_but_constants} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Returns 0 after timing every depth and writing the "compile_layers" section."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=list(LAYERS))
    parser.add_argument("--repeats", type=int, default=1, help="compiles per depth (median)")
    args = parser.parse_args(argv)
    jax.config.update("jax_num_cpu_devices", 8)  # before any computation
    jax.config.update("jax_cpu_enable_async_dispatch", False)
    began = time.perf_counter()
    load_before = machine_load()
    rows = measure(args.layers, args.repeats)
    pairs = [slices_against_arrays() for _ in range(args.repeats)]
    separate = statistics.median(p[0] for p in pairs)
    sliced = statistics.median(p[1] for p in pairs)
    layers = " ".join(str(n) for n in args.layers)
    body = "\n".join(
        [
            "## Compile time against depth, pipelined and not",
            "",
            f"Made by `{COMMAND} --layers {layers} --repeats {args.repeats}` (jax "
            f"{jax.__version__}, fake CPU devices; medians over repeats). MLP of L "
            f"tanh(Dense({WIDTH})) layers, markers cutting it into {STAGES} stages, 1f1b, "
            f"m = {MICROBATCHES}, {STAGES} devices; each time is `jax.jit(f).lower(...)"
            ".compile()` of a fresh function. Kernels: the compiled step's fused computations; "
            "XLA:CPU generates code once per distinct one, and the layers' kernels differ by "
            "the offsets at which each reads its params from the staged rows.",
            "",
            table(rows),
            "",
            f"64 kernels `2 * x` of 256 elements compile in {separate:.2f} s over 64 separate "
            f"arrays (alike kernels) and in {sliced:.2f} s over 64 slices of one array (each "
            "kernel distinct by its slice's offset).",
            "",
            f"Machine load before: `{load_before}`; after: `{machine_load()}`.",
            f"Took {time.perf_counter() - began:.0f} s.",
        ]
    )
    path = write_section("compile_layers", body)
    print(body)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
