"""``pipeline(..., has_aux=True)``: ``loss_fn`` returns ``(loss, aux)`` as for
``jax.value_and_grad(..., has_aux=True)``; aux leaves are averaged over microbatches like the loss.
"""

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import zbjax
from models import gpt
from zbjax.errors import PartitionError, PipelineError
from zbjax.executor import run_schedule
from zbjax.microbatch import reference_value_and_grad

AUTO = jax.sharding.AxisType.Auto
CFG = gpt.GPTConfig(vocab_size=32, seq_len=8, d_model=16, num_heads=2, num_layers=4)


def pp_mesh(p, dp=1):
    shape, names = ((p,), ("pp",)) if dp == 1 else ((p, dp), ("pp", "dp"))
    return jax.make_mesh(
        shape, names, axis_types=(AUTO,) * len(shape), devices=jax.devices()[: p * dp]
    )


def gpt_with_metrics(cfg):
    """A GPT loss returning metrics beside the loss, as a training loop logs them: one computed
    from the logits (last stage), one from the embedding's output (first stage)."""
    model = gpt.GPT(cfg, deterministic=True)

    def loss_fn(params, batch):
        logits = model.apply({"params": params}, batch["tokens"]).astype(jnp.float32)
        loss = gpt.cross_entropy(logits, batch["targets"])
        correct = jnp.argmax(logits, axis=-1) == batch["targets"]
        embed = params["embed"]["token"]["embedding"][batch["tokens"]]
        aux = {
            "accuracy": jnp.mean(correct.astype(jnp.float32)),
            "embed_rms": jnp.sqrt(jnp.mean(embed**2)),
            "per_position_loss": jnp.mean(
                -jnp.take_along_axis(
                    jax.nn.log_softmax(logits), batch["targets"][..., None], axis=-1
                )[..., 0],
                axis=0,
            ),
            "constant": 1.5,
        }
        return loss, aux

    return loss_fn


def case(num_stages):
    cfg = dataclasses.replace(CFG, stage_boundaries=gpt.balanced_boundaries(CFG, num_stages))
    params = gpt.init_params(jax.random.key(0), cfg)
    batch = gpt.make_batch(jax.random.key(1), cfg, 8)
    return gpt_with_metrics(cfg), params, batch


def assert_matches(result, reference):
    ((loss, aux), grads), ((ref_loss, ref_aux), ref_grads) = result, reference
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    assert jax.tree.structure(aux) == jax.tree.structure(ref_aux)
    for a, r in zip(jax.tree.leaves(aux), jax.tree.leaves(ref_aux), strict=True):
        assert jnp.shape(a) == jnp.shape(r)
        np.testing.assert_allclose(a, r, rtol=1e-5, atol=1e-6)
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["1f1b", "zb-h1", "zb-h2", "zb-v", "dag-zb"])
def test_aux_is_the_mean_over_microbatches_and_grads_match(name):
    loss_fn, params, batch = case(4 if name == "zb-v" else 2)
    pipe = zbjax.pipeline(loss_fn, mesh=pp_mesh(2), schedule=name, num_microbatches=4, has_aux=True)
    reference = reference_value_and_grad(loss_fn, params, batch, 4, has_aux=True)
    assert_matches(pipe.value_and_grad(params, batch), reference)
    (_, aux), _ = reference
    assert 0.0 <= float(aux["accuracy"]) <= 1.0 and aux["per_position_loss"].shape == (CFG.seq_len,)


def test_aux_with_auto_cut_data_parallel_staged_params_and_buffers_in_jit():
    cfg = CFG  # no markers: cut by the cost model
    params = gpt.init_params(jax.random.key(0), cfg)
    batch = gpt.make_batch(jax.random.key(1), cfg, 8)
    loss_fn = gpt_with_metrics(cfg)
    pipe = zbjax.pipeline(
        loss_fn, mesh=pp_mesh(2, dp=2), schedule="zb-h1", num_microbatches=2, has_aux=True
    )
    staged = pipe.stage(params, batch)
    buffers = pipe.init_buffers(staged, batch)
    step = jax.jit(lambda s, b, buf: pipe.value_and_grad(s, b, buffers=buf), donate_argnums=2)
    (loss, aux), grads, buffers = step(staged, batch, buffers)
    reference = reference_value_and_grad(loss_fn, params, batch, 2, has_aux=True)
    assert_matches(((loss, aux), pipe.unstage(grads)), reference)
    (loss2, _), _, _ = step(staged, batch, buffers)  # the returned buffers serve the next step
    np.testing.assert_allclose(loss2, loss, rtol=1e-6)


def test_sequential_executor_returns_the_same_aux():
    loss_fn, params, batch = case(2)
    pipe = zbjax.pipeline(
        loss_fn, mesh=pp_mesh(2), schedule="zb-h1", num_microbatches=4, has_aux=True
    )
    pipe.value_and_grad(params, batch)
    result = run_schedule(pipe.graph, pipe.programs, pipe.schedule, params, batch)
    assert_matches(result, reference_value_and_grad(loss_fn, params, batch, 4, has_aux=True))


def test_aux_errors_name_the_problem_and_the_fix():
    loss_fn, params, batch = case(2)
    mesh = pp_mesh(2)
    with pytest.raises(PartitionError, match=r"has_aux=True"):
        zbjax.pipeline(loss_fn, mesh=mesh, num_microbatches=2).value_and_grad(params, batch)
    scalar = lambda p, b: loss_fn(p, b)[0]  # noqa: E731
    with pytest.raises(
        PartitionError, match=r"must return a pair \(loss, aux\); got a float32\[\]"
    ):
        zbjax.pipeline(scalar, mesh=mesh, num_microbatches=2, has_aux=True).value_and_grad(
            params, batch
        )
    tagged = lambda p, b: (loss_fn(p, b)[0], {"phase": "train"})  # noqa: E731
    with pytest.raises(PartitionError, match=r"aux leaf \['phase'\] is a str \('train'\)"):
        zbjax.pipeline(tagged, mesh=mesh, num_microbatches=2, has_aux=True).value_and_grad(
            params, batch
        )
    counts = lambda p, b: (loss_fn(p, b)[0], {"n": jnp.sum(b["tokens"] > 0)})  # noqa: E731
    with pytest.raises(PartitionError, match=r"aux leaf \['n'\] is int32\[\].*floating"):
        zbjax.pipeline(counts, mesh=mesh, num_microbatches=2, has_aux=True).value_and_grad(
            params, batch
        )
    # The message said every aux leaf is averaged; per-example rows are joined, and may be
    # integers (helper HC).
    with pytest.raises(PartitionError, match=r"or joined where it holds per-example rows"):
        zbjax.pipeline(counts, mesh=mesh, num_microbatches=2, has_aux=True).value_and_grad(
            params, batch
        )

    # A leaf whose shape changes with the batch other than by its rows along the first axis
    # (per-example values come back joined): neither a mean nor the parts joined gives it.
    def pairs(p, b):
        first = b["tokens"][:, 0] * 1.0
        return loss_fn(p, b)[0], {"pairs": jnp.outer(first, first)}

    with pytest.raises(
        PipelineError,
        match=r"aux leaf \['pairs'\] has shape \[8, 8\] for the whole batch but \[4, 4\] for "
        r"one microbatch: neither the same .* nor per-example rows",
    ):
        zbjax.pipeline(pairs, mesh=mesh, num_microbatches=2, has_aux=True).value_and_grad(
            params, batch
        )


def _per_example_case():
    rng = np.random.default_rng(5)
    params = [jnp.asarray(rng.normal(size=(8, 8)) * 0.4, jnp.float32) for _ in range(4)]
    batch = {k: jnp.asarray(rng.normal(size=(16, 8)), jnp.float32) for k in ("x", "y")}

    def loss_fn(w, b):
        h = b["x"]
        for k in range(4):
            h = jnp.tanh((zbjax.stage_boundary(h) if k else h) @ w[k])
        per_example = jnp.mean((h - b["y"]) ** 2, axis=1)
        aux = {
            "per_example": per_example,  # [16]
            "predictions": h,  # [16, 8]
            "first_two": h[:, :2].reshape(-1),  # [32]: two values a row, flattened
            "mean": jnp.mean(h),  # a metric: the mean over microbatches
            # [16, 0]: a head with no outputs (a ZeroDivisionError joining it, helper HC)
            "none": h[:, :0],
            # Integer and bool rows are joined too (refused as not floating before).
            "argmax": jnp.argmax(h, axis=-1),
            "positive": h[:, 0] > 0,
        }
        return jnp.mean(per_example), aux

    return loss_fn, params, batch


@pytest.mark.parametrize("schedule, dp", [("1f1b", 2), ("zb-v", 1), ("dag-zb", 1)])
def test_per_example_aux_comes_back_joined_as_value_and_grad_returns_it(schedule, dp):
    """An aux leaf of per-example rows (predictions, a per-row loss) comes back as
    jax.value_and_grad of the unpipelined loss returns it: each microbatch's (and data shard's)
    rows in the batch's order, from value_and_grad and pipe.value alike; the microbatched
    reference and the schedule executor join them too. (Refused before, as no mean of the
    microbatches' rows is the whole batch's.)"""
    loss_fn, params, batch = _per_example_case()
    kw = {"num_stages": 4} if schedule == "zb-v" else {}
    mesh = pp_mesh(2 if schedule == "zb-v" else 4, dp)
    pipe = zbjax.pipeline(
        loss_fn, mesh=mesh, schedule=schedule, num_microbatches=4, has_aux=True, **kw
    )
    want = jax.value_and_grad(loss_fn, has_aux=True)(params, batch)
    assert_matches(pipe.value_and_grad(params, batch), want)
    assert_matches((pipe.value(params, batch), want[1]), want)
    reference = reference_value_and_grad(loss_fn, params, batch, 4, has_aux=True, data_parallel=dp)
    assert_matches(reference, want)
    # Aux leaves in key order: argmax, first_two, mean, none, per_example, positive,
    # predictions.
    assert pipe.graph.aux_rows == (True, True, False, True, True, True, True)
    aux = pipe.value_and_grad(params, batch)[0][1]
    assert aux["argmax"].dtype == jnp.int32 and aux["positive"].dtype == jnp.bool_
    if dp == 1:
        executed = run_schedule(pipe.graph, pipe.programs, pipe.schedule, params, batch)
        assert_matches(executed, want)


def test_aux_computed_in_the_first_stage_is_carried_to_the_last():
    weights = [jax.random.normal(jax.random.key(i), (8, 8)) * 0.5 for i in range(4)]
    batch = {"x": jax.random.normal(jax.random.key(9), (16, 8)), "y": jnp.ones((16, 8))}

    def loss_fn(w, b):
        h = jnp.tanh(b["x"] @ w[0])
        first = {
            "saturated": jnp.mean((jnp.abs(h) > 0.9).astype(jnp.float32)),
            "rms": jnp.sqrt(jnp.mean(h**2)),
        }
        for k in range(1, 4):
            h = jnp.tanh(zbjax.stage_boundary(h) @ w[k])
        return jnp.mean((h - b["y"]) ** 2), {"stage0": first, "out_mean": jnp.mean(h, axis=0)}

    pipe = zbjax.pipeline(
        loss_fn, mesh=pp_mesh(4), schedule="zb-h2", num_microbatches=4, has_aux=True
    )
    result = pipe.value_and_grad(weights, batch)
    assert_matches(result, reference_value_and_grad(loss_fn, weights, batch, 4, has_aux=True))
    # The metrics read stage 0's activation before its marker: stage 0 computes them and
    # sends the two scalars to the loss stage, not the activation.
    to_loss = [e for e in pipe.graph.edges if (e.src, e.dst) == (0, pipe.graph.loss_stage)]
    assert [v.shape for e in to_loss for v in e.values] == [(), ()]


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_an_aux_metric_with_an_infinite_derivative_leaves_the_grads_finite(schedule):
    """JAX differentiates no aux. A metric sent from stage 0 to the loss stage was flagged
    differentiable: its zero cotangent times the derivative of a norm at 0 (a zero-initialised
    residual branch's) made every stage-0 gradient NaN."""
    k = jax.random.split(jax.random.key(0), 4)
    params = {
        "w_in": jax.random.normal(k[0], (8, 8)) / 3,
        "w_out": jnp.zeros((8, 8)),
        "head": jax.random.normal(k[1], (8, 8)) / 3,
    }
    batch = {"x": jax.random.normal(k[2], (8, 8)), "y": jax.random.normal(k[3], (8, 8))}

    def loss_fn(p, b):
        branch = jnp.tanh(b["x"] @ p["w_in"]) @ p["w_out"]
        metrics = {"branch_norm": jnp.linalg.norm(branch), "log": jnp.log(0 * branch[0, 0])}
        h = zbjax.stage_boundary(b["x"] + branch)
        return jnp.mean((jnp.tanh(h @ p["head"]) - b["y"]) ** 2), metrics

    pipe = zbjax.pipeline(
        loss_fn, mesh=pp_mesh(2), schedule=schedule, num_microbatches=2, has_aux=True
    )
    result = pipe.value_and_grad(params, batch)
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(result[1]))
    assert_matches(result, reference_value_and_grad(loss_fn, params, batch, 2, has_aux=True))
    # The metrics' edge carries no cotangent back to stage 0.
    assert pipe.graph.stages[0].output_differentiable.count(True) == 1


def test_a_loss_written_for_its_microbatch_shape_runs_with_aux():
    """The check that refuses per-example aux traces loss_fn on the whole batch too; a loss
    written for its microbatch's shape (a fixed reshape) failed there with its own TypeError,
    though the pipeline only ever calls it on microbatches. Such a loss now runs."""
    width, rows = 8, 2  # microbatches of 2 rows

    def loss_fn(p, b):
        x = b["x"].reshape(rows, width)
        h = zbjax.stage_boundary(jnp.tanh(x @ p["w1"]))
        loss = jnp.mean((h @ p["w2"] - b["y"].reshape(rows, width)) ** 2)
        return loss, {"act": jnp.mean(h)}

    rng = np.random.default_rng(0)
    params = {k: jnp.asarray(rng.normal(size=(width, width)) * 0.3) for k in ("w1", "w2")}
    batch = {k: jnp.asarray(rng.normal(size=(8, width))) for k in ("x", "y")}
    mesh = jax.make_mesh((2,), ("pp",), devices=jax.devices()[:2])
    pipe = zbjax.pipeline(loss_fn, mesh=mesh, schedule="1f1b", num_microbatches=4, has_aux=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # scalar aux only: nothing to warn about
        (loss, aux), grads = pipe.value_and_grad(params, batch)
    (want, want_aux), want_grads = reference_value_and_grad(loss_fn, params, batch, 4, has_aux=True)
    np.testing.assert_allclose(loss, want, rtol=1e-5)
    np.testing.assert_allclose(aux["act"], want_aux["act"], rtol=1e-5)
    for name in params:
        np.testing.assert_allclose(grads[name], want_grads[name], rtol=1e-4, atol=1e-6)

    # A per-row aux leaf cannot be told from a mean when loss_fn fails on the whole batch: it
    # comes back averaged, as before, but now with a warning that says so and why.
    def per_row(p, b):
        loss, _ = loss_fn(p, b)
        return loss, {"row_loss": jnp.mean(b["x"].reshape(rows, width) ** 2, axis=1)}

    pipe = zbjax.pipeline(per_row, mesh=mesh, schedule="1f1b", num_microbatches=4, has_aux=True)
    with pytest.warns(UserWarning, match="loss_fn fails on the whole batch .TypeError") as got:
        (_, aux), _ = pipe.value_and_grad(params, batch)
    assert "every aux leaf comes back as the mean" in str(got[0].message)
    assert got[0].filename == __file__  # it names the user's line
    with pytest.warns(UserWarning, match="loss_fn fails on the whole batch"):
        (_, want_aux), _ = reference_value_and_grad(per_row, params, batch, 4, has_aux=True)
    assert aux["row_loss"].shape == (rows,)
    np.testing.assert_allclose(aux["row_loss"], want_aux["row_loss"], rtol=1e-5)


def test_flax_batch_stats_pass_in_params_and_come_back_as_aux():
    """The README's path for Flax mutable state: batch_stats in the params tree (a zero
    gradient) and the updated state returned as aux, averaged over the microbatches."""
    import flax.linen as nn
    import optax

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.BatchNorm(use_running_average=False)(nn.Dense(8)(x))
            x = zbjax.stage_boundary(jnp.tanh(x))
            return nn.Dense(2)(x)

    net = Net()
    rng = np.random.default_rng(0)
    batch = {"x": rng.normal(size=(8, 4)).astype(np.float32), "y": rng.normal(size=(8, 2))}
    variables = net.init(jax.random.key(0), batch["x"])

    def loss_fn(variables, batch):
        out, state = net.apply(variables, batch["x"], mutable=["batch_stats"])
        return jnp.mean((out - batch["y"]) ** 2), state

    pipe = zbjax.pipeline(
        loss_fn, mesh=pp_mesh(2), schedule="zb-h1", num_microbatches=2, has_aux=True
    )
    (loss, state), grads = pipe.value_and_grad(variables, batch)
    want = reference_value_and_grad(loss_fn, variables, batch, 2, has_aux=True)
    for got, ref in zip(
        jax.tree.leaves(((loss, state), grads)), jax.tree.leaves(want), strict=True
    ):
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)
    assert all(np.all(g == 0) for g in jax.tree.leaves(grads["batch_stats"]))
    # The running mean moved from its initial zeros, as one step of BatchNorm moves it.
    assert np.any(np.asarray(state["batch_stats"]["BatchNorm_0"]["mean"]) != 0)
    # Kept out of the optimizer, it stays as the step left it.
    labels = {k: ("frozen" if k == "batch_stats" else "train") for k in variables}
    tx = pipe.per_leaf(
        optax.multi_transform({"train": optax.adamw(0.1), "frozen": optax.set_to_zero()}, labels)
    )
    staged = pipe.stage(variables)
    staged_grads = pipe.value_and_grad(staged, batch)[1]
    updates = pipe.unstage(tx.update(staged_grads, tx.init(staged), staged)[0])
    assert all(np.all(u == 0) for u in jax.tree.leaves(updates["batch_stats"]))
    assert all(np.any(u != 0) for u in jax.tree.leaves(updates["params"]))


def test_complex_aux_leaves_come_back_as_value_and_grad_returns_them():
    """A complex metric was refused ("a mean must be floating"; helper H1), though
    jax.value_and_grad(has_aux=True) returns it; its mean and per-example rows come back."""

    def loss_fn(p, b):
        h = zbjax.stage_boundary(jnp.tanh(b["x"] @ p["w0"]))
        h = jnp.tanh(h @ p["w1"])
        aux = {"z": jnp.mean(h[:, 0] + 1j * h[:, 1]), "phase": jnp.exp(1j * h[:, 2])}
        return jnp.mean(h**2), aux

    rng = np.random.default_rng(0)
    params = {k: jnp.asarray(rng.normal(size=(8, 8)) / 3, jnp.float32) for k in ("w0", "w1")}
    batch = {"x": jnp.asarray(rng.normal(size=(16, 8)), jnp.float32)}
    (want, want_aux), _ = jax.value_and_grad(loss_fn, has_aux=True)(params, batch)
    pipe = zbjax.pipeline(
        loss_fn, mesh=pp_mesh(2, dp=2), schedule="zb-h1", num_microbatches=4, has_aux=True
    )
    (loss, aux), _ = pipe.value_and_grad(params, batch)
    np.testing.assert_allclose(loss, want, rtol=1e-6)
    for name in ("z", "phase"):
        assert aux[name].dtype == jnp.complex64 and aux[name].shape == want_aux[name].shape
        np.testing.assert_allclose(aux[name], want_aux[name], rtol=1e-5, atol=1e-7)
