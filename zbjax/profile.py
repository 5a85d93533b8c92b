"""Measured costs: each stage's F, B and W jitted alone and timed on one device, and one
tick's exchange of messages between the devices.

The schedules and the lowering's tick packing take per-stage ``Costs``; the static estimates of
``cost_model`` are rough on small stages, so ``Pipeline.measure_costs`` times the very stage
programs the pipeline runs. B and W run as the lowering runs them: B writes only the stash
values W does not read in place (from a kept residual slot, a param or a batch leaf), so a
first stage's B, which has no input cotangent to compute, costs next to nothing.

Each action is timed as the tick loop runs it: several runs in one jitted loop, each writing
its outputs into a slot of pools the loop keeps between calls (``looped``). Timed as one call
each, every run would write freshly allocated outputs; on Linux the allocator hands large freed
blocks back to the system, so each call faults its output pages in again, which made a 2-stage
MLP's first forward measure 1.7x what it costs inside the pipeline (9.2 ms alone, 5.3 ms once
memory is reused). Written whole into buffers the loop carries, the outputs cost less than in
the pipeline, where XLA computes each into a buffer of its own and copies it into its slot:
pinned to one core, F measured 1.01-1.11x its whole-buffer cost, the MLP's B (which writes W's
stash) 1.07x, W and BW 1.01-1.04x (``benchmarks/slot_writes.py``), so whole-buffer costs made
the split B and W look cheaper next to the fused BW than they run.
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

from zbjax._jax_compat import shard_map
from zbjax.lower import Lowering, read_apart, reads_stash_apart, slot_layout
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


def weight_apart(args: Sequence[Any]) -> tuple[int, ...]:
    """Returns the ``apart`` positions for ``looped`` of ``lowered_b_and_w``'s W on the device
    ``args`` lie on (the first array's; the default device without any): its second argument,
    the values B wrote, where the lowering reads W's stash apart (``reads_stash_apart``)."""
    device = _device_of(args)
    return (1,) if reads_stash_apart([device or jax.devices()[0]]) else ()


def _device_of(args: Any) -> jax.Device | None:
    """Returns the device of the first array in ``args``, or None without any."""
    placed = [x for x in jax.tree.leaves(args) if isinstance(x, jax.Array)]
    return next(iter(placed[0].devices())) if placed else None


#: Runs of an action in one timed call of ``looped``.
LOOP_RUNS = 8
#: Slots of the pools ``looped`` writes an action's outputs into, run after run in turn.
LOOP_SLOTS = 2


def _first_inexact(leaves: Sequence[Any]) -> int | None:
    """Returns the index of the first non-empty float leaf, or None."""
    for i, x in enumerate(leaves):
        if jnp.issubdtype(jnp.result_type(x), jnp.inexact) and np.prod(np.shape(x)) > 0:
            return i
    return None


class Looped:
    """``fn`` jitted to run ``runs`` times per call in a ``fori_loop``, as the pipeline's tick
    loop runs an action (made by ``looped``).

    Each run writes its outputs into one slot of pools of ``slots`` slots, run after run in
    turn, as an action writes a slot of the lowering's pools: XLA computes the outputs into
    buffers of their own and copies them into the slot, a copy an output written whole does
    not pay. The pools stay allocated between calls (donated to each call, as the lowering's
    are with ``keep_buffers``), so no call pays for allocating or zeroing them. Each run's
    float arguments get the previous run's first float output times zero added, so XLA can
    neither hoist any part of a run out of the loop nor merge runs (it does not fold ``x * 0``
    for floats, which would turn a NaN into 0), and the runs follow one another as the
    pipeline's do. The additions stand for the pipeline's reads of its pools: where an operand
    must be contiguous (a matmul's), both copy it once. The arguments at positions ``apart``
    get theirs inside a conditional, as the lowering reads W's stash where
    ``zbjax.lower.reads_stash_apart`` says (``zbjax.lower.read_apart``).

    Calling it returns the pools (every output with a leading axis of ``slots``);
    ``outputs(pools)`` picks the last run's outputs out of them.
    """

    def __init__(self, fn: Callable[..., Any], runs: int, slots: int, apart: Sequence[int] = ()):
        if runs < 1:
            raise ValueError(f"runs={runs}; it must be at least 1")
        if slots < 1:
            raise ValueError(f"slots={slots}; it must be at least 1")
        self.fn, self.runs, self.slots, self.apart = fn, runs, slots, tuple(sorted(set(apart)))
        self._loop = jax.jit(self._run_loop, donate_argnums=0)
        last = (runs - 1) % slots
        self._take = jax.jit(lambda pools: jax.tree.map(lambda p: p[last], pools))
        self._pools: Any = None
        self._pools_for: Any = None
        self._args: tuple[Any, ...] | None = None

    def _run_loop(self, pools: Any, *args: Any) -> Any:
        if any(not 0 <= k < len(args) for k in self.apart):
            raise ValueError(
                f"apart={self.apart} names arguments that the {len(args)} arguments lack; "
                f"pass positions below {len(args)}"
            )
        leaves, treedef = jax.tree_util.tree_flatten(args)
        pool_leaves, pool_def = jax.tree_util.tree_flatten(pools)
        # Which leaves belong to the arguments read apart.
        starts = np.cumsum([0] + [len(jax.tree_util.tree_leaves(a)) for a in args])
        apart = [j for k in self.apart for j in range(starts[k], starts[k + 1])]

        def body(i, carry):
            link, written = carry

            def read(x):
                if jnp.issubdtype(x.dtype, jnp.inexact):
                    return x + link.astype(x.dtype)
                return x

            linked = [read(x) for x in leaves]
            if apart:
                read_off = read_apart(lambda: [read(leaves[j]) for j in apart], i)
                for j, x in zip(apart, read_off, strict=True):
                    linked[j] = x
            out_leaves = jax.tree_util.tree_leaves(
                self.fn(*jax.tree_util.tree_unflatten(treedef, linked))
            )
            slot = i % self.slots
            written = [
                jax.lax.dynamic_update_index_in_dim(p, o.astype(p.dtype), slot, 0)
                for p, o in zip(written, out_leaves, strict=True)
            ]
            source = _first_inexact(out_leaves)
            if source is not None:
                first = jnp.ravel(out_leaves[source])[0].astype(jnp.float32)
                link = first * jnp.float32(0.0)
            return link, written

        init = (jnp.zeros((), jnp.float32), pool_leaves)
        written = jax.lax.fori_loop(0, self.runs, body, init)[1]
        return jax.tree_util.tree_unflatten(pool_def, written)

    def _new_pools(self, args: Sequence[Any]) -> Any:
        """Returns zeroed pools for ``fn``'s outputs on ``args``, on the first argument's
        device."""
        out_avals = jax.eval_shape(self.fn, *args)
        pools = jax.tree.map(lambda a: jnp.zeros((self.slots, *a.shape), a.dtype), out_avals)
        device = _device_of(args)
        if device is not None:
            pools = jax.device_put(pools, device)
        return pools

    def _pools_key(self, args: Sequence[Any]) -> Any:
        leaves, treedef = jax.tree_util.tree_flatten(args)
        return treedef, tuple(
            (x.shape, x.dtype) if isinstance(x, jax.Array | np.ndarray) else (type(x), x)
            for x in leaves
        )

    def __call__(self, *args: Any) -> Any:
        """Runs ``fn`` ``runs`` times on ``args``; returns the pools its runs wrote, valid until
        the next call, which writes them again in place."""
        # The very arguments of the last call (as timing passes them) need no shape check.
        last = self._args
        same = last is not None and len(args) == len(last)
        if self._pools is None or not (
            same and all(a is b for a, b in zip(args, last, strict=True))
        ):
            key = self._pools_key(args)
            if self._pools is None or self._pools_for != key:
                self._pools, self._pools_for = self._new_pools(args), key
            self._args = args
        pools, self._pools = self._pools, None  # donated: not to be used again if the call fails
        self._pools = self._loop(pools, *args)
        return self._pools

    def outputs(self, pools: Any) -> Any:
        """Returns the last run's outputs from ``pools`` (what a call returned), as new
        arrays: the next call reuses the pools."""
        return self._take(pools)

    def lower(self, *args: Any) -> jax.stages.Lowered:
        """Returns the loop's ``Lowered`` for ``args`` (``.compile()`` works)."""
        return self._loop.lower(self._new_pools(args), *args)


def looped(
    fn: Callable[..., Any],
    runs: int = LOOP_RUNS,
    slots: int = LOOP_SLOTS,
    apart: Sequence[int] = (),
) -> Looped:
    """Returns ``fn`` run ``runs`` times per call in a loop writing its outputs into pools of
    ``slots`` slots kept between calls, as the pipeline's tick loop runs an action
    (``Looped``; ``apart``: the positions of the arguments read apart from the work, as the
    lowering reads W's stash on some platforms, ``zbjax.lower.read_apart``)."""
    return Looped(fn, runs, slots, apart)


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


def stage_cost_calls(
    graph: StageGraph,
    programs: Sequence[StageProgram],
    param_leaves: Sequence[jax.Array],
    batch_leaves: Sequence[jax.Array],
    slots: int = LOOP_SLOTS,
) -> list[tuple[Looped, Sequence[Any]]]:
    """Returns the (call, arguments) that time every stage's F, B, W and BW in that order,
    each ``looped`` with ``slots`` slots per output (``batch_leaves``: one microbatch, as the
    stage graph numbers them). Each call runs ``LOOP_RUNS`` runs."""
    calls: list[tuple[Looped, Sequence[Any]]] = []
    for index, program in enumerate(programs):
        forward_args, args = stage_arguments(graph, programs, param_leaves, batch_leaves, index)
        num_in = sum(graph.stages[index].input_differentiable)
        plain_b, plain_w = lowered_b_and_w(program, num_in)
        backward_input = looped(plain_b, slots=slots)
        backward_weight = looped(plain_w, slots=slots, apart=weight_apart(args))
        # W's inputs from the very B that is timed (its loop's outputs are B's), so B compiles
        # once.
        new = backward_input.outputs(backward_input(*args))[1]
        residuals = args[: len(program.residual_avals)]
        calls += [
            (looped(jaxpr_as_fun(program.forward), slots=slots), forward_args),
            (backward_input, args),
            (backward_weight, (residuals, new)),
            (looped(jaxpr_as_fun(program.backward), slots=slots), args),
        ]
    return calls


def measure_stage_costs(
    graph: StageGraph,
    programs: Sequence[StageProgram],
    param_leaves: Sequence[jax.Array],
    batch_leaves: Sequence[jax.Array],
    repeats: int = 10,
) -> Costs:
    """Returns per-stage median seconds of F, B, W and the fused backward BW (``Costs.bw``),
    each jitted alone on the device the arguments are on and run ``LOOP_RUNS`` times in a loop
    per timed call that writes its outputs into slot pools (``looped``), the calls of every
    stage alternating ``repeats`` times (``batch_leaves``: one microbatch, as the stage graph
    numbers them).

    Every stage is timed in every round, so load drift over the measurement hits all stages
    alike: timed stage after stage, a drift between them skewed the costs the planner
    balances (on this project's 2-core machine, one stage's F read 1.5x its cost of minutes
    before while the other's did not)."""
    _check_repeats(repeats)
    calls = stage_cost_calls(graph, programs, param_leaves, batch_leaves)
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
        shard_map(
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
