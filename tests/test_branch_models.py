"""Contract tests of the multi-branch reference models: loss, grads, markers, stage graphs."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zbjax
from models import candle_uno, dlrm, multimodal, two_tower

BATCH_SIZE = 8

# name -> (module, config without markers, marker options that cut some branch in two, stages
# per branch with those options, counted by hand)
MODELS = {
    "multimodal": (
        multimodal,
        multimodal.MultiModalConfig(layers_per_branch=2),
        {"branch_boundaries": True, "layers_per_stage": 1},
        [2, 2],
    ),
    "two_tower": (
        two_tower,
        two_tower.TwoTowerConfig(combine="concat"),
        {"branch_boundaries": True, "layers_per_stage": 2},
        [1, 2],
    ),
    "dlrm": (
        dlrm,
        dlrm.DLRMConfig(bag_size=3, num_table_groups=2),
        {"branch_boundaries": True, "layers_per_stage": 1},
        [2, 1, 1],
    ),
    "candle_uno": (
        candle_uno,
        candle_uno.CandleUnoConfig(tower_depths=(2, 1, 2)),
        {"branch_boundaries": True, "layers_per_stage": 1, "head_stage": False},
        [2, 1, 2],
    ),
}

# name -> (config, expected number of marker stages), counted by hand from the docstrings.
STAGE_COUNTS = {
    "multimodal 2x1": (multimodal.MultiModalConfig(branch_boundaries=True), 3),
    "multimodal 4x1": (multimodal.MultiModalConfig(num_branches=4, branch_boundaries=True), 5),
    "multimodal 4x2 cut": (
        multimodal.MultiModalConfig(
            num_branches=4, layers_per_branch=2, branch_boundaries=True, layers_per_stage=1
        ),
        9,
    ),
    "multimodal 4x2 cut, head in last branch": (
        multimodal.MultiModalConfig(
            num_branches=4,
            layers_per_branch=2,
            branch_boundaries=True,
            layers_per_stage=1,
            head_stage=False,
        ),
        8,
    ),
    "two_tower 1+3 dot": (two_tower.TwoTowerConfig(branch_boundaries=True), 3),
    "two_tower 1+3 per layer": (
        two_tower.TwoTowerConfig(branch_boundaries=True, layers_per_stage=1),
        5,
    ),
    "dlrm 3 tables": (dlrm.DLRMConfig(branch_boundaries=True), 5),
    "dlrm bottom 4 per layer": (
        dlrm.DLRMConfig(bottom_depth=4, branch_boundaries=True, layers_per_stage=1),
        8,
    ),
    "candle_uno 3 towers": (candle_uno.CandleUnoConfig(branch_boundaries=True), 4),
    "candle_uno 3 towers of 2 cut": (
        candle_uno.CandleUnoConfig(branch_boundaries=True, layers_per_stage=1),
        7,
    ),
}
MODULE_OF = {
    multimodal.MultiModalConfig: multimodal,
    two_tower.TwoTowerConfig: two_tower,
    dlrm.DLRMConfig: dlrm,
    candle_uno.CandleUnoConfig: candle_uno,
}


def _marked(name: str):
    _, cfg, options, _ = MODELS[name]
    return dataclasses.replace(cfg, **options)


@pytest.fixture(scope="module")
def computed():
    """Per model: (params, batch, (loss, grads) without markers, (loss, grads) with markers)."""
    out = {}
    for name, (module, cfg, _, _) in MODELS.items():
        params = module.init_params(jax.random.key(0), cfg)
        batch = module.make_batch(jax.random.key(1), cfg, BATCH_SIZE)
        plain = jax.value_and_grad(module.make_loss_fn(cfg))
        marked = jax.value_and_grad(module.make_loss_fn(_marked(name)))
        # One compiled program per model for both variants.
        both = jax.jit(lambda p, b, plain=plain, marked=marked: (plain(p, b), marked(p, b)))
        out[name] = (params, batch, *both(params, batch))
    return out


def _marker_count(module, cfg) -> int:
    # Shapes only: tracing needs no compiled init or data.
    params = jax.eval_shape(lambda key: module.init_params(key, cfg), jax.random.key(0))
    batch = jax.eval_shape(lambda key: module.make_batch(key, cfg, 2), jax.random.key(1))
    return str(jax.make_jaxpr(module.make_loss_fn(cfg))(params, batch)).count("stage_boundary")


def _expected_edges(segments: list[int], head_stage: bool) -> set[tuple[int, int]]:
    """Returns branch-internal chain edges plus each branch's last stage -> head stage."""
    edges, first, lasts = set(), 0, []
    for count in segments:
        edges.update((s, s + 1) for s in range(first, first + count - 1))
        lasts.append(first + count - 1)
        first += count
    head = first if head_stage else first - 1
    edges.update((last, head) for last in lasts if last != head)
    return edges


# ----------------------------------------------------------------------------- every model


@pytest.mark.parametrize("name", list(MODELS))
def test_loss_is_a_finite_float32_scalar_and_grads_are_finite_and_shaped_like_params(
    computed, name
):
    params, _, (loss, grads), _ = computed[name]
    assert loss.dtype == jnp.float32 and loss.shape == () and np.isfinite(float(loss))
    assert jax.tree.structure(grads) == jax.tree.structure(params)
    for p, g in zip(jax.tree.leaves(params), jax.tree.leaves(grads), strict=True):
        assert p.dtype == g.dtype == jnp.float32 and p.shape == g.shape
        assert np.isfinite(np.asarray(g)).all()
    # Every branch and the head learn: each top-level params group gets some gradient.
    for key, group in grads.items():
        assert max(float(jnp.abs(g).max()) for g in jax.tree.leaves(group)) > 0.0, key


@pytest.mark.parametrize("name", list(MODELS))
def test_branch_markers_do_not_change_the_loss_or_the_grads(computed, name):
    _, _, (loss, grads), (marked_loss, marked_grads) = computed[name]
    np.testing.assert_array_equal(np.asarray(loss), np.asarray(marked_loss))
    for g, h in zip(jax.tree.leaves(grads), jax.tree.leaves(marked_grads), strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(h))


@pytest.mark.parametrize("name", list(STAGE_COUNTS))
def test_marker_count_is_num_marker_stages_minus_one(name):
    cfg, expected = STAGE_COUNTS[name]
    module = MODULE_OF[type(cfg)]
    assert module.num_marker_stages(cfg) == expected
    assert len(module.stage_owners(cfg)) == expected
    assert _marker_count(module, cfg) == expected - 1
    unmarked = dataclasses.replace(
        cfg, branch_boundaries=False, layers_per_stage=None, head_stage=True
    )
    assert module.num_marker_stages(unmarked) == 1
    assert _marker_count(module, unmarked) == 0


@pytest.mark.parametrize("name", list(MODELS))
def test_params_top_level_keys_are_the_branches_and_the_head(computed, name):
    module, cfg, _, _ = MODELS[name]
    params = computed[name][0]
    owned = [k for keys in module.stage_owners(_marked(name)) for k in keys]
    assert sorted(set(owned)) == sorted(params) and len(set(owned)) == len(params)
    assert f"{sum(x.size for x in jax.tree.leaves(params)):,} params" in module.describe(cfg)


@pytest.mark.parametrize("name", list(MODELS))
def test_cut_at_markers_branch_stages_fan_into_the_head_and_read_only_their_params(computed, name):
    module, _, _, segments = MODELS[name]
    cfg = _marked(name)
    params, batch, _, _ = computed[name]
    graph = zbjax.partition(module.make_loss_fn(cfg), params, batch)
    owners = module.stage_owners(cfg)
    assert graph.num_stages == module.num_marker_stages(cfg) == len(owners)
    assert graph.num_stages == sum(segments) + int(cfg.head_stage)
    # Each stage reads only the param leaves of its branch (or of the head).
    paths = [path[0].key for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    for stage, keys in zip(graph.stages, owners, strict=True):
        read = {paths[leaf] for leaf in stage.param_leaves}
        assert read and read <= set(keys), (stage.name, read, keys)
    assert set(graph.edge_pairs) == _expected_edges(segments, cfg.head_stage)
    for s in np.cumsum([0, *segments[:-1]]):  # branches start from batch inputs: parallel
        assert graph.stages[s].in_edges == ()


def test_four_branches_of_two_stages_fill_eight_stages_with_the_head_in_the_last():
    cfg, expected = STAGE_COUNTS["multimodal 4x2 cut, head in last branch"]
    params = jax.eval_shape(lambda key: multimodal.init_params(key, cfg), jax.random.key(0))
    batch = jax.eval_shape(lambda key: multimodal.make_batch(key, cfg, 2), jax.random.key(1))
    graph = zbjax.partition(multimodal.make_loss_fn(cfg), params, batch)
    assert graph.num_stages == expected == 8
    assert set(graph.edge_pairs) == {(0, 1), (2, 3), (4, 5), (6, 7), (1, 7), (3, 7), (5, 7)}


def test_two_tower_pipelined_over_its_stage_dag_gives_the_unpipelined_loss_and_grads(computed):
    module, _, _, _ = MODELS["two_tower"]
    cfg = _marked("two_tower")
    params, batch, (loss, grads), _ = computed["two_tower"]
    num_stages, num_microbatches = module.num_marker_stages(cfg), 2
    microbatch = jax.tree.map(lambda x: x[: BATCH_SIZE // num_microbatches], batch)
    graph = zbjax.partition(module.make_loss_fn(cfg), params, microbatch)
    schedule = zbjax.schedules.build(
        "dag-zb",
        num_stages,
        num_microbatches,
        edges=list(graph.edge_pairs),
        placement=tuple(range(num_stages)),
    )
    mesh = jax.make_mesh(
        (num_stages,),
        ("pp",),
        axis_types=(jax.sharding.AxisType.Auto,),
        devices=jax.devices()[:num_stages],
    )
    pipe = zbjax.pipeline(
        module.make_loss_fn(cfg), mesh=mesh, schedule=schedule, num_microbatches=num_microbatches
    )
    pipelined_loss, pipelined_grads = pipe.value_and_grad(params, batch)
    np.testing.assert_allclose(float(pipelined_loss), float(loss), rtol=1e-5)
    for g, h in zip(jax.tree.leaves(grads), jax.tree.leaves(pipelined_grads), strict=True):
        np.testing.assert_allclose(np.asarray(h), np.asarray(g), rtol=1e-4, atol=1e-6)


# ----------------------------------------------------------------------------- per model


def test_dlrm_interaction_is_every_pairwise_dot_product_once():
    z = jax.random.normal(jax.random.key(0), (2, 4, 3))
    dots = np.asarray(dlrm.pairwise_dots(z))
    expected = [[float(z[b, i] @ z[b, j]) for i in range(4) for j in range(i)] for b in range(2)]
    np.testing.assert_allclose(dots, expected, rtol=1e-5)


def test_dlrm_bags_are_int32_ids_and_their_embeddings_are_summed(computed):
    params, batch, _, _ = computed["dlrm"]
    cfg = MODELS["dlrm"][1]
    assert batch["sparse_0"].dtype == jnp.int32 and batch["sparse_0"].shape == (BATCH_SIZE, 3)
    assert set(np.unique(np.asarray(batch["y"]))) <= {0.0, 1.0}
    # A bag [a, b, c] gives the same loss as [c, a, b]: sum pooling ignores order.
    loss_fn = dlrm.make_loss_fn(cfg)
    shuffled = dict(batch, sparse_1=jnp.roll(batch["sparse_1"], 1, axis=1))
    np.testing.assert_allclose(loss_fn(params, batch), loss_fn(params, shuffled), rtol=1e-6)


def test_unequal_two_tower_depths_show_in_the_params():
    cfg = two_tower.TwoTowerConfig()
    params = jax.eval_shape(lambda key: two_tower.init_params(key, cfg), jax.random.key(0))
    assert sorted(params["tower_0"]) == ["dense_0", "out"]
    assert sorted(params["tower_1"]) == ["dense_0", "dense_1", "dense_2", "out"]
    assert sorted(params) == ["bias", "scale", "tower_0", "tower_1"]


def test_bad_branch_options_raise_errors_that_name_the_fix():
    with pytest.raises(ValueError, match="branch_boundaries=True"):
        multimodal.MultiModalConfig(layers_per_stage=1)
    with pytest.raises(ValueError, match="positive int"):
        dlrm.DLRMConfig(branch_boundaries=True, layers_per_stage=0)
    with pytest.raises(ValueError, match="head_stage=False needs branch 0"):
        candle_uno.CandleUnoConfig(branch_boundaries=True, head_stage=False)
    with pytest.raises(ValueError, match="one input width per branch"):
        multimodal.MultiModalConfig(num_branches=3, in_dims=(4, 4))
    with pytest.raises(ValueError, match="num_table_groups"):
        dlrm.DLRMConfig(num_table_groups=4)


@pytest.mark.parametrize("name", ["multimodal", "dlrm"])
def test_twenty_adam_steps_reduce_the_loss(computed, name):
    module, cfg, _, _ = MODELS[name]
    params, batch, _, _ = computed[name]
    loss_fn = module.make_loss_fn(cfg)
    optimizer = optax.adam(1e-2)

    @jax.jit
    def train(params, batch):
        def step(carry, _):
            params, state = carry
            loss, grads = jax.value_and_grad(loss_fn)(params, batch)
            updates, state = optimizer.update(grads, state, params)
            return (optax.apply_updates(params, updates), state), loss

        carry = (params, optimizer.init(params))
        (params, _), losses = jax.lax.scan(step, carry, None, length=20)
        return losses, loss_fn(params, batch)

    losses, final = train(params, batch)
    assert np.isfinite(np.asarray(losses)).all()
    assert float(final) < 0.8 * float(losses[0]), (float(losses[0]), float(final))
