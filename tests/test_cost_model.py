"""The jaxpr cost model: exact matmul FLOPs through control flow, and the bytes-weighted cost."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

from zbjax import stage_boundary
from zbjax.cost_model import (
    BYTES_WEIGHT,
    COMM_FREE_BYTES,
    COMM_WEIGHT,
    CPU_BYTES_WEIGHT,
    CPU_COMM_FREE_BYTES,
    CPU_COMM_WEIGHT,
    aval_bytes,
    avals_bytes,
    bytes_weight,
    comm_free_bytes,
    comm_weight,
    costs_for,
    equation_cost,
    jaxpr_cost,
    matmul_flops,
)

F32 = jnp.float32


def _sds(*shape, dtype=F32):
    return jax.ShapeDtypeStruct(shape, dtype)


def _jaxpr(fn, *args):
    return jax.make_jaxpr(fn)(*args)


def test_dot_general_flops_are_two_m_n_k():
    closed = _jaxpr(lambda a, b: a @ b, _sds(3, 5), _sds(5, 7))
    assert matmul_flops(closed) == 2 * 3 * 5 * 7
    assert matmul_flops(closed.jaxpr) == 2 * 3 * 5 * 7


def test_batched_einsum_flops_include_batch_dims():
    closed = _jaxpr(
        lambda q, k: jnp.einsum("bhqd,bhkd->bhqk", q, k), _sds(2, 4, 6, 8), _sds(2, 4, 10, 8)
    )
    assert matmul_flops(closed) == 2 * (2 * 4) * 6 * 10 * 8


def test_conv_flops_count_kernel_terms_per_output():
    def conv(x, w):
        return jax.lax.conv_general_dilated(x, w, (1, 1), "SAME")

    closed = _jaxpr(conv, _sds(2, 3, 8, 8), _sds(5, 3, 3, 3))
    assert matmul_flops(closed) == 2 * (2 * 5 * 8 * 8) * (3 * 3 * 3)
    grouped = _jaxpr(
        lambda x, w: jax.lax.conv_general_dilated(x, w, (1, 1), "VALID", feature_group_count=2),
        _sds(1, 4, 5, 5),
        _sds(6, 2, 3, 3),
    )
    assert matmul_flops(grouped) == 2 * (1 * 6 * 3 * 3) * (2 * 3 * 3)


def test_flops_recurse_into_jit_remat_custom_rules_and_scan_times_length():
    @jax.custom_jvp
    def cj(x):
        return x @ x

    cj.defjvp(lambda p, t: (cj(p[0]), t[0]))

    @jax.custom_vjp
    def cv(x):
        return x @ x

    cv.defvjp(lambda x: (cv(x), x), lambda r, g: (g,))

    def f(x):
        y = jax.jit(lambda y: y @ y)(x)
        y = jax.checkpoint(lambda y: y @ y)(y)
        y = cj(y) + cv(y)
        y = jax.lax.scan(lambda c, _: (c @ c, None), y, None, length=5)[0]
        return y

    n = 4
    one = 2 * n * n * n
    assert matmul_flops(_jaxpr(f, _sds(n, n))) == one * (1 + 1 + 2 + 5)


def test_cond_counts_the_most_expensive_branch_and_while_counts_body_once():
    n = 4
    one = 2 * n * n * n

    def f(p, x):
        y = jax.lax.cond(p, lambda y: y @ y @ y, lambda y: y @ y, x)
        return jax.lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, c[1] @ c[1]), (0, y))

    assert matmul_flops(_jaxpr(f, True, _sds(n, n))) == 2 * one + one


def test_shard_map_counts_total_work_over_manual_devices():
    mesh = jax.make_mesh((4,), ("i",), axis_types=(jax.sharding.AxisType.Auto,))
    f = jax.shard_map(lambda a, b: a @ b, mesh=mesh, in_specs=(P("i"), P()), out_specs=P("i"))
    # Each of 4 devices multiplies its [2, 6] rows by [6, 3].
    assert matmul_flops(_jaxpr(f, _sds(8, 6), _sds(6, 3))) == 2 * 8 * 6 * 3


def test_aval_bytes_by_dtype_and_shape():
    assert aval_bytes(_sds(3, 4)) == 48
    assert aval_bytes(_sds(3, 4, dtype=jnp.bfloat16)) == 24
    assert aval_bytes(_sds(dtype=jnp.int8)) == 1
    assert avals_bytes([_sds(2), _sds(5, dtype=jnp.int32)]) == 28
    key_aval = jax.eval_shape(lambda: jax.random.split(jax.random.key(0), 3))
    assert aval_bytes(key_aval) == 3 * 8


def test_equation_cost_is_flops_for_matmuls_and_weighted_bytes_otherwise():
    closed = _jaxpr(lambda a, b: jnp.tanh(stage_boundary(a @ b)), _sds(3, 5), _sds(5, 7))
    dot, marker, tanh = closed.jaxpr.eqns
    assert equation_cost(dot) == 2 * 3 * 5 * 7
    assert equation_cost(marker) == 0.0
    assert equation_cost(tanh) == bytes_weight() * (2 * 3 * 7 * 4)
    assert jaxpr_cost(closed) == pytest.approx(2 * 3 * 5 * 7 + bytes_weight() * 168)
    # Bytes weigh by the platform the program runs on: JAX's default backend here (CPU),
    # the devices of its mesh in a pipeline.
    assert bytes_weight() == CPU_BYTES_WEIGHT
    with costs_for("gpu"):
        assert equation_cost(tanh) == BYTES_WEIGHT * (2 * 3 * 7 * 4)
        with costs_for("cpu"):
            assert bytes_weight() == CPU_BYTES_WEIGHT
            assert comm_weight() == CPU_COMM_WEIGHT
            assert comm_free_bytes() == CPU_COMM_FREE_BYTES
        assert bytes_weight() == BYTES_WEIGHT
        assert (comm_weight(), comm_free_bytes()) == (COMM_WEIGHT, COMM_FREE_BYTES)
    assert (comm_weight(), comm_free_bytes()) == (CPU_COMM_WEIGHT, CPU_COMM_FREE_BYTES)


def test_jaxpr_cost_scales_scan_bodies_by_length():
    def body(c, w):
        return jnp.tanh(c @ w), None

    one = _jaxpr(lambda c, w: body(c, w)[0], _sds(2, 8), _sds(8, 8))
    three = _jaxpr(lambda c, ws: jax.lax.scan(body, c, ws)[0], _sds(2, 8), _sds(3, 8, 8))
    assert jaxpr_cost(three) == pytest.approx(3 * jaxpr_cost(one))
    assert matmul_flops(three) == 3 * matmul_flops(one)
