"""Optax transformations on staged params that see the user's parameter tree.

Staged params (``zbjax.params``) are, per dtype, one ``[num_devices, L]`` array whose row ``d``
packs device ``d``'s parameter leaves back to back. An optax transformation that works element
by element (``sgd``, ``adam``, ``adamw`` without a mask, ``lion``) gives the same result on
those rows as on the user's tree. One that looks at the tree does not: a weight-decay mask
(``optax.adamw(mask=...)``), ``optax.multi_transform`` labels, and transformations that use a
leaf's shape or norm (``adafactor``, ``lamb``, ``lars``, ``scale_by_trust_ratio``) would see two
leaves, the rows, instead of the model's parameters.

``per_leaf(tx, ...)`` runs ``tx`` on each device's own leaves in the user's tree structure:
inside a ``shard_map`` over the pipeline axis every device unpacks its row into the leaves its
stages hold (static slices; ``params.per_device``, a ``lax.switch``, picks the device's code, as
for ``params.sum_shared_gradients``), calls ``tx``, and packs the updates back into its row.
A leaf the device does not hold is None in its tree (an empty subtree, which optax's tree maps
pass over, as they do its masked leaves), so ``tx`` neither computes nor traces it there and
the optimizer state of a device holds only its leaves' share. The state is packed the same way,
per dtype one ``[num_devices, S]`` array (``StagedState``), each device's state leaves back to
back.

What a device's ``tx`` sees, and so what matches the user-layout optimizer exactly:

- a leaf a stage of the device reads whole is that leaf; a leaf stored on several devices (a
  tied embedding) is seen whole by each, gets the same summed gradient, and so the same update;
- a leaf of which the device holds some rows (the layers of a stacked ``nn.scan`` parameter its
  stages run) is seen as those rows, in order: element-wise transformations and masks given
  as trees or computed from a leaf's path, ``ndim`` or trailing dimensions match exactly (a
  mask function reading the leading dimension or size sees the rows); a transformation that
  reduces over a whole leaf (``lamb``'s trust ratio, ``adafactor``'s factored moments)
  reduces over the device's rows of it instead;
- nothing crosses devices, so a transformation that decides on the whole tree
  (``clip_by_global_norm``; ``apply_if_finite``, which inside would skip a step on one device
  only) must stay outside: ``optax.chain(pipe.clip_by_global_norm(1.0), pipe.per_leaf(tx))``;
- each device's tree has every dtype of the user's (``device_views``: a row of zeros stands
  in for a dtype it holds none of), as optax reads the tree's dtypes (``inject_hyperparams``);
  a scalar state leaf (a hyperparameter) whose dtype still differs from the one ``tx.init``
  makes on the user's tree (``inject_hyperparams`` inside ``multi_transform``, which looks
  at a label's leaves only) is refused with the fix;
- updates come back in the rows' dtypes, and in float32 rows for a 16-bit float dtype whose
  updates ``tx`` makes wider (their recorded dtypes stay the params'), so
  ``optax.apply_updates`` rounds ``param + update`` once, as on the user's tree, rather than
  rounding the update first.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from zbjax._jax_compat import place_for_shard_map, shard_map
from zbjax.errors import PipelineError
from zbjax.params import (
    LeafSlot,
    PackedRows,
    StagedLayout,
    StagedParams,
    dtype_name,
    per_device,
    read_slots,
    wide_dtype,
)
from zbjax.tensor import from_blocks, to_blocks, value_splits


@dataclass(frozen=True)
class LeafView:
    """One leaf as one device's optimizer sees it.

    ``shape`` is the view's shape: the leaf's, or its held rows' (leading axis shortened);
    ``reads`` are (slot, first row of the slot to take) in view order: concatenated they make
    the view, and there are none when the device holds none of the leaf. ``writes`` are
    (slot, first row of the view) for every copy on the device: each gets its rows of the view.
    ``stand_in``: the device holds none of the leaf, but its optimizer gets one row of zeros of
    its dtype (``device_views``), whose update is dropped.
    """

    shape: tuple[int, ...]
    dtype: str
    reads: tuple[tuple[LeafSlot, int], ...]
    writes: tuple[tuple[LeafSlot, int], ...]
    stand_in: bool = False

    @property
    def given(self) -> bool:
        """Whether the device's optimizer gets this leaf (else None stands in its tree)."""
        return bool(self.reads) or self.stand_in


def _slot_rows(slot: LeafSlot, num_rows: int) -> tuple[int, int]:
    return slot.rows if slot.rows is not None else (0, num_rows)


def leaf_view(aval: Any, slots: Sequence[LeafSlot]) -> LeafView:
    """Returns the view of a leaf with ``aval`` whose copies on one device are ``slots``."""
    shape, dtype = tuple(aval.shape), dtype_name(aval.dtype)
    if not slots:
        return LeafView((0, *shape[1:]), dtype, (), ())
    if not shape:  # a scalar leaf is stored whole
        return LeafView((), dtype, ((slots[0], 0),), tuple((s, 0) for s in slots))
    # Rows held, as disjoint runs; a whole copy holds every row.
    spans = sorted(_slot_rows(s, shape[0]) for s in slots)
    runs: list[list[int]] = []
    for begin, end in spans:
        if runs and begin <= runs[-1][1]:
            runs[-1][1] = max(runs[-1][1], end)
        else:
            runs.append([begin, end])
    run_start, pos = [], 0
    for begin, end in runs:
        run_start.append(pos)
        pos += end - begin

    def view_row(row: int) -> int:
        i = max(j for j, run in enumerate(runs) if run[0] <= row)
        return run_start[i] + row - runs[i][0]

    reads, covered = [], -1
    for slot in sorted(slots, key=lambda s: _slot_rows(s, shape[0])):
        begin, end = _slot_rows(slot, shape[0])
        if end > covered:
            first = max(begin, covered) if covered >= 0 else begin
            reads.append((slot, first - begin))
            covered = end
    writes = tuple((s, view_row(_slot_rows(s, shape[0])[0])) for s in slots)
    return LeafView((pos, *shape[1:]), dtype, tuple(reads), writes)


def device_views(layout: StagedLayout) -> list[list[LeafView]]:
    """Returns, per device, the view of every param leaf (``param_leaves`` order).

    For each dtype of the user's tree that none of a device's leaves has, the first leaf of
    that dtype is given to the device's optimizer as one row of zeros (``LeafView.stand_in``):
    optax reads the tree's dtypes (``optax.inject_hyperparams`` keeps its hyperparameters in
    the tree's highest float dtype), so a device holding only bfloat16 leaves of a tree with
    float32 ones would otherwise keep ``b2 = 0.999`` in bfloat16, where it is 1.0, and divide
    by zero."""
    held: list[list[list[LeafSlot]]] = [
        [[] for _ in layout.param_avals] for _ in range(layout.num_devices)
    ]
    for device, slot in layout.copies():
        held[device][slot.leaf].append(slot)
    out = []
    for d in range(layout.num_devices):
        views = [leaf_view(aval, held[d][i]) for i, aval in enumerate(layout.param_avals)]
        present = {v.dtype for v in views if v.reads}
        for i, view in enumerate(views):
            if view.dtype not in present:
                present.add(view.dtype)
                # One row of zeros, not none: shape logic (muon's fan_out / fan_in) divided by 0.
                shape = layout.param_avals[i].shape
                stand_in = (1, *shape[1:]) if shape else ()
                views[i] = dataclasses.replace(view, shape=stand_in, stand_in=True)
        out.append(views)
    return out


def unpack_views(
    layout: StagedLayout, views: Sequence[LeafView], rows: Sequence[jax.Array]
) -> list[jax.Array]:
    """Returns one device's leaves as ``views`` say, from its rows (one vector per dtype);
    None for a leaf it does not hold (zeros for a stand-in)."""
    out: list = []
    for view in views:
        if not view.reads:
            out.append(jnp.zeros(view.shape, view.dtype) if view.stand_in else None)
            continue
        values = read_slots(layout, rows, [slot for slot, _ in view.reads])
        # A scalar leaf is read whole (skip 0): it has no rows to skip.
        pieces = [v[skip:] if skip else v for v, (_, skip) in zip(values, view.reads, strict=True)]
        out.append(pieces[0] if len(pieces) == 1 else jnp.concatenate(pieces))
    return out


def _pack(
    pieces: Sequence[tuple[int, jax.Array, int | None]],
    size: int,
    dtype: str,
    tensor: tuple[str, int] | None = None,
) -> jax.Array:
    """Returns a ``size``-long vector with each flat value of ``pieces`` (offset, value, split)
    at its offset, zeros elsewhere (``pieces`` do not overlap). Over a tensor axis
    (``tensor``: its name and size T) the vector is T blocks of ``size``, each device's holding
    its part of each value (split along ``split``, or all of it for None)."""
    blocks = 1 if tensor is None else tensor[1]
    parts, fill = [], 0
    for offset, value, split in sorted(pieces, key=lambda p: p[0]):
        if offset > fill:
            parts.append(jnp.zeros((blocks, offset - fill), dtype))
        value = jnp.asarray(value).astype(dtype)
        part = jnp.ravel(value)[None] if tensor is None else to_blocks(tensor[0], [value], [split])
        parts.append(part)
        # max: an empty value (a leaf of size 0) may share its offset with the one before it
        fill = max(fill, offset + part.shape[1])
    if size > fill or not parts:
        parts.append(jnp.zeros((blocks, size - fill), dtype))
    return (jnp.concatenate(parts, axis=1) if len(parts) > 1 else parts[0]).reshape(-1)


def _tensor(layout: StagedLayout) -> tuple[str, int] | None:
    return (layout.tensor_axis, layout.tensor_size) if layout.tensor_size > 1 else None


def pack_views(
    layout: StagedLayout,
    views: Sequence[LeafView],
    values: Sequence[jax.Array],
    row_dtypes: Sequence[Any] | None = None,
) -> list[jax.Array]:
    """Returns one device's rows (one vector per dtype) holding ``values`` as ``views`` say,
    every copy of a leaf its rows of the value; padding and others' slots hold zeros. The
    rows are of ``row_dtypes`` (by default a 16-bit float dtype's in float32,
    ``params.wide_dtype``: updates computed wider than their leaves, which optax adds to the
    params before rounding once)."""
    if row_dtypes is None:
        row_dtypes = [wide_dtype(dt) for dt in layout.dtypes]
    pieces: list[list] = [[] for _ in layout.dtypes]
    for view, value in zip(views, values, strict=True):
        for slot, first in view.writes:
            rows = layout.copy_shape(slot)[0] if slot.shape else None
            part = value if rows is None else value[first : first + rows]
            pieces[layout.dtype_index(slot.dtype)].append(
                (slot.offset, part, layout.split_of(slot))
            )
    return [
        _pack(p, size, dt, _tensor(layout))
        for p, size, dt in zip(pieces, layout.row_size, row_dtypes, strict=True)
    ]


def update_row_dtypes(
    layout: StagedLayout,
    views: Sequence[Sequence[LeafView]],
    update_dtypes: Sequence[Sequence],
    incoming: Sequence[Any],
) -> list[Any]:
    """Returns the dtype of each update row: its ``incoming`` update row's dtype promoted with
    the dtypes of the updates each device's optimizer returns for its leaves (float32 for a
    bfloat16 leaf under ``mu_dtype=jnp.float32``, a float for an integer leaf under weight
    decay), as optax returns them on the user's tree. Updates in the leaves' own dtypes stay
    in it: a transformation wrapping the update (``optax.apply_if_finite``) gets the dtypes it
    expects, and adding a 16-bit update in float32 rounds as adding it in its dtype does."""
    out = [jnp.dtype(dt) for dt in incoming]
    for device_views_, dtypes in zip(views, update_dtypes, strict=True):
        for view, dtype in zip(device_views_, dtypes, strict=True):
            if view.reads and dtype is not None:
                k = layout.dtype_index(view.dtype)
                out[k] = jnp.promote_types(out[k], dtype)
    return out


@jax.tree_util.register_pytree_node_class
class StagedState(PackedRows):
    """An optimizer state made by ``per_leaf``: ``rows[k]`` is a ``[num_devices, S_k]`` array
    of dtype ``dtypes[k]`` whose row ``d`` packs device ``d``'s state leaves."""


@dataclass(frozen=True)
class StateLayout:
    """Where each device's optimizer state leaves sit in its ``StagedState`` rows.

    ``treedefs[d]`` is device ``d``'s state tree structure (they may differ: a mask computed
    from leaf sizes, say), ``leaves[d]`` its leaves' (dtype index, offset, shape, split). Over
    a tensor axis (``tensor``: its name and size T) a row is T blocks of ``row_size``, and a
    leaf split along ``split`` holds its part in each (``shape`` is a part's), as staged params
    do."""

    dtypes: tuple[str, ...]
    row_size: tuple[int, ...]
    treedefs: tuple[Any, ...]
    leaves: tuple[tuple[tuple[int, int, tuple[int, ...], int | None], ...], ...]
    tensor: tuple[str, int] | None = None

    def row_width(self, k: int) -> int:
        """Returns the length of dtype ``dtypes[k]``'s rows (all blocks)."""
        return self.row_size[k] * (self.tensor[1] if self.tensor else 1)

    def unpack(self, device: int, rows: Sequence[jax.Array]) -> Any:
        values, blocks, where = [], [], []
        for k, offset, shape, split in self.leaves[device]:
            size = int(np.prod(shape, dtype=np.int64))
            if self.tensor is None:
                # lax.slice: JAX fails to index an array typed on a mesh to an empty result
                # (a leaf of size 0) outside a mesh context
                values.append(jax.lax.slice_in_dim(rows[k], offset, offset + size).reshape(shape))
                continue
            row = rows[k].reshape(self.tensor[1], self.row_size[k])
            blocks.append(jax.lax.slice_in_dim(row, offset, offset + size, axis=1))
            where.append((shape, split))
        if self.tensor is not None and blocks:
            shapes, splits = zip(*where, strict=True)
            values = from_blocks(self.tensor[0], blocks, shapes, splits)
        return jax.tree_util.tree_unflatten(self.treedefs[device], values)

    def pack(self, device: int, state: Any, what: str) -> list[jax.Array]:
        values, treedef = jax.tree_util.tree_flatten(state)
        if treedef != self.treedefs[device]:
            raise PipelineError(
                f"{what} returned an optimizer state whose structure differs from the one its "
                f"init made ({treedef} != {self.treedefs[device]}); per_leaf needs a "
                f"transformation whose state keeps its structure from step to step, as optax's do"
            )
        pieces: list[list] = [[] for _ in self.dtypes]
        for (k, offset, _, split), value in zip(self.leaves[device], values, strict=True):
            pieces[k].append((offset, value, split))
        return [
            _pack(p, size, dt, self.tensor)
            for p, size, dt in zip(pieces, self.row_size, self.dtypes, strict=True)
        ]


def _view_tree(treedef: Any, views: Sequence[LeafView]) -> Any:
    """Returns a device's view tree of ``ShapeDtypeStruct`` (None for a leaf it does not hold)."""
    avals = [jax.ShapeDtypeStruct(v.shape, v.dtype) if v.given else None for v in views]
    return jax.tree_util.tree_unflatten(treedef, avals)


def _state_splits(
    tx: Any, treedef: Any, views: Sequence[LeafView], leaf_splits: Sequence, state: Any, size: int
) -> list[int | None]:
    """Returns the dimension each state leaf of one device is split along over a tensor axis
    of ``size`` devices (None: whole): what ``tx.update`` makes of it from the leaves' splits
    (``tensor.value_splits``), fed its own answer until it stops changing (Adam's moments:
    split like their leaves once the gradients have flowed into them)."""
    tree = _view_tree(treedef, views)
    held = [
        split if view.reads else None
        for view, split in zip(views, leaf_splits, strict=True)
        if view.given
    ]
    splits: list = [None] * len(jax.tree.leaves(state))
    try:
        closed, (updates, _) = jax.make_jaxpr(tx.update, return_shape=True)(tree, state, tree)
    except TypeError:
        # An update that needs extra arguments (reduce_on_plateau's value=), unknown at init:
        # its state is stored whole in every block, which is right, if not the least memory.
        return splits
    num_updates = len(jax.tree.leaves(updates))
    for _ in range(4):
        outs = value_splits(closed, [*held, *splits, *held], size)[num_updates:]
        if outs == splits:
            break
        splits = outs
    return splits


def _scalar_dtypes(state: Any) -> dict[str, Any]:
    """Returns the dtype of every scalar float leaf of an optimizer state (its
    hyperparameters, step sizes), by path."""
    return {
        jax.tree_util.keystr(path): leaf.dtype
        for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]
        if getattr(leaf, "shape", None) == () and jnp.issubdtype(leaf.dtype, jnp.floating)
    }


def _check_scalar_dtypes(whole: dict[str, Any], device: dict[str, Any], index: int) -> None:
    """Raises PipelineError if a scalar float of a device's optimizer state has another dtype
    than the same one has in the state ``tx.init`` makes of the user's whole tree."""
    for path, dtype in device.items():
        if path in whole and whole[path] != dtype:
            raise PipelineError(
                f"per_leaf: the optimizer state's {path} is {dtype_name(dtype)} on pipeline "
                f"device {index} but {dtype_name(whole[path])} on your whole tree: the "
                "transformation picks it from the leaves it sees (optax.inject_hyperparams "
                "takes their highest float dtype, inside multi_transform or masked those of "
                "one label), and the device holds other leaves than the tree; fix the dtype, "
                "e.g. optax.inject_hyperparams(optax.adamw, hyperparam_dtype=jnp.float32)"
            )


def state_layout(
    tx: Any, treedef: Any, views: Sequence[Sequence[LeafView]], layout: StagedLayout | None = None
) -> StateLayout:
    """Returns the layout of the states ``tx.init`` makes for each device's view tree (over
    the tensor axis of ``layout``, if it has one, with each state leaf split as
    ``_state_splits`` finds)."""
    tensor = _tensor(layout) if layout is not None else None
    scalars = None
    if layout is not None:
        whole = jax.tree_util.tree_unflatten(treedef, list(layout.param_avals))
        scalars = _scalar_dtypes(jax.eval_shape(tx.init, whole))
    flat = []
    for device, device_views_ in enumerate(views):
        state = jax.eval_shape(tx.init, _view_tree(treedef, device_views_))
        if scalars is not None:
            _check_scalar_dtypes(scalars, _scalar_dtypes(state), device)
        leaves, state_def = jax.tree_util.tree_flatten(state)
        for leaf in leaves:
            if not isinstance(leaf, jax.ShapeDtypeStruct) or jax.dtypes.issubdtype(
                leaf.dtype, jax.dtypes.extended
            ):
                raise PipelineError(
                    f"per_leaf: the optimizer's state holds {leaf!r}, which cannot be packed into "
                    f"the staged state's rows; per_leaf takes transformations whose state is "
                    f"numeric arrays (every optax optimizer's is); keep a transformation with "
                    f"other state (a PRNG key, say) outside per_leaf in the optax.chain (random "
                    f"noise on the rows differs between the copies of a tied leaf)"
                )
        splits = [None] * len(leaves)
        if tensor is not None:
            leaf_splits = [layout.leaf_split[i] for i in range(len(device_views_))]
            splits = _state_splits(tx, treedef, device_views_, leaf_splits, state, tensor[1])
        flat.append((leaves, state_def, splits))
    dtypes = tuple(sorted({dtype_name(x.dtype) for leaves, _, _ in flat for x in leaves}))
    fills = []
    placed = []
    for leaves, _, splits in flat:
        fill = [0] * len(dtypes)
        mine = []
        for x, split in zip(leaves, splits, strict=True):
            k = dtypes.index(dtype_name(x.dtype))
            shape = list(x.shape)
            if split is not None:
                shape[split] //= tensor[1]
            mine.append((k, fill[k], tuple(shape), split))
            fill[k] += int(np.prod(shape, dtype=np.int64))
        fills.append(fill)
        placed.append(tuple(mine))
    row_size = tuple(max((f[k] for f in fills), default=0) for k in range(len(dtypes)))
    return StateLayout(dtypes, row_size, tuple(d for _, d, _ in flat), tuple(placed), tensor)


def _update_dtypes(
    tx: Any,
    treedef: Any,
    views: Sequence[Sequence[LeafView]],
    incoming: Sequence[Any],
    layout: StagedLayout,
    with_params: bool,
    extra: Any,
) -> list[list[Any]]:
    """Returns, per device, the dtype of ``tx``'s update of each leaf given updates of the
    ``incoming`` rows' dtypes (None where it holds none, or where the updates do not have the
    params' structure, which ``update`` reports)."""
    out = []
    for device_views_ in views:
        tree = _view_tree(treedef, device_views_)
        grads = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(
                x.shape, incoming[layout.dtype_index(dtype_name(x.dtype))]
            ),
            tree,
        )

        def updates(tree, grads, extra):
            state = tx.init(tree)
            return tx.update(grads, state, tree if with_params else None, **extra)[0]

        shapes = jax.eval_shape(updates, tree, grads, extra)
        try:
            flat = treedef.flatten_up_to(shapes)
        except (TypeError, ValueError):
            flat = [None] * len(device_views_)
        out.append([getattr(x, "dtype", None) for x in flat])
    return out


def per_leaf(
    tx: Any, *, layout: Callable[[], tuple[StagedLayout, Any]], mesh: Any, axis: str
) -> Any:
    """Returns an optax transformation of staged params that runs ``tx`` on each device's
    leaves in the user's tree structure (see the module docstring).

    ``layout()`` gives the pipeline's current staged layout and the user's param treedef; it
    is asked at every ``init`` and ``update``, so the transformation can be made before the
    pipeline is built.
    """
    import optax

    # Extra arguments (``value=loss`` for reduce_on_plateau, polyak_sgd) reach ``tx`` on
    # every device; a transformation that takes none ignores them, as optax.chain does.
    tx = optax.with_extra_args_support(tx)
    spec = PartitionSpec(axis)

    def check(params: Any, what: str) -> tuple[StagedLayout, Any]:
        if not isinstance(params, StagedParams):
            raise PipelineError(
                f"per_leaf(...).{what} takes staged params (pipe.stage(params, batch)) and "
                f"their gradients, got {type(params).__name__}; for params in the user's "
                f"layout use the optax transformation itself"
            )
        staged_layout, treedef = layout()
        widths = tuple(staged_layout.row_width(k) for k in range(len(staged_layout.dtypes)))
        if params.layout not in (None, staged_layout.fingerprint):
            raise PipelineError(
                f"per_leaf(...).{what}: the staged arrays follow another pipeline's layout "
                "(another schedule, stage count, placement or, for an automatic cut, microbatch "
                "shape puts the leaves elsewhere in the rows); use the per_leaf of the "
                "pipeline that staged them, or stage the params with this one: "
                "pipe.stage(other_pipe.unstage(staged))"
            )
        if tuple(np.shape(r)[-1] for r in params.rows) != widths:
            raise PipelineError(
                f"per_leaf(...).{what}: the staged arrays have rows of "
                f"{[np.shape(r)[-1] for r in params.rows]} elements, the pipeline's current "
                f"layout {list(widths)}; stage the params with this pipeline "
                f"(pipe.stage) after building it for the batch shape you train with"
            )
        return staged_layout, treedef

    built: dict[int, tuple] = {}  # id(layout) -> (layout, views, state layout)

    def setup(params: Any, what: str):
        staged_layout, treedef = check(params, what)
        if id(staged_layout) not in built:  # the layout is kept, so its id is not reused
            views = device_views(staged_layout)
            states = state_layout(tx, treedef, views, staged_layout)
            built[id(staged_layout)] = (staged_layout, views, states)
        _, views, states = built[id(staged_layout)]
        return staged_layout, treedef, views, states

    def run(
        body: Callable,
        args: Sequence[Any],
        num_out: Sequence[int],
        tensor_axis: str | None,
        replicated: Any = (),
    ) -> Any:
        """Runs ``body`` per device on ``args`` (staged rows, split by device) and then
        ``replicated`` (a pytree every device gets whole)."""
        whole = jax.tree.map(lambda _: PartitionSpec(), replicated)
        specs = (*jax.tree.map(lambda _: spec, tuple(args)), whole)
        args = (*args, replicated)
        fn = shard_map(
            body,
            mesh=mesh,
            in_specs=tuple(specs),
            out_specs=tuple([spec] * n for n in num_out),
            # A tensor axis is left to the compiler, as in the pipeline's step.
            axis_names={a for a in mesh.axis_names if a != tensor_axis},
            check_vma=False,
        )
        if tensor_axis is not None:
            # Called eagerly, a shard_map with an axis left to the compiler fails in JAX's
            # eager path (it checks the outputs against specs naming only manual axes).
            fn = jax.jit(fn)
        try:
            return fn(*place_for_shard_map(mesh, tuple(args), tuple(specs)))
        except NotImplementedError as e:
            if "Closing over inputs to shard_map" not in str(e):
                raise
            raise PipelineError(
                "per_leaf: the optax transformation closes over a value of the enclosing jit "
                "that lies on the mesh's explicit axes, which the per-device shard_map cannot "
                "take in (optax.inject_hyperparams around per_leaf computes the learning rate "
                "from its step count outside it, say); put such a wrapper inside: "
                "pipe.per_leaf(optax.inject_hyperparams(optax.adamw)(learning_rate=schedule))"
            ) from None

    def init(params: StagedParams) -> StagedState:
        staged_layout, treedef, views, states = setup(params, "init")

        def body(param_rows, _):
            def branch(d):
                def on_device(rows):
                    leaves = unpack_views(staged_layout, views[d], rows)
                    state = tx.init(jax.tree_util.tree_unflatten(treedef, leaves))
                    return states.pack(d, state, "init")

                return on_device

            local = [r[0] for r in param_rows]
            out = per_device(axis, staged_layout.num_devices, branch, local)
            return ([r[None] for r in out],)

        (rows,) = run(body, (list(params.rows),), (len(states.dtypes),), staged_layout.tensor_axis)
        return StagedState(rows, states.dtypes, staged_layout.fingerprint)

    def validate(updates: Any, state: Any, params: Any):
        """Returns ``setup``'s layout, treedef, views and state layout after checking that
        the updates, state and params are this pipeline's (raises PipelineError)."""
        staged_layout, treedef, views, states = setup(updates, "update")
        sizes = tuple(np.shape(r)[-1] for r in getattr(state, "rows", ()))
        widths = tuple(states.row_width(k) for k in range(len(states.dtypes)))
        if (
            not isinstance(state, StagedState)
            or (state.dtypes, sizes) != (states.dtypes, widths)
            or state.layout not in (None, staged_layout.fingerprint)
        ):
            raise PipelineError(
                "per_leaf(...).update: the optimizer state is not the one per_leaf(...).init "
                "made for this pipeline's layout; call init on the staged params again"
            )
        if params is not None:
            check(params, "update")
        return staged_layout, treedef, views, states

    jitted: dict[str, Callable] = {}  # layout fingerprint -> update compiled for it

    def update(
        updates: StagedParams,
        state: StagedState,
        params: StagedParams | None = None,
        **extra_args: Any,
    ):
        if isinstance(updates, StagedParams) and not any(
            isinstance(x, jax.core.Tracer)
            for x in jax.tree.leaves((updates, state, params, extra_args))
        ):
            # Called eagerly, the per-device shard_map would be traced and compiled again at
            # every step (its body is made anew): compile once per layout, as inside a jit.
            # The arrays are checked at every call: the compiled update would take another
            # pipeline's arrays of the same shapes without tracing (and checking) again.
            validate(updates, state, params)
            fingerprint = layout()[0].fingerprint
            if fingerprint not in jitted:
                jitted[fingerprint] = jax.jit(traced_update)
            return jitted[fingerprint](updates, state, params, **extra_args)
        return traced_update(updates, state, params, **extra_args)

    def traced_update(
        updates: StagedParams,
        state: StagedState,
        params: StagedParams | None = None,
        **extra_args: Any,
    ):
        staged_layout, treedef, views, states = validate(updates, state, params)
        with_params = params is not None
        incoming = [r.dtype for r in updates.rows]
        row_dtypes = update_row_dtypes(
            staged_layout,
            views,
            _update_dtypes(tx, treedef, views, incoming, staged_layout, with_params, extra_args),
            incoming,
        )

        def body(grad_rows, state_rows, param_rows, extra):
            def branch(d):
                def on_device(grads, st, ps):
                    def tree(rows):
                        leaves = unpack_views(staged_layout, views[d], rows)
                        return jax.tree_util.tree_unflatten(treedef, leaves)

                    new, new_state = tx.update(
                        tree(grads),
                        states.unpack(d, st),
                        tree(ps) if with_params else None,
                        **extra,
                    )
                    try:  # the subtree at each leaf: None where the device holds none
                        flat = treedef.flatten_up_to(new)
                    except (TypeError, ValueError) as e:
                        raise PipelineError(
                            f"per_leaf: the transformation's updates do not have the params' "
                            f"tree structure {treedef}: {e}"
                        ) from None
                    return pack_views(staged_layout, views[d], flat, row_dtypes), states.pack(
                        d, new_state, "update"
                    )

                return on_device

            local = [[r[0] for r in rows] for rows in (grad_rows, state_rows, param_rows)]
            new, new_state = per_device(axis, staged_layout.num_devices, branch, *local)
            return [r[None] for r in new], [r[None] for r in new_state]

        param_rows = list(params.rows) if with_params else list(updates.rows)
        new, new_state = run(
            body,
            (list(updates.rows), list(state.rows), param_rows),
            (len(staged_layout.dtypes), len(states.dtypes)),
            staged_layout.tensor_axis,
            extra_args,
        )
        fingerprint = staged_layout.fingerprint
        return (
            StagedParams(new, updates.dtypes, fingerprint),
            StagedState(new_state, states.dtypes, fingerprint),
        )

    return optax.GradientTransformationExtraArgs(init, update)
