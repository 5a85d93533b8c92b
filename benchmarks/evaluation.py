"""What does ``pipe.value`` (forwards only) save next to ``value_and_grad``'s loss?

The demo's GPT (8 blocks, d 64) pipelined over 8 fake CPU devices (zb-v and interleaved-1f1b
over 4, two stages each) under five schedules: for each, the jitted ``pipe.value(staged,
batch)`` (the schedule's forwards alone, no residuals stored) against the jitted
``pipe.value_and_grad(staged, batch)[0]`` (which runs every backward: the tick loop is one
``lax.scan``), timed in alternating rounds; the ratio is taken within each round, and the
table gives medians, and each compiled step's temporary bytes per device
(``memory_analysis``). Both return the same loss (checked). Writes the section "evaluation"
of ``benchmarks/RESULTS.md``.

Run: ``python benchmarks/evaluation.py [--rounds N]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Sequence

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _results import machine_load, write_section
from stash_reads import alternate

from models import gpt
from zbjax.cpu import use_cpu_devices

COMMAND = "python benchmarks/evaluation.py"
SCHEDULES = ("gpipe", "1f1b", "zb-h1", "zb-v", "interleaved-1f1b")
CFG = gpt.GPTConfig(vocab_size=64, seq_len=32, d_model=64, num_heads=4, num_layers=8)
BATCH = 32
MICROBATCHES = 8


def measure(schedules: Sequence[str], rounds: int, cfg: gpt.GPTConfig = CFG) -> list[tuple]:
    """Returns per schedule (name, value s, value_and_grad's loss s, median ratio, and the
    temporary bytes of each compiled step)."""
    import zbjax

    loss_fn = gpt.make_loss_fn(cfg)
    params = gpt.init_params(jax.random.key(0), cfg)
    batch = gpt.make_batch(jax.random.key(1), cfg, BATCH)
    rows = []
    for name in schedules:
        two = name in ("zb-v", "interleaved-1f1b")
        devices = min(len(jax.devices()), 4 if two else 8, cfg.num_layers)
        mesh = jax.make_mesh((devices,), ("pp",), devices=jax.devices()[:devices])
        pipe = zbjax.pipeline(
            loss_fn,
            mesh=mesh,
            schedule=name,
            num_microbatches=MICROBATCHES,
            num_stages=2 * devices if two else devices,
        )
        staged = pipe.stage(params, batch)
        forward = jax.jit(pipe.value)
        training = jax.jit(lambda s, b, pipe=pipe: pipe.value_and_grad(s, b)[0])
        # The same arithmetic compiled as two programs: XLA may round them 1 ulp apart.
        same = np.isclose(float(forward(staged, batch)), float(training(staged, batch)), 1e-6)
        if not same:
            raise AssertionError(f"{name}: pipe.value and value_and_grad's loss differ")
        times = alternate(
            {
                "value": lambda f=forward, s=staged: f(s, batch),
                "value_and_grad": lambda f=training, s=staged: f(s, batch),
            },
            rounds,
        )
        ratios = [a / b for a, b in zip(times["value"], times["value_and_grad"], strict=True)]
        temp = [
            f.lower(staged, batch).compile().memory_analysis().temp_size_in_bytes
            for f in (forward, training)
        ]
        rows.append(
            (
                name,
                statistics.median(times["value"]),
                statistics.median(times["value_and_grad"]),
                statistics.median(ratios),
                *temp,
            )
        )
    return rows


def table(rows: Sequence[tuple]) -> str:
    lines = [
        "| schedule | pipe.value (ms) | value_and_grad's loss (ms) | ratio | "
        "temp MiB: pipe.value / value_and_grad |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, value, both, ratio, value_temp, both_temp in rows:
        lines.append(
            f"| {name} | {value * 1e3:.2f} | {both * 1e3:.2f} | {ratio:.2f} | "
            f"{value_temp / 2**20:.2f} / {both_temp / 2**20:.2f} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Returns 0 after timing every schedule and writing the "evaluation" section."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=11, help="alternating timed rounds")
    args = parser.parse_args(argv)
    use_cpu_devices(8)
    began = time.perf_counter()
    load_before = machine_load()
    rows = measure(SCHEDULES, args.rounds)
    body = "\n".join(
        [
            "## Evaluation: forwards only against the training step's loss",
            "",
            f"Made by `{COMMAND} --rounds {args.rounds}` (jax {jax.__version__}, fake CPU "
            f"devices). The demo's GPT (8 blocks, d 64, batch {BATCH}, m = {MICROBATCHES}) over "
            "8 devices, 4 for zb-v and interleaved-1f1b (2 stages each). `pipe.value` runs the "
            "forwards of the same pipeline's schedule alone (`Schedule.forwards()`: each device "
            "runs its F as their inputs arrive, no residuals stored); `value_and_grad`'s loss, "
            "jitted alone, runs every backward. Medians over rounds; the ratio is the median "
            "of per-round ratios. Temp: each compiled step's temporary bytes on one device "
            "(`memory_analysis()`; the staged params are arguments, not temporaries). The "
            "losses agree to 1e-6 (checked).",
            "",
            table(rows),
            "",
            f"Machine load before: `{load_before}`; after: `{machine_load()}`.",
            f"Took {time.perf_counter() - began:.0f} s.",
        ]
    )
    path = write_section("evaluation", body)
    print(body)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
