"""Jaxpr surgery helpers: the ONLY zbjax module that may import ``jax._src`` internals.

Internal jaxpr APIs move between JAX releases (0.10 here, 0.11 on GPU machines); keeping every
use of them here means a release bump touches one file. Each helper is a plain function from
jaxprs to jaxprs. Sections are owned by the engineer named in their header; append new helpers
in your own section.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import numpy as np
from jax._src import core as _core
from jax._src import mesh as _mesh_lib
from jax._src import source_info_util as _source_info
from jax.extend.core import (
    ClosedJaxpr,
    DebugInfo,
    DropVar,
    Jaxpr,
    Literal,
    Var,
    jaxpr_as_fun,
    new_jaxpr_eqn,
)

try:  # jax >= 0.11 describes a scan's operands and results as flat trees, not counts
    from jax._src import flattree as _flattree
except ImportError:  # jax 0.10
    _flattree = None

# ----------------------------------------------------------------------------------------------
# Section: jaxpr building, DCE and call inlining (owner: split / markers / cost model engineer)
# ----------------------------------------------------------------------------------------------

# Primitives whose equation just calls a sub-jaxpr on its operands, so inlining the sub-jaxpr
# changes nothing but the equation boundaries. ``jit`` is the 0.10+ name of ``pjit``.
CALL_PRIMITIVES = frozenset({"jit", "pjit", "closed_call", "core_call"})
# Rematerialised regions are calls too; inlining them keeps the values, drops only the
# "recompute instead of save" hint (which a backward program no longer needs).
REMAT_PRIMITIVES = frozenset({"checkpoint", "remat", "remat2"})


def is_literal(atom: Any) -> bool:
    """Returns whether a jaxpr atom is a literal constant (as opposed to a variable)."""
    return isinstance(atom, Literal)


def is_drop_var(var: Any) -> bool:
    """Returns whether a jaxpr output variable is a dropped (unused) output ``_``."""
    return isinstance(var, DropVar)


def new_var(aval: Any) -> Var:
    """Returns a fresh jaxpr variable of the given abstract value."""
    return Var(aval)


def ordered_effect_names(jaxpr: Jaxpr) -> list[str]:
    """Returns the names of ``jaxpr``'s ordered effects (``jax.debug.print(...,
    ordered=True)``, ``io_callback(..., ordered=True)``), which JAX runs on one device only."""
    from jax._src import effects

    found = [e for e in jaxpr.effects if effects.ordered_effects.contains(e)]
    return sorted({type(e).__name__ for e in found})


def key_impl(dtype: Any) -> Any:
    """Returns the PRNG implementation of a typed key dtype (``key<fry>``), which
    ``jax.random.wrap_key_data(data, impl=...)`` takes."""
    return dtype._impl


def make_closed_jaxpr(
    invars: Sequence[Var],
    outvars: Sequence[Any],
    eqns: Sequence[Any],
    constvars: Sequence[Var] = (),
    consts: Sequence[Any] = (),
    name: str = "zbjax",
) -> ClosedJaxpr:
    """Returns a ClosedJaxpr over existing variables and equations (shared, not copied).

    The caller guarantees every variable the equations and outputs read is an input, a
    constant, or defined by an earlier equation. Effects are the union of the equations'.
    """
    effects = frozenset().union(*(eqn.effects for eqn in eqns)) if eqns else frozenset()
    debug_info = DebugInfo("zbjax", name, (name,) * len(invars), (name,) * len(outvars))
    jaxpr = Jaxpr(list(constvars), list(invars), list(outvars), list(eqns), effects, debug_info)
    return ClosedJaxpr(jaxpr, list(consts))


def scan_counts(params: dict) -> tuple[int, int]:
    """Returns (number of consts, number of carries) of a ``scan`` equation's params.

    jax 0.10 stores them as ``num_consts`` and ``num_carry``; jax 0.11 as the flat trees
    ``ft_in`` (consts, carries, scanned-over inputs) and ``ft_out`` (carries, stacked outputs).
    """
    if "num_consts" in params:
        return params["num_consts"], params["num_carry"]
    consts, carries, _ = params["ft_in"].unpack()
    return len(consts), len(carries)


def scan_params(params: dict, jaxpr: ClosedJaxpr, num_consts: int, num_carry: int) -> dict:
    """Returns the params of a ``scan`` like ``params`` whose body is ``jaxpr`` taking
    ``num_consts`` consts and ``num_carry`` carries (the rest of its inputs scanned over, the
    rest of its outputs stacked), whichever way this JAX release describes them."""
    num_in, num_out = len(jaxpr.in_avals), len(jaxpr.out_avals)
    new = dict(params, jaxpr=jaxpr)
    if "ft_in" in params:
        nones = _flattree.nones
        new["ft_in"] = _flattree.pack(
            (nones(num_consts), nones(num_carry), nones(num_in - num_consts - num_carry))
        )
        new["ft_out"] = _flattree.pack((nones(num_carry), nones(num_out - num_carry)))
        return new
    new.update(num_consts=num_consts, num_carry=num_carry)
    if "linear" in new:
        new["linear"] = (False,) * num_in
    return new


def replace_equation(eqn: Any, invars: Sequence[Any], outvars: Sequence[Var], params: dict) -> Any:
    """Returns a copy of ``eqn`` with new operands, results and params (same primitive)."""
    sub_effects = [j.effects for j in _jaxprs_in(params)]
    effects = frozenset().union(*sub_effects) if sub_effects else eqn.effects
    return new_jaxpr_eqn(
        list(invars), list(outvars), eqn.primitive, params, effects, eqn.source_info, eqn.ctx
    )


def register_identity_dce(primitive: Any) -> None:
    """Lets JAX's dead-code elimination drop the unused results of ``primitive``, whose result
    i is its operand i, together with those operands (the whole equation when none is used)."""
    from jax._src.interpreters import partial_eval as pe

    def rule(used_outputs: list[bool], eqn: Any) -> tuple[list[bool], Any]:
        if not any(used_outputs):
            return [False] * len(eqn.invars), None
        if all(used_outputs):
            return list(used_outputs), eqn
        invars = [v for v, used in zip(eqn.invars, used_outputs, strict=True) if used]
        outvars = [v for v, used in zip(eqn.outvars, used_outputs, strict=True) if used]
        return list(used_outputs), replace_equation(eqn, invars, outvars, eqn.params)

    pe.dce_rules[primitive] = rule


def dce_closed_jaxpr(closed: ClosedJaxpr, used_outputs: Sequence[bool]) -> ClosedJaxpr:
    """Returns ``closed`` with only the used outputs and the equations they need.

    Inputs are all kept (calling conventions stay fixed); sub-jaxprs of control flow (scan
    carries and outputs, cond branches, calls) are pruned too, by JAX's own DCE rules.
    """
    from jax._src.interpreters import partial_eval as pe

    pruned, _ = pe.dce_jaxpr(closed.jaxpr, list(used_outputs), instantiate=True)
    outvars = [v for v, used in zip(closed.jaxpr.outvars, used_outputs, strict=True) if used]
    # dce_jaxpr keeps the Var objects, so the original inputs still name the same values.
    return make_closed_jaxpr(
        closed.jaxpr.invars, outvars, pruned.eqns, closed.jaxpr.constvars, closed.consts
    )


def inline_calls(closed: ClosedJaxpr, *, inline_remat: bool = True) -> ClosedJaxpr:
    """Returns an equivalent ClosedJaxpr with jit/closed_call (and remat) equations inlined.

    Bodies of ``scan`` are inlined recursively as well, so that later passes can split any
    equation that computes several independent results. Re-traces the jaxpr; values and
    equation order are unchanged.
    """

    def run(*args: Any) -> list[Any]:
        return _eval_inlined(closed.jaxpr, closed.consts, args, inline_remat)

    return jax.make_jaxpr(run)(*_shape_structs(closed.in_avals))


def vmap_independent_scans(closed: ClosedJaxpr) -> ClosedJaxpr:
    """Returns an equivalent ClosedJaxpr whose top-level carry-less ``scan``s are ``vmap``s.

    A scan without carries runs independent iterations: W's scan over a stage's layers, which
    only turns each layer's stashed values into that layer's weight gradient. As a loop it reads
    every iteration's slice of the stacked stash through a copy; as one batched computation
    it does not, and XLA batches the per-layer matmuls. Its temporaries then hold every
    iteration at once, but W's per-layer values are already stacked in its inputs, so they are
    of the stash's size. Iteration order cannot matter without a carry, so ``reverse`` is moot.
    A body with a primitive that has no batching rule keeps its scan.
    """
    if not any(_independent_scan(eqn) for eqn in closed.jaxpr.eqns):
        return closed  # nothing to batch: skip the re-trace

    def eval_equation(eqn: Any, invals: list[Any]) -> Sequence[Any]:
        params = eqn.params
        if _independent_scan(eqn):
            batched = _batched_body(params["jaxpr"], scan_counts(params)[0], eqn.invars)
            if batched is not None:
                return jaxpr_as_fun(batched)(*invals)
        return bind_equation(eqn, invals)

    def run(*args: Any) -> list[Any]:
        return _interpret(closed.jaxpr, closed.consts, args, eval_equation)

    return jax.make_jaxpr(run)(*_shape_structs(closed.in_avals))


def _independent_scan(eqn: Any) -> bool:
    params = eqn.params
    return eqn.primitive.name == "scan" and scan_counts(params)[1] == 0 and params["length"] > 0


def _batched_body(body: ClosedJaxpr, num_consts: int, invars: Sequence[Any]) -> Any:
    """Returns ``body`` vmapped over the scanned operands (consts shared), as a ClosedJaxpr
    taking the scan's operands; None when a primitive in it has no batching rule."""
    num_xs = len(invars) - num_consts
    batched = jax.vmap(jaxpr_as_fun(body), in_axes=(None,) * num_consts + (0,) * num_xs)
    try:
        # Traced on its own, so a failure leaves nothing behind in the caller's trace.
        return jax.make_jaxpr(batched)(*_shape_structs([v.aval for v in invars]))
    except NotImplementedError:  # "Batching rule for '...' not implemented"
        return None


def _shape_structs(avals: Sequence[Any]) -> list[jax.ShapeDtypeStruct]:
    return [
        jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=getattr(a, "weak_type", False))
        for a in avals
    ]


def _interpret(
    jaxpr: Jaxpr,
    consts: Sequence[Any],
    args: Sequence[Any],
    eval_equation: Callable[[Any, list[Any]], Sequence[Any]],
    literal: Callable[[Any], Any] = lambda value: value,
) -> list[Any]:
    """Returns ``jaxpr``'s outputs, each equation evaluated by ``eval_equation(eqn, invals)``
    (each literal's value passed through ``literal``)."""
    env: dict[Var, Any] = {}

    def read(atom: Any) -> Any:
        return literal(atom.val) if isinstance(atom, Literal) else env[atom]

    for var, val in zip(jaxpr.constvars, consts, strict=True):
        env[var] = val
    for var, val in zip(jaxpr.invars, args, strict=True):
        env[var] = val
    for eqn in jaxpr.eqns:
        outs = eval_equation(eqn, [read(v) for v in eqn.invars])
        for var, val in zip(eqn.outvars, outs, strict=True):
            if not isinstance(var, DropVar):
                env[var] = val
    return [read(v) for v in jaxpr.outvars]


def _eval_inlined(jaxpr: Jaxpr, consts: Sequence[Any], args: Sequence[Any], remat: bool) -> list:
    def eval_equation(eqn: Any, invals: list[Any]) -> Sequence[Any]:
        name = eqn.primitive.name
        if name in CALL_PRIMITIVES or (remat and name in REMAT_PRIMITIVES):
            body = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
            if isinstance(body, ClosedJaxpr):
                return _eval_inlined(body.jaxpr, body.consts, invals, remat)
            return _eval_inlined(body, (), invals, remat)
        if name == "scan":
            params = dict(eqn.params, jaxpr=inline_calls(eqn.params["jaxpr"], inline_remat=remat))
            with equation_source(eqn):
                return list(eqn.primitive.bind(*invals, **params))
        return bind_equation(eqn, invals)

    return _interpret(jaxpr, consts, args, eval_equation)


def equation_source(eqn: Any) -> Any:
    """Returns a context in which equations bound take ``eqn``'s source line, as eval_jaxpr
    binds each equation: a program rebuilt from the user's jaxpr then points at the user's code
    in compiled metadata and errors, not at the zbjax code that rebuilt it.

    The named scopes stay the caller's (the action's "F s0"), not the equation's: alike stages
    (``split``'s ``same_jaxpr``) differ in their layers' names (Flax module paths), and one
    split serves them all only while the names are not part of their programs."""
    scopes = _source_info.current_name_stack()
    return _source_info.user_context(eqn.source_info.traceback, name_stack=scopes)


def under_trace() -> bool:
    """Returns whether JAX is tracing here (inside a jit, eval_shape, make_jaxpr, a control-flow
    body), even where every value at hand is concrete (closed over from outside the trace)."""
    return not _core.trace_ctx.is_top_level()


#: JAX settings that change what tracing a function gives (``jax.default_matmul_precision``,
#: ``jax.numpy_rank_promotion``, ... as contexts or config): jit retraces when they change.
_TRACING_SETTINGS = (
    "default_matmul_precision",
    "numpy_rank_promotion",
    "numpy_dtype_promotion",
    "enable_x64",
    "default_prng_impl",
    "threefry_partitionable",
    "softmax_custom_jvp",
    "high_dynamic_range_gumbel",
    "random_seed_offset",
    "use_direct_linearize",
    "explicit_x64_dtypes",
)


def tracing_config() -> tuple:
    """Returns the values of the JAX settings that change a trace, where they are set now (a
    context manager included): part of the key of a cached trace, as of jit's."""
    from jax._src import config

    return tuple(getattr(getattr(config, name, None), "value", None) for name in _TRACING_SETTINGS)


def checking_numerics() -> bool:
    """Returns whether ``jax_debug_nans`` or ``jax_debug_infs`` is on here (a context
    manager included): JAX then runs a step that made a NaN again, de-optimized, with the
    same arguments, so none may be donated."""
    from jax._src import config

    return bool(config.debug_nans.value or config.debug_infs.value)


def closes_over_tracers(consts: Sequence[Any]) -> bool:
    """Returns whether a traced program's ``consts`` hold values of an enclosing trace (a
    ``loss_fn`` that reads a value of the user's jit): such a program is valid in that trace
    only, so it must not be cached for another."""
    return any(isinstance(c, _core.Tracer) for c in consts)


_EXCHANGES = itertools.count()
_exchanges_made = 0


def exchanges_made() -> int:
    """Returns how many exchanges (``exchange_between_processes``) this process has made."""
    return _exchanges_made


def exchange_between_processes(
    data: bytes, timeout_s: float = 300.0, wait: bool = True
) -> list[bytes] | None:
    """Returns every process's ``data`` (process i's at index i) through jax.distributed's
    key-value store: host messages, no device collective, so it also works while a jit traces.
    Every process must call it the same number of times, in the same order. None when
    jax.distributed was not initialized (the processes cannot be reached this way). Without
    ``wait``, only posts ``data`` as this process's part of its next exchange (a process that
    stops early tells the others, who wait there) and returns None."""
    from jax._src import distributed

    client = distributed.global_state.client
    if client is None:
        return None
    global _exchanges_made
    n, me = next(_EXCHANGES), jax.process_index()
    _exchanges_made = n + 1
    client.key_value_set_bytes(f"zbjax/exchange/{n}/{me}", data)
    if not wait:
        return None
    every = [
        bytes(client.blocking_key_value_get_bytes(f"zbjax/exchange/{n}/{i}", int(timeout_s * 1000)))
        for i in range(jax.process_count())
    ]
    # Every process posted exchange n after reading all of n - 1: this one's part of n - 1 is
    # read by all (eager steps exchange once each: the store would grow step by step).
    if n > 0:
        client.key_value_delete(f"zbjax/exchange/{n - 1}/{me}")
    return every


def context_mesh_devices() -> tuple | None:
    """Returns the devices of the ``jax.set_mesh`` context's mesh in its order, or None where
    no concrete mesh is set. (JAX's internal getter: the public ``jax.sharding.get_mesh``
    refuses to run inside a ``jit``, where the context's devices still decide.)"""
    getter = getattr(_mesh_lib, "get_concrete_mesh", None)
    mesh = getter() if getter is not None else None
    if mesh is None or mesh.empty:
        return None
    return tuple(mesh.devices.flat)


def user_line(eqn: Any) -> str:
    """Returns where the user's code made ``eqn``: "file:line in function" of the innermost
    frame of its traceback outside JAX and zbjax, or "" when the traceback has none."""
    traceback = eqn.source_info.traceback
    if traceback is None:
        return ""
    package = os.path.dirname(os.path.abspath(__file__)) + os.sep
    for frame in _source_info.user_frames(traceback):
        if not os.path.abspath(frame.file_name).startswith(package):
            return f"{frame.file_name}:{frame.start_line} in {frame.function_name}"
    return ""


def bind_equation(eqn: Any, invals: Sequence[Any]) -> list[Any]:
    """Returns the outputs of binding ``eqn``'s primitive to ``invals`` (as eval_jaxpr does,
    without entering the context the equation recorded), as a list.

    As eval_jaxpr does, the bound equation keeps the source line the user's code gave it
    (``equation_source``), so the compiled step's metadata and errors point at the user's code
    rather than at this interpreter.
    """
    # jax 0.10 returns the bind params (call primitives put their body in ``subfuns``); older
    # releases returned (subfuns, params).
    bind_params = eqn.primitive.get_bind_params(eqn.params)
    subfuns = ()
    if isinstance(bind_params, tuple):
        subfuns, bind_params = bind_params
    with equation_source(eqn):
        outs = eqn.primitive.bind(*subfuns, *invals, **bind_params)
    return list(outs) if eqn.primitive.multiple_results else [outs]


def _jaxprs_in(params: dict) -> list[Jaxpr]:
    found = []
    for value in params.values():
        for v in value if isinstance(value, tuple) else (value,):
            if isinstance(v, ClosedJaxpr):
                found.append(v.jaxpr)
            elif isinstance(v, Jaxpr):
                found.append(v)
    return found


#: The primitives of a ``jax.custom_vjp`` function in a jaxpr (by JAX version).
CUSTOM_VJP_PRIMITIVES = frozenset({"custom_vjp_call", "custom_vjp_call_jaxpr"})


def holds_primitive(closed: ClosedJaxpr | Jaxpr, names: frozenset[str]) -> bool:
    """Returns whether ``closed`` or a jaxpr nested in its equations (a scan's body, a call's,
    a cond's branches) has an equation of a primitive named in ``names``."""
    jaxpr = closed.jaxpr if isinstance(closed, ClosedJaxpr) else closed
    return any(calls_primitive(eqn, names) for eqn in jaxpr.eqns)


def calls_primitive(eqn: Any, names: frozenset[str]) -> bool:
    """Returns whether ``eqn`` is of a primitive named in ``names`` or holds a jaxpr that has
    one (``holds_primitive``)."""
    if eqn.primitive.name in names:
        return True
    return any(holds_primitive(inner, names) for inner in _jaxprs_in(eqn.params))


def eval_jaxpr_here(closed: ClosedJaxpr, *args: Any) -> list[Any]:
    """Returns the outputs of ``closed`` applied to ``args``, its equations bound in the caller's
    context (``jaxpr_as_fun`` binds each inside the context recorded when it was traced).

    The lowering runs stage programs inside its ``shard_map``. Bound in its recorded context (no
    mesh), a literal in the program takes the mesh of a ``with jax.set_mesh(...)`` around the
    caller instead of the ``shard_map``'s manual one, and the two do not mix ("Mesh for all
    inputs should be equal").
    """

    return _interpret(closed.jaxpr, closed.consts, args, bind_equation)


def eval_closed_jaxpr(closed: ClosedJaxpr, *args: Any) -> list[Any]:
    """Returns the outputs of ``closed`` applied to ``args``, re-tracing control-flow bodies.

    Use this instead of ``jaxpr_as_fun`` to run a stage program inside ``shard_map``: a
    ``scan``/``while``/``cond`` equation binds a body typed when the jaxpr was traced (values
    not varying over any manual axis), which ``shard_map`` rejects once the operands vary over
    the pipeline axis ("Scan carry input and output got mismatched varying manual axes"). Here
    those bodies are traced again on the actual operands, and loop carries are cast to vary
    over the axes the loop's operands vary over. Calls (jit, custom_jvp/vjp, remat) are
    inlined: the result is for evaluation (and further tracing), not for differentiation with
    the original custom rules.
    """
    return _eval_retraced(closed.jaxpr, closed.consts, args)


def _eval_retraced(jaxpr: Jaxpr, consts: Sequence[Any], args: Sequence[Any]) -> list[Any]:
    def eval_equation(eqn: Any, invals: list[Any]) -> Sequence[Any]:
        rule = _RETRACE_RULES.get(eqn.primitive.name)
        if rule is not None:
            return rule(eqn.params, invals)
        if eqn.primitive.name in CALL_PRIMITIVES | REMAT_PRIMITIVES | _CUSTOM_CALLS:
            body = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
            return _eval_body(body, invals)
        if eqn.primitive.name not in _COLLECTIVES:
            # What lax's wrappers do before binding: operands of one op vary alike.
            invals = _cast_varying(invals, _varying_axes(invals))
        return bind_equation(eqn, invals)

    return _interpret(jaxpr, consts, args, eval_equation)


# Primitives whose typing rule relates input and output variance themselves.
_COLLECTIVES = frozenset(
    {
        "psum",
        "psum_invariant",
        "pmax",
        "pmin",
        "ppermute",
        "pbroadcast",
        "all_gather",
        "all_gather_invariant",
        "all_to_all",
        "reduce_scatter",
        "psum_scatter",
        "axis_index",
        "pvary",
        "pcast",
        "shard_map",
    }
)
_CUSTOM_CALLS = frozenset({"custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr"})


def _eval_body(body: Jaxpr | ClosedJaxpr, args: Sequence[Any]) -> list[Any]:
    if isinstance(body, ClosedJaxpr):
        return _eval_retraced(body.jaxpr, body.consts, args)
    return _eval_retraced(body, (), args)


def _vma(value: Any) -> frozenset:
    # The manual mesh axes a value varies over inside shard_map (empty outside). jax 0.10 keeps
    # them in ``aval.mat.varying``; other releases in ``aval.vma``.
    aval = jax.typeof(value)
    mat = getattr(aval, "mat", None)
    if mat is not None:
        return frozenset(mat.varying)
    return frozenset(getattr(aval, "vma", frozenset()))


def _is_array(value: Any) -> bool:
    return hasattr(jax.typeof(value), "shape")


def _varying_axes(values: Sequence[Any]) -> frozenset:
    axes: frozenset = frozenset()
    for v in values:
        if _is_array(v):
            axes |= _vma(v)
    return axes


def _cast_varying(values: Sequence[Any], axes: frozenset) -> list[Any]:
    # Outside shard_map no value varies, so this is a no-op there.
    out = []
    for v in values:
        missing = tuple(sorted(axes - _vma(v))) if _is_array(v) else ()
        out.append(jax.lax.pcast(v, missing, to="varying") if missing else v)
    return out


def _retrace_scan(params: dict, invals: list) -> list:
    nc, nk = scan_counts(params)
    consts, init, xs = invals[:nc], invals[nc : nc + nk], invals[nc + nk :]
    init = _cast_varying(init, _varying_axes(invals))
    body = params["jaxpr"]

    def step(carry: list, x: list) -> tuple[list, list]:
        outs = _eval_body(body, [*consts, *carry, *x])
        return _cast_varying(outs[:nk], _varying_axes(carry)), outs[nk:]

    carry, ys = jax.lax.scan(
        step,
        init,
        xs,
        length=params["length"],
        reverse=params["reverse"],
        unroll=params.get("unroll", 1),
    )
    return [*carry, *ys]


def _retrace_while(params: dict, invals: list) -> list:
    cn, bn = params["cond_nconsts"], params["body_nconsts"]
    cond_consts, body_consts, init = invals[:cn], invals[cn : cn + bn], invals[cn + bn :]
    init = _cast_varying(init, _varying_axes(invals))

    def cond(carry: list) -> Any:
        return _eval_body(params["cond_jaxpr"], [*cond_consts, *carry])[0]

    def body(carry: list) -> list:
        outs = _eval_body(params["body_jaxpr"], [*body_consts, *carry])
        return _cast_varying(outs, _varying_axes(carry))

    return list(jax.lax.while_loop(cond, body, init))


def _retrace_cond(params: dict, invals: list) -> list:
    index, operands = invals[0], invals[1:]
    branches = [(lambda *ops, _b=b: _eval_body(_b, ops)) for b in params["branches"]]
    if len(branches) == 1:
        return list(branches[0](*operands))
    axes = _varying_axes(invals)
    wrapped = [(lambda *ops, _f=f: _cast_varying(_f(*ops), axes)) for f in branches]
    return list(jax.lax.switch(index, wrapped, *operands))


_RETRACE_RULES = {"scan": _retrace_scan, "while": _retrace_while, "cond": _retrace_cond}


def merge_contracting_dims(closed: ClosedJaxpr) -> ClosedJaxpr:
    """Returns an equivalent ClosedJaxpr whose ``dot_general``s contract over one dimension.

    JAX differentiates ``x @ w`` (``x`` of shape ``[batch, seq, d]``) into a weight gradient
    that contracts ``x`` and the output cotangent over ``(batch, seq)`` together. XLA turns a
    dot with several contracting dimensions into a plain matmul by transposing its operands so
    that the contracting dimensions come last, a full copy of each operand (on XLA:CPU an
    untiled loop, slower than the matmul itself). Where the contracting dimensions are
    adjacent in both operands, in the same order, merging them with a ``reshape`` (free in a
    row-major layout) gives the same contraction with no transpose. Other dots, and
    everything else, are left as they are; bodies of control flow and calls are rewritten
    too. The jaxpr is re-traced only when it holds a dot to merge.
    """
    if not _has_mergeable_dot(closed.jaxpr):
        return closed

    def run(*args: Any) -> list[Any]:
        return _interpret(closed.jaxpr, closed.consts, args, _eval_merged)

    return jax.make_jaxpr(run)(*_shape_structs(closed.in_avals))


def _contracting_run(dimension_numbers: Any) -> tuple[int, int, int] | None:
    """Returns (first lhs dim, first rhs dim, count) when a dot contracts over several
    dimensions that are adjacent and in the same order in both operands, else None."""
    (lhs_contracting, rhs_contracting), _ = dimension_numbers
    if len(lhs_contracting) < 2:
        return None
    pairs = sorted(zip(lhs_contracting, rhs_contracting, strict=True))
    for (l0, r0), (l1, r1) in itertools.pairwise(pairs):
        if l1 != l0 + 1 or r1 != r0 + 1:
            return None
    return pairs[0][0], pairs[0][1], len(pairs)


def _has_mergeable_dot(jaxpr: Jaxpr) -> bool:
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            if _contracting_run(eqn.params["dimension_numbers"]) is not None:
                return True
        elif any(_has_mergeable_dot(sub) for sub in _jaxprs_in(eqn.params)):
            return True
    return False


def _merged_operand(x: Any, first: int, count: int) -> Any:
    shape = x.shape
    merged = math.prod(shape[first : first + count])
    return jax.lax.reshape(x, (*shape[:first], merged, *shape[first + count :]))


def _eval_merged(eqn: Any, invals: list[Any]) -> Sequence[Any]:
    params = eqn.params
    if eqn.primitive.name == "dot_general":
        run = _contracting_run(params["dimension_numbers"])
        if run is not None:
            lhs_first, rhs_first, count = run
            _, (lhs_batch, rhs_batch) = params["dimension_numbers"]

            def shifted(dims: Sequence[int], first: int) -> tuple[int, ...]:
                return tuple(d if d < first else d - count + 1 for d in dims)

            merged = (
                ((lhs_first,), (rhs_first,)),
                (shifted(lhs_batch, lhs_first), shifted(rhs_batch, rhs_first)),
            )
            lhs = _merged_operand(invals[0], lhs_first, count)
            rhs = _merged_operand(invals[1], rhs_first, count)
            with equation_source(eqn):
                return [eqn.primitive.bind(lhs, rhs, **dict(params, dimension_numbers=merged))]
    else:
        rewritten = {k: _map_closed_jaxprs(v, merge_contracting_dims) for k, v in params.items()}
        if any(rewritten[k] is not v for k, v in params.items()):
            eqn = replace_equation(eqn, eqn.invars, eqn.outvars, rewritten)
    return bind_equation(eqn, invals)


def _map_closed_jaxprs(value: Any, fn: Callable[[ClosedJaxpr], ClosedJaxpr]) -> Any:
    """Returns ``value`` (an equation's param) with ``fn`` applied to each ClosedJaxpr in it;
    ``value`` itself where nothing changed."""
    if isinstance(value, ClosedJaxpr):
        return fn(value)
    if isinstance(value, tuple) and any(isinstance(v, ClosedJaxpr) for v in value):
        mapped = tuple(_map_closed_jaxprs(v, fn) for v in value)
        return value if all(m is v for m, v in zip(mapped, value, strict=True)) else mapped
    return value


def unroll_short_scans(closed: ClosedJaxpr, max_length: int) -> ClosedJaxpr:
    """Returns ``closed`` with every ``scan`` of at most ``max_length`` iterations unrolled.

    Only the scan's ``unroll`` param changes (to its length), so the equations, their operands
    and results stay as they are, and XLA compiles the iterations as straight-line code: no
    loop that slices each iteration's weights and residuals out of the stacked operands and
    writes each iteration's results into the stacked ones, and fusion across iterations.
    Scans nested in control flow and calls are unrolled too.
    """
    eqns, changed = [], False
    for eqn in closed.jaxpr.eqns:
        params = {
            k: _map_closed_jaxprs(v, lambda c: unroll_short_scans(c, max_length))
            for k, v in eqn.params.items()
        }
        if eqn.primitive.name == "scan" and 1 < params["length"] <= max_length:
            params["unroll"] = params["length"]
        if any(params[k] is not v for k, v in eqn.params.items()):
            eqn = replace_equation(eqn, eqn.invars, eqn.outvars, params)
            changed = True
        eqns.append(eqn)
    if not changed:
        return closed
    jaxpr = closed.jaxpr
    return make_closed_jaxpr(jaxpr.invars, jaxpr.outvars, eqns, jaxpr.constvars, closed.consts)


def same_jaxpr(a: ClosedJaxpr, b: ClosedJaxpr) -> bool:
    """Returns whether ``a`` and ``b`` are one program written twice: equal constants, and
    equation by equation the same primitive, params, effects and name stack, reading and
    writing the same variables up to their names (nested jaxprs compared the same way).

    Whatever is derived from one (its vjp, its split, its lowering) is then right for the
    other. The comparison errs on the side of "different": a param it cannot compare (a rule
    held as a function object other than the same one, a traced constant) makes the two
    differ. Source tracebacks are not compared.
    """
    if not _same_list(a.consts, b.consts, _same_value):
        return False
    return _same_open(a.jaxpr, b.jaxpr)


def _same_list(xs: Sequence[Any], ys: Sequence[Any], same: Callable[[Any, Any], bool]) -> bool:
    return len(xs) == len(ys) and all(same(x, y) for x, y in zip(xs, ys, strict=True))


def _same_value(x: Any, y: Any) -> bool:
    """Whether two constants or params are equal (arrays by their elements)."""
    if x is y:
        return True
    if isinstance(x, ClosedJaxpr | Jaxpr) or isinstance(y, ClosedJaxpr | Jaxpr):
        if type(x) is not type(y):
            return False
        return same_jaxpr(x, y) if isinstance(x, ClosedJaxpr) else _same_open(x, y)
    if isinstance(x, tuple | list) or isinstance(y, tuple | list):
        return type(x) is type(y) and _same_list(x, y, _same_value)
    if isinstance(x, dict) or isinstance(y, dict):
        return (
            type(x) is type(y) and x.keys() == y.keys() and all(_same_value(x[k], y[k]) for k in x)
        )
    if isinstance(x, jax.core.Tracer) or isinstance(y, jax.core.Tracer):
        return False  # a traced constant: its value is unknown here
    if isinstance(x, np.ndarray | jax.Array | np.generic) or isinstance(
        y, np.ndarray | jax.Array | np.generic
    ):
        if np.shape(x) != np.shape(y) or np.result_type(x) != np.result_type(y):
            return False
        return _same_bits(np.asarray(x), np.asarray(y))
    if type(x) is not type(y):
        return False
    if isinstance(x, float | complex):
        return _same_bits(np.asarray(x), np.asarray(y))
    try:
        return bool(x == y)
    except Exception:  # noqa: BLE001 - a value without a usable equality: treat as different
        return False


def _same_bits(x: np.ndarray, y: np.ndarray) -> bool:
    """Whether two arrays of one shape and dtype hold the same bits: 0.0 and -0.0 differ (they
    give different results: 1 / x), and a NaN equals the same NaN."""
    return np.ascontiguousarray(x).tobytes() == np.ascontiguousarray(y).tobytes()


def _same_open(a: Jaxpr, b: Jaxpr) -> bool:
    counts = (len(a.constvars), len(a.invars), len(a.outvars), len(a.eqns))
    if counts != (len(b.constvars), len(b.invars), len(b.outvars), len(b.eqns)):
        return False
    names: dict[Var, Var] = {}  # a's variable -> b's

    def define(xs: Sequence[Any], ys: Sequence[Any]) -> bool:
        for x, y in zip(xs, ys, strict=True):
            if is_drop_var(x) or is_drop_var(y):
                if not (is_drop_var(x) and is_drop_var(y) and x.aval == y.aval):
                    return False
                continue
            if x.aval != y.aval:
                return False
            names[x] = y
        return True

    def read(x: Any, y: Any) -> bool:
        if is_literal(x) or is_literal(y):
            return (
                is_literal(x) and is_literal(y) and x.aval == y.aval and _same_value(x.val, y.val)
            )
        return names.get(x) is y

    if not define(a.constvars, b.constvars) or not define(a.invars, b.invars):
        return False
    for ea, eb in zip(a.eqns, b.eqns, strict=True):
        if (
            ea.primitive is not eb.primitive
            or ea.effects != eb.effects
            or ea.source_info.name_stack != eb.source_info.name_stack
            or len(ea.invars) != len(eb.invars)
            or len(ea.outvars) != len(eb.outvars)
            or not all(read(x, y) for x, y in zip(ea.invars, eb.invars, strict=True))
            or not _same_value(ea.params, eb.params)
            or not define(ea.outvars, eb.outvars)
        ):
            return False
    return all(read(x, y) for x, y in zip(a.outvars, b.outvars, strict=True))


# ----------------------------------------------------------------------------------------------
# Section: sharding annotations (owner: partition engineer)
# ----------------------------------------------------------------------------------------------

# Primitives that only say where their operands are placed (``with_sharding_constraint``,
# ``jax.sharding.reshard``, layouts, ``jax.device_put`` inside a traced function): each result
# is its operand.
_PLACEMENT_PRIMITIVES = frozenset(
    {"sharding_constraint", "reshard", "layout_constraint", "device_put"}
)
# Params by which an equation places its result (``out_sharding=`` of ``jnp.einsum`` and friends,
# the shardings of values typed by an explicit-axes mesh); ``None`` leaves placement to XLA.
_SHARDING_PARAMS = ("sharding", "out_sharding")


def strip_sharding_annotations(closed: ClosedJaxpr) -> tuple[ClosedJaxpr, list[Any]]:
    """Returns ``closed`` without sharding annotations, and (sharding, shape of the value) of
    each annotation dropped.

    The annotations name mesh axes of the mesh the function was written for; inside a pipeline's
    ``shard_map``, which is manual over those axes, binding them fails ("Mesh for all inputs
    should be equal"). They never change a value, so dropping them changes no result: each
    placement equation becomes its operand, each ``sharding``/``out_sharding`` param ``None``,
    in bodies of control flow too. A function traced inside ``with jax.set_mesh(...)`` records
    the mesh as well, and fails the same way: in its values' types, its equations' contexts,
    its literals' types, and the rules of its custom_jvp/custom_vjp functions (traced when
    differentiated, on the first trace's operand types). Such a program is re-traced outside
    any mesh, its literals retyped and its rules stripped when they are traced. A ``jit``
    holding any of these is inlined; a rematerialised region keeps its policy. Any other
    program is returned as it is.
    """
    found: list[Any] = []
    if not _annotated(closed.jaxpr):
        return closed, found
    return _strip_closed(closed, found), found


def sharded_axes(sharding: Any) -> list[tuple[int, str]]:
    """Returns the (dimension, mesh axis) pairs a sharding (or PartitionSpec) splits."""
    spec = getattr(sharding, "spec", sharding)
    if not isinstance(spec, jax.sharding.PartitionSpec):
        return []
    pairs = []
    for dim, entry in enumerate(spec):
        names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        pairs.extend((dim, name) for name in names if isinstance(name, str))
    return pairs


def _annotated(jaxpr: Jaxpr) -> bool:
    if any(_has_mesh(v) for v in jaxpr.invars):
        return True
    for eqn in jaxpr.eqns:
        if any(_has_mesh(v) for v in eqn.outvars):
            return True
        if _traced_under_mesh(eqn) or eqn.primitive.name in _PLACEMENT_PRIMITIVES:
            return True
        if any(eqn.params.get(k) is not None for k in _SHARDING_PARAMS):
            return True
        if any(_annotated(sub) for sub in _jaxprs_in(eqn.params)):
            return True
    return False


def _has_mesh(var: Any) -> bool:
    """Whether a variable's type names a mesh (a value traced under one, or constrained)."""
    mesh = getattr(getattr(getattr(var, "aval", None), "sharding", None), "mesh", None)
    return mesh is not None and not mesh.empty


def _traced_under_mesh(eqn: Any) -> bool:
    """Whether ``eqn`` was traced under a mesh context (``jax.set_mesh``): evaluating it enters
    that mesh again, which inside a ``shard_map`` clashes with the manual one."""
    mesh = getattr(getattr(eqn, "ctx", None), "cur_abstract_mesh", None)
    return mesh is not None and not mesh.empty


def _strip_closed(closed: ClosedJaxpr, found: list[Any]) -> ClosedJaxpr:
    def run(*args: Any) -> list[Any]:
        return _strip_eval(closed.jaxpr, closed.consts, args, found)

    with no_mesh_context():  # so that no equation records the caller's mesh
        return jax.make_jaxpr(run)(*_shape_structs(closed.in_avals))


@contextlib.contextmanager
def no_mesh_context() -> Iterator[None]:
    """A context in which no mesh is set (as outside ``with jax.set_mesh(...)``).

    zbjax builds its stage programs in it: an equation traced under a mesh context records it
    and enters it again when evaluated, and inside the pipeline's ``shard_map`` that mesh
    clashes with the manual one ("context mesh ... should match the aval mesh").
    """
    from jax._src import mesh as mesh_lib
    from jax._src.sharding_impls import _internal_use_concrete_mesh

    # ``jax.set_mesh`` sets a concrete mesh too, which JAX reads where no abstract one is set.
    with (
        jax.sharding.use_abstract_mesh(mesh_lib.empty_abstract_mesh),
        _internal_use_concrete_mesh(mesh_lib.empty_concrete_mesh),
    ):
        yield


def _strip_eval(jaxpr: Jaxpr, consts: Sequence[Any], args: Sequence[Any], found: list) -> list:
    def eval_equation(eqn: Any, invals: list[Any]) -> Sequence[Any]:
        name = eqn.primitive.name
        params = eqn.params
        if name in _PLACEMENT_PRIMITIVES:
            for k in ("sharding", "dst_sharding", "devices"):
                value = params.get(k)
                if value is None:
                    continue
                targets = value if isinstance(value, tuple | list) else [value] * len(invals)
                found.extend(zip(targets, (np.shape(x) for x in invals), strict=False))
            return invals
        if name in CALL_PRIMITIVES and any(_annotated(s) for s in _jaxprs_in(params)):
            return _strip_eval(params["jaxpr"].jaxpr, params["jaxpr"].consts, invals, found)
        new = dict(params)
        for k in _SHARDING_PARAMS:
            if new.get(k) is not None:
                found.append((new[k], tuple(eqn.outvars[0].aval.shape)))
                new[k] = None
        for k, v in new.items():
            if isinstance(v, Jaxpr) and _annotated(v):  # a remat region's open body
                body = _strip_closed(ClosedJaxpr(v, ()), found)
                if body.consts:  # cannot stay an open body: run it inline, remat dropped
                    return _strip_eval(body.jaxpr, body.consts, invals, found)
                new[k] = body.jaxpr
            else:
                new[k] = _map_closed_jaxprs(
                    v, lambda c: _strip_closed(c, found) if _annotated(c.jaxpr) else c
                )
        for k in _RULE_THUNKS:
            if k in new:
                new[k] = _stripped_rule(new[k], found)
        if any(new[k] is not v for k, v in params.items()):
            eqn = replace_equation(eqn, eqn.invars, eqn.outvars, new)
        return bind_equation(eqn, invals)

    return _interpret(jaxpr, consts, args, eval_equation, _unplaced_literal)


def _unplaced_literal(value: Any) -> Any:
    """Returns a literal's value without the mesh its type recorded when traced under one."""
    from jax._src.core import ShapedArray
    from jax._src.literals import TypedNdArray

    aval = getattr(value, "aval", None)
    mesh = getattr(getattr(aval, "sharding", None), "mesh", None)
    if not isinstance(value, TypedNdArray) or mesh is None or mesh.empty:
        return value
    return TypedNdArray(np.asarray(value), ShapedArray(aval.shape, aval.dtype, aval.weak_type))


# Params of custom_jvp / custom_vjp equations that trace the user's rule when differentiated,
# on the operand types of the original trace (which name the caller's mesh).
_RULE_THUNKS = ("jvp_jaxpr_fun", "fwd_jaxpr_thunk")


def _stripped_rule(thunk: Any, found: list[Any]) -> Any:
    """Returns ``thunk`` (-> (jaxpr, consts, *rest)) with its jaxpr stripped as above."""
    from jax._src import linear_util as lu

    done: dict[tuple, tuple] = {}

    def call(*zeros: Any) -> tuple:
        if zeros not in done:
            jaxpr, consts, *rest = thunk.call_wrapped(*zeros)
            closed = _strip_closed(ClosedJaxpr(jaxpr, list(consts)), found)
            done[zeros] = (closed.jaxpr, closed.consts, *rest)
        return done[zeros]

    return lu.wrap_init(call, debug_info=thunk.debug_info)


# ----------------------------------------------------------------------------------------------
# Section: buffers (owner: lowering engineer)
# ----------------------------------------------------------------------------------------------


def uninitialized(shape: tuple[int, ...], dtype: Any) -> jax.Array:
    """Returns an array whose contents the caller overwrites before reading them.

    ``jax.lax.empty`` lets backends skip initialising (GPU allocates without writing; CPU still
    fills zeros); releases without it get zeros.
    """
    empty = getattr(jax.lax, "empty", None)
    if empty is None:
        return jax.numpy.zeros(shape, dtype)
    return empty(shape, dtype)


def in_host_memory(aval: Any) -> bool:
    """Returns whether ``aval`` (a traced value's type) lies in host memory."""
    memory = getattr(jax, "memory", None)
    space = getattr(aval, "memory_space", None)
    return memory is not None and space is not None and space == memory.Space.Host


def on_device_memory(x: jax.Array) -> jax.Array:
    """Returns ``x`` in device memory: a value a ``jax.checkpoint`` offload policy put in host
    memory (``offload_dot_with_no_batch_dims``) is moved back, since the step's arenas are
    device arrays (``dynamic_update_slice`` refuses to mix memory spaces)."""
    if not in_host_memory(jax.typeof(x)):
        return x
    return jax.device_put(x, jax.memory.Space.Device)


def set_rows(x: jax.Array, start: int, value: jax.Array) -> jax.Array:
    """Returns ``x`` with rows ``start : start + len(value)`` (axis 0) replaced by ``value``.

    Same as ``x.at[start : start + n].set(value)``, but never a scatter: a static slice that
    covers all of ``x`` lowers to a scatter with zero-size indices, and jax 0.11's Shardy
    partitioner crashes the process compiling one inside ``shard_map``. This is an in-place
    ``dynamic_update_slice`` (or just ``value`` when it covers ``x``).
    """
    value = value.astype(x.dtype)
    if start == 0 and value.shape == x.shape:
        return value
    return jax.lax.dynamic_update_slice_in_dim(x, value, start, 0)


def add_rows(x: jax.Array, start: int, value: jax.Array) -> jax.Array:
    """Returns ``x`` with ``value`` added to rows ``start : start + len(value)`` (axis 0):
    ``x.at[start : start + n].add(value)`` without a scatter (see ``set_rows``)."""
    value = value.astype(x.dtype)
    if start == 0 and value.shape == x.shape:
        return x + value
    rows = jax.lax.slice_in_dim(x, start, start + value.shape[0], axis=0)
    return jax.lax.dynamic_update_slice_in_dim(x, rows + value, start, 0)


# ----------------------------------------------------------------------------------------------
# Section: shard_map (owner: lowering engineer)
# ----------------------------------------------------------------------------------------------


def _is_spec(x: Any) -> bool:
    return x is None or isinstance(x, jax.sharding.PartitionSpec)


def _local_shape(shape: tuple[int, ...], spec: Any, mesh: Any) -> tuple[int, ...]:
    """Returns the per-device shape of a global ``shape`` split by ``spec`` over ``mesh``."""
    local = list(shape)
    for d, entry in enumerate(tuple(spec or ())):
        names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        for name in names:
            local[d] //= mesh.shape[name]
    return tuple(local)


def shard_map(fn: Callable, *, mesh: Any, in_specs: Any, **kwargs: Any) -> Callable:
    """``jax.shard_map``, except that zero-size inputs do not cross into the manual region.

    jax 0.11's Shardy partitioner crashes the process (a segfault while compiling, on XLA:CPU)
    when a zero-size array is an operand of a ``shard_map``. A zero-size array holds no data, so
    each one is dropped from the operands and made afresh (zeros of its per-device shape) inside
    the body instead. ``in_specs`` may be a prefix of the arguments, as for ``jax.shard_map``.
    """

    def call(*args: Any) -> Any:
        # One spec for every argument, or one per argument (each a prefix of it).
        per_arg = (in_specs,) * len(args) if _is_spec(in_specs) else tuple(in_specs)
        specs = jax.tree.map(
            lambda spec, sub: jax.tree.map(lambda _: spec, sub), per_arg, args, is_leaf=_is_spec
        )
        leaves, treedef = jax.tree.flatten(args)
        spec_leaves = jax.tree.leaves(specs, is_leaf=_is_spec)
        empty = {
            i: (_local_shape(x.shape, s, mesh), x.dtype)
            for i, (x, s) in enumerate(zip(leaves, spec_leaves, strict=True))
            if x.size == 0
        }
        if not empty:
            return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, **kwargs)(*args)
        kept = [i for i in range(len(leaves)) if i not in empty]

        def body(*kept_leaves: Any) -> Any:
            full = [None] * len(leaves)
            for i, x in zip(kept, kept_leaves, strict=True):
                full[i] = x
            for i, (shape, dtype) in empty.items():
                full[i] = jax.numpy.zeros(shape, dtype)
            return fn(*jax.tree.unflatten(treedef, full))

        kept_specs = tuple(spec_leaves[i] for i in kept)
        inner = jax.shard_map(body, mesh=mesh, in_specs=kept_specs, **kwargs)
        return inner(*(leaves[i] for i in kept))

    return call


def place_for_shard_map(mesh: Any, args: Any, specs: Any) -> Any:
    """Returns ``args`` resharded to ``specs`` (a tree of ``PartitionSpec``, a prefix of
    ``args``) when ``mesh`` has explicit axes, else ``args`` as they are.

    Under explicit sharding ``shard_map`` takes inputs only when they already carry its
    ``in_specs``; resharding one placed that way already is a no-op.
    """
    types = dict(zip(mesh.axis_names, getattr(mesh, "axis_types", ()), strict=False))
    explicit = {a for a, t in types.items() if t == jax.sharding.AxisType.Explicit}
    if not explicit:
        return args

    def explicit_part(entry: Any) -> Any:
        # jax.reshard takes explicit axes only: on a mesh that mixes types, an Auto axis of
        # the spec is left to shard_map (which splits the input over it itself).
        names = entry if isinstance(entry, tuple) else (entry,)
        kept = tuple(n for n in names if n in explicit)
        return None if not kept else kept if isinstance(entry, tuple) else kept[0]

    def place(spec: Any, sub: Any) -> Any:
        spec = jax.sharding.PartitionSpec(*(explicit_part(e) for e in spec))
        return jax.tree.map(lambda x: jax.reshard(x, jax.sharding.NamedSharding(mesh, spec)), sub)

    return jax.tree.map(place, specs, args, is_leaf=_is_spec)
