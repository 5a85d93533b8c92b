"""The ``stage_boundary`` marker: an identity primitive that tells zbjax where to cut stages.

``stage_boundary(x)`` returns ``x`` unchanged (any pytree) but leaves one equation of the
``stage_boundary`` primitive in the traced jaxpr, bound on the flat leaves. The primitive is
linear and its own transpose, so differentiating through it leaves the same marker in the
backward program at the mirrored place: forward and backward are cut at the same boundaries.
It has batching (vmap) and lowering rules; lowered, it returns its operands, so outside a
pipeline it adds no copy and no work to the compiled program.
"""

from __future__ import annotations

from typing import Any, TypeVar

import jax
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from zbjax._jax_compat import register_identity_dce

T = TypeVar("T")

STAGE_BOUNDARY = Primitive("stage_boundary")
STAGE_BOUNDARY.multiple_results = True


def stage_boundary(x: T, name: str | None = None) -> T:
    """Returns ``x`` unchanged, marking the program point between two pipeline stages.

    ``x`` may be any pytree of arrays (the activations that cross the boundary). ``name`` is an
    optional label kept in the equation's params (``eqn.params["name"]``) for error messages and
    plots; it does not change the result.
    """
    leaves, treedef = jax.tree_util.tree_flatten(x)
    if not leaves:
        return x
    outs = STAGE_BOUNDARY.bind(*leaves, name=name)
    return jax.tree_util.tree_unflatten(treedef, outs)


def is_stage_boundary(eqn: Any) -> bool:
    """Returns whether a jaxpr equation is a ``stage_boundary`` marker."""
    return eqn.primitive is STAGE_BOUNDARY


def _impl(*args: Any, name: str | None) -> list[Any]:
    del name
    return list(args)


def _abstract_eval(*avals: Any, name: str | None) -> list[Any]:
    # Returning the input avals unchanged keeps dtype, weak type, sharding and the
    # varying-manual-axes type inside shard_map.
    del name
    return list(avals)


def _jvp(primals: list[Any], tangents: list[Any], *, name: str | None) -> tuple[list, list]:
    primal_out = STAGE_BOUNDARY.bind(*primals, name=name)
    # Symbolic zero tangents stay symbolic; only the real tangents pass through a marker, so
    # the tangent program (and hence the transposed backward) is cut at the same place.
    nonzero = [i for i, t in enumerate(tangents) if not isinstance(t, ad.Zero)]
    tangent_out = list(tangents)
    if nonzero:
        outs = STAGE_BOUNDARY.bind(*(tangents[i] for i in nonzero), name=name)
        for i, out in zip(nonzero, outs, strict=True):
            tangent_out[i] = out
    return primal_out, tangent_out


def _transpose(cts: list[Any], *args: Any, name: str | None) -> list[Any]:
    # The identity is its own transpose. Inputs that are not linear (known primals) get no
    # cotangent; symbolic-zero cotangents stay symbolic zeros of the input's aval (zeros made
    # real would flow on into the backward of what the loss reads without a derivative, a
    # norm at 0 say, and make its gradient 0 * inf = NaN where JAX's is finite).
    result: list[Any] = [None] * len(args)
    live = []
    for i, (ct, arg) in enumerate(zip(cts, args, strict=True)):
        if not ad.is_undefined_primal(arg):
            continue
        if type(ct) is ad.Zero:
            result[i] = ad.Zero(arg.aval)
        else:
            live.append(i)
    if live:
        outs = STAGE_BOUNDARY.bind(*(cts[i] for i in live), name=name)
        for i, out in zip(live, outs, strict=True):
            result[i] = out
    return result


def _batch(args: tuple, dims: tuple, *, name: str | None) -> tuple[list, tuple]:
    return STAGE_BOUNDARY.bind(*args, name=name), dims


def _lower(ctx: Any, *args: Any, name: str | None) -> list[Any]:
    # The identity lowers to its operands: no HLO op, no copy.
    del ctx, name
    return list(args)


STAGE_BOUNDARY.def_impl(_impl)
STAGE_BOUNDARY.def_abstract_eval(_abstract_eval)
ad.primitive_jvps[STAGE_BOUNDARY] = _jvp
ad.primitive_transposes[STAGE_BOUNDARY] = _transpose
batching.primitive_batchers[STAGE_BOUNDARY] = _batch
mlir.register_lowering(STAGE_BOUNDARY, _lower)
# Dead-code elimination drops the results nothing reads, with their operands, as it would
# without the marker. Kept, an unused result held its value alive: a scan's stacked ys that
# the loss ignores stayed in the linearized program, and jax 0.10's transpose of the scan
# failed on their symbolic-zero cotangent ("Expected cotangent type float32[4] but got
# float32[2,4]").
register_identity_dce(STAGE_BOUNDARY)
