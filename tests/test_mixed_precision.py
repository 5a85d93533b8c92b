"""Mixed precision: reference GPTs computing in bfloat16 on float32 parameters, pipelined.

A bfloat16 value crossing a stage boundary carries a gradient like a float32 one: the
partitioner once took bfloat16 for not differentiable (NumPy's ``issubdtype`` does not count
it as inexact), and every stage before the last got all-zero gradients. The pipelined results
are compared with ``jax.value_and_grad`` of the unpipelined loss within bfloat16's precision.
The same loss computed on the whole batch and as the mean over 4 microbatches (each rounding its
matmuls and reductions to bfloat16 on its own) differs by 2.3-3.3 % of a leaf's largest
gradient entry on these models (``_relative_error``, worst leaf); the pipelined gradients
differed from ``value_and_grad``'s by 2.2-3.4 %.
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import zbjax
from models import gpt, gpt_nnx, gpt_scan
from zbjax.partition import partition
from zbjax.pipeline import TWO_STAGES_PER_DEVICE

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zb-v", "zb-auto")
GPT_SIZES = dict(vocab_size=32, seq_len=8, d_model=16, num_heads=2, dtype="bfloat16")
MODULES = {"gpt": gpt, "gpt_nnx": gpt_nnx, "gpt_scan": gpt_scan}
#: A leaf's gradient may differ from value_and_grad's by this fraction of its largest entry
#: (bfloat16 rounding: see the module docstring); a gradient that is all zero differs by 1.
TOLERANCE = 0.08


@functools.cache
def setup(model, num_stages):
    """Returns (loss_fn, params, batch, jax.value_and_grad(loss_fn)(params, batch))."""
    module = MODULES[model]
    cfg = module.GPTConfig(num_layers=num_stages, **GPT_SIZES)
    params = module.init_params(jax.random.key(0), cfg)
    batch = gpt.make_batch(jax.random.key(1), cfg, 16)
    loss_fn = module.make_loss_fn(cfg)
    return loss_fn, params, batch, jax.jit(jax.value_and_grad(loss_fn))(params, batch)


def _relative_error(got, want):
    """Returns max |got - want| / max |want|: 1.0 for an all-zero gradient."""
    return float(np.max(np.abs(np.asarray(got) - np.asarray(want))) / np.max(np.abs(want)))


def _check(loss, grads, ref_loss, ref_grads):
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-3)
    assert jax.tree.structure(grads) == jax.tree.structure(ref_grads)
    errors = {
        jax.tree_util.keystr(path): _relative_error(g, r)
        for (path, g), r in zip(
            jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(ref_grads), strict=True
        )
    }
    worst = max(errors, key=errors.get)
    assert errors[worst] <= TOLERANCE, f"{worst}: {errors[worst]:.3f} of its largest entry"
    assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(grads))


def test_a_bfloat16_value_crossing_a_stage_boundary_is_differentiable():
    cfg = gpt.GPTConfig(num_layers=2, stage_boundaries=(0,), **GPT_SIZES)
    params = gpt.init_params(jax.random.key(0), cfg)
    graph = partition(gpt.make_loss_fn(cfg), params, gpt.make_batch(jax.random.key(1), cfg, 4))
    boundary = graph.stages[1]
    assert [a.dtype for a in boundary.jaxpr.in_avals[-1:]] == [jnp.bfloat16]
    assert boundary.input_differentiable == (True,)


@pytest.mark.parametrize("name", SCHEDULES)
def test_bfloat16_gpt_pipelined_equals_value_and_grad(name):
    p, m = 2, 4
    stages = 2 * p if name in TWO_STAGES_PER_DEVICE else p
    loss_fn, params, batch, (ref_loss, ref_grads) = setup("gpt", stages)
    mesh = jax.make_mesh((p,), ("pp",), devices=jax.devices()[:p])
    pipe = zbjax.pipeline(loss_fn, mesh=mesh, schedule=name, num_microbatches=m, num_stages=stages)
    _check(*pipe.value_and_grad(params, batch), ref_loss, ref_grads)


@pytest.mark.parametrize("model, name", [("gpt_nnx", "zb-h1"), ("gpt_scan", "zb-h2")])
def test_bfloat16_nnx_and_scanned_gpts_pipelined_equal_value_and_grad(model, name):
    loss_fn, params, batch, (ref_loss, ref_grads) = setup(model, 4)
    mesh = jax.make_mesh((4,), ("pp",), devices=jax.devices()[:4])
    pipe = zbjax.pipeline(loss_fn, mesh=mesh, schedule=name, num_microbatches=4)
    _check(*pipe.value_and_grad(params, batch), ref_loss, ref_grads)


class _HalfParams(nn.Module):
    """Dense layers with bfloat16 params and LayerNorms with float32 ones, computing in
    bfloat16: the staged layout holds a row per dtype."""

    @nn.compact
    def __call__(self, x):
        for i in range(4):
            x = nn.LayerNorm(dtype=jnp.bfloat16)(x)
            x = jnp.tanh(nn.Dense(32, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)(x))
            if i < 3:
                x = zbjax.stage_boundary(x)
        return x


def test_bfloat16_params_staged_with_data_parallelism_equal_value_and_grad():
    model = _HalfParams()
    x = jax.random.normal(jax.random.key(1), (16, 32))
    params = model.init(jax.random.key(0), x)
    assert {a.dtype for a in jax.tree.leaves(params)} == {
        jnp.dtype(jnp.bfloat16),
        jnp.dtype(jnp.float32),
    }

    def loss_fn(params, x):
        return jnp.mean(model.apply(params, x).astype(jnp.float32) ** 2)

    mesh = jax.make_mesh((2, 2), ("pp", "dp"), devices=jax.devices()[:4])
    pipe = zbjax.pipeline(loss_fn, mesh=mesh, axis_name="pp", schedule="zb-v", num_microbatches=4)
    loss, grads = jax.jit(pipe.value_and_grad)(pipe.stage(params, x), x)
    ref_loss, ref_grads = jax.value_and_grad(loss_fn)(params, x)
    grads = pipe.unstage(grads)
    assert jax.tree.map(lambda g: g.dtype, grads) == jax.tree.map(lambda g: g.dtype, ref_grads)
    _check(loss, jax.tree.map(lambda g: g.astype(jnp.float32), grads), ref_loss, ref_grads)


def test_a_bfloat16_loss_is_returned_in_bfloat16_as_value_and_grad_does():
    def loss_fn(params, x):
        h = zbjax.stage_boundary(jnp.tanh(x.astype(jnp.bfloat16) @ params[0].astype(jnp.bfloat16)))
        return jnp.mean((h @ params[1].astype(jnp.bfloat16)) ** 2)

    keys = jax.random.split(jax.random.key(2), 3)
    params = [jax.random.normal(k, (16, 16)) / 4 for k in keys[:2]]
    x = jax.random.normal(keys[2], (8, 16))
    mesh = jax.make_mesh((2,), ("pp",), devices=jax.devices()[:2])
    pipe = zbjax.pipeline(loss_fn, mesh=mesh, schedule="zb-h1", num_microbatches=4)
    loss, grads = pipe.value_and_grad(params, x)
    ref_loss, ref_grads = jax.value_and_grad(loss_fn)(params, x)
    assert loss.dtype == ref_loss.dtype == jnp.bfloat16
    _check(loss.astype(jnp.float32), grads, ref_loss.astype(jnp.float32), ref_grads)


def test_a_python_scalar_param_stays_weakly_typed_then_an_array_param_promotes():
    """``bf16 * p["scale"]`` stays bfloat16 for a Python float, as under jax.value_and_grad
    (it was traced as a float32 array, the loss came back float32); after an optimizer
    step the scale is a float32 array and the same pipeline traces the step again for it."""

    def loss_fn(params, x):
        h = jnp.tanh(x.astype(jnp.bfloat16) @ params["w0"].astype(jnp.bfloat16)) * params["scale"]
        h = zbjax.stage_boundary(h)
        return jnp.mean((h @ params["w1"].astype(jnp.bfloat16)) ** 2)

    keys = jax.random.split(jax.random.key(3), 3)
    params = {"w0": jax.random.normal(keys[0], (16, 16)) / 4, "scale": 1.5}
    params["w1"] = jax.random.normal(keys[1], (16, 16)) / 4
    x = jax.random.normal(keys[2], (8, 16))
    mesh = jax.make_mesh((2,), ("pp",), devices=jax.devices()[:2])
    pipe = zbjax.pipeline(loss_fn, mesh=mesh, schedule="zb-h1", num_microbatches=2)
    for scale, dtype in ((1.5, jnp.bfloat16), (jnp.float32(1.25), jnp.float32)):
        given = {**params, "scale": scale}
        loss, grads = pipe.value_and_grad(given, x)
        ref_loss, ref_grads = jax.value_and_grad(loss_fn)(given, x)
        assert loss.dtype == ref_loss.dtype == dtype
        _check(loss.astype(jnp.float32), grads, ref_loss.astype(jnp.float32), ref_grads)


def test_sixteen_bit_losses_are_averaged_without_overflow_or_a_rounded_seed():
    """A float16 loss summed over m microbatches in float16 overflowed (4 x 30000 = inf where
    the mean is 30000), in the pipeline and in reference_value_and_grad, whose float16 grads
    overflowed too; the backward was seeded with 1/m rounded to the loss dtype, so float32
    grads of a bfloat16 loss were 0.2 % off at m = 3."""
    mesh = jax.make_mesh((2,), ("pp",), devices=jax.devices()[:2])

    def loss_fn(p, b, dtype=jnp.float16):
        h = zbjax.stage_boundary(b["x"] @ p[0])
        return jnp.mean(h @ p[1]).astype(dtype)

    big = [jnp.eye(4, dtype=jnp.float16) * 100, jnp.eye(4, dtype=jnp.float16) * 75]
    batch = {"x": jnp.ones((8, 4), jnp.float16)}
    want_loss, want_grads = jax.value_and_grad(loss_fn)(big, batch)
    assert float(want_loss) == 7500.0
    pipe = zbjax.pipeline(loss_fn, mesh=mesh, schedule="1f1b", num_microbatches=4)
    for loss, grads in (
        pipe.value_and_grad(big, batch),
        zbjax.reference_value_and_grad(loss_fn, big, batch, 4),
    ):
        assert loss.dtype == jnp.float16 and float(loss) == 7500.0
        for g, w in zip(grads, want_grads, strict=True):
            assert g.dtype == w.dtype and bool(jnp.all(jnp.isfinite(g)))
            np.testing.assert_allclose(g.astype(np.float32), w.astype(np.float32), rtol=1e-3)
    bf16_loss = functools.partial(loss_fn, dtype=jnp.bfloat16)
    eye = [jnp.eye(4), jnp.eye(4)]
    for m in (3, 7):
        batch = {"x": jnp.ones((2 * m, 4))}
        pipe = zbjax.pipeline(bf16_loss, mesh=mesh, schedule="zb-h1", num_microbatches=m)
        _, grads = pipe.value_and_grad(eye, batch)
        _, want = jax.value_and_grad(bf16_loss)(eye, batch)
        for g, w in zip(grads, want, strict=True):
            np.testing.assert_allclose(g, w, rtol=1e-6)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_sixteen_bit_gradients_are_summed_over_microbatches_in_float32(dtype):
    """m equal microbatches have the mean gradient of one. Summed in 16 bits the pipeline's
    differed from it in a quarter to half of the entries (m = 3, 5, 7); now it equals it, and
    the microbatched reference, bit for bit. A tied leaf's copies are summed in float32 too
    (JAX adds them in 16 bits within one backward: equal within a 16-bit rounding)."""
    mesh = jax.make_mesh((2,), ("pp",), devices=jax.devices()[:2])
    k = jax.random.split(jax.random.key(0), 3)
    params = {
        "w0": (jax.random.normal(k[0], (8, 8)) / 3).astype(dtype),
        "w1": (jax.random.normal(k[1], (8, 8)) / 3).astype(dtype),
    }

    def loss_fn(p, b, tied=False):
        h = zbjax.stage_boundary(jnp.tanh(b["x"] @ p["w0"]))
        out = jnp.tanh(h @ p["w1"]) @ (p["w0"].T if tied else jnp.eye(8, dtype=dtype))
        return jnp.mean((out - b["y"]) ** 2)

    row = {"x": jax.random.normal(k[2], (2, 8)).astype(dtype), "y": jnp.ones((2, 8), dtype)}
    for tied in (False, True):
        fn = functools.partial(loss_fn, tied=tied)
        _, one = jax.value_and_grad(fn)(params, row)
        for m in (3, 7):
            batch = jax.tree.map(lambda x, m=m: jnp.concatenate([x] * m), row)
            pipe = zbjax.pipeline(fn, mesh=mesh, schedule="zb-h1", num_microbatches=m)
            _, grads = pipe.value_and_grad(params, batch)
            ref = zbjax.reference_value_and_grad(fn, params, batch, m)[1]
            for name in params:
                got, want = grads[name].astype(np.float32), one[name].astype(np.float32)
                assert grads[name].dtype == dtype
                if tied:
                    np.testing.assert_allclose(got, want, atol=2**-7 * np.abs(want).max())
                    continue
                np.testing.assert_array_equal(grads[name], ref[name])  # seeded alike
                if dtype == jnp.bfloat16:
                    np.testing.assert_array_equal(got, want)
                else:  # the 2^-k seed rounds float16's subnormal cotangents: a few entries
                    assert np.mean(got != want) <= 0.05, np.mean(got != want)
