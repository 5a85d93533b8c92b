"""pipe.per_leaf: optax transformations that look at the parameter tree, on staged params.

Each case runs two optimizer steps on staged params and gradients and the same two on the user
layout, and compares the staged params after them with the user-layout params staged (every
copy of a tied leaf, padding included). Both get the same gradients (``jax.value_and_grad``'s,
staged: each copy of a tied leaf holds the leaf's gradient, as the pipeline's do), because
Adam-like optimizers turn float rounding in a near-zero gradient into a visible difference.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zbjax
from models import gpt, gpt_scan
from zbjax.microbatch import reference_value_and_grad
from zbjax.optim import device_views, leaf_view, pack_views, unpack_views
from zbjax.params import LeafSlot, stage_leaves, staged_layout

CFG = gpt.GPTConfig(num_layers=4, d_model=16, seq_len=8, vocab_size=32)
M = 2


def decay_mask(params):
    return jax.tree.map(lambda x: x.ndim > 1, params)


def labels(params):
    return jax.tree.map(lambda x: "matrix" if x.ndim > 1 else "vector", params)


TRANSFORMS = {
    "adamw with a decay mask": lambda: optax.adamw(1e-2, weight_decay=0.5, mask=decay_mask),
    "adamw with a decay mask tree": lambda: optax.adamw(
        1e-2, weight_decay=0.5, mask=decay_mask(gpt.init_params(jax.random.key(0), CFG))
    ),
    "multi_transform by label": lambda: optax.multi_transform(
        {"matrix": optax.adam(1e-2), "vector": optax.sgd(0.5)}, labels
    ),
    "lamb (per-leaf trust ratio)": lambda: optax.lamb(1e-2),
    "adafactor (factored moments)": lambda: optax.adafactor(1e-2, min_dim_size_to_factor=8),
}
# What reduces over a whole leaf sees a device's rows of a leaf split over devices by rows.
ROWS_EXACT = ("adamw with a decay mask", "multi_transform by label")


def _case(module, mesh_shape, schedule, num_stages):
    cfg = CFG
    if module is gpt:
        cfg = dataclasses.replace(cfg, stage_boundaries=gpt.balanced_boundaries(cfg, num_stages))
    loss_fn = module.make_loss_fn(cfg)
    params = module.init_params(jax.random.key(0), cfg)
    batch = gpt.make_batch(jax.random.key(1), cfg, 8)
    explicit = (jax.sharding.AxisType.Explicit,) * len(mesh_shape)
    mesh = jax.make_mesh(mesh_shape, ("pp", "dp")[: len(mesh_shape)], axis_types=explicit)
    kw = {} if module is gpt else {"num_stages": num_stages}
    pipe = zbjax.pipeline(loss_fn, mesh=mesh, schedule=schedule, num_microbatches=M, **kw)
    staged = pipe.stage(params, batch)
    _, ref_grads = reference_value_and_grad(loss_fn, params, batch, M)
    return pipe, params, staged, pipe.stage(ref_grads), ref_grads


@pytest.fixture(scope="module")
def tied_case():
    # The tied embedding is read by the first stage and the LM head on the last device.
    return _case(gpt, (2, 2), "zb-h1", 2)


@pytest.fixture(scope="module")
def scan_case():
    # zb-v puts stages 0 and 3 on device 0: it holds two row ranges of each stacked leaf.
    return _case(gpt_scan, (2,), "zb-v", 4)


def two_steps(tx, params, grads):
    state = tx.init(params)
    for _ in range(2):
        updates, state = tx.update(grads, state, params)
        params = optax.apply_updates(params, updates)
    return params


def _check(case, name):
    pipe, params, staged, grads, ref_grads = case
    make = TRANSFORMS[name]
    tx = optax.chain(pipe.clip_by_global_norm(1.0), pipe.per_leaf(make()))
    got = jax.jit(lambda p, g: two_steps(tx, p, g))(staged, grads)
    want = two_steps(optax.chain(optax.clip_by_global_norm(1.0), make()), params, ref_grads)
    assert isinstance(got, zbjax.StagedParams)
    for row, want_row in zip(got.rows, pipe.stage(want).rows, strict=True):
        np.testing.assert_allclose(row, want_row, rtol=1e-5, atol=1e-6)
    moved = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(got.rows, staged.rows, strict=True))
    assert moved > 1e-3


@pytest.mark.parametrize("name", list(TRANSFORMS))
def test_per_leaf_equals_the_optimizer_on_the_user_tree_with_a_tied_leaf_and_data_parallel(
    tied_case, name
):
    _check(tied_case, name)


@pytest.mark.parametrize("name", ROWS_EXACT)
def test_per_leaf_equals_the_optimizer_on_the_user_tree_with_scan_rows_split_over_devices(
    scan_case, name
):
    _check(scan_case, name)


def test_flax_train_state_holds_staged_params(tied_case):
    """TrainState.create / apply_gradients ask whether the params hold
    "overwrite_with_gradient", which raised a TypeError on staged params."""
    from flax.training import train_state

    pipe, params, staged, grads, ref_grads = tied_case
    tx = optax.chain(pipe.clip_by_global_norm(1.0), pipe.per_leaf(optax.adamw(1e-2)))
    state = train_state.TrainState.create(apply_fn=None, params=staged, tx=tx)
    for _ in range(2):
        state = state.apply_gradients(grads=grads)
    want = two_steps(
        optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2)), params, ref_grads
    )
    assert int(state.step) == 2
    for row, want_row in zip(state.params.rows, pipe.stage(want).rows, strict=True):
        np.testing.assert_allclose(row, want_row, rtol=1e-5, atol=1e-6)


def test_a_mask_on_the_staged_rows_without_per_leaf_decays_every_leaf(tied_case):
    # Why per_leaf exists: the mask sees the rows (two-dimensional), not the model's leaves.
    pipe, params, staged, grads, ref_grads = tied_case
    tx = optax.adamw(1e-2, weight_decay=0.5, mask=decay_mask)
    got = pipe.unstage(two_steps(tx, staged, grads))
    want = two_steps(tx, params, ref_grads)
    np.testing.assert_allclose(  # a matrix: decayed either way
        got["embed"]["position"], want["embed"]["position"], rtol=1e-4, atol=1e-5
    )
    # A LayerNorm scale (ones at init, one-dimensional): decayed only on the rows.
    scale = got["block_0"]["ln_1"]["scale"] - want["block_0"]["ln_1"]["scale"]
    assert float(jnp.max(jnp.abs(scale))) > 1e-3


def test_per_leaf_state_holds_each_devices_share_and_errors_name_the_fix(tied_case):
    pipe, params, staged, grads, _ = tied_case
    tx = pipe.per_leaf(optax.adam(1e-2))
    state = tx.init(staged)
    assert isinstance(state, zbjax.StagedState)
    # mu and nu of a device's leaves, plus the step count: the tied embedding on both devices.
    sizes = [np.shape(r) for r in state.rows]
    staged_size = sum(np.shape(r)[1] for r in staged.rows)
    assert sizes[0][0] == 2
    assert 2 * staged_size <= sum(s[1] for s in sizes) <= 2 * staged_size + 4
    with pytest.raises(zbjax.PipelineError, match="takes staged params"):
        tx.init(params)
    with pytest.raises(zbjax.PipelineError, match="not the one per_leaf"):
        tx.update(grads, optax.EmptyState(), staged)


def test_a_learning_rate_schedule_runs_inside_per_leaf_and_a_closure_over_the_step_is_named(
    tied_case,
):
    pipe, params, staged, grads, ref_grads = tied_case
    schedule = optax.linear_schedule(1e-2, 1e-3, 4)
    inner = optax.inject_hyperparams(optax.adamw)(
        learning_rate=schedule, weight_decay=0.5, mask=decay_mask
    )
    step = jax.jit(lambda p, g, s, tx: _step(tx, p, g, s), static_argnums=3)
    tx = pipe.per_leaf(inner)
    got, state = staged, tx.init(staged)
    want, ref_state = params, inner.init(params)
    for _ in range(3):
        got, state = step(got, grads, state, tx)
        want, ref_state = _step(inner, want, ref_grads, ref_state)
    for row, want_row in zip(got.rows, pipe.stage(want).rows, strict=True):
        np.testing.assert_allclose(row, want_row, rtol=1e-5, atol=1e-6)
    # Around per_leaf, the schedule's learning rate is a value of the jitted step that the
    # per-device code closes over; on a mesh with explicit axes (the fixtures') JAX cannot
    # take it in.
    outer = optax.inject_hyperparams(lambda learning_rate: pipe.per_leaf(optax.sgd(learning_rate)))(
        learning_rate=schedule
    )
    state = outer.init(staged)
    _, state = step(staged, grads, state, outer)  # the state now lies on the mesh
    with pytest.raises(zbjax.PipelineError, match="put such a wrapper inside"):
        step(staged, grads, state, outer)


def _step(tx, params, grads, state, **extra_args):
    updates, state = tx.update(grads, state, params, **extra_args)
    return optax.apply_updates(params, updates), state


def test_extra_arguments_such_as_the_loss_value_reach_the_transformation_inside_per_leaf(
    tied_case,
):
    # reduce_on_plateau reads update(..., value=loss); per_leaf's update took no extra
    # arguments (a TypeError from zbjax's closure). Every device gets the value whole.
    pipe, params, staged, grads, ref_grads = tied_case

    def make():
        plateau = optax.contrib.reduce_on_plateau(patience=1, factor=0.5, cooldown=0)
        return optax.chain(optax.adamw(1e-2, weight_decay=0.5, mask=decay_mask), plateau)

    step = jax.jit(lambda p, g, s, v, tx: _step(tx, p, g, s, value=v), static_argnums=4)
    tx, inner = pipe.per_leaf(make()), make()
    got, state = staged, tx.init(staged)
    want, ref_state = params, inner.init(params)
    for value in (1.0, 1.0, 1.0, 0.5):  # a plateau: the learning rate halves on the way
        got, state = step(got, grads, state, jnp.float32(value), tx)
        want, ref_state = _step(inner, want, ref_grads, ref_state, value=jnp.float32(value))
    assert float(ref_state[1].scale) < 1.0
    for row, want_row in zip(got.rows, pipe.stage(want).rows, strict=True):
        np.testing.assert_allclose(row, want_row, rtol=1e-5, atol=1e-6)
    # Eagerly, and a transformation that takes no extra arguments ignores them.
    sgd = pipe.per_leaf(optax.sgd(0.1))
    updates, _ = sgd.update(grads, sgd.init(staged), staged, value=jnp.float32(2.0))
    expected, _ = optax.sgd(0.1).update(ref_grads, optax.sgd(0.1).init(params), params)
    for row, want_row in zip(updates.rows, pipe.stage(expected).rows, strict=True):
        np.testing.assert_allclose(row, want_row, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------- views of one device's row


def _slot(leaf, offset, shape, rows=None):
    return LeafSlot(leaf, "float32", offset, int(np.prod(shape)), shape, rows)


def test_leaf_view_of_whole_missing_scalar_and_row_range_copies():
    aval = jax.ShapeDtypeStruct((6, 3), jnp.float32)
    for missing in (aval, jax.ShapeDtypeStruct((), jnp.float32)):  # held by other devices
        assert leaf_view(missing, []).reads == leaf_view(missing, []).writes == ()
    whole, part = _slot(0, 0, (6, 3)), _slot(0, 18, (2, 3), (1, 3))
    view = leaf_view(aval, [part, whole])
    assert view.shape == (6, 3) and view.reads == ((whole, 0),)
    assert set(view.writes) == {(whole, 0), (part, 1)}
    # Two disjoint ranges and one overlapping the first: the view is rows 0-3 then 4-6.
    a, b, c = _slot(0, 0, (2, 3), (0, 2)), _slot(0, 6, (2, 3), (4, 6)), _slot(0, 12, (2, 3), (1, 3))
    view = leaf_view(aval, [b, c, a])
    assert view.shape == (5, 3)
    assert view.reads == ((a, 0), (c, 1), (b, 0))
    assert dict((s.offset, first) for s, first in view.writes) == {0: 0, 6: 3, 12: 1}


@pytest.mark.parametrize(
    "stage_leaves_, placement, rows",
    [
        (((0, 1), (2,), (0, 3)), (0, 1, 1), None),  # leaf 0 tied over two devices
        (((0, 1), (0, 2)), (0, 0), None),  # tied on one device, stored twice
        (((0, 3), (0,), (0, 2)), (0, 1, 0), (((0, 2), None), ((2, 4),), ((3, 6), None))),
        (((0, 4), (1, 4, 2)), (0, 1), None),  # a scalar leaf (a learned scale) on both devices
    ],
)
def test_unpack_then_pack_gives_each_devices_row_back(stage_leaves_, placement, rows):
    shapes = ((6, 3), (4,), (2, 2), (5,), ())
    avals = [jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes]
    layout = staged_layout(avals, stage_leaves_, placement, 2, rows)
    leaves = [jax.random.normal(jax.random.key(i), a.shape) for i, a in enumerate(avals)]
    staged = stage_leaves(layout, leaves)
    for d, views in enumerate(device_views(layout)):
        local = [r[d] for r in staged.rows]
        values = unpack_views(layout, views, local)
        for view, value in zip(views, values, strict=True):
            assert value.shape == view.shape if view.given else value is None
        # A device without any float32 leaf (the second case's device 1) gets one empty.
        assert any(view.given for view in views)
        for got, want in zip(pack_views(layout, views, values), local, strict=True):
            np.testing.assert_array_equal(got, want)


def test_per_leaf_called_eagerly_compiles_once_and_matches_the_jitted_update(tied_case):
    """Outside a jit, every update built the per-device shard_map anew and compiled it
    again (1.2-2.5 s per step on 2 cores)."""
    pipe, params, staged, grads, _ = tied_case
    traces = []

    def counting(tx):
        def update(updates, state, params=None):
            traces.append(1)  # runs once per trace of each device's branch
            return tx.update(updates, state, params)

        return optax.GradientTransformation(tx.init, update)

    tx = pipe.per_leaf(counting(optax.adamw(1e-2, mask=decay_mask)))
    state = tx.init(staged)
    eager, state = _step(tx, staged, grads, state)
    first = len(traces)
    assert first > 0
    for _ in range(2):
        eager, state = _step(tx, eager, grads, state)
    assert len(traces) == first  # the 2nd and 3rd eager updates were not traced again
    adamw = optax.adamw(1e-2, mask=decay_mask)
    jitted = jax.jit(lambda p, g: two_steps(pipe.per_leaf(adamw), p, g))
    want = two_steps(pipe.per_leaf(adamw), staged, grads)  # eager updates
    for row, want_row in zip(jitted(staged, grads).rows, want.rows, strict=True):
        np.testing.assert_allclose(row, want_row, rtol=1e-6, atol=1e-7)


def test_global_norm_leaves_out_row_padding_an_optimizer_filled_with_nan(tied_case):
    """optax.adam(eps=0) on the rows computes 0 / 0 in the padding (float16 Adam too, its eps
    underflowing): the params stay right, but the norm of the rows was NaN."""
    pipe, params, staged, grads, _ = tied_case
    tx = optax.adam(1e-2, eps=0.0)
    stepped, _ = _step(tx, staged, grads, tx.init(staged))
    assert any(bool(jnp.any(jnp.isnan(r))) for r in stepped.rows)  # the padding
    unstaged = pipe.unstage(stepped)
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(unstaged))
    want = np.sqrt(sum(np.sum(np.square(np.asarray(x))) for x in jax.tree.leaves(unstaged)))
    np.testing.assert_allclose(float(pipe.global_norm(stepped)), want, rtol=1e-5)


def test_per_leaf_on_bfloat16_params_rounds_once_as_optax_on_the_user_tree():
    """Adam with float32 moments on bfloat16 params: optax adds the float32 update to the
    param and rounds once. per_leaf returns 16-bit leaves' updates in float32 rows, so
    optax.apply_updates on the staged rows does the same (packed into bfloat16 rows, the
    update was rounded first: params one bfloat16 step off after one step)."""

    def loss_fn(p, batch):
        h = jnp.tanh(batch["x"] @ p["w1"].astype(jnp.float32))
        h = zbjax.stage_boundary(h)
        return jnp.mean((h @ p["w2"].astype(jnp.float32) - batch["y"]) ** 2)

    keys = jax.random.split(jax.random.key(0), 4)
    params = {
        "w1": (jax.random.normal(keys[0], (8, 16)) * 0.5).astype(jnp.bfloat16),
        "w2": (jax.random.normal(keys[1], (16, 4)) * 0.5).astype(jnp.bfloat16),
    }
    batch = {"x": jax.random.normal(keys[2], (8, 8)), "y": jax.random.normal(keys[3], (8, 4))}
    mesh = jax.make_mesh((2,), ("pp",), devices=jax.devices()[:2])
    pipe = zbjax.pipeline(loss_fn, mesh=mesh, schedule="1f1b", num_microbatches=2)
    staged = pipe.stage(params, batch)
    grads = jax.grad(loss_fn)(params, batch)
    tx = optax.adam(1e-2, mu_dtype=jnp.float32)
    # Jitted, as in a train step (eagerly each op rounds Adam's bfloat16 second moment, which
    # a fused XLA program keeps wider: the two differ by up to 3.6e-5 in the update).
    updates, _ = jax.jit(tx.update)(grads, tx.init(params), params)
    want = optax.apply_updates(params, updates)
    wrapped = pipe.per_leaf(tx)
    staged_updates, _ = jax.jit(wrapped.update)(pipe.stage(grads), wrapped.init(staged), staged)
    assert [str(r.dtype) for r in staged_updates.rows] == ["float32"]
    assert staged_updates.dtypes == staged.dtypes == ("bfloat16",)
    got = pipe.unstage(optax.apply_updates(staged, staged_updates))
    for name in params:
        assert got[name].dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(want[name]))
    # The float32 update rows unstage and measure as the updates they are (both refused
    # them as rows "cast after pipe.stage"), so clipping can follow per_leaf in a chain.
    unstaged = pipe.unstage(staged_updates)
    for name in params:
        assert unstaged[name].dtype == jnp.float32
        np.testing.assert_allclose(unstaged[name], updates[name], rtol=1e-6)  # two programs
    np.testing.assert_allclose(pipe.global_norm(staged_updates), optax.tree.norm(updates), 1e-6)
    clipped = optax.chain(wrapped, pipe.clip_by_global_norm(1e-3))
    out, _ = jax.jit(clipped.update)(pipe.stage(grads), clipped.init(staged), staged)
    np.testing.assert_allclose(pipe.global_norm(out), 1e-3, rtol=1e-5)


def test_per_leaf_gives_a_device_of_bfloat16_leaves_the_trees_dtypes_and_their_updates():
    """A float32 leaf on device 0, a bfloat16 one on device 1. inject_hyperparams keeps the
    hyperparameters in the tree's highest float dtype: device 1 alone saw bfloat16, where
    b2 = 0.999 is 1.0, and its Adam update was NaN. And the bfloat16 leaf's update came back
    in float32 rows where optax returns bfloat16, so optax.apply_if_finite (whose skip branch
    returns zeros like the gradients) failed in lax.cond (helper Q2)."""

    def loss_fn(p, x):
        h = zbjax.stage_boundary(jnp.tanh(x @ p["w0"]))
        return jnp.mean((h.astype(jnp.bfloat16) @ p["w1"]).astype(jnp.float32) ** 2)

    k0, k1, k2 = jax.random.split(jax.random.key(0), 3)
    params = {
        "w0": jax.random.normal(k0, (8, 8)) / 3,
        "w1": (jax.random.normal(k1, (8, 8)) / 3).astype(jnp.bfloat16),
    }
    x = jax.random.normal(k2, (8, 8))
    mesh = jax.make_mesh((2,), ("pp",), devices=jax.devices()[:2])
    pipe = zbjax.pipeline(loss_fn, mesh=mesh, schedule="1f1b", num_microbatches=2)
    staged = pipe.stage(params, x)
    grads = jax.grad(loss_fn)(params, x)

    injected = optax.inject_hyperparams(optax.adamw)
    cases = [  # inject_hyperparams' float32 learning rate makes the bfloat16 leaf's update float32
        (injected(learning_rate=1e-2), pipe.per_leaf(injected(learning_rate=1e-2))),
        (
            optax.apply_if_finite(optax.adam(1e-2), 3),
            optax.apply_if_finite(pipe.per_leaf(optax.adam(1e-2)), 3),
        ),
    ]
    for tx, wrapped in cases:
        want, _ = jax.jit(tx.update)(grads, tx.init(params), params)
        updates, _ = jax.jit(wrapped.update)(pipe.stage(grads), wrapped.init(staged), staged)
        assert staged.dtypes == ("bfloat16", "float32")
        assert [r.dtype for r in updates.rows] == [want["w1"].dtype, want["w0"].dtype]
        got = pipe.unstage(updates)
        for name in params:
            assert bool(jnp.all(jnp.isfinite(got[name])))
            np.testing.assert_allclose(
                np.asarray(got[name], np.float32), np.asarray(want[name], np.float32), rtol=1e-6
            )


def test_per_leaf_on_mixed_dtypes_keeps_wide_and_float_updates_and_names_a_hyperparameter_split():
    """Review of the change above: a second per_leaf in a chain rounded the first's float32
    update of a bfloat16 leaf (its dtypes were probed with the params' dtypes, not the rows it
    gets); an integer leaf's float update (weight decay) was truncated to int; the stand-in
    leaf had zero rows, and muon divided by its fan-in; inject_hyperparams inside
    multi_transform sees one label's leaves, which on device 1 are bfloat16 only (NaN), now
    refused naming hyperparam_dtype."""

    def loss_fn(p, x):
        h = zbjax.stage_boundary(jnp.tanh(x @ p["a"] + p["b"]) * p["n"][0])
        return jnp.mean((h.astype(jnp.bfloat16) @ p["c"]).astype(jnp.float32) ** 2)

    k0, k1, k2 = jax.random.split(jax.random.key(0), 3)
    params = {
        "a": jax.random.normal(k0, (8, 16)) / 3,
        "b": jnp.full((16,), 0.1),
        "c": (jax.random.normal(k1, (16, 8)) / 3).astype(jnp.bfloat16),
        "n": jnp.arange(1, 9, dtype=jnp.int32),
    }
    x = jax.random.normal(k2, (8, 8))
    mesh = jax.make_mesh((2,), ("pp",), devices=jax.devices()[:2])
    pipe = zbjax.pipeline(loss_fn, mesh=mesh, schedule="1f1b", num_microbatches=2)
    staged = pipe.stage(params, x)
    grads = jax.grad(loss_fn, allow_int=True)(params, x)
    grads["n"] = jnp.zeros_like(params["n"])  # zbjax's integer gradients: zeros of the dtype
    staged_grads = pipe.stage(grads)
    floats = {k: v for k, v in params.items() if k != "n"}
    cases = [
        (optax.chain(optax.scale_by_adam(mu_dtype=jnp.float32), optax.scale(-1e-2)), False),
        (optax.adamw(1e-1, weight_decay=0.5), True),
    ]
    if hasattr(optax.contrib, "muon"):  # optax 0.2.5 and later
        cases.append((optax.contrib.muon(1e-2), False))
    for tx, with_int in cases:
        tree = params if with_int else floats
        g = grads if with_int else {k: grads[k] for k in floats}
        want, _ = jax.jit(tx.update)(g, tx.init(tree), tree)
        if isinstance(tx, optax.GradientTransformation) and tx is cases[0][0]:
            parts = (optax.scale_by_adam(mu_dtype=jnp.float32), optax.scale(-1e-2))
            wrapped = optax.chain(*(pipe.per_leaf(t) for t in parts))  # two per_leafs
        else:
            wrapped = pipe.per_leaf(tx)
        got, _ = jax.jit(wrapped.update)(staged_grads, wrapped.init(staged), staged)
        got = pipe.unstage(got)
        for name in want:
            assert got[name].dtype == want[name].dtype, name
            np.testing.assert_allclose(
                np.asarray(got[name], np.float32),
                np.asarray(want[name], np.float32),
                rtol=1e-5,
                atol=1e-7,  # muon's Newton-Schulz matmuls, in two programs: 2.3e-8 apart
            )
    labels = {"a": "x", "b": "y", "c": "y", "n": "x"}
    tx = optax.multi_transform(
        {"x": optax.sgd(1e-2), "y": optax.inject_hyperparams(optax.adam)(learning_rate=1e-2)},
        labels,
    )
    with pytest.raises(zbjax.PipelineError, match="hyperparam_dtype=jnp.float32"):
        pipe.per_leaf(tx).init(staged)


def test_per_leaf_packs_an_empty_leaf_that_shares_its_offset_with_another():
    """A stacked leaf of size 0 split by rows beside a scanned weight, under zb-v (two stages
    a device): its empty slot shares an offset with the next stage's weight, and packing
    the updates went back to that offset, padding the row (a switch-branch shape error)."""

    def loss_fn(p, b):
        def body(h, w):
            return jnp.tanh(h @ w[0]) + jnp.sum(w[1]), None

        h, _ = jax.lax.scan(body, b["x"], (p["W"], p["empty"]))
        return jnp.mean(h**2)

    params = {
        "W": 0.3 * jax.random.normal(jax.random.key(0), (8, 8, 8)),
        "empty": jnp.zeros((8, 0)),
    }
    batch = {"x": jax.random.normal(jax.random.key(1), (8, 8))}
    mesh = jax.make_mesh((2,), ("pp",), devices=jax.devices()[:2])
    pipe = zbjax.pipeline(loss_fn, mesh=mesh, schedule="zb-v", num_microbatches=2)
    staged = pipe.stage(params, batch)
    grads = pipe.value_and_grad(staged, batch)[1]
    tx = pipe.per_leaf(optax.adam(1e-2))
    updates, _ = tx.update(grads, tx.init(staged), staged)
    ref = optax.adam(1e-2)
    user_grads = jax.grad(loss_fn)(params, batch)
    want, _ = ref.update(user_grads, ref.init(params), params)
    got = pipe.unstage(updates)
    np.testing.assert_allclose(got["W"], want["W"], rtol=1e-5, atol=1e-6)
    assert got["empty"].shape == (8, 0)
