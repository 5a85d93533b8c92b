"""Tensor parallelism inside pipeline stages (``zbjax.pipeline(param_specs=...)``).

On a pp x dp x tp mesh of the 8 fake CPU devices (all axes Auto), each param leaf is stored
split over ``tp`` as its spec says and XLA partitions each stage's equations over it. Results
equal ``jax.value_and_grad`` of the unpipelined function for every schedule.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import zbjax
from models import gpt, gpt_scan
from zbjax.errors import PipelineError
from zbjax.params import stage_leaves, staged_layout, unstage_gradients, unstage_leaves

D, H, LAYERS = 16, 64, 4
AUTO = (AxisType.Auto,) * 3


def _mesh(pp=2, dp=2, tp=2, types=AUTO):
    return jax.make_mesh((pp, dp, tp), ("pp", "dp", "tp"), axis_types=types)


def _mlp():
    rng = np.random.default_rng(0)

    def normal(*shape, scale):
        return jnp.asarray(rng.normal(size=shape) * scale, jnp.float32)

    params = {
        "layers": [
            {
                "w1": normal(D, H, scale=0.2),
                "b1": normal(H, scale=0.1),
                "w2": normal(H, D, scale=0.2),
                "b2": normal(D, scale=0.1),
            }
            for _ in range(LAYERS)
        ],
        "head": normal(D, 3, scale=0.2),
    }
    layer = {"w1": P(None, "tp"), "b1": P("tp"), "w2": P("tp", None), "b2": None}
    specs = {"layers": [layer] * LAYERS, "head": None}
    batch = {"x": normal(32, D, scale=1.0), "y": normal(32, 3, scale=1.0)}
    return params, specs, batch


def _mlp_loss(stages):
    def loss_fn(params, batch):
        x = batch["x"]
        for i, layer in enumerate(params["layers"]):
            if i and i % (LAYERS // stages) == 0:
                x = zbjax.stage_boundary(x)
            x = x + jnp.tanh(x @ layer["w1"] + layer["b1"]) @ layer["w2"] + layer["b2"]
        return jnp.mean((x @ params["head"] - batch["y"]) ** 2)

    return loss_fn


def _max_diff(a, b):
    return max(
        float(jnp.max(jnp.abs(x - y)))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


@pytest.mark.parametrize(
    "schedule", ["gpipe", "1f1b", "zb-h1", "zb-h2", "zb-v", "interleaved-1f1b", "zb-auto"]
)
def test_every_schedule_matches_value_and_grad(schedule):
    params, specs, batch = _mlp()
    stages = 4 if schedule in ("zb-v", "interleaved-1f1b") else 2
    loss_fn = _mlp_loss(stages)
    pipe = zbjax.pipeline(
        loss_fn, mesh=_mesh(), schedule=schedule, num_microbatches=4, param_specs=specs
    )
    loss, grads = jax.jit(pipe.value_and_grad)(params, batch)
    want_loss, want_grads = jax.value_and_grad(loss_fn)(params, batch)
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-6)
    assert _max_diff(grads, want_grads) < 1e-5


def test_staged_params_are_split_over_the_tensor_axis():
    params, specs, batch = _mlp()
    loss_fn = _mlp_loss(2)
    split = zbjax.pipeline(
        loss_fn, mesh=_mesh(), schedule="1f1b", num_microbatches=4, param_specs=specs
    )
    plain = zbjax.pipeline(loss_fn, mesh=_mesh(), schedule="1f1b", num_microbatches=4)
    staged = split.stage(params, batch)
    assert [r.sharding.spec for r in staged.rows] == [P("pp", "tp")]
    # Per device: half of each split leaf (w1, b1, w2) and all of each replicated one.
    layers = LAYERS // 2
    want = layers * (D * H // 2 + H // 2 + H * D // 2 + D) + D * 3
    assert split.lowering.layout.row_size == (want,)
    assert [s.data.shape for s in staged.rows[0].addressable_shards] == [(1, want)] * 8
    plain.stage(params, batch)
    assert plain.lowering.layout.row_size == (layers * (2 * D * H + H + D) + D * 3,)
    # The compiled step's arguments on each device: its blocks of the rows, and its batch.
    compiled = jax.jit(split.value_and_grad).lower(staged, batch).compile()
    batch_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(batch))
    assert compiled.memory_analysis().argument_size_in_bytes == want * 4 + batch_bytes
    # The round trip and the norm count each element once (replicated leaves are in each block).
    assert _max_diff(split.unstage(staged), params) == 0.0
    loss, grads = jax.jit(split.value_and_grad)(staged, batch)
    _, want_grads = jax.value_and_grad(loss_fn)(params, batch)
    assert _max_diff(split.unstage(grads), want_grads) < 1e-5
    np.testing.assert_allclose(
        float(split.global_norm(grads)), float(optax.tree.norm(want_grads)), rtol=1e-5
    )


def test_optax_steps_on_split_staged_params():
    params, specs, batch = _mlp()
    loss_fn = _mlp_loss(2)
    pipe = zbjax.pipeline(
        loss_fn, mesh=_mesh(), schedule="zb-h1", num_microbatches=4, param_specs=specs
    )
    tx = optax.chain(pipe.clip_by_global_norm(0.5), optax.adamw(1e-2))
    ref_tx = optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(1e-2))
    staged = pipe.stage(params, batch)
    state, ref_state, ref = tx.init(staged), ref_tx.init(params), params

    @jax.jit
    def step(staged, state, grads):
        updates, state = tx.update(grads, state, staged)
        return optax.apply_updates(staged, updates), state

    for _ in range(2):
        _, ref_grads = jax.value_and_grad(loss_fn)(ref, batch)
        # Identical gradients on both sides (Adam turns rounding differences into updates).
        staged, state = step(staged, state, pipe.stage(ref_grads))
        updates, ref_state = ref_tx.update(ref_grads, ref_state, ref)
        ref = optax.apply_updates(ref, updates)
    assert _max_diff(pipe.unstage(staged), ref) < 1e-6


@pytest.mark.parametrize("flavour", ["loop-1f1b", "scan-zb-v"])
def test_gpt_megatron_split_with_tied_embedding(flavour):
    """The reference GPT split Megatron-style (``gpt.tensor_parallel_specs``): its token
    embedding, split over the vocabulary, is also the LM head on the last stage's device."""
    if flavour == "loop-1f1b":
        cfg = gpt.GPTConfig(num_layers=4, stage_boundaries=(1,))
        module, schedule, kwargs = gpt, "1f1b", {}
    else:
        cfg = gpt.GPTConfig(num_layers=4)
        module, schedule, kwargs = gpt_scan, "zb-v", {"num_stages": 4}
    params = module.init_params(jax.random.key(0), cfg)
    loss_fn = module.make_loss_fn(cfg)
    batch = gpt.make_batch(jax.random.key(1), cfg, 16)
    pipe = zbjax.pipeline(
        loss_fn,
        mesh=_mesh(),
        schedule=schedule,
        num_microbatches=4,
        param_specs=gpt.tensor_parallel_specs(params),
        **kwargs,
    )
    staged = pipe.stage(params, batch)
    loss, grads = jax.jit(pipe.value_and_grad)(staged, batch)
    want_loss, want_grads = jax.value_and_grad(loss_fn)(params, batch)
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-6)
    assert _max_diff(pipe.unstage(grads), want_grads) < 1e-6
    np.testing.assert_allclose(
        float(pipe.global_norm(grads)), float(optax.tree.norm(want_grads)), rtol=1e-5
    )


def test_layout_round_trip_with_tied_row_ranges_and_splits():
    """stage, unstage and the gradient sum over copies, for leaves split along dimension 0
    and 1, replicated, tied over devices and stored in row ranges, with T = 2 blocks."""
    rng = np.random.default_rng(1)
    avals = [
        jax.ShapeDtypeStruct((4, 6), jnp.float32),  # split along 1, row ranges over devices
        jax.ShapeDtypeStruct((8, 3), jnp.float32),  # split along 0, tied over devices
        jax.ShapeDtypeStruct((5,), jnp.float32),  # replicated, tied
        jax.ShapeDtypeStruct((2, 2), jnp.int32),  # replicated, unread
    ]
    leaves = [jnp.asarray(rng.normal(size=a.shape), a.dtype) for a in avals]
    layout = staged_layout(
        avals,
        [[0, 1, 2], [0, 1, 2]],
        [0, 1],
        2,
        [[(0, 2), None, None], [(2, 4), None, None]],
        ("tp", 2, (1, 0, None, None)),
    )
    assert layout.stage_slots[0][0].shape == (2, 3)
    assert layout.stage_slots[0][1].shape == (4, 3)
    staged = stage_leaves(layout, leaves)
    assert [r.shape for r in staged.rows] == [
        (2, 2 * layout.row_size[k]) for k in range(len(layout.dtypes))
    ]
    assert _max_diff(unstage_leaves(layout, staged), leaves) == 0.0
    # As gradients, each tied copy holds a contribution: the leaf's gradient is their sum.
    grads = unstage_gradients(layout, staged)
    np.testing.assert_array_equal(grads[0], leaves[0])
    np.testing.assert_array_equal(grads[1], 2 * leaves[1])
    np.testing.assert_array_equal(grads[2], 2 * leaves[2])


def test_errors_name_the_problem():
    params, specs, batch = _mlp()
    loss_fn = _mlp_loss(2)

    def build(specs, mesh=None):
        return zbjax.pipeline(loss_fn, mesh=mesh or _mesh(), schedule="1f1b", param_specs=specs)

    explicit = _mesh(types=(AxisType.Explicit,) * 3)
    with pytest.raises(PipelineError, match="Explicit mesh axis.*AxisType.Auto"):
        build(specs, explicit)
    with pytest.raises(PipelineError, match="pipeline axis 'pp'"):
        build({"layers": [{"w1": P(None, "pp")}] * LAYERS, "head": None})
    with pytest.raises(PipelineError, match=r"name mesh axes \['dp', 'tp'\]"):
        build({"layers": [{"w1": P("dp", "tp")}] * LAYERS, "head": None})
    with pytest.raises(PipelineError, match="does not have"):
        build({"layers": P("model"), "head": None})
    with pytest.raises(PipelineError, match="not a jax.sharding.PartitionSpec"):
        build({"layers": "tp", "head": None})
    odd = dict(params, head=jnp.zeros((D, 3)))
    with pytest.raises(PipelineError, match=r"\['head'\] has 3 entries along dimension 1"):
        build(dict(specs, head=P(None, "tp"))).value_and_grad(odd, batch)
    with pytest.raises(PipelineError, match="do not match the params' structure"):
        build({"layers": [None] * 3, "head": None}).value_and_grad(params, batch)
    with pytest.raises(PipelineError, match="more entries than the param has dimensions"):
        build(dict(specs, head=P(None, None, "tp"))).value_and_grad(params, batch)
    with pytest.raises(PipelineError, match="per_leaf does not yet handle"):
        build(specs).per_leaf(optax.adamw(1e-3))


def test_scan_layers_split_along_their_stacked_axis_are_refused():
    cfg = gpt.GPTConfig(num_layers=4)
    params = gpt_scan.init_params(jax.random.key(0), cfg)
    specs = jax.tree.map(lambda _: None, params)
    specs["blocks"]["block"]["mlp_fc"]["kernel"] = P("tp")
    pipe = zbjax.pipeline(
        gpt_scan.make_loss_fn(cfg), mesh=_mesh(), schedule="1f1b", param_specs=specs
    )
    with pytest.raises(PipelineError, match="stacked layer parameter.*split it along another"):
        pipe.value_and_grad(params, gpt.make_batch(jax.random.key(1), cfg, 16))
