"""Measured costs: each stage's F, B and W jitted alone and timed on one device, and one
tick's exchange of messages between the devices.

The schedules and the lowering's tick packing take per-stage ``Costs``; the static estimates of
``cost_model`` are rough on small stages, so ``Pipeline.measure_costs`` times the very stage
programs the pipeline runs. B and W run as the lowering runs them: B writes only the stash
values W does not read in place (from a kept residual slot, a param or a batch leaf), so a
first stage's B, which has no input cotangent to compute, costs next to nothing.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend.core import jaxpr_as_fun
from jax.sharding import NamedSharding, PartitionSpec

from zbjax.lower import Lowering, slot_layout
from zbjax.schedules.ir import Costs
from zbjax.split import forwarded_stash
from zbjax.stages import StageGraph, StageProgram


def _random_like(key: jax.Array, aval: Any) -> jax.Array:
    if jnp.issubdtype(aval.dtype, jnp.inexact):
        return jax.random.normal(key, aval.shape, aval.dtype)
    return jnp.zeros(aval.shape, aval.dtype)


def stage_arguments(
    graph: StageGraph,
    programs: Sequence[StageProgram],
    param_leaves: Sequence[jax.Array],
    batch_leaves: Sequence[jax.Array],
    stage_index: int,
) -> tuple[list[jax.Array], list[jax.Array]]:
    """Returns (F's arguments, B's and BW's arguments) of stage ``stage_index`` for one
    microbatch (``batch_leaves``: the microbatch's leaves as the stage graph numbers them).

    The stages up to ``stage_index`` run their forwards in index order (a topological order)
    on the real microbatch, so F gets real inputs and B real residuals; the output cotangents
    are random normals of the right shapes (timing does not depend on them).
    """
    sent: dict[int, list[Any]] = {}
    for stage in graph.stages[: stage_index + 1]:
        args = (
            stage.param_inputs(list(param_leaves))
            + [batch_leaves[i] for i in stage.batch_leaves]
            + [v for e in stage.in_edges for v in sent[e]]
        )
        outs = list(jax.jit(jaxpr_as_fun(programs[stage.index].forward))(*args))
        num_out = len(stage.output_differentiable)
        start = 0
        for e in stage.out_edges:
            n = len(graph.edges[e].values)
            sent[e] = outs[start : start + n]
            start += n
    residuals = outs[num_out:]
    stage = graph.stages[stage_index]
    if stage_index == graph.loss_stage:
        return args, residuals + [jnp.asarray(1.0, stage.jaxpr.out_avals[0].dtype)]
    keys = iter(jax.random.split(jax.random.key(2), num_out))
    cts = [
        _random_like(next(keys), aval)
        for aval, differentiable in zip(
            stage.jaxpr.out_avals, stage.output_differentiable, strict=True
        )
        if differentiable
    ]
    return args, residuals + cts


def stash_forwarded(program: StageProgram) -> list[int | None]:
    """Returns, per stash value W reads, the residual index it is read from (None: B writes it),
    as the lowering lays the stash out (``zbjax.lower.slot_layout``)."""
    return [
        f if where != "stash" else None
        for f, (where, _) in zip(forwarded_stash(program), slot_layout(program).stash, strict=True)
    ]


def lowered_b_and_w(program: StageProgram, num_in: int) -> tuple[Callable, Callable]:
    """Returns B and W of ``program`` jitted as the lowering runs them.

    B(*backward args) returns (input cotangents, the stash values W does not find elsewhere);
    W(residuals, those values) reads the others where they are (a kept residual slot, a param,
    a batch leaf), as ``zbjax.lower.slot_layout`` decides.
    """
    forwarded = stash_forwarded(program)
    b_program = jaxpr_as_fun(program.backward_input)
    w_program = jaxpr_as_fun(program.backward_weight)

    @jax.jit
    def backward_input(*args):
        outs = b_program(*args)
        stash = outs[num_in:]
        return outs[:num_in], [v for v, f in zip(stash, forwarded, strict=True) if f is None]

    @jax.jit
    def backward_weight(residuals, new):
        computed = iter(new)
        stash = [next(computed) if f is None else residuals[f] for f in forwarded]
        return w_program(*stash)

    return backward_input, backward_weight


def median_times(calls: Sequence[tuple[Callable[..., Any], Sequence[Any]]], repeats: int):
    """Returns the median seconds of each (fn, args) call after a warm-up, the calls
    alternating so that load drift hits all alike."""
    for fn, args in calls:
        jax.block_until_ready(fn(*args))
    times: list[list[float]] = [[] for _ in calls]
    for _ in range(repeats):
        for k, (fn, args) in enumerate(calls):
            began = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times[k].append(time.perf_counter() - began)
    return [statistics.median(t) for t in times]


def measure_stage_costs(
    graph: StageGraph,
    programs: Sequence[StageProgram],
    param_leaves: Sequence[jax.Array],
    batch_leaves: Sequence[jax.Array],
    repeats: int = 10,
) -> Costs:
    """Returns per-stage median seconds of F, B and W, each jitted alone on the device the
    arguments are on (``batch_leaves``: one microbatch, as the stage graph numbers them)."""
    if repeats < 1:
        raise ValueError(f"repeats={repeats}; it must be at least 1")
    f, b, w = [], [], []
    for index, program in enumerate(programs):
        forward_args, args = stage_arguments(graph, programs, param_leaves, batch_leaves, index)
        num_in = sum(graph.stages[index].input_differentiable)
        backward_input, backward_weight = lowered_b_and_w(program, num_in)
        new = backward_input(*args)[1]
        residuals = args[: len(program.residual_avals)]
        calls = [
            (jax.jit(jaxpr_as_fun(program.forward)), forward_args),
            (backward_input, args),
            (backward_weight, (residuals, new)),
        ]
        tf, tb, tw = median_times(calls, repeats)
        f.append(tf)
        b.append(tb)
        w.append(tw)
    return Costs(tuple(f), tuple(b), tuple(w), 0.0)


def measure_exchange(low: Lowering, repeats: int = 10, ticks: int = 20) -> float:
    """Returns the median seconds of one tick's exchange of ``low``: every shift's payload
    (``messages_per_shift`` messages of the largest edge's size, per message dtype)
    ``ppermute``-d over the pipeline axis by all devices at once, as the tick loop does it.

    A loop of ``ticks`` exchanges runs jitted over the whole mesh, ``repeats`` times after a
    warm-up; the median divided by ``ticks`` is returned. It is a collective over every
    device of the mesh, so every process of a multi-process mesh must call it.
    """
    if repeats < 1:
        raise ValueError(f"repeats={repeats}; it must be at least 1")
    tables, axis, mesh = low.tables, low.axis_name, low.mesh
    num_devices = tables.num_devices
    moving = [(k, s) for k, s in enumerate(tables.shifts) if s % num_devices]
    payloads = [
        [
            jnp.zeros((num_devices * n * c,), dt)
            for dt, c in zip(low.message_dtypes, low.message_capacity, strict=True)
        ]
        for n in (tables.messages_per_shift[k] for k, _ in moving)
    ]
    if not payloads or not any(p.size for per_shift in payloads for p in per_shift):
        return 0.0

    def exchange(payloads):
        def tick(carry, _):
            out = []
            for (_, shift), per_shift in zip(moving, carry, strict=True):
                perm = [(d, (d + shift) % num_devices) for d in range(num_devices)]
                out.append([jax.lax.ppermute(p, axis, perm) for p in per_shift])
            return out, None

        return jax.lax.scan(tick, payloads, None, length=ticks)[0]

    spec = [[PartitionSpec(axis)] * len(per_shift) for per_shift in payloads]
    run = jax.jit(
        jax.shard_map(
            exchange,
            mesh=mesh,
            in_specs=(spec,),
            out_specs=spec,
            axis_names=set(mesh.axis_names),
            check_vma=False,
        )
    )
    sharding = NamedSharding(mesh, PartitionSpec(axis))
    payloads = jax.device_put(payloads, sharding)
    (seconds,) = median_times([(run, (payloads,))], repeats)
    return seconds / ticks
