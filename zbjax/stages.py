"""The values that pass from the compiler front half to the lowering: stage graph and programs.

Data only, no logic. ``partition`` builds a ``StageGraph`` from a traced loss function;
``split`` turns each ``Stage`` into a ``StageProgram`` (F, B, W and fused BW jaxprs); ``lower``
and the sequential executor consume both. Jaxprs here are ``jax.extend.core.ClosedJaxpr``.

Calling conventions (all flat tuples of arrays, in this order):

- ``Stage.jaxpr``: (params read, batch leaves read, inputs) -> outputs.
  *params read* are the leaves ``param_leaves`` of the flattened params pytree, the ``k``-th
  restricted to rows ``param_rows[k]`` of its leading axis when that is not None (a stage
  running some iterations of a scan over stacked layer params reads only those layers' rows;
  ``Stage.param_inputs`` applies the slices); *batch leaves
  read* are ``batch_leaves`` of the flattened (per-microbatch) batch; *inputs* are the values of
  each in-edge, edge after edge in ``in_edges`` order, each edge's ``values`` in order. Outputs
  are the values of each out-edge in ``out_edges`` order; the loss stage outputs ``(loss,)``
  (a float32 scalar) and has no out-edges.
- ``StageProgram.forward``: same inputs as ``Stage.jaxpr`` -> (outputs..., residuals...).
- ``StageProgram.backward_input`` (B): (residuals..., output cotangents...) ->
  (input cotangents..., stash...).
- ``StageProgram.backward_weight`` (W): (stash...) -> (param cotangents...), one per
  ``param_leaves`` entry.
- ``StageProgram.backward`` (fused BW): (residuals..., output cotangents...) ->
  (input cotangents..., param cotangents...).

Cotangents exist only for inexact (floating) values: *output cotangents* are for the outputs
whose ``Stage.output_differentiable`` flag is set, *input cotangents* for the inputs whose
``Stage.input_differentiable`` flag is set. The loss stage's single output cotangent is the seed
(1.0 for one microbatch; the pipeline uses 1/num_microbatches to average).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend.core import jaxpr_as_fun

from zbjax._jax_compat import CUSTOM_VJP_PRIMITIVES, holds_primitive, key_impl


def is_key(dtype: Any) -> bool:
    """Returns whether ``dtype`` is a typed PRNG key's (``jax.random.key``)."""
    return bool(jnp.issubdtype(dtype, jax.dtypes.prng_key))


def _struct(aval: Any) -> jax.ShapeDtypeStruct:
    weak = getattr(aval, "weak_type", False)
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=weak)


def key_data_aval(aval: Any) -> jax.ShapeDtypeStruct:
    """The aval of ``aval`` as stored or sent between devices: a typed PRNG key as its uint32
    key data (``jax.random.key_data``: arenas and messages hold numbers), anything else as is."""
    if not is_key(aval.dtype):
        return _struct(aval)
    shape = tuple(aval.shape) + tuple(key_impl(aval.dtype).key_shape)
    return jax.ShapeDtypeStruct(shape, jnp.uint32)


def keys_as_data(closed: Any, inputs: Sequence[int] | range, outputs: Sequence[int] | range) -> Any:
    """Returns ``closed`` (a ClosedJaxpr) taking the typed PRNG keys among its ``inputs``
    positions as key data and returning those among its ``outputs`` as key data; ``closed``
    itself when it has none there."""
    wrap = [i for i in inputs if is_key(closed.in_avals[i].dtype)]
    unwrap = [j for j in outputs if is_key(closed.out_avals[j].dtype)]
    if not wrap and not unwrap:
        return closed
    run_closed = jaxpr_as_fun(closed)

    def run(*args: Any) -> list[Any]:
        args = list(args)
        for i in wrap:
            impl = key_impl(closed.in_avals[i].dtype)
            args[i] = jax.random.wrap_key_data(args[i], impl=impl)
        outs = list(run_closed(*args))
        for j in unwrap:
            outs[j] = jax.random.key_data(outs[j])
        return outs

    avals = [key_data_aval(a) if i in wrap else _struct(a) for i, a in enumerate(closed.in_avals)]
    return jax.make_jaxpr(run)(*avals)


def has_cotangent(dtype: Any) -> bool:
    """Returns whether values of ``dtype`` are differentiated: floating and complex dtypes,
    bfloat16 included (NumPy's own ``issubdtype`` does not count it as inexact); not
    integers, booleans or PRNG keys."""
    try:
        return bool(jnp.issubdtype(dtype, jnp.inexact))
    except TypeError:  # extended dtypes (PRNG keys)
        return False


def leading_rows(value: Any, rows: tuple[int, int] | None) -> Any:
    """Returns rows [begin, end) of ``value``'s leading axis, or all of it for None."""
    return value if rows is None else value[rows[0] : rows[1]]


@dataclass(frozen=True)
class Edge:
    """Activations flowing from stage ``src`` to stage ``dst``, one microbatch's worth."""

    src: int
    dst: int
    values: tuple[jax.ShapeDtypeStruct, ...]


@dataclass(frozen=True)
class Stage:
    """One node of the stage graph: a slice of the traced program."""

    index: int
    name: str
    jaxpr: Any  # jax.extend.core.ClosedJaxpr
    param_leaves: tuple[int, ...]
    batch_leaves: tuple[int, ...]
    in_edges: tuple[int, ...]
    out_edges: tuple[int, ...]
    input_differentiable: tuple[bool, ...]
    output_differentiable: tuple[bool, ...]
    cost: float  # estimated forward cost (matmul FLOPs plus bytes moved)
    # Per ``param_leaves`` entry: None (the whole leaf) or the [begin, end) rows of its leading
    # axis that the stage reads; empty means every leaf whole.
    param_rows: tuple[tuple[int, int] | None, ...] = ()

    def param_slices(self) -> tuple[tuple[int, int] | None, ...]:
        """Returns ``param_rows`` with one entry per ``param_leaves`` entry."""
        return self.param_rows or (None,) * len(self.param_leaves)

    def param_inputs(self, leaves: Sequence[Any]) -> list[Any]:
        """Returns this stage's param inputs from the flat param ``leaves`` (rows sliced)."""
        return [
            leading_rows(leaves[leaf], rows)
            for leaf, rows in zip(self.param_leaves, self.param_slices(), strict=True)
        ]


@dataclass(frozen=True)
class StageGraph:
    """Stages (topologically ordered) and the edges between them.

    ``param_avals`` and ``batch_avals`` describe the flattened params and ONE microbatch of the
    batch; ``params_treedef``/``batch_treedef`` rebuild the user's pytrees. ``tied_params`` lists
    param leaves read by more than one stage (their gradient is the sum of those stages').
    ``aux_treedef`` (a ``loss_fn`` with ``has_aux``) rebuilds the aux pytree from the loss
    stage's outputs after the loss: that stage returns ``[loss, *aux_leaves]``, differentiating
    the loss alone; None when ``loss_fn`` returns the loss alone.
    """

    stages: tuple[Stage, ...]
    edges: tuple[Edge, ...]
    loss_stage: int
    params_treedef: Any
    batch_treedef: Any
    param_avals: tuple[jax.ShapeDtypeStruct, ...]
    batch_avals: tuple[jax.ShapeDtypeStruct, ...]
    aux_treedef: Any = None
    #: Per aux leaf, whether it holds per-example rows (``microbatch.aux_rows``): the pipeline
    #: returns those joined over the microbatches, the others as their means. Empty: all means.
    aux_rows: tuple[bool, ...] = ()
    #: The cost-balanced cut that made the stages (``partition``'s ``cut``): the number of
    #: pieces of activation work and the first piece of each stage; None for markers.
    cut: tuple[int, tuple[int, ...]] | None = field(default=None, compare=False)

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def empty_backward(self) -> tuple[int, ...]:
        """Returns the stages whose B computes nothing (no differentiable input to send a
        cotangent to, as the first stage's): their whole backward is W."""
        return tuple(s.index for s in self.stages if not any(s.input_differentiable))

    @cached_property
    def holds_custom_vjp(self) -> bool:
        """Returns whether a stage calls a ``jax.custom_vjp`` function, whose bwd rule may not
        be linear in its cotangent (``microbatch.backward_seed``). Walked once per graph: the
        lowering asks for every (stage, action kind)."""
        return any(holds_primitive(s.jaxpr, CUSTOM_VJP_PRIMITIVES) for s in self.stages)

    def output_rows(self) -> tuple[bool, ...]:
        """Returns, per output of the loss stage (``[loss, *aux_leaves]``), whether it holds
        per-example rows (``aux_rows``), which are joined over microbatches, not averaged."""
        count = len(self.stages[self.loss_stage].jaxpr.out_avals)
        rows = tuple(self.aux_rows) or (False,) * (count - 1)
        return (False, *rows)

    def loss_and_aux(self, totals: Sequence[Any]) -> Any:
        """Returns the loss, or (loss, aux) with ``aux_treedef``, from the loss stage's outputs
        ``[loss, *aux_leaves]`` (or their means over microbatches, rows joined)."""
        if self.aux_treedef is None:
            return totals[0]
        return totals[0], jax.tree_util.tree_unflatten(self.aux_treedef, list(totals[1:]))

    @property
    def edge_pairs(self) -> tuple[tuple[int, int], ...]:
        """Returns the (src, dst) stage pairs, deduplicated, for ``Schedule.edges``."""
        return tuple(dict.fromkeys((e.src, e.dst) for e in self.edges))

    @property
    def tied_params(self) -> tuple[int, ...]:
        """Returns the leaves of which two stages read the same rows (a whole leaf counts as all
        its rows); stages reading disjoint rows of a stacked leaf do not tie it."""
        reads: dict[int, list[tuple[int, int] | None]] = {}
        for stage in self.stages:
            for leaf, rows in zip(stage.param_leaves, stage.param_slices(), strict=True):
                reads.setdefault(leaf, []).append(rows)

        def overlap(a: tuple[int, int] | None, b: tuple[int, int] | None) -> bool:
            return a is None or b is None or (a[0] < b[1] and b[0] < a[1])

        return tuple(
            sorted(
                leaf
                for leaf, rows in reads.items()
                if any(overlap(a, b) for i, a in enumerate(rows) for b in rows[i + 1 :])
            )
        )


@dataclass(frozen=True)
class StageProgram:
    """A stage's forward, split backward (B, W) and fused backward, without recomputation.

    The matmul FLOPs of ``backward_input`` plus ``backward_weight`` equal those of
    ``backward``. Costs are estimates from the jaxprs (matmul FLOPs plus bytes moved); byte
    counts are per microbatch: ``activation_bytes`` is M_B (residuals kept from F until B; not
    those that merely forward a parameter or batch leaf, which the lowering reads where they
    are resident), ``stash_bytes`` is M_W (kept from B until W).
    """

    stage: Stage
    forward: Any  # ClosedJaxpr
    backward_input: Any  # ClosedJaxpr
    backward_weight: Any  # ClosedJaxpr
    backward: Any  # ClosedJaxpr
    residual_avals: tuple[jax.ShapeDtypeStruct, ...]
    stash_avals: tuple[jax.ShapeDtypeStruct, ...]
    cost_forward: float
    cost_backward_input: float
    cost_backward_weight: float
    flops_forward: int
    flops_backward_input: int
    flops_backward_weight: int
    flops_backward: int
    param_bytes: int
    activation_bytes: int
    stash_bytes: int
