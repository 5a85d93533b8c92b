"""Lowering: a schedule and its stage programs become ONE ``shard_map`` program over the pp axis.

The program is a ``lax.scan`` over the ticks of ``zbjax.ticks.tick_tables``. Each tick, every
device reads what its action needs from its slot pools (a residual/stash slot, message slots
with received activations or cotangents, the microbatch's batch leaves), runs a ``lax.switch``
over (kind, stage) branches, and then writes back after the switch: residuals or W's stash
into a residual slot, W's parameter gradient into the running staged gradient, the loss into
the running loss sum. Finally the messages the action sends move with one ``ppermute`` per
distinct device shift (one flat operand per dtype) and are stored into message slots of the
receiving device as the tables say. Branches never return the big buffers (XLA would copy
them every tick); they return small payloads only.

All slot contents are flat per-dtype vectors; ``Packing`` says where each value sits in them.
The shard_map is manual over the pipeline axis only, so other mesh axes (data or tensor
parallel) stay with the compiler.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import jaxpr_as_fun
from jax.sharding import NamedSharding, PartitionSpec

from zbjax.errors import ScheduleError
from zbjax.params import (
    StagedLayout,
    StagedParams,
    dtype_name,
    pack_stage_gradients,
    staged_layout,
    unpack_stage_params,
)
from zbjax.schedules.ir import Schedule
from zbjax.split import forwarded_residuals
from zbjax.stages import StageGraph, StageProgram
from zbjax.ticks import (
    BACKWARD,
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    FORWARD,
    IDLE,
    MessageEdge,
    TickTables,
    incoming_messages,
    outgoing_messages,
    tick_tables,
)

_KIND_SCOPE = {FORWARD: "F", BACKWARD_INPUT: "B", BACKWARD_WEIGHT: "W", BACKWARD: "BW"}


@dataclass(frozen=True)
class Packing:
    """Where each value of a list sits in per-dtype flat vectors.

    ``items[i]`` is (dtype index into ``dtypes``, offset, shape) of value ``i``; ``sizes[k]``
    is how much of dtype ``k`` the values use.
    """

    dtypes: tuple[str, ...]
    items: tuple[tuple[int, int, tuple[int, ...]], ...]
    sizes: tuple[int, ...]


def packing(avals: Sequence[Any], dtypes: Sequence[str]) -> Packing:
    """Returns the packing of values shaped like ``avals`` into flat vectors of ``dtypes``."""
    dtypes = tuple(dtypes)
    sizes = [0] * len(dtypes)
    items = []
    for aval in avals:
        k = dtypes.index(dtype_name(aval.dtype))
        size = int(np.prod(aval.shape, dtype=np.int64))
        items.append((k, sizes[k], tuple(aval.shape)))
        sizes[k] += size
    return Packing(dtypes, tuple(items), tuple(sizes))


def pack(p: Packing, values: Sequence[jax.Array], capacity: Sequence[int]) -> list[jax.Array]:
    """Returns per dtype a flat vector of length ``capacity[k]`` holding ``values``."""
    pieces: list[list[jax.Array]] = [[] for _ in p.dtypes]
    for (k, _, _), value in zip(p.items, values, strict=True):
        pieces[k].append(jnp.ravel(value).astype(p.dtypes[k]))
    out = []
    for k, dt in enumerate(p.dtypes):
        pad = capacity[k] - p.sizes[k]
        parts = pieces[k] + ([jnp.zeros(pad, dt)] if pad else [])
        out.append(jnp.concatenate(parts) if parts else jnp.zeros(0, dt))
    return out


def unpack(p: Packing, flats: Sequence[jax.Array]) -> list[jax.Array]:
    """Returns the values that ``pack`` put into ``flats``."""
    out = []
    for k, offset, shape in p.items:
        size = int(np.prod(shape, dtype=np.int64))
        out.append(flats[k][offset : offset + size].reshape(shape))
    return out


def _union_dtypes(avals: Sequence[Any]) -> tuple[str, ...]:
    return tuple(sorted({dtype_name(a.dtype) for a in avals}))


def _is_float(aval: Any) -> bool:
    return jnp.issubdtype(aval.dtype, jnp.inexact)


def message_edges(graph: StageGraph) -> tuple[MessageEdge, ...]:
    """Returns the graph's edges as the tick tables see them (cotangents where src needs them)."""
    out = []
    for index, edge in enumerate(graph.edges):
        flags = _edge_flags(graph, graph.stages[edge.src], edge_index=index, output=True)
        out.append(MessageEdge(edge.src, edge.dst, any(flags)))
    return tuple(out)


def _edge_positions(graph: StageGraph, stage_index: int, output: bool) -> dict[int, range]:
    """Returns, per edge index, the positions of its values among the stage's inputs/outputs."""
    stage = graph.stages[stage_index]
    positions = {}
    start = 0
    for e in stage.out_edges if output else stage.in_edges:
        n = len(graph.edges[e].values)
        positions[e] = range(start, start + n)
        start += n
    return positions


def _edge_flags(graph: StageGraph, stage, edge_index: int, output: bool) -> list[bool]:
    flags = stage.output_differentiable if output else stage.input_differentiable
    return [flags[i] for i in _edge_positions(graph, stage.index, output)[edge_index]]


@dataclass(frozen=True)
class Lowering:
    """Everything the lowered step needs, computed once from graph, programs and schedule.

    ``step(staged_params, microbatched_batch_leaves)`` is the function to call inside
    ``jax.jit``: batch leaves have a leading ``num_microbatches`` axis; it returns
    ``(loss, staged_grads)`` with the loss averaged over microbatches. Mesh axes other than
    ``axis_name`` are data parallel: every batch leaf's rows (axis 1) are split over them, so
    the stage programs must have been traced for ``rows / data_parallel_size`` rows, and the
    loss and grads are averaged over them.
    """

    graph: StageGraph
    programs: tuple[StageProgram, ...]
    schedule: Schedule
    tables: TickTables
    layout: StagedLayout
    mesh: Any
    axis_name: str
    residual_dtypes: tuple[str, ...]
    residual_capacity: tuple[int, ...]
    message_dtypes: tuple[str, ...]
    message_capacity: tuple[int, ...]

    def slot_bytes(self) -> tuple[int, int]:
        """Returns the bytes of one residual slot and of one message slot."""
        res = sum(
            n * np.dtype(d).itemsize
            for d, n in zip(self.residual_dtypes, self.residual_capacity, strict=True)
        )
        msg = sum(
            n * np.dtype(d).itemsize
            for d, n in zip(self.message_dtypes, self.message_capacity, strict=True)
        )
        return res, msg

    @property
    def data_axes(self) -> tuple[str, ...]:
        """Returns the mesh axes other than the pipeline axis: data parallel, rows split."""
        return tuple(a for a in self.mesh.axis_names if a != self.axis_name)

    @property
    def data_parallel_size(self) -> int:
        """Returns how many data-parallel shards each microbatch's rows are split into."""
        return int(np.prod([self.mesh.shape[a] for a in self.data_axes], dtype=np.int64))

    def step(self, staged: StagedParams, batch_leaves: Sequence[jax.Array]):
        """Returns (mean loss, staged grads) of the pipelined step (call under ``jax.jit``)."""
        return _run(self, staged, tuple(batch_leaves))


def lower(
    graph: StageGraph,
    programs: Sequence[StageProgram],
    schedule: Schedule,
    mesh: Any,
    axis_name: str,
) -> Lowering:
    """Returns the lowering of ``schedule`` over ``programs`` on ``mesh``'s ``axis_name``."""
    programs = tuple(programs)
    missing = tuple(pair for pair in graph.edge_pairs if pair not in schedule.edges)
    if missing:
        if any(a >= b for a, b in missing):
            raise ScheduleError(
                f"the stage graph has edges {list(missing)} that schedule {schedule.name!r} "
                f"(edges {list(schedule.edges)}) does not know and that go backwards in stage "
                "order; build the schedule with edges=graph.edge_pairs"
            )
        # A skip edge i -> j (i < j) of the graph is implied by a chain schedule's order;
        # adding it lets the tick tables route its messages.
        schedule = dataclasses.replace(schedule, edges=schedule.edges + missing)
    tables = tick_tables(schedule, message_edges(graph))
    layout = staged_layout(
        graph.param_avals,
        [stage.param_leaves for stage in graph.stages],
        schedule.placement,
        schedule.num_devices,
    )
    slot_avals = [a for p in programs for a in (*stored_residual_avals(p), *p.stash_avals)]
    residual_dtypes = _union_dtypes(slot_avals)
    residual_capacity = [0] * len(residual_dtypes)
    for p in programs:
        for avals in (stored_residual_avals(p), p.stash_avals):
            sizes = packing(avals, residual_dtypes).sizes
            residual_capacity = [max(a, b) for a, b in zip(residual_capacity, sizes, strict=True)]
    edge_avals = [v for e in graph.edges for v in e.values]
    message_dtypes = _union_dtypes(edge_avals)
    message_capacity = [0] * len(message_dtypes)
    for e in graph.edges:
        sizes = packing(e.values, message_dtypes).sizes
        message_capacity = [max(a, b) for a, b in zip(message_capacity, sizes, strict=True)]
    return Lowering(
        graph=graph,
        programs=programs,
        schedule=schedule,
        tables=tables,
        layout=layout,
        mesh=mesh,
        axis_name=axis_name,
        residual_dtypes=residual_dtypes,
        residual_capacity=tuple(residual_capacity),
        message_dtypes=message_dtypes,
        message_capacity=tuple(message_capacity),
    )


def residual_sources(program: StageProgram) -> tuple[tuple[str, int], ...]:
    """Returns, per residual, where B finds it: ("slot", i), ("param", j) or ("batch", j).

    A residual that merely forwards a parameter or a batch leaf is read from the resident
    params or the microbatch at B time instead of being stored in a slot per microbatch
    (``split.forwarded_residuals``); ``i`` numbers the stored residuals, ``j`` indexes the
    stage's ``param_leaves`` or ``batch_leaves``.
    """
    num_params = len(program.stage.param_leaves)
    num_batch = len(program.stage.batch_leaves)
    sources = []
    stored = 0
    for index in forwarded_residuals(program):
        if index is not None and index < num_params:
            sources.append(("param", index))
        elif index is not None and index < num_params + num_batch:
            sources.append(("batch", index - num_params))
        else:
            sources.append(("slot", stored))
            stored += 1
    return tuple(sources)


def stored_residual_avals(program: StageProgram) -> tuple[Any, ...]:
    """Returns the avals of the residuals a slot stores (those not read from params/batch)."""
    return tuple(
        aval
        for aval, (where, _) in zip(program.residual_avals, residual_sources(program), strict=True)
        if where == "slot"
    )


def branch_keys(tables: TickTables) -> tuple[tuple[int, int], ...]:
    """Returns the (kind, stage) of every switch branch: idle first, then those the tables use."""
    used = sorted(
        {
            (int(k), int(s))
            for k, s in zip(tables.kind.ravel(), tables.stage.ravel(), strict=True)
            if int(k) != IDLE
        }
    )
    return ((IDLE, 0), *used)


def _make_branch(low: Lowering, kind: int, stage_index: int):
    """Returns the switch branch running action ``kind`` of stage ``stage_index``."""
    graph, tables, layout = low.graph, low.tables, low.layout
    num_devices = tables.num_devices
    edges = tables.edges
    msg_dtypes, msg_cap = low.message_dtypes, low.message_capacity
    res_dtypes, res_cap = low.residual_dtypes, low.residual_capacity
    num_micro = low.schedule.num_microbatches
    loss_aval = graph.stages[graph.loss_stage].jaxpr.out_avals[0]

    def zeros_outputs():
        sends = [
            [jnp.zeros(n * c, dt) for dt, c in zip(msg_dtypes, msg_cap, strict=True)]
            for n in tables.messages_per_shift
        ]
        residual = [jnp.zeros(c, dt) for dt, c in zip(res_dtypes, res_cap, strict=True)]
        grads = [
            jnp.zeros(c, dt) for dt, c in zip(layout.dtypes, layout.stage_capacity, strict=True)
        ]
        offsets = [jnp.zeros((), jnp.int32) for _ in layout.dtypes]
        return sends, residual, grads, offsets, jnp.zeros((), loss_aval.dtype)

    if kind == IDLE:
        return lambda *_: zeros_outputs()

    stage = graph.stages[stage_index]
    program = low.programs[stage_index]
    name = f"{_KIND_SCOPE[kind]} s{stage_index}"
    backward = kind in (BACKWARD_INPUT, BACKWARD)
    edge_packing = {e: packing(graph.edges[e].values, msg_dtypes) for e in range(len(edges))}
    reads = incoming_messages(edges, stage_index, backward)
    sent = outgoing_messages(edges, tables.placement, num_devices, stage_index, backward)
    shift_index = {shift: k for k, shift in enumerate(tables.shifts)}
    out_positions = _edge_positions(graph, stage_index, output=True)
    in_positions = _edge_positions(graph, stage_index, output=False)
    residual_packing = packing(stored_residual_avals(program), res_dtypes)
    sources = residual_sources(program)
    stash_packing = packing(program.stash_avals, res_dtypes)
    n_outputs = len(stage.output_differentiable)
    n_in_cts = sum(stage.input_differentiable)

    def place_sends(sends, values_of_edge):
        # Each message goes to its shift's payload at its position (capacity-sized blocks).
        for shift, position, e in sent:
            k = shift_index[shift]
            flats = pack(edge_packing[e], values_of_edge(e), msg_cap)
            for t in range(len(msg_dtypes)):
                start = position * msg_cap[t]
                sends[k][t] = sends[k][t].at[start : start + msg_cap[t]].set(flats[t])
        return sends

    def output_cotangents(messages):
        if stage_index == graph.loss_stage:
            return [jnp.full(loss_aval.shape, 1.0 / num_micro, loss_aval.dtype)]
        cts: list = [None] * n_outputs
        for j, e in enumerate(reads):
            values = unpack(edge_packing[e], messages[j])
            for pos, value in zip(out_positions[e], values, strict=True):
                cts[pos] = value
        return [ct for ct, flag in zip(cts, stage.output_differentiable, strict=True) if flag]

    def input_cotangent_sends(sends, in_cts):
        full: list = [None] * len(stage.input_differentiable)
        it = iter(in_cts)
        for pos, flag in enumerate(stage.input_differentiable):
            if flag:
                full[pos] = next(it)
        avals = [v for e in stage.in_edges for v in graph.edges[e].values]

        def values_of_edge(e):
            return [
                full[pos]
                if full[pos] is not None
                else jnp.zeros(avals[pos].shape, avals[pos].dtype)
                for pos in in_positions[e]
            ]

        return place_sends(sends, values_of_edge)

    def branch(param_rows, batch_mb, residual_buf, res_read, messages):
        # The slot is read here, by the branches that need it, so F and idle ticks copy
        # nothing out of the residual pool.
        def read_slot():
            return [jax.lax.dynamic_index_in_dim(b, res_read, keepdims=False) for b in residual_buf]

        with jax.named_scope(name):
            sends, res_out, grads, offsets, loss = zeros_outputs()
            if kind == FORWARD:
                params = unpack_stage_params(layout, stage_index, param_rows)
                batch = [batch_mb[i] for i in stage.batch_leaves]
                inputs: list = []
                for e in stage.in_edges:
                    inputs += unpack(edge_packing[e], messages[reads.index(e)])
                outs = jaxpr_as_fun(program.forward)(*params, *batch, *inputs)
                outputs, residuals = outs[:n_outputs], outs[n_outputs:]
                if stage_index == graph.loss_stage:
                    loss = outputs[0].astype(loss.dtype)
                else:
                    sends = place_sends(sends, lambda e: [outputs[p] for p in out_positions[e]])
                stored = [
                    r for r, (where, _) in zip(residuals, sources, strict=True) if where == "slot"
                ]
                res_out = pack(residual_packing, stored, res_cap)
            elif kind in (BACKWARD_INPUT, BACKWARD):
                stored = unpack(residual_packing, read_slot())
                resident = {
                    "slot": stored,
                    "param": unpack_stage_params(layout, stage_index, param_rows)
                    if any(where == "param" for where, _ in sources)
                    else [],
                    "batch": [batch_mb[i] for i in stage.batch_leaves],
                }
                residuals = [resident[where][j] for where, j in sources]
                jaxpr = program.backward_input if kind == BACKWARD_INPUT else program.backward
                outs = jaxpr_as_fun(jaxpr)(*residuals, *output_cotangents(messages))
                in_cts, rest = outs[:n_in_cts], outs[n_in_cts:]
                sends = input_cotangent_sends(sends, in_cts)
                if kind == BACKWARD_INPUT:
                    res_out = pack(stash_packing, rest, res_cap)
                else:
                    grads = _stage_gradients(layout, stage_index, rest)
                    offsets = [jnp.asarray(o, jnp.int32) for o in layout.stage_offset[stage_index]]
            else:  # BACKWARD_WEIGHT
                stash = unpack(stash_packing, read_slot())
                param_cts = jaxpr_as_fun(program.backward_weight)(*stash)
                grads = _stage_gradients(layout, stage_index, param_cts)
                offsets = [jnp.asarray(o, jnp.int32) for o in layout.stage_offset[stage_index]]
            return sends, res_out, grads, offsets, loss

    return branch


def _stage_gradients(layout: StagedLayout, stage_index: int, param_cts) -> list[jax.Array]:
    # Integer params have float0 cotangents; their gradient slot stays zero.
    fixed = []
    for slot, ct in zip(layout.stage_slots[stage_index], param_cts, strict=True):
        if ct.dtype == jax.dtypes.float0 or not jnp.issubdtype(slot.dtype, jnp.inexact):
            ct = jnp.zeros(slot.shape, slot.dtype)
        fixed.append(ct)
    return pack_stage_gradients(layout, stage_index, fixed)


def _tick_inputs(low: Lowering) -> tuple[np.ndarray, ...]:
    """Returns the per-tick tables the scan consumes, each ``[num_ticks, num_devices, ...]``."""
    tables = low.tables
    keys = branch_keys(tables)
    index = {key: i for i, key in enumerate(keys)}
    branch = np.zeros(tables.kind.shape, np.int32)
    for (t, d), k in np.ndenumerate(tables.kind):
        if k != IDLE:
            branch[t, d] = index[(int(k), int(tables.stage[t, d]))]
    return (
        branch,
        tables.microbatch,
        tables.residual_read,
        tables.residual_write,
        tables.message_read,
        tables.message_write,
    )


def _run(low: Lowering, staged: StagedParams, batch_leaves: tuple[jax.Array, ...]):
    axis = low.axis_name
    tables = low.tables
    branches = [_make_branch(low, kind, stage) for kind, stage in branch_keys(tables)]
    xs = tuple(jnp.asarray(x) for x in _tick_inputs(low))
    num_micro = low.schedule.num_microbatches
    loss_aval = low.graph.stages[low.graph.loss_stage].jaxpr.out_avals[0]
    res_slots = tables.num_residual_slots + 1
    msg_slots = tables.num_message_slots + 1
    data_axes = low.data_axes

    def device_program(rows, batch, xs):
        rows = [r[0] for r in rows]
        xs = tuple(x[:, 0] for x in xs)

        def zeros(shape, dtype):
            return jnp.zeros(shape, dtype)

        carry = (
            [
                zeros((res_slots, c), dt)
                for dt, c in zip(low.residual_dtypes, low.residual_capacity, strict=True)
            ],
            [
                zeros((msg_slots, c), dt)
                for dt, c in zip(low.message_dtypes, low.message_capacity, strict=True)
            ],
            [zeros(r.shape, r.dtype) for r in rows],
            zeros((), loss_aval.dtype),
        )

        def tick(carry, x):
            residual_buf, message_buf, grad_acc, loss_sum = carry
            branch, micro, res_read, res_write, msg_read, msg_write = x
            messages = [
                [jax.lax.dynamic_index_in_dim(b, msg_read[j], keepdims=False) for b in message_buf]
                for j in range(msg_read.shape[0])
            ]
            batch_mb = [jax.lax.dynamic_index_in_dim(b, micro, keepdims=False) for b in batch]
            sends, res_out, grads, offsets, loss = jax.lax.switch(
                branch, branches, rows, batch_mb, residual_buf, res_read, messages
            )
            residual_buf = [
                jax.lax.dynamic_update_index_in_dim(b, v, res_write, 0)
                for b, v in zip(residual_buf, res_out, strict=True)
            ]
            grad_acc = [
                jax.lax.dynamic_update_slice(
                    acc, jax.lax.dynamic_slice(acc, (off,), (g.shape[0],)) + g, (off,)
                )
                for acc, g, off in zip(grad_acc, grads, offsets, strict=True)
            ]
            for k, shift in enumerate(tables.shifts):
                payload = sends[k]
                if shift:
                    perm = [
                        (d, (d + shift) % tables.num_devices) for d in range(tables.num_devices)
                    ]
                    payload = jax.lax.ppermute(payload, axis, perm)
                for j in range(tables.messages_per_shift[k]):
                    message_buf = [
                        jax.lax.dynamic_update_index_in_dim(
                            b, p[j * c : (j + 1) * c], msg_write[k, j], 0
                        )
                        for b, p, c in zip(message_buf, payload, low.message_capacity, strict=True)
                    ]
            return (residual_buf, message_buf, grad_acc, loss_sum + loss), None

        (_, _, grad_acc, loss_sum), _ = jax.lax.scan(tick, carry, xs)
        loss = jax.lax.psum(loss_sum, axis) / num_micro
        if data_axes:
            # Each data-parallel shard saw an equal part of every microbatch: average.
            loss = jax.lax.pmean(loss, data_axes)
            grad_acc = [jax.lax.pmean(g, data_axes) for g in grad_acc]
        return loss, [g[None] for g in grad_acc]

    mesh = low.mesh
    in_specs = (
        [PartitionSpec(axis)] * len(staged.rows),
        [
            PartitionSpec(None, data_axes) if data_axes and b.ndim >= 2 else PartitionSpec()
            for b in batch_leaves
        ],
        tuple(PartitionSpec(None, axis) for _ in xs),
    )
    run = jax.shard_map(
        device_program,
        mesh=mesh,
        in_specs=in_specs,
        out_specs=(PartitionSpec(), [PartitionSpec(axis)] * len(staged.rows)),
        # Manual over every mesh axis: the other axes are data parallel, done by hand. Left to
        # the compiler, they put collectives inside the switch branches, which only the
        # devices of one pipeline stage take; on XLA:CPU those collectives deadlock.
        axis_names={axis, *data_axes},
        # The stage jaxprs were traced outside the shard_map, so their equations carry no
        # varying-axis annotations; evaluating them under vma checking would reject every
        # mix of a per-device value with a constant. Replication is tracked by hand here:
        # only the loss is psum-ed, everything else is per device.
        check_vma=False,
    )
    args = (list(staged.rows), list(batch_leaves), xs)
    if any(t == jax.sharding.AxisType.Explicit for t in getattr(mesh, "axis_types", ())):
        # Under explicit sharding shard_map takes inputs only when they already carry its
        # in_specs; reshard them (a no-op for inputs placed that way already).
        args = jax.tree.map(
            lambda x, spec: jax.reshard(x, NamedSharding(mesh, spec)),
            args,
            in_specs,
            is_leaf=lambda x: isinstance(x, PartitionSpec),
        )
    loss, grad_rows = run(*args)
    return loss, StagedParams(grad_rows, staged.dtypes)
