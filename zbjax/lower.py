"""Lowering: a schedule and its stage programs become ONE ``shard_map`` program over the pp axis.

The program is a ``lax.scan`` over the ticks of ``zbjax.ticks.tick_tables``. Each tick, every
device runs at most one action (F, B, W or BW of one stage). The actions are a sequence of
two-way ``lax.cond``s, one per (kind, stage), of which the tick's action code selects one; an
action reads and updates the device's buffers in place: F writes its residuals into a residual
slot (those only B reads) and a kept slot (those W reads too), B reads both and writes what W
needs beyond them into a stash slot (or over the residuals only B read: ``slot_layout``'s
overlay), W reads the kept and stash slots, W and BW add their weight gradients into the
device's gradient row, and F, B and BW put the messages they send into the tick's send payloads,
at the positions the tables give them (the messages a device sends over one shift in one tick,
from any of its lanes, share one exchange). Then every payload moves with one ``ppermute`` per
distinct device shift (one flat operand per dtype) and is stored into message slots of the
receiving device as the tables say. The actions' conditionals hold no collective (devices take
different branches); a shift's ``ppermute`` sits in a ``lax.switch`` of its own where some ticks
send nothing over it or send fewer messages than others, on a code every device reads alike
(``TickTables.payload_blocks``, ``exchange_sizes``): each tick moves only the positions it
filled, a tick that sends nothing skips the exchange, and since the exchange is where devices
wait for each other, a device then runs on into its next tick's actions instead of waiting for
the slowest one.

Why two-way conds: with one multi-way ``lax.switch``, or with a branch that reads and writes the
same buffer without every read ordered before the first write, XLA copies the whole buffer on
every tick; a two-way cond per action whose branches read one buffer and write another (or,
for a B that writes where it reads, read it in a nested conditional before writing it) keeps
every buffer in place, so a tick costs what its action reads and writes.

The residual, kept and stash data live in *arenas* (``zbjax.ticks.arenas``): flat buffers per
dtype on every device, one shared by the three kinds or one per kind, where each (stage,
microbatch) takes its own stage's size for as long as it lives, beside the others alive at the
same time; ``Packing`` and ``SlotLayout`` say where each value sits in its item. The
shard_map is manual over every mesh axis; the axes other than the pipeline axis are data
parallel (rows split, gradients averaged).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from zbjax._jax_compat import (
    eval_jaxpr_here,
    on_device_memory,
    place_for_shard_map,
    set_rows,
    shard_map,
    uninitialized,
)
from zbjax.errors import ScheduleError
from zbjax.microbatch import backward_seed
from zbjax.params import (
    StagedLayout,
    StagedParams,
    dtype_name,
    reduce_wide,
    staged_layout,
    sum_shared_gradients,
    unpack_stage_params,
    wide_dtype,
    write_slots,
)
from zbjax.schedules.ir import Action, Costs, Schedule
from zbjax.split import forwarded_residuals, forwarded_stash
from zbjax.stages import StageGraph, StageProgram
from zbjax.tensor import from_blocks, per_shard, to_blocks, value_splits
from zbjax.ticks import (
    ARENA_GROUPS,
    BACKWARD,
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    FORWARD,
    IDLE,
    KIND_NAMES,
    PHASES,
    Arenas,
    MessageEdge,
    TickTables,
    arena_floor,
    arenas,
    incoming_messages,
    outgoing_messages,
    plan_ticks,
    tick_tables,
    with_lives,
)

_KIND_SCOPE = {FORWARD: "F", BACKWARD_INPUT: "B", BACKWARD_WEIGHT: "W", BACKWARD: "BW"}


@dataclass(frozen=True)
class Packing:
    """Where each value of a list sits in per-dtype flat vectors.

    ``items[i]`` is (dtype index into ``dtypes``, offset, shape, split) of value ``i``;
    ``sizes[k]`` is how much of dtype ``k`` the values use. Over a tensor axis of T devices a
    value split along dimension ``split`` (None: whole) is stored as its part on each device:
    ``shape`` and offsets are then a part's, in each device's block of the flat vector.
    """

    dtypes: tuple[str, ...]
    items: tuple[tuple[int, int, tuple[int, ...], int | None], ...]
    sizes: tuple[int, ...]


def packing(
    avals: Sequence[Any],
    dtypes: Sequence[str],
    splits: Sequence[int | None] | None = None,
    tensor_size: int = 1,
) -> Packing:
    """Returns the packing of values shaped like ``avals`` into flat vectors of ``dtypes``,
    each value split along ``splits[i]`` over a tensor axis of ``tensor_size`` devices."""
    dtypes = tuple(dtypes)
    sizes = [0] * len(dtypes)
    items = []
    for i, aval in enumerate(avals):
        k = dtypes.index(dtype_name(aval.dtype))
        split = splits[i] if splits is not None else None
        shape = list(aval.shape)
        if split is not None:
            shape[split] //= tensor_size
        size = int(np.prod(shape, dtype=np.int64))
        items.append((k, sizes[k], tuple(shape), split))
        sizes[k] += size
    return Packing(dtypes, tuple(items), tuple(sizes))


def pack(p: Packing, values: Sequence[jax.Array], capacity: Sequence[int]) -> list[jax.Array]:
    """Returns per dtype a flat vector of length ``capacity[k]`` holding ``values``."""
    pieces: list[list[jax.Array]] = [[] for _ in p.dtypes]
    for (k, *_), value in zip(p.items, values, strict=True):
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
    for k, offset, shape, _ in p.items:
        size = int(np.prod(shape, dtype=np.int64))
        out.append(jnp.reshape(jax.lax.slice_in_dim(flats[k], offset, offset + size), shape))
    return out


def _union_dtypes(avals: Sequence[Any]) -> tuple[str, ...]:
    return tuple(sorted({dtype_name(a.dtype) for a in avals}))


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
class SlotLayout:
    """Where one stage's values sit in the device's residual, kept and stash slots.

    Sources name where a value is found: ("residual", (k, offset, shape)) in a residual slot,
    ("kept", (k, offset, shape)) in a kept slot, ("stash", (k, offset, shape)) in a stash slot
    (``k`` indexes the lowering's slot dtypes, offsets are into the slot's flat vector of that
    dtype), or ("param", j) / ("batch", j) for values that merely forward the stage's ``j``-th
    param or batch leaf. ``residuals[i]`` is where B (or BW) finds residual ``i``; ``stash[i]``
    where W finds stash value ``i``. ``residual_sizes``/``kept_sizes``/``stash_sizes`` are the
    elements used per dtype. With ``overlay``, what B stashes ("overlay" sources, offsets into
    the overlay region) goes into the residual slot's overlay region, which starts right after
    ``weight_residual_sizes`` (the residuals W reads there, first in the slot);
    ``stash_sizes`` is then the region it needs.
    """

    residuals: tuple[tuple[str, Any], ...]
    stash: tuple[tuple[str, Any], ...]
    residual_sizes: tuple[int, ...]
    kept_sizes: tuple[int, ...]
    stash_sizes: tuple[int, ...]
    weight_residual_sizes: tuple[int, ...] = ()

    @property
    def overlay(self) -> bool:
        """Returns whether B writes W's stash over its residual slot ("overlay" sources)."""
        return any(where == "overlay" for where, _ in self.stash)

    @property
    def has_kept(self) -> bool:
        """Returns whether the stage stores anything in a kept slot."""
        return any(self.kept_sizes)

    @property
    def weight_reads_residuals(self) -> bool:
        """Returns whether W reads the residual slot (which then lives until W)."""
        return any(where in ("residual", "overlay") for where, _ in self.stash)


def slot_layout(
    program: StageProgram,
    dtypes: Sequence[str] | None = None,
    whole: bool | None = False,
    overlay: bool = False,
    splits: tuple[Sequence[int | None], Sequence[int | None]] | None = None,
    tensor_size: int = 1,
) -> SlotLayout:
    """Returns ``program``'s slot layout over per-dtype vectors of ``dtypes`` (by default the
    dtypes of its own residuals and stash).

    ``splits`` (per residual, per stash value: the dimension split over a tensor axis of
    ``tensor_size`` devices, or None) stores split values as their parts (``packing``).

    W reads some residuals too (``split.forwarded_stash``: the ``x`` of ``x @ A``); it reads
    them where F stored them, so B copies nothing for W and writes into the stash slot only
    what F did not store. Where F stores them:

    - ``whole=False``: in a kept slot, which lives until W, and the others in a residual slot,
      free after B: the Zero Bubble memory model (M_B freed at B, what W needs kept until W).
    - ``whole=True``: every residual in the residual slot, which then lives until W (one pool
      instead of two: fewer bytes when W reads nearly all of them, as on a first stage whose B
      has no input cotangent to compute).
    - ``whole=None``: ``True`` when at most ``WHOLE_SLOT_WASTE`` of the stored bytes would be
      held until W for nothing, else ``False``.

    With ``overlay``, what B stashes for W goes into B's own residual slot, over residuals only
    B read (the slot's overlay region, after W's residuals, which come first), instead of into
    a stash slot: the slot then lives until W and needs max(residuals, W's residuals plus the
    stash), not residuals and stash side by side (the paper's M_W replacing M_B after B).
    """
    if dtypes is None:
        dtypes = _union_dtypes([*stored_residual_avals(program), *program.stash_avals])
    dtypes = tuple(dtypes)
    sources = residual_sources(program)
    stored_avals = stored_residual_avals(program)
    forwarded = forwarded_stash(program)
    read_by_w = {sources[f][1] for f in forwarded if f is not None and sources[f][0] == "slot"}
    if whole is None:
        unread = sum(_nbytes(a) for j, a in enumerate(stored_avals) if j not in read_by_w)
        whole = bool(read_by_w) and unread <= WHOLE_SLOT_WASTE * sum(map(_nbytes, stored_avals))
    in_kept = [not whole and j in read_by_w for j in range(len(stored_avals))]
    kept_index = [j for j, k in enumerate(in_kept) if k]
    # W's residuals first, so that an overlaid stash goes after them, over B's.
    rest_index = [j for j, k in enumerate(in_kept) if not k]
    rest_index.sort(key=lambda j: j not in read_by_w)
    if splits is None:
        stored_splits, stash_splits = [None] * len(stored_avals), [None] * len(forwarded)
    else:
        stored_splits = [
            s for s, (where, _) in zip(splits[0], sources, strict=True) if where == "slot"
        ]
        stash_splits = list(splits[1])

    def pack_of(index):
        return packing(
            [stored_avals[j] for j in index], dtypes, [stored_splits[j] for j in index], tensor_size
        )

    kept, rest = pack_of(kept_index), pack_of(rest_index)
    item = {
        **{j: ("kept", i) for j, i in zip(kept_index, kept.items, strict=True)},
        **{j: ("residual", i) for j, i in zip(rest_index, rest.items, strict=True)},
    }
    residuals = tuple(item[j] if where == "slot" else (where, j) for where, j in sources)
    fresh = [i for i, f in enumerate(forwarded) if f is None]
    new = packing(
        [program.stash_avals[i] for i in fresh],
        dtypes,
        [stash_splits[i] for i in fresh],
        tensor_size,
    )
    weight_sizes = [0] * len(dtypes)
    for j, (k, offset, shape, _) in zip(rest_index, rest.items, strict=True):
        if j in read_by_w:
            weight_sizes[k] = max(weight_sizes[k], offset + int(np.prod(shape, dtype=np.int64)))
    written = iter(new.items)
    where_new = "overlay" if overlay else "stash"
    stash = tuple(residuals[f] if f is not None else (where_new, next(written)) for f in forwarded)
    return SlotLayout(residuals, stash, rest.sizes, kept.sizes, new.sizes, tuple(weight_sizes))


#: ``slot_layout(whole=None)`` keeps a stage's whole residual slot until W when at most this
#: share of it would be held for nothing (W reads the rest), instead of a separate kept slot.
WHOLE_SLOT_WASTE = 0.1


def _nbytes(aval: Any) -> int:
    return int(np.prod(aval.shape, dtype=np.int64)) * np.dtype(aval.dtype).itemsize


def _slot_bytes(dtypes: Sequence[str], capacity: Sequence[int]) -> int:
    return sum(n * np.dtype(d).itemsize for d, n in zip(dtypes, capacity, strict=True))


@dataclass(frozen=True)
class Lowering:
    """Everything the lowered step needs, computed once from graph, programs and schedule.

    ``step(staged_params, microbatched_batch_leaves)`` is the function to call inside
    ``jax.jit``: batch leaves have a leading ``num_microbatches`` axis; it returns
    ``(loss, staged_grads)`` with the loss averaged over microbatches (``((loss, aux),
    staged_grads)`` when the graph has ``aux_treedef``, each aux leaf averaged the same way).
    Mesh axes other than ``axis_name`` are data parallel: every batch leaf's rows (axis 1) are
    split over them, so the stage programs must have been traced for ``rows /
    data_parallel_size`` rows, and the loss and grads are averaged over them.
    """

    graph: StageGraph
    programs: tuple[StageProgram, ...]
    schedule: Schedule
    tables: TickTables
    layout: StagedLayout
    mesh: Any
    axis_name: str
    slot_dtypes: tuple[str, ...]
    slot_layouts: tuple[SlotLayout, ...]
    #: Per dtype, the largest stage's residual, kept and stash item: what one slot of each
    #: kind would hold (``slot_bytes``; the arenas give each item its own stage's size).
    residual_capacity: tuple[int, ...]
    kept_capacity: tuple[int, ...]
    stash_capacity: tuple[int, ...]
    #: Per dtype, the largest overlay region: where a stage's B writes W's stash over
    #: residuals only B read, right after those its W reads (``SlotLayout.overlay``); zero
    #: when the stash has slots of its own.
    overlay_capacity: tuple[int, ...]
    message_dtypes: tuple[str, ...]
    message_capacity: tuple[int, ...]
    #: Where the residual, kept and stash data of each (stage, microbatch) lie: the buffers
    #: the tick loop keeps them in (``pool_avals``), sized by what is alive at once.
    arenas: Arenas
    #: The batch leaf holding each microbatch's PRNG key (``[m]`` typed keys or ``[m, 2]``
    #: raw ones), or None: it is not split over the data axes; data-parallel shard ``s``
    #: folds ``s`` into its microbatch's key, so the shards draw independent bits.
    key_leaf: int | None = None

    def slot_bytes(self) -> tuple[int, int, int, int]:
        """Returns the bytes of one residual, kept, stash and message slot."""
        return (
            _slot_bytes(self.slot_dtypes, self.residual_capacity),
            _slot_bytes(self.slot_dtypes, self.kept_capacity),
            _slot_bytes(self.slot_dtypes, self.stash_capacity),
            _slot_bytes(self.message_dtypes, self.message_capacity),
        )

    @property
    def data_axes(self) -> tuple[str, ...]:
        """Returns the mesh axes other than the pipeline and tensor axes: data parallel, rows
        split."""
        skip = (self.axis_name, self.layout.tensor_axis)
        return tuple(a for a in self.mesh.axis_names if a not in skip)

    @property
    def pool_spec(self) -> PartitionSpec:
        """Returns how the arenas lie on the mesh: every device its own."""
        return PartitionSpec(self.axis_name, self.data_axes or None)

    @property
    def data_parallel_size(self) -> int:
        """Returns how many data-parallel shards each microbatch's rows are split into."""
        return int(np.prod([self.mesh.shape[a] for a in self.data_axes], dtype=np.int64))

    def arena_bytes(self) -> tuple[int, ...]:
        """Returns the bytes of each of one device's arena buffers (``Arenas.sizes``; per
        tensor-axis device: its parts)."""
        return tuple(_slot_bytes(self.slot_dtypes, n) for n in self.arenas.sizes)

    def slot_pool_bytes(self) -> int:
        """Returns the bytes one device keeps the residual, kept and stash data in (its
        arenas, ``pool_avals``)."""
        return sum(self.arena_bytes())

    def pool_avals(self) -> tuple[jax.ShapeDtypeStruct, ...]:
        """Returns the arenas' shapes, ``[pp devices, data-parallel shards, rows, elements]``
        each (``Arenas.shape``), per arena buffer (``Arenas.sizes``) per slot dtype."""
        d, dp = self.tables.num_devices, self.data_parallel_size
        # Over a tensor axis of T devices, [..., rows, T, elements]: each its parts.
        T = self.layout.tensor_size
        blocks = (T,) if T > 1 else ()
        return tuple(
            jax.ShapeDtypeStruct((d, dp, rows, *blocks, length), dt)
            for b in range(len(self.arenas.sizes))
            for k, dt in enumerate(self.slot_dtypes)
            for rows, length in [self.arenas.shape(b, k)]
        )

    def pool_shardings(self) -> list[NamedSharding]:
        """Returns where each arena lies: each device's rows on it (over a tensor axis, each
        device its parts), spelled with one entry per dimension. ``new_pools`` makes them so
        and ``step`` returns them so: P("pp", "dp") and P("pp", "dp", None, None) are
        different types to jit, which would compile a user's step again for the arenas it
        returned."""
        entries = list(self.pool_spec)
        if self.layout.tensor_size > 1:
            entries += [None, self.layout.tensor_axis]
        explicit = all(t == jax.sharding.AxisType.Explicit for t in self.mesh.axis_types)
        out = []
        for a in self.pool_avals():
            spec = entries + [None] * (len(a.shape) - len(entries))
            # A result's sharding has one entry per dimension where its type holds it (every
            # mesh axis explicit); else JAX spells it without the trailing Nones.
            if not explicit:
                while spec and spec[-1] is None:
                    spec.pop()
            out.append(NamedSharding(self.mesh, PartitionSpec(*spec)))
        return out

    def new_pools(self) -> list[jax.Array]:
        """Returns fresh arenas to pass to ``step`` (zeros, each device's rows on it)."""
        return [
            jax.jit(lambda a=a: jnp.zeros(a.shape, a.dtype), out_shardings=sharding)()
            for a, sharding in zip(self.pool_avals(), self.pool_shardings(), strict=True)
        ]

    def step(
        self,
        staged: StagedParams,
        batch_leaves: Sequence[jax.Array],
        pools: Sequence[jax.Array] | None = None,
    ):
        """Returns (mean loss, staged grads) of the pipelined step (call under ``jax.jit``).

        Each device's grads stay in its row; every copy of a tied leaf holds the leaf's whole
        gradient (``unstage_leaves`` gives the user-layout gradients).

        With ``pools`` (from ``new_pools`` or a previous step) the step keeps its residuals and
        W's stash in them instead of allocating new ones, and returns (loss, grads, pools):
        donate them to the jitted step and pass the returned ones to the next, and no step
        spends time initialising slot memory. Their contents between steps mean nothing.
        """
        return _run(self, staged, tuple(batch_leaves), None if pools is None else list(pools))


class TickPlan(NamedTuple):
    """``ticks.plan_ticks(source, costs, ...)``'s result: the schedule to run (``source``
    with some backwards fused) and each action's (tick, lane)."""

    source: Schedule
    schedule: Schedule
    positions: dict[Action, tuple[int, int]]


def lower(
    graph: StageGraph,
    programs: Sequence[StageProgram],
    schedule: Schedule,
    mesh: Any,
    axis_name: str,
    costs: Costs | None = None,
    tensor: tuple[str, int, Sequence[int | None]] | None = None,
    key_leaf: int | None = None,
    planned: TickPlan | None = None,
) -> Lowering:
    """Returns the lowering of ``schedule`` over ``programs`` on ``mesh``'s ``axis_name``.

    ``key_leaf`` is the batch leaf that holds the microbatches' PRNG keys (``Lowering.key_leaf``).
    ``planned`` is ``ticks.plan_ticks``'s result for ``schedule`` and ``costs``, made already
    (it takes seconds on 8 devices); it is used when its ``source`` is ``schedule``.

    ``tensor`` (tensor-parallel axis, its size, per param leaf the dimension it splits or None)
    lays the staged params out split over that axis (``params.staged_layout``); the axis is
    left to the compiler inside the ``shard_map``, which partitions each stage's equations.

    With ``costs`` (per-stage F/B/W times, any unit), devices that finish a tick's action early
    also run the next actions that fit in the rest of the tick, or the ticks are laid out
    around the fewest exchanges (``ticks.choose_ticks``), and a stage whose B computes nothing,
    or whose B and W cost more than its fused backward, runs its backward fused where that
    shortens the ticks (``ticks.plan_ticks``); ``Lowering.schedule`` is the schedule that
    runs.
    """
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
    # A stage with no differentiable input (the first) has an empty B: its whole backward is
    # W. Run it fused where B stood when the costs say the ticks get shorter; so too any stage
    # whose split costs more than deferring its W saves.
    empty_backward = graph.empty_backward
    if planned is not None and planned.source == schedule:
        schedule, positions = planned.schedule, dict(planned.positions)
    else:
        schedule, positions = plan_ticks(schedule, costs, empty_backward)
    slot_dtypes = _union_dtypes(
        [a for p in programs for a in (*stored_residual_avals(p), *p.stash_avals)]
    )
    splits, tensor_size = None, 1
    if tensor is not None:
        tensor_size = tensor[1]
        splits = [_tensor_splits(p, tensor) for p in programs]
    slot_layouts, tables, capacities, arena = _slots_and_tables(
        programs, slot_dtypes, schedule, graph, positions, splits, tensor_size
    )
    residual_capacity, kept_capacity, stash_capacity, overlay_capacity = capacities
    layout = staged_layout(
        graph.param_avals,
        [stage.param_leaves for stage in graph.stages],
        schedule.placement,
        schedule.num_devices,
        [stage.param_slices() for stage in graph.stages],
        tensor,
    )
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
        slot_dtypes=slot_dtypes,
        slot_layouts=slot_layouts,
        residual_capacity=residual_capacity,
        kept_capacity=kept_capacity,
        stash_capacity=stash_capacity,
        overlay_capacity=overlay_capacity,
        message_dtypes=message_dtypes,
        message_capacity=tuple(message_capacity),
        arenas=arena,
        key_leaf=key_leaf,
    )


def _tensor_splits(program: StageProgram, tensor: tuple) -> tuple[list, list]:
    """Returns (per residual, per stash value) the dimension a stage computes it split along
    over the tensor axis (``tensor.value_splits`` from its params' splits), None for whole."""
    _, size, leaf_split = tensor
    forward_in = len(program.forward.in_avals)
    param_splits = [leaf_split[leaf] for leaf in program.stage.param_leaves]
    outs = value_splits(
        program.forward, param_splits + [None] * (forward_in - len(param_splits)), size
    )
    residual = outs[len(outs) - len(program.residual_avals) :]
    backward_in = len(program.backward_input.in_avals)
    outs = value_splits(
        program.backward_input, residual + [None] * (backward_in - len(residual)), size
    )
    return residual, outs[len(outs) - len(program.stash_avals) :]


def _capacities(
    slot_layouts: Sequence[SlotLayout], tables: TickTables
) -> tuple[tuple[int, ...], ...]:
    """Returns the per-dtype sizes of one residual, one kept and one stash slot and of the
    residual slot's overlay region (``SlotLayout.overlay``; no stash slots then)."""
    # Stash slots are sized over the stages that run a separate W in this schedule.
    split_stages = {
        int(s)
        for k, s in zip(tables.kind.ravel(), tables.stage.ravel(), strict=True)
        if k == BACKWARD_WEIGHT
    }
    num_dtypes = len(slot_layouts[0].residual_sizes) if slot_layouts else 0
    residual = tuple(max(s.residual_sizes[k] for s in slot_layouts) for k in range(num_dtypes))
    kept = tuple(max(s.kept_sizes[k] for s in slot_layouts) for k in range(num_dtypes))
    stash = tuple(
        max((slot_layouts[s].stash_sizes[k] for s in split_stages), default=0)
        for k in range(num_dtypes)
    )
    none, split = (0,) * num_dtypes, sorted(split_stages)
    if not any(s.overlay for s in slot_layouts):
        return residual, kept, stash, none
    # A stage's overlay region starts right after the residuals its own W reads, and holds
    # its own stash.
    residual = tuple(
        max(
            [
                residual[k],
                *(
                    slot_layouts[s].weight_residual_sizes[k] + slot_layouts[s].stash_sizes[k]
                    for s in split
                ),
            ]
        )
        for k in range(num_dtypes)
    )
    return residual, kept, none, stash


#: Every item of an arena starts at a multiple of this many bytes.
ARENA_ALIGN_BYTES = 64


def _item_size(layouts: Sequence[SlotLayout], group: str, stage: int, k: int, split: bool) -> int:
    """Returns the elements of slot dtype ``k`` that one microbatch's ``group`` data of
    ``stage`` takes in its arena (``zbjax.ticks.arenas``; ``split``: its backward runs as B and
    W)."""
    layout = layouts[stage]
    if group == "residual":
        if split and layout.overlay:  # B writes W's stash after the residuals W reads
            return max(
                layout.residual_sizes[k], layout.weight_residual_sizes[k] + layout.stash_sizes[k]
            )
        return layout.residual_sizes[k]
    if group == "kept":
        return layout.kept_sizes[k]
    return 0 if layout.overlay or not split else layout.stash_sizes[k]


#: ``_slots_and_tables`` overlays W's stash on B's residuals, or puts every group in one shared
#: arena, only when that saves at least this share of the arena bytes: B's outputs are then
#: materialized before it writes the stash (see ``_make_action``).
OVERLAY_MIN_SAVING = 0.1

#: The (``whole``, ``overlay``) of ``slot_layout`` that ``_slots_and_tables`` weighs.
SLOT_CANDIDATES = tuple(itertools.product((False, True, None), (False, True)))

#: Whether ``_slots_and_tables`` weighs an arena buffer per group (False), one shared by every
#: group (True), or both (``zbjax.ticks.arenas``).
ARENA_SHARING = (False, True)


def _slots_and_tables(
    programs: Sequence[StageProgram],
    dtypes: Sequence[str],
    schedule: Schedule,
    graph: StageGraph,
    positions: dict | None = None,
    splits: Sequence[tuple] | None = None,
    tensor_size: int = 1,
) -> tuple[tuple[SlotLayout, ...], TickTables, tuple[tuple[int, ...], ...], Arenas]:
    """Returns the slot layouts, tick tables, (residual, kept, stash, overlay region) slot
    sizes per dtype and arenas that hold the fewest bytes (``splits[s]``: stage ``s``'s
    ``slot_layout`` splits over a tensor axis of ``tensor_size`` devices).

    The arenas hold what is alive at once on the busiest device, so the best place for what W
    reads depends on the schedule. Six layouts are counted (``slot_layout``'s ``whole`` and
    ``overlay``): every stage keeps it in kept slots, every stage keeps its whole residual slot
    until W, or each stage decides by how much of its slot W reads; each with B's stash in
    stash slots or over B's residuals in the residual slot; and each with an arena buffer per
    group or one shared by all (``zbjax.ticks.arenas``). A tie keeps the earlier candidate. A
    candidate where B writes into the buffer it reads (overlaid or shared) is taken only when
    it holds at least ``OVERLAY_MIN_SAVING`` fewer bytes than the best where it does not.
    """
    best: dict[bool, tuple] = {}
    packed: dict[tuple, Arenas | ScheduleError] = {}
    separate_w = any(a.kind == "W" for _, _, a in schedule.all_actions())
    # The layouts change nothing in the tables but their item counts (``with_lives``).
    plain_tables = tick_tables(schedule, message_edges(graph), positions=positions)
    align = [max(1, ARENA_ALIGN_BYTES // np.dtype(d).itemsize) for d in dtypes]
    for whole, overlay in SLOT_CANDIDATES:
        if overlay and not separate_w:
            continue  # no B writes a stash: nothing to overlay
        layouts = tuple(
            slot_layout(p, dtypes, whole, overlay, splits and splits[s], tensor_size)
            for s, p in enumerate(programs)
        )
        kept = [s.has_kept for s in layouts]
        until_weight = [s.weight_reads_residuals for s in layouts]
        lives = (tuple(kept), tuple(until_weight))
        tables = with_lives(plain_tables, kept, until_weight)
        size_of = functools.partial(_item_size, layouts)
        items = tuple(
            size_of(group, s, k, split)
            for s in range(len(layouts))
            for group in ARENA_GROUPS
            for k in range(len(dtypes))
            for split in (False, True)
        )
        for shared in ARENA_SHARING:
            if shared and not separate_w:
                continue  # B writes nothing: nothing to share with
            # Overlaid or shared, B writes into the buffer it reads.
            key = overlay or shared
            # Layouts that differ only where no item does pack alike: pack them once.
            signature = (lives, items, shared)
            if signature not in packed and key in best:
                # Packing takes time (seconds at m = 256 on 32 devices); a layout whose
                # floor holds no fewer bytes than the best of its kind cannot be taken.
                floor = arena_floor(
                    tables, size_of, len(dtypes), kept, until_weight, align, shared=shared
                )
                if sum(_slot_bytes(dtypes, n) for n in floor) >= best[key][0]:
                    continue
            if signature not in packed:
                try:
                    packed[signature] = arenas(
                        tables,
                        size_of,
                        len(dtypes),
                        kept,
                        until_weight,
                        align,
                        shared=shared,
                    )
                except ScheduleError as error:  # an item too large for a row: not this one
                    packed[signature] = error
            arena = packed[signature]
            if isinstance(arena, ScheduleError):
                continue
            size = sum(_slot_bytes(dtypes, n) for n in arena.sizes)
            if key not in best or size < best[key][0]:
                best[key] = (size, layouts, tables, arena)
    if not best:
        raise next(e for e in packed.values() if isinstance(e, ScheduleError))
    plain, rewritten = best.get(False), best.get(True)
    if rewritten and (plain is None or rewritten[0] <= (1 - OVERLAY_MIN_SAVING) * plain[0]):
        plain = rewritten
    _, layouts, tables, arena = plain
    # The slot sizes describe the layout taken (``Lowering.slot_bytes``); only it needs them.
    return layouts, tables, _capacities(layouts, tables), arena


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


def branch_keys(tables: TickTables, lane: int) -> tuple[tuple[int, int], ...]:
    """Returns the (kind, stage) of every action code of ``lane``: idle (code 0) first, then
    the actions the tables run in that lane, in a fixed order. The loop's per-tick action
    table holds these codes."""
    kinds, stages = tables.kind[:, :, lane], tables.stage[:, :, lane]
    used = sorted(
        {(int(k), int(s)) for k, s in zip(kinds.ravel(), stages.ravel(), strict=True) if k != IDLE}
    )
    return ((IDLE, 0), *used)


#: Platforms on which W reads the stash B wrote for it apart from its work (``read_apart``).
#: XLA:CPU fuses a slot read into the transpose a weight gradient's matmul wants of it (the
#: cotangent, rows last) and emits that as an untiled strided loop: 5x its tiled transpose of
#: a whole buffer on one core of the project's Xeon (4 MB, `benchmarks/stash_reads.py`), which
#: made W of the GPT reference stages 1.14-1.16x what it takes reading its stash apart. Since
#: the split merges the (batch, seq) contraction of those matmuls into one dimension, they
#: transpose nothing, and reading apart measures 0.98-1.00x reading fused (`stash_reads`);
#: it still guards any dot whose contraction could not be merged.
STASH_READS_APART = ("cpu",)
#: Where W's stash values lie that B wrote for it (``SlotLayout.stash`` sources).
B_WROTE = ("stash", "overlay")


def reads_stash_apart(devices: Any) -> bool:
    """Returns whether W reads its stash slots apart (``read_apart``) on ``devices`` (an array
    or iterable of ``jax.Device``), as the lowering decides it: on the ``STASH_READS_APART``
    platforms."""
    return all(d.platform in STASH_READS_APART for d in np.ravel(devices))


def read_apart(read: Callable[[], Any], code: jax.Array, avals: Any = None) -> Any:
    """Returns ``read()`` computed inside a conditional whose predicate (``code >= 0``) holds
    whenever it runs, so that XLA computes the values into whole buffers before any work on
    them, fusing neither the reads into that work nor the work into the reads (``code``: a
    traced integer that is never negative, e.g. the tick's action code). ``avals``: the shapes
    and dtypes ``read()`` returns, where the caller knows them (else ``read`` is traced once
    more to find them)."""
    if avals is None:
        avals = jax.eval_shape(read)
    return jax.lax.cond(
        code >= 0, read, lambda: jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), avals)
    )


def _item_start(bases: Sequence[tuple], k: int, offset: int, blocked: bool) -> tuple:
    """Returns the start index of (row, [block 0,] start + ``offset``) for ``bases[k] = (row,
    start)``, an item's place in the arena of dtype ``k``, and a value's offset in the item,
    in the integer dtype of the tables (with ``jax_enable_x64`` a Python int would be int64
    beside the int32 tables, which the dynamic slices refuse)."""
    row, base = (jnp.asarray(i) for i in bases[k])
    const = base.dtype.type
    start = base + const(offset) if offset else base
    return (row, const(0), start) if blocked else (row, start)


def _read_slots(reads: Sequence[tuple], tensor_axis: str | None = None) -> list[jax.Array]:
    """Returns the values ``reads`` name, each (buffers, bases, item): the value ``item``
    names in the item at ``bases[k]`` (row, start) of its dtype ``k``'s arena in ``buffers``.
    Over a tensor axis (arenas ``[rows, T, elements]``, split over it along T) each device
    reads its parts, which one nested ``shard_map`` for all of them turns into values split as
    their items say.

    Starts are never negative, so the slices skip JAX's wrapping of negative indices (three
    equations per index): a stage's B reads tens of residuals at every tick."""
    blocked = tensor_axis is not None
    out, shapes, splits = [], [], []
    for buffers, bases, (k, offset, shape, split) in reads:
        size = int(np.prod(shape, dtype=np.int64))
        pool = buffers[k]
        sizes = (1, pool.shape[1], size) if blocked else (1, size)
        start = _item_start(bases, k, offset, blocked)
        value = jax.lax.dynamic_slice(pool, start, sizes, allow_negative_indices=False)
        out.append(jnp.reshape(value, sizes[1:] if blocked else shape))
        shapes.append(shape)
        splits.append(split)
    if not blocked or not reads:
        return out
    return from_blocks(tensor_axis, out, shapes, splits)


def _write_slots(writes: Sequence[tuple], tensor_axis: str | None = None) -> None:
    """Writes values where ``writes`` say, each (buffers, bases, item, value): ``value`` where
    ``item`` says in the item at ``bases[k]`` of its dtype ``k``'s arena in ``buffers`` (a
    list, updated in place; see ``_read_slots``; over a tensor axis one nested ``shard_map``
    cuts every value into its parts)."""
    if not writes:
        return
    values = [_as_dtype(value, b[item[0]].dtype) for b, _, item, value in writes]
    blocked = tensor_axis is not None
    if blocked:
        flats = to_blocks(tensor_axis, values, [item[3] for _, _, item, _ in writes], each=True)
    else:
        flats = values
    for (buffers, bases, (k, offset, *_), _), flat in zip(writes, flats, strict=True):
        pool = buffers[k]
        flat = jnp.reshape(flat, (1, *pool.shape[1:-1], -1))
        start = _item_start(bases, k, offset, blocked)
        buffers[k] = jax.lax.dynamic_update_slice(pool, flat, start, allow_negative_indices=False)


def _as_dtype(value: Any, dtype: Any) -> jax.Array:
    """Returns ``value`` as an array of ``dtype``, adding no conversion when it is one."""
    value = on_device_memory(jnp.asarray(value))
    return value if value.dtype == dtype else jax.lax.convert_element_type(value, dtype)


@dataclass(frozen=True)
class _TickState:
    """What one tick's actions update: the device's buffers and what leaves the device."""

    arenas: list  # per arena buffer, per slot dtype: the device's part of it
    grads: list  # per param dtype, the device's gradient row
    sends: list  # per shift, per message dtype, the payload to send
    loss: list  # the loss stage's outputs summed over its forwards so far: loss, then aux


jax.tree_util.register_dataclass(
    _TickState,
    data_fields=["arenas", "grads", "sends", "loss"],
    meta_fields=[],
)


def _psum_rows(rows: jax.Array, axis: str) -> jax.Array:
    """Returns per-example aux ``rows``, held by the loss stage's device (zeros elsewhere), on
    every device of ``axis``: their ``psum`` (of bools as integers; 16-bit floats in float32,
    ``reduce_wide``)."""
    if rows.dtype == jnp.bool_:
        return jax.lax.psum(rows.astype(jnp.int32), axis).astype(jnp.bool_)
    return reduce_wide(jax.lax.psum, rows, axis)


def _finish_before_sending(
    state: _TickState, code: jax.Array, tensor_axis: str | None = None
) -> _TickState:
    """Returns ``state`` with every payload depending on every buffer the tick's actions wrote.

    XLA orders a loop body by data dependencies only: an action that sends nothing (W, or F on
    the last stage) may otherwise run after the ``ppermute``, in the next tick's time, where it
    adds to that tick's action while the other devices wait at the next ``ppermute``. On a
    2-device CPU mesh that made ticks last the sum of both devices' actions instead of the
    larger one. ``optimization_barrier`` does not help: XLA:CPU drops it without ordering.
    The dependency is one element of each written buffer, selected under a predicate that is
    never true (action codes are not negative), so the payload's values never change.

    Over a tensor axis (``tensor_axis``) each device takes the first element of its own part
    of each buffer, in a nested ``shard_map``: the first element of the whole buffer would have
    XLA move the arenas between devices (an all-to-all of every arena at every tick) to ravel
    them. The parts' elements differ between devices, which the never-taken select hides.
    """
    pools = [b for buffer in state.arenas for b in buffer]
    if not any(b.size for b in [*pools, *state.grads, *state.loss]):
        return state

    def first_elements(pools: list, grads: list, loss: list) -> jax.Array:
        # (A complex buffer's real part: casting complex to real is deprecated in JAX.)
        parts = [
            jnp.real(jnp.ravel(b)[:1]).astype(jnp.float32)
            for b in [*pools, *grads, *loss]
            if b.size
        ]
        return jnp.sum(jnp.concatenate(parts))

    if tensor_axis is None:
        dep = first_elements(pools, state.grads, state.loss)
    else:
        # Arenas are [rows, T, elements] and gradient rows [T * n], split over the axis along
        # T; the loss is whole.
        specs = (
            [PartitionSpec(None, tensor_axis)] * len(pools),
            [PartitionSpec(tensor_axis)] * len(state.grads),
            [PartitionSpec()] * len(state.loss),
        )
        dep = per_shard(tensor_axis, first_elements, specs, PartitionSpec())(
            pools, list(state.grads), list(state.loss)
        )
    never = code < 0
    sends = [
        [
            set_rows(p, 0, jnp.where(never, dep.astype(p.dtype), p[:1])) if p.size else p
            for p in payloads
        ]
        for payloads in state.sends
    ]
    return dataclasses.replace(state, sends=sends)


def _make_action(low: Lowering, kind: int, stage_index: int):
    """Returns the function running action ``kind`` of stage ``stage_index`` for one tick.

    It takes the tick state and returns it updated in place: F writes its residuals into its
    residual item and its kept item (``zbjax.ticks.arenas``), B reads them and writes the rest
    of W's stash into its stash item (or, overlaid, over the residuals of its residual item
    that only it read), W reads the kept and stash items, W and BW add their weight gradient
    into the gradient row; F, B and BW put the messages they send into the send payloads. XLA
    keeps a buffer in place through the conditional that runs the action only when the
    branch's data dependencies order every read of it before its first write (otherwise it
    copies the buffer every tick): F writes buffers it does not read, W reads buffers it does
    not write, a B with a stash buffer of its own writes only that, which it does not read,
    and a B that writes the buffer it reads (overlaid, or one arena buffer shared by every
    group) runs its backward in a nested conditional (a predicate that is always true at run
    time) whose outputs are whole buffers, so that every read of the buffer is done before the
    stash is written into it. Without the nested conditional XLA fuses reads of the buffer
    into the writes and into work it schedules after them, and copies the buffer.
    """
    graph, tables, layout = low.graph, low.tables, low.layout
    edges = tables.edges
    msg_dtypes, msg_cap = low.message_dtypes, low.message_capacity
    num_micro = low.schedule.num_microbatches
    # Each microbatch's backward is seeded with 2^-k and its param gradients scaled by 2^k / m,
    # or with 1 / (m * S) and scaled by S where a stage calls a custom_vjp (``backward_seed``),
    # as reference_value_and_grad does.
    seed, grad_scale = backward_seed(num_micro, low.data_parallel_size, graph.holds_custom_vjp)
    loss_aval = graph.stages[graph.loss_stage].jaxpr.out_avals[0]
    output_rows = graph.output_rows()
    stage = graph.stages[stage_index]
    program = low.programs[stage_index]
    name = f"{_KIND_SCOPE[kind]} s{stage_index}"
    slots = low.slot_layouts[stage_index]
    # Over a tensor axis the arenas hold each device's parts: [rows, T, elements].
    tensor_axis = low.layout.tensor_axis if low.layout.tensor_size > 1 else None

    def overlay_item(item):
        # Offsets into the stage's overlay region, right after the residuals its W reads.
        k, offset, shape, split = item
        return k, slots.weight_residual_sizes[k] + offset, shape, split

    edge_packing = {e: packing(graph.edges[e].values, msg_dtypes) for e in range(len(edges))}
    reads = incoming_messages(edges, stage_index, kind != FORWARD)
    sent = outgoing_messages(
        edges, tables.placement, tables.num_devices, stage_index, kind != FORWARD
    )
    shift_index = {shift: k for k, shift in enumerate(tables.shifts)}
    out_positions = _edge_positions(graph, stage_index, output=True)
    in_positions = _edge_positions(graph, stage_index, output=False)
    n_outputs = len(stage.output_differentiable)
    n_in_cts = sum(stage.input_differentiable)
    stash_apart = reads_stash_apart(low.mesh.devices)
    # B writes a stash into the buffer it reads its residuals from.
    writes_shared = low.arenas.shared and any(where == "stash" for where, _ in slots.stash)

    def place_sends(sends, values_of_edge, send_position):
        # Each message goes to its shift's payload (capacity-sized blocks) at the position the
        # tables give it this tick: after those of the device's earlier lanes on that shift.
        sends = [list(s) for s in sends]
        for j, (shift, _, e) in enumerate(sent):
            k = shift_index[shift]
            flats = pack(edge_packing[e], values_of_edge(e), msg_cap)
            for t in range(len(msg_dtypes)):
                start = send_position[j] * msg_cap[t]
                sends[k][t] = jax.lax.dynamic_update_slice(
                    sends[k][t], flats[t], (start,), allow_negative_indices=False
                )
        return sends

    def incoming(message_buf, msg_read):
        # The message slots this action reads, unpacked, per incoming edge.
        out = {}
        for j, e in enumerate(reads):
            flats = [
                jax.lax.dynamic_index_in_dim(
                    b, msg_read[j], keepdims=False, allow_negative_indices=False
                )
                for b in message_buf
            ]
            out[e] = unpack(edge_packing[e], flats)
        return out

    def output_cotangents(messages):
        if stage_index == graph.loss_stage:
            return [jnp.full(loss_aval.shape, seed, loss_aval.dtype)]
        cts: list = [None] * n_outputs
        for e, values in messages.items():
            for pos, value in zip(out_positions[e], values, strict=True):
                cts[pos] = value
        return [ct for ct, flag in zip(cts, stage.output_differentiable, strict=True) if flag]

    def input_cotangent_sends(sends, in_cts, send_position):
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

        return place_sends(sends, values_of_edge, send_position)

    def action(state: _TickState, ctx: dict) -> _TickState:
        # One list per buffer; groups sharing a buffer share its list, so that what one
        # writes the others read.
        buffers = [list(b) for b in state.arenas]
        residual_buf, kept_buf, stash_buf = (buffers[b] for b in low.arenas.group_buffer)
        grads = list(state.grads)
        sends, loss = state.sends, state.loss

        def batch_mb(j):
            leaf = ctx["batch"][stage.batch_leaves[j]]
            return jax.lax.dynamic_index_in_dim(
                leaf, ctx["micro"], keepdims=False, allow_negative_indices=False
            )

        def resolve(sources, apart=()):
            # The values ``sources`` name; those at positions ``apart`` read apart.
            params = (
                unpack_stage_params(layout, stage_index, ctx["rows"])
                if any(where == "param" for where, _ in sources)
                else []
            )
            pools = {
                "residual": (residual_buf, ctx["residual_at"]),
                "kept": (kept_buf, ctx["kept_at"]),
                "stash": (stash_buf, ctx["stash_at"]),
            }

            def read(positions):
                # The values at ``positions``, those in slots read together.
                def where_found(where, what):
                    if where == "overlay":
                        return residual_buf, ctx["residual_at"], overlay_item(what)
                    return (*pools[where], what)

                in_slots = [i for i in positions if sources[i][0] in (*pools, "overlay")]
                found = dict(
                    zip(
                        in_slots,
                        _read_slots([where_found(*sources[i]) for i in in_slots], tensor_axis),
                        strict=True,
                    )
                )
                for i in positions:
                    where, what = sources[i]
                    if i not in found:
                        found[i] = params[what] if where == "param" else batch_mb(what)
                return [found[i] for i in positions]

            together = [i for i in range(len(sources)) if i not in apart]
            out = dict(zip(together, read(together), strict=True))
            if apart:
                out.update(zip(apart, read_apart(lambda: read(apart), ctx["code"]), strict=True))
            return [out[i] for i in range(len(sources))]

        with jax.named_scope(name):
            if kind == FORWARD:
                params = unpack_stage_params(layout, stage_index, ctx["rows"])
                messages = incoming(ctx["messages"], ctx["message_read"])
                inputs = [v for e in stage.in_edges for v in messages[e]]
                batch = [batch_mb(j) for j in range(len(stage.batch_leaves))]
                outs = eval_jaxpr_here(program.forward, *params, *batch, *inputs)
                outputs, residuals = outs[:n_outputs], outs[n_outputs:]
                if stage_index == graph.loss_stage:
                    # Summed over microbatches; an aux leaf of per-example rows goes to its
                    # microbatch's place instead (``StageGraph.aux_rows``).
                    loss = [
                        jax.lax.dynamic_update_index_in_dim(
                            acc, jnp.asarray(out).astype(acc.dtype), ctx["micro"], 0
                        )
                        if joined
                        else acc + jnp.asarray(out).astype(acc.dtype)
                        for acc, out, joined in zip(loss, outputs, output_rows, strict=True)
                    ]
                else:
                    sends = place_sends(
                        sends,
                        lambda e: [outputs[p] for p in out_positions[e]],
                        ctx["send_position"],
                    )
                writes = {
                    "residual": (residual_buf, ctx["residual_at"]),
                    "kept": (kept_buf, ctx["kept_at"]),
                }
                stored = [
                    (*writes[where], item, value)
                    for (where, item), value in zip(slots.residuals, residuals, strict=True)
                    if where in writes
                ]
                _write_slots(stored, tensor_axis)
            elif kind in (BACKWARD_INPUT, BACKWARD):
                jaxpr = program.backward_input if kind == BACKWARD_INPUT else program.backward

                def backward():
                    residuals = resolve(slots.residuals)
                    messages = incoming(ctx["messages"], ctx["message_read"])
                    return eval_jaxpr_here(jaxpr, *residuals, *output_cotangents(messages))

                if kind == BACKWARD_INPUT and (slots.overlay or writes_shared):
                    # See the docstring; B's outputs are its jaxpr's.
                    outs = read_apart(backward, ctx["code"], list(jaxpr.out_avals))
                else:
                    outs = backward()
                in_cts, rest = outs[:n_in_cts], outs[n_in_cts:]
                sends = input_cotangent_sends(sends, in_cts, ctx["send_position"])
                if kind == BACKWARD_INPUT:
                    stashed = [
                        (stash_buf, ctx["stash_at"], item, value)
                        if where == "stash"
                        else (residual_buf, ctx["residual_at"], overlay_item(item), value)
                        for (where, item), value in zip(slots.stash, rest, strict=True)
                        if where in ("stash", "overlay")
                    ]
                    _write_slots(stashed, tensor_axis)
                else:
                    _add_gradients(layout, stage_index, grads, rest, grad_scale)
            else:  # BACKWARD_WEIGHT
                apart = [i for i, (where, _) in enumerate(slots.stash) if where in B_WROTE]
                stash = resolve(slots.stash, apart=apart if stash_apart else ())
                param_cts = eval_jaxpr_here(program.backward_weight, *stash)
                _add_gradients(layout, stage_index, grads, param_cts, grad_scale)
        return _TickState(buffers, grads, sends, loss)

    return action


def _add_gradients(
    layout: StagedLayout, stage_index: int, grads: list, param_cts, scale: float = 1.0
) -> None:
    """Adds a stage's param cotangents, times ``scale``, into the device's gradient rows.

    A stage's leaves of one dtype are contiguous in the row, so they are packed into one vector
    and added with one in-place slice update: one operation per dtype instead of one per leaf
    (on CPU, 16 small updates cost about 7x one packed update).
    """
    slots: list[list] = [[] for _ in layout.dtypes]
    values: list[list] = [[] for _ in layout.dtypes]
    for slot, ct in zip(layout.stage_slots[stage_index], param_cts, strict=True):
        k = layout.dtype_index(slot.dtype)
        # Integer params have float0 cotangents; their gradient stays zero.
        if ct.dtype == jax.dtypes.float0 or not jnp.issubdtype(slot.dtype, jnp.inexact):
            ct = jnp.zeros(layout.copy_shape(slot), slot.dtype)
        else:
            ct = ct.astype(grads[k].dtype)  # a 16-bit leaf's sum is kept in float32
            if scale != 1.0:
                ct = ct * jnp.asarray(scale, ct.dtype)
        slots[k].append(slot)
        values[k].append(ct)
    for k, (these, cts) in enumerate(zip(slots, values, strict=True)):
        if these:
            start = these[0].offset
            grads[k] = write_slots(layout, grads[k], start, these, cts, add=True)


def _tick_inputs(low: Lowering) -> tuple[np.ndarray, ...]:
    """Returns the per-tick tables the scan consumes, each ``[num_ticks, num_devices, lanes,
    ...]`` (``message_write``: ``[num_ticks, num_devices, shifts, messages]``; the arena
    rows and offsets ``[..., lanes, groups, slot dtypes]``)."""
    tables = low.tables
    action = np.zeros(tables.kind.shape, np.int32)
    for lane in range(tables.num_lanes):
        index = {key: i for i, key in enumerate(branch_keys(tables, lane))}
        for (t, d), k in np.ndenumerate(tables.kind[:, :, lane]):
            if k != IDLE:
                action[t, d, lane] = index[(int(k), int(tables.stage[t, d, lane]))]
    blocks = tables.payload_blocks
    sizes = exchange_sizes(tables)
    exchange = np.zeros(blocks.shape, np.int32)
    for (t, k), n in np.ndenumerate(blocks):
        if n:
            exchange[t, k] = 1 + sizes[k].index(int(n))
    exchanges = np.broadcast_to(
        exchange[:, None, :], (tables.num_ticks, tables.num_devices, len(tables.shifts))
    )
    return (
        action,
        tables.microbatch,
        *low.arenas.row_offsets(),
        tables.message_read,
        tables.message_write,
        tables.send_position,
        exchanges,
    )


def exchange_sizes(tables: TickTables) -> tuple[tuple[int, ...], ...]:
    """Returns, per shift, the numbers of payload positions its exchanges move (ascending):
    the loop has one ``ppermute`` of each size and picks a tick's by its ``exchange`` code
    (0: none, ``i + 1``: ``sizes[k][i]`` positions)."""
    blocks = tables.payload_blocks
    return tuple(
        tuple(sorted({int(n) for n in blocks[:, k] if n})) for k in range(len(tables.shifts))
    )


def _run(
    low: Lowering,
    staged: StagedParams,
    batch_leaves: tuple[jax.Array, ...],
    pools: list[jax.Array] | None,
):
    axis = low.axis_name
    tables = low.tables
    lane_keys = [branch_keys(tables, lane)[1:] for lane in range(tables.num_lanes)]
    made = {key: _make_action(low, *key) for key in sorted(set().union(*lane_keys))}
    xs = tuple(jnp.asarray(x) for x in _tick_inputs(low))
    num_micro = low.schedule.num_microbatches
    loss_avals = low.graph.stages[low.graph.loss_stage].jaxpr.out_avals
    # Per loss-stage output: summed over microbatches, or (per-example rows) each
    # microbatch's written to its place in an [m, ...] buffer.
    output_rows = low.graph.output_rows()
    msg_slots = tables.num_message_slots + 1  # + the spare that absorbs "nothing arrives"
    data_axes = low.data_axes
    always_exchanges = tables.exchanges.all(axis=0)
    sizes = exchange_sizes(tables)
    tensor_axis = low.layout.tensor_axis if low.layout.tensor_size > 1 else None

    num_slot_dtypes = len(low.slot_dtypes)

    def device_program(rows, batch, xs, given_pools):
        rows = [r[0] for r in rows]
        if low.key_leaf is not None and low.data_parallel_size > 1:
            # Each data-parallel shard draws its own bits: fold_in(key_i, shard). (Data axes
            # of size 1 make one shard, which keeps key_i, as a mesh without them does.)
            shard = jax.lax.axis_index(data_axes)
            batch = list(batch)
            fold = jax.vmap(jax.random.fold_in, in_axes=(0, None))
            batch[low.key_leaf] = fold(batch[low.key_leaf], shard)
        xs = tuple(x[:, 0] for x in xs)
        if given_pools:
            pools = [p[0, 0] for p in given_pools]
        else:
            # Never read before an action writes it, so it need not be zeroed (backends that
            # can skip it do).
            pools = [uninitialized(a.shape[2:], a.dtype) for a in low.pool_avals()]
        n = num_slot_dtypes
        arena_bufs = [pools[b * n : (b + 1) * n] for b in range(len(low.arenas.sizes))]
        message_buf = [
            jnp.zeros((msg_slots, c), dt)
            for dt, c in zip(low.message_dtypes, low.message_capacity, strict=True)
        ]

        def tick(carry, x):
            arena_bufs, grads, message_buf, sends, loss_sum = carry
            code, micro, arena_row, arena_at, msg_read, msg_write, send_pos, exchange = x

            def deliver(message_buf, payload, k, n):
                # Positions 0..n-1 of shift k's payload, arrived, into the slots the tables give.
                for j in range(n):
                    message_buf = [
                        jax.lax.dynamic_update_index_in_dim(
                            b,
                            p[j * c : (j + 1) * c],
                            msg_write[k, j],
                            0,
                            allow_negative_indices=False,
                        )
                        for b, p, c in zip(message_buf, payload, low.message_capacity, strict=True)
                    ]
                return message_buf

            # The send payloads are carried from tick to tick, not refilled: an action writes
            # the positions it sends, and whatever a position held before goes, if it travels
            # at all, to the spare message slot.
            tick_loss = [
                total if joined else jnp.zeros(a.shape, a.dtype)
                for total, joined, a in zip(loss_sum, output_rows, loss_avals, strict=True)
            ]
            state = _TickState(arena_bufs, grads, sends, tick_loss)
            # One two-way conditional per (kind, stage) a lane runs anywhere, in sequence (at
            # most one is taken per lane and tick); unlike one multi-way switch, this keeps the
            # buffers in place on XLA. Kind by kind (``PHASES``), lanes in order within a kind.
            contexts = [
                dict(
                    rows=rows,
                    batch=batch,
                    micro=micro[lane],
                    messages=message_buf,
                    message_read=msg_read[lane],
                    # Where the lane's (stage, microbatch) data starts, per slot dtype.
                    **{
                        f"{group}_at": [
                            (arena_row[lane, g, k], arena_at[lane, g, k])
                            for k in range(num_slot_dtypes)
                        ]
                        for g, group in enumerate(ARENA_GROUPS)
                    },
                    send_position=send_pos[lane],
                    code=code[lane],
                )
                for lane in range(tables.num_lanes)
            ]
            for kind in sorted(PHASES, key=PHASES.__getitem__):
                for lane, keys in enumerate(lane_keys):
                    for i, key in enumerate(keys):
                        if KIND_NAMES[key[0]] == kind:
                            state = jax.lax.cond(
                                code[lane] == i + 1,
                                made[key],
                                lambda state, ctx: state,
                                state,
                                contexts[lane],
                            )
            state = _finish_before_sending(state, code[0], tensor_axis)
            message_buf = list(message_buf)
            for k, shift in enumerate(tables.shifts):
                payload = state.sends[k]
                full = tables.messages_per_shift[k]
                if not shift:
                    message_buf = deliver(message_buf, payload, k, full)
                    continue
                perm = [(d, (d + shift) % tables.num_devices) for d in range(tables.num_devices)]

                def send(message_buf, q, n, k=k, perm=perm):
                    # Only the first n positions travel; the others stay where they are.
                    moved = jax.lax.ppermute(
                        [p[: n * c] for p, c in zip(q, low.message_capacity, strict=True)],
                        axis,
                        perm,
                    )
                    return deliver(message_buf, moved, k, n)

                if always_exchanges[k] and sizes[k] == (full,):
                    message_buf = send(message_buf, payload, full)
                else:
                    # Every device reads the same code, so all or none enter the same
                    # collective; in a tick where nothing travels, none does and nobody
                    # waits. One two-way conditional per size, as for the actions: a
                    # multi-way switch would copy the message pool every tick.
                    for i, n in enumerate(sizes[k]):
                        message_buf = jax.lax.cond(
                            exchange[k] == i + 1,
                            lambda b, q, n=n, send=send: send(b, q, n),
                            lambda b, q: list(b),
                            message_buf,
                            payload,
                        )
            carry = (
                state.arenas,
                state.grads,
                message_buf,
                state.sends,
                [
                    b if joined else a + b.astype(a.dtype)
                    for a, b, joined in zip(loss_sum, state.loss, output_rows, strict=True)
                ],
            )
            return carry, None

        # The gradients, loss and aux summed over microbatches are kept in float32 for 16-bit
        # floats: a float16 sum of m losses overflows (4 x 30000) where their mean does not,
        # and bfloat16 gradients summed in bfloat16 lost precision with m (0.016 off the
        # exact mean at m = 64, where a float32 sum is 0.003 off).
        grads = [jnp.zeros(r.shape, wide_dtype(r.dtype)) for r in rows]
        zero = [
            jnp.zeros((num_micro, *a.shape), a.dtype)
            if joined
            else jnp.zeros(a.shape, wide_dtype(a.dtype))
            for a, joined in zip(loss_avals, output_rows, strict=True)
        ]
        sends = [
            [
                jnp.zeros(n * c, dt)
                for dt, c in zip(low.message_dtypes, low.message_capacity, strict=True)
            ]
            for n in tables.messages_per_shift
        ]
        carry = (arena_bufs, grads, message_buf, sends, zero)
        (arena_bufs, grads, _, _, loss_sum), _ = jax.lax.scan(tick, carry, xs)
        # The loss and its aux, summed on the loss stage's device: their means, on every device
        # (per-example rows: each microbatch's, zeros elsewhere, summed to every device).
        loss = [
            _psum_rows(t, axis) if joined else reduce_wide(jax.lax.psum, t, axis) / num_micro
            for t, joined in zip(loss_sum, output_rows, strict=True)
        ]
        if data_axes:
            # Each data-parallel shard saw an equal part of every microbatch: average (rows:
            # each shard's block of every microbatch's rows, gathered in order).
            loss = [
                jax.lax.all_gather(t, data_axes, axis=1, tiled=True)
                if joined
                else reduce_wide(jax.lax.pmean, t, data_axes)
                for t, joined in zip(loss, output_rows, strict=True)
            ]
            # Integer params' gradients are zeros of their dtype (pmean would make them float).
            grads = [
                reduce_wide(jax.lax.pmean, g, data_axes)
                if jnp.issubdtype(g.dtype, jnp.inexact)
                else g
                for g in grads
            ]
        loss = [t.astype(a.dtype) for t, a in zip(loss, loss_avals, strict=True)]
        # Every copy of a tied leaf gets the leaf's whole gradient; the rest stay where they are.
        grads = sum_shared_gradients(low.layout, grads, axis)
        grads = [g.astype(r.dtype) for g, r in zip(grads, rows, strict=True)]
        pools = [b for buffer in arena_bufs for b in buffer]
        out_pools = [p[None, None] for p in pools] if given_pools else []
        return loss, [g[None] for g in grads], out_pools

    mesh = low.mesh
    in_specs = (
        [PartitionSpec(axis)] * len(staged.rows),
        [
            PartitionSpec(None, data_axes)
            if data_axes and b.ndim >= 2 and j != low.key_leaf
            else PartitionSpec()
            for j, b in enumerate(batch_leaves)
        ],
        tuple(PartitionSpec(None, axis) for _ in xs),
        [low.pool_spec] * len(pools or ()),
    )
    run = shard_map(
        device_program,
        mesh=mesh,
        in_specs=in_specs,
        out_specs=(
            [PartitionSpec()] * len(loss_avals),
            [PartitionSpec(axis)] * len(staged.rows),
            [low.pool_spec] * len(pools or ()),
        ),
        # Manual over the pipeline and data axes: the data axes are done by hand. Left to the
        # compiler, they put collectives inside the conditional branches, which only the
        # devices of one pipeline stage take; on XLA:CPU those collectives deadlocked. The
        # tensor axis, if any, is the compiler's: it partitions each stage's equations, with
        # collectives among the devices of one stage, which all take the same branch.
        axis_names={axis, *data_axes},
        # The stage jaxprs were traced outside the shard_map, so their equations carry no
        # varying-axis annotations; evaluating them under vma checking would reject every
        # mix of a per-device value with a constant. Replication is tracked by hand here:
        # only the loss is psum-ed, everything else is per device.
        check_vma=False,
    )
    args = (list(staged.rows), list(batch_leaves), xs, list(pools or ()))
    args = place_for_shard_map(mesh, args, in_specs)
    totals, grad_rows, out_pools = run(*args)
    # Per-example rows, [m, rows of a microbatch, ...]: the batch's rows in order.
    totals = [
        jnp.reshape(t, (t.shape[0] * t.shape[1], *t.shape[2:])) if joined else t
        for t, joined in zip(totals, output_rows, strict=True)
    ]
    loss = low.graph.loss_and_aux(totals)
    grads = StagedParams(grad_rows, staged.dtypes, low.layout.fingerprint)
    return (loss, grads) if pools is None else (loss, grads, out_pools)
