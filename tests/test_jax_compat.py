"""The release shims in zbjax._jax_compat: shard_map without zero-size operands, row updates
without scatters, and scan params on jax 0.10 (counts) and 0.11 (flat trees); and the jaxpr
pass that merges a dot's adjacent contracting dimensions into one.

Each of these crashed or broke on jax 0.11.2 before its shim: a zero-size shard_map operand and
a whole-array ``.at[a:b]`` update inside shard_map both segfault Shardy's partitioner while
compiling, and a scan's params lost ``num_consts`` / ``num_carry``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from zbjax._jax_compat import (
    add_rows,
    merge_contracting_dims,
    same_jaxpr,
    scan_counts,
    scan_params,
    set_rows,
    shard_map,
    unroll_short_scans,
)

AUTO = jax.sharding.AxisType.Auto


def mesh2():
    return jax.make_mesh((2,), ("pp",), axis_types=(AUTO,), devices=jax.devices()[:2])


@pytest.mark.parametrize("spec", [P(), P("pp")], ids=["replicated", "sharded"])
def test_shard_map_takes_zero_size_operands_and_hands_the_body_their_local_shape(spec):
    empty = jnp.zeros((2, 3, 0), jnp.float32)
    seen = []

    def body(x, pair):
        e, y = pair
        seen.append(e.shape)
        return x * 2 + y, e, jnp.sum(e)

    run = shard_map(
        body,
        mesh=mesh2(),
        in_specs=(P("pp"), (spec, P("pp"))),
        out_specs=(P("pp"), spec, P()),
        check_vma=False,
    )
    x, y = jnp.arange(4.0), jnp.ones(4)
    out, e, total = jax.jit(run)(x, (empty, y))
    np.testing.assert_array_equal(out, x * 2 + 1)
    assert e.shape == (2, 3, 0) and float(total) == 0.0
    assert seen == [(1, 3, 0) if spec == P("pp") else (2, 3, 0)]


def test_shard_map_without_zero_size_operands_is_jax_shard_map():
    run = shard_map(lambda x: x + 1, mesh=mesh2(), in_specs=P("pp"), out_specs=P("pp"))
    np.testing.assert_array_equal(jax.jit(run)(jnp.arange(4.0)), jnp.arange(4.0) + 1)


@pytest.mark.parametrize(("start", "size"), [(0, 4), (0, 2), (1, 3), (3, 1)])
def test_row_updates_equal_at_set_and_add_inside_shard_map(start, size):
    rows = jnp.arange(8.0).reshape(2, 4).T.reshape(-1)  # 4 rows per device
    value = jnp.arange(2 * size, dtype=jnp.float32) * 10

    def body(r, v):
        return set_rows(r, start, v), add_rows(r, start, v)

    run = shard_map(body, mesh=mesh2(), in_specs=P("pp"), out_specs=P("pp"))
    got_set, got_add = jax.jit(run)(rows, value)
    for d in range(2):
        r, v = rows[4 * d : 4 * d + 4], value[size * d : size * d + size]
        np.testing.assert_array_equal(got_set[4 * d : 4 * d + 4], r.at[start : start + size].set(v))
        np.testing.assert_array_equal(got_add[4 * d : 4 * d + 4], r.at[start : start + size].add(v))


def test_row_updates_cast_to_the_rows_dtype_and_work_on_2d_rows():
    x = jnp.zeros((3, 2), jnp.bfloat16)
    v = jnp.ones((2, 2), jnp.float32)
    assert set_rows(x, 1, v).dtype == jnp.bfloat16
    np.testing.assert_array_equal(add_rows(x, 1, v), x.at[1:3].add(v.astype(jnp.bfloat16)))


def _scan_equation(fn, *args):
    closed = jax.make_jaxpr(fn)(*args)
    (eqn,) = [e for e in closed.jaxpr.eqns if e.primitive.name == "scan"]
    return eqn


def test_scan_counts_and_params_rebuild_an_equal_scan():
    w = jnp.float32(0.5)

    def f(h, total, xs):
        def step(carry, x):
            h, t = carry
            h = jnp.tanh(h * w + x)
            return (h, t + h), 2 * h

        return jax.lax.scan(step, (h, total), xs)

    args = (jnp.float32(0.1), jnp.float32(0.0), jnp.arange(5.0))
    eqn = _scan_equation(f, *args)
    num_consts, num_carry = scan_counts(eqn.params)
    assert (num_consts, num_carry) == (1, 2)
    params = scan_params(eqn.params, eqn.params["jaxpr"], num_consts, num_carry)
    rebuilt = eqn.primitive.bind(w, *args, **params)
    (h, total), ys = f(*args)
    np.testing.assert_allclose(rebuilt[0], h, rtol=1e-6)
    np.testing.assert_allclose(rebuilt[1], total, rtol=1e-6)
    np.testing.assert_allclose(rebuilt[2], ys, rtol=1e-6)


def test_scan_params_describe_a_body_with_other_counts():
    def f(xs):
        return jax.lax.scan(lambda c, x: (c + x, c * x), jnp.float32(0.0), xs)

    eqn = _scan_equation(f, jnp.arange(3.0))
    assert scan_counts(eqn.params) == (0, 1)

    # The same body seen as carry-less: a const (the carry's start) and one scanned input.
    body = eqn.params["jaxpr"]
    params = scan_params(eqn.params, body, num_consts=1, num_carry=0)
    assert scan_counts(params) == (1, 0)
    outs = eqn.primitive.bind(jnp.float32(2.0), jnp.arange(3.0), **params)
    np.testing.assert_array_equal(outs[0], 2.0 + jnp.arange(3.0))
    np.testing.assert_array_equal(outs[1], 2.0 * jnp.arange(3.0))


def _equations(closed, primitive):
    """Every equation of ``primitive`` in ``closed``, control-flow and call bodies too."""
    found = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == primitive:
                found.append(eqn)
            for value in eqn.params.values():
                for sub in value if isinstance(value, tuple) else (value,):
                    if isinstance(sub, jax.extend.core.ClosedJaxpr):
                        walk(sub.jaxpr)

    walk(closed.jaxpr)
    return found


def _contracting_counts(closed):
    """The number of contracting dimensions of every dot_general, nested ones too."""
    return [len(e.params["dimension_numbers"][0][0]) for e in _equations(closed, "dot_general")]


def _dense_weight_gradient(x, dy):
    w = jnp.zeros((x.shape[-1], dy.shape[-1]), x.dtype)
    return jax.vjp(lambda w: x @ w, w)[1](dy)[0]


def test_merged_weight_gradient_contracts_one_dimension_and_equals_jax():
    x = jax.random.normal(jax.random.key(0), (4, 6, 8))
    dy = jax.random.normal(jax.random.key(1), (4, 6, 5))
    closed = jax.make_jaxpr(_dense_weight_gradient)(x, dy)
    # the forward's x @ w, then the weight gradient, which contracts (batch, seq) together
    assert _contracting_counts(closed) == [1, 2]
    merged = merge_contracting_dims(closed)
    assert _contracting_counts(merged) == [1, 1]
    assert merged.out_avals == closed.out_avals
    want = jax.jit(jax.extend.core.jaxpr_as_fun(closed))(x, dy)[0]
    got = jax.jit(jax.extend.core.jaxpr_as_fun(merged))(x, dy)[0]
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(got, jnp.einsum("bsi,bso->io", x, dy), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "lhs_shape, rhs_shape, dims, merged_count",
    [
        # contracting (1, 2) after a batch dim 0: the batch dims stay where they are
        ((3, 4, 5, 6), (3, 4, 5, 7), (((1, 2), (1, 2)), ((0,), (0,))), 1),
        # contracting dims before a batch dim: the batch dims shift down
        ((4, 5, 3, 6), (3, 4, 5, 7), (((0, 1), (1, 2)), ((2,), (0,))), 1),
        # three adjacent dims, listed out of order but paired alike in both operands
        ((2, 3, 4, 6), (2, 3, 4, 5), (((2, 0, 1), (2, 0, 1)), ((), ())), 1),
        # not adjacent in the lhs: left as it is
        ((4, 6, 5), (4, 5, 7), (((0, 2), (0, 1)), ((), ())), 2),
        # adjacent in both, but paired in opposite orders: left as it is
        ((4, 5, 6), (5, 4, 7), (((0, 1), (1, 0)), ((), ())), 2),
    ],
)
def test_merge_contracting_dims_keeps_every_dot_equal(lhs_shape, rhs_shape, dims, merged_count):
    lhs = jax.random.normal(jax.random.key(2), lhs_shape)
    rhs = jax.random.normal(jax.random.key(3), rhs_shape)
    closed = jax.make_jaxpr(lambda a, b: jax.lax.dot_general(a, b, dims))(lhs, rhs)
    merged = merge_contracting_dims(closed)
    assert _contracting_counts(merged) == [merged_count]
    if merged_count > 1:
        assert merged is closed  # nothing to merge: not even re-traced
    got = jax.extend.core.jaxpr_as_fun(merged)(lhs, rhs)[0]
    np.testing.assert_allclose(got, jax.lax.dot_general(lhs, rhs, dims), rtol=1e-5, atol=1e-5)


def test_merge_contracting_dims_rewrites_scan_and_cond_bodies():
    xs = jax.random.normal(jax.random.key(4), (3, 4, 6, 8))
    dys = jax.random.normal(jax.random.key(5), (3, 4, 6, 5))

    def fn(xs, dys, flag):
        def step(carry, pair):
            x, dy = pair
            g = jax.lax.cond(
                flag, _dense_weight_gradient, lambda x, dy: -_dense_weight_gradient(x, dy), x, dy
            )
            return carry + g, g

        return jax.lax.scan(step, jnp.zeros((8, 5)), (xs, dys))

    closed = jax.make_jaxpr(fn)(xs, dys, True)
    assert _contracting_counts(closed) == [1, 2, 1, 2]  # per cond branch: forward, gradient
    merged = merge_contracting_dims(closed)
    assert _contracting_counts(merged) == [1, 1, 1, 1]
    for flag in (True, False):
        want = jax.extend.core.jaxpr_as_fun(closed)(xs, dys, flag)
        got = jax.extend.core.jaxpr_as_fun(merged)(xs, dys, flag)
        for g, w in zip(got, want, strict=True):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


def _scan_unrolls(closed):
    """(length, unroll) of every scan, nested ones too."""
    return [(e.params["length"], e.params["unroll"]) for e in _equations(closed, "scan")]


def test_unroll_short_scans_unrolls_only_scans_up_to_the_length_and_keeps_values():
    def fn(x):
        def inner(c, _):
            return jnp.sin(c) * 1.5, c

        def outer(c, _):
            c, ys = jax.lax.scan(inner, c, None, length=3)
            return c, ys.sum()

        c, _ = jax.lax.scan(outer, x, None, length=2)
        return jax.lax.scan(lambda c, _: (c + 1.0, c), c, None, length=6)

    x = jnp.arange(4.0)
    closed = jax.make_jaxpr(fn)(x)
    assert sorted(_scan_unrolls(closed)) == [(2, 1), (3, 1), (6, 1)]
    unrolled = unroll_short_scans(closed, 3)
    assert sorted(_scan_unrolls(unrolled)) == [(2, 2), (3, 3), (6, 1)]
    assert [e.primitive.name for e in unrolled.jaxpr.eqns] == [
        e.primitive.name for e in closed.jaxpr.eqns
    ]
    want = jax.extend.core.jaxpr_as_fun(closed)(x)
    got = jax.jit(jax.extend.core.jaxpr_as_fun(unrolled))(x)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-6)
    assert unroll_short_scans(closed, 1) is closed  # nothing to unroll: the same jaxpr


def _scan_sum(w, xs, scale):
    def body(c, x):
        return c + jnp.tanh(x @ w) * scale, None

    return jax.lax.scan(body, jnp.zeros(xs.shape[1:]), xs)[0]


def test_same_jaxpr_holds_for_one_program_traced_twice_and_not_for_any_change():
    w, x = jnp.ones((4, 4)), jnp.ones((3, 4))
    table = np.arange(4.0, dtype=np.float32)

    def base(w, x):
        return jnp.sum(jnp.tanh(x @ w) * 2.0 - x, axis=1)

    variants = {
        "literal": lambda w, x: jnp.sum(jnp.tanh(x @ w) * 3.0 - x, axis=1),
        "param": lambda w, x: jnp.sum(jnp.tanh(x @ w) * 2.0 - x, axis=0)[:3],
        "operands swapped": lambda w, x: jnp.sum(x - jnp.tanh(x @ w) * 2.0, axis=1),
        "primitive": lambda w, x: jnp.sum(jnp.sin(x @ w) * 2.0 - x, axis=1),
        "name stack": lambda w, x: jax.named_scope("block_2")(base)(w, x),
    }
    # Two traces (make_jaxpr caches by function, so two functions): new variables, same program.
    first = jax.make_jaxpr(lambda w, x: base(w, x))(w, x)
    again = jax.make_jaxpr(lambda w, x: base(w, x))(w, x)
    assert first.jaxpr.invars[0] is not again.jaxpr.invars[0]
    assert same_jaxpr(first, again)
    for name, fn in variants.items():
        assert not same_jaxpr(first, jax.make_jaxpr(fn)(w, x)), name

    # Constants compare by value; a different value or shape is a different program.
    def with_table(t):
        return jax.make_jaxpr(lambda x: x @ jnp.ones((4, 4)) + jnp.asarray(t))(x)

    assert with_table(table).consts and same_jaxpr(with_table(table), with_table(table.copy()))
    assert not same_jaxpr(with_table(table), with_table(table + 1))
    # 0.0 == -0.0, but 1 / x tells them apart: literals and constants compare by their bits.
    assert not same_jaxpr(with_table(table * 0), with_table(table * -0.0))
    assert not same_jaxpr(
        jax.make_jaxpr(lambda x: x / 0.0)(x), jax.make_jaxpr(lambda x: x / -0.0)(x)
    )
    nan = np.full(4, np.nan, np.float32)
    assert same_jaxpr(with_table(nan), with_table(nan.copy()))
    bf16 = np.zeros(4, jnp.bfloat16)
    assert not same_jaxpr(with_table(bf16), with_table(-bf16))

    # Nested jaxprs (a scan's body) are compared the same way.
    xs = jnp.ones((5, 3, 4))
    scan = jax.make_jaxpr(lambda w, xs: _scan_sum(w, xs, 2.0))(w, xs)
    assert same_jaxpr(scan, jax.make_jaxpr(lambda w, xs: _scan_sum(w, xs, 2.0))(w, xs))
    assert not same_jaxpr(scan, jax.make_jaxpr(lambda w, xs: _scan_sum(w, xs, 0.5))(w, xs))
