"""The stage_boundary marker: identity, visible in jaxprs, linear, and free outside a pipeline."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import zbjax
from zbjax.markers import STAGE_BOUNDARY, is_stage_boundary, stage_boundary


def _two_layer(w, x, marked):
    h = jnp.tanh(x @ w["a"])
    if marked:
        h = stage_boundary(h, name="mid")
    return jnp.sum(jnp.sin(h @ w["b"]))


def _marked(w, x):
    return _two_layer(w, x, True)


def _plain(w, x):
    return _two_layer(w, x, False)


def _params():
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    w = {"a": jax.random.normal(k1, (8, 8)), "b": jax.random.normal(k2, (8, 4))}
    x = jax.random.normal(k3, (3, 8))
    return w, x


def _markers(jaxpr):
    return [e for e in jaxpr.eqns if is_stage_boundary(e)]


def test_marker_is_identity_on_any_pytree():
    tree = {"a": jnp.arange(3.0), "b": (jnp.ones((2, 2), jnp.int32), jnp.zeros(()))}
    out = stage_boundary(tree)
    assert jax.tree_util.tree_structure(out) == jax.tree_util.tree_structure(tree)
    for got, want in zip(
        jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(tree), strict=True
    ):
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(got, want)
    assert stage_boundary({}) == {}
    assert zbjax.stage_boundary is stage_boundary


def test_marker_appears_once_in_jaxpr_bound_on_flat_leaves_with_name():
    tree = {"a": jnp.ones(3), "b": jnp.ones((2, 2))}
    jaxpr = jax.make_jaxpr(lambda t: stage_boundary(t, name="cut"))(tree).jaxpr
    (eqn,) = _markers(jaxpr)
    assert eqn.primitive is STAGE_BOUNDARY
    assert eqn.params["name"] == "cut"
    assert len(eqn.invars) == 2 and len(eqn.outvars) == 2


def test_grad_through_marker_equals_grad_without_it():
    w, x = _params()
    got = jax.grad(_marked)(w, x)
    want = jax.grad(_plain)(w, x)
    for g, e in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
        np.testing.assert_allclose(g, e, rtol=1e-6)


def test_marker_appears_in_the_backward_jaxpr_of_grad():
    w, x = _params()
    jaxpr = jax.make_jaxpr(jax.grad(_marked))(w, x).jaxpr
    # One marker on the forward activation and its transpose on the cotangent.
    assert len(_markers(jaxpr)) == 2
    _, vjp = jax.vjp(lambda h: stage_boundary(jnp.sin(h)), x)
    bwd = jax.make_jaxpr(vjp)(x).jaxpr
    assert len(_markers(bwd)) == 1


def test_symbolic_zero_cotangents_and_non_float_leaves_pass_through():
    x = jnp.arange(4.0)

    def f(x):
        a, b, n = stage_boundary((2.0 * x, 3.0 * x, jnp.arange(4)))
        return jnp.sum(a) + jnp.sum(n)  # b unused: its cotangent is a symbolic zero

    np.testing.assert_allclose(jax.grad(f)(x), jnp.full(4, 2.0))
    np.testing.assert_allclose(jax.jacfwd(lambda x: stage_boundary(x**2))(x), jnp.diag(2 * x))
    np.testing.assert_allclose(jax.hessian(lambda x: jnp.sum(stage_boundary(x) ** 3))(x)[1, 1], 6.0)


def test_grad_through_a_marker_on_a_scan_s_ys_the_loss_ignores():
    # The marker hands the scan's transpose a zero cotangent for its stacked outputs: jax 0.10
    # failed on a symbolic one ("Expected cotangent type float32[4] but got float32[2,4]").
    def loss(stack, x, mark):
        h, ys = jax.lax.scan(lambda c, w: (jnp.tanh(c @ w), jnp.sum(c, axis=1)), x, stack)
        if mark:
            ys, h = stage_boundary((ys, h))
        return jnp.mean(h**2)

    stack, x = jnp.full((2, 8, 8), 0.1), jnp.ones((4, 8))
    got = jax.value_and_grad(loss)(stack, x, True)
    want = jax.value_and_grad(loss)(stack, x, False)
    for g, e in zip(got, want, strict=True):
        np.testing.assert_allclose(g, e, rtol=1e-6)


def test_marker_under_jit_vmap_eval_shape_and_checkpoint():
    w, x = _params()
    want = _plain(w, x)
    np.testing.assert_allclose(jax.jit(_marked)(w, x), want, rtol=1e-6)
    xs = jnp.stack([x, 2 * x])
    got = jax.vmap(_marked, (None, 0))(w, xs)
    np.testing.assert_allclose(got, jax.vmap(_plain, (None, 0))(w, xs), rtol=1e-6)
    assert jax.eval_shape(_marked, w, x).shape == ()
    g = jax.grad(jax.checkpoint(lambda w: _marked(w, x)))(w)
    np.testing.assert_allclose(g["a"], jax.grad(_plain)(w, x)["a"], rtol=1e-5)


def test_marker_lowers_to_no_op_and_no_copy():
    w, x = _params()
    with_marker = jax.jit(_marked).lower(w, x).as_text()
    without = jax.jit(_plain).lower(w, x).as_text()
    assert "stage_boundary" not in with_marker
    assert with_marker.count("stablehlo.") == without.count("stablehlo.")


def test_marker_inside_shard_map_forward_and_grad():
    mesh = jax.make_mesh((2,), ("i",))
    x = jnp.arange(8.0).reshape(2, 4)

    def body(x):
        return jax.lax.psum(jnp.sum(stage_boundary(x) ** 2), "i")

    with jax.set_mesh(mesh):
        xs = jax.device_put(x, P("i"))
        f = jax.shard_map(body, in_specs=P("i"), out_specs=P())
        np.testing.assert_allclose(jax.jit(f)(xs), jnp.sum(x**2))
        np.testing.assert_allclose(jax.jit(jax.grad(f))(xs), 2 * x)
