"""Staged parameter layout: each pipeline device holds only the parameters of its own stages.

A ``shard_map`` input is split evenly over the pipeline axis, so every device's shard has the
same shape, while stages (embedding, blocks, head) hold different parameters. The staged
layout therefore keeps, per dtype, one ``[num_devices, row_size]`` buffer whose row ``d``
packs the parameter leaves of device ``d``'s stages back to back, stage after stage, padded to
the longest row. A stage's leaves are contiguous in its row, so the lowering unpacks them with
static slices and adds a stage's weight gradient into the row with one slice update.

A leaf read by stages on two devices (a tied embedding) is stored in both rows; a leaf read by
two stages of one device is stored once per stage. Its gradient is the sum of all copies.
Leaves no stage reads are kept at the end of row 0 so that ``unstage(stage(params))`` gives
the params back; their gradient is zero.

A stage that reads only some rows of a leaf's leading axis (``Stage.param_rows``: the layers of
a stacked scan parameter that its share of the scan's iterations use) stores only those rows, so
a pipeline over an ``nn.scan`` model holds each layer's weights on one device. Rows no stage
reads are kept at the end of row 0, like unread leaves.

With a tensor-parallel axis of size T (``zbjax.pipeline(param_specs=...)``), a device's row is
T blocks of ``row_size`` elements, block t on tensor shard t: a leaf split over the axis along
one dimension stores its t-th part in block t (the slot's ``shape`` is that part's), a leaf the
specs leave replicated stores the whole leaf in every block. Rows are ``[num_devices, T *
row_size]`` arrays sharded over the pipeline axis and the tensor axis, so each device holds
``row_size`` elements per dtype; inside the pipeline's ``shard_map`` (manual over the pipeline
and data axes, the tensor axis left to the compiler) slots are read and written by a nested
``shard_map`` over the tensor axis, so that each leaf arrives split as its spec says.
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from zbjax._jax_compat import add_rows, set_rows
from zbjax.errors import PipelineError
from zbjax.stages import leading_rows
from zbjax.tensor import from_blocks, to_blocks


def dtype_name(dtype) -> str:
    """Returns the canonical name of ``dtype`` used to key per-dtype buffers."""
    return np.dtype(dtype).name


@dataclass(frozen=True)
class LeafSlot:
    """Where one copy of a param leaf sits: its dtype's row, offset in the row, and shape.

    ``rows`` is None for a copy of the whole leaf, else the [begin, end) rows of the leaf's
    leading axis the copy holds (``shape`` is then the shape of those rows).
    """

    leaf: int
    dtype: str
    offset: int
    size: int
    shape: tuple[int, ...]
    rows: tuple[int, int] | None = None


@dataclass(frozen=True)
class StagedLayout:
    """Per-dtype row layout of the staged params.

    ``stage_slots[s]`` lists stage ``s``'s leaves in ``param_leaves`` order with offsets in
    device ``placement[s]``'s row; ``stage_offset[s][k]`` is where stage ``s``'s block of dtype
    ``dtypes[k]`` starts and ``stage_capacity[k]`` the largest such block over stages.
    ``row_size[k]`` is the fullest device's row: a device's stages' blocks lie one after
    another, so one holding a large and a small stage (zb-v) needs no second large block.
    """

    dtypes: tuple[str, ...]
    row_size: tuple[int, ...]
    stage_capacity: tuple[int, ...]
    stage_offset: tuple[tuple[int, ...], ...]
    stage_slots: tuple[tuple[LeafSlot, ...], ...]
    placement: tuple[int, ...]
    num_devices: int
    unread_slots: tuple[LeafSlot, ...]  # on device 0
    param_avals: tuple[jax.ShapeDtypeStruct, ...]
    #: The tensor-parallel mesh axis (None: none), its size T, and per leaf the dimension it
    #: splits (None: the leaf is replicated over it).
    tensor_axis: str | None = None
    tensor_size: int = 1
    leaf_split: tuple[int | None, ...] = ()

    @functools.cached_property
    def fingerprint(self) -> str:
        """A digest of where every leaf lies in the rows: two layouts with the same rows' shapes
        (another schedule, stage count or placement of one model, or for an automatic cut
        another microbatch shape) have different ones."""
        where = (
            self.dtypes,
            self.row_size,
            self.stage_offset,
            self.stage_slots,
            self.placement,
            self.unread_slots,
            self.tensor_axis,
            self.tensor_size,
            self.leaf_split,
        )
        return hashlib.sha1(repr(where).encode()).hexdigest()[:16]

    def split_of(self, slot: LeafSlot) -> int | None:
        """Returns the dimension of ``slot``'s leaf split over the tensor axis (None: none)."""
        return self.leaf_split[slot.leaf] if self.leaf_split else None

    def copy_shape(self, slot: LeafSlot) -> tuple[int, ...]:
        """Returns the shape of the copy ``slot`` holds (its leaf, or rows of it), all parts."""
        split = self.split_of(slot)
        if split is None:
            return slot.shape
        return tuple(n * self.tensor_size if i == split else n for i, n in enumerate(slot.shape))

    def row_width(self, k: int) -> int:
        """Returns the length of dtype ``dtypes[k]``'s rows: ``tensor_size`` blocks."""
        return self.tensor_size * self.row_size[k]

    def dtype_index(self, dtype: str) -> int:
        """Returns the position of ``dtype`` in ``dtypes``."""
        return self.dtypes.index(dtype)

    def copies(self) -> list[tuple[int, LeafSlot]]:
        """Returns every stored copy as (device, slot)."""
        out = [
            (self.placement[s], slot) for s, slots in enumerate(self.stage_slots) for slot in slots
        ]
        out += [(0, slot) for slot in self.unread_slots]
        return out

    def bytes_per_device(self) -> int:
        """Returns the bytes of staged params one device holds (its row of every dtype)."""
        return sum(
            n * np.dtype(dt).itemsize for dt, n in zip(self.dtypes, self.row_size, strict=True)
        )


def _slot(
    leaf: int,
    aval: jax.ShapeDtypeStruct,
    rows: tuple[int, int] | None,
    dtypes,
    fill: list[int],
    split: tuple[int | None, int] = (None, 1),
) -> LeafSlot:
    """Returns a slot for ``rows`` of ``leaf`` at the end of a device row; advances ``fill``.

    ``split`` is (the dimension the tensor axis splits, the axis size): the slot holds one part.
    """
    shape = list(aval.shape) if rows is None else [rows[1] - rows[0], *aval.shape[1:]]
    if split[0] is not None:
        shape[split[0]] //= split[1]
    shape = tuple(shape)
    k = dtypes.index(dtype_name(aval.dtype))
    size = int(np.prod(shape, dtype=np.int64))
    slot = LeafSlot(leaf, dtypes[k], fill[k], size, shape, rows)
    fill[k] += size
    return slot


def _unread_rows(
    num_rows: int, reads: Sequence[tuple[int, int] | None]
) -> list[tuple[int, int] | None]:
    """Returns the row ranges of a leaf that none of ``reads`` covers (None: the whole leaf)."""
    if not reads:
        return [None]
    if any(r is None for r in reads):
        return []
    gaps, pos = [], 0
    for begin, end in sorted(reads):
        if begin > pos:
            gaps.append((pos, begin))
        pos = max(pos, end)
    if pos < num_rows:
        gaps.append((pos, num_rows))
    return gaps


def staged_layout(
    param_avals: Sequence[jax.ShapeDtypeStruct],
    stage_param_leaves: Sequence[Sequence[int]],
    placement: Sequence[int],
    num_devices: int,
    stage_param_rows: Sequence[Sequence[tuple[int, int] | None]] | None = None,
    tensor: tuple[str, int, Sequence[int | None]] | None = None,
) -> StagedLayout:
    """Returns the row layout for stages reading ``stage_param_leaves`` placed on devices.

    ``stage_param_rows[s][j]`` (default: all None) is the row range of leaf
    ``stage_param_leaves[s][j]`` that stage ``s`` reads (``Stage.param_rows``), None for all.
    ``tensor`` is (tensor-parallel axis, its size, per leaf the dimension it splits or None).
    """
    param_avals = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in param_avals)
    axis, size, leaf_split = tensor if tensor is not None else (None, 1, ())
    leaf_split = tuple(leaf_split)

    def split(leaf: int) -> tuple[int | None, int]:
        return (leaf_split[leaf] if leaf_split else None, size)

    if stage_param_rows is None:
        stage_param_rows = [[None] * len(leaves) for leaves in stage_param_leaves]
    dtypes = tuple(sorted({dtype_name(a.dtype) for a in param_avals}))
    fill = [[0] * len(dtypes) for _ in range(num_devices)]
    stage_offset = []
    stage_slots = []
    capacity = [0] * len(dtypes)
    reads: dict[int, list[tuple[int, int] | None]] = {}
    for s, (leaves, rows) in enumerate(zip(stage_param_leaves, stage_param_rows, strict=True)):
        row = fill[placement[s]]
        start = list(row)
        slots = []
        for leaf, leaf_rows in zip(leaves, rows, strict=True):
            slots.append(_slot(leaf, param_avals[leaf], leaf_rows, dtypes, row, split(leaf)))
            reads.setdefault(leaf, []).append(leaf_rows)
        for k in range(len(dtypes)):
            capacity[k] = max(capacity[k], row[k] - start[k])
        stage_offset.append(tuple(start))
        stage_slots.append(tuple(slots))
    unread = [
        _slot(leaf, aval, rows, dtypes, fill[0], split(leaf))
        for leaf, aval in enumerate(param_avals)
        for rows in _unread_rows(aval.shape[0] if aval.shape else 1, reads.get(leaf, []))
    ]
    row_size = [max(fill[d][k] for d in range(num_devices)) for k in range(len(dtypes))]
    return StagedLayout(
        dtypes=dtypes,
        row_size=tuple(row_size),
        stage_capacity=tuple(capacity),
        stage_offset=tuple(stage_offset),
        stage_slots=tuple(stage_slots),
        placement=tuple(placement),
        num_devices=num_devices,
        unread_slots=tuple(unread),
        param_avals=param_avals,
        tensor_axis=axis,
        tensor_size=size,
        leaf_split=leaf_split,
    )


class _RowsMeta:
    """The pytree metadata of packed rows. Rows with and without a known layout (restored by
    hand: ``StagedParams(rows, dtypes)``) have one tree structure, and a tree rebuilt from a
    structure keeps the layout it carried; rows of two different known layouts do not, so that
    a jitted step traced for one pipeline's rows is traced again (and refused) for another's
    rather than reused. Hashed by the dtypes alone, which equal metadata share."""

    def __init__(self, dtypes: tuple[str, ...], layout: str | None):
        self.dtypes, self.layout = dtypes, layout

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, _RowsMeta)
            and self.dtypes == other.dtypes
            and (self.layout is None or other.layout is None or self.layout == other.layout)
        )

    def __hash__(self) -> int:
        return hash(self.dtypes)

    def __repr__(self) -> str:
        where = "" if self.layout is None else f", layout {self.layout}"
        return f"{self.dtypes!r}{where}"


class PackedRows:
    """Per dtype one ``[num_devices, n]`` array, ``rows[k]`` of dtype ``dtypes[k]``, whose row
    ``d`` lives on pipeline device ``d``; a pytree whose leaves are the rows (subclasses
    register themselves)."""

    #: ``StagedLayout.fingerprint`` of the layout the rows follow (None: not known, as for rows
    #: put together by hand or unpickled from an older zbjax), so that rows of another
    #: pipeline's layout are refused. It is not part of the pytree structure.
    layout: str | None = None

    def __init__(self, rows: Sequence[jax.Array], dtypes: Sequence[str], layout: str | None = None):
        self.rows = tuple(rows)
        self.dtypes = tuple(dtypes)
        self.layout = layout
        if len(self.rows) != len(self.dtypes):
            raise PipelineError(
                f"{type(self).__name__} of {len(self.rows)} rows and {len(self.dtypes)} dtypes "
                f"{list(self.dtypes)}; give one row per dtype (rows as pipe.stage returns them)"
            )

    def __contains__(self, key: object) -> bool:
        """False: the rows hold no named entries (Flax's ``TrainState`` asks whether the params
        hold "overwrite_with_gradient" before it applies gradients)."""
        return False

    def tree_flatten(self):
        return self.rows, _RowsMeta(self.dtypes, self.layout)

    @classmethod
    def tree_unflatten(cls, meta, rows):
        return cls(rows, meta.dtypes, meta.layout)

    def __repr__(self) -> str:
        # The rows' own dtypes (a row cast by jax.tree.map keeps the recorded ones); a leaf
        # that is no array (jax.tree.map(lambda x: x.shape, staged)) is shown as it is.
        shown = ", ".join(
            f"{dtype_name(r.dtype)}{list(r.shape)}"
            if hasattr(r, "dtype") and hasattr(r, "shape")
            else repr(r)
            for r in self.rows
        )
        return f"{type(self).__name__}({shown})"


@jax.tree_util.register_pytree_node_class
class StagedParams(PackedRows):
    """Params (or grads) in the staged layout: ``rows[k]`` is a ``[num_devices, row_size[k]]``
    array of dtype ``dtypes[k]``; row ``d`` packs device ``d``'s parameter leaves."""


def _tensor_parts(layout: StagedLayout, slot: LeafSlot, value: jax.Array) -> list[jax.Array]:
    """Returns the ``tensor_size`` parts of a copy's ``value`` that the blocks of a row hold:
    its slices along the split dimension, or the whole value in every block."""
    split = layout.split_of(slot)
    if split is None:
        return [value] * layout.tensor_size
    return jnp.split(value, layout.tensor_size, axis=split)


def _join_parts(layout: StagedLayout, slot: LeafSlot, parts: Sequence[jax.Array]) -> jax.Array:
    """Returns a copy's value from its blocks' parts (the inverse of ``_tensor_parts``)."""
    split = layout.split_of(slot)
    if split is None or len(parts) == 1:
        return parts[0]
    return _concatenate(parts, axis=split)


def _concatenate(parts: Sequence[Any], axis: int = 0) -> Any:
    """Returns ``parts`` joined along ``axis``: in NumPy when they are host values."""
    if all(isinstance(p, np.ndarray) for p in parts):
        return np.concatenate(parts, axis=axis)
    return _bitwise(lambda bits: jnp.concatenate(bits, axis=axis), parts)


def _bitwise(join: Callable[[list], jax.Array], parts: Sequence[jax.Array]) -> jax.Array:
    """Returns ``join(parts)`` (a concatenation or a stack) done on the parts' bits where they
    are floats of one or two bytes: XLA:CPU joins bfloat16 by way of float32, which quiets
    NaN payloads (0x7fc1 came back 0x7fc0), and ``unstage(stage(params))`` gives every bit
    back."""
    dtype = jnp.result_type(*parts) if parts else None
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating) or dtype.itemsize > 2:
        return join(list(parts))
    carrier = jnp.dtype(f"uint{8 * dtype.itemsize}")
    bits = [jax.lax.bitcast_convert_type(jnp.asarray(p, dtype), carrier) for p in parts]
    return jax.lax.bitcast_convert_type(join(bits), dtype)


def stage_leaves(layout: StagedLayout, leaves: Sequence[jax.Array]) -> StagedParams:
    """Returns the staged layout of the flat param ``leaves`` (works under ``jax.jit``)."""
    T = layout.tensor_size
    # pieces[k][device][block]: the flat values of that block, in row order.
    pieces: list = [
        [[[] for _ in range(T)] for _ in range(layout.num_devices)] for _ in layout.dtypes
    ]
    fill = [[0] * len(layout.dtypes) for _ in range(layout.num_devices)]
    for device, slot in sorted(layout.copies(), key=lambda c: (c[0], c[1].offset)):
        k = layout.dtype_index(slot.dtype)
        gap = slot.offset - fill[device][k]
        value = jnp.asarray(leading_rows(leaves[slot.leaf], slot.rows), slot.dtype)
        for block, part in zip(pieces[k][device], _tensor_parts(layout, slot, value), strict=True):
            if gap > 0:
                block.append(jnp.zeros(gap, slot.dtype))
            block.append(jnp.ravel(part))
        fill[device][k] = slot.offset + slot.size
    rows = []
    for k, dt in enumerate(layout.dtypes):
        device_rows = []
        for d in range(layout.num_devices):
            pad = layout.row_size[k] - fill[d][k]
            parts = [
                p for block in pieces[k][d] for p in block + ([jnp.zeros(pad, dt)] if pad else [])
            ]
            device_rows.append(_concatenate(parts) if parts else jnp.zeros(0, dt))
        rows.append(_bitwise(jnp.stack, device_rows))
    return StagedParams(rows, layout.dtypes, layout.fingerprint)


def _slot_value(rows: Sequence[jax.Array], layout: StagedLayout, device: int, slot: LeafSlot):
    k = layout.dtype_index(slot.dtype)
    row = rows[k][device]
    if layout.tensor_size == 1:
        return _slice(row, slot).reshape(slot.shape)
    blocks = row.reshape(layout.tensor_size, layout.row_size[k])
    parts = [_slice(b, slot).reshape(slot.shape) for b in blocks]
    return _join_parts(layout, slot, parts)


def _slice(row: jax.Array | np.ndarray, slot: LeafSlot) -> jax.Array | np.ndarray:
    if isinstance(row, np.ndarray):
        return row[slot.offset : slot.offset + slot.size]
    # lax.slice: indexing an array typed on a mesh to an empty result (a leaf of size 0)
    # fails in JAX outside a mesh context.
    return jax.lax.slice_in_dim(row, slot.offset, slot.offset + slot.size)


def read_slots(
    layout: StagedLayout, local_rows: Sequence[jax.Array], slots: Sequence[LeafSlot]
) -> list[jax.Array]:
    """Returns the values ``slots`` hold in one device's rows (inside the pipeline's
    ``shard_map``); over a tensor axis each comes out split as its leaf's spec says."""
    parts = []
    for slot in slots:
        k = layout.dtype_index(slot.dtype)
        row = local_rows[k]
        if layout.tensor_size > 1:
            # The slot's part in every block: [T, size], split over the tensor axis.
            row = jnp.reshape(row, (layout.tensor_size, layout.row_size[k]))
            parts.append(jax.lax.slice_in_dim(row, slot.offset, slot.offset + slot.size, axis=1))
        else:
            part = jax.lax.slice_in_dim(row, slot.offset, slot.offset + slot.size)
            parts.append(jnp.reshape(part, slot.shape))
    if layout.tensor_size == 1 or not slots:
        return parts
    shapes = [slot.shape for slot in slots]
    return from_blocks(layout.tensor_axis, parts, shapes, [layout.split_of(s) for s in slots])


def write_slots(
    layout: StagedLayout,
    row: jax.Array,
    start: int,
    slots: Sequence[LeafSlot],
    values: Sequence[jax.Array],
    *,
    add: bool,
) -> jax.Array:
    """Returns one device's ``row`` (of one dtype) with ``values``, the leaves of ``slots``
    that lie back to back from ``start``, written (``add``: added) there as one vector
    (inside the pipeline's ``shard_map``; over a tensor axis each block gets its parts)."""
    values = [jnp.asarray(v).astype(row.dtype) for v in values]
    if layout.tensor_size == 1:
        vector = [jnp.ravel(v) for v in values]
        vector = jnp.concatenate(vector) if len(vector) > 1 else vector[0]
        return add_rows(row, start, vector) if add else set_rows(row, start, vector)
    T, width = layout.tensor_size, row.shape[0] // layout.tensor_size
    parts = to_blocks(layout.tensor_axis, values, [layout.split_of(s) for s in slots])
    blocks = row.reshape(T, width)
    if add:
        parts = parts + jax.lax.slice_in_dim(blocks, start, start + parts.shape[1], axis=1)
    blocks = jax.lax.dynamic_update_slice_in_dim(blocks, parts, start, axis=1)
    return blocks.reshape(row.shape)


def _copies_by_leaf(layout: StagedLayout) -> list[list[tuple[int, LeafSlot]]]:
    by_leaf: list[list[tuple[int, LeafSlot]]] = [[] for _ in layout.param_avals]
    for device, slot in layout.copies():
        by_leaf[slot.leaf].append((device, slot))
    return by_leaf


def _first_copies(copies: Sequence[tuple[int, LeafSlot]]) -> list[tuple[int, LeafSlot, int]]:
    """Returns (device, slot, rows to skip) of the copies that first hold each part of a leaf:
    its first whole copy, else its row-range copies in row order, each from the first row that
    an earlier one does not hold."""
    whole = [(d, slot) for d, slot in copies if slot.rows is None]
    if whole:
        return [(*whole[0], 0)]
    chosen, pos = [], 0
    for device, slot in sorted(copies, key=lambda c: c[1].rows):
        begin, end = slot.rows
        if end > pos:
            chosen.append((device, slot, pos - begin))
            pos = end
    return chosen


def unstage_leaves(layout: StagedLayout, staged: StagedParams) -> list[jax.Array]:
    """Returns the flat param leaves stored in ``staged`` (the first copy of a tied leaf; a
    leaf stored in row ranges is put together from them, first copy of every row). Rows given
    as NumPy arrays give NumPy leaves (no compile per slice)."""
    out: list = []
    for copies in _copies_by_leaf(layout):
        pieces = []
        for device, slot, skip in _first_copies(copies):
            value = _slot_value(staged.rows, layout, device, slot)
            pieces.append(value[skip:] if skip else value)
        out.append(_concatenate(pieces) if len(pieces) > 1 else pieces[0])
    return out


def _tiles(copies: Sequence[tuple[int, LeafSlot]]) -> bool:
    """Returns whether ``copies`` are row ranges of a leaf that do not overlap, so that every
    element of the leaf has one copy and its gradient is that copy's."""
    ranges = sorted(slot.rows for _, slot in copies if slot.rows is not None)
    disjoint = all(a[1] <= b[0] for a, b in zip(ranges, ranges[1:], strict=False))
    return bool(ranges) and len(ranges) == len(copies) and disjoint


def _summed_gradient(
    layout: StagedLayout, staged: StagedParams, copies: Sequence[tuple[int, LeafSlot]]
) -> jax.Array:
    """Returns one leaf's gradient: the sum over its ``copies``, a row-range copy adding to
    its rows."""
    aval = layout.param_avals[copies[0][1].leaf]
    return _sum_copies(aval, [(s, _slot_value(staged.rows, layout, d, s)) for d, s in copies])


def _sum_copies(
    aval: jax.ShapeDtypeStruct,
    pieces: Sequence[tuple[LeafSlot, jax.Array]],
    dtype: Any = None,
):
    """Returns the sum of a leaf's copies ``(slot, value)`` in the leaf's shape (in ``dtype``,
    else the leaf's): a row-range copy adds to its rows, and elements no copy holds are zero."""
    dtype = aval.dtype if dtype is None else dtype
    total = jnp.zeros(aval.shape, dtype)
    for slot, value in pieces:
        value = value.astype(dtype)
        if slot.rows is None:
            total = total + value
        else:
            total = add_rows(total, slot.rows[0], value)
    return total


def unstage_gradients(layout: StagedLayout, staged: StagedParams) -> list[jax.Array]:
    """Returns flat param gradients from staged ones: the sum over every copy of a leaf (a
    copy of some rows adds to those rows)."""
    out: list = []
    for copies in _copies_by_leaf(layout):
        if _tiles(copies):
            # Row ranges that tile the leaf (the unread rest has a zero gradient slot).
            ordered = sorted(copies, key=lambda c: c[1].rows)
            out.append(jnp.concatenate([_slot_value(staged.rows, layout, *c) for c in ordered]))
        else:
            out.append(_summed_gradient(layout, staged, copies))
    return out


def shared_leaves(layout: StagedLayout) -> list[list[tuple[int, LeafSlot]]]:
    """Returns the copies of every leaf whose gradient needs a sum over copies: tied leaves
    and overlapping row ranges (a leaf stored once, or in row ranges that tile it, needs none).
    """
    return [c for c in _copies_by_leaf(layout) if len(c) > 1 and not _tiles(c)]


def sum_shared_gradients(layout: StagedLayout, rows: Sequence[jax.Array], axis: str) -> list:
    """Returns a device's gradient ``rows`` with every copy of a ``shared_leaves`` leaf
    holding the leaf's whole gradient, the sum over its copies. Runs inside the lowering's
    ``shard_map`` over ``axis`` (which checks no varying axes).

    Each device adds up its own copies of a shared leaf into a leaf-shaped value, one ``psum``
    totals them all (``psum_concatenated``), and each device writes the total back into its
    copies. Only shared leaves move; every other slot already holds its leaf's gradient. The
    result equals ``stage_leaves(layout, unstage_gradients(layout, staged))`` row by row.
    """
    groups = shared_leaves(layout)
    if not groups:
        return list(rows)
    if layout.tensor_size == 1:
        return _sum_shared_by_index(layout, groups, rows, axis)

    def gather(device: int):
        def branch(rows):
            out = []
            for copies in groups:
                slots = [slot for d, slot in copies if d == device]
                values = read_slots(layout, rows, slots)
                aval = layout.param_avals[copies[0][1].leaf]
                pieces = list(zip(slots, values, strict=True))
                out.append(_sum_copies(aval, pieces, wide_dtype(aval.dtype)))
            return out

        return branch

    def scatter(device: int):
        def branch(rows, totals):
            rows = list(rows)
            for copies, total in zip(groups, totals, strict=True):
                for _, slot in (c for c in copies if c[0] == device):
                    k = layout.dtype_index(slot.dtype)
                    value = leading_rows(total, slot.rows)
                    rows[k] = write_slots(layout, rows[k], slot.offset, [slot], [value], add=False)
            return rows

        return branch

    # The slots differ by device, so each device runs its own static code (one branch each).
    mine = per_device(axis, layout.num_devices, gather, list(rows))
    totals = psum_concatenated(mine, axis)
    return per_device(axis, layout.num_devices, scatter, list(rows), totals)


def _sum_shared_by_index(
    layout: StagedLayout, groups: Sequence[Sequence[tuple[int, LeafSlot]]], rows, axis: str
) -> list:
    """``sum_shared_gradients`` without a tensor axis, in a few ops whatever the number of
    shared leaves: per dtype, each device gathers its copies' elements into one vector of all
    the shared leaves (one gather per copy a device holds of the same element, added in slot
    order as before), and after the ``psum`` selects the totals back into its copies' places.
    Reading and writing each leaf's slots on its own put a slice and an update per copy into
    every device's branch, and 400 tied leaves took seconds to compile (helper D)."""
    dtypes = sorted({layout.dtype_index(copies[0][1].dtype) for copies in groups})
    # Where each shared leaf starts in its dtype's vector of totals.
    base, length = {}, dict.fromkeys(dtypes, 0)
    for copies in groups:
        leaf, k = copies[0][1].leaf, layout.dtype_index(copies[0][1].dtype)
        base[leaf], length[k] = length[k], length[k] + math.prod(layout.param_avals[leaf].shape)

    def places(device: int, k: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """(row positions, total positions) of each copy of dtype ``k`` on ``device``."""
        out = []
        for copies in groups:
            for d, slot in copies:
                # (An empty leaf has nothing to sum: a zero-size copy takes no place.)
                if d != device or layout.dtype_index(slot.dtype) != k or not slot.size:
                    continue
                start = base[slot.leaf]
                if slot.rows is not None:
                    start += slot.rows[0] * math.prod(layout.param_avals[slot.leaf].shape[1:])
                span = np.arange(slot.size, dtype=np.int32)
                out.append((slot.offset + span, start + span))
        return out

    def gather(device: int):
        def branch(rows):
            out = []
            for k in dtypes:
                row = rows[k]
                pad = row.shape[0]  # index of the zero appended to the row
                count = np.zeros(length[k], np.int32)
                index = []  # index[j][t]: where the (j+1)-th copy of total element t sits
                for row_at, total_at in places(device, k):
                    for j in np.unique(count[total_at]):
                        if j == len(index):
                            index.append(np.full(length[k], pad, np.int32))
                        at = count[total_at] == j
                        index[j][total_at[at]] = row_at[at]
                    count[total_at] += 1
                if not index:
                    out.append(jnp.zeros(length[k], row.dtype))
                    continue
                row = jnp.concatenate([row, jnp.zeros(1, row.dtype)])
                total = row[index[0]]
                for more in index[1:]:
                    total = total + row[more]
                out.append(total)
            return out

        return branch

    def scatter(device: int):
        def branch(rows, totals):
            rows = list(rows)
            for k, total in zip(dtypes, totals, strict=True):
                found = places(device, k)
                if not found:
                    continue
                held = np.zeros(rows[k].shape[0], bool)
                source = np.zeros(rows[k].shape[0], np.int32)
                for row_at, total_at in found:
                    held[row_at], source[row_at] = True, total_at
                rows[k] = jnp.where(held, total[source].astype(rows[k].dtype), rows[k])
            return rows

        return branch

    # The places differ by device, so each device runs its own static code (one branch each).
    mine = per_device(axis, layout.num_devices, gather, list(rows))
    totals = psum_concatenated(mine, axis)
    return per_device(axis, layout.num_devices, scatter, list(rows), totals)


def psum_concatenated(values: Sequence[jax.Array], axis: str) -> list[jax.Array]:
    """Returns ``[reduce_wide(jax.lax.psum, x, axis) for x in values]`` with one ``psum`` per
    reduction dtype: the values are flattened and concatenated, summed, and split again. One
    ``psum`` per value put one all-reduce per tied leaf in the step (helper D); XLA:CPU merges
    them only late, and the step ran slower. Each element is still the sum of its own devices'
    elements, so the totals are those of separate ``psum``s."""
    groups: dict[Any, list[int]] = {}
    for i, x in enumerate(values):
        groups.setdefault(wide_dtype(x.dtype), []).append(i)
    out: list = [None] * len(values)
    for wide, members in groups.items():
        flat = jnp.concatenate([values[i].astype(wide).reshape(-1) for i in members])
        summed = jax.lax.psum(flat, axis)
        start = 0
        for i in members:
            x = values[i]
            out[i] = summed[start : start + x.size].reshape(x.shape).astype(x.dtype)
            start += x.size
    return out


def wide_dtype(dtype: Any) -> Any:
    """Returns float32 for a 16-bit float dtype (sums kept in it lose less and do not
    overflow), else ``dtype``."""
    if jnp.issubdtype(dtype, jnp.floating) and jnp.dtype(dtype).itemsize < 4:
        return jnp.dtype(jnp.float32)
    return dtype


def reduce_wide(collective: Callable[..., Any], x: jax.Array, axes: Any) -> jax.Array:
    """Returns ``collective(x, axes)`` (``jax.lax.psum`` or ``pmean``), a 16-bit float reduced
    in float32: XLA:CPU aborted the process compiling a bfloat16 all-reduce in a step whose
    tensor axis XLA partitions (its all-reduce promotion pass), and a float32 sum loses less."""
    wide = wide_dtype(x.dtype)
    if wide != x.dtype:
        return collective(x.astype(wide), axes).astype(x.dtype)
    return collective(x, axes)


def per_device(axis: str, num_devices: int, branch, *operands):
    """Returns ``branch(d)(*operands)`` on pipeline device ``d`` of ``axis``: each device runs
    its own static code, one ``lax.switch`` branch per device (inside ``shard_map``)."""
    if num_devices == 1:
        return branch(0)(*operands)
    index = jax.lax.axis_index(axis)
    return jax.lax.switch(index, [branch(d) for d in range(num_devices)], *operands)


def extra_copies(layout: StagedLayout) -> list[tuple[int, LeafSlot, int, int]]:
    """Returns (device, slot, first row, end row) of every stored part of a param element that
    is not its first copy: the second copy of a tied leaf, rows an earlier row-range copy
    already holds. Usually a handful of slots, whatever the model's size.
    """
    extras = []
    for copies in _copies_by_leaf(layout):
        first = {id(slot): skip for _, slot, skip in _first_copies(copies)}
        for device, slot in copies:
            rows = slot.shape[0] if slot.shape else 1
            skip = first.get(id(slot), rows)
            if skip:
                extras.append((device, slot, 0, skip))
    return extras


def _norm_extras(layout: StagedLayout) -> list[tuple[int, LeafSlot, int, int]]:
    """Returns (device, slot, first, end) element ranges of the rows (``row_width`` long)
    whose elements another range also holds: the ``extra_copies``, in every block of a split
    leaf and in block 0 of a replicated one, and the blocks after the first of every copy of a
    leaf replicated over the tensor axis (each block holds all of it)."""
    T = layout.tensor_size
    out = []
    for device, slot, begin, end in extra_copies(layout):
        row_elems = slot.size // slot.shape[0] if slot.shape else slot.size
        lo = slot.offset + begin * row_elems if slot.shape else slot.offset
        hi = slot.offset + end * row_elems if slot.shape else slot.offset + slot.size
        R = layout.row_size[layout.dtype_index(slot.dtype)]
        blocks = range(T) if layout.split_of(slot) is not None else range(1)
        out += [(device, slot, b * R + lo, b * R + hi) for b in blocks]
    for device, slot in layout.copies() if T > 1 else ():
        if layout.split_of(slot) is None:
            R = layout.row_size[layout.dtype_index(slot.dtype)]
            start = slot.offset
            out += [(device, slot, b * R + start, b * R + start + slot.size) for b in range(1, T)]
    return out


def _padding(layout: StagedLayout, k: int) -> list[tuple[int, int, int]]:
    """Returns (device, first, end) of the element ranges of dtype ``k``'s rows that no copy of
    a leaf holds (the padding up to ``row_size``, in every tensor block)."""
    width, R = layout.row_width(k), layout.row_size[k]
    held = np.zeros((layout.num_devices, width), bool)
    for device, slot in layout.copies():
        if layout.dtype_index(slot.dtype) == k:
            for b in range(layout.tensor_size):
                held[device, b * R + slot.offset : b * R + slot.offset + slot.size] = True
    ranges = []
    for device in range(layout.num_devices):
        flips = np.flatnonzero(np.diff(np.concatenate([[True], held[device], [True]]).astype(int)))
        starts, ends = flips[::2], flips[1::2]  # each unheld run: where it starts and ends
        ranges += [(device, int(lo), int(hi)) for lo, hi in zip(starts, ends, strict=True)]
    return ranges


def _counted_once(layout: StagedLayout, k: int, row: jax.Array) -> jax.Array:
    """Returns ``row`` (all devices' rows of dtype ``k``) with zeros in its padding and in the
    extra copies of leaves (``_norm_extras``), selected by index comparisons (no constant as
    large as the rows): left out, not subtracted, as an inf subtracted from an inf is NaN."""
    ranges = _padding(layout, k) + [
        (device, lo, hi)
        for device, slot, lo, hi in _norm_extras(layout)
        if layout.dtype_index(slot.dtype) == k
    ]
    if not ranges:
        return row
    device = jax.lax.broadcasted_iota(jnp.int32, row.shape, 0)
    column = jax.lax.broadcasted_iota(jnp.int32, row.shape, 1)
    left_out = functools.reduce(
        jnp.logical_or,
        [(device == d) & (column >= lo) & (column < hi) for d, lo, hi in ranges],
    )
    return jnp.where(left_out, jnp.zeros((), row.dtype), row)


def global_norm(layout: StagedLayout, staged: StagedParams) -> jax.Array:
    """Returns the L2 norm of the params (or grads) in ``staged``, each element counted once:
    equal to ``optax.tree.norm`` of the user-layout tree, integer and bool leaves included
    (works under ``jax.jit``).

    The norm of every row without the ``extra_copies`` (and, over a tensor axis, the blocks'
    copies of replicated leaves). Row padding is left out: ``stage_leaves`` and the step's
    gradients leave zeros there, but an optimizer run on the rows may not (0 / 0 in
    ``optax.adam(eps=0)``, or in float16 Adam whose eps underflows, makes NaN there).
    """
    return jnp.sqrt(staged_sum_of_squares(layout, staged))


def staged_sum_of_squares(layout: StagedLayout, staged: StagedParams) -> jax.Array:
    """Returns the squared ``global_norm`` of ``staged``: each element's square counted once."""
    return sum(sum_of_squares(_counted_once(layout, k, row)) for k, row in enumerate(staged.rows))


def sum_of_squares(x: jax.Array, axis: int | None = None) -> jax.Array:
    """Returns the sum of ``|x|^2`` (along ``axis``, else all of it), as ``optax.tree.norm``
    squares: 16-bit floats summed in float32, float64 (x64) in float64, complex values by
    their modulus, integers and bools (0 or 1) in float32."""
    # Spelled out rather than promoted: jax_numpy_dtype_promotion="strict" refuses promotion.
    wide = x.dtype if jnp.issubdtype(x.dtype, jnp.inexact) else jnp.dtype(jnp.float32)
    x = x.astype(wide_dtype(wide))
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        return jnp.sum(jnp.square(jnp.real(x)) + jnp.square(jnp.imag(x)), axis=axis)
    return jnp.sum(jnp.square(x), axis=axis)


def unpack_stage_params(
    layout: StagedLayout, stage: int, local_rows: Sequence[jax.Array]
) -> list[jax.Array]:
    """Returns stage ``stage``'s param leaves (``param_leaves`` order) from its device's rows."""
    return read_slots(layout, local_rows, layout.stage_slots[stage])
