"""Why does W read its stash apart on XLA:CPU? A slot read fused into a transpose, timed.

A weight gradient's matmul as JAX traces it (x^T @ dy, contracting (batch, seq) together)
makes XLA:CPU transpose one of its operands, usually the output cotangent dy that B wrote into
a stash slot for W. Where dy is read from a slot (a dynamic slice of the pool) or has any
other work on it, XLA fuses that into the transpose and emits the fusion as an untiled strided
loop; a transpose of a whole buffer gets its tiled emitter. So the lowering reads the values B
wrote inside a conditional on CPU (``zbjax.lower.read_apart``), which XLA cannot fuse through.
Since the split merges such contracting dimensions into one
(``zbjax._jax_compat.merge_contracting_dims``), W's matmuls transpose nothing; the W rows
below say what reading apart still changes.

This script times, pinned to one core as one pipeline device runs: (1) a transpose of a dy of
the GPT stage's shape, whole, read from a slot, and read apart first; (2) W of the
``bw_split`` reference stages looped as the pipeline runs it (``zbjax.profile.looped``) with
and without reading apart, against the fused backward BW. Variants alternate round by round;
times are medians, ratios the median over rounds. Writes the section "stash_reads" of
``benchmarks/RESULTS.md``.

Run: ``python benchmarks/stash_reads.py [--repeats N]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend.core import jaxpr_as_fun

from zbjax.lower import read_apart
from zbjax.profile import LOOP_RUNS, looped

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bw_split
from _results import machine_load, pin_to_one_core, write_section

COMMAND = "python benchmarks/stash_reads.py"
#: dy of a GPT block's MLP up-projection in ``bw_split``'s stages: batch 8, seq 128, 4 x 256.
DY_SHAPE = (8, 128, 1024)


def alternate(calls: dict[str, Callable[[], Any]], repeats: int) -> dict[str, list[float]]:
    """Returns each call's seconds per round, the calls run in turn in every round (the
    order rotating), after two warm-up rounds."""
    names = list(calls)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(repeats + 2):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            began = time.perf_counter()
            jax.block_until_ready(calls[name]())
            if r >= 2:
                times[name].append(time.perf_counter() - began)
    return times


def transpose_calls(shape: Sequence[int]) -> dict[str, Callable[[], Any]]:
    """Returns the transposes to time: of a whole buffer, of a slot read, of a slot read
    apart, and the read apart alone."""
    dy = jax.random.normal(jax.random.key(0), tuple(shape))
    pool = jnp.stack([dy, dy])
    slot = jnp.int32(1)
    rows = shape[0] * shape[1]

    def transpose(x):
        return jnp.transpose(x, (2, 0, 1)).reshape(shape[2], rows)

    def read(pool, i):
        return jax.lax.dynamic_index_in_dim(pool, i, keepdims=False)

    whole = jax.jit(transpose)
    fused = jax.jit(lambda p, i: transpose(read(p, i)))
    apart = jax.jit(lambda p, i: transpose(read_apart(lambda: read(p, i), i)))
    copy = jax.jit(lambda p, i: read_apart(lambda: read(p, i), i))
    return {
        "transpose of a whole buffer": lambda: whole(dy),
        "transpose of a slot read (fused)": lambda: fused(pool, slot),
        "slot read apart, then transpose": lambda: apart(pool, slot),
        "slot read apart alone": lambda: copy(pool, slot),
    }


def weight_calls(case: bw_split.Case) -> dict[str, Callable[[], Any]]:
    """Returns ``case``'s W looped as the pipeline runs it, reading B's values fused and
    apart, its B, and its fused backward BW."""
    p = bw_split.prepare(case)
    plain_w = p.backward_weight.fn
    fused = looped(plain_w)
    apart = looped(plain_w, apart=(1,))
    backward = looped(jaxpr_as_fun(p.program.backward))
    return {
        "B": lambda: p.backward_input(*p.args),
        "W, reads fused": lambda: fused(p.residuals, p.new),
        "W, reads apart": lambda: apart(p.residuals, p.new),
        "BW": lambda: backward(*p.args),
    }


def median_ms(times: list[float], per: int = 1) -> float:
    return 1e3 * statistics.median(times) / per


def median_ratio(a: list[float], b: list[float]) -> float:
    return statistics.median(x / y for x, y in zip(a, b, strict=True))


def transpose_table(shape: Sequence[int], times: dict[str, list[float]]) -> str:
    base = times["transpose of a whole buffer"]
    lines = [
        f"| {shape} float32 | ms | / transpose of a whole buffer |",
        "|---|---|---|",
    ]
    lines += [
        f"| {name} | {median_ms(t):.2f} | {median_ratio(t, base):.2f} |"
        for name, t in times.items()
    ]
    return "\n".join(lines)


def weight_row(label: str, times: dict[str, list[float]]) -> str:
    ms = {name: median_ms(t, LOOP_RUNS) for name, t in times.items()}
    b, bw = times["B"], times["BW"]

    def split_ratio(w: list[float]) -> float:
        return median_ratio([x + y for x, y in zip(b, w, strict=True)], bw)

    return (
        f"| {label} | {ms['B']:.2f} | {ms['W, reads fused']:.2f} | {ms['W, reads apart']:.2f} "
        f"| {ms['BW']:.2f} | "
        f"{median_ratio(times['W, reads apart'], times['W, reads fused']):.3f} | "
        f"{split_ratio(times['W, reads fused']):.3f} | {split_ratio(times['W, reads apart']):.3f} |"
    )


def measure(
    sizes: bw_split.Sizes, shape: Sequence[int], repeats: int
) -> tuple[dict[str, list[float]], list[tuple[str, dict[str, list[float]]]]]:
    """Returns the transpose times and, per ``bw_split`` case but the first GPT stage (whose
    B computes nothing and writes W nothing), the W times."""
    transposes = alternate(transpose_calls(shape), repeats)
    weights = [
        (case.label, alternate(weight_calls(case), repeats))
        for case in bw_split.reference_cases(sizes)
        if "first" not in case.label
    ]
    return transposes, weights


def main(argv: Sequence[str] | None = None) -> int:
    """Returns 0 after timing on one core and writing the "stash_reads" section."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=21, help="timed rounds")
    args = parser.parse_args(argv)
    pin_to_one_core()
    began = time.perf_counter()
    load_before = machine_load()
    transposes, weights = measure(bw_split.Sizes(), DY_SHAPE, args.repeats)
    load_after = machine_load()
    rows = [weight_row(label, times) for label, times in weights]
    body = "\n".join(
        [
            "## W's stash reads on XLA:CPU: fused into the transpose versus read apart",
            "",
            f"Made by `{COMMAND} --repeats {args.repeats}`, pinned to one core "
            f"({jax.devices()[0].device_kind}, jax {jax.__version__}). Variants alternate "
            f"round by round, {args.repeats} rounds after warm-up; times are medians, ratios "
            "the median over rounds.",
            "",
            "JAX's weight gradient of a Dense layer over (batch, seq) contracts two "
            "dimensions, and for it XLA:CPU transposes the output cotangent dy. Read from a "
            "slot (a dynamic slice of the pool), the read is fused into the transpose and XLA "
            "emits an untiled strided loop; a whole buffer's transpose is tiled. *Read apart* "
            "reads inside a conditional first (`zbjax.lower.read_apart`), as the lowering "
            "reads W's stash on CPU:",
            "",
            transpose_table(DY_SHAPE, transposes),
            "",
            "W of the `bw_split` reference stages, looped as the pipeline runs it "
            "(`zbjax.profile.looped`, ms per run), reading what B wrote fused or apart; "
            "*split / BW* is the median over rounds of (B + W) / BW. zbjax's programs "
            "contract those dimensions merged into one "
            "(`zbjax._jax_compat.merge_contracting_dims`), so their weight gradients need no "
            "transpose of dy, read apart or not; reading apart is kept on CPU, where it still "
            "measures no slower:",
            "",
            "| stage | B (ms) | W, reads fused (ms) | W, reads apart (ms) | BW (ms) | "
            "apart / fused | split / BW, fused | split / BW, apart |",
            "|---|---|---|---|---|---|---|---|",
            *rows,
            "",
            f"Machine load before: `{load_before}`; after: `{load_after}`.",
            f"Took {time.perf_counter() - began:.0f} s.",
        ]
    )
    print(write_section("stash_reads", body))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
