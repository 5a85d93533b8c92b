"""Tensor parallelism inside pipeline stages: which param leaves a mesh axis splits.

``zbjax.pipeline(..., param_specs=specs)`` takes a ``PartitionSpec`` per param leaf (a pytree
of specs matching the params, or a prefix of them; None for a replicated leaf), the way
``jax.jit``'s ``in_shardings`` or ``flax.linen.get_partition_spec`` give them. The one mesh axis
the specs name is the tensor-parallel axis: each leaf is stored split along the dimension its
spec names (``params.staged_layout``), the ``shard_map`` leaves that axis to the compiler, and
XLA partitions each stage's equations over it (Megatron-style collectives among the devices
of one stage). The mesh axes that are neither the pipeline axis nor the tensor axis stay data
parallel.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import PartitionSpec

from zbjax._jax_compat import scan_counts, shard_map
from zbjax.errors import PipelineError
from zbjax.trace import ACTION_SCOPE, branch_permutes, scope_order


def split_spec(axis: str, split: int | None) -> PartitionSpec:
    """Returns the spec of a value split along dimension ``split`` over ``axis`` (None: whole)."""
    return PartitionSpec() if split is None else PartitionSpec(*([None] * split), axis)


def per_shard(axis: str, fn: Any, in_specs: Any, out_specs: Any) -> Any:
    """Returns ``fn`` run on each device's part over tensor ``axis``: a ``shard_map`` manual
    over that axis, inside the pipeline's (which leaves it to the compiler). A block-split
    ``[T, n]`` array comes in as the device's ``[1, n]`` block; a whole value declared whole
    (``PartitionSpec()``) is taken to be equal on every device, unchecked."""
    return shard_map(
        fn,
        mesh=jax.sharding.get_abstract_mesh(),
        in_specs=in_specs,
        out_specs=out_specs,
        axis_names={axis},
        check_vma=False,
    )


def to_blocks(
    axis: str, values: Sequence[Any], splits: Sequence[int | None], each: bool = False
) -> Any:
    """Returns ``values``, each split along ``splits[i]`` over ``axis`` (None: whole), raveled
    and put side by side as each device's block: a ``[T, n]`` array split over ``axis``; with
    ``each``, a list of such blocks, one per value (one nested ``shard_map`` all the same)."""

    def local(values):
        flat = [jax.numpy.ravel(v)[None] for v in values]
        if each:
            return flat
        return jax.numpy.concatenate(flat, axis=1) if len(flat) > 1 else flat[0]

    specs = [split_spec(axis, s) for s in splits]
    out_specs = [PartitionSpec(axis)] * len(values) if each else PartitionSpec(axis)
    return per_shard(axis, local, (specs,), out_specs)(list(values))


def from_blocks(
    axis: str, blocks: Sequence[Any], shapes: Sequence[tuple[int, ...]], splits: Sequence
) -> list:
    """Returns the values whose parts ``blocks[i]`` (``[T, n]``, split over ``axis``) hold:
    each device's block reshaped to ``shapes[i]`` (a part's shape), split along ``splits[i]``
    (None: whole, every block a copy)."""

    def local(blocks):
        return [b.reshape(shape) for b, shape in zip(blocks, shapes, strict=True)]

    specs = [split_spec(axis, s) for s in splits]
    return per_shard(axis, local, ([PartitionSpec(axis)] * len(blocks),), specs)(list(blocks))


def _is_spec(x: Any) -> bool:
    return x is None or isinstance(x, PartitionSpec)


def _names(entry: Any) -> tuple[str, ...]:
    """Returns the mesh axis names one ``PartitionSpec`` entry names."""
    if entry is None:
        return ()
    if isinstance(entry, str):
        return (entry,)
    if entry is PartitionSpec.UNCONSTRAINED:
        raise PipelineError(
            "param_specs use PartitionSpec.UNCONSTRAINED, which leaves a dimension's split to "
            "the compiler; the pipeline lays each param out itself, so say the split: the "
            "tensor axis's name, or None for a dimension not split"
        )
    return tuple(entry)


def tensor_axis(param_specs: Any, mesh: Any, pipeline_axis: str) -> str | None:
    """Returns the mesh axis ``param_specs`` name (None when they name none), after checking
    that it is one Auto axis of ``mesh`` other than the pipeline axis."""
    if param_specs is None:
        return None
    specs = jax.tree.leaves(param_specs, is_leaf=_is_spec)
    for spec in specs:
        if not _is_spec(spec):
            raise PipelineError(
                f"param_specs has a leaf {spec!r}, which is not a jax.sharding.PartitionSpec; "
                "give one PartitionSpec (or None, replicated) per param leaf, e.g. "
                "flax.linen.get_partition_spec(variables)"
            )
    named = sorted({n for spec in specs if spec is not None for e in spec for n in _names(e)})
    if not named:
        return None
    unknown = [n for n in named if n not in mesh.axis_names]
    if unknown:
        raise PipelineError(
            f"param_specs name mesh axes {unknown} that the mesh (axes "
            f"{tuple(mesh.axis_names)}) does not have; name the mesh's tensor-parallel axis"
        )
    if pipeline_axis in named:
        raise PipelineError(
            f"param_specs name the pipeline axis {pipeline_axis!r}; the pipeline places each "
            "stage's params on its device itself, so a spec names only the tensor-parallel "
            f"axis (e.g. PartitionSpec(None, 'tp')); drop {pipeline_axis!r} from the specs"
        )
    if len(named) > 1:
        raise PipelineError(
            f"param_specs name mesh axes {named}; a pipeline splits params over one "
            "tensor-parallel axis (the other non-pipeline axes are data parallel, with params "
            "replicated over them); name one axis in the specs"
        )
    axis = named[0]
    types = dict(zip(mesh.axis_names, getattr(mesh, "axis_types", ()), strict=False))
    if types.get(axis) == jax.sharding.AxisType.Explicit:
        kinds = ", ".join(
            "AxisType.Auto" if a == axis else f"AxisType.{types[a].name}" for a in mesh.axis_names
        )
        raise PipelineError(
            f"the tensor-parallel axis {axis!r} is an Explicit mesh axis (jax.make_mesh's "
            "default); zbjax leaves it to the compiler inside each stage, which needs it Auto: "
            f"build the mesh with axis_types=({kinds})"
        )
    return axis


def leaf_splits(
    param_specs: Any, params_avals: Any, axis: str | None, size: int
) -> tuple[int | None, ...]:
    """Returns, per param leaf (``jax.tree.leaves`` order), the dimension ``axis`` splits (None:
    replicated), from ``param_specs`` (a tree of specs matching ``params_avals`` or a prefix)."""
    try:
        per_leaf = jax.tree.map(
            lambda spec, sub: _Group(spec, len(jax.tree.leaves(sub))),
            param_specs,
            params_avals,
            is_leaf=_is_spec,
        )
    except ValueError as e:
        raise PipelineError(
            f"param_specs do not match the params' structure: specs "
            f"{jax.tree.structure(param_specs, is_leaf=_is_spec)}, params "
            f"{jax.tree.structure(params_avals)}; give one PartitionSpec per param leaf (or "
            f"per subtree)\n{e}"
        ) from None
    specs = [g.spec for g in jax.tree.leaves(per_leaf) for _ in range(g.count)]
    leaves = jax.tree_util.tree_leaves_with_path(params_avals)
    return tuple(
        _split_dim(jax.tree_util.keystr(path), aval, spec, axis, size)
        for (path, aval), spec in zip(leaves, specs, strict=True)
    )


class _Group:
    """A spec and how many param leaves it covers (not a pytree: a leaf of tree functions)."""

    def __init__(self, spec: Any, count: int):
        self.spec, self.count = spec, count


def _split_dim(where: str, aval: Any, spec: Any, axis: str, size: int) -> int | None:
    """Returns the dimension of one leaf that ``spec`` splits over ``axis``, checked."""
    if spec is None:
        return None
    shape = tuple(aval.shape)
    if len(spec) > len(shape):
        raise PipelineError(
            f"param_specs give param {where} (shape {shape}) the spec {spec}, which has more "
            "entries than the param has dimensions; give it one entry per dimension at most"
        )
    dims = [d for d, entry in enumerate(spec) if axis in _names(entry)]
    if len(dims) > 1:
        raise PipelineError(
            f"param_specs split param {where} over {axis!r} along dimensions {dims} ({spec}); "
            "split it along one dimension"
        )
    if not dims:
        return None
    dim = dims[0]
    if shape[dim] % size:
        raise PipelineError(
            f"param {where} has {shape[dim]} entries along dimension {dim}, which the {size} "
            f"devices of tensor axis {axis!r} cannot split evenly ({spec}); give it a size "
            f"that is a multiple of {size}, or leave the param replicated (None)"
        )
    return dim


def check_row_splits(
    split: Sequence[int | None], rows: Sequence[Sequence[tuple[int, int] | None]], where: Any
) -> None:
    """Raises when a leaf whose layers stages split by rows (``nn.scan``) is also split along
    its leading axis by the tensor axis; ``where(leaf)`` names a leaf."""
    for stage_rows in rows:
        for leaf, r in stage_rows:
            if r is not None and split[leaf] == 0:
                raise PipelineError(
                    f"param {where(leaf)} is a stacked layer parameter whose layers the "
                    "stages split between them (its leading axis), and param_specs split "
                    "that axis over the tensor axis too; split it along another dimension"
                )


# ---------------------------------------------------------------------------------------------
# Which intermediate values a split stage computes split: where its slots keep them split too.
# ---------------------------------------------------------------------------------------------

#: Primitives that keep a value's shape and act element by element: an output is split like
#: its split operands of the same shape, when those agree.
_ELEMENTWISE = frozenset(
    {
        "abs",
        "acos",
        "acosh",
        "add",
        "add_any",
        "and",
        "asin",
        "asinh",
        "atan",
        "atan2",
        "atanh",
        "cbrt",
        "ceil",
        "clamp",
        "convert_element_type",
        "copy",
        "copy_p",
        "cos",
        "cosh",
        "div",
        "eq",
        "erf",
        "erf_inv",
        "erfc",
        "exp",
        "exp2",
        "expm1",
        "floor",
        "ge",
        "gt",
        "imag",
        "integer_pow",
        "is_finite",
        "le",
        "lgamma",
        "digamma",
        "log",
        "log1p",
        "logistic",
        "lt",
        "max",
        "min",
        "mul",
        "ne",
        "neg",
        "nextafter",
        "not",
        "one_minus_square",
        "or",
        "pow",
        "real",
        "reduce_precision",
        "rem",
        "round",
        "rsqrt",
        "select_n",
        "sign",
        "sin",
        "sinh",
        "sqrt",
        "square",
        "stop_gradient",
        "sub",
        "tan",
        "tanh",
        "xor",
    }
)
_REDUCTIONS = frozenset(
    {"reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "argmax", "argmin"}
)


def check_stage_permutes(hlo_text: str, mesh: Any, pipeline_axis: str, axis: str) -> None:
    """Raises PipelineError when the compiled step ``hlo_text`` would hang on XLA:CPU: a
    collective-permute among the devices of one pipeline position (XLA's partitioning of a
    stage over tensor ``axis``) inside a conditional, which only that stage's devices take.

    XLA:CPU runs a collective-permute only once every device of the program has reached it
    (its rendezvous waits for all of them, 40 s, then aborts the process), so one that only
    some devices run never completes. All-reduces and all-gathers wait for their groups only.
    The pipeline's own transfers (between positions) run on every device and are not counted.
    """
    if mesh.shape[pipeline_axis] < 2:
        return
    where = mesh.axis_names.index(pipeline_axis)

    def position(partition: int) -> int:
        return int(np.unravel_index(partition, mesh.devices.shape)[where])

    ops: dict[str, list[str]] = {}
    for permute in branch_permutes(hlo_text):
        if permute.pairs and all(position(a) == position(b) for a, b in permute.pairs):
            scopes = ACTION_SCOPE.findall(permute.op_name)
            op = permute.op_name.rsplit("/", 1)[-1] or "?"
            if permute.source:
                op = f"{op} at {permute.source}"
            names = ops.setdefault(scopes[-1] if scopes else "a stage", [])
            if op not in names:
                names.append(op)
    if not ops:
        return
    shown = "; ".join(
        f"{scope}: {', '.join(names)}"
        for scope, names in sorted(ops.items(), key=lambda kv: scope_order(kv[0]))
    )
    raise PipelineError(
        f"this step would hang: XLA partitions the stages over tensor axis {axis!r} with "
        f"collective-permutes inside the actions ({shown}), but each stage runs in a "
        "conditional that only its devices take, and XLA:CPU runs a collective-permute only "
        "once every device of the program reaches it (the step would wait 40 s and abort the "
        "process). XLA permutes where a stage moves data along a split dimension: jnp.split "
        "or a slice of the output of a kernel split by columns (a fused gate/up or qkv kernel "
        "whose parts do not lie block by block: give each part a leaf of its own), "
        "jnp.roll, jnp.concatenate or jnp.pad along a split dimension, or a lax.scan over a "
        "leaf split along the scanned (layer) axis (split another dimension). Change that "
        "code, or leave those leaves out of param_specs"
    )


def value_splits(closed: Any, in_splits: Sequence[int | None], size: int) -> list[int | None]:
    """Returns, per output of the jaxpr ``closed``, the dimension along which it comes out split
    over a tensor axis of ``size`` devices when its inputs are split as ``in_splits`` say (None:
    whole), by following each equation's dimensions: element-wise operations, matmuls' free
    and batch dimensions, broadcasts, transposes, reshapes that keep the split dimension
    leading, reductions, splits, slices, pads and concatenations along other dimensions,
    calls, and ``scan`` bodies (a stacked output split one dimension further along); anything
    else, or a dimension the devices do not divide, is whole. A guess at what XLA's
    partitioner will do: a wrong one costs a resharding between a slot and its reader, never
    a wrong value.
    """
    return _propagate(closed.jaxpr, list(in_splits), size)


def _shape(atom: Any) -> tuple[int, ...]:
    return tuple(getattr(atom.aval, "shape", ()))


def _propagate(jaxpr: Any, in_splits: list, size: int) -> list:
    from jax.extend.core import Literal

    env: dict = {}
    for var, split in zip(jaxpr.invars, in_splits, strict=True):
        env[var] = split

    def read(atom: Any) -> int | None:
        return None if isinstance(atom, Literal) else env.get(atom)

    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        outs = _rule(eqn, ins, size)
        for var, split in zip(eqn.outvars, outs, strict=True):
            shape = _shape(var)
            ok = split is not None and split < len(shape) and shape[split] % size == 0
            env[var] = split if ok else None
    return [read(v) for v in jaxpr.outvars]


def _rule(eqn: Any, ins: list, size: int) -> list:
    name = eqn.primitive.name
    params = eqn.params
    none = [None] * len(eqn.outvars)
    if not any(s is not None for s in ins):
        return none
    if name in _ELEMENTWISE:
        out_shape = _shape(eqn.outvars[0])
        # A whole operand next to a split one is sliced where it is: the result stays split.
        # An operand broadcast along size-1 dimensions (a bias ``[1, n]`` added to ``[m, n]``)
        # passes on a split along a dimension it has in full.
        splits = {
            s
            for v, s in zip(eqn.invars, ins, strict=True)
            if s is not None and len(_shape(v)) == len(out_shape) and _shape(v)[s] == out_shape[s]
        }
        return [splits.pop()] if len(splits) == 1 else none
    if name == "dot_general":
        return [_dot_split(eqn, ins)]
    if name == "broadcast_in_dim":
        s = ins[0]
        return [None if s is None else params["broadcast_dimensions"][s]]
    if name == "transpose":
        s = ins[0]
        return [None if s is None else list(params["permutation"]).index(s)]
    if name in _REDUCTIONS:
        s, axes = ins[0], tuple(params["axes"])
        return [None if s is None or s in axes else s - sum(a < s for a in axes)]
    if name == "squeeze":
        s, dims = ins[0], tuple(params["dimensions"])
        return [None if s is None or s in dims else s - sum(d < s for d in dims)]
    if name == "reshape":
        return [_reshape_split(_shape(eqn.invars[0]), _shape(eqn.outvars[0]), ins[0], size)]
    if name == "split":  # pieces along another dimension than the split keep it
        return [None if ins[0] == params["axis"] else ins[0]] * len(eqn.outvars)
    if name == "slice":
        return [_slice_keeps(eqn, ins[0])]
    if name == "pad":
        s = ins[0]
        return [None if s is None or tuple(params["padding_config"][s]) != (0, 0, 0) else s]
    if name == "concatenate":
        splits = set(ins)
        s = splits.pop() if len(splits) == 1 else None
        return [None if s == params["dimension"] else s]
    if name == "scan":
        return _scan_splits(eqn, ins, size)
    inner = _inner_jaxpr(eqn)
    if inner is not None:
        return _propagate(inner, ins[len(ins) - len(inner.invars) :], size)
    return none


def _scan_splits(eqn: Any, ins: list, size: int) -> list:
    """Returns a ``scan``'s output splits: its body's, with each carry split only where every
    iteration keeps it so (whole otherwise, until that holds) and each stacked output's one
    dimension further along; a scanned input split along the scanned dimension is whole in
    the body (each device would hold other iterations)."""
    num_consts, num_carry = scan_counts(eqn.params)
    body = eqn.params["jaxpr"].jaxpr
    consts = ins[:num_consts]
    carry = ins[num_consts : num_consts + num_carry]
    xs = [None if s in (None, 0) else s - 1 for s in ins[num_consts + num_carry :]]
    while True:  # each pass makes at least one more carry whole, or stops
        outs = _propagate(body, consts + carry + xs, size)
        kept = [c if c == o else None for c, o in zip(carry, outs[:num_carry], strict=True)]
        if kept == carry:
            break
        carry = kept
    return carry + [None if s is None else s + 1 for s in outs[num_carry:]]


def _dot_split(eqn: Any, ins: list) -> int | None:
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    lhs_rank, rhs_rank = len(_shape(eqn.invars[0])), len(_shape(eqn.invars[1]))
    lhs_free = [d for d in range(lhs_rank) if d not in lc and d not in lb]
    rhs_free = [d for d in range(rhs_rank) if d not in rc and d not in rb]
    found = set()
    for s, batch, free, offset in (
        (ins[0], lb, lhs_free, len(lb)),
        (ins[1], rb, rhs_free, len(lb) + len(lhs_free)),
    ):
        if s is None:
            continue
        if s in batch:
            found.add(list(batch).index(s))
        elif s in free:
            found.add(offset + free.index(s))
        else:
            return None  # split along a contracted dimension: a partial sum, reduced whole
    return found.pop() if len(found) == 1 else None


def _slice_keeps(eqn: Any, s: int | None) -> int | None:
    """Returns ``s`` when a static slice takes all of the split dimension ``s``, else None."""
    if s is None:
        return None
    params = eqn.params
    strides = params["strides"] or (1,) * len(params["start_indices"])
    whole = (0, _shape(eqn.invars[0])[s], 1)
    return (
        s if (params["start_indices"][s], params["limit_indices"][s], strides[s]) == whole else None
    )


def _reshape_split(
    in_shape: tuple[int, ...], out_shape: tuple[int, ...], s: int | None, size: int
) -> int | None:
    """Returns the output dimension that a reshape maps the split input dimension ``s`` onto,
    when it is the leading part of that dimension (so that equal blocks stay equal blocks)."""
    if s is None:
        return None
    before = int(np.prod(in_shape[:s], dtype=np.int64))
    acc = 1
    for j, n in enumerate(out_shape):
        if acc == before and n != 1:  # (size-1 dimensions before it come and go)
            # Dimension j starts where s does: s leads it (merged) or it leads s (split).
            if n % size == 0 and (n % in_shape[s] == 0 or in_shape[s] % n == 0):
                return j
            return None
        acc *= n
        if acc > before:
            return None
    return None


def _inner_jaxpr(eqn: Any) -> Any:
    """Returns the jaxpr a call-like equation runs on its last operands (jit, custom_jvp/vjp,
    remat), None for other equations (control flow among them)."""
    if eqn.primitive.name in ("scan", "while", "cond"):
        return None
    for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        inner = eqn.params.get(key)
        inner = getattr(inner, "jaxpr", inner)
        if (
            hasattr(inner, "eqns")
            and len(inner.invars) <= len(eqn.invars)
            and len(inner.outvars) == len(eqn.outvars)
        ):
            return inner
    return None
