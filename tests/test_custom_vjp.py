"""``jax.custom_vjp`` functions whose bwd rule is not linear in its cotangent (helper H1).

JAX's own custom_vjp example clips the cotangent. Such a rule must see the cotangent
``jax.value_and_grad`` gives it: not one scaled for exactness (the backward seed), not a
stage's share of a summed one (a value recomputed in several stages), and not be bypassed by
differentiating its fwd rule's body (an outer ``jax.grad``).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import zbjax
from zbjax.microbatch import reference_value_and_grad

AUTO = jax.sharding.AxisType.Auto


def clipped(bound):
    @jax.custom_vjp
    def clip_gradient(x):
        return x

    clip_gradient.defvjp(lambda x: (x, None), lambda _, g: (jnp.clip(g, -bound, bound),))
    return clip_gradient


def mesh(pp, dp=1):
    shape, names = ((pp,), ("pp",)) if dp == 1 else ((pp, dp), ("pp", "dp"))
    devices = jax.devices()[: pp * dp]
    return jax.make_mesh(shape, names, axis_types=(AUTO,) * len(shape), devices=devices)


def activation_loss(bound=4e-3):
    clip = clipped(bound)

    def loss_fn(p, b):
        h = clip(jnp.tanh(b["x"] @ p["w0"]))
        h = zbjax.stage_boundary(h)
        h = jnp.tanh(h @ p["w1"])
        return jnp.mean((h.sum(-1) - b["y"]) ** 2)

    return loss_fn


def inputs(rows=24, seed=0):
    k = jax.random.split(jax.random.key(seed), 4)
    params = {"w0": jax.random.normal(k[0], (8, 8)) / 3, "w1": jax.random.normal(k[1], (8, 8)) / 3}
    batch = {"x": jax.random.normal(k[2], (rows, 8)), "y": jax.random.normal(k[3], (rows,))}
    return params, batch


def assert_close(got, want):
    (loss, grads), (want_loss, want_grads) = got, want
    np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
    for name in want_grads:
        np.testing.assert_allclose(grads[name], want_grads[name], rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("m,dp", [(3, 1), (6, 1), (3, 2)])
def test_a_clipping_rule_sees_the_cotangents_value_and_grad_gives_it(m, dp):
    # The rule clips elementwise, per row: with every part's cotangent at the whole batch's
    # scale, microbatching changes nothing. Seeded with 2^-k and rescaled after (exact for a
    # linear backward), w0's gradient was 1/3 off at m = 3 and 6.
    loss_fn = activation_loss()
    params, batch = inputs()
    want = jax.value_and_grad(loss_fn)(params, batch)
    pipe = zbjax.pipeline(loss_fn, mesh=mesh(2, dp), schedule="1f1b", num_microbatches=m)
    assert_close(pipe.value_and_grad(params, batch), want)
    assert_close(reference_value_and_grad(loss_fn, params, batch, m, data_parallel=dp), want)
    # The clip bites: without it w0's gradient differs by far more than the tolerance.
    plain = jax.grad(activation_loss(bound=1e9))(params, batch)
    assert not np.allclose(plain["w0"], want[1]["w0"], rtol=1e-2)


def test_a_custom_vjp_value_of_params_read_by_two_stages_is_recomputed_with_a_warning():
    # Each stage that reads it computes the value, and runs the bwd rule on its own share of
    # the cotangent: exact for a straight-through estimator (linear in the cotangent), not
    # for a clip (helper H1), so zbjax warns. (Computed once and sent, a quantized weight
    # stack went to every stage every microbatch: 129x the message bytes, helper H3.)
    @jax.custom_vjp
    def fake_quant(w):
        return jnp.round(w * 8) / 8

    fake_quant.defvjp(lambda w: (fake_quant(w), jnp.abs(w) <= 1), lambda keep, g: (g * keep,))

    def loss_fn(p, b):
        w = fake_quant(p["w"])
        h = zbjax.stage_boundary(jnp.tanh(b["x"] @ w))
        h = jnp.tanh(h @ w.T)
        return jnp.mean((h.sum(-1) - b["y"]) ** 2)

    params, batch = inputs(rows=8)
    params = {"w": params["w0"] * 4}  # some entries beyond 1: the mask matters
    want = jax.value_and_grad(loss_fn)(params, batch)
    pipe = zbjax.pipeline(loss_fn, mesh=mesh(2), schedule="zb-h1", num_microbatches=2)
    line = f"{__file__}:{loss_fn.__code__.co_firstlineno + 1}"
    with pytest.warns(UserWarning, match=f"custom_vjp function of params alone .at {line}"):
        assert_close(pipe.value_and_grad(params, batch), want)
    # Recomputed in both stages: only the activation crosses.
    assert [len(e.values) for e in pipe.graph.edges] == [1]
    assert all(0 in s.param_leaves for s in pipe.graph.stages)


def test_grad_through_value_applies_the_rule_and_grad_through_the_training_step_is_refused():
    loss_fn = activation_loss(bound=1e-3)
    params, batch = inputs(rows=8)
    pipe = zbjax.pipeline(loss_fn, mesh=mesh(2), schedule="1f1b", num_microbatches=2)
    want = jax.grad(loss_fn)(params, batch)
    # pipe.value runs the stages' own jaxprs, which keep the custom_vjp call (it ran jax.vjp's
    # forward, where the function is its fwd rule's body: the rule was ignored, w0 700x off).
    got = jax.jit(jax.grad(pipe.value))(params, batch)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-8)
    # Forward mode: JAX refuses a custom_vjp function, through pipe.value too.
    with pytest.raises(TypeError, match="can't apply forward-mode autodiff"):
        jax.jvp(lambda p: loss_fn(p, batch), (params,), (params,))
    with pytest.raises(TypeError, match="can't apply forward-mode autodiff"):
        jax.jit(lambda p: jax.jvp(lambda q: pipe.value(q, batch), (p,), (p,)))(params)
    # The training step runs the fwd rule: differentiating it is refused, naming pipe.value.
    with pytest.raises(zbjax.PipelineError, match=r"custom_vjp.*pipe.value\(params, batch\)"):
        jax.grad(lambda p: pipe.value_and_grad(p, batch)[0])(params)
    loss, grads = pipe.value_and_grad(params, batch)  # not differentiated: it runs
    for name in want:
        np.testing.assert_allclose(grads[name], want[name], rtol=1e-5, atol=1e-8)
