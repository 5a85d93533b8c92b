"""Trace a loss function and cut it into a ``StageGraph``, at markers or by a cost model.

``partition(loss_fn, params, microbatch)`` traces ``loss_fn`` on one microbatch into a flat
jaxpr (``jit``/``closed_call`` wrappers inlined, so markers inside jitted functions are seen),
assigns every equation a stage, and builds one jaxpr per stage plus the edges between them.
The trace runs in the caller's mesh context; everything after it runs outside any mesh, and
the program is stripped of sharding annotations and of the mesh the trace recorded
(``_jax_compat.strip_sharding_annotations``), with a warning when the annotations split model
dimensions: inside the pipeline the other mesh axes are data parallel.

Stage assignment:

- **Markers.** The k-th ``stage_boundary`` equation in traced order (k = 0, 1, ...) starts
  stage k + 1; its outputs live in that stage. Any other equation goes to the latest stage of
  its inputs, so the stages are in topological order and a value defined in stage i and read
  in stage j > i travels on a direct edge i -> j (skip connections and branches give a DAG).
- **Automatic** (no markers, ``num_stages`` given). *Activations* are the values that depend
  on both a batch leaf and a param leaf. Activation equations, in traced order, are cut into
  ``num_stages`` contiguous groups minimising the largest group cost
  (``cost_model.equation_cost``) plus the most live activation bytes crossing a cut beyond
  ``cost_model.comm_free_bytes()``, weighed by two thirds of ``cost_model.comm_weight()``
  (every tick's messages travel in slots as large as the largest edge's; a byte goes out in
  F and its cotangent in B while a stage computes F, B and W); among near-optimal cuts
  (within ``AUTO_SLACK``) those with fewer live activation bytes are preferred. A ``scan``
  over layers counts as ``length`` units,
  and a scan cut inside is rewritten into several scans over iteration ranges (the scanned-over
  inputs, stacked params included, sliced along axis 0; the carry threaded; the stacked outputs
  concatenated). Each such stage reads the whole stacked param leaf and slices its range.
- **Free equations** (those that are not activations: position embeddings, masks, one-hot
  targets, dropout bits drawn from a key) go to the earliest stage that reads them, so they are
  never computed twice; the stages after it receive them on an edge. Equations on params alone
  (a cast of the param tree, a tied embedding scaled once) or on no input at all (a causal
  mask built from ``iota``s) are the exception: they run again in every stage that reads their
  values (``_recompute_param_values``), which then holds those params, rather than sending a
  param-sized value, or a constant, every microbatch. Free inputs of a marker
  are read at the stage of the marker's other inputs (stage 0 when it has none). With
  ``has_aux``, an equation that feeds only aux outputs and reads no param runs at the stage of
  its latest input instead, so a metric of an early activation travels, not the activation.
- **Assigned** (``assign=`` given). ``assign(program, num_params)`` receives the flat inlined
  program (a ``ClosedJaxpr`` whose first ``num_params`` inputs are the param leaves, then the
  batch leaves) and returns one stage per equation, e.g. GraphPipe's
  ``op_graph_from_jaxpr(...).equation_stages(graph_partition(...))``. Markers in the program
  are then only identities. Stages must be numbered so that every value flows from a stage to
  itself or a later one, every stage gets at least one equation, and the loss is computed in
  the last stage.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import inspect
import math
import os
import sys
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal, Var, jaxprs_in_params

from zbjax import cost_model
from zbjax._jax_compat import (
    CUSTOM_VJP_PRIMITIVES,
    REMAT_PRIMITIVES,
    bind_equation,
    calls_primitive,
    closes_over_tracers,
    dce_closed_jaxpr,
    equation_source,
    new_var,
    no_mesh_context,
    ordered_effect_names,
    scan_counts,
    sharded_axes,
    strip_sharding_annotations,
    tracing_config,
    user_line,
)
from zbjax.errors import PartitionError
from zbjax.markers import is_stage_boundary
from zbjax.microbatch import check_aux_leaves, check_aux_pair, check_key, check_loss_leaf
from zbjax.schedules.ir import count as whole_count
from zbjax.stages import Edge, Stage, StageGraph, has_cotangent, key_data_aval, keys_as_data

#: Automatic cuts may exceed the best achievable maximum stage cost by this fraction when that
#: lets a cut cross fewer live activation bytes (less to send between devices).
AUTO_SLACK = 0.03

# Call wrappers whose body is inlined into the flat program: they only name or jit a function.
_INLINE_ALWAYS = frozenset({"jit", "pjit", "closed_call", "core_call"})
# Wrappers inlined only when their body holds a marker: inlining them changes how the body is
# rematerialised, so they are kept whole otherwise. (A custom_jvp function holding a marker is
# refused, as a custom_vjp one is: inlining it would differentiate its body, not its rule.)
_INLINE_IF_MARKED = frozenset({"checkpoint", "remat", "remat2"})


@dataclass(frozen=True)
class _Program:
    """A flat traced program: invars are the params leaves, then the batch leaves."""

    jaxpr: Jaxpr
    consts: tuple[Any, ...]
    num_params: int
    # With has_aux: the treedef of loss_fn's aux output, whose leaves are outvars 1, 2, ...
    aux_treedef: Any = None


#: Per aux leaf whether it holds per-example rows, or a function of the aux leaves' shapes for
#: one microbatch returning that (``partition``'s ``aux_rows``).
AuxRows = Sequence[bool] | Callable[[list[tuple[int, ...]]], Sequence[bool]]


def partition(
    loss_fn: Callable[..., Any],
    params: Any,
    microbatch: Any,
    *,
    num_stages: int | None = None,
    key: Any = None,
    assign: Callable[[ClosedJaxpr, int], Sequence[int]] | None = None,
    has_aux: bool = False,
    tensor_axis: str | None = None,
    cut: tuple[int, tuple[int, ...]] | None = None,
    aux_rows: AuxRows | None = None,
) -> StageGraph:
    """Returns the stage graph of ``loss_fn(params, microbatch)`` cut at markers or by cost.

    ``params`` and ``microbatch`` (ONE microbatch of the batch) may hold arrays or
    ``jax.ShapeDtypeStruct``s. With markers, ``num_stages`` (optional) must equal the marker
    count + 1. Without markers, ``num_stages`` stages are balanced by the cost model (one stage
    when it is None). With ``key`` (a PRNG key or its ShapeDtypeStruct), ``loss_fn`` is called
    as ``loss_fn(params, microbatch, key)`` and the graph's batch pytree is
    ``(microbatch, key)``: the key is a batch leaf, one per microbatch (see
    ``zbjax.microbatch.microbatch_keys``). With ``assign``, the callable picks every
    equation's stage (module docstring) and ``num_stages``, when given, must match its count.
    With ``has_aux``, ``loss_fn`` returns ``(loss, aux)`` as for ``jax.value_and_grad(...,
    has_aux=True)``; the aux leaves (arrays; floating but for ``aux_rows``) are outputs of
    the loss stage, carried to it from the stages that compute them, and ``graph.aux_treedef``
    rebuilds the pytree.
    ``tensor_axis`` (the pipeline's ``param_specs`` axis) is a mesh axis over which sharding
    annotations in ``loss_fn`` draw no warning: the pipeline splits the stages over it.
    ``cut`` (a graph's ``cut``, from another batch shape) makes a cost-balanced cut start its
    stages at the same pieces of work when the program has as many as then, so another batch
    shape keeps the stages (and the staged params layout); the graph records its ``cut``.
    ``aux_rows`` (per aux leaf, ``microbatch.aux_rows``; or a function of the aux leaves'
    shapes for one microbatch that returns them) marks the aux leaves of per-example rows,
    which are joined over microbatches, not averaged, and so may be integers or bools
    (``StageGraph.aux_rows``); the others must be floating.
    """
    if not callable(loss_fn):
        raise PartitionError(
            f"partition takes loss_fn(params, microbatch) -> loss first, not "
            f"{type(loss_fn).__name__} {loss_fn!r:.40}"
        )
    if num_stages is not None:
        num_stages = whole_count("num_stages", num_stages, PartitionError)
    if key is not None:
        check_key(leaf_aval(key))
    if assign is not None and not callable(assign):
        raise PartitionError(
            f"assign={assign!r}; pass a function (program, num_params) -> stage of each "
            "equation, or None"
        )
    batch = microbatch if key is None else (microbatch, key)
    param_avals, params_treedef = flat_avals(params, "params")
    batch_avals, batch_treedef = flat_avals(batch, "microbatch")
    program = _traced(
        loss_fn, params_treedef, batch_treedef, param_avals, batch_avals, key, has_aux, tensor_axis
    )
    rows = _checked_aux_rows(program, aux_rows) if has_aux else ()
    with no_mesh_context():  # the stage programs must not record the caller's mesh
        graph = _partition(
            program,
            num_stages,
            assign,
            params_treedef,
            batch_treedef,
            param_avals,
            batch_avals,
            cut,
        )
    return dataclasses.replace(graph, aux_rows=rows) if rows else graph


def _checked_aux_rows(program: _Program, aux_rows: AuxRows | None) -> tuple[bool, ...]:
    """Returns ``aux_rows`` (default: none; a callable gets the aux leaves' shapes for this
    microbatch) for the program's aux leaves; raises PartitionError naming an aux leaf that is
    averaged (not rows) and not floating."""
    avals = [v.aval for v in program.jaxpr.outvars[1:]]
    if callable(aux_rows):
        aux_rows = aux_rows([tuple(a.shape) for a in avals])
    paths = [
        jax.tree_util.keystr(path)
        for path, _ in jax.tree_util.tree_leaves_with_path(
            jax.tree_util.tree_unflatten(program.aux_treedef, avals)
        )
    ]
    rows = (False,) * len(avals) if aux_rows is None else tuple(bool(r) for r in aux_rows)
    if len(rows) != len(avals):
        raise PartitionError(
            f"aux_rows has {len(rows)} entries but loss_fn's aux has {len(avals)} leaves; give "
            "one per aux leaf"
        )
    check_aux_leaves(
        (
            (path, a.dtype, a.shape)
            for path, a, joined in zip(paths, avals, rows, strict=True)
            if not joined
        ),
        PartitionError,
    )
    return rows


def _partition(
    program: _Program,
    num_stages: int | None,
    assign: Callable[[ClosedJaxpr, int], Sequence[int]] | None,
    params_treedef: Any,
    batch_treedef: Any,
    param_avals: Sequence[jax.ShapeDtypeStruct],
    batch_avals: Sequence[jax.ShapeDtypeStruct],
    cut: tuple[int, tuple[int, ...]] | None = None,
) -> StageGraph:
    eqns = list(program.jaxpr.eqns)
    markers = [i for i, eqn in enumerate(eqns) if is_stage_boundary(eqn)]
    if assign is not None:
        closed = ClosedJaxpr(program.jaxpr, list(program.consts))
        eqn_stages = _check_assigned(program, assign(closed, program.num_params), num_stages)
        names = [f"stage {s}" for s in range(max(eqn_stages) + 1)]
        return _build_graph(
            program, eqn_stages, names, params_treedef, batch_treedef, param_avals, batch_avals
        )
    if markers:
        if num_stages is not None and num_stages != len(markers) + 1:
            raise PartitionError(
                f"loss_fn has {len(markers)} stage_boundary markers, which make "
                f"{len(markers) + 1} stages, but num_stages={num_stages}; pass "
                f"num_stages={len(markers) + 1} (or None), or add/remove markers"
            )
        explicit = {i: rank + 1 for rank, i in enumerate(markers)}
        count = len(markers) + 1
    else:
        count = 1 if num_stages is None else num_stages
        # One stage needs no cut: every equation lands in stage 0 as a free equation.
        if count > 1:
            program, explicit, cut = _auto_cut(program, count, cut)
        else:
            explicit, cut = {}, None
    eqn_stages = _assign_stages(program, explicit, count)
    # Each stage's equations, those on params or on no input alone moved to the stages that
    # read them (a marker on such a value, jnp.arange(d) / d, left its stage without work).
    members = _recompute_param_values(program, eqn_stages, count)
    if markers:
        _warn_idle_stages(program.jaxpr.eqns, markers, members)
    names = [f"stage {s}" for s in range(count)]
    for i, s in explicit.items():
        label = program.jaxpr.eqns[i].params.get("name") if markers else None
        if label:
            names[s] = f"stage {s} ({label})"
    graph = _build_graph(
        program,
        eqn_stages,
        names,
        params_treedef,
        batch_treedef,
        param_avals,
        batch_avals,
        members,
    )
    return graph if markers or cut is None else dataclasses.replace(graph, cut=cut)


def _warn_idle_stages(
    eqns: Sequence[Any], markers: Sequence[int], members: Sequence[set[int]]
) -> None:
    """Warns when markers make a stage with no work of its own (no equation but its marker;
    ``members``: each stage's equations): its device only passes values on. Names the markers
    that start such stages."""
    idle = [s for s, these in enumerate(members) if all(is_stage_boundary(eqns[i]) for i in these)]
    if not idle:
        return
    where = [
        f"stage {s} ({'before the first marker, at' if s == 0 else 'from the marker at'} "
        f"{user_line(eqns[markers[max(s - 1, 0)]]) or 'an unknown line'})"
        for s in idle
    ]
    warnings.warn(
        f"the zbjax.stage_boundary markers make {'stages' if len(idle) > 1 else 'a stage'} "
        f"without work of {'their' if len(idle) > 1 else 'its'} own: {'; '.join(where)}; "
        "such a stage does no work (at most it passes values on) while its device idles. An "
        "equation runs in the latest stage of its inputs, so work that reads only the batch "
        "and params (a second tower) stays in stage 0 however late it is written, and a "
        "marker on a batch input starts a stage before any work; mark the activation each "
        "stage's work starts from, or remove the marker",
        stacklevel=caller_stacklevel(),
    )


def stage_summary(graph: StageGraph) -> str:
    """Returns one line per stage: name, params read, forward cost and edges in and out."""
    if not isinstance(graph, StageGraph):
        raise PartitionError(
            f"stage_summary takes a StageGraph (zbjax.partition(...), or pipe.graph after a "
            f"call), not a {type(graph).__name__}"
        )
    lines = []
    total = sum(s.cost for s in graph.stages) or 1.0
    for stage in graph.stages:
        count = sum(math.prod(a.shape) for a in stage.jaxpr.in_avals[: len(stage.param_leaves)])
        ins = ", ".join(
            f"{graph.edges[e].src}->{stage.index} ({len(graph.edges[e].values)} values)"
            for e in stage.in_edges
        )
        outs = ", ".join(
            f"{stage.index}->{graph.edges[e].dst} ({len(graph.edges[e].values)} values)"
            for e in stage.out_edges
        )
        loss = " [loss]" if stage.index == graph.loss_stage else ""
        lines.append(
            f"{stage.name}{loss}: {len(stage.param_leaves)} param leaves ({count:,} params), "
            f"cost {stage.cost:.3g} ({100 * stage.cost / total:.1f}%), "
            f"in: {ins or '-'}; out: {outs or '-'}"
        )
    return "\n".join(lines)


# ----------------------------------------------------------------------------- tracing


def flat_avals(
    tree: Any, what: str, error: type[Exception] = PartitionError
) -> tuple[tuple[jax.ShapeDtypeStruct, ...], Any]:
    """Returns (each leaf's aval, the tree structure); raises ``error`` naming a leaf (of
    ``what``: params, batch, key) that JAX cannot take as an array (a string, an object)."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
    avals = []

    def named(path: Any) -> str:  # only for an error: keystr is slow over many leaves
        return f"{what} leaf {jax.tree_util.keystr(path) or '(the ' + what + ' itself)'}"

    for path, x in leaves:
        try:
            avals.append(leaf_aval(x))
        except TypeError:
            shown = repr(x) if len(repr(x)) <= 40 else repr(x)[:37] + "..."
            raise error(
                f"{named(path)} is a {type(x).__name__} ({shown}), which is not an array: JAX "
                f"traces arrays and numbers only; take it out of the {what} (close over it in "
                "loss_fn or bind it with functools.partial), or make it an array"
            ) from None
        if not all(isinstance(d, int | np.integer) for d in avals[-1].shape):
            raise error(
                f"{named(path)} has shape {avals[-1].shape}, with a symbolic dimension "
                "(jax.export's symbolic_shape): a pipeline's stages, schedule and buffers are "
                "built for concrete shapes; export with concrete shapes, one per batch size"
            )
    return tuple(avals), treedef


def leaf_aval(x: Any) -> jax.ShapeDtypeStruct:
    """The shape and dtype ``jax.jit`` traces ``x`` with: a Python scalar or a NumPy array
    takes JAX's canonical dtype (float32 for a Python float or a float64 array, without x64),
    and a Python scalar stays weakly typed (``bf16_array * p["scale"]`` stays bfloat16)."""
    if isinstance(x, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, weak_type=x.weak_type)
    dtype = x.dtype if isinstance(x, jax.Array) else jnp.result_type(x)
    return jax.ShapeDtypeStruct(np.shape(x), dtype, weak_type=jax.typeof(x).weak_type)


def _traced(
    loss_fn: Callable[..., Any],
    params_treedef: Any,
    batch_treedef: Any,
    param_avals: Sequence[jax.ShapeDtypeStruct],
    batch_avals: Sequence[jax.ShapeDtypeStruct],
    key: Any,
    has_aux: bool = False,
    tensor_axis: str | None = None,
) -> _Program:
    """Returns ``_trace``'s program, traced once per (loss_fn, shapes) for repeated cuts.

    The pipeline first asks whether the program has markers and then cuts it (by cost or by
    GraphPipe); both calls read the same trace. The traced program is never mutated.
    """
    args = (loss_fn, params_treedef, batch_treedef, tuple(param_avals), tuple(batch_avals))
    cache_key = (*args, key is not None, has_aux, tensor_axis, tracing_config())
    try:
        program = _TRACES.pop(cache_key, None)
    except TypeError:  # an unhashable loss_fn: trace without the cache
        return _trace(*args, key, has_aux, tensor_axis)
    if program is None:
        program = _trace(*args, key, has_aux, tensor_axis)
        if closes_over_tracers(program.consts):  # valid in the enclosing trace only
            return program
    _TRACES[cache_key] = program  # the most recently used last
    while len(_TRACES) > _TRACES_KEPT:
        _TRACES.popitem(last=False)
    return program


#: Recent traces by (loss_fn, shapes, settings); the oldest go first.
_TRACES: collections.OrderedDict[tuple, _Program] = collections.OrderedDict()
_TRACES_KEPT = 4


def _trace(
    loss_fn: Callable[..., Any],
    params_treedef: Any,
    batch_treedef: Any,
    param_avals: Sequence[jax.ShapeDtypeStruct],
    batch_avals: Sequence[jax.ShapeDtypeStruct],
    key: Any,
    has_aux: bool = False,
    tensor_axis: str | None = None,
) -> _Program:
    _check_arity(loss_fn, key is not None)
    num_params = len(param_avals)
    aux: list = []  # with has_aux: (treedef, key paths) of the aux pytree, set while tracing

    def flat_loss(*leaves: Any) -> Any:
        params = jax.tree_util.tree_unflatten(params_treedef, leaves[:num_params])
        batch = jax.tree_util.tree_unflatten(batch_treedef, leaves[num_params:])
        if key is None:
            out = loss_fn(params, batch)
        else:
            microbatch, microbatch_key = batch
            out = loss_fn(params, microbatch, microbatch_key)
        if not has_aux:
            check_loss_leaf(out, "loss_fn returns", PartitionError)
            return out
        check_aux_pair(out, PartitionError)
        check_loss_leaf(out[0], "the loss in loss_fn's (loss, aux) is", PartitionError)
        with_paths, treedef = jax.tree_util.tree_flatten_with_path(out[1])
        for path, leaf in with_paths:
            if not isinstance(leaf, jax.Array | np.ndarray | np.generic | float | int | complex):
                raise PartitionError(
                    f"aux leaf {jax.tree_util.keystr(path) or '(the aux itself)'} is a "
                    f"{type(leaf).__name__} ({leaf!r:.40}), not an array: aux holds arrays "
                    "(metrics the pipeline averages over microbatches); keep other values "
                    "(labels, flags) outside loss_fn"
                )
        aux.append((treedef, [jax.tree_util.keystr(path) for path, _ in with_paths]))
        return [out[0], *(leaf for _, leaf in with_paths)]

    try:
        closed = jax.make_jaxpr(flat_loss)(*param_avals, *batch_avals)
    except NameError as error:
        if "unbound axis name" not in str(error):
            raise
        raise PartitionError(
            f"loss_fn calls a collective over a named axis ({error.args[0].split('.')[0]}): "
            "loss_fn is traced as an ordinary function of one microbatch, outside any "
            "shard_map, as jax.value_and_grad would call it. Leave the collectives out (the "
            "pipeline already averages the loss and gradients over the microbatches and the "
            "data-parallel axes); return the loss of the microbatch it is given"
        ) from None
    closed, annotations = strip_sharding_annotations(closed)
    _warn_model_sharding(annotations, batch_avals, tensor_axis)
    out_avals = closed.out_avals
    loss_avals = out_avals[:1] if has_aux else out_avals
    if (
        len(loss_avals) != 1
        or loss_avals[0].shape != ()
        or not jnp.issubdtype(loss_avals[0].dtype, jnp.floating)
    ):
        got = ", ".join(f"{a.dtype}{list(a.shape)}" for a in loss_avals) or "nothing"
        raise PartitionError(
            f"loss_fn must return one floating-point scalar; got {got}; return the loss alone "
            "as a float scalar (e.g. the mean loss over the batch), or return (loss, aux) "
            "with metrics in aux and pass has_aux=True"
        )
    refuse_ordered_effects(closed.jaxpr, "loss_fn")
    with no_mesh_context():
        flat = _inline_calls(closed)
    live = dce_closed_jaxpr(flat, [True] * len(flat.jaxpr.outvars)).jaxpr
    _warn_unused_markers(_marker_lines(closed.jaxpr), _marker_lines(live))
    return _Program(live, tuple(flat.consts), num_params, aux[0][0] if has_aux else None)


def refuse_ordered_effects(jaxpr: Jaxpr, what: str) -> None:
    """Raises PartitionError when ``jaxpr`` (``what``: the loss, or a stage's backward, where a
    custom_vjp rule's bwd is traced) has ordered effects, which JAX runs on one device only."""
    ordered = ordered_effect_names(jaxpr)
    if ordered:
        raise PartitionError(
            f"{what} has ordered effects ({', '.join(ordered)}): jax.debug.print(..., "
            "ordered=True) or io_callback(..., ordered=True), which JAX runs on one device "
            "only, while a pipelined step runs on every device of the pipeline axis; pass "
            "ordered=False (a pipelined print then comes from each device and microbatch)"
        )


def _marker_lines(jaxpr: Jaxpr) -> list[str]:
    """Where the user's code called each stage_boundary of ``jaxpr`` (those in called
    functions once per call; "" where the traceback does not say)."""
    lines = []
    for eqn in jaxpr.eqns:
        if is_stage_boundary(eqn):
            lines.append(user_line(eqn))
        for sub in _sub_jaxprs(eqn):
            lines.extend(_marker_lines(sub))
    return lines


def _warn_unused_markers(called: list[str], used: list[str]) -> None:
    """Warns when markers were dropped as dead code: a marker cuts where its output is read,
    so one whose output nothing reads makes no stage (and the counts in later messages would
    not match the calls in the user's code). Names the unused calls' lines."""
    if len(used) < len(called):
        unused = collections.Counter(called) - collections.Counter(used)
        where = ", ".join(sorted(line for line in unused.elements() if line))
        warnings.warn(
            f"loss_fn calls zbjax.stage_boundary {len(called)} times, but the outputs of "
            f"{len(called) - len(used)} of them are never used"
            + (f" ({where})" if where else "")
            + f", so those make no cut ({len(used)} marker{'' if len(used) == 1 else 's'}, "
            f"{len(used) + 1} stages): a "
            "marker cuts where its output is read. Use each marker's output in place of its "
            "input (x = zbjax.stage_boundary(x)), or remove the unused ones",
            stacklevel=caller_stacklevel(),
        )


def _check_arity(loss_fn: Callable[..., Any], with_key: bool) -> None:
    """Raises PartitionError when ``loss_fn`` cannot take the arguments the pipeline passes:
    (params, microbatch), and the microbatch's key when the step was given one."""
    try:
        signature = inspect.signature(loss_fn)
    except (TypeError, ValueError):  # a callable Python cannot inspect: let the call tell
        return
    args = ("params", "batch", "key") if with_key else ("params", "batch")
    try:
        signature.bind(*args)
    except TypeError:
        if with_key:
            keyword_only = any(
                p.kind is inspect.Parameter.KEYWORD_ONLY for p in signature.parameters.values()
            )
            raise PartitionError(
                f"the pipeline got key=, so loss_fn is called as loss_fn(params, "
                f"microbatch, key_i), but loss_fn{signature} does not take a third "
                "positional argument; give loss_fn a key parameter"
                + (" that is positional (not after *)" if keyword_only else "")
                + ", or call without key"
            ) from None
        try:
            signature.bind("params")
        except TypeError:
            pass
        else:
            raise PartitionError(
                f"loss_fn{signature} is called as loss_fn(params, microbatch), but it takes "
                "no second positional argument; give it a batch parameter (the pipeline "
                "splits the batch into microbatches)"
            ) from None
        raise PartitionError(
            f"loss_fn{signature} is called as loss_fn(params, microbatch), but it needs "
            "other arguments; if it takes a PRNG key, pass a key to every pipeline call that "
            "takes a batch: value_and_grad, value, stage, lower, init_buffers, profile (microbatch "
            "i gets jax.random.fold_in(key, i)), or bind extra arguments with "
            "functools.partial"
        ) from None


def _warn_model_sharding(
    annotations: Sequence[tuple[Any, tuple[int, ...]]],
    batch_avals: Sequence[Any],
    tensor_axis: str | None = None,
) -> None:
    """Warns when ``loss_fn`` shards values other than by their batch rows (tensor or fully
    sharded data parallelism) over an axis other than ``tensor_axis``: the pipeline drops its
    sharding annotations, and the mesh axes other than the pipeline and tensor axes split
    every microbatch's rows instead."""
    rows = {a.shape[0] for a in batch_avals if len(a.shape)}
    axes = sorted(
        {
            name
            for sharding, shape in annotations
            for dim, name in sharded_axes(sharding)
            if (dim > 0 or not shape or shape[0] not in rows) and name != tensor_axis
        }
    )
    if axes:
        warnings.warn(
            f"loss_fn shards model dimensions over mesh axes {tuple(axes)} "
            "(with_sharding_constraint, reshard or out_sharding); zbjax drops these "
            "annotations, which changes no value: inside the pipeline every mesh axis but the "
            "pipeline axis (and the param_specs tensor axis) is data parallel, splitting each "
            "microbatch's rows. For tensor parallelism inside each stage, pass "
            "zbjax.pipeline(..., param_specs=...) with a PartitionSpec per param leaf. Remove "
            "the annotations, or build the mesh without those axes, to silence this warning",
            stacklevel=caller_stacklevel(),
        )


def caller_stacklevel() -> int:
    """Returns the ``stacklevel`` of the innermost frame outside zbjax (and JAX's tracing)
    that led here, so that a warning names the user's line."""
    package = os.path.dirname(os.path.abspath(__file__))
    jax_dir = os.path.dirname(os.path.abspath(jax.__file__))
    frame, level = sys._getframe(1), 1
    while frame is not None:
        name = os.path.abspath(frame.f_code.co_filename)
        if not name.startswith((package, jax_dir)):
            return level
        frame, level = frame.f_back, level + 1
    return 1


def _read(env: dict[Var, Any], atom: Any) -> Any:
    return atom.val if isinstance(atom, Literal) else env[atom]


def _contains_marker(jaxpr: Jaxpr) -> bool:
    for eqn in jaxpr.eqns:
        if is_stage_boundary(eqn):
            return True
        if any(_contains_marker(sub) for sub in _sub_jaxprs(eqn)):
            return True
    return False


def _sub_jaxprs(eqn: Any) -> list[Jaxpr]:
    return [j.jaxpr if isinstance(j, ClosedJaxpr) else j for j in jaxprs_in_params(eqn.params)]


def _inline_body(eqn: Any) -> tuple[Jaxpr, Sequence[Any]] | None:
    """Returns (body, consts) of a call wrapper that is inlined, None for other equations."""
    name = eqn.primitive.name
    if name in _INLINE_ALWAYS or name in _INLINE_IF_MARKED:
        body = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
        if body is None:
            return None
        closed = body if isinstance(body, ClosedJaxpr) else ClosedJaxpr(body, ())
        if name in _INLINE_ALWAYS or _contains_marker(closed.jaxpr):
            return closed.jaxpr, closed.consts
        return None
    marked = [line for sub in _sub_jaxprs(eqn) for line in _marker_lines(sub)]
    if marked:
        line = marked[0] or user_line(eqn)  # the marker's, else the control flow's
        at = f" (at {line})" if line else ""
        where = {
            "cond": "a lax.cond/switch branch",
            "while": "a lax.while_loop/fori_loop body",
            "scan": "a lax.scan body (e.g. Flax nn.scan, or a fori_loop of fixed length)",
        }.get(name, f"the body of a {name!r} equation")
        if name.startswith(("custom_vjp_call", "custom_jvp_call")):
            kind = "jvp" if name == "custom_jvp_call" else "vjp"
            raise PartitionError(
                f"a stage_boundary marker{at} sits inside a jax.custom_{kind} function; its "
                "differentiation rule covers the whole function, so a pipeline cannot cut it "
                "into stages (differentiating its body instead would ignore the rule). Put "
                "the stage_boundary outside the function, or give each stage's part a "
                "custom rule of its own"
            )
        raise PartitionError(
            f"a stage_boundary marker{at} sits inside {where}; a pipeline cannot cut inside "
            "control flow. Move the stage_boundary outside the control flow (e.g. between "
            "two loops, or unroll the loop), or remove the markers and pass num_stages to "
            "cut automatically (scans over layers are split by iteration)"
        )
    return None


def _eval_inlined(jaxpr: Jaxpr, consts: Sequence[Any], args: Sequence[Any]) -> list[Any]:
    env: dict[Var, Any] = dict(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))
    for eqn in jaxpr.eqns:
        invals = [_read(env, a) for a in eqn.invars]
        body = _inline_body(eqn)
        if body is not None and eqn.primitive.name in _INLINE_IF_MARKED:
            outs = _eval_checkpoint_cut(eqn, body[0], body[1], invals)
        elif body is not None:
            outs = _eval_inlined(body[0], body[1], invals)
        else:
            with eqn.ctx.manager:
                outs = bind_equation(eqn, invals)
        env.update(zip(eqn.outvars, outs, strict=True))
    return [_read(env, a) for a in jaxpr.outvars]


def _inline_calls(closed: ClosedJaxpr) -> ClosedJaxpr:
    """Returns ``closed`` retraced with its call wrappers inlined (recursively)."""
    avals = [jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type) for a in closed.in_avals]
    return jax.make_jaxpr(lambda *args: _eval_inlined(closed.jaxpr, closed.consts, args))(*avals)


def _eval_checkpoint_cut(
    eqn: Any, body: Jaxpr, consts: Sequence[Any], invals: Sequence[Any]
) -> list[Any]:
    """Evaluates a ``jax.checkpoint`` (``nn.remat``) region whose body holds markers as one
    checkpoint, with the region's policy, per piece between its markers, the markers between
    them: each stage then rematerialises its part of the region as the user asked (inlined
    whole, every stage would store all of its part's activations)."""
    avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in body.invars]
    flat = jax.make_jaxpr(lambda *args: _eval_inlined(body, consts, args))(*avals)
    jaxpr, eqns = flat.jaxpr, flat.jaxpr.eqns
    env: dict[Var, Any] = dict(zip(jaxpr.constvars, flat.consts, strict=True))
    env.update(zip(jaxpr.invars, invals, strict=True))
    cuts = [i for i, e in enumerate(eqns) if is_stage_boundary(e)]
    remat = functools.partial(
        jax.checkpoint,
        prevent_cse=eqn.params.get("prevent_cse", True),
        policy=eqn.params.get("policy"),
    )
    for lo, hi in zip([0, *(c + 1 for c in cuts)], [*cuts, len(eqns)], strict=True):
        piece = eqns[lo:hi]
        defined = {v for e in piece for v in e.outvars}
        ins = list(
            dict.fromkeys(
                v for e in piece for v in e.invars if isinstance(v, Var) and v not in defined
            )
        )
        read_later = {v for e in eqns[hi:] for v in e.invars if isinstance(v, Var)}
        read_later |= {v for v in jaxpr.outvars if isinstance(v, Var)}
        outs = [v for e in piece for v in e.outvars if v in read_later]

        def run(*values: Any, piece: Sequence[Any] = piece, ins=ins, outs=outs) -> list[Any]:
            local = dict(zip(ins, values, strict=True))
            for e in piece:
                with e.ctx.manager:
                    local.update(
                        zip(
                            e.outvars,
                            bind_equation(e, [_read(local, a) for a in e.invars]),
                            strict=True,
                        )
                    )
            return [local[v] for v in outs]

        if piece:
            with equation_source(eqn):  # each piece's checkpoint keeps the region's line
                env.update(zip(outs, remat(run)(*(env[v] for v in ins)), strict=True))
        if hi < len(eqns):  # the marker, outside every checkpoint
            marker = eqns[hi]
            with marker.ctx.manager:
                values = bind_equation(marker, [_read(env, a) for a in marker.invars])
            env.update(zip(marker.outvars, values, strict=True))
    return [_read(env, a) for a in jaxpr.outvars]


# ----------------------------------------------------------------------------- stages


def _assign_stages(program: _Program, explicit: dict[int, int], count: int) -> list[int]:
    """Returns the stage of every equation (see the module docstring for the rules)."""
    eqns = program.jaxpr.eqns
    var_stage: dict[Var, int] = {}
    eqn_stage: list[int | None] = [None] * len(eqns)
    for i, eqn in enumerate(eqns):
        staged = [var_stage[v] for v in eqn.invars if isinstance(v, Var) and v in var_stage]
        if i in explicit:
            stage = explicit[i]
        elif staged:
            stage = max(staged)
        else:
            continue  # free: placed below by its readers
        eqn_stage[i] = stage
        var_stage.update((v, stage) for v in eqn.outvars)
    last = count - 1
    read_at: dict[Var, int] = {v: last for v in program.jaxpr.outvars if isinstance(v, Var)}
    for i in reversed(range(len(eqns))):
        eqn = eqns[i]
        if eqn_stage[i] is None:
            eqn_stage[i] = min((read_at[v] for v in eqn.outvars if v in read_at), default=last)
        if is_stage_boundary(eqn):
            staged = [var_stage[v] for v in eqn.invars if isinstance(v, Var) and v in var_stage]
            reader = max(staged, default=0)
        else:
            reader = eqn_stage[i]
        for v in eqn.invars:
            if isinstance(v, Var) and v not in var_stage:
                read_at[v] = min(read_at.get(v, last), reader)
    if program.aux_treedef is not None:
        _compute_aux_where_its_inputs_are(program, eqn_stage)
    return [int(s) for s in eqn_stage]  # type: ignore[arg-type]


def _compute_aux_where_its_inputs_are(program: _Program, eqn_stage: list) -> None:
    """Moves each equation that only feeds aux outputs (not the loss) and reads no param to
    the stage of its latest input, in place: a metric of an early activation (a norm, a mean)
    is then computed where that activation is and sent on as the metric, not computed in the
    last stage with the activation sent there. Moving an equation earlier, but not before its
    inputs, keeps every value flowing forward."""
    jaxpr = program.jaxpr
    eqns = jaxpr.eqns
    params = set(jaxpr.invars[: program.num_params])
    needed = {v for v in jaxpr.outvars[:1] if isinstance(v, Var)}
    feeds_loss = [False] * len(eqns)
    for i in reversed(range(len(eqns))):
        if any(v in needed for v in eqns[i].outvars):
            feeds_loss[i] = True
            needed.update(v for v in eqns[i].invars if isinstance(v, Var))
    produced: dict[Var, int] = {}
    for i, eqn in enumerate(eqns):
        inputs = [v for v in eqn.invars if isinstance(v, Var)]
        if not feeds_loss[i] and not is_stage_boundary(eqn) and not params.intersection(inputs):
            eqn_stage[i] = min(eqn_stage[i], max((produced.get(v, 0) for v in inputs), default=0))
        produced.update((v, eqn_stage[i]) for v in eqn.outvars)


def _check_assigned(
    program: _Program, assigned: Sequence[int], num_stages: int | None
) -> list[int]:
    """Returns ``assigned`` as ints after checking it is a valid stage per equation."""
    eqns = program.jaxpr.eqns
    stages = [int(s) for s in assigned]
    if len(stages) != len(eqns):
        raise PartitionError(
            f"assign returned {len(stages)} stages but the program has {len(eqns)} equations; "
            "return one stage per equation of the program it receives"
        )
    if not stages:
        raise PartitionError("the program has no equations; there is nothing to assign")
    count = max(stages) + 1
    missing = sorted(set(range(count)) - set(stages))
    if min(stages) < 0 or missing:
        raise PartitionError(
            f"assign used stages {sorted(set(stages))}; number the stages 0..k-1 with no gaps "
            f"and no negatives (missing {missing})"
        )
    if num_stages is not None and num_stages != count:
        raise PartitionError(
            f"assign made {count} stages but num_stages={num_stages}; pass num_stages=None "
            f"or {count}"
        )
    defined_at: dict[Var, int] = {}
    for i, eqn in enumerate(eqns):
        for v in eqn.invars:
            if isinstance(v, Var) and defined_at.get(v, -1) > stages[i]:
                raise PartitionError(
                    f"assign puts equation {i} ({eqn.primitive.name}) in stage {stages[i]} but "
                    f"it reads a value computed in stage {defined_at[v]}; a value may only "
                    "flow to its own or a later stage (number the stages topologically)"
                )
        defined_at.update((v, stages[i]) for v in eqn.outvars)
    loss = program.jaxpr.outvars[0]
    if isinstance(loss, Var) and defined_at.get(loss, count - 1) != count - 1:
        raise PartitionError(
            f"assign computes the loss in stage {defined_at[loss]}, not in the last stage "
            f"{count - 1}; every other stage must feed the loss, so number its stage last"
        )
    return stages


def _aval_struct(atom: Any) -> jax.ShapeDtypeStruct:
    aval = atom.aval
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=aval.weak_type)


def _build_graph(
    program: _Program,
    eqn_stages: Sequence[int],
    names: Sequence[str],
    params_treedef: Any,
    batch_treedef: Any,
    param_avals: tuple[jax.ShapeDtypeStruct, ...],
    batch_avals: tuple[jax.ShapeDtypeStruct, ...],
    members: list[set[int]] | None = None,
) -> StageGraph:
    """Returns the stage graph of ``program`` cut as ``eqn_stages`` says; ``members`` are
    ``_recompute_param_values``'s, where the caller has them already."""
    jaxpr = program.jaxpr
    eqns = jaxpr.eqns
    count = len(names)
    param_index = {v: i for i, v in enumerate(jaxpr.invars[: program.num_params])}
    batch_index = {v: i for i, v in enumerate(jaxpr.invars[program.num_params :])}
    const_value = dict(zip(jaxpr.constvars, program.consts, strict=True))
    home: dict[Var, tuple[int, int]] = {}  # value -> (stage, definition order)
    for i, eqn in enumerate(eqns):
        for v in eqn.outvars:
            home[v] = (eqn_stages[i], len(home))
    if members is None:
        members = _recompute_param_values(program, eqn_stages, count)
    stage_eqns: list[list[Any]] = [[eqns[i] for i in sorted(m)] for m in members]
    reads: list[list[Any]] = [[a for e in stage_eqns[s] for a in e.invars] for s in range(count)]
    computed = [{v for e in stage_eqns[s] for v in e.outvars} for s in range(count)]
    loss, aux = jaxpr.outvars[0], list(jaxpr.outvars[1:])
    reads[count - 1].extend([loss, *aux])
    # Values the loss depends on differentiably: only these carry cotangents between stages.
    # One that reaches aux alone, or the loss only through stop_gradient or an integer or
    # boolean value (a comparison), gets none, as JAX gives it a symbolic zero (it got a zero,
    # which a backward with an infinite derivative there, a norm at 0, turned into NaN).
    to_loss = {loss} if isinstance(loss, Var) else set()
    for eqn in reversed(eqns):
        if eqn.primitive.name == "stop_gradient":
            continue
        reaches = [v in to_loss and has_cotangent(v.aval.dtype) for v in eqn.outvars]
        if is_stage_boundary(eqn):  # the identity on each operand: operand i gives result i
            pairs = zip(eqn.invars, reaches, strict=True)
            to_loss.update(a for a, r in pairs if r and isinstance(a, Var))
        elif any(reaches):
            to_loss.update(a for a in eqn.invars if isinstance(a, Var))

    def differentiable(v: Var) -> bool:
        return has_cotangent(v.aval.dtype) and v in to_loss

    params_read: list[list[int]] = []
    batch_read: list[list[int]] = []
    received: dict[tuple[int, int], list[Var]] = {}
    for stage, atoms in enumerate(reads):
        vars_read = {a for a in atoms if isinstance(a, Var)}
        params_read.append(sorted(param_index[v] for v in vars_read if v in param_index))
        batch_read.append(sorted(batch_index[v] for v in vars_read if v in batch_index))
        for v in sorted((v for v in vars_read if v in home), key=lambda v: home[v][1]):
            src = home[v][0]
            if src != stage and v not in computed[stage]:
                received.setdefault((src, stage), []).append(v)
    pairs = sorted(received)
    edges = tuple(
        Edge(src, dst, tuple(key_data_aval(v.aval) for v in received[(src, dst)]))
        for src, dst in pairs
    )
    stages = []
    for s in range(count):
        in_edges = tuple(e for e, (_, dst) in enumerate(pairs) if dst == s)
        out_edges = tuple(e for e, (src, _) in enumerate(pairs) if src == s)
        inputs = [v for e in in_edges for v in received[pairs[e]]]
        outputs = [v for e in out_edges for v in received[pairs[e]]]
        if s == count - 1:
            outputs = [loss, *aux]
        param_vars = [jaxpr.invars[i] for i in params_read[s]]
        rows, param_inputs, dropped, added = _row_sliced_params(stage_eqns[s], param_vars, outputs)
        invars = (
            param_inputs + [jaxpr.invars[program.num_params + i] for i in batch_read[s]] + inputs
        )
        body = added + [eqn for eqn in stage_eqns[s] if not any(eqn is e for e in dropped)]
        closed = _stage_jaxpr(body, invars, outputs, const_value)
        # A typed PRNG key crossing stages travels as its key data (messages hold numbers).
        received_at = range(len(invars) - len(inputs), len(invars))
        closed = keys_as_data(closed, received_at, range(len(outputs) if s < count - 1 else 0))
        stages.append(
            Stage(
                index=s,
                name=names[s],
                jaxpr=closed,
                param_leaves=tuple(params_read[s]),
                param_rows=rows,
                batch_leaves=tuple(batch_read[s]),
                in_edges=in_edges,
                out_edges=out_edges,
                input_differentiable=tuple(differentiable(v) for v in inputs),
                # The loss stage differentiates the loss alone, not its aux outputs.
                output_differentiable=(
                    (True,) + (False,) * len(aux)
                    if s == count - 1
                    else tuple(differentiable(v) for v in outputs)
                ),
                cost=cost_model.jaxpr_cost(closed),
            )
        )
    return StageGraph(
        stages=tuple(stages),
        edges=edges,
        loss_stage=count - 1,
        params_treedef=params_treedef,
        batch_treedef=batch_treedef,
        param_avals=param_avals,
        batch_avals=batch_avals,
        aux_treedef=program.aux_treedef,
    )


def _recompute_param_values(
    program: _Program, eqn_stages: Sequence[int], count: int
) -> list[set[int]]:
    """Returns per stage the indices of the equations it runs: its own (``eqn_stages``), plus
    those that compute from params alone or from no input at all (a cast, a transpose, a
    scaled copy; a causal mask built from ``iota``s; no batch value, no activation, no effect)
    whose values it reads, recomputed there rather than sent from the stage they were assigned
    to every microbatch (their params are then held by each such stage, as a tied leaf is);
    such an equation is dropped from a stage that no longer reads its values."""
    jaxpr = program.jaxpr
    eqns = jaxpr.eqns
    params = set(jaxpr.invars[: program.num_params])
    consts = set(jaxpr.constvars)
    made_by: dict[Var, int] = {}  # a value computed from params alone -> its equation
    for i, eqn in enumerate(eqns):
        if eqn.effects or is_stage_boundary(eqn):
            continue
        atoms = [a for a in eqn.invars if isinstance(a, Var)]
        if all(a in params or a in consts or a in made_by for a in atoms):
            made_by.update((v, i) for v in eqn.outvars)
    members = [{i for i, s in enumerate(eqn_stages) if s == t} for t in range(count)]
    if not made_by:
        return members
    recomputed = set(made_by.values())
    for t in range(count):
        # What the stage reads: its other equations' inputs, and (last stage) loss and aux.
        wanted = [a for i in members[t] if i not in recomputed for a in eqns[i].invars]
        if t == count - 1:
            wanted.extend(jaxpr.outvars)
        kept: set[int] = set()
        while wanted:
            a = wanted.pop()
            if isinstance(a, Var) and a in made_by and made_by[a] not in kept:
                kept.add(made_by[a])
                wanted.extend(eqns[made_by[a]].invars)
        members[t] = {i for i in members[t] if i not in recomputed} | kept
    _warn_split_custom_vjp(eqns, members)
    return members


def _warn_split_custom_vjp(eqns: Sequence[Any], members: Sequence[set[int]]) -> None:
    """Warns when a ``jax.custom_vjp`` function of params alone runs in several stages: each
    stage runs its bwd rule on its own share of the value's cotangent, rule(a) + rule(b)
    where JAX runs rule(a + b). Exact for a rule linear in its cotangent (a straight-through
    estimator), not for one that clips or normalizes it (helper H1). Computed once and sent
    instead, a quantized weight stack or tied embedding would travel to every stage every
    microbatch (helper H3: 129x the message bytes, a 1.7x step), so it stays recomputed."""
    for i, eqn in enumerate(eqns):
        stages = [t for t, these in enumerate(members) if i in these]
        if len(stages) > 1 and _calls_custom_vjp(eqn):
            line = user_line(eqn)
            warnings.warn(
                "a jax.custom_vjp function of params alone"
                + (f" (at {line})" if line else "")
                + f" runs in stages {stages}, which all read its value: each runs its bwd rule "
                "on its own share of the cotangent, rule(a) + rule(b) where jax.value_and_grad "
                "runs rule(a + b). That is exact for a rule linear in the cotangent (a "
                "straight-through estimator), not for one that clips or normalizes it; apply "
                "such a rule to activations, or where one stage reads the value",
                stacklevel=caller_stacklevel(),
            )
            return


def _calls_custom_vjp(eqn: Any) -> bool:
    """Returns whether ``eqn`` calls a ``jax.custom_vjp`` function (itself, or inside a call
    or loop), whose bwd rule need not be linear in its cotangent."""
    return calls_primitive(eqn, CUSTOM_VJP_PRIMITIVES)


def _row_sliced_params(
    eqns: Sequence[Any], param_vars: Sequence[Var], outputs: Sequence[Any]
) -> tuple[tuple[tuple[int, int] | None, ...], list[Var], list[Any], list[Any]]:
    """Returns, per param of a stage, the rows it reads (None: all of it), and the stage's
    input per param, the equations that no longer run and those that run first instead.

    A param whose only use in ``eqns`` is one static slice of contiguous rows of its leading
    axis (all of every other axis) -- what a scan split by iteration does to its stacked layer
    params -- is read as those rows only: the stage takes the slice's result as its input, so
    its device holds and differentiates only those rows. So is a param whose only use is a
    cast (``astype``, the mixed-precision idiom) whose only use is such a slice: the stage
    takes the rows and casts them. A param read by several such slices (layers unrolled over
    a stacked param) is read as the rows from the first to the last, which the slices then
    slice.
    """
    uses: dict[Var, list[Any]] = {}
    for eqn in eqns:
        for atom in eqn.invars:
            if isinstance(atom, Var):
                uses.setdefault(atom, []).append(eqn)
    returned = {out for out in outputs if isinstance(out, Var)}

    def only_use(v: Var) -> Any:
        found = uses.get(v, [])
        return found[0] if len(found) == 1 and v not in returned else None

    rows: list[tuple[int, int] | None] = []
    inputs: list[Var] = []
    dropped: list[Any] = []
    added: list[Any] = []
    for v in param_vars:
        eqn = only_use(v)
        slices = _row_slices(uses.get(v, []), v) if v not in returned else None
        if slices is not None and len(slices) == 1:  # the slice's result is the input
            rows.append(slices[0])
            inputs.append(eqn.outvars[0])
            dropped.append(eqn)
            continue
        if slices is not None:
            lo, hi = min(a for a, _ in slices), max(b for _, b in slices)
            part = new_var(v.aval.update(shape=(hi - lo, *v.aval.shape[1:])))
            rows.append((lo, hi))
            inputs.append(part)
            for use, (a, b) in zip(uses[v], slices, strict=True):
                dropped.append(use)
                start, limit = use.params["start_indices"], use.params["limit_indices"]
                params = dict(
                    use.params,
                    start_indices=(a - lo, *start[1:]),
                    limit_indices=(b - lo, *limit[1:]),
                )
                added.append(use.replace(invars=[part], params=params))
            continue
        cast = eqn if eqn is not None and eqn.primitive.name == "convert_element_type" else None
        sliced = only_use(cast.outvars[0]) if cast is not None else None
        span = _leading_rows(sliced, cast.outvars[0]) if sliced is not None else None
        if span is None:
            rows.append(None)
            inputs.append(v)
            continue
        part = new_var(v.aval.update(shape=(span[1] - span[0], *v.aval.shape[1:])))
        rows.append(span)
        inputs.append(part)
        dropped.extend((cast, sliced))
        added.append(cast.replace(invars=[part], outvars=[sliced.outvars[0]]))
    return tuple(rows), inputs, dropped, added


def _row_slices(found: Sequence[Any], v: Var) -> list[tuple[int, int]] | None:
    """Returns each use's [begin, end) rows when ``v`` is read by static slices of rows of its
    leading axis and nothing else (one: a split scan's stacked params; several: layers unrolled
    over a stacked param, ``p["stack"][i]``) that leave some rows unread, else None."""
    if not found:
        return None
    slices = [_leading_rows(eqn, v) for eqn in found]
    if any(s is None for s in slices):
        return None
    if (min(a for a, _ in slices), max(b for _, b in slices)) == (0, v.aval.shape[0]):
        return None
    return slices


def _leading_rows(eqn: Any, v: Var) -> tuple[int, int] | None:
    """Returns [begin, end) when ``eqn`` slices rows of ``v``'s leading axis and nothing else."""
    if eqn.primitive.name != "slice" or len(eqn.invars) != 1:
        return None
    shape = v.aval.shape
    start, limit = eqn.params["start_indices"], eqn.params["limit_indices"]
    strides = eqn.params.get("strides") or (1,) * len(shape)
    if not shape or any(st != 1 for st in strides):
        return None
    if any(start[k] != 0 or limit[k] != shape[k] for k in range(1, len(shape))):
        return None
    if (start[0], limit[0]) == (0, shape[0]):
        return None
    return int(start[0]), int(limit[0])


def _stage_jaxpr(
    eqns: Sequence[Any], invars: Sequence[Var], outputs: Sequence[Any], consts: dict[Var, Any]
) -> ClosedJaxpr:
    """Returns the closed jaxpr (invars...) -> (outputs...) running ``eqns`` (markers elided)."""

    def run(*args: Any) -> list[Any]:
        env: dict[Var, Any] = dict(consts)
        env.update(zip(invars, args, strict=True))
        for eqn in eqns:
            invals = [_read(env, a) for a in eqn.invars]
            if is_stage_boundary(eqn):
                outs = invals  # the marker is the identity; the cut is the stage edge
            else:
                with eqn.ctx.manager:
                    outs = bind_equation(eqn, invals)
            env.update(zip(eqn.outvars, outs, strict=True))
        return [_read(env, a) for a in outputs]

    return jax.make_jaxpr(run)(*(_aval_struct(v) for v in invars))


# ----------------------------------------------------------------------------- automatic cuts


# Wrappers the automatic cut keeps whole (one piece of work, however many layers they hold).
_KEPT_WHOLE = {
    **dict.fromkeys(REMAT_PRIMITIVES, "a jax.checkpoint (nn.remat) region"),
    "custom_jvp_call": "a jax.custom_jvp function",
    "custom_vjp_call": "a jax.custom_vjp function",
    "custom_vjp_call_jaxpr": "a jax.custom_vjp function",
    "cond": "a lax.cond (lax.switch)",
    "while": "a lax.while_loop",
}

# How to let the cut split what it keeps whole, by primitive (else: wrap each layer).
_WHOLE_FIX = {
    "scan": "use partitioner='chain', which splits a scan's iterations between stages",
    "cond": "compute the layers outside the cond (run both and select the result with "
    "jnp.where, or branch per layer), or put the cond in a stage of its own with "
    "zbjax.stage_boundary markers before and after it",
    "while": "write the loop as lax.scan or a lax.fori_loop with static bounds, whose "
    "iterations the cut splits between stages (a while_loop's trip count is unknown, and the "
    "cost model counts its body once)",
}


def warn_whole_regions(
    pieces: Sequence[tuple[Any, float]], count: int, graph: bool = False
) -> None:
    """Warns when a region a cut keeps whole (a jax.checkpoint, a custom_vjp; with ``graph``,
    GraphPipe's partition, also a scan) holds more than 1.5 times a stage's even share of the
    cost: the stage that gets it runs most of the model while the others wait, however the
    rest is cut. (Twice the share never fired on 2 stages, where it is the whole model: helper
    H1, a checkpoint around 99 % of a model.) ``pieces`` are the (equation, cost) the cut chose
    between."""
    total = sum(cost for _, cost in pieces)
    for eqn, cost in pieces:
        name = eqn.primitive.name
        what = _KEPT_WHOLE.get(name) or (
            "a lax.scan (nn.scan)" if graph and name == "scan" else None
        )
        if what is None or cost <= 1.5 * total / count:
            continue
        line = user_line(eqn)
        fix = _WHOLE_FIX.get(
            name,
            "wrap each layer rather than the whole model, or place zbjax.stage_boundary "
            "markers inside it",
        )
        warnings.warn(
            f"{'GraphPipe' if graph else 'the automatic cut'} keeps {what}"
            + (f" (at {line})" if line else "")
            + f" whole, and it holds {cost / total:.0%} of the model's cost, so one "
            f"of the {count} stages runs most of the model while the others wait; {fix}",
            stacklevel=caller_stacklevel(),
        )
        return


@dataclass(frozen=True)
class _Unit:
    """One indivisible piece of activation work: an equation, or one iteration of a scan."""

    eqn: int
    iteration: int  # 0 unless the equation is a scan split by iteration
    cost: float


def _auto_cut(
    program: _Program, count: int, cut: tuple[int, tuple[int, ...]] | None = None
) -> tuple[_Program, dict[int, int], tuple[int, tuple[int, ...]]]:
    """Returns the program (scans split where cut), the stage of each activation equation and
    the cut (number of units, each stage's first unit): ``cut``'s when it has as many units
    and stages, else the cost-balanced one."""
    eqns = program.jaxpr.eqns
    activation = _activation_equations(program)
    units: list[_Unit] = []
    first_unit: dict[int, int] = {}
    for i in activation:
        eqn = eqns[i]
        first_unit[i] = len(units)
        cost = cost_model.equation_cost(eqn)
        length = eqn.params["length"] if _splittable_scan(eqn) else 1
        units.extend(_Unit(i, it, cost / length) for it in range(length))
    if len(units) < count:
        wrapped = sorted(
            {
                _KEPT_WHOLE[eqns[u.eqn].primitive.name]
                for u in units
                if eqns[u.eqn].primitive.name in _KEPT_WHOLE
            }
        )
        keep = "keeps the layers inside it" if len(wrapped) == 1 else "keep the layers inside them"
        inside = (
            f"; {' and '.join(wrapped)} {keep} whole: wrap each layer rather than the whole "
            "model, or place zbjax.stage_boundary markers inside"
            if wrapped
            else ""
        )
        if not units:
            raise PartitionError(
                f"num_stages={count} but loss_fn has no work to cut into stages: its loss "
                "does not compute on both params and batch (it is a constant, or reads only "
                "one of them); pipeline a loss that runs a model on its batch with its params"
            )
        raise PartitionError(
            f"num_stages={count} but the program has only {len(units)} pieces of activation "
            "work to cut between (equations, or scan iterations); ask for at most "
            f"{len(units)} stages or give the model more layers{inside}"
        )
    costs = [u.cost for u in units]
    _attach_free_costs(program, activation, first_unit, costs)
    live = _live_bytes(program, units, first_unit)
    if cut is not None and cut[0] == len(units) and len(cut[1]) == count:
        starts = list(cut[1])
    else:
        comm = _SENDS_PER_COMPUTE * cost_model.comm_weight()
        starts = _choose_cuts(costs, live, count, comm, cost_model.comm_free_bytes())
        warn_whole_regions([(eqns[u.eqn], c) for u, c in zip(units, costs, strict=True)], count)
    cut = (len(units), tuple(int(s) for s in starts))
    unit_stage = np.zeros(len(units), dtype=int)
    for s, start in enumerate(starts):
        unit_stage[start:] = s
    explicit: dict[int, int] = {}
    scan_chunks: dict[int, list[tuple[int, int, int]]] = {}
    for i in activation:
        lo = first_unit[i]
        n = eqns[i].params["length"] if _splittable_scan(eqns[i]) else 1
        here = unit_stage[lo : lo + n]
        if here[0] == here[-1]:
            explicit[i] = int(here[0])
        else:
            chunks = []
            begin = 0
            for it in range(1, n + 1):
                if it == n or here[it] != here[begin]:
                    chunks.append((begin, it, int(here[begin])))
                    begin = it
            scan_chunks[i] = chunks
    if not scan_chunks:
        return program, explicit, cut
    return (*_split_scans(program, explicit, scan_chunks), cut)


def _activation_equations(program: _Program) -> list[int]:
    """Returns the indices of equations whose outputs depend on a batch AND a param leaf."""
    jaxpr = program.jaxpr
    depends: dict[Var, int] = {}  # bit 1: a param leaf; bit 2: a batch leaf
    for n, v in enumerate(jaxpr.invars):
        depends[v] = 1 if n < program.num_params else 2
    activation = []
    for i, eqn in enumerate(jaxpr.eqns):
        bits = 0
        for v in eqn.invars:
            if isinstance(v, Var):
                bits |= depends.get(v, 0)
        depends.update((v, bits) for v in eqn.outvars)
        if bits == 3:
            activation.append(i)
    return activation


def _splittable_scan(eqn: Any) -> bool:
    return eqn.primitive.name == "scan" and eqn.params["length"] >= 2


def _attach_free_costs(
    program: _Program, activation: list[int], first_unit: dict[int, int], costs: list[float]
) -> None:
    """Adds each free equation's cost to the first unit that reads it (where it will run)."""
    eqns = program.jaxpr.eqns
    last = len(costs) - 1
    is_activation = set(activation)
    read_at: dict[Var, int] = {v: last for v in program.jaxpr.outvars if isinstance(v, Var)}
    for i in reversed(range(len(eqns))):
        eqn = eqns[i]
        if i in is_activation:
            position = first_unit[i]
        else:
            position = min((read_at[v] for v in eqn.outvars if v in read_at), default=last)
            costs[position] += cost_model.equation_cost(eqn)
        for v in eqn.invars:
            if isinstance(v, Var):
                read_at[v] = min(read_at.get(v, last), position)


def _live_bytes(program: _Program, units: list[_Unit], first_unit: dict[int, int]) -> list[float]:
    """Returns, per cut position p (before unit p), the activation bytes crossing the cut."""
    eqns = program.jaxpr.eqns
    n = len(units)
    delta = np.zeros(n + 1)
    defined: dict[Var, int] = {}
    last_read: dict[Var, int] = {}

    def at_each_boundary(lo: int, length: int, share: Callable[[int], float]) -> None:
        # Adds share(it) at the cut before iteration it of a scan (1 <= it < length).
        for it in range(1, length):
            delta[lo + it] += share(it)
            delta[lo + it + 1] -= share(it)

    stacked_outputs = []
    for i, lo in first_unit.items():
        eqn = eqns[i]
        length = eqn.params["length"] if _splittable_scan(eqn) else 1
        # Inside a split scan its consts are read by every iteration; its carry's initial value
        # by the first (the carry crosses the later boundaries, below); of its xs, the slices
        # not scanned yet cross each boundary, and of its ys, the slices made so far.
        num_consts, num_carry = scan_counts(eqn.params) if length > 1 else (0, 0)
        for j, v in enumerate(eqn.invars):
            if not (isinstance(v, Var) and v in defined):
                continue
            read = lo + length - 1 if j < num_consts or length == 1 else lo
            last_read[v] = max(last_read.get(v, 0), read)
            if length > 1 and j >= num_consts + num_carry:
                size = cost_model.aval_bytes(v.aval)
                at_each_boundary(lo, length, lambda it, s=size, n=length: s * (n - it) / n)
        for v in eqn.outvars:
            defined[v] = lo + length - 1
        if length > 1:
            carry = sum(cost_model.aval_bytes(v.aval) for v in eqn.outvars[:num_carry])
            at_each_boundary(lo, length, lambda it, c=carry: c)
            stacked_outputs.append((lo, length, eqn.outvars[num_carry:]))
    for v in program.jaxpr.outvars:
        if isinstance(v, Var) and v in defined:
            last_read[v] = n - 1
    for v, d in defined.items():
        if v in last_read and last_read[v] > d:
            size = cost_model.aval_bytes(v.aval)
            delta[d + 1] += size
            delta[last_read[v] + 1] -= size
    for lo, length, ys in stacked_outputs:
        for v in ys:
            if v in last_read and last_read[v] > defined[v]:
                size = cost_model.aval_bytes(v.aval)
                at_each_boundary(lo, length, lambda it, s=size, n=length: s * it / n)
    return list(np.cumsum(delta)[:n])


#: The bytes crossing a cut are sent twice per microbatch (the activation in F, its cotangent in
#: B) while a stage computes F, B and W, about three forward costs: in forward-cost units a
#: crossing byte costs this share of ``cost_model.comm_weight()``.
_SENDS_PER_COMPUTE = 2.0 / 3.0

#: ``_choose_cuts`` tries every bound on the bytes crossing a cut up to twice this many, else
#: the least this many and this many of the others.
_CROSSING_LIMITS = 64


def _choose_cuts(
    costs: Sequence[float],
    live: Sequence[float],
    count: int,
    comm: float = 0.0,
    free: float = 0.0,
) -> list[int]:
    """Returns the first unit of each of ``count`` contiguous groups (starts[0] == 0).

    Minimises the largest group cost plus ``comm`` times the most live bytes crossing a cut
    beyond ``free`` (the lowering's message slots are as large as the largest edge, and a
    message up to ``free`` bytes costs what an empty one does; the bytes of all values
    crossing one position are summed): over each bound on the bytes crossing (all of them,
    or the least ``_CROSSING_LIMITS`` and as many spread over the others), the cuts crossing
    at most that many are considered, and the largest group cost they allow is found by
    bisection on it with greedy packing. Then each cut moves,
    within ``AUTO_SLACK`` of that cost, to the allowed position with the fewest live bytes.
    A group is also no larger than the groups after it will be (an even split of the rest, or
    its largest unit), beyond its own first unit and ``AUTO_SLACK``: when one unit sets the
    bound (a large embedding, say), the others are still spread over the other groups
    instead of piling into one; and among the positions crossing as few bytes, each cut goes
    nearest an even split of what is left, in which a stretch that cannot be split and is
    larger than its share (a vocabulary's head) counts as a group of its own.
    """
    prefix = np.concatenate([[0.0], np.cumsum(costs)])
    n = len(costs)
    if count == 1:
        return [0]
    live = np.asarray(live, dtype=float)
    # Positions a cut may go to (before unit p, 1 <= p < n): those crossing at most the chosen
    # number of bytes.
    positions, largest = _allowed_positions(
        prefix, costs, np.maximum(live - free, 0.0), count, comm
    )
    bound = largest * (1.0 + AUTO_SLACK)
    largest_after = np.maximum.accumulate(np.asarray(costs, dtype=float)[::-1])[::-1]
    allowed = len(positions)
    # earliest[k]: the first position group k may start at so that groups k .. count - 1 still
    # fit the bound (packed greedily from the end, each starting at an allowed position and
    # leaving allowed positions for the groups before it).
    earliest = [0] * (count + 1)
    earliest[count] = n
    for k in range(count - 1, 0, -1):
        end = earliest[k + 1]
        j = int(np.searchsorted(positions, end)) - 1  # the last allowed position before end
        while j - 1 >= k - 1 and prefix[end] - prefix[positions[j - 1]] <= bound:
            j -= 1
        earliest[k] = int(positions[j])
    starts = [0]
    for k in range(1, count):
        prev = starts[-1]
        best = None
        share = _even_share(prefix, positions, prev, count - k + 1)
        first = max(prev + 1, earliest[k])
        # Group k - 1 = [prev, p) must fit the bound and leave one allowed position per later
        # group; and it is no larger than the later groups will be (estimated: an even split
        # of the rest, or its largest unit), except by its own first unit or AUTO_SLACK of
        # them.
        lo = max(int(np.searchsorted(positions, first)), k - 1)
        candidates = [int(p) for p in positions[lo : allowed - (count - k) + 1]]
        for p in candidates:
            group = prefix[p] - prefix[prev]
            if group > bound:
                break
            later = max(largest_after[p], (prefix[-1] - prefix[p]) / (count - k))
            if p > candidates[0] and group > max(costs[prev], later) + later * AUTO_SLACK:
                continue
            score = (live[p], abs(prefix[p] - prefix[prev] - share))
            if best is None or score < best[0]:
                best = (score, p)
        starts.append(best[1] if best is not None else candidates[0])
    return starts


def _even_share(prefix: np.ndarray, positions: np.ndarray, start: int, groups: int) -> float:
    """Returns the cost each of ``groups`` groups cut from ``start`` on would have split evenly,
    where the stretches between allowed positions cannot be split: one larger than the even
    split of what is left takes a group of its own, and the others share the rest."""
    ends = np.concatenate([[start], positions[positions > start], [len(prefix) - 1]])
    pieces = sorted(np.diff(prefix[ends]), reverse=True)
    rest = float(prefix[-1] - prefix[start])
    for piece in pieces:
        if groups <= 1 or piece <= rest / groups:
            break
        rest, groups = rest - piece, groups - 1
    return rest / groups


def _allowed_positions(
    prefix: np.ndarray, costs: Sequence[float], live: np.ndarray, count: int, comm: float
) -> tuple[np.ndarray, float]:
    """Returns the cut positions (1 <= p < n) crossing at most the live bytes that minimise
    the largest group cost plus ``comm`` times those bytes, and that largest group cost."""
    n = len(costs)
    everywhere = np.arange(1, n)
    if comm <= 0.0:
        return everywhere, _largest_group(prefix, costs, count, everywhere)
    crossing = np.sort(live[1:])
    # At least count - 1 positions are needed; each larger distinct value admits more. Of many
    # distinct values (thousands of units, all crossing different bytes) the least
    # ``_CROSSING_LIMITS`` are tried (the best is often just enough cheap positions to
    # balance), then ``_CROSSING_LIMITS`` of the others, evenly spaced in their order, the
    # most kept.
    limits = np.unique(crossing[count - 2 :])
    if len(limits) > 2 * _CROSSING_LIMITS:
        rest = limits[_CROSSING_LIMITS:]
        spaced = np.linspace(0, len(rest) - 1, _CROSSING_LIMITS).round().astype(int)
        limits = np.concatenate([limits[:_CROSSING_LIMITS], rest[np.unique(spaced)]])
    floor = max(max(costs), prefix[-1] / count)  # no cut does better than this
    best_score, best = np.inf, (everywhere, float(prefix[-1]))
    for limit in limits:
        if floor + comm * limit >= best_score:
            break  # larger limits only add to the communication term
        positions = everywhere[live[1:] <= limit]
        if _groups_needed(prefix, np.append(positions, n), best_score - comm * limit) > count:
            continue  # cannot beat the best found
        largest = _largest_group(prefix, costs, count, positions)
        if largest + comm * limit < best_score:
            best_score, best = largest + comm * limit, (positions, largest)
    return best


def _groups_needed(prefix: np.ndarray, ends: np.ndarray, bound: float) -> int:
    """Returns how many groups of cost at most ``bound`` greedy packing needs, each group
    ending at one of ``ends`` (the allowed positions, then the number of units); a huge
    number when one unit cannot fit."""
    n = len(prefix) - 1
    groups, start = 0, 0
    while start < n:
        reach = int(np.searchsorted(prefix, prefix[start] + bound, side="right")) - 1
        last = int(np.searchsorted(ends, reach, side="right")) - 1  # the furthest end in reach
        if last < 0 or ends[last] <= start:
            return n + 1
        groups, start = groups + 1, int(ends[last])
    return groups


def _largest_group(
    prefix: np.ndarray, costs: Sequence[float], count: int, positions: np.ndarray
) -> float:
    """Returns the least largest group cost of ``count`` groups cut at allowed positions
    (bisection to a relative 1e-9)."""
    lo, hi = max(costs), float(prefix[-1])
    ends = np.append(positions, len(costs))
    if _groups_needed(prefix, ends, lo) <= count:
        return float(lo)
    for _ in range(100):
        if hi - lo <= 1e-9 * max(hi, 1.0):
            break
        mid = 0.5 * (lo + hi)
        if _groups_needed(prefix, ends, mid) <= count:
            hi = mid
        else:
            lo = mid
    return float(hi)


def _split_scans(
    program: _Program, explicit: dict[int, int], scan_chunks: dict[int, list[tuple[int, int, int]]]
) -> tuple[_Program, dict[int, int]]:
    """Returns the program with each scan in ``scan_chunks`` replaced by one scan per chunk."""
    jaxpr = program.jaxpr
    rename: dict[Var, Any] = {}
    new_eqns: list[Any] = []
    new_explicit: dict[int, int] = {}
    constvars = list(jaxpr.constvars)
    consts = list(program.consts)

    def renamed(atom: Any) -> Any:
        while isinstance(atom, Var) and atom in rename:
            atom = rename[atom]
        return atom

    for i, eqn in enumerate(jaxpr.eqns):
        eqn = eqn.replace(invars=[renamed(a) for a in eqn.invars])
        if i not in scan_chunks:
            if i in explicit:
                new_explicit[len(new_eqns)] = explicit[i]
            new_eqns.append(eqn)
            continue
        chunks = scan_chunks[i]
        replacement = _chunked_scan_jaxpr(eqn, [(a, b) for a, b, _ in chunks])
        inner = dict(zip(replacement.jaxpr.invars, eqn.invars, strict=True))
        fresh_consts = dict(zip(replacement.jaxpr.constvars, replacement.consts, strict=True))
        constvars.extend(fresh_consts)
        consts.extend(fresh_consts.values())
        scan_count = 0
        for sub in replacement.jaxpr.eqns:
            sub = sub.replace(
                invars=[inner.get(a, a) if isinstance(a, Var) else a for a in sub.invars]
            )
            if sub.primitive.name == "scan":
                new_explicit[len(new_eqns)] = chunks[scan_count][2]
                scan_count += 1
            new_eqns.append(sub)
        for outer, inner_out in zip(eqn.outvars, replacement.jaxpr.outvars, strict=True):
            rename[outer] = (
                inner.get(inner_out, inner_out) if isinstance(inner_out, Var) else (inner_out)
            )
    outvars = [renamed(v) for v in jaxpr.outvars]
    new_jaxpr = jaxpr.replace(constvars=constvars, eqns=new_eqns, outvars=outvars)
    program = _Program(new_jaxpr, tuple(consts), program.num_params, program.aux_treedef)
    return program, new_explicit


def _chunked_scan_jaxpr(eqn: Any, ranges: list[tuple[int, int]]) -> ClosedJaxpr:
    """Returns a jaxpr equal to the scan ``eqn`` run as one scan per iteration range.

    ``ranges`` are [begin, end) in processing order; for a reverse scan, processing step t
    reads row length - 1 - t of the scanned-over inputs.
    """
    params = eqn.params
    length, (num_consts, num_carry) = params["length"], scan_counts(params)
    reverse = params["reverse"]

    def chunked(*args: Any) -> list[Any]:
        consts = args[:num_consts]
        carry = list(args[num_consts : num_consts + num_carry])
        xs = args[num_consts + num_carry :]
        pieces = []
        for begin, end in ranges:
            rows = (length - end, length - begin) if reverse else (begin, end)
            xs_chunk = [jax.lax.slice_in_dim(x, rows[0], rows[1], axis=0) for x in xs]
            outs = eqn.primitive.bind(
                *consts, *carry, *xs_chunk, **{**params, "length": end - begin}
            )
            carry = list(outs[:num_carry])
            pieces.append((rows[0], outs[num_carry:]))
        pieces.sort(key=lambda piece: piece[0])
        num_ys = len(eqn.outvars) - num_carry
        ys = [jax.lax.concatenate([p[1][k] for p in pieces], 0) for k in range(num_ys)]
        return carry + ys

    avals = [_aval_struct(v) for v in eqn.invars]
    with equation_source(eqn):
        return jax.make_jaxpr(chunked)(*avals)
