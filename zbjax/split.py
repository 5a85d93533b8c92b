"""Per-stage forward (F), input backward (B) and weight backward (W) jaxprs, without recomputation.

For each ``Stage`` we differentiate its jaxpr once with ``jax.vjp``: the forward program returns
the stage outputs plus the residuals its backward reads (the leaves of the vjp function), and the
fused backward BW is the vjp function traced as a function of (residuals, output cotangents).
BW's equations are then partitioned:

- B = the equations the input cotangents depend on;
- W = the remaining equations the parameter cotangents need;
- the stash = every value W reads that B computed (or that is an input of B: a residual or an
  output cotangent); B returns it after the input cotangents, and it is W's only input.

Before the split, every ``dot_general`` of F and BW that contracts several adjacent dimensions
(the weight gradient of ``x @ w`` over ``[batch, seq, d]``) contracts them merged into one,
which spares XLA a transposed copy of the cotangent (``merge_contracting_dims``), and every
``scan`` of at most ``UNROLL_SCAN_LENGTH`` iterations in F and BW runs unrolled
(``unroll_short_scans``); the B and W scans the split makes from BW's keep its params, so they
run unrolled too.

A residual F computes from parameters alone by data movement (a weight's bfloat16 copy in a
mixed-precision layer) is not stored per microbatch: F returns the parameter, and BW casts it
again; nor is one F computes from no input at all by cheap elementwise ops (a causal mask),
which BW computes again (``_recompute_parameter_residuals``). No matmul runs twice, so matmul
FLOPs of B plus W equal those of BW exactly. A backward
``scan`` (layers run with ``lax.scan``/``nn.scan``) computes both kinds of cotangent in one
equation; it is split into a B scan, which also stacks the per-iteration values W needs, and a
W scan over those stacked values. Nested scans inside a scan body are not split further (their
equation goes wholly to B when B needs any of its results).

The calling conventions are those of ``zbjax.stages``. Only inexact values are differentiated:
every inexact parameter, and the incoming activations flagged ``input_differentiable``; batch
leaves never are. A parameter that is not inexact (an integer table) gets an all-zero cotangent
of its own shape and dtype, so W always returns one cotangent per ``param_leaves`` entry.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import ClosedJaxpr, Var, jaxpr_as_fun

from zbjax._jax_compat import (
    CALL_PRIMITIVES,
    dce_closed_jaxpr,
    inline_calls,
    is_drop_var,
    is_literal,
    make_closed_jaxpr,
    merge_contracting_dims,
    new_var,
    no_mesh_context,
    replace_equation,
    same_jaxpr,
    scan_counts,
    scan_params,
    unroll_short_scans,
    vmap_independent_scans,
)
from zbjax.cost_model import avals_bytes, jaxpr_cost, matmul_flops
from zbjax.errors import PartitionError
from zbjax.partition import refuse_ordered_effects
from zbjax.stages import Stage, StageGraph, StageProgram, has_cotangent, keys_as_data


def split(graph: StageGraph) -> tuple[StageProgram, ...]:
    """Returns the F/B/W/BW programs of every stage of ``graph``, in stage order.

    Stages that are one program written twice (the middle stages of a stack of identical
    blocks, each holding its own blocks' params: ``alike``) are differentiated and split once;
    the others get the first one's programs, their params' order mapped. Differentiating the
    stages was about half the time of building a pipeline (``benchmarks/build_time.py``); it
    now grows with the distinct stages, not with every stage.
    """
    programs: list[StageProgram] = []
    distinct: list[tuple[ClosedJaxpr, tuple[int, ...], StageProgram]] = []
    for stage in graph.stages:
        canonical, order = _params_by_first_use(stage)
        for first_canonical, first_order, first in distinct:
            if _same_roles(first.stage, stage) and same_jaxpr(first_canonical, canonical):
                programs.append(_program_for(first, first_order, stage, order))
                break
        else:
            program = split_stage(stage)
            distinct.append((canonical, order, program))
            programs.append(program)
    return tuple(programs)


def alike(a: Stage, b: Stage) -> bool:
    """Returns whether stages ``a`` and ``b`` split into the same programs: the same jaxpr up
    to variable names and the order of its params (``same_jaxpr`` with the params ordered by
    first use), as many params and batch leaves, and the same inputs and outputs
    differentiated. Which leaves they hold, where they sit in the graph and their names may
    differ."""
    return _same_roles(a, b) and same_jaxpr(_params_by_first_use(a)[0], _params_by_first_use(b)[0])


def _same_roles(a: Stage, b: Stage) -> bool:
    return (
        len(a.param_leaves) == len(b.param_leaves)
        and len(a.batch_leaves) == len(b.batch_leaves)
        and tuple(a.input_differentiable) == tuple(b.input_differentiable)
        and tuple(a.output_differentiable) == tuple(b.output_differentiable)
    )


def _params_by_first_use(stage: Stage) -> tuple[ClosedJaxpr, tuple[int, ...]]:
    """Returns the stage's jaxpr with its params reordered by their first read (equations in
    order, then outputs; unread params last), and ``order``: the original position of each.

    Params come in the order of the model's leaves, which need not be the order a stage uses
    them (``block_10`` sorts before ``block_9``), so two stages of the same blocks can list
    the same params in different orders."""
    jaxpr = stage.jaxpr.jaxpr
    num_params = len(stage.param_leaves)
    position = {v: k for k, v in enumerate(jaxpr.invars[:num_params])}
    order: dict[int, None] = {}
    for eqn in jaxpr.eqns:
        for v in eqn.invars:
            if not is_literal(v) and v in position:
                order.setdefault(position[v], None)
    for v in jaxpr.outvars:
        if not is_literal(v) and v in position:
            order.setdefault(position[v], None)
    for k in range(num_params):
        order.setdefault(k, None)
    ordered = tuple(order)
    if ordered == tuple(range(num_params)):
        return stage.jaxpr, ordered
    invars = [jaxpr.invars[k] for k in ordered] + list(jaxpr.invars[num_params:])
    canonical = make_closed_jaxpr(
        invars, jaxpr.outvars, jaxpr.eqns, jaxpr.constvars, stage.jaxpr.consts
    )
    return canonical, ordered


def _program_for(
    first: StageProgram, first_order: tuple[int, ...], stage: Stage, order: tuple[int, ...]
) -> StageProgram:
    """Returns ``first``'s programs for ``stage``, an ``alike`` stage whose params in first-use
    order sit at ``order`` (``first``'s at ``first_order``): F takes them, and W and BW return
    their cotangents, in ``stage``'s order."""
    if order == first_order:
        return replace(first, stage=stage)
    source = dict(zip(order, first_order, strict=True))  # stage's position -> first's
    n = len(order)
    num_in_cts = sum(stage.input_differentiable)

    def permuted(closed: ClosedJaxpr, invars: list, outvars: list) -> ClosedJaxpr:
        j = closed.jaxpr
        return make_closed_jaxpr(invars, outvars, j.eqns, j.constvars, closed.consts)

    fw, bw, w = first.forward, first.backward, first.backward_weight
    fw_in = fw.jaxpr.invars
    bw_out = bw.jaxpr.outvars
    return replace(
        first,
        stage=stage,
        forward=permuted(fw, [fw_in[source[k]] for k in range(n)] + fw_in[n:], fw.jaxpr.outvars),
        backward=permuted(
            bw,
            bw.jaxpr.invars,
            bw_out[:num_in_cts] + [bw_out[num_in_cts + source[k]] for k in range(n)],
        ),
        backward_weight=permuted(w, w.jaxpr.invars, [w.jaxpr.outvars[source[k]] for k in range(n)]),
    )


#: A stage program's ``scan`` of at most this many iterations (a stage's share of the layers of
#: an ``nn.scan``) is unrolled (``unroll_short_scans``). The fused backward of the `nn.scan`
#: GPT's middle stage (2 layers), unrolled and with its dots merged, took 0.59-0.62x the time of
#: it as JAX traced it, where the linen GPT's stages gain 0.68-0.77x from the merge alone
#: (`benchmarks/bw_split.py`, four runs on the project's 2-core Xeon); unrolling more costs
#: more compile time for what a loop's per-iteration overhead amortises.
UNROLL_SCAN_LENGTH = 4


def split_stage(
    stage: Stage,
    *,
    merge_contracting: bool = True,
    unroll_scans: int = UNROLL_SCAN_LENGTH,
    recompute_parameter_casts: bool = True,
    recompute_constants: bool = True,
) -> StageProgram:
    """Returns the stage's forward, split backward (B, W) and fused backward programs.

    ``merge_contracting=False`` keeps every ``dot_general`` as JAX traced it, instead of
    merging adjacent contracting dimensions (``merge_contracting_dims``),
    ``unroll_scans=0`` keeps every ``scan`` a loop, instead of unrolling those of at most
    that many iterations (``unroll_short_scans``), and ``recompute_parameter_casts=False``
    and ``recompute_constants=False`` store the residuals F computes from parameters alone (a
    weight's bfloat16 copy) and from no input (a causal mask) per microbatch, instead of
    computing them again in the backward (``_recompute_parameter_residuals``): to measure what
    each saves.
    """
    with no_mesh_context():  # a mesh the caller set must not reach the programs
        roles = _differentiation_roles(stage)
        forward, backward = _forward_and_backward(stage, roles)
        if recompute_parameter_casts or recompute_constants:
            forward, backward = _recompute_parameter_residuals(
                forward,
                backward,
                len(stage.jaxpr.out_avals),
                roles.num_params if recompute_parameter_casts else 0,
                constants=recompute_constants,
            )
        if merge_contracting:
            # The weight gradients of ``x @ w`` over ``[batch, seq, d]`` contract two dimensions;
            # merged into one they need no transposed copy of the cotangent (in BW, B and W).
            forward, backward = merge_contracting_dims(forward), merge_contracting_dims(backward)
        # Unrolled here, before the split: the B and W scans the split makes from BW's keep their
        # scan's params, ``unroll`` included.
        forward, backward = (
            unroll_short_scans(forward, unroll_scans),
            unroll_short_scans(backward, unroll_scans),
        )
        backward_input, backward_weight = _split_backward(backward, len(roles.input_positions))
        backward_weight = vmap_independent_scans(backward_weight)
        # Residuals and stash live in arenas of numbers: a typed PRNG key among them (a
        # dropout key F keeps for the backward) is stored as its key data.
        num_out, num_res = len(stage.jaxpr.out_avals), _num_residuals(forward, stage)
        num_b_out = len(backward_input.out_avals) - len(backward_weight.in_avals)
        forward = keys_as_data(forward, (), range(num_out, len(forward.out_avals)))
        backward = keys_as_data(backward, range(num_res), ())
        backward_input = keys_as_data(
            backward_input, range(num_res), range(num_b_out, len(backward_input.out_avals))
        )
        backward_weight = keys_as_data(backward_weight, range(len(backward_weight.in_avals)), ())
    residual_avals = tuple(_sds(a) for a in backward.in_avals[:num_res])
    stash_avals = tuple(_sds(a) for a in backward_weight.in_avals)
    num_params = len(stage.param_leaves)
    return StageProgram(
        stage=stage,
        forward=forward,
        backward_input=backward_input,
        backward_weight=backward_weight,
        backward=backward,
        residual_avals=residual_avals,
        stash_avals=stash_avals,
        cost_forward=jaxpr_cost(forward),
        cost_backward_input=jaxpr_cost(backward_input),
        cost_backward_weight=jaxpr_cost(backward_weight),
        flops_forward=matmul_flops(forward),
        flops_backward_input=matmul_flops(backward_input),
        flops_backward_weight=matmul_flops(backward_weight),
        flops_backward=matmul_flops(backward),
        param_bytes=avals_bytes(stage.jaxpr.in_avals[:num_params]),
        activation_bytes=_stored_residual_bytes(forward, len(stage.jaxpr.out_avals)),
        stash_bytes=avals_bytes(stash_avals),
    )


def forwards_only(program: StageProgram) -> StageProgram:
    """Returns ``program`` computing its stage's outputs alone: its forward without the
    residuals (and what only they needed), no stash, and backward programs that return zeros
    (a lowering of ``Schedule.forwards`` never runs them; they keep their signatures). For
    evaluation: a stage's F then stores nothing."""
    # The stage's own jaxpr (F is made from it, so takes the same inputs and returns its
    # outputs first): F is jax.vjp's forward, in which a jax.custom_vjp function is its fwd
    # rule's body, so an outer jax.grad of F would differentiate that body and not the rule
    # (helper H1); the stage's jaxpr keeps the custom_vjp call.
    forward = program.stage.jaxpr
    assert list(forward.in_avals) == list(program.forward.in_avals)
    num_in_cts = len(program.backward_input.out_avals) - len(program.stash_avals)
    num_out_cts = len(program.backward.in_avals) - len(program.residual_avals)
    cotangents = program.backward.in_avals[len(program.residual_avals) :]
    assert len(cotangents) == num_out_cts
    return replace(
        program,
        forward=forward,
        backward_input=_zeros_jaxpr(cotangents, program.backward_input.out_avals[:num_in_cts]),
        backward_weight=_zeros_jaxpr((), program.backward_weight.out_avals),
        backward=_zeros_jaxpr(cotangents, program.backward.out_avals),
        residual_avals=(),
        stash_avals=(),
        activation_bytes=0,
        stash_bytes=0,
    )


def _zeros_jaxpr(in_avals: Sequence[Any], out_avals: Sequence[Any]) -> ClosedJaxpr:
    """Returns a closed jaxpr taking ``in_avals`` that returns zeros of ``out_avals``."""

    def zeros(*_: Any) -> list[Any]:
        # (float0 zeros, a non-differentiable input's cotangent, are NumPy's alone.)
        return [
            np.zeros(a.shape, a.dtype)
            if a.dtype == jax.dtypes.float0
            else jnp.zeros(a.shape, a.dtype)
            for a in out_avals
        ]

    return jax.make_jaxpr(zeros)(*in_avals)


def _stored_residual_bytes(forward: ClosedJaxpr, num_outputs: int) -> int:
    """Returns the bytes of F's residuals that a lowering stores per microbatch: all but those
    that forward one of F's inputs (a parameter or batch leaf, read where it is resident)."""
    residuals = forward.jaxpr.outvars[num_outputs:]
    forwarded = _forwarded_inputs(forward, num_outputs)
    return avals_bytes(v.aval for v, f in zip(residuals, forwarded, strict=True) if f is None)


def forwarded_residuals(program: StageProgram) -> tuple[int | None, ...]:
    """Returns, per residual, the index of the forward input it merely forwards, else None.

    Residuals that are a parameter (the ``A`` of ``x @ A`` that B needs for ``dy @ A.T``) or a
    batch leaf are already resident where B runs; a lowering may read them from there instead of
    storing them per microbatch. Indices are positions in ``Stage.jaxpr``'s inputs.
    """
    return _forwarded_inputs(program.forward, len(program.stage.jaxpr.out_avals))


def _forwarded_inputs(forward: ClosedJaxpr, num_outputs: int) -> tuple[int | None, ...]:
    jaxpr = forward.jaxpr
    position = {v: i for i, v in enumerate(jaxpr.invars)}
    return tuple(None if is_literal(v) else position.get(v) for v in jaxpr.outvars[num_outputs:])


def forwarded_stash(program: StageProgram) -> tuple[int | None, ...]:
    """Returns, per stash value, the index of the residual it merely forwards, else None.

    W often needs values B only passes through (the ``x`` of ``x @ A``, whose weight gradient
    is ``x.T @ dy``). Such a value is already stored for B; a lowering that keeps residuals until
    W can let W read it there instead of having B copy it into the stash.
    """
    jaxpr = program.backward_input.jaxpr
    num_residuals = len(program.residual_avals)
    num_input_cts = len(jaxpr.outvars) - len(program.stash_avals)
    position = {v: i for i, v in enumerate(jaxpr.invars[:num_residuals])}
    return tuple(None if is_literal(v) else position.get(v) for v in jaxpr.outvars[num_input_cts:])


@dataclass(frozen=True)
class _Roles:
    """Which stage inputs and outputs are differentiated, as positions in the flat lists."""

    input_positions: tuple[int, ...]  # inputs given a cotangent (B's outputs), in order
    param_positions: tuple[int, ...]  # inexact params (the rest get zero cotangents)
    output_positions: tuple[int, ...]  # outputs that receive a cotangent
    num_params: int


def _differentiation_roles(stage: Stage) -> _Roles:
    in_avals, out_avals = stage.jaxpr.in_avals, stage.jaxpr.out_avals
    num_params, num_batch = len(stage.param_leaves), len(stage.batch_leaves)
    first_input = num_params + num_batch
    num_inputs = len(in_avals) - first_input
    if num_inputs != len(stage.input_differentiable) or len(out_avals) != len(
        stage.output_differentiable
    ):
        raise PartitionError(
            f"stage {stage.index} ({stage.name!r}) has {len(in_avals)} jaxpr inputs and "
            f"{len(out_avals)} outputs, but {num_params} params + {num_batch} batch leaves + "
            f"{len(stage.input_differentiable)} input flags and "
            f"{len(stage.output_differentiable)} output flags; build the Stage with one flag "
            "per incoming and outgoing value"
        )
    for kind, avals, flags, offset in (
        ("input", in_avals, stage.input_differentiable, first_input),
        ("output", out_avals, stage.output_differentiable, 0),
    ):
        for k, flag in enumerate(flags):
            if flag and not has_cotangent(avals[offset + k].dtype):
                raise PartitionError(
                    f"stage {stage.index} ({stage.name!r}) flags {kind} {k} of type "
                    f"{avals[offset + k].str_short()} as differentiable; only floating "
                    "values have cotangents, so set its flag to False"
                )
    return _Roles(
        input_positions=tuple(
            first_input + k for k, flag in enumerate(stage.input_differentiable) if flag
        ),
        param_positions=tuple(k for k in range(num_params) if has_cotangent(in_avals[k].dtype)),
        output_positions=tuple(k for k, flag in enumerate(stage.output_differentiable) if flag),
        num_params=num_params,
    )


def _forward_and_backward(stage: Stage, roles: _Roles) -> tuple[ClosedJaxpr, ClosedJaxpr]:
    """Returns F (inputs -> outputs, residuals) and BW ((residuals, cts) -> (in cts, param cts))."""
    stage_fn = jaxpr_as_fun(stage.jaxpr)
    diff_positions = roles.input_positions + roles.param_positions
    num_outputs = len(stage.jaxpr.out_avals)
    captured: dict[str, Any] = {}

    def forward(*args: Any) -> list[Any]:
        def differentiable(*diff_values: Any) -> tuple[list, list]:
            full = list(args)
            for position, value in zip(diff_positions, diff_values, strict=True):
                full[position] = value
            outs = stage_fn(*full)
            aux = [o for k, o in enumerate(outs) if k not in roles.output_positions]
            return [outs[k] for k in roles.output_positions], aux

        primals = [args[p] for p in diff_positions]
        diff_outs, vjp_fn, aux = jax.vjp(differentiable, *primals, has_aux=True)
        leaves, captured["treedef"] = jax.tree_util.tree_flatten(vjp_fn)
        traced = [isinstance(leaf, jax.core.Tracer) for leaf in leaves]
        # The constant leaves only: a tracer kept past the trace is a leak (jax.checking_leaks).
        captured["leaves"] = [None if t else leaf for leaf, t in zip(leaves, traced, strict=True)]
        captured["is_traced"] = traced
        outs = _merge(diff_outs, aux, roles.output_positions, num_outputs)
        return outs + [leaf for leaf in leaves if isinstance(leaf, jax.core.Tracer)]

    forward_full = jax.make_jaxpr(forward)(*(_sds(a) for a in stage.jaxpr.in_avals))
    # Residual leaves that turned out constant (a literal or a captured array) are baked into
    # the backward; the others are deduplicated by the forward variable they hold.
    slots, residual_vars = _residual_slots(forward_full, num_outputs, captured)
    unique_avals = [v.aval for v in residual_vars]
    ct_avals = [stage.jaxpr.out_avals[k] for k in roles.output_positions]

    def backward(residuals: list, cotangents: list) -> list[Any]:
        leaves = [residuals[s] if isinstance(s, int) else s.value for s in slots]
        vjp_fn = jax.tree_util.tree_unflatten(captured["treedef"], leaves)
        grads = list(vjp_fn(list(cotangents))) if diff_positions else []
        input_cts = grads[: len(roles.input_positions)]
        by_param = dict(
            zip(roles.param_positions, grads[len(roles.input_positions) :], strict=True)
        )
        param_avals = stage.jaxpr.in_avals[: roles.num_params]
        param_cts = [
            by_param[k] if k in by_param else jnp.zeros(a.shape, a.dtype)
            for k, a in enumerate(param_avals)
        ]
        return input_cts + param_cts

    backward_full = jax.make_jaxpr(backward)(
        [_sds(a) for a in unique_avals], [_sds(a) for a in ct_avals]
    )
    refuse_ordered_effects(
        backward_full.jaxpr, f"the backward of stage {stage.index} (a custom_vjp rule's bwd)"
    )
    forward_unique = make_closed_jaxpr(
        forward_full.jaxpr.invars,
        list(forward_full.jaxpr.outvars[:num_outputs]) + residual_vars,
        forward_full.jaxpr.eqns,
        forward_full.jaxpr.constvars,
        forward_full.consts,
    )
    return _drop_unread_residuals(forward_unique, backward_full, num_outputs)


#: Primitives that only move, reshape or cast their operand: a residual such ops compute from
#: parameters alone (a layer's slice of stacked weights, a weight cast to bfloat16) is computed
#: again where the backward runs instead of being stored per microbatch.
_DATA_MOVEMENT = frozenset(
    {
        "slice",
        "split",
        "squeeze",
        "reshape",
        "expand_dims",
        "broadcast_in_dim",
        "convert_element_type",
        "transpose",
        "concatenate",
        "copy",
    }
)

#: Cheap elementwise primitives: a residual such ops and ``_DATA_MOVEMENT`` compute from no
#: input at all (a causal mask: ``iota``s compared, broadcast over batch and heads) is computed
#: again where the backward runs instead of being stored per microbatch.
_CONSTANT_ARITHMETIC = frozenset(
    {
        "iota",
        "add",
        "sub",
        "mul",
        "neg",
        "max",
        "min",
        "eq",
        "ne",
        "ge",
        "gt",
        "le",
        "lt",
        "and",
        "or",
        "not",
        "xor",
        "select_n",
    }
)
_CONSTANT_OPS = _DATA_MOVEMENT | _CONSTANT_ARITHMETIC


def _recompute_parameter_residuals(
    forward: ClosedJaxpr,
    backward: ClosedJaxpr,
    num_outputs: int,
    num_params: int,
    *,
    constants: bool = True,
) -> tuple[ClosedJaxpr, ClosedJaxpr]:
    """Returns F and BW where residuals that F computes from parameters alone, by data
    movement only (``_DATA_MOVEMENT``), or from no input at all, by data movement and cheap
    elementwise ops (``_CONSTANT_ARITHMETIC``: a causal mask), are recomputed in BW.

    Parameters are resident where the backward runs (``forwarded_residuals``), so such a
    residual costs a per-microbatch slot in F's output for what is a copy of a parameter or
    a constant (and, on a tensor axis, a collective when the slot is sharded otherwise than
    the value). BW gets the parameters it needs as residuals instead, and starts with F's
    equations that compute the dropped residuals. ``num_params=0`` recomputes only
    constants, ``constants=False`` only values derived from parameters.
    """
    made_by = {v: e.primitive.name for e in forward.jaxpr.eqns for v in e.outvars}
    if any(made_by.get(v) in CALL_PRIMITIVES for v in forward.jaxpr.outvars[num_outputs:]):
        # A residual a call computes (the loop-invariant values ``jax.vjp`` hoists out of a
        # ``scan``, such as its body's causal mask): look into the call.
        forward = inline_calls(forward)
    jaxpr = forward.jaxpr
    # Values computed without reading any input (an attention mask from ``iota``s), by cheap
    # elementwise ops and data movement, and values computed from parameters by data movement.
    constant: set = set(jaxpr.constvars)
    derived: set = set(jaxpr.invars[:num_params])
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        operands = [v for v in eqn.invars if not is_literal(v)]
        if name in _CONSTANT_OPS and all(v in constant for v in operands):
            constant |= _defined(eqn)
        elif name in _DATA_MOVEMENT and all(v in constant or v in derived for v in operands):
            derived |= _defined(eqn)
    if constants:
        derived |= constant
    residuals = list(jaxpr.outvars[num_outputs:])
    dropped = [r for r in residuals if not is_literal(r) and r in derived]
    if not dropped:
        return forward, backward
    kept = [r for r in residuals if is_literal(r) or r not in derived]
    # The equations the dropped residuals need, in F's order, and the parameters they read.
    live, reads = _live(jaxpr.eqns, dropped)
    eqns = [jaxpr.eqns[k] for k in sorted(live)]
    params = [v for v in jaxpr.invars[:num_params] if v in reads]
    recompute = make_closed_jaxpr(
        params, dropped, eqns, *_used_consts(jaxpr.constvars, forward.consts, eqns, dropped)
    )
    extra = [v for v in params if v not in kept]
    new_forward = dce_closed_jaxpr(
        make_closed_jaxpr(
            jaxpr.invars,
            list(jaxpr.outvars[:num_outputs]) + kept + extra,
            jaxpr.eqns,
            jaxpr.constvars,
            forward.consts,
        ),
        [True] * (num_outputs + len(kept) + len(extra)),
    )
    residual_of = {v: k for k, v in enumerate(kept + extra)}
    backward_fn = jaxpr_as_fun(backward)
    recompute_fn = jaxpr_as_fun(recompute)

    def new_backward(*args: Any) -> list[Any]:
        values, cts = args[: len(residual_of)], args[len(residual_of) :]
        recomputed = dict(
            zip(dropped, recompute_fn(*(values[residual_of[p]] for p in params)), strict=True)
        )
        full = [recomputed[r] if r in recomputed else values[residual_of[r]] for r in residuals]
        return backward_fn(*full, *cts)

    avals = [v.aval for v in kept + extra] + list(backward.in_avals[len(residuals) :])
    return new_forward, jax.make_jaxpr(new_backward)(*(_sds(a) for a in avals))


@dataclass(frozen=True)
class _Constant:
    value: Any


def _residual_slots(
    forward: ClosedJaxpr, num_outputs: int, captured: dict
) -> tuple[list[int | _Constant], list[Var]]:
    """Returns per vjp leaf its unique-residual index (or constant) and the unique residuals."""
    jaxpr = forward.jaxpr
    const_of = dict(zip(jaxpr.constvars, forward.consts, strict=True))
    traced_outvars = iter(jaxpr.outvars[num_outputs:])
    index: dict[Var, int] = {}
    residual_vars: list[Var] = []
    slots: list[int | _Constant] = []
    for leaf, traced in zip(captured["leaves"], captured["is_traced"], strict=True):
        if not traced:
            slots.append(_Constant(leaf))
            continue
        atom = next(traced_outvars)
        if is_literal(atom):
            slots.append(_Constant(atom.val))
        elif atom in const_of:
            slots.append(_Constant(const_of[atom]))
        else:
            if atom not in index:
                index[atom] = len(residual_vars)
                residual_vars.append(atom)
            slots.append(index[atom])
    return slots, residual_vars


def _drop_unread_residuals(
    forward: ClosedJaxpr, backward: ClosedJaxpr, num_outputs: int
) -> tuple[ClosedJaxpr, ClosedJaxpr]:
    """Returns F and BW keeping only the residuals BW reads; BW is inlined and DCE'd."""
    backward = inline_calls(backward)
    backward = dce_closed_jaxpr(backward, [True] * len(backward.jaxpr.outvars))
    num_residuals = len(forward.jaxpr.outvars) - num_outputs
    read = _read_vars(backward.jaxpr.eqns, backward.jaxpr.outvars)
    keep = [v in read for v in backward.jaxpr.invars[:num_residuals]]
    forward = dce_closed_jaxpr(forward, [True] * num_outputs + keep)
    invars = [v for v, k in zip(backward.jaxpr.invars[:num_residuals], keep, strict=True) if k]
    backward = make_closed_jaxpr(
        invars + list(backward.jaxpr.invars[num_residuals:]),
        backward.jaxpr.outvars,
        backward.jaxpr.eqns,
        backward.jaxpr.constvars,
        backward.consts,
    )
    return forward, backward


def _num_residuals(forward: ClosedJaxpr, stage: Stage) -> int:
    return len(forward.jaxpr.outvars) - len(stage.jaxpr.out_avals)


# ---------------------------------------------------------------------------------------------
# Splitting BW into B and W
# ---------------------------------------------------------------------------------------------


def _split_backward(backward: ClosedJaxpr, num_input_cts: int) -> tuple[ClosedJaxpr, ClosedJaxpr]:
    """Returns (B, W): B = BW's input-cotangent equations plus the stash, W = the rest."""
    jaxpr = backward.jaxpr
    b_out = list(jaxpr.outvars[:num_input_cts])
    w_out = list(jaxpr.outvars[num_input_cts:])
    eqns = list(jaxpr.eqns)
    already_split: set[int] = set()
    while True:
        in_b, b_needed = _live(eqns, b_out, exclude=frozenset(), keep_effects=True)
        in_w, w_needed = _live(eqns, w_out, exclude=in_b)
        target = _scan_to_split(eqns, in_b, b_needed, w_needed, already_split)
        if target is None:
            break
        index, pieces = target
        eqns[index : index + 1] = pieces
        already_split.add(id(pieces[0]))

    b_eqns = [eqns[i] for i in sorted(in_b)]
    w_eqns = [eqns[i] for i in sorted(in_w)]
    b_defined = set(jaxpr.invars).union(*(_defined(e) for e in b_eqns))
    hoisted = _small_reductions(w_eqns, b_defined | set(jaxpr.constvars), w_out)
    if hoisted:
        b_eqns += [e for e in w_eqns if id(e) in hoisted]
        w_eqns = [e for e in w_eqns if id(e) not in hoisted]
        b_defined = b_defined.union(*(_defined(e) for e in b_eqns))
        w_needed = _read_vars(w_eqns, w_out)
    # Deterministic stash order: B's inputs first, then values in the order B computes them.
    candidates = list(jaxpr.invars) + [v for e in b_eqns for v in e.outvars]
    stash = list(dict.fromkeys(v for v in candidates if v in w_needed and v in b_defined))
    constvars, consts = jaxpr.constvars, backward.consts
    b = make_closed_jaxpr(
        jaxpr.invars, b_out + stash, b_eqns, *_used_consts(constvars, consts, b_eqns, b_out)
    )
    w = make_closed_jaxpr(stash, w_out, w_eqns, *_used_consts(constvars, consts, w_eqns, w_out))
    return b, w


# Cheap equations W may hand to B: elementwise arithmetic, reductions and reshapes.
_CHEAP = frozenset(
    {
        "add",
        "add_any",
        "sub",
        "mul",
        "neg",
        "div",
        "reduce_sum",
        "reshape",
        "squeeze",
        "expand_dims",
        "broadcast_in_dim",
        "convert_element_type",
    }
)
# A reduction moves to B when its result is at most this fraction of its largest source.
_SMALL_FRACTION = 1 / 8


def _small_reductions(w_eqns: Sequence[Any], available: set, w_out: Sequence[Any]) -> set[int]:
    """Returns the ids of W equations to run in B instead: chains of cheap equations over
    values B already has that end in a W output much smaller than what they read (a bias or
    layer-norm gradient: a sum over the batch of a stashed cotangent).

    B has those values in cache when it computes them; W would read them back from memory
    only for these sums. A chain moves only when nothing else in W reads its intermediate
    values, so no work is done twice and the stash only gains the small results.
    """
    produced_by: dict[Any, Any] = {}
    sources: dict[Any, int] = {}  # cheap-chain value -> size of its largest available source
    for eqn in w_eqns:
        if eqn.primitive.name not in _CHEAP or eqn.effects:
            continue
        reads = [v for v in eqn.invars if not is_literal(v)]
        if not all(v in available or v in sources for v in reads):
            continue
        largest = max([sources[v] if v in sources else int(v.aval.size) for v in reads], default=0)
        for v in _defined(eqn):
            sources[v] = largest
            produced_by[v] = eqn
    readers: dict[Any, set[int]] = {}
    for eqn in w_eqns:
        for v in eqn.invars:
            if not is_literal(v):
                readers.setdefault(v, set()).add(id(eqn))
    roots = [
        v
        for v in dict.fromkeys(v for v in w_out if not is_literal(v))
        if v in produced_by and v.aval.size <= _SMALL_FRACTION * sources[v]
    ]
    hoisted: set[int] = set()
    for root in roots:
        chain: dict[int, Any] = {}
        stack = [root]
        while stack:
            eqn = produced_by[stack.pop()]
            if id(eqn) in chain:
                continue
            chain[id(eqn)] = eqn
            stack += [v for v in eqn.invars if not is_literal(v) and v in produced_by]
        inner = {v for e in chain.values() for v in _defined(e)} - {root}
        if all(readers.get(v, set()) <= chain.keys() and v not in w_out for v in inner):
            hoisted |= chain.keys()
    return hoisted


def _scan_to_split(
    eqns: list, in_b: set[int], b_needed: set, w_needed: set, already_split: set[int]
) -> tuple[int, list] | None:
    """Returns (index, replacement equations) for a B scan that also computes W-only results."""
    for i in sorted(in_b):
        eqn = eqns[i]
        if eqn.primitive.name != "scan" or id(eqn) in already_split:
            continue
        wants = {v for v in eqn.outvars if v in w_needed and v not in b_needed}
        if not wants:
            continue
        pieces = _split_scan(eqn, b_needed, wants)
        return i, pieces if pieces is not None else [eqn]
    return None


def _split_scan(eqn: Any, b_needed: set, w_wants: set) -> list | None:
    """Returns [B scan, W scan] computing what B needs (plus a per-iteration stash) and the rest.

    Returns None when everything W wants from the scan is already produced by its B part.
    """
    params = eqn.params
    body: ClosedJaxpr = params["jaxpr"]
    bj = body.jaxpr
    (nc, nk), length = scan_counts(params), params["length"]
    c_in, k_in, x_in = bj.invars[:nc], bj.invars[nc : nc + nk], bj.invars[nc + nk :]
    k_out, y_out = bj.outvars[:nk], bj.outvars[nk:]
    o_consts, o_init, o_xs = eqn.invars[:nc], eqn.invars[nc : nc + nk], eqn.invars[nc + nk :]
    o_kf, o_ys = eqn.outvars[:nk], eqn.outvars[nk:]

    # B's carries: those B needs at the end, closed under "the body reads the carry".
    kb = {i for i in range(nk) if o_kf[i] in b_needed}
    yb = {j for j in range(len(y_out)) if o_ys[j] in b_needed}
    while True:
        live_b, need_b = _live(
            bj.eqns, [k_out[i] for i in kb] + [y_out[j] for j in yb], keep_effects=True
        )
        grown = kb | {i for i in range(nk) if k_in[i] in need_b}
        if grown == kb:
            break
        kb = grown
    b_available = (set(c_in) | {k_in[i] for i in kb} | set(x_in) | set(bj.constvars)).union(
        *(_defined(bj.eqns[i]) for i in live_b)
    )
    wanted = b_needed | w_wants
    yb |= {
        j for j, v in enumerate(y_out) if o_ys[j] in wanted and (is_literal(v) or v in b_available)
    }

    kr = {i for i in range(nk) if o_kf[i] in w_wants} - kb
    yr = {j for j in range(len(y_out)) if o_ys[j] in w_wants} - yb
    if not kr and not yr:
        return None
    live_r, need_r, kr = _rest_of_body(bj.eqns, (k_in, k_out), y_out, live_b, kb, kr, yr)
    # Per-layer bias and layer-norm sums run in B, as at the top level (_small_reductions).
    hoisted = _small_reductions(
        [bj.eqns[i] for i in sorted(live_r)], b_available, [y_out[j] for j in sorted(yr)]
    )
    if hoisted:
        moved = {i for i in live_r if id(bj.eqns[i]) in hoisted}
        live_b |= moved
        need_b = need_b | {v for i in moved for v in bj.eqns[i].invars if not is_literal(v)}
        b_available = b_available.union(*(_defined(bj.eqns[i]) for i in moved))
        now_b = {j for j in yr if y_out[j] in b_available}
        yb, yr = yb | now_b, yr - now_b
        kr = {i for i in range(nk) if o_kf[i] in w_wants} - kb
        live_r, need_r, kr = _rest_of_body(bj.eqns, (k_in, k_out), y_out, live_b, kb, kr, yr)

    b_carried = [k_in[i] for i in sorted(kb)]
    b_computed = [v for i in sorted(live_b) for v in bj.eqns[i].outvars]
    stash = list(dict.fromkeys(v for v in b_carried + b_computed if v in need_r))
    stacked = [new_var(v.aval.update(shape=(length, *v.aval.shape))) for v in stash]

    b_consts = [k for k in range(nc) if c_in[k] in need_b]
    b_xs = [k for k in range(len(x_in)) if x_in[k] in need_b]
    b_body = make_closed_jaxpr(
        [c_in[k] for k in b_consts] + b_carried + [x_in[k] for k in b_xs],
        [k_out[i] for i in sorted(kb)] + [y_out[j] for j in sorted(yb)] + stash,
        [bj.eqns[i] for i in sorted(live_b)],
        bj.constvars,
        body.consts,
    )
    b_eqn = _scan_equation(
        eqn,
        b_body,
        [o_consts[k] for k in b_consts] + [o_init[i] for i in sorted(kb)] + [o_xs[k] for k in b_xs],
        [o_kf[i] for i in sorted(kb)] + [o_ys[j] for j in sorted(yb)] + stacked,
        num_consts=len(b_consts),
        num_carry=len(kb),
    )

    if not kr and not yr:  # B's body took over all that W computed
        return [b_eqn]
    r_consts = [k for k in range(nc) if c_in[k] in need_r]
    r_xs = [k for k in range(len(x_in)) if x_in[k] in need_r]
    r_body = make_closed_jaxpr(
        [c_in[k] for k in r_consts]
        + [k_in[i] for i in sorted(kr)]
        + [x_in[k] for k in r_xs]
        + stash,
        [k_out[i] for i in sorted(kr)] + [y_out[j] for j in sorted(yr)],
        [bj.eqns[i] for i in sorted(live_r)],
        bj.constvars,
        body.consts,
    )
    r_eqn = _scan_equation(
        eqn,
        r_body,
        [o_consts[k] for k in r_consts]
        + [o_init[i] for i in sorted(kr)]
        + [o_xs[k] for k in r_xs]
        + stacked,
        [o_kf[i] for i in sorted(kr)] + [o_ys[j] for j in sorted(yr)],
        num_consts=len(r_consts),
        num_carry=len(kr),
    )
    return [b_eqn, r_eqn]


def _rest_of_body(
    eqns: Sequence[Any],
    carries: tuple[Sequence[Any], Sequence[Any]],
    y_out: Sequence[Any],
    live_b: set[int],
    kb: set[int],
    kr: set[int],
    yr: set[int],
) -> tuple[set[int], set, set[int]]:
    """Returns (equations, values read, carries) of a split scan body's W part: what computes
    the carries ``kr`` and outputs ``yr`` besides B's equations ``live_b``, with the carries
    closed under "the body reads the carry". ``carries`` is (carry inputs, carry outputs)."""
    k_in, k_out = carries
    while True:
        live_r, need_r = _live(eqns, [k_out[i] for i in kr] + [y_out[j] for j in yr], live_b)
        grown = kr | {i for i in range(len(k_in)) if k_in[i] in need_r and i not in kb}
        if grown == kr:
            return live_r, need_r, kr
        kr = grown


def _scan_equation(
    eqn: Any, body: ClosedJaxpr, invars: list, outvars: list, num_consts: int, num_carry: int
) -> Any:
    params = scan_params(eqn.params, body, num_consts, num_carry)
    return replace_equation(eqn, invars, outvars, params)


# ---------------------------------------------------------------------------------------------
# Small jaxpr utilities
# ---------------------------------------------------------------------------------------------


def _live(
    eqns: Sequence[Any],
    outvars: Iterable[Any],
    exclude: frozenset[int] | set[int] = frozenset(),
    keep_effects: bool = False,
) -> tuple[set[int], set]:
    """Returns (indices of equations the outvars need, every variable they read), skipping
    ``exclude``d equations (their results count as available)."""
    needed = {v for v in outvars if not is_literal(v)}
    live: set[int] = set()
    for i in reversed(range(len(eqns))):
        if i in exclude:
            continue
        eqn = eqns[i]
        if (keep_effects and eqn.effects) or any(v in needed for v in _defined(eqn)):
            live.add(i)
            needed.update(v for v in eqn.invars if not is_literal(v))
    return live, needed


def _defined(eqn: Any) -> set:
    return {v for v in eqn.outvars if not is_drop_var(v)}


def _read_vars(eqns: Sequence[Any], outvars: Sequence[Any]) -> set:
    read = {v for v in outvars if not is_literal(v)}
    for eqn in eqns:
        read.update(v for v in eqn.invars if not is_literal(v))
    return read


def _used_consts(
    constvars: Sequence[Var], consts: Sequence[Any], eqns: Sequence[Any], outvars: Sequence[Any]
) -> tuple[list, list]:
    read = _read_vars(eqns, outvars)
    pairs = [(v, c) for v, c in zip(constvars, consts, strict=True) if v in read]
    return [v for v, _ in pairs], [c for _, c in pairs]


def _merge(diff: list, aux: list, diff_positions: Sequence[int], total: int) -> list:
    diff_iter, aux_iter = iter(diff), iter(aux)
    return [next(diff_iter) if k in diff_positions else next(aux_iter) for k in range(total)]


def _sds(aval: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=getattr(aval, "weak_type", False))
