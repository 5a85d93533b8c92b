"""Measured costs: each stage's F, B and W jitted alone and timed on one device, and one
tick's exchange of messages between the devices.

The schedules and the lowering's tick packing take per-stage ``Costs``; the static estimates of
``cost_model`` are rough on small stages, so ``Pipeline.measure_costs`` times the very stage
programs the pipeline runs. B and W run as the lowering runs them: B writes only the stash
values W does not read in place (from a kept residual slot, a param or a batch leaf), so a
first stage's B, which has no input cotangent to compute, costs next to nothing.

Each action is timed as the tick loop runs it: several runs in one jitted loop whose outputs
go into buffers the loop carries (``looped``). Timed as one call each, every run would write
freshly allocated outputs; on Linux the allocator hands large freed blocks back to the system,
so each call faults its output pages in again, which made a 2-stage MLP's first forward measure
1.7x what it costs inside the pipeline (9.2 ms alone, 5.3 ms once memory is reused).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
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


#: Runs of an action in one timed call of ``looped``.
LOOP_RUNS = 8


def _first_inexact(leaves: Sequence[Any]) -> int | None:
    """Returns the index of the first non-empty float leaf, or None."""
    for i, x in enumerate(leaves):
        if jnp.issubdtype(jnp.result_type(x), jnp.inexact) and np.prod(np.shape(x)) > 0:
            return i
    return None


def looped(fn: Callable[..., Any], runs: int = LOOP_RUNS) -> Callable[..., Any]:
    """Returns ``fn`` jitted to run ``runs`` times in a ``fori_loop`` and return the last
    run's outputs, as the pipeline's tick loop runs an action.

    The outputs go into buffers the loop carries, allocated once per call, as the lowering's
    slot pools are once per step. Each run's float arguments get the previous run's first float
    output times zero added, so XLA can neither hoist any part of a run out of the loop nor
    merge runs (it does not fold ``x * 0`` for floats, which would turn a NaN into 0), and the
    runs follow one another as the pipeline's do. The additions stand for the pipeline's reads
    of its buffers: where an operand must be contiguous (a matmul's), both copy it once.
    """
    if runs < 1:
        raise ValueError(f"runs={runs}; it must be at least 1")

    @jax.jit
    def run(*args):
        leaves, treedef = jax.tree_util.tree_flatten(args)
        out_avals = jax.eval_shape(fn, *args)

        def body(_, carry):
            link, _ = carry
            linked = [
                x + link.astype(x.dtype) if jnp.issubdtype(x.dtype, jnp.inexact) else x
                for x in leaves
            ]
            outs = fn(*jax.tree_util.tree_unflatten(treedef, linked))
            out_leaves = jax.tree_util.tree_leaves(outs)
            source = _first_inexact(out_leaves)
            if source is None:
                return link, outs
            first = jnp.ravel(out_leaves[source])[0].astype(jnp.float32)
            return first * jnp.float32(0.0), outs

        init = (
            jnp.zeros((), jnp.float32),
            jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), out_avals),
        )
        return jax.lax.fori_loop(0, runs, body, init)[1]

    return run


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
    """Returns per-stage median seconds of F, B, W and the fused backward BW (``Costs.bw``),
    each jitted alone on the device the arguments are on and run ``LOOP_RUNS`` times in a loop
    per timed call (``looped``), the calls of every stage alternating ``repeats`` times
    (``batch_leaves``: one microbatch, as the stage graph numbers them).

    Every stage is timed in every round, so load drift over the measurement hits all stages
    alike: timed stage after stage, a drift between them skewed the costs the planner
    balances (on this project's 2-core machine, one stage's F read 1.5x its cost of minutes
    before while the other's did not)."""
    _check_repeats(repeats)
    calls = []
    for index, program in enumerate(programs):
        forward_args, args = stage_arguments(graph, programs, param_leaves, batch_leaves, index)
        num_in = sum(graph.stages[index].input_differentiable)
        backward_input, backward_weight = (looped(fn) for fn in lowered_b_and_w(program, num_in))
        # W's inputs from the very B that is timed (its loop's outputs are B's), so B compiles
        # once.
        new = backward_input(*args)[1]
        residuals = args[: len(program.residual_avals)]
        calls += [
            (looped(jaxpr_as_fun(program.forward)), forward_args),
            (backward_input, args),
            (backward_weight, (residuals, new)),
            (looped(jaxpr_as_fun(program.backward)), args),
        ]
    times = [t / LOOP_RUNS for t in median_times(calls, repeats)]
    f, b, w, bw = (tuple(times[k::4]) for k in range(4))
    return Costs(f, b, w, 0.0, bw=bw)


def measure_exchange(
    low: Lowering, repeats: int = 10, ticks: int = 20, messages: int | None = None
) -> float:
    """Returns the median seconds of one tick's exchange of ``low``: every shift's payload
    (``messages`` messages of the largest edge's size per message dtype; by default the
    shift's ``messages_per_shift``) ``ppermute``-d over the pipeline axis by all devices at
    once, as the tick loop does it.

    A loop of ``ticks`` exchanges runs jitted over the whole mesh, ``repeats`` times after a
    warm-up; the median divided by ``ticks`` is returned. It is a collective over every
    device of the mesh, so every process of a multi-process mesh must call it.
    """
    _check_repeats(repeats)
    call = _exchange_call(low, ticks, messages)
    if call is None:
        return 0.0
    (seconds,) = median_times([call], repeats)
    return seconds / ticks


def measure_exchange_costs(
    low: Lowering, repeats: int = 10, ticks: int = 20
) -> tuple[float, float]:
    """Returns ``(comm, comm_message)`` for ``Costs``: the seconds of one tick's exchange of
    one message per shift, and what a second message adds (at least 0), timed as
    ``measure_exchange`` does, the two alternating so that load drift hits both alike."""
    _check_repeats(repeats)
    calls = [_exchange_call(low, ticks, n) for n in (1, 2)]
    if calls[0] is None:  # nothing moves between devices, with one message or two
        return 0.0, 0.0
    one, two = (t / ticks for t in median_times(calls, repeats))
    return one, max(two - one, 0.0)


def _check_repeats(repeats: int) -> None:
    if repeats < 1:
        raise ValueError(f"repeats={repeats}; it must be at least 1")


def _exchange_call(
    low: Lowering, ticks: int, messages: int | None
) -> tuple[Callable[..., Any], tuple] | None:
    """Returns the jitted loop of ``ticks`` exchanges ``measure_exchange`` times and its
    arguments; None when nothing moves between devices."""
    if messages is not None and messages < 1:
        raise ValueError(f"messages={messages}; it must be at least 1 (or None)")
    tables, axis, mesh = low.tables, low.axis_name, low.mesh
    num_devices = tables.num_devices
    moving = [(k, s) for k, s in enumerate(tables.shifts) if s % num_devices]
    payloads = [
        [
            jnp.zeros((num_devices * n * c,), dt)
            for dt, c in zip(low.message_dtypes, low.message_capacity, strict=True)
        ]
        for n in (messages or tables.messages_per_shift[k] for k, _ in moving)
    ]
    if not payloads or not any(p.size for per_shift in payloads for p in per_shift):
        return None

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
    return run, (jax.device_put(payloads, sharding),)
