"""run_schedule: pipelined loss and grads equal jax.value_and_grad for every model and order."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import zbjax
from models import gpt, gpt_nnx, gpt_scan, mlp
from zbjax import PipelineError, ScheduleError, schedules
from zbjax.executor import run_schedule
from zbjax.microbatch import reference_value_and_grad, split_microbatches
from zbjax.partition import partition
from zbjax.schedules import Action, Schedule
from zbjax.split import split

RTOL, ATOL = 1e-5, 1e-6
M = 2  # microbatches; 4 in the dropout test
BATCH = 4

# Every GPT here shares these sizes, so eager op-by-op execution reuses compiled kernels.
GPT_SIZES = dict(vocab_size=16, seq_len=8, d_model=16, num_heads=2)


@functools.cache
def unmarked_model(name):
    """Returns (config, module, params, batch, jax.value_and_grad(loss_fn)(params, batch))."""
    if name == "mlp":
        cfg = mlp.MLPConfig(in_dim=8, width=16, depth=4, out_dim=4)
        module = mlp
    else:
        # "gpt_scan8": the scan GPT with 8 layers, enough scan iterations for 8 stages.
        module = {"gpt": gpt, "gpt_nnx": gpt_nnx, "gpt_scan": gpt_scan, "gpt_scan8": gpt_scan}[name]
        cfg = module.GPTConfig(num_layers=8 if name == "gpt_scan8" else 4, **GPT_SIZES)
    params = jax.jit(module.init_params, static_argnums=1)(jax.random.key(0), cfg)
    make_batch = jax.jit(
        module.make_batch if module is mlp else gpt.make_batch, static_argnums=(1, 2)
    )
    batch = make_batch(jax.random.key(1), cfg, BATCH)
    reference = jax.jit(jax.value_and_grad(module.make_loss_fn(cfg)))(params, batch)
    return cfg, module, params, batch, reference


@functools.cache
def model(name):
    """Returns (loss_fn, params, batch, reference (loss, grads)) for a reference model.

    ``"gpt:markers"`` is the GPT with stage_boundary markers after blocks 0 and 2; markers are
    identities, so its reference is the unmarked model's ``jax.value_and_grad``.
    """
    base, _, markers = name.partition(":")
    cfg, module, params, batch, reference = unmarked_model(base)
    if markers:
        cfg = dataclasses.replace(cfg, stage_boundaries=(0, 2))
    return module.make_loss_fn(cfg), params, batch, reference


@functools.cache
def stage_programs(name, num_stages):
    loss_fn, params, batch, _ = model(name)
    microbatch = jax.tree.map(lambda x: x[0], split_microbatches(batch, M))
    graph = partition(loss_fn, params, microbatch, num_stages=num_stages)
    return graph, split(graph)


def assert_matches(got, want):
    loss, grads = got
    want_loss, want_grads = want
    np.testing.assert_allclose(loss, want_loss, rtol=RTOL, atol=ATOL)
    assert jax.tree.structure(grads) == jax.tree.structure(want_grads)
    for path, g in jax.tree_util.tree_leaves_with_path(grads):
        w = functools.reduce(lambda t, k: t[k.key], path, want_grads)
        np.testing.assert_allclose(g, w, rtol=RTOL, atol=ATOL, err_msg=jax.tree_util.keystr(path))


CASES = [
    ("mlp:markers", None),
    ("mlp", 2),
    ("mlp", 4),
    ("mlp", 8),
    ("gpt:markers", None),
    ("gpt", 2),
    ("gpt", 4),
    ("gpt", 8),
    ("gpt_nnx:markers", None),
    ("gpt_nnx", 2),
    ("gpt_nnx", 4),
    ("gpt_nnx", 8),
    ("gpt_scan", 2),
    ("gpt_scan", 4),
    ("gpt_scan8", 8),  # 8 stages need more than the 4 scan iterations of the default
]


@pytest.mark.parametrize("order", ["1f1b", "zb-h1"])
@pytest.mark.parametrize(("name", "num_stages"), CASES, ids=[f"{n}-{s}" for n, s in CASES])
def test_pipelined_loss_and_grads_equal_jax_value_and_grad(name, num_stages, order):
    loss_fn, params, batch, reference = model(name)
    graph, programs = stage_programs(name, num_stages)
    if num_stages is not None:
        assert graph.num_stages == num_stages
    schedule = schedules.build(order, num_stages=graph.num_stages, num_microbatches=M)
    assert_matches(run_schedule(graph, programs, schedule, params, batch, jit=False), reference)


def dag_schedule(graph, m, fused):
    """Returns a one-stage-per-device schedule on the graph's edges: all F, then backwards."""
    backward = (
        (lambda s, i: [Action("BW", s, i)])
        if fused
        else (lambda s, i: [Action("B", s, i), Action("W", s, i)])
    )
    actions = [
        [Action("F", s, i) for i in range(m)] + [a for i in range(m) for a in backward(s, i)]
        for s in range(graph.num_stages)
    ]
    return Schedule(
        "dag", graph.num_stages, m, tuple(range(graph.num_stages)), actions, edges=graph.edge_pairs
    )


def diamond_loss(params, batch):
    a = jnp.tanh(batch["x"] @ params["wa"])
    b = jnp.tanh(zbjax.stage_boundary(a) @ params["wb"])
    c = jnp.sin(zbjax.stage_boundary(a) @ params["wc"])
    b, c = zbjax.stage_boundary((b, c))
    return jnp.mean(((b * c) @ params["wd"] + a @ params["wa"] - batch["y"]) ** 2)


@pytest.mark.parametrize("fused", [True, False], ids=["F-BW", "F-B-W"])
def test_diamond_dag_fans_out_and_in_and_matches_jax_grad(fused):
    keys = jax.random.split(jax.random.key(0), 6)
    params = {n: jax.random.normal(k, (4, 4)) / 2 for n, k in zip("abcd", keys, strict=False)}
    params = {f"w{n}": w for n, w in params.items()}
    batch = {"x": jax.random.normal(keys[4], (4, 4)), "y": jax.random.normal(keys[5], (4, 4))}
    microbatch = jax.tree.map(lambda x: x[:2], batch)
    graph = partition(diamond_loss, params, microbatch)
    assert graph.edge_pairs == ((0, 1), (0, 2), (0, 3), (1, 3), (2, 3))
    schedule = dag_schedule(graph, 2, fused)
    got = run_schedule(graph, split(graph), schedule, params, batch, jit=False)
    assert_matches(got, jax.value_and_grad(diamond_loss)(params, batch))


def test_dropout_microbatch_i_uses_fold_in_key_i():
    cfg, _, params, batch, _ = unmarked_model("gpt")
    cfg = dataclasses.replace(cfg, dropout_rate=0.2, stage_boundaries=(1,))
    loss_fn = gpt.make_loss_fn(cfg)
    key = jax.random.key(42)
    microbatch = jax.tree.map(lambda x: x[0], split_microbatches(batch, M))
    graph = partition(loss_fn, params, microbatch, key=key)
    schedule = schedules.build("zb-h1", num_stages=2, num_microbatches=M)
    got = run_schedule(graph, split(graph), schedule, params, batch, key=key, jit=False)
    reference = jax.jit(functools.partial(reference_value_and_grad, loss_fn, num_microbatches=M))
    assert_matches(got, reference(params, batch, key=key))
    other_key = reference(params, batch, key=jax.random.key(7))
    assert not np.allclose(got[0], other_key[0])  # the key really reaches the stages


def test_jitted_actions_give_the_same_result():
    loss_fn, params, batch, reference = model("mlp:markers")
    graph, programs = stage_programs("mlp:markers", None)
    schedule = schedules.build("zb-h1", num_stages=graph.num_stages, num_microbatches=M)
    assert_matches(run_schedule(graph, programs, schedule, params, batch, jit=False), reference)


def test_a_batch_that_does_not_split_into_microbatches_is_refused():
    _, params, batch, _ = model("mlp:markers")
    graph, programs = stage_programs("mlp:markers", None)
    schedule = schedules.build("1f1b", num_stages=graph.num_stages, num_microbatches=3)
    with pytest.raises(PipelineError, match=r"\['x'\] has shape \(4, 8\).*num_microbatches=3"):
        run_schedule(graph, programs, schedule, params, batch, jit=False)


def test_a_deadlocked_order_is_refused():
    _, params, batch, _ = model("mlp:markers")
    graph, programs = stage_programs("mlp:markers", None)
    good = schedules.build("1f1b", num_stages=graph.num_stages, num_microbatches=M)
    bad = good.with_actions([[Action("BW", 0, 0), Action("F", 0, 0)], list(good.actions[1])])
    with pytest.raises(ScheduleError, match="deadlock.*device 0 waits at 0BW0"):
        run_schedule(graph, programs, bad, params, batch, jit=False)


def test_run_schedule_and_stage_summary_name_a_wrong_argument_type():
    _, params, batch, _ = model("mlp:markers")
    graph, programs = stage_programs("mlp:markers", None)
    with pytest.raises(PipelineError, match="schedule is a str, not a Schedule; pass zbjax"):
        run_schedule(graph, programs, "zb-h1", params, batch)
    with pytest.raises(PipelineError, match="graph is a NoneType, not a StageGraph"):
        run_schedule(None, programs, schedules.build("1f1b", 2, M), params, batch)
    with pytest.raises(zbjax.PartitionError, match="takes a StageGraph.*not a NoneType"):
        zbjax.stage_summary(None)


def test_a_schedule_missing_w_is_refused():
    _, params, batch, _ = model("mlp:markers")
    graph, programs = stage_programs("mlp:markers", None)
    good = schedules.build("zb-h1", num_stages=graph.num_stages, num_microbatches=M)
    bad = good.with_actions([[a for a in p if str(a) != "0W0"] for p in good.actions])
    with pytest.raises(ScheduleError, match="leaves work undone: 0W0"):
        run_schedule(graph, programs, bad, params, batch, jit=False)


def test_params_or_batch_that_do_not_fit_the_graph_are_refused():
    _, params, batch, _ = model("mlp:markers")
    graph, programs = stage_programs("mlp:markers", None)
    schedule = schedules.build("1f1b", num_stages=graph.num_stages, num_microbatches=1)
    with pytest.raises(PipelineError, match=r"shape \(4, 8\) but the graph was partitioned for"):
        run_schedule(graph, programs, schedule, params, batch, jit=False)
    with pytest.raises(PipelineError, match="tree structure"):
        run_schedule(graph, programs, schedule, {"other": params}, batch, jit=False)
    wider = jax.tree.map(lambda x: jnp.zeros((*x.shape[:-1], x.shape[-1] + 1), x.dtype), params)
    with pytest.raises(PipelineError, match=r"params leaf .* but the graph was partitioned with"):
        run_schedule(graph, programs, schedule, wider, batch, jit=False)
    with pytest.raises(PipelineError, match="jit='no'; pass True or False"):
        run_schedule(graph, programs, schedule, params, batch, jit="no")
    halved = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    with pytest.raises(PipelineError, match=r"is bfloat16\[.*partitioned with float32"):
        run_schedule(graph, programs, schedule, halved, batch, jit=False)


@pytest.mark.parametrize("order", ["zb-v", "interleaved-1f1b"])
def test_schedules_with_two_stages_per_device_give_the_same_grads(order):
    loss_fn, params, batch, reference = model("mlp")
    graph, programs = stage_programs("mlp", 4)
    schedule = schedules.build(order, num_stages=4, num_microbatches=M)
    assert schedule.num_devices == 2
    assert_matches(run_schedule(graph, programs, schedule, params, batch, jit=False), reference)


def test_an_action_outside_the_graph_is_refused():
    _, params, batch, _ = model("mlp:markers")
    graph, programs = stage_programs("mlp:markers", None)
    good = schedules.build("1f1b", num_stages=graph.num_stages, num_microbatches=M)
    bad = good.with_actions([[Action("F", 0, M)] + list(good.actions[0])] + list(good.actions[1:]))
    with pytest.raises(ScheduleError, match=f"0F{M} names stage 0 / microbatch {M}, outside"):
        run_schedule(graph, programs, bad, params, batch, jit=False)
