"""Tensor parallelism inside pipeline stages (``zbjax.pipeline(param_specs=...)``).

On a pp x dp x tp mesh of the 8 fake CPU devices (all axes Auto), each param leaf is stored
split over ``tp`` as its spec says and XLA partitions each stage's equations over it. Results
equal ``jax.value_and_grad`` of the unpipelined function for every schedule.
"""

import dataclasses
import functools
import re
import warnings
from types import SimpleNamespace

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
from zbjax.microbatch import reference_value_and_grad
from zbjax.params import stage_leaves, staged_layout, unstage_gradients, unstage_leaves
from zbjax.tensor import value_splits

D, H, LAYERS = 16, 64, 4
AUTO = (AxisType.Auto,) * 3


def _mesh(pp=2, dp=2, tp=2, types=AUTO):
    devices = jax.devices()[: pp * dp * tp]
    return jax.make_mesh((pp, dp, tp), ("pp", "dp", "tp"), axis_types=types, devices=devices)


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
    if schedule in ("1f1b", "zb-v"):
        # pipe.value, the forwards alone, over the same pipeline x data x tensor mesh.
        value = jax.jit(pipe.value)(params, batch)
        np.testing.assert_allclose(float(value), float(want_loss), rtol=1e-6)


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


def _tp_gpt(cfg, flavour, schedule, microbatches, batch_size):
    """Returns (pipe, loss_fn, params, batch) of the reference GPT (``"loop"``: markers after
    block 1; ``"scan"``: ``gpt_scan`` cut into 4 stages) split by its tensor_parallel_specs."""
    if flavour == "loop":
        module, cfg, kwargs = gpt, dataclasses.replace(cfg, stage_boundaries=(1,)), {}
    else:
        module, kwargs = gpt_scan, {"num_stages": 4}
    params = module.init_params(jax.random.key(0), cfg)
    loss_fn = module.make_loss_fn(cfg)
    batch = gpt.make_batch(jax.random.key(1), cfg, batch_size)
    pipe = zbjax.pipeline(
        loss_fn,
        mesh=_mesh(),
        schedule=schedule,
        num_microbatches=microbatches,
        param_specs=gpt.tensor_parallel_specs(params),
        **kwargs,
    )
    return pipe, loss_fn, params, batch


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
    with pytest.raises(PipelineError, match="PartitionSpec.UNCONSTRAINED.*or None"):
        build({"layers": P(P.UNCONSTRAINED, "tp"), "head": None})  # a bare TypeError before
    odd = dict(params, head=jnp.zeros((D, 3)))
    with pytest.raises(PipelineError, match=r"\['head'\] has 3 entries along dimension 1"):
        build(dict(specs, head=P(None, "tp"))).value_and_grad(odd, batch)
    with pytest.raises(PipelineError, match="do not match the params' structure"):
        build({"layers": [None] * 3, "head": None}).value_and_grad(params, batch)
    with pytest.raises(PipelineError, match="more entries than the param has dimensions"):
        build(dict(specs, head=P(None, None, "tp"))).value_and_grad(params, batch)


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


def _permuting_stage(kind):
    """A two-stage model whose first stage XLA partitions over tp with a collective-permute:
    a fused gate/up kernel split by columns then jnp.split, jnp.roll along a split hidden
    dimension, or a scan over layers split along the layer axis, inside the stage."""
    rng = np.random.default_rng(0)

    def normal(*shape):
        return jnp.asarray(rng.normal(size=shape) * 0.2, jnp.float32)

    if kind == "scan":
        params, specs = {"w1": normal(4, D, D), "w3": normal(D, D)}, {"w1": P("tp"), "w3": None}
    else:
        params = {"w13": normal(D, 2 * H), "w2": normal(H, D), "w3": normal(D, D)}
        specs = {"w13": P(None, "tp"), "w2": P("tp", None), "w3": None}

    def block(p, x):
        if kind == "scan":
            return jax.lax.scan(lambda x, w: (x + jnp.tanh(x @ w), None), x, p["w1"])[0]
        if kind == "fused":
            a, g = jnp.split(x @ p["w13"], 2, axis=-1)
            return x + (jax.nn.silu(a) * g) @ p["w2"]
        return x + jnp.roll(jnp.tanh(x @ p["w13"]), 1, axis=-1)[:, :H] @ p["w2"]

    def loss_fn(p, b):
        x = zbjax.stage_boundary(block(p, b["x"]))
        return jnp.mean((x @ p["w3"] - b["y"]) ** 2)

    batch = {"x": normal(16, D), "y": normal(16, D)}
    pipe = zbjax.pipeline(
        loss_fn, mesh=_mesh(), schedule="1f1b", num_microbatches=2, param_specs=specs
    )
    return pipe, params, batch


@pytest.mark.parametrize("kind, call", [("fused", "call"), ("roll", "jit"), ("scan", "lower")])
def test_stage_collective_permutes_are_refused_before_they_would_hang(kind, call):
    """A collective-permute among one stage's devices inside its conditional never completes
    on XLA:CPU (the rendezvous waits 40 s for all 8 devices, then aborts the process); the
    compiled step is read before it runs, called directly, inside a user's jit, or lowered."""
    pipe, params, batch = _permuting_stage(kind)
    run = {
        "call": pipe.value_and_grad,
        "jit": jax.jit(pipe.value_and_grad),
        "lower": pipe.lower,
    }[call]
    # Each op named with the line of the user's code that made it (here, in block).
    at = re.escape(f"at {__file__}:") + r"\d+ in _permuting_stage\.<locals>\.block"
    with pytest.raises(PipelineError, match=rf"would hang: .*tensor axis 'tp'.*\(F s0: [^;]*{at}"):
        run(params, batch)


def test_split_activations_stay_split_in_the_slot_pools():
    """The MLP's hidden activations come out of F split over tp (column-parallel w1); the slots
    keep each device's part, so nothing is gathered and the pools hold half of them."""
    params, specs, batch = _mlp()
    loss_fn = _mlp_loss(2)
    split = zbjax.pipeline(
        loss_fn, mesh=_mesh(), schedule="zb-h1", num_microbatches=4, param_specs=specs
    )
    # The same rows per device without tp: pp 2 x dp 2 on 4 of the devices.
    plain = zbjax.pipeline(loss_fn, mesh=_mesh(tp=1), schedule="zb-h1", num_microbatches=4)
    staged = split.stage(params, batch)
    plain.stage(params, batch)
    hlo = jax.jit(split.value_and_grad).lower(staged, batch).compile().as_text()
    assert "all-gather(" not in hlo and "all-to-all(" not in hlo
    assert "all-reduce(" in hlo  # the row-parallel w2's partial sums
    # Per device: the [rows, H] activations at half their size, the [rows, D] ones whole.
    assert split.lowering.slot_pool_bytes() < 0.7 * plain.lowering.slot_pool_bytes()
    pools = split.lowering.pool_avals()
    assert all(a.shape[3] == 2 for a in pools)  # [pp, dp, rows, T, elements]


def _splits_of(fn, *args, in_splits, size=2):
    closed = jax.make_jaxpr(fn)(*args)
    return value_splits(closed, in_splits, size)


def test_value_splits_follow_dimensions():
    x, w = jnp.zeros((4, 8)), jnp.zeros((8, 6))
    # Column-parallel: the free dimension of w stays split; row-parallel contraction: whole.
    assert _splits_of(lambda x, w: x @ w, x, w, in_splits=[None, 1]) == [1]
    assert _splits_of(lambda x, w: x @ w, x, w, in_splits=[1, 0]) == [None]
    # Element-wise with a whole operand stays split; reductions over other dimensions keep it.
    assert _splits_of(lambda a, b: jnp.tanh(a) * b, w, w, in_splits=[1, None]) == [1]
    # An operand broadcast along a size-1 dimension passes on a split along its other one.
    row = jnp.zeros((1, 6))
    assert _splits_of(lambda a, b: jax.lax.add(a, b), w, row, in_splits=[None, 1]) == [1]
    assert _splits_of(lambda a, b: jax.lax.add(a, b), w, row, in_splits=[0, 1]) == [None]
    assert _splits_of(lambda a: a.sum(0), w, in_splits=[1]) == [0]
    assert _splits_of(lambda a: a.sum(1), w, in_splits=[1]) == [None]
    assert _splits_of(lambda a: a.T, w, in_splits=[1]) == [0]
    # A reshape keeps the split where it leads a dimension; 3 rows do not split over 2.
    assert _splits_of(lambda a: a.reshape(2, 4, 6), w, in_splits=[0]) == [0]
    assert _splits_of(lambda a: a.reshape(48), w, in_splits=[0]) == [0]
    assert _splits_of(lambda a: a.reshape(8, 2, 3), w, in_splits=[1]) == [1]
    assert _splits_of(lambda a: a.reshape(8, 3, 2), w, in_splits=[1]) == [None]
    assert _splits_of(lambda a: a[None] + 1.0, w, in_splits=[1]) == [2]
    # Size-1 dimensions around the split one (a bias broadcast to [1, 1, n]) come and go.
    b = jnp.zeros(8)
    assert _splits_of(lambda a: a.reshape(1, 1, 8), b, in_splits=[0]) == [2]
    assert _splits_of(lambda a: a.reshape(1, 1, 8).reshape(8), b, in_splits=[0]) == [0]
    # Splits, slices, pads and concatenations along another dimension keep the split.
    q = jnp.zeros((4, 3, 6))
    assert _splits_of(lambda a: jnp.split(a, 3, axis=1), q, in_splits=[0]) == [0, 0, 0]
    assert _splits_of(lambda a: jnp.split(a, 2, axis=0), q, in_splits=[0]) == [None, None]
    assert _splits_of(lambda a: a[:, 1], q, in_splits=[0]) == [0]
    assert _splits_of(lambda a: a[:2], q, in_splits=[0]) == [None]
    assert _splits_of(lambda a: jnp.pad(a, ((0, 0), (1, 0), (0, 0))), q, in_splits=[0]) == [0]
    assert _splits_of(lambda a: jnp.pad(a, ((1, 1), (0, 0), (0, 0))), q, in_splits=[0]) == [None]
    cat = [lambda a, b: jnp.concatenate([a, b], 1), lambda a, b: jnp.concatenate([a, b], 0)]
    assert _splits_of(cat[0], q, q, in_splits=[0, 0]) == [0]
    assert _splits_of(cat[1], q, q, in_splits=[0, 0]) == [None]
    assert _splits_of(cat[0], q, q, in_splits=[0, None]) == [None]
    # Through a jitted function; an operation without a rule gives a whole value.
    assert _splits_of(jax.jit(lambda a: jnp.exp(a)), w, in_splits=[1]) == [1]
    assert _splits_of(lambda a: jnp.cumsum(a, 0), w, in_splits=[1]) == [None]


def test_value_splits_follow_scan_bodies():
    """Layers under ``lax.scan`` (``nn.scan``): stacked weights split along a layer's dimension
    give per-layer values split the same way and stacked outputs split one further along."""
    h, ws = jnp.zeros((4, 8)), jnp.zeros((3, 8, 8))

    def layers(h, ws):  # column-parallel: each layer's output keeps w's split free dimension
        return jax.lax.scan(lambda h, w: (h, jnp.tanh(h @ w)), h, ws)

    # The carry h never meets w, so it stays whole; the stacked outputs [3, 4, 8] are split.
    assert _splits_of(layers, h, ws, in_splits=[None, 2]) == [None, 2]

    def carried(h, ws):  # the carry becomes h @ w: split after one iteration, whole before
        return jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), h), h, ws)

    assert _splits_of(carried, h, ws, in_splits=[None, 2]) == [None, None]

    def scaled(h, ws):  # the carry keeps its split in every iteration
        return jax.lax.scan(lambda h, w: (h * jnp.tanh(w.sum(0)), h), h, ws)

    assert _splits_of(scaled, h, ws, in_splits=[1, 2]) == [1, 2]
    assert _splits_of(scaled, h, ws, in_splits=[0, None]) == [0, 1]
    # Split along the scanned dimension, each device would run other iterations: whole.
    assert _splits_of(layers, h, ws, in_splits=[None, 0]) == [None, None]
    # A constant of the body (a bias closed over, added as [1, 8]) keeps its split in every
    # iteration; h, which the body returns unchanged, is one too, and its rows stay split.
    b = jnp.zeros(8)

    def biased(h, ws, b):
        return jax.lax.scan(lambda h, w: (h, h @ w + b), h, ws)

    assert _splits_of(biased, h, ws, b, in_splits=[None, None, 0]) == [None, 2]
    assert _splits_of(biased, h, ws, b, in_splits=[0, None, None]) == [0, 1]


def test_tp_annotations_in_loss_fn_explicit_data_axes_and_aux():
    """A loss_fn that annotates its hidden activations over tp (as a tensor-parallel model
    does) runs without the dropped-annotation warning, on a mesh whose pp and dp axes are
    Explicit, with an aux output; loss, aux and grads match."""
    params, specs, batch = _mlp()
    mesh = _mesh(types=(AxisType.Explicit, AxisType.Explicit, AxisType.Auto))
    hidden = jax.sharding.NamedSharding(mesh, P(None, "tp"))

    def loss_fn(params, batch, annotate=True):
        x = batch["x"]
        for i, layer in enumerate(params["layers"]):
            if i == LAYERS // 2:
                x = zbjax.stage_boundary(x)
            h = jnp.tanh(x @ layer["w1"] + layer["b1"])
            if annotate:
                h = jax.lax.with_sharding_constraint(h, hidden)
            x = x + h @ layer["w2"] + layer["b2"]
        err = x @ params["head"] - batch["y"]
        return jnp.mean(err**2), {"mae": jnp.mean(jnp.abs(err))}

    pipe = zbjax.pipeline(
        loss_fn, mesh=mesh, schedule="zb-h2", num_microbatches=4, param_specs=specs, has_aux=True
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        (loss, aux), grads = jax.jit(pipe.value_and_grad)(params, batch)
    micro = [jax.tree.map(lambda a, i=i: a[i * 8 : (i + 1) * 8], batch) for i in range(4)]
    # The unpipelined reference, without the annotation (it changes no value).
    reference = jax.value_and_grad(lambda p, b: loss_fn(p, b, annotate=False), has_aux=True)
    outs = [reference(params, mb) for mb in micro]
    want_grads = jax.tree.map(lambda *g: sum(g) / 4, *[g for _, g in outs])
    np.testing.assert_allclose(float(loss), np.mean([float(v) for (v, _), _ in outs]), rtol=1e-6)
    np.testing.assert_allclose(
        float(aux["mae"]), np.mean([float(a["mae"]) for (_, a), _ in outs]), rtol=1e-5
    )
    assert _max_diff(grads, want_grads) < 1e-5


TP_CFG = gpt.GPTConfig(num_layers=4, d_model=16, seq_len=8, vocab_size=32)


def _decay_mask(params):
    return jax.tree.map(lambda x: x.ndim > 1, params)


TP_TRANSFORMS = {
    "adamw with a decay mask": lambda: optax.adamw(1e-2, weight_decay=0.5, mask=_decay_mask),
    "lamb (per-leaf trust ratio)": lambda: optax.lamb(1e-2),
    "adafactor (factored moments)": lambda: optax.adafactor(1e-2, min_dim_size_to_factor=8),
}


def _tp_case(flavour):
    kind, schedule = flavour.split("-", 1)
    pipe, loss_fn, params, batch = _tp_gpt(TP_CFG, kind, schedule, 2, 8)
    staged = pipe.stage(params, batch)
    ref_loss, ref_grads = reference_value_and_grad(loss_fn, params, batch, 2)
    return SimpleNamespace(
        pipe=pipe,
        params=params,
        batch=batch,
        staged=staged,
        ref_loss=ref_loss,
        ref_grads=ref_grads,
        grads=pipe.stage(ref_grads),  # staged: each copy of the tied leaf holds its gradient
    )


# Shared by the step and the optimizer tests (each builds its pipeline once).
@pytest.fixture(scope="module")
def tp_loop_case():
    return _tp_case("loop-zb-h1")


@pytest.fixture(scope="module")
def tp_scan_case():
    return _tp_case("scan-zb-v")


def test_bfloat16_params_and_loss_with_a_tensor_axis_and_data_parallel():
    # XLA:CPU aborted the process compiling the step's bfloat16 all-reduces (the gradients'
    # data-parallel mean, the loss's sum) once a tensor axis was partitioned: zbjax reduces
    # 16-bit floats in float32.
    params, specs, batch = _mlp()
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    base = _mlp_loss(2)

    def loss_fn(params, batch):
        return base(jax.tree.map(lambda x: x.astype(jnp.float32), params), batch).astype(
            jnp.bfloat16
        )

    pipe = zbjax.pipeline(
        loss_fn, mesh=_mesh(), schedule="1f1b", num_microbatches=2, param_specs=specs
    )
    loss, grads = jax.jit(pipe.value_and_grad)(params, batch)
    want_loss, want_grads = reference_value_and_grad(loss_fn, params, batch, 2)
    assert loss.dtype == jnp.bfloat16
    assert jax.tree.leaves(grads)[0].dtype == jnp.bfloat16
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=2e-2)
    wide = lambda t: jax.tree.map(lambda x: x.astype(jnp.float32), t)  # noqa: E731
    assert _max_diff(wide(grads), wide(want_grads)) < 2e-2


def test_gpt_specs_split_attention_by_whole_heads():
    """``gpt.tensor_parallel_specs`` splits qkv column-parallel and the attention output
    row-parallel; qkv's features lie head by head, so each device's part is whole heads and
    the attention output comes out split (nothing to gather). With more devices than heads,
    attention stays whole."""
    cfg = gpt.GPTConfig(vocab_size=32, seq_len=8, d_model=16, num_heads=4, num_layers=1)
    params = jax.eval_shape(lambda k: gpt.init_params(k, cfg), jax.random.key(0))
    block = gpt.tensor_parallel_specs(params, "tp", 2, cfg.num_heads)["block_0"]
    assert block["qkv"] == {"kernel": P(None, "tp"), "bias": P("tp")}
    assert block["attn_proj"] == {"kernel": P("tp"), "bias": None}
    qkv = jnp.zeros((2, cfg.seq_len, 3 * cfg.d_model))
    attention = functools.partial(gpt.causal_attention, num_heads=cfg.num_heads)
    assert _splits_of(attention, qkv, in_splits=[2]) == [2]
    whole = gpt.tensor_parallel_specs(params, "tp", 8, cfg.num_heads)["block_0"]
    assert whole["qkv"] == {"kernel": None, "bias": None} and whole["attn_proj"]["kernel"] is None
    assert whole["mlp_fc"]["kernel"] == P(None, "tp")


@pytest.mark.parametrize("flavour", ["loop", "scan"])
def test_gpt_megatron_split_with_tied_embedding(flavour, request):
    """The reference GPT split by ``gpt.tensor_parallel_specs`` (loop GPT under zb-h1, nn.scan
    GPT under zb-v): its token embedding, split over the vocabulary, is also the LM head on
    the last stage's device. Nothing is gathered over tp: each block's causal mask, split
    over the heads where F uses it, is computed again in B rather than stored. Nor are the
    slot pools moved between the tp devices (an all-to-all) at any tick."""
    case = request.getfixturevalue(f"tp_{flavour}_case")
    step = jax.jit(case.pipe.value_and_grad).lower(case.staged, case.batch).compile()
    hlo = step.as_text()
    assert "all-gather" not in hlo and "all-to-all" not in hlo
    loss, grads = step(case.staged, case.batch)
    np.testing.assert_allclose(float(loss), float(case.ref_loss), rtol=1e-6)
    assert _max_diff(case.pipe.unstage(grads), case.ref_grads) < 1e-6
    np.testing.assert_allclose(
        float(case.pipe.global_norm(grads)), float(optax.tree.norm(case.ref_grads)), rtol=1e-5
    )


def _two_steps(tx, params, grads):
    state = tx.init(params)
    for _ in range(2):
        updates, state = tx.update(grads, state, params)
        params = optax.apply_updates(params, updates)
    return params


def _check_per_leaf(case, name):
    pipe, params, staged, grads, ref_grads = (
        case.pipe,
        case.params,
        case.staged,
        case.grads,
        case.ref_grads,
    )
    make = TP_TRANSFORMS[name]
    tx = optax.chain(pipe.clip_by_global_norm(1.0), pipe.per_leaf(make()))
    got = jax.jit(lambda p, g: _two_steps(tx, p, g))(staged, grads)
    want = _two_steps(optax.chain(optax.clip_by_global_norm(1.0), make()), params, ref_grads)
    assert isinstance(got, zbjax.StagedParams)
    for row, want_row in zip(got.rows, pipe.stage(want).rows, strict=True):
        np.testing.assert_allclose(row, want_row, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", list(TP_TRANSFORMS))
def test_per_leaf_on_params_split_over_the_tensor_axis(tp_loop_case, name):
    """per_leaf sees each split leaf whole (XLA splits its work), so masks, lamb's trust
    ratio and adafactor's factored moments match optax on the user's tree."""
    _check_per_leaf(tp_loop_case, name)


def test_per_leaf_on_split_scan_layers_and_its_state_holds_parts(tp_scan_case):
    """The nn.scan GPT under zb-v: each device holds two row ranges of each stacked leaf,
    split over tp along another dimension (a per-leaf norm would be over the device's layers,
    as ``test_optim.py`` says, so the masked adamw is the exact case)."""
    _check_per_leaf(tp_scan_case, "adamw with a decay mask")
    # Adam's two moments per leaf hold each device's part, as its params row does: at most
    # twice the row per block (whole copies of the split leaves would not fit).
    pipe, staged = tp_scan_case.pipe, tp_scan_case.staged
    # Called eagerly, outside a jit, as a user may.
    state = pipe.per_leaf(TP_TRANSFORMS["adamw with a decay mask"]()).init(staged)
    layout = pipe.lowering.layout
    k = state.dtypes.index("float32")
    assert state.rows[k].shape[1] // layout.tensor_size <= 2 * layout.row_size[0]


def test_per_leaf_with_an_update_that_takes_extra_arguments_over_a_tensor_axis():
    """reduce_on_plateau's update needs value=, which init (where the state's splits over tp
    are worked out from a trace of the update) does not have: init raised JAX's TypeError
    (helper R). Its state is now kept whole; the update equals optax on the user's tree."""

    def loss_fn(p, x):
        h = zbjax.stage_boundary(jnp.tanh(x @ p["a"]))
        return jnp.mean((h @ p["c"]) ** 2)

    k0, k1, k2 = jax.random.split(jax.random.key(0), 3)
    params = {"a": jax.random.normal(k0, (8, 16)) / 3, "c": jax.random.normal(k1, (16, 8)) / 3}
    x = jax.random.normal(k2, (8, 8))
    mesh = jax.make_mesh(
        (2, 2), ("pp", "tp"), devices=jax.devices()[:4], axis_types=(AxisType.Auto,) * 2
    )
    specs = {"a": P(None, "tp"), "c": P("tp", None)}
    pipe = zbjax.pipeline(
        loss_fn, mesh=mesh, axis_name="pp", schedule="1f1b", num_microbatches=2, param_specs=specs
    )
    staged = pipe.stage(params, x)
    loss, grads = pipe.value_and_grad(staged, x)

    def make():
        return optax.chain(optax.adam(1e-2), optax.contrib.reduce_on_plateau(patience=0))

    tx = pipe.per_leaf(make())
    updates, _ = tx.update(grads, tx.init(staged), staged, value=loss)
    ref = make()
    want, _ = ref.update(pipe.unstage(grads), ref.init(params), params, value=loss)
    for name in params:
        np.testing.assert_allclose(pipe.unstage(updates)[name], want[name], rtol=1e-5)


@pytest.mark.parametrize("schedule", ["dag-1f1b", "dag-zb"])
def test_two_branches_on_a_stage_dag_split_over_tp(schedule):
    """Two towers the GraphPipe partitioner puts on the two pp devices, each split
    Megatron-style over tp."""
    rng = np.random.default_rng(2)

    def normal(*shape):
        return jnp.asarray(rng.normal(size=shape) * 0.2, jnp.float32)

    params = {t: {"w1": normal(D, H), "w2": normal(H, D)} for t in ("a", "b")}
    params["head"] = normal(D, 3)
    tower = {"w1": P(None, "tp"), "w2": P("tp", None)}
    specs = {"a": tower, "b": tower, "head": None}

    def loss_fn(p, batch):
        xa = jnp.tanh(batch["x"] @ p["a"]["w1"]) @ p["a"]["w2"]
        xb = jnp.tanh(batch["z"] @ p["b"]["w1"]) @ p["b"]["w2"]
        return jnp.mean(((xa + xb) @ p["head"] - batch["y"]) ** 2)

    batch = {"x": normal(32, D), "z": normal(32, D), "y": normal(32, 3)}
    pipe = zbjax.pipeline(
        loss_fn, mesh=_mesh(), schedule=schedule, num_microbatches=4, param_specs=specs
    )
    loss, grads = jax.jit(pipe.value_and_grad)(params, batch)
    want_loss, want_grads = jax.value_and_grad(loss_fn)(params, batch)
    assert pipe.partitioner_used == "graph"
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-6)
    assert _max_diff(grads, want_grads) < 1e-5
