"""Does the lowered pipeline run as fast as its schedule predicts? Step time per schedule.

On a 2-device CPU mesh (one core per device), a 2-stage MLP of 128-wide layers runs one
training step (loss and grads) under every schedule; each schedule's step time is reported as
a ratio to 1f1b measured in the same process (variants alternate round by round), next to the
ratio the simulator predicts from the measured F, B and W times of each stage. Two baselines run
in the same rounds: the unpipelined ``jax.jit(jax.value_and_grad(loss))`` on one device, and the
textbook JAX pipeline (a GPipe loop in ``shard_map`` with ``ppermute``, differentiated by
``jax.grad``). The per-tick overhead of the lowering is measured first, with a model so small
that a step is nothing but ticks. Writes the section "step_time" of ``benchmarks/RESULTS.md``
and ``benchmarks/figures/step_time.png``.

Run: ``python benchmarks/step_time.py [--rounds N] [--microbatches 4 8 16]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

import zbjax
from zbjax import schedules
from zbjax.partition import partition
from zbjax.profile import measure_stage_costs
from zbjax.split import split
from zbjax.ticks import barrier_time, exchange_messages, exchange_ticks, pack_ticks, plan_ticks

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _results import machine_load, pin_to_one_core, run_pinned_copy, save_figure, write_section

from models import mlp

COMMAND = "python benchmarks/step_time.py"
FIGURES = Path(__file__).resolve().parent / "figures"
AXIS = "pp"
NUM_DEVICES = 2
SCHEDULE_NAMES = ("gpipe", "1f1b", "zb-h1", "zb-h2", "zb-v", "zb-auto")
TARGET = "zb-h2"
TARGET_TOLERANCE = 0.05
FRESH = f"{TARGET}, keep_buffers=False"
#: Untimed rounds of every variant after the compiles (``alternate``).
WARMUP_ROUNDS = 3
UNPACKED = f"{TARGET}, pack_ticks=False"
#: The target with every stage's B and W kept split: the pipeline gets the measured costs
#: without the fused backward's (``Costs.bw`` left at B + W), so the planner fuses no stage
#: whose B computes something, however much the split costs.
SPLIT = f"{TARGET}, B and W split"


def split_costs(costs: schedules.Costs) -> schedules.Costs:
    """Returns ``costs`` without the fused backward's times (BW costs B + W): costs under
    which the planner keeps every stage's backward split that has a B to compute."""
    return dataclasses.replace(costs, bw=None)


@dataclass(frozen=True)
class Setup:
    """The MLP: ``width``-wide layers, ``layers_per_stage`` per device, rows per microbatch."""

    width: int = 128
    layers_per_stage: int = 8
    microbatch_rows: int = 1024


SMOKE_SETUP = Setup(width=8, layers_per_stage=2, microbatch_rows=4)


def mlp_config(setup: Setup, num_stages: int) -> mlp.MLPConfig:
    """Returns the MLP config: 2 x layers_per_stage layers cut into ``num_stages`` even stages."""
    depth = NUM_DEVICES * setup.layers_per_stage
    if depth % num_stages:
        raise ValueError(f"{depth} layers do not split into {num_stages} even stages")
    per = depth // num_stages
    return mlp.MLPConfig(
        in_dim=setup.width,
        width=setup.width,
        depth=depth,
        out_dim=setup.width,
        stage_boundaries=tuple(per * (s + 1) - 1 for s in range(num_stages - 1)),
    )


def make_mesh() -> jax.sharding.Mesh:
    """Returns the 1-D mesh of the first 2 devices over axis "pp"."""
    return jax.sharding.Mesh(np.array(jax.devices()[:NUM_DEVICES]), (AXIS,))


# --------------------------------------------------------------------------- textbook GPipe


def textbook_params(params: Any, setup: Setup) -> dict[str, jax.Array]:
    """Returns the MLP params as the textbook pipeline wants them: hidden layers stacked
    ``[devices, layers_per_stage, ...]``, output layer apart."""
    k = setup.layers_per_stage
    kernels = [params[f"dense_{i}"]["kernel"] for i in range(NUM_DEVICES * k)]
    biases = [params[f"dense_{i}"]["bias"] for i in range(NUM_DEVICES * k)]
    return {
        "w": jnp.stack(kernels).reshape(NUM_DEVICES, k, setup.width, setup.width),
        "b": jnp.stack(biases).reshape(NUM_DEVICES, k, setup.width),
        "out_w": params["out"]["kernel"],
        "out_b": params["out"]["bias"],
    }


def textbook_gpipe(
    mesh: jax.sharding.Mesh, setup: Setup, num_microbatches: int
) -> Callable[[Any, Any], Any]:
    """Returns jit(value_and_grad(loss)) of the MLP run by a hand-written GPipe in shard_map.

    The pattern of the JAX shard_map tutorial: every device holds its stage's stacked layers;
    at each of m + p - 1 ticks device 0 takes the next microbatch, every device applies its
    stage and passes the result on with ``ppermute``; the last device's outputs leave the
    shard_map and the output layer and loss run after it. ``jax.grad`` differentiates through
    the loop (so the backward is GPipe's too: all forwards, then all backwards).
    """
    p, m = NUM_DEVICES, num_microbatches

    def stage(w, b, x):
        for i in range(w.shape[0]):
            x = jnp.tanh(x @ w[i] + b[i])
        return x

    def device_program(w, b, xs):
        w, b = w[0], b[0]
        index = jax.lax.axis_index(AXIS)

        def tick(carry, t):
            state, outputs = carry
            first = jax.lax.dynamic_index_in_dim(xs, jnp.minimum(t, m - 1), keepdims=False)
            y = stage(w, b, jnp.where(index == 0, first, state))
            done = t - (p - 1)
            slot = jnp.clip(done, 0, m - 1)
            old = jax.lax.dynamic_index_in_dim(outputs, slot, keepdims=False)
            keep = (index == p - 1) & (done >= 0)
            outputs = jax.lax.dynamic_update_index_in_dim(outputs, jnp.where(keep, y, old), slot, 0)
            state = jax.lax.ppermute(y, AXIS, [(d, (d + 1) % p) for d in range(p)])
            return (state, outputs), None

        zeros = jax.lax.pcast(jnp.zeros(xs.shape[1:], xs.dtype), (AXIS,), to="varying")
        outputs = jax.lax.pcast(jnp.zeros_like(xs), (AXIS,), to="varying")
        (_, outputs), _ = jax.lax.scan(tick, (zeros, outputs), jnp.arange(m + p - 1))
        return outputs[None]

    run = jax.shard_map(
        device_program,
        mesh=mesh,
        in_specs=(PartitionSpec(AXIS), PartitionSpec(AXIS), PartitionSpec()),
        out_specs=PartitionSpec(AXIS),
    )

    def loss(params, batch):
        xs = batch["x"].reshape(m, -1, setup.width)
        hidden = run(params["w"], params["b"], xs)[p - 1].reshape(-1, setup.width)
        out = hidden @ params["out_w"] + params["out_b"]
        return jnp.mean((out - batch["y"]) ** 2)

    return jax.jit(jax.value_and_grad(loss))


def place_textbook(mesh: jax.sharding.Mesh, params: dict[str, jax.Array]) -> dict[str, Any]:
    """Returns the textbook params with the stacked layers sharded over the pp axis."""
    staged = NamedSharding(mesh, PartitionSpec(AXIS))
    whole = NamedSharding(mesh, PartitionSpec())
    return {k: jax.device_put(v, staged if k in ("w", "b") else whole) for k, v in params.items()}


# --------------------------------------------------------------------------- costs, prediction


def measured_costs(
    loss_fn: Callable[..., Any], params: Any, microbatch: Any, repeats: int
) -> schedules.Costs:
    """Returns per-stage median seconds of F, B and W, each jitted alone on one device, as
    ``Pipeline.measure_costs`` measures them (``zbjax.profile``): B and W are timed as the
    lowering runs them, so a first stage's B, which has no input cotangent to compute, costs
    next to nothing and its W does the whole backward.
    """
    graph = partition(loss_fn, params, microbatch)
    return measure_stage_costs(
        graph,
        split(graph),
        jax.tree_util.tree_leaves(params),
        jax.tree_util.tree_leaves(microbatch),
        repeats,
    )


def lockstep_time(
    schedule: schedules.Schedule,
    costs: schedules.Costs,
    slowdown: float = 1.0,
    pack: bool = True,
) -> tuple[float, int, int]:
    """Returns (compute time of the lowering's ticks, ticks, exchanges): the devices run their
    actions back to back and wait for each other at the ticks that exchange messages
    (``barrier_time``, without ``costs.comm``).

    The ticks are the lowering's: with ``pack``, stages' backward fused and actions
    packed into lanes after short ones where the costs say it pays (``plan_ticks``, as
    ``pipeline(costs=...)`` does), else one action per device per tick. ``slowdown``
    stretches the stretches between exchanges in which more than one device computes: the
    measured cost of running on every device at once over running on one (the parallelism
    check).
    """
    return _lockstep(*planned_ticks(schedule, costs, pack), costs, slowdown)


def _lockstep(
    planned: schedules.Schedule, positions: dict, costs: schedules.Costs, slowdown: float
) -> tuple[float, int, int]:
    """Returns ``lockstep_time`` of ticks already planned."""
    return (
        barrier_time(
            planned, positions, dataclasses.replace(costs, comm=0.0, comm_message=0.0), slowdown
        ),
        1 + max(tick for tick, _ in positions.values()),
        len(exchange_ticks(planned, positions)),
    )


def planned_ticks(
    schedule: schedules.Schedule, costs: schedules.Costs, pack: bool = True
) -> tuple[schedules.Schedule, dict]:
    """Returns the schedule and ticks the lowering runs (``lockstep_time``'s ``pack``)."""
    # As the lowering plans it: the first stage (no differentiable input, so an empty B) and
    # any stage whose split costs more than it saves may run fused, and actions may be packed
    # into lanes or laid out around the exchanges.
    return plan_ticks(schedule, costs, [0]) if pack else (schedule, pack_ticks(schedule))


def fused_stages(schedule: schedules.Schedule) -> tuple[int, ...]:
    """Returns the stages whose backward ``schedule`` runs fused (BW)."""
    return tuple(sorted({a.stage for _, _, a in schedule.all_actions() if a.kind == "BW"}))


def stages_text(stages: Sequence[int]) -> str:
    """Returns ``stages`` as a table cell: "0, 1", or "none"."""
    return ", ".join(map(str, stages)) or "none"


@dataclass(frozen=True)
class Prediction:
    """What the simulator says of one schedule: makespan, span bubble, lockstep time, ticks."""

    makespan: float
    bubble_rate: float
    span_bubble_rate: float
    lockstep: float
    contended: float  # lockstep, ticks with several busy devices stretched by the slowdown
    ticks: int
    exchanges: int  # ticks that end in a ppermute (the others skip it)
    comm: float  # those ppermutes' time by the costs (``Costs.exchange`` of each payload)
    work: float  # every action's cost summed: the step time if the devices time-share one core
    fused: tuple[int, ...]  # the stages whose backward the planned schedule runs fused


def predict(
    schedule: schedules.Schedule,
    costs: schedules.Costs,
    slowdown: float = 1.0,
    pack: bool = True,
    plan_costs: schedules.Costs | None = None,
) -> Prediction:
    """Returns the simulated makespan, both bubble views and the lockstep times of the
    schedule the lowering runs for ``schedule`` (``slowdown``: the parallelism check, for the
    contended lockstep time; ``pack``: whether the lowering packs its ticks by the costs;
    ``plan_costs``: the costs the pipeline was given, by default ``costs``). Everything is
    timed with ``costs``."""
    planned = planned_ticks(schedule, plan_costs or costs, pack)  # planned once, timed twice
    result = schedules.simulate(planned[0], costs)
    lockstep, ticks, exchanges = _lockstep(*planned, costs, 1.0)
    comm = sum(costs.exchange(n) for n in exchange_messages(*planned).values())
    work = sum(costs.of(a, schedule.num_stages) for _, _, a in planned[0].all_actions())
    return Prediction(
        result.makespan,
        result.bubble_rate,
        schedules.span_bubble_rate(planned[0], result),
        lockstep,
        _lockstep(*planned, costs, slowdown)[0],
        ticks,
        exchanges,
        comm,
        work,
        fused_stages(planned[0]),
    )


# --------------------------------------------------------------------------- timing


def alternate(variants: dict[str, Callable[[], Any]], rounds: int) -> dict[str, list[float]]:
    """Returns per-variant step times over ``rounds``; each round runs every variant once,
    starting at a different variant each round so load drift hits all alike. Every variant is
    compiled first, then ``WARMUP_ROUNDS`` rounds run untimed (the first steps after the
    compiles ran 1.2-1.4x slower over processes than the same steps timed later)."""
    for fn in variants.values():  # compile
        jax.block_until_ready(fn())
    for _ in range(WARMUP_ROUNDS):
        for fn in variants.values():
            jax.block_until_ready(fn())
    names = list(variants)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            began = time.perf_counter()
            jax.block_until_ready(variants[name]())
            times[name].append(time.perf_counter() - began)
    return times


def median_ratio(times: dict[str, list[float]], name: str, reference: str) -> float:
    """Returns the median over rounds of time(name) / time(reference) in the same round."""
    return statistics.median(a / b for a, b in zip(times[name], times[reference], strict=True))


def ratio_quartiles(
    times: dict[str, list[float]], name: str, reference: str
) -> tuple[float, float]:
    """Returns the first and third quartiles over rounds of time(name) / time(reference) in
    the same round: the middle half of the rounds' ratios, how far one round's ratio strays."""
    ratios = [a / b for a, b in zip(times[name], times[reference], strict=True)]
    if len(ratios) < 2:
        return ratios[0], ratios[0]
    q1, _, q3 = statistics.quantiles(ratios, n=4, method="inclusive")
    return q1, q3


def pipeline_step(
    loss_fn: Callable[..., Any],
    schedule: schedules.Schedule,
    mesh: jax.sharding.Mesh,
    params: Any,
    batch: Any,
    keep_buffers: bool | None = None,
    costs: schedules.Costs | None = None,
    pack_ticks: bool = True,
) -> Callable[[], Any]:
    """Returns a thunk running one pipelined step of ``schedule`` on staged params (its
    ticks packed by ``costs`` unless ``pack_ticks`` is False)."""
    pipe = zbjax.pipeline(
        loss_fn,
        mesh=mesh,
        axis_name=AXIS,
        schedule=schedule,
        num_microbatches=schedule.num_microbatches,
        keep_buffers=keep_buffers,
        costs=costs,
        pack_ticks=pack_ticks,
    )
    staged = pipe.stage(params, batch)  # builds from the batch's shapes; nothing compiled
    return lambda: pipe.value_and_grad(staged, batch)


def _stage_forward(setup: Setup) -> tuple[Callable[..., Any], jax.Array]:
    """Returns one MLP stage's forward (``layers_per_stage`` Dense + tanh) and its weights."""
    key = jax.random.key(5)
    weights = jax.random.normal(key, (setup.layers_per_stage, setup.width, setup.width)) * 0.1

    def stage(x, w):
        for i in range(w.shape[0]):
            x = jnp.tanh(x @ w[i])
        return x

    return stage, weights


def forward_alone(setup: Setup, repeats: int = 30) -> float:
    """Returns the median seconds of one stage's forward on one device, the others idle."""
    stage, weights = _stage_forward(setup)
    one = jax.jit(stage)
    x = jnp.ones((setup.microbatch_rows, setup.width))
    return statistics.median(alternate({"one": lambda: one(x, weights)}, repeats)["one"])


def forward_one_core(setup: Setup, repeats: int = 30) -> float:
    """Returns ``forward_alone`` measured by a copy of this script pinned to one core."""
    return float(run_pinned_copy(__file__, "--one-core-forward-json")["seconds"])


def parallel_slowdown(
    mesh: jax.sharding.Mesh, setup: Setup, repeats: int = 30
) -> tuple[float, float, float]:
    """Returns time(one stage's forward on every device at once) / time(on one device alone),
    and the two median times in seconds.

    A device alone gets every core through XLA's intra-op threads; with every device busy each
    gets about one. So on a 2-core machine this reads about 2 even when the devices do run in
    parallel; it says how much slower an action runs when the other device computes too.
    """
    p = mesh.devices.size
    stage, weights = _stage_forward(setup)
    one = jax.jit(stage)
    every = jax.jit(
        jax.shard_map(
            lambda x, w: stage(x[0], w)[None],
            mesh=mesh,
            in_specs=(PartitionSpec(AXIS), PartitionSpec()),
            out_specs=PartitionSpec(AXIS),
        )
    )
    x_one = jnp.ones((setup.microbatch_rows, setup.width))
    x_every = jax.device_put(
        jnp.ones((p, setup.microbatch_rows, setup.width)), NamedSharding(mesh, PartitionSpec(AXIS))
    )
    times = alternate(
        {"one": lambda: one(x_one, weights), "every": lambda: every(x_every, weights)}, repeats
    )
    return (
        median_ratio(times, "every", "one"),
        statistics.median(times["one"]),
        statistics.median(times["every"]),
    )


@dataclass(frozen=True)
class TickOverhead:
    """Seconds per lockstep tick and fixed seconds per step, fitted over (ticks, time) points."""

    per_tick: float
    fixed: float
    points: tuple[tuple[int, float], ...]


def tick_overhead(
    mesh: jax.sharding.Mesh, rounds: int, microbatches: Sequence[int] = (4, 16, 64)
) -> TickOverhead:
    """Returns the lowering's cost per tick: gpipe steps of an MLP of width 8, one layer per
    device (compute negligible), at several m, step time regressed on the number of ticks."""
    p = mesh.devices.size
    cfg = mlp.MLPConfig(in_dim=8, width=8, depth=p, out_dim=8, stage_boundaries=range(p - 1))
    params = mlp.init_params(jax.random.key(0), cfg)
    loss_fn = mlp.make_loss_fn(cfg)
    variants, ticks = {}, {}
    for m in microbatches:
        batch = mlp.make_batch(jax.random.key(1), cfg, m * 8)
        schedule = schedules.build("gpipe", p, m)
        ticks[m] = lockstep_time(schedule, schedules.Costs())[1]
        variants[m] = pipeline_step(loss_fn, schedule, mesh, params, batch)
    times = alternate(variants, rounds)
    points = tuple((ticks[m], statistics.median(times[m])) for m in microbatches)
    slope, intercept = np.polyfit([t for t, _ in points], [s for _, s in points], 1)
    return TickOverhead(float(slope), float(intercept), points)


@dataclass(frozen=True)
class Row:
    """One variant at one m: measured median time and ratio to 1f1b, and the predictions."""

    name: str
    m: int
    seconds: float
    ratio: float
    quartiles: tuple[float, float]
    prediction: Prediction | None


def measure_m(
    m: int,
    setup: Setup,
    mesh: jax.sharding.Mesh,
    rounds: int,
    cost_repeats: int,
    slowdown: float = 1.0,
) -> tuple[list[Row], schedules.Costs, bool]:
    """Returns the rows for every schedule and both baselines at ``m`` microbatches, the
    costs, and whether zb-auto's schedule runs the very actions the target's does."""
    cfg2, cfg4 = mlp_config(setup, NUM_DEVICES), mlp_config(setup, 2 * NUM_DEVICES)
    params = mlp.init_params(jax.random.key(0), cfg2)
    batch = mlp.make_batch(jax.random.key(1), cfg2, m * setup.microbatch_rows)
    microbatch = jax.tree.map(lambda x: x[: setup.microbatch_rows], batch)
    loss2, loss4 = mlp.make_loss_fn(cfg2), mlp.make_loss_fn(cfg4)
    costs2 = measured_costs(loss2, params, microbatch, cost_repeats)
    costs4 = measured_costs(loss4, params, microbatch, cost_repeats)
    built: dict[str, tuple[schedules.Schedule, schedules.Costs, Callable]] = {}
    for name in SCHEDULE_NAMES:
        two = name == "zb-v"
        costs, loss_fn = (costs4, loss4) if two else (costs2, loss2)
        stages = 2 * NUM_DEVICES if two else NUM_DEVICES
        schedule = schedules.build(name, stages, m, num_devices=NUM_DEVICES, costs=costs)
        built[name] = (schedule, costs, loss_fn)
    variants = {
        name: pipeline_step(loss_fn, schedule, mesh, params, batch, costs=costs)
        for name, (schedule, costs, loss_fn) in built.items()
    }
    # The same schedule allocating its arenas in every step (keep_buffers=False), and
    # running one action per device per tick (pack_ticks=False).
    schedule, costs, loss_fn = built[TARGET]
    variants[FRESH] = pipeline_step(
        loss_fn, schedule, mesh, params, batch, keep_buffers=False, costs=costs
    )
    variants[UNPACKED] = pipeline_step(
        loss_fn, schedule, mesh, params, batch, costs=costs, pack_ticks=False
    )
    variants[SPLIT] = pipeline_step(
        loss_fn, schedule, mesh, params, batch, costs=split_costs(costs)
    )
    single = jax.devices()[0]
    params_one = jax.device_put(params, single)
    batch_one = jax.device_put(batch, single)
    unpipelined = jax.jit(jax.value_and_grad(loss2))
    variants["unpipelined (1 device)"] = lambda: unpipelined(params_one, batch_one)
    textbook = textbook_gpipe(mesh, setup, m)
    tb_params = place_textbook(mesh, textbook_params(params, setup))
    variants["textbook shard_map GPipe"] = lambda: textbook(tb_params, batch)
    times = alternate(variants, rounds)
    rows = [
        Row(
            name,
            m,
            statistics.median(times[name]),
            median_ratio(times, name, "1f1b"),
            ratio_quartiles(times, name, "1f1b"),
            predict(*built[name][:2], slowdown)
            if name in built
            else predict(*built[TARGET][:2], slowdown, pack=False)
            if name == UNPACKED
            else predict(*built[TARGET][:2], slowdown, plan_costs=split_costs(built[TARGET][1]))
            if name == SPLIT
            else None,
        )
        for name in variants
    ]
    same = built["zb-auto"][0].actions == built[TARGET][0].actions
    return rows, costs2, same


def check_textbook(setup: Setup, mesh: jax.sharding.Mesh, m: int) -> float:
    """Returns the largest |difference| between textbook-pipeline and jax.grad gradients."""
    cfg = mlp_config(setup, NUM_DEVICES)
    params = mlp.init_params(jax.random.key(0), cfg)
    batch = mlp.make_batch(jax.random.key(1), cfg, m * setup.microbatch_rows)
    loss, grads = textbook_gpipe(mesh, setup, m)(textbook_params(params, setup), batch)
    ref_loss, ref_grads = jax.value_and_grad(mlp.make_loss_fn(cfg))(params, batch)
    ref = textbook_params(ref_grads, setup)
    diffs = [abs(float(loss) - float(ref_loss))]
    diffs += [float(jnp.max(jnp.abs(grads[k] - ref[k]))) for k in ref]
    return max(diffs)


# --------------------------------------------------------------------------- report


def table(rows: Sequence[Row], reference: Prediction, overhead: TickOverhead) -> str:
    """Returns the markdown table of one m's rows."""

    def with_overhead(p: Prediction) -> float:
        return p.lockstep + p.ticks * overhead.per_tick + overhead.fixed

    lines = [
        "| variant | step (ms) | measured / 1f1b | rounds' middle half | "
        "predicted / 1f1b (makespan) | "
        "predicted / 1f1b (span) | predicted / 1f1b (lockstep) | predicted / 1f1b (lockstep "
        "+ tick overhead) | predicted / 1f1b (lockstep, contended) | predicted step (ms, "
        "lockstep + overhead) | ticks | bubble (makespan) | implied overhead per tick (ms) | "
        "same, devices time-sharing (ms) | stages run fused (BW) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        p = row.prediction
        if p is None:
            cells = "– | – | – | – | – | – | – | – | – | – | –"
        else:
            span = (1 - reference.span_bubble_rate) / (1 - p.span_bubble_rate)
            # Span view: equal work, so time per step goes as 1 / (1 - span bubble).
            cells = (
                f"{p.makespan / reference.makespan:.3f} | {span:.3f} | "
                f"{p.lockstep / reference.lockstep:.3f} | "
                f"{with_overhead(p) / with_overhead(reference):.3f} | "
                f"{p.contended / reference.contended:.3f} | "
                f"{with_overhead(p) * 1e3:.1f} | {p.ticks} | {p.bubble_rate:.1%} | "
                f"{(row.seconds - p.lockstep) / p.ticks * 1e3:.2f} | "
                f"{(row.seconds - p.work) / p.ticks * 1e3:.2f} | "
                f"{stages_text(p.fused)}"
            )
        low, high = row.quartiles
        lines.append(
            f"| {row.name} | {row.seconds * 1e3:.1f} | {row.ratio:.3f} | "
            f"{low:.3f}–{high:.3f} | {cells} |"
        )
    return "\n".join(lines)


def verdict(row: Row, ref: Prediction) -> str:
    """Returns the target's text for ``row``: measured and predicted (makespan) ratios to 1f1b
    (``ref``), how far apart, and which stages ran fused."""
    predicted = row.prediction.makespan / ref.makespan
    off = row.ratio / predicted - 1
    return (
        f"{row.name} (stages run fused: {stages_text(row.prediction.fused)}) measured "
        f"{row.ratio:.3f} (rounds' middle half "
        f"{row.quartiles[0]:.3f}–{row.quartiles[1]:.3f}) vs predicted {predicted:.3f} "
        f"({off:+.1%}, {'within' if abs(off) <= TARGET_TOLERANCE else 'NOT within'} "
        f"{TARGET_TOLERANCE:.0%}; contended lockstep predicts "
        f"{row.prediction.contended / ref.contended:.3f})"
    )


def plot(all_rows: Sequence[Row], path: Path) -> Path:
    """Returns ``path`` after drawing measured vs predicted (makespan) ratios per schedule."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ms = sorted({r.m for r in all_rows})
    fig, axes = plt.subplots(1, len(ms), figsize=(4.5 * len(ms), 4), squeeze=False)
    for ax, m in zip(axes[0], ms, strict=True):
        rows = [r for r in all_rows if r.m == m and r.prediction is not None]
        ref = next(r for r in rows if r.name == "1f1b").prediction
        x = np.arange(len(rows))
        ax.bar(x - 0.2, [r.ratio for r in rows], 0.4, label="measured")
        ax.bar(
            x + 0.2,
            [r.prediction.makespan / ref.makespan for r in rows],
            0.4,
            label="predicted (makespan)",
        )
        ax.set_xticks(x, [r.name for r in rows], rotation=45)
        ax.axhline(1.0, color="grey", lw=0.5)
        ax.set_title(f"m = {m}: step time / 1f1b")
    axes[0][0].legend()
    return save_figure(fig, path)


def main(argv: Sequence[str] | None = None) -> int:
    """Returns 0 after measuring every m and writing the "step_time" section."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15, help="alternating rounds per m")
    parser.add_argument("--microbatches", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument(
        "--one-core-forward-json",
        type=Path,
        help="pin this process to one core, time one stage's forward on one device, write it "
        "here as JSON and stop (how the script measures its one-core forward)",
    )
    args = parser.parse_args(argv)
    if args.one_core_forward_json is not None:
        pin_to_one_core()
        seconds = forward_alone(Setup())
        args.one_core_forward_json.write_text(json.dumps({"seconds": seconds}))
        return 0
    # Two fake CPU devices, one per core; must precede the first JAX computation.
    jax.config.update("jax_num_cpu_devices", NUM_DEVICES)
    began = time.perf_counter()
    load_before = machine_load()
    setup = Setup()
    mesh = make_mesh()
    textbook_error = check_textbook(SMOKE_SETUP, mesh, 4)
    slowdown_before, alone, every = parallel_slowdown(mesh, setup)
    one_core = forward_one_core(setup)
    print(
        f"parallel slowdown {slowdown_before:.2f}; forward alone {alone * 1e3:.2f} ms, "
        f"pinned to one core {one_core * 1e3:.2f} ms, on both devices {every * 1e3:.2f} ms",
        flush=True,
    )
    overhead = tick_overhead(mesh, args.rounds)
    print(
        f"per tick {overhead.per_tick * 1e3:.3f} ms, fixed {overhead.fixed * 1e3:.2f} ms",
        flush=True,
    )
    sections, all_rows, verdicts = [], [], []
    for m in args.microbatches:
        rows, costs, auto_is_target = measure_m(m, setup, mesh, args.rounds, 21, slowdown_before)
        all_rows += rows
        ref = next(r for r in rows if r.name == "1f1b").prediction
        target = next(r for r in rows if r.name == TARGET)
        split = next(r for r in rows if r.name == SPLIT)
        verdicts.append(
            f"m = {m}: "
            + verdict(target, ref)
            + (
                f"; zb-auto ran the very same actions and measured "
                f"{next(r for r in rows if r.name == 'zb-auto').ratio:.3f}"
                if auto_is_target
                else ""
            )
            + "; "
            + verdict(split, ref)
        )
        fused = costs.fused_per_stage(len(costs.f))
        cost_text = ", ".join(
            f"stage {s}: F {costs.f[s] * 1e3:.2f} / B {costs.b[s] * 1e3:.2f} / "
            f"W {costs.w[s] * 1e3:.2f} / fused BW {fused[s] * 1e3:.2f} ms"
            for s in range(len(costs.f))
        )
        sections += [
            f"### m = {m}",
            "",
            f"Measured stage costs ({cost_text}).",
            "",
            table(rows, ref, overhead),
            "",
        ]
        print("\n".join(sections[-4:]), flush=True)
    figure = plot(all_rows, FIGURES / "step_time.png")
    slowdown_after = parallel_slowdown(mesh, setup)[0]
    load_after = machine_load()
    fit = ", ".join(f"{t} ticks: {s * 1e3:.2f} ms" for t, s in overhead.points)
    body = "\n".join(
        [
            "## Step time on a 2-device CPU mesh: measured versus predicted, ratio to 1f1b",
            "",
            f"Made by `{COMMAND} --rounds {args.rounds} --microbatches "
            f"{' '.join(map(str, args.microbatches))}` (jax {jax.__version__}, "
            f"{os.cpu_count()} cores, `jax_num_cpu_devices=2`).",
            f"Model: MLP of {NUM_DEVICES * setup.layers_per_stage} Dense({setup.width}) + tanh "
            f"layers and a Dense({setup.width}) output with MSE, cut into 2 stages of "
            f"{setup.layers_per_stage} layers (4 stages of {setup.layers_per_stage // 2} for "
            f"zb-v, 2 per device); {setup.microbatch_rows} rows per microbatch, so each matmul "
            "runs on one core and one F takes a few ms. Pipelined steps use staged params "
            "(`pipe.stage`).",
            "Every variant runs once per round, the starting variant rotating, "
            f"{args.rounds} rounds after warm-up; step (ms) is the median, measured / 1f1b the "
            "median over rounds of the ratio within the round, *rounds' middle half* its first "
            "to third quartile over the rounds (how far one round strays: the spread of the "
            "noise the medians damp; where zb-auto's schedule runs the very actions zb-h2's "
            "does, the target line says what it measured, another view of the noise). "
            "Predictions simulate the very "
            "schedule that ran with per-stage costs measured in this process (F, B, W each "
            "jitted alone, several runs per timed call in a loop writing each run's outputs "
            "into a slot of pools kept between calls, as the tick loop writes its arenas, "
            "`zbjax.profile.looped`; the fused backward BW timed the same way, `Costs.bw`): "
            "*makespan* is `simulate(...).makespan`, what one "
            "isolated step takes and therefore what the target uses; *span* is the throughput "
            "the span bubble implies (`span_bubble_rate`: steady state with successive steps "
            "overlapping, which a single jitted step does not do); *lockstep* is how the "
            "lowering runs: the devices run their ticks' actions back to back and wait for "
            "each other only at the ticks that send a message (the others skip their "
            "`ppermute`; `zbjax.ticks.barrier_time`), actions packed after a short one (or the "
            "exchanges placed first, `zbjax.ticks.segment_ticks`) and a stage's backward fused "
            "where the costs say it pays: the first stage's (its B has nothing to compute), and "
            "any other stage's whose B and W cost more than its fused BW by more than deferring "
            "W saves (`zbjax.ticks.plan_ticks`; *stages run fused* lists every stage whose "
            "backward ran as BW; the pipelines get the measured costs, `pipeline(costs=...)`); "
            "*lockstep + tick "
            "overhead* adds the per-tick and fixed costs measured below; *lockstep, contended* "
            "stretches every run of ticks between exchanges in which both devices compute by the "
            "parallelism check's "
            "slowdown (the two fake devices share this machine's cores and memory), which is "
            "what this machine can show at best. *Implied overhead per "
            "tick* = (measured step − lockstep compute) / ticks: what each tick costs beyond "
            "its slowest action at this model size; *same, devices time-sharing* subtracts "
            "all the step's work instead (every action's cost summed), the right baseline "
            "when the parallelism check reads about 2.",
            f"*{FRESH}* is {TARGET} with its arenas allocated in every step instead of "
            f"kept between calls (the CPU default); *{UNPACKED}* is {TARGET} as built, one "
            "action per device per tick (nothing packed, no backward fused); "
            f"*{SPLIT}* is {TARGET} given the measured costs without the fused backward's "
            "(BW costing B + W), so the planner keeps every stage with a B to compute split "
            "(its prediction: the ticks planned by those costs, timed by the measured ones).",
            f"Baselines in the same rounds: unpipelined = `jax.jit(jax.value_and_grad(loss))` "
            "on one device (XLA may use both cores for its larger matmuls); textbook = a GPipe "
            "loop (`lax.scan` over m + p − 1 ticks, `ppermute`) inside `shard_map`, "
            "differentiated by `jax.grad`; it agrees with `jax.grad` to "
            f"{textbook_error:.1e}.",
            "",
            f"**Parallelism check**: one stage's forward run on both devices at once took "
            f"{slowdown_before:.2f}x (before) and {slowdown_after:.2f}x (after) the time of the "
            "same forward on one device alone. A device alone gets both cores from XLA's "
            "intra-op threads, so this is not time-sharing: the same forward took "
            f"{alone * 1e3:.2f} ms alone, {one_core * 1e3:.2f} ms alone pinned to one core "
            "(a copy of the script, `--one-core-forward-json`) and "
            f"{every * 1e3:.2f} ms on both devices at once, i.e. each device ran at "
            f"{one_core / every:.2f}x one core's speed. In the pipeline a device's action runs "
            "on about one core whether or not the other device computes (a device waiting in "
            "the tick's `ppermute` holds its thread), so the costs measured alone make every "
            "action look about that much cheaper than it runs; the contended column stretches "
            "the runs of ticks where both devices compute by the check's factor.",
            "",
            f"**Per-tick overhead of the lowering**: {overhead.per_tick * 1e3:.3f} ms per tick "
            f"and {overhead.fixed * 1e3:.2f} ms fixed per step, fitted on gpipe steps of a "
            f"width-8 MLP (compute negligible): {fit}.",
            "",
            *sections,
            f"Target: {TARGET}'s measured ratio to 1f1b within {TARGET_TOLERANCE:.0%} of the "
            f"predicted (makespan) ratio, as planned and with B and W kept split ({SPLIT}). "
            + "; ".join(verdicts)
            + ".",
            "",
            f"Figure: [step_time.png](figures/{figure.name}).",
            f"Machine load before: `{load_before}`; after: `{load_after}`.",
            f"Took {time.perf_counter() - began:.0f} s.",
        ]
    )
    path = write_section("step_time", body)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
