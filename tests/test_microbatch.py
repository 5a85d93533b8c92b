"""Microbatch splitting, per-microbatch keys, and the mean-over-microbatches reference."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from zbjax import PipelineError
from zbjax.microbatch import microbatch_keys, reference_value_and_grad, split_microbatches


def test_split_reshapes_every_leaf_to_m_by_rows_and_keeps_row_order():
    batch = {"x": jnp.arange(24.0).reshape(6, 4), "y": jnp.arange(6)}
    out = split_microbatches(batch, 3)
    assert out["x"].shape == (3, 2, 4) and out["y"].shape == (3, 2)
    np.testing.assert_array_equal(out["y"][1], [2, 3])  # microbatch i = rows i*B/m : (i+1)*B/m
    np.testing.assert_array_equal(out["x"][2], batch["x"][4:6])


def test_split_names_the_leaf_its_shape_and_m_when_not_divisible():
    batch = {"tokens": jnp.zeros((6, 3)), "targets": jnp.zeros((5, 3))}
    with pytest.raises(PipelineError, match=r"\['targets'\].*\(5, 3\).*num_microbatches=2"):
        split_microbatches(batch, 2)


def test_microbatch_counts_must_be_integers_of_at_least_one():
    """microbatch_keys(key, 2.5) returned 3 keys and 0 none; a float count failed in JAX."""
    batch = {"x": jnp.ones((4, 2))}
    for bad in (2.5, 0, -1, True, "2", None):
        message = f"num_microbatches = {bad!r}; it must be an integer >= 1"
        for call in (
            lambda m: microbatch_keys(jax.random.key(0), m),
            lambda m: split_microbatches(batch, m),
            lambda m: reference_value_and_grad(lambda p, b: jnp.sum(b["x"]) * p, 1.0, batch, m),
        ):
            with pytest.raises(PipelineError, match=re.escape(message)):
                call(bad)
    with pytest.raises(PipelineError, match=re.escape("data_parallel = 2.0; it must be")):
        reference_value_and_grad(lambda p, b: jnp.sum(b["x"]) * p, 1.0, batch, 2, data_parallel=2.0)
    assert microbatch_keys(jax.random.key(0), np.int64(3)).shape == (3,)


def test_split_rejects_a_scalar_leaf():
    with pytest.raises(PipelineError, match=r"\['scale'\] is a scalar"):
        split_microbatches({"x": jnp.zeros((4, 2)), "scale": jnp.float32(2.0)}, 2)


@pytest.mark.parametrize("make_key", [jax.random.key, jax.random.PRNGKey], ids=["typed", "raw"])
def test_microbatch_i_gets_fold_in_key_i(make_key):
    key = make_key(7)
    keys = microbatch_keys(key, 3)
    assert keys.shape[0] == 3
    for i in range(3):
        expected = jax.random.fold_in(key, i)
        if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
            expected, got = jax.random.key_data(expected), jax.random.key_data(keys[i])
        else:
            got = keys[i]
        np.testing.assert_array_equal(got, expected)


def _mean_loss(params, batch):
    return jnp.mean((jnp.tanh(batch["x"] @ params["w"]) - batch["y"]) ** 2)


def test_reference_equals_full_batch_value_and_grad_for_a_mean_loss():
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    params = {"w": jax.random.normal(k1, (3, 2))}
    batch = {"x": jax.random.normal(k2, (8, 3)), "y": jax.random.normal(k3, (8, 2))}
    loss, grads = reference_value_and_grad(_mean_loss, params, batch, 4)
    want_loss, want_grads = jax.value_and_grad(_mean_loss)(params, batch)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(grads["w"], want_grads["w"], rtol=1e-5, atol=1e-6)


def test_reference_refuses_an_aux_leaf_whose_mean_is_not_of_its_dtype():
    # An int32 count came back as 0 (its sum times an int32 1/m), a bool as an OR; the
    # pipeline refuses such aux leaves, and so does the reference now.
    params = {"w": jnp.ones((3, 2))}
    batch = {"x": jnp.ones((8, 3)), "y": jnp.ones((8, 2))}

    def counted(params, batch):
        return _mean_loss(params, batch), {"ok": jnp.float32(1), "n": jnp.sum(batch["x"] > 0)}

    with pytest.raises(PipelineError, match=r"aux leaf \[.n.\] is int32\[\]"):
        reference_value_and_grad(counted, params, batch, 2, has_aux=True)
    with pytest.raises(PipelineError, match=r"pair \(loss, aux\); got a float32\[\] array"):
        reference_value_and_grad(_mean_loss, params, batch, 2, has_aux=True)


def keyed_loss(params, batch, key):
    keep = jax.random.bernoulli(key, 0.5, batch["x"].shape)
    return jnp.mean(jnp.where(keep, batch["x"], 0.0) @ params["w"])


def test_reference_with_key_averages_microbatches_run_with_fold_in_keys():
    loss_fn = keyed_loss
    params = {"w": jnp.arange(3.0)}
    batch = {"x": jax.random.normal(jax.random.key(1), (4, 3))}
    key = jax.random.key(2)
    loss, grads = reference_value_and_grad(loss_fn, params, batch, 2, key=key)
    parts = [
        jax.value_and_grad(loss_fn)(
            params, {"x": batch["x"][2 * i : 2 * i + 2]}, jax.random.fold_in(key, i)
        )
        for i in range(2)
    ]
    np.testing.assert_allclose(loss, (parts[0][0] + parts[1][0]) / 2, rtol=1e-6)
    np.testing.assert_allclose(grads["w"], (parts[0][1]["w"] + parts[1][1]["w"]) / 2, rtol=1e-6)


def test_reference_with_data_parallel_shards_runs_block_s_with_fold_in_key_i_s():
    loss_fn = keyed_loss
    params = {"w": jnp.arange(3.0)}
    batch = {"x": jax.random.normal(jax.random.key(1), (8, 3))}
    key = jax.random.key(2)
    loss, grads = reference_value_and_grad(loss_fn, params, batch, 2, key=key, data_parallel=2)
    # Microbatch i holds rows 4i..4i+3; its shard s the rows 4i+2s, 4i+2s+1.
    parts = [
        jax.value_and_grad(loss_fn)(
            params,
            {"x": batch["x"][4 * i + 2 * s : 4 * i + 2 * s + 2]},
            jax.random.fold_in(jax.random.fold_in(key, i), s),
        )
        for i in range(2)
        for s in range(2)
    ]
    np.testing.assert_allclose(loss, sum(p[0] for p in parts) / 4, rtol=1e-6)
    np.testing.assert_allclose(grads["w"], sum(p[1]["w"] for p in parts) / 4, rtol=1e-6)
    with pytest.raises(PipelineError, match="data_parallel=3 must be at least 1 and divide"):
        reference_value_and_grad(loss_fn, params, batch, 2, key=key, data_parallel=3)


def test_keys_that_are_not_one_prng_key_are_refused_naming_the_fix():
    """microbatch_keys and reference_value_and_grad passed JAX's "invalid PRNG key data" or
    "fold_in accepts a single key" through; the pipeline's own key check now runs there."""
    bad_keys = (3, "abc", jax.random.split(jax.random.key(0), 2), jnp.zeros(2))
    for key in bad_keys:
        with pytest.raises(PipelineError, match="pass one PRNG key"):
            microbatch_keys(key, 4)
    params, batch = jnp.ones((2, 2)), jnp.ones((4, 2))
    with pytest.raises(PipelineError, match="key is int32\\[\\]; pass one PRNG key"):
        reference_value_and_grad(lambda p, b, k: jnp.mean(b @ p), params, batch, 2, key=3)
    assert microbatch_keys(jax.random.key(0), 3).shape == (3,)
    assert microbatch_keys(jax.random.PRNGKey(0), 3).shape == (3, 2)


def test_split_names_a_text_leaf_as_not_an_array():
    with pytest.raises(
        PipelineError, match=r"batch leaf \['tag'\] is a str \('v1'\), not an array"
    ):
        split_microbatches({"x": jnp.ones((4, 2)), "tag": "v1"}, 2)


def test_the_reference_seeds_as_the_pipeline_so_a_loss_scaled_float16_model_stays_finite():
    """Seeded with 1 per microbatch, the reference's float16 cotangents were m times the
    pipeline's (seeded 2^-k) and overflowed where the pipeline and the whole batch do not."""
    k = jax.random.split(jax.random.key(0), 6)
    params = [(jax.random.normal(k[i], (16, 16)) / 4).astype(jnp.float16) for i in range(4)]
    batch = {
        "x": jax.random.normal(k[4], (16, 16)).astype(jnp.float16),
        "y": (jax.random.normal(k[5], (16, 16)) * 100).astype(jnp.float16),
    }

    def loss_fn(p, b):
        x = b["x"]
        for w in p:
            x = jnp.tanh(x @ w)
        return jnp.mean((x - b["y"]) ** 2) * jnp.float16(8192)  # a static loss scale

    _, whole = jax.value_and_grad(loss_fn)(params, batch)
    _, grads = reference_value_and_grad(loss_fn, params, batch, 4)
    for g, w in zip(grads, whole, strict=True):
        assert bool(jnp.all(jnp.isfinite(g)))
        w = w.astype(np.float32)
        np.testing.assert_allclose(g.astype(np.float32), w, atol=0.01 * np.abs(w).max())
    with pytest.raises(PipelineError, match=r"float32\[3\] loss; return one real"):
        reference_value_and_grad(lambda p, b: jnp.ones(3) * p, 1.0, batch, 4)
    # A (loss, aux) pair without has_aux, or a loss in a list: named, as the pipeline names it.
    for bad, kind in ((lambda p, b: (p, {"n": p}), "tuple"), (lambda p, b: [p], "list")):
        with pytest.raises(PipelineError, match=f"returns a {kind}, not one.*has_aux=True"):
            reference_value_and_grad(bad, 1.0, batch, 4)
