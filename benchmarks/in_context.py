"""Do the actions cost inside the pipeline what they cost alone? Measured costs against a trace.

``pipe.measure_costs`` times each stage's F, B, W and fused BW jitted alone on one device; the
planner and the simulator's predictions take those times. ``pipe.profile`` traces the real
step and sums each action's ops by its named scope (``zbjax.trace``). On ``step_time``'s MLP
(2 devices, m = 4) this script profiles 1f1b, zb-h2 as planned (the costs say where to fuse a
stage's backward) and zb-h2 with B and W kept split, several times each in turn, and sets
every action's time in context beside its time alone; per device it splits the step into
actions, exchanges (waiting for the other device included) and the tick loop's own work.
Writes the section "in_context" of ``benchmarks/RESULTS.md``.
Run: ``python benchmarks/in_context.py [--repeats N] [--steps N]``.
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _results import machine_load, write_section
from step_time import NUM_DEVICES, SPLIT, TARGET, Setup, make_mesh, mlp_config, split_costs

import zbjax
from models import mlp
from zbjax.schedules import Costs
from zbjax.trace import BETWEEN, EXCHANGES, ActionTimes, scope_cost, scope_order

COMMAND = "python benchmarks/in_context.py"
MICROBATCHES = 4
PLANNED = f"{TARGET}, as planned"
#: The variants: (name, schedule, whether the costs keep the fused backward's times).
VARIANTS = (("1f1b", "1f1b", True), (PLANNED, TARGET, True), (SPLIT, TARGET, False))


@dataclass(frozen=True)
class Result:
    """A variant's name and its profiles, one per repeat."""

    name: str
    profiles: list[ActionTimes]


def measure(setup: Setup, repeats: int, steps: int) -> tuple[Costs, list[Result]]:
    """Returns the costs measured alone and every variant's profiles, the variants profiled
    in turn ``repeats`` times."""
    cfg = mlp_config(setup, NUM_DEVICES)
    loss_fn = mlp.make_loss_fn(cfg)
    params = mlp.init_params(jax.random.key(0), cfg)
    batch = mlp.make_batch(jax.random.key(1), cfg, MICROBATCHES * setup.microbatch_rows)
    mesh = make_mesh()

    def make(schedule: str, costs: Costs | None) -> zbjax.Pipeline:
        return zbjax.pipeline(
            loss_fn, mesh=mesh, schedule=schedule, num_microbatches=MICROBATCHES, costs=costs
        )

    costs = make(TARGET, None).measure_costs(params, batch, repeats=max(3, repeats))
    pipes = []
    for name, schedule, fused in VARIANTS:
        pipe = make(schedule, costs if fused else split_costs(costs))
        pipes.append((name, pipe, pipe.stage(params, batch)))
    results = {name: Result(name, []) for name, _, _ in VARIANTS}
    for _ in range(repeats):
        for name, pipe, staged in pipes:
            results[name].profiles.append(pipe.profile(staged, batch, steps=steps))
    return costs, list(results.values())


def action_table(costs: Costs, results: Sequence[Result]) -> str:
    """Returns the markdown table of every action per variant: time per run in context
    (median over repeats) against alone."""
    lines = [
        "| variant | action | device | in context (ms per run) | alone (ms) | in context / alone |",
        "|---|---|---|---|---|---|",
    ]
    for result in results:
        first = result.profiles[0]
        for device, scopes in first.seconds.items():
            for scope in sorted((s for s in scopes if s in first.runs), key=scope_order):
                ctx = statistics.median([p.per_run(scope, device) for p in result.profiles])
                alone = scope_cost(costs, scope)
                lines.append(
                    f"| {result.name} | {scope} | {device} | {ctx * 1e3:.2f} | "
                    f"{alone * 1e3:.2f} | {ctx / alone:.2f} |"
                )
    return "\n".join(lines)


def device_table(results: Sequence[Result]) -> str:
    """Returns the markdown table of each variant's step per device: its wall time untraced
    and traced, and the traced step's time in actions, exchanges and between actions, and
    their sum over the traced step (medians)."""
    lines = [
        "| variant | device | step (ms) | traced step (ms) | actions (ms) | exchanges (ms) | "
        "between actions (ms) | sum / traced step |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for result in results:
        profiles = result.profiles
        step = statistics.median([p.step_seconds for p in profiles])
        traced = statistics.median([p.traced_step_seconds for p in profiles])
        for device in profiles[0].seconds:
            parts = [
                statistics.median([p.action_seconds(device) for p in profiles]),
                statistics.median([p.seconds[device].get(EXCHANGES, 0.0) for p in profiles]),
                statistics.median([p.seconds[device].get(BETWEEN, 0.0) for p in profiles]),
            ]
            lines.append(
                f"| {result.name} | {device} | {step * 1e3:.1f} | {traced * 1e3:.1f} | "
                + " | ".join(f"{v * 1e3:.1f}" for v in parts)
                + f" | {sum(parts) / traced:.2f} |"
            )
    return "\n".join(lines)


def split_line(costs: Costs, results: Sequence[Result]) -> str:
    """Returns what the split costs stage 1 in context: its B + W (split variant) against its
    fused BW (as planned), next to the same ratio alone."""
    by_name = {r.name: r for r in results}
    split, planned = by_name[SPLIT].profiles, by_name[PLANNED].profiles
    if not all("B s1" in p.runs and "W s1" in p.runs for p in split) or not all(
        "BW s1" in p.runs for p in planned
    ):
        return "Stage 1 did not run split in one variant and fused in the other."
    bw_split = statistics.median([p.per_run("B s1") + p.per_run("W s1") for p in split])
    bw_fused = statistics.median([p.per_run("BW s1") for p in planned])
    alone = (costs.b[1] + costs.w[1]) / costs.bw[1]
    return (
        f"Stage 1's backward in context: B + W {bw_split * 1e3:.2f} ms (kept split) against "
        f"BW {bw_fused * 1e3:.2f} ms (as planned), {bw_split / bw_fused:.2f}x; alone "
        f"{(costs.b[1] + costs.w[1]) * 1e3:.2f} against {costs.bw[1] * 1e3:.2f} ms, {alone:.2f}x."
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Returns 0 after profiling every variant and writing the "in_context" section."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="profiles per variant")
    parser.add_argument("--steps", type=int, default=5, help="traced steps per profile")
    args = parser.parse_args(argv)
    jax.config.update("jax_num_cpu_devices", NUM_DEVICES)  # before any JAX computation
    began = time.perf_counter()
    load_before = machine_load()
    setup = Setup()
    costs, results = measure(setup, args.repeats, args.steps)
    load_after = machine_load()
    cfg = mlp_config(setup, NUM_DEVICES)
    body = "\n".join(
        [
            "## Actions in the pipeline versus alone: measured costs against a trace",
            "",
            f"Made by `{COMMAND} --repeats {args.repeats} --steps {args.steps}` "
            f"({jax.devices()[0].device_kind}, {os.cpu_count()} cores, "
            f"`jax_num_cpu_devices={NUM_DEVICES}`, jax {jax.__version__}).",
            f"Model: `step_time`'s MLP ({cfg.depth} x Dense({setup.width}) + tanh, "
            f"{setup.microbatch_rows} rows per microbatch, 2 stages), m = {MICROBATCHES}. "
            "*Alone*: `pipe.measure_costs` (each stage's F, B, W and fused BW jitted alone on "
            "one device, what the planner and the predictions use). *In context*: "
            f"`pipe.profile` ({args.steps} steps traced with `jax.profiler`, each action's time: "
            "the time its ops cover, by its named scope, per run), the variants profiled in turn "
            f"{args.repeats} times, medians. *{PLANNED}*: the pipeline given the costs, which "
            "fuses a stage's backward where they say it pays; "
            f"*{SPLIT}*: given the costs without the fused backward's, so stage 1 keeps B and "
            "W split. Exchanges include waiting for the other device; *between actions* is "
            "the tick loop's own work; what the ops' events do not cover (*sum / traced step* "
            "below 1) is time in no op: the executor between ops, the step's launch.",
            "",
            action_table(costs, results),
            "",
            device_table(results),
            "",
            split_line(costs, results),
            "",
            f"Machine load before: `{load_before}`; after: `{load_after}`.",
            f"Took {time.perf_counter() - began:.0f} s.",
        ]
    )
    print(write_section("in_context", body))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
