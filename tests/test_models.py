"""Contract tests of the reference models: loss, grads, markers, tied head, scan, NNX, training."""

from __future__ import annotations

import dataclasses
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from models import gpt, gpt_nnx, gpt_scan, mlp
from zbjax.errors import PartitionError

GPT_MODULES = {"gpt": gpt, "gpt_nnx": gpt_nnx, "gpt_scan": gpt_scan}
CFG = gpt.GPTConfig()
BATCH_SIZE = 8


def _marker_count(jaxpr) -> int:
    return str(jaxpr).count("stage_boundary")


@pytest.fixture(scope="module")
def compiled():
    """Per GPT flavour: (params, batch, jitted value_and_grad, its (loss, grads) on the batch)."""
    batch = gpt.make_batch(jax.random.key(1), CFG, BATCH_SIZE)
    out = {}
    for name, module in GPT_MODULES.items():
        params = module.init_params(jax.random.key(0), CFG)
        value_and_grad = jax.jit(jax.value_and_grad(module.make_loss_fn(CFG)))
        out[name] = (params, batch, value_and_grad, value_and_grad(params, batch))
    return out


# ----------------------------------------------------------------------------- every model


@pytest.mark.parametrize("name", list(GPT_MODULES))
def test_gpt_loss_at_init_is_finite_and_near_log_vocab(compiled, name):
    _, _, _, (loss, _) = compiled[name]
    assert loss.dtype == jnp.float32 and loss.shape == ()
    assert abs(float(loss) - math.log(CFG.vocab_size)) < 0.1


@pytest.mark.parametrize("name", list(GPT_MODULES))
def test_grads_are_finite_float32_and_shaped_like_params(compiled, name):
    params, _, _, (_, grads) = compiled[name]
    assert jax.tree.structure(grads) == jax.tree.structure(params)
    for p, g in zip(jax.tree.leaves(params), jax.tree.leaves(grads), strict=True):
        assert p.dtype == g.dtype == jnp.float32 and p.shape == g.shape
        assert np.isfinite(np.asarray(g)).all()
    assert max(np.abs(np.asarray(g)).max() for g in jax.tree.leaves(grads)) > 0.0


def _only_dicts(tree) -> bool:
    if isinstance(tree, dict):
        return all(_only_dicts(v) for v in tree.values())
    return isinstance(tree, jax.Array)


@pytest.mark.parametrize("name", list(GPT_MODULES))
def test_params_are_a_plain_dict_pytree_of_float32_arrays(compiled, name):
    params = compiled[name][0]
    assert _only_dicts(params)
    assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(params))


@pytest.mark.parametrize("name", list(GPT_MODULES))
def test_describe_states_the_parameter_count(compiled, name):
    count = sum(leaf.size for leaf in jax.tree.leaves(compiled[name][0]))
    text = GPT_MODULES[name].describe(CFG)
    assert f"{count:,} params" in text and "tied" in text


def test_gpt_batch_targets_are_tokens_shifted_and_follow_a_fixed_successor_table():
    cfg = dataclasses.replace(CFG, data_noise=0.0)
    batch = gpt.make_batch(jax.random.key(3), cfg, 32)
    tokens, targets = np.asarray(batch["tokens"]), np.asarray(batch["targets"])
    assert tokens.dtype == targets.dtype == np.int32
    assert tokens.shape == targets.shape == (32, cfg.seq_len)
    np.testing.assert_array_equal(tokens[:, 1:], targets[:, :-1])
    successor = {}
    for t, s in zip(tokens.ravel(), targets.ravel(), strict=True):
        assert successor.setdefault(t, s) == s
    other = gpt.make_batch(jax.random.key(4), cfg, 32)
    for t, s in zip(np.ravel(other["tokens"]), np.ravel(other["targets"]), strict=True):
        assert successor.get(t, s) == s  # a new batch follows the same table


# ----------------------------------------------------------------------------- markers


@pytest.mark.parametrize("name", ["gpt", "gpt_nnx"])
def test_gpt_markers_appear_in_jaxpr_and_do_not_change_the_loss(compiled, name):
    module = GPT_MODULES[name]
    params, batch, _, (loss, _) = compiled[name]
    cfg = dataclasses.replace(CFG, stage_boundaries=module.balanced_boundaries(CFG, 4))
    loss_fn = module.make_loss_fn(cfg)
    assert _marker_count(jax.make_jaxpr(loss_fn)(params, batch)) == 3
    assert _marker_count(jax.make_jaxpr(module.make_loss_fn(CFG))(params, batch)) == 0
    marked_loss, marked_grads = jax.jit(jax.value_and_grad(loss_fn))(params, batch)
    assert float(marked_loss) == float(loss)
    grads = compiled[name][3][1]
    for g, mg in zip(jax.tree.leaves(grads), jax.tree.leaves(marked_grads), strict=True):
        np.testing.assert_allclose(mg, g, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("task", mlp.TASKS)
def test_mlp_markers_appear_in_jaxpr_and_do_not_change_the_loss(task):
    cfg = mlp.MLPConfig(task=task, depth=4)
    marked_cfg = dataclasses.replace(cfg, stage_boundaries=mlp.balanced_boundaries(cfg, 3))
    params = mlp.init_params(jax.random.key(0), cfg)
    batch = mlp.make_batch(jax.random.key(1), cfg, BATCH_SIZE)
    loss, grads = jax.jit(jax.value_and_grad(mlp.make_loss_fn(cfg)))(params, batch)
    marked_fn = mlp.make_loss_fn(marked_cfg)
    marked_loss, marked_grads = jax.jit(jax.value_and_grad(marked_fn))(params, batch)
    assert _marker_count(jax.make_jaxpr(marked_fn)(params, batch)) == 2
    assert float(marked_loss) == float(loss) and np.isfinite(float(loss))
    for g, mg in zip(jax.tree.leaves(grads), jax.tree.leaves(marked_grads), strict=True):
        np.testing.assert_array_equal(mg, g)
    if task == "classification":
        assert batch["y"].dtype == jnp.int32
        assert abs(float(loss) - math.log(cfg.out_dim)) < 0.5
    assert f"{sum(x.size for x in jax.tree.leaves(params)):,} params" in mlp.describe(cfg)


def test_balanced_cuts_minimise_the_costliest_stage_like_brute_force():
    rng = np.random.default_rng(0)
    for _ in range(30):
        costs = list(rng.integers(1, 10, size=int(rng.integers(2, 8))))
        for stages in range(1, len(costs) + 1):
            cuts = mlp.balanced_cuts(costs, stages)
            assert len(cuts) == stages - 1

            def worst(cut_set, costs=costs):
                edges = [0, *(c + 1 for c in cut_set), len(costs)]
                return max(sum(costs[a:b]) for a, b in itertools.pairwise(edges))

            best = min(worst(c) for c in itertools.combinations(range(len(costs) - 1), stages - 1))
            assert worst(cuts) == best


def test_gpt_balanced_boundaries_put_one_block_per_stage_when_stages_equal_blocks():
    assert gpt.balanced_boundaries(CFG, 1) == ()
    assert gpt.balanced_boundaries(CFG, 4) == (0, 1, 2)
    assert gpt.balanced_boundaries(CFG, 5) == (0, 1, 2, 3)  # the head gets a stage of its own


def test_bad_stage_boundaries_and_stage_counts_raise_partition_errors():
    with pytest.raises(PartitionError, match=r"stage_boundaries=\(2, 1\)"):
        gpt.GPTConfig(stage_boundaries=(2, 1))
    with pytest.raises(PartitionError, match="stage_boundaries=\\(4,\\)"):
        gpt.GPTConfig(num_layers=4, stage_boundaries=(4,))
    with pytest.raises(PartitionError, match="num_stages=6"):
        gpt.balanced_boundaries(CFG, 6)
    with pytest.raises(PartitionError, match="nn.scan"):
        gpt_scan.make_loss_fn(dataclasses.replace(CFG, stage_boundaries=(1,)))


# ----------------------------------------------------------------------------- tied head


@pytest.mark.parametrize("name", list(GPT_MODULES))
def test_tied_head_has_no_weight_of_its_own_and_gets_gradient_for_unseen_tokens(compiled, name):
    params, batch, value_and_grad, _ = compiled[name]
    vocab_leaves = [
        path
        for path, leaf in jax.tree_util.tree_leaves_with_path(params)
        if CFG.vocab_size in leaf.shape
    ]
    assert [jax.tree_util.keystr(p) for p in vocab_leaves] == ["['embed']['token']['embedding']"]
    # Only the first half of the vocabulary appears as input, so rows of the second half can
    # receive gradient only through the head's use of the embedding.
    half = {"tokens": batch["tokens"] % (CFG.vocab_size // 2), "targets": batch["targets"]}
    _, grads = value_and_grad(params, half)
    unseen_rows = grads["embed"]["token"]["embedding"][CFG.vocab_size // 2 :]
    assert float(jnp.abs(unseen_rows).max()) > 0.0


def test_tied_embedding_is_read_by_two_equations_of_the_gpt_jaxpr(compiled):
    params, batch, _, _ = compiled["gpt"]
    closed = jax.make_jaxpr(gpt.make_loss_fn(CFG))(params, batch)
    leaves = jax.tree_util.tree_leaves_with_path(params)
    index = next(
        i
        for i, (path, _) in enumerate(leaves)
        if jax.tree_util.keystr(path).endswith("['embedding']")
    )
    embedding = closed.jaxpr.invars[index]
    readers = [e for e in closed.jaxpr.eqns if any(v is embedding for v in e.invars)]
    assert len(readers) == 2


# ----------------------------------------------------------------------------- scan and NNX


def _linen_blocks(params):
    return [params[f"block_{i}"] for i in range(CFG.num_layers)]


def test_gpt_scan_jaxpr_has_one_scan_over_num_layers_with_stacked_params(compiled):
    params, batch, _, _ = compiled["gpt_scan"]
    closed = jax.make_jaxpr(gpt_scan.make_loss_fn(CFG))(params, batch)
    scans = [e for e in closed.jaxpr.eqns if e.primitive.name == "scan"]
    assert [e.params["length"] for e in scans] == [CFG.num_layers]
    for leaf in jax.tree.leaves(params["blocks"]):
        assert leaf.shape[0] == CFG.num_layers


def test_gpt_scan_and_gpt_nnx_compute_the_linen_gpt_loss_with_the_same_weights(compiled):
    linen_params, batch, _, (linen_loss, _) = compiled["gpt"]
    blocks = _linen_blocks(linen_params)
    shared = {"embed": linen_params["embed"], "ln_f": linen_params["ln_f"]}
    scan_params = {**shared, "blocks": {"block": jax.tree.map(lambda *x: jnp.stack(x), *blocks)}}
    nnx_params = {**shared, "blocks": dict(enumerate(blocks))}
    scan_loss = compiled["gpt_scan"][2](scan_params, batch)[0]
    nnx_loss = compiled["gpt_nnx"][2](nnx_params, batch)[0]
    np.testing.assert_allclose(scan_loss, linen_loss, rtol=1e-5)
    np.testing.assert_allclose(nnx_loss, linen_loss, rtol=1e-5)


def test_gpt_nnx_params_round_trip_through_the_nnx_module(compiled):
    params = compiled["gpt_nnx"][0]
    model = gpt_nnx.merge_params(CFG, params)
    assert isinstance(model, gpt_nnx.GPT)
    np.testing.assert_array_equal(model.ln_f.scale[...], params["ln_f"]["scale"])
    _, again = gpt_nnx.split_model(model)
    assert jax.tree.structure(again) == jax.tree.structure(params)
    for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(a, b)


# ----------------------------------------------------------------------------- dropout


@pytest.mark.parametrize("name", list(GPT_MODULES))
def test_dropout_is_deterministic_per_key_and_differs_between_keys(compiled, name):
    module = GPT_MODULES[name]
    params, batch, _, (loss, _) = compiled[name]
    loss_fn = jax.jit(module.make_loss_fn(dataclasses.replace(CFG, dropout_rate=0.3)))
    a, b = loss_fn(params, batch, jax.random.key(7)), loss_fn(params, batch, jax.random.key(7))
    c = loss_fn(params, batch, jax.random.key(8))
    assert float(a) == float(b)
    assert float(a) != float(c) and float(a) != float(loss)
    with pytest.raises(ValueError, match="needs a PRNG key"):
        module.make_loss_fn(dataclasses.replace(CFG, dropout_rate=0.3))(params, batch)


# ----------------------------------------------------------------------------- training


def test_twenty_adamw_steps_reduce_the_gpt_loss(compiled):
    params, _, _, _ = compiled["gpt"]
    loss_fn = gpt.make_loss_fn(CFG)
    optimizer = optax.adamw(1e-2)

    @jax.jit
    def step(params, opt_state, key):
        loss, grads = jax.value_and_grad(loss_fn)(params, gpt.make_batch(key, CFG, 16))
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    opt_state = optimizer.init(params)
    losses = []
    for key in jax.random.split(jax.random.key(5), 20):
        params, opt_state, loss = step(params, opt_state, key)
        losses.append(float(loss))
    assert np.mean(losses[-5:]) < losses[0] - 1.0, losses
