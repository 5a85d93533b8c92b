"""Jaxpr surgery helpers: the ONLY zbjax module that may import ``jax._src`` internals.

Internal jaxpr APIs move between JAX releases (0.10 here, 0.11 on GPU machines); keeping every
use of them here means a release bump touches one file. Each helper is a plain function from
jaxprs to jaxprs. Sections are owned by the engineer named in their header; append new helpers
in your own section.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
from jax.extend.core import (
    ClosedJaxpr,
    DebugInfo,
    DropVar,
    Jaxpr,
    Literal,
    Var,
    new_jaxpr_eqn,
)

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


def replace_equation(eqn: Any, invars: Sequence[Any], outvars: Sequence[Var], params: dict) -> Any:
    """Returns a copy of ``eqn`` with new operands, results and params (same primitive)."""
    sub_effects = [j.effects for j in _jaxprs_in(params)]
    effects = frozenset().union(*sub_effects) if sub_effects else eqn.effects
    return new_jaxpr_eqn(
        list(invars), list(outvars), eqn.primitive, params, effects, eqn.source_info, eqn.ctx
    )


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
    avals = [
        jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=getattr(a, "weak_type", False))
        for a in closed.in_avals
    ]

    def run(*args: Any) -> list[Any]:
        return _eval_inlined(closed.jaxpr, closed.consts, args, inline_remat)

    return jax.make_jaxpr(run)(*avals)


def _eval_inlined(jaxpr: Jaxpr, consts: Sequence[Any], args: Sequence[Any], remat: bool) -> list:
    env: dict[Var, Any] = {}

    def read(atom: Any) -> Any:
        return atom.val if isinstance(atom, Literal) else env[atom]

    for var, val in zip(jaxpr.constvars, consts, strict=True):
        env[var] = val
    for var, val in zip(jaxpr.invars, args, strict=True):
        env[var] = val
    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        name = eqn.primitive.name
        if name in CALL_PRIMITIVES or (remat and name in REMAT_PRIMITIVES):
            body = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
            if isinstance(body, ClosedJaxpr):
                outs = _eval_inlined(body.jaxpr, body.consts, invals, remat)
            else:
                outs = _eval_inlined(body, (), invals, remat)
        elif name == "scan":
            params = dict(eqn.params, jaxpr=inline_calls(eqn.params["jaxpr"], inline_remat=remat))
            outs = eqn.primitive.bind(*invals, **params)
        else:
            outs = _bind_like(eqn, invals)
        if not eqn.primitive.multiple_results:
            outs = [outs]
        for var, val in zip(eqn.outvars, outs, strict=True):
            if not isinstance(var, DropVar):
                env[var] = val
    return [read(v) for v in jaxpr.outvars]


def _bind_like(eqn: Any, invals: Sequence[Any]) -> Any:
    # jax 0.10 returns the bind params (call primitives put their body in ``subfuns``); older
    # releases returned (subfuns, params).
    bind_params = eqn.primitive.get_bind_params(eqn.params)
    if isinstance(bind_params, tuple):
        subfuns, bind_params = bind_params
        return eqn.primitive.bind(*subfuns, *invals, **bind_params)
    return eqn.primitive.bind(*invals, **bind_params)


def _jaxprs_in(params: dict) -> list[Jaxpr]:
    found = []
    for value in params.values():
        for v in value if isinstance(value, tuple) else (value,):
            if isinstance(v, ClosedJaxpr):
                found.append(v.jaxpr)
            elif isinstance(v, Jaxpr):
                found.append(v)
    return found
