"""Does building a pipeline stay quick as the model gets deeper? Build time against depth.

``pipe.lower(params, batch)`` traces the loss, cuts it into stages, differentiates and splits
every stage (``zbjax.split``), schedules and lowers the step. Differentiating is the largest
part, and it grows with the layers. Stages that are one program written twice (``alike``: the
middle stages of a stack of identical blocks, cut at block boundaries) are split once; this
times both ways in one process, alternating: every stage split (``split_stage`` per stage)
and alike stages split once (``zbjax.split.split``, what a pipeline does).
Model: the reference GPT (d_model 256, seq 64, 4 heads) at several depths, cut by the cost
model into 8 stages on 8 fake CPU devices, 1f1b, 8 microbatches. Writes the section
"build_time" of ``benchmarks/RESULTS.md``.

Run: ``python benchmarks/build_time.py [--repeats N] [--layers 8 16 32 48]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import jax
import numpy as np

import zbjax
from zbjax.split import split, split_stage

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _results import machine_load, write_section

from models import gpt

COMMAND = "python benchmarks/build_time.py"
AXIS = "pp"
SCHEDULE = "1f1b"
DEVICES = 8
MICROBATCHES = 8
LAYERS = (8, 16, 32, 48)
SIZES = dict(vocab_size=256, seq_len=64, d_model=256, num_heads=4)
#: A tiny GPT for the smoke test.
SMOKE_SIZES = dict(vocab_size=16, seq_len=8, d_model=16, num_heads=2)
#: The pipeline module, whose ``split`` a variant replaces while it builds.
_PIPELINE = sys.modules["zbjax.pipeline"]


def split_every_stage(graph):
    """Splits every stage on its own, alike or not (the build before alike stages were shared)."""
    return tuple(split_stage(stage) for stage in graph.stages)


VARIANTS: dict[str, Callable] = {
    "every stage split": split_every_stage,
    "alike stages split once": split,
}


@dataclass(frozen=True)
class Build:
    """One fresh pipeline's ``pipe.lower`` time, the part of it spent splitting, and how many
    distinct programs the stages got."""

    variant: str
    layers: int
    lower_s: float
    split_s: float
    stages: int
    programs_split: int


def build_once(variant: str, layers: int, sizes: dict) -> Build:
    """Returns the timing of ``pipe.lower`` for a fresh pipeline built the ``variant`` way."""
    cfg = gpt.GPTConfig(num_layers=layers, **sizes)
    params = jax.eval_shape(lambda k: gpt.init_params(k, cfg), jax.random.key(0))
    rows = MICROBATCHES * 2
    batch = jax.eval_shape(lambda k: gpt.make_batch(k, cfg, rows), jax.random.key(1))
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:DEVICES]), (AXIS,))
    pipe = zbjax.pipeline(
        gpt.make_loss_fn(cfg),
        mesh=mesh,
        axis_name=AXIS,
        schedule=SCHEDULE,
        num_microbatches=MICROBATCHES,
    )
    spent: list[float] = []
    programs: list = []

    def timed(graph):
        began = time.perf_counter()
        out = VARIANTS[variant](graph)
        spent.append(time.perf_counter() - began)
        programs.extend(out)
        return out

    original = _PIPELINE.split
    _PIPELINE.split = timed
    try:
        began = time.perf_counter()
        pipe.lower(params, batch)
        lower_s = time.perf_counter() - began
    finally:
        _PIPELINE.split = original
    # Programs given to an alike stage share the first one's equations.
    distinct = {id(p.forward.jaxpr.eqns[0]) if p.forward.jaxpr.eqns else id(p) for p in programs}
    return Build(variant, layers, lower_s, spent[0], len(programs), len(distinct))


def measure(layers: Sequence[int], repeats: int, sizes: dict) -> list[Build]:
    """Returns every build, the variants alternating in order from repeat to repeat."""
    builds = []
    names = list(VARIANTS)
    for r in range(repeats):
        for n in layers:
            for variant in names if r % 2 == 0 else names[::-1]:
                b = build_once(variant, n, sizes)
                builds.append(b)
                print(
                    f"{n} layers, {variant}: lower {b.lower_s:.2f} s (split {b.split_s:.2f} s, "
                    f"{b.programs_split} of {b.stages} stages split)",
                    flush=True,
                )
    return builds


def table(builds: Sequence[Build], layers: Sequence[int]) -> str:
    """Returns the markdown table: one row per depth, medians over repeats."""
    every, once = VARIANTS
    lines = [
        "| layers | stages split (of 8) | `pipe.lower`, every stage split (s) | "
        "`pipe.lower`, alike stages split once (s) | once / every | split, every (s) | "
        "split, once (s) |",
        "|---|---|---|---|---|---|---|",
    ]
    for n in layers:
        mine = {v: [b for b in builds if b.layers == n and b.variant == v] for v in VARIANTS}
        lower = {v: statistics.median(b.lower_s for b in mine[v]) for v in VARIANTS}
        splits = {v: statistics.median(b.split_s for b in mine[v]) for v in VARIANTS}
        lines.append(
            f"| {n} | {mine[once][0].programs_split} | {lower[every]:.2f} | {lower[once]:.2f} | "
            f"{lower[once] / lower[every]:.2f} | {splits[every]:.2f} | {splits[once]:.2f} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Returns 0 after timing both ways of building at every depth and writing the section."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="builds per depth and variant")
    parser.add_argument("--layers", type=int, nargs="+", default=list(LAYERS))
    args = parser.parse_args(argv)
    jax.config.update("jax_num_cpu_devices", DEVICES)  # before any computation
    began = time.perf_counter()
    load_before = machine_load()
    builds = measure(args.layers, args.repeats, SIZES)
    body = "\n".join(
        [
            "## Building a pipeline: alike stages split once",
            "",
            f"Made by `{COMMAND} --repeats {args.repeats} --layers "
            f"{' '.join(map(str, args.layers))}` "
            f"(jax {jax.__version__}, {os.cpu_count()} CPU cores, {DEVICES} fake devices). "
            f"Time of `pipe.lower(params, batch)` for a fresh `zbjax.pipeline(..., "
            f"schedule={SCHEDULE!r}, num_microbatches={MICROBATCHES})` of the reference GPT "
            f"(d_model {SIZES['d_model']}, seq {SIZES['seq_len']}, {SIZES['num_heads']} "
            f"heads), cut by the cost model into {DEVICES} stages: trace, partition, split, "
            "schedule, lower to StableHLO (no compile). *Every stage split* differentiates "
            "and splits each stage on its own; *alike stages split once* is `zbjax.split.split`, "
            "which splits the first of the stages that are one program (`zbjax.split.alike`) "
            "and gives the others its programs; *stages split* counts the programs it split. "
            "*Split* is the part of `pipe.lower` spent in the split. The two alternate within "
            f"each repeat (order reversed every other one); medians over {args.repeats}.",
            "",
            table(builds, args.layers),
            "",
            f"Machine load before: `{load_before}`; after: `{machine_load()}`.",
            f"Took {time.perf_counter() - began:.0f} s.",
        ]
    )
    path = write_section("build_time", body)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
