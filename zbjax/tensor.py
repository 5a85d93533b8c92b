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
from jax.sharding import PartitionSpec

from zbjax.errors import PipelineError


def _is_spec(x: Any) -> bool:
    return x is None or isinstance(x, PartitionSpec)


def _names(entry: Any) -> tuple[str, ...]:
    """Returns the mesh axis names one ``PartitionSpec`` entry names."""
    if entry is None:
        return ()
    if isinstance(entry, str):
        return (entry,)
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
