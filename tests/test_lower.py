"""Lowering: the one shard_map program computes jax.value_and_grad for every schedule and graph.

These tests build stage programs by hand (forward keeps its inputs as residuals, B is a
``jax.vjp`` returning the param cotangents as W's stash, W is the identity on the stash), so
they check the lowering alone: routing along any edge, slots, staged params and tied leaves.
"""

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from zbjax import schedules, ticks
from zbjax.lower import _tick_inputs, branch_keys, lower
from zbjax.params import stage_leaves, unstage_leaves
from zbjax.schedules import Action, Schedule
from zbjax.stages import Edge, Stage, StageGraph, StageProgram
from zbjax.ticks import IDLE, KIND_NAMES

WIDTH = 8
MICRO = 2  # rows per microbatch


@dataclass(frozen=True)
class StageSpec:
    fn: object  # (params, batch, inputs) -> outputs, all lists
    param_leaves: tuple[int, ...]
    batch_leaves: tuple[int, ...]
    in_edges: tuple[int, ...]
    out_edges: tuple[int, ...]


def sds(x):
    return jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x))


def handmade(specs, edge_pairs, params, batch_mb):
    """Returns (StageGraph, programs) for stages given as plain functions (DAG in edge order)."""
    leaves, ptree = jax.tree.flatten(params)
    bleaves, btree = jax.tree.flatten(batch_mb)
    edge_values: dict[int, tuple] = {}
    stages, programs = [], []
    for s, spec in enumerate(specs):
        p_avals = [sds(leaves[i]) for i in spec.param_leaves]
        b_avals = [sds(bleaves[i]) for i in spec.batch_leaves]
        i_avals = [v for e in spec.in_edges for v in edge_values[e]]
        n_p, n_b, n_in = len(p_avals), len(b_avals), len(p_avals) + len(b_avals) + len(i_avals)

        def f(*args, fn=spec.fn, n_p=n_p, n_b=n_b):
            return tuple(fn(list(args[:n_p]), list(args[n_p : n_p + n_b]), list(args[n_p + n_b :])))

        ins = p_avals + b_avals + i_avals
        jaxpr = jax.make_jaxpr(f)(*ins)
        outs = [sds(o) for o in jaxpr.out_avals]
        start = 0
        for e in spec.out_edges:
            n = 1  # every handmade edge carries one value
            edge_values[e] = tuple(outs[start : start + n])
            start += n

        def backward(*args, f=f, n_in=n_in, n_p=n_p, n_b=n_b):
            residuals, cts = args[:n_in], args[n_in:]
            _, vjp = jax.vjp(f, *residuals)
            grads = vjp(tuple(cts))
            return (*grads[n_p + n_b :], *grads[:n_p])

        forward_j = jax.make_jaxpr(lambda *a, f=f: (*f(*a), *a))(*ins)
        backward_j = jax.make_jaxpr(backward)(*ins, *outs)
        weight_j = jax.make_jaxpr(lambda *a: tuple(a))(*p_avals)
        stage = Stage(
            index=s,
            name=f"s{s}",
            jaxpr=jaxpr,
            param_leaves=spec.param_leaves,
            batch_leaves=spec.batch_leaves,
            in_edges=spec.in_edges,
            out_edges=spec.out_edges,
            input_differentiable=(True,) * len(i_avals),
            output_differentiable=(True,) * len(outs),
            cost=1.0,
        )
        stages.append(stage)
        programs.append(
            StageProgram(
                stage=stage,
                forward=forward_j,
                backward_input=backward_j,
                backward_weight=weight_j,
                backward=backward_j,
                residual_avals=tuple(ins),
                stash_avals=tuple(p_avals),
                cost_forward=1.0,
                cost_backward_input=1.0,
                cost_backward_weight=1.0,
                flops_forward=0,
                flops_backward_input=0,
                flops_backward_weight=0,
                flops_backward=0,
                param_bytes=0,
                activation_bytes=0,
                stash_bytes=0,
            )
        )
    graph = StageGraph(
        stages=tuple(stages),
        edges=tuple(Edge(a, b, edge_values[e]) for e, (a, b) in enumerate(edge_pairs)),
        loss_stage=len(specs) - 1,
        params_treedef=ptree,
        batch_treedef=btree,
        param_avals=tuple(sds(x) for x in leaves),
        batch_avals=tuple(sds(x) for x in bleaves),
    )
    return graph, tuple(programs)


def chain_mlp(num_stages, tied=False):
    """Returns (specs, edges, params, loss_fn): one tanh layer per stage, squared-error loss.

    With ``tied`` the last stage also multiplies by the first stage's weight (leaf 0),
    like a tied embedding read by the first and last stage.
    """
    specs = []
    for s in range(num_stages):
        last = s == num_stages - 1

        def fn(p, b, x, s=s, last=last):
            h = (b[0] if s == 0 else x[0]) @ p[0] + p[1]
            if not last:
                return [jnp.tanh(h)]
            if tied:
                h = h @ p[2]
            return [jnp.mean((h - b[-1]) ** 2)]

        leaves = (2 * s, 2 * s + 1) + ((0,) if (tied and last) else ())
        batch = ((0,) if s == 0 else ()) + ((1,) if last else ())
        ins = () if s == 0 else (s - 1,)
        outs = () if last else (s,)
        specs.append(StageSpec(fn, leaves, batch, ins, outs))
    keys = jax.random.split(jax.random.key(0), 2 * num_stages)
    params = [
        (jax.random.normal(keys[i], (WIDTH, WIDTH)) / WIDTH**0.5)
        if i % 2 == 0
        else 0.1 * jax.random.normal(keys[i], (WIDTH,))
        for i in range(2 * num_stages)
    ]

    def loss_fn(params, batch):
        h = batch[0]
        for s in range(num_stages):
            h = h @ params[2 * s] + params[2 * s + 1]
            if s < num_stages - 1:
                h = jnp.tanh(h)
        if tied:
            h = h @ params[0]
        return jnp.mean((h - batch[1]) ** 2)

    return specs, schedules.chain_edges(num_stages), params, loss_fn


def make_batch(num_microbatches):
    n = num_microbatches * MICRO
    return [
        jax.random.normal(jax.random.key(1), (n, WIDTH)),
        jax.random.normal(jax.random.key(2), (n, WIDTH)),
    ]


def mesh_of(num_devices):
    return jax.make_mesh(
        (num_devices,),
        ("pp",),
        axis_types=(jax.sharding.AxisType.Auto,),
        devices=jax.devices()[:num_devices],
    )


def run_lowered(graph, programs, schedule, params, batch, costs=None):
    low = lower(graph, programs, schedule, mesh_of(schedule.num_devices), "pp", costs)
    m = schedule.num_microbatches

    @jax.jit
    def step(params, batch):
        staged = stage_leaves(low.layout, params)
        micro = [b.reshape(m, b.shape[0] // m, *b.shape[1:]) for b in batch]
        loss, grads = low.step(staged, micro)
        return loss, unstage_leaves(low.layout, grads)

    return low, step(params, batch)


def assert_matches(result, loss_fn, params, batch):
    loss, grads = result
    ref_loss, ref_grads = jax.value_and_grad(loss_fn)(params, batch)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    for g, r in zip(grads, ref_grads, strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize(
    "name, devices, micro",
    [
        ("gpipe", 4, 4),
        ("1f1b", 4, 8),
        ("zb-h1", 4, 4),
        ("zb-h2", 2, 4),
        ("interleaved-1f1b", 2, 4),
        ("zb-v", 4, 4),
    ],
)
def test_lowered_step_equals_value_and_grad_for_every_schedule(name, devices, micro):
    stages = 2 * devices if name in ("zb-v", "interleaved-1f1b") else devices
    specs, edges, params, loss_fn = chain_mlp(stages)
    batch = make_batch(micro)
    graph, programs = handmade(specs, edges, params, [b[:MICRO] for b in batch])
    schedule = schedules.build(name, stages, micro, num_devices=devices)
    _, result = run_lowered(graph, programs, schedule, params, batch)
    assert_matches(result, loss_fn, params, batch)


#: Per-stage costs (first 8 stages) under which W packs into the ticks: a first stage with a
#: cheap B and a long W.
PACKING_COSTS = schedules.Costs(
    f=(1.0, 1.2) + (1.0,) * 6, b=(0.1,) + (1.0,) * 7, w=(1.5,) + (1.0,) * 7
)
#: Step_time's 2-stage MLP costs (ms) and an exchange of 0.5 ms, under which F, B and BW pack
#: after short actions too (fewer ticks that send, so fewer exchanges): the last stage runs F
#: and B of one microbatch in one tick, the loss computed in a lane.
TWO_STAGE_COSTS = schedules.Costs((1.8, 1.95), (0.1, 1.8), (2.6, 1.75), 0.5)


@pytest.mark.parametrize(
    "name, devices, micro",
    [
        ("zb-h1", 2, 6),
        ("zb-h2", 4, 8),
        ("zb-v", 2, 6),
        ("1f1b", 2, 4),
        ("zb-h2", 2, 4),
        ("zb-h1", 2, 4),
    ],
)
def test_packed_ticks_still_equal_value_and_grad(name, devices, micro, monkeypatch):
    # Packing, not the segments that two devices may get instead (tested in test_ticks and
    # test_pipeline): with these costs segments would win and pack only W into lanes.
    monkeypatch.setattr(ticks, "segment_ticks", lambda *args, **kwargs: None)
    stages = 2 * devices if name == "zb-v" else devices
    specs, edges, params, loss_fn = chain_mlp(stages, tied=name == "zb-v")
    batch = make_batch(micro)
    graph, programs = handmade(specs, edges, params, [b[:MICRO] for b in batch])
    schedule = schedules.build(name, stages, micro, num_devices=devices)
    if devices == 4:
        f, b, w = PACKING_COSTS.per_stage(8)
        costs = schedules.Costs(f[:stages], b[:stages], w[:stages])
    else:
        per = stages // devices
        f, b, w = (tuple(x / per for x in v for _ in range(per)) for v in
                   TWO_STAGE_COSTS.per_stage(2))  # fmt: skip
        costs = schedules.Costs(f, b, w, TWO_STAGE_COSTS.comm)
    low, result = run_lowered(graph, programs, schedule, params, batch, costs)
    packed = {KIND_NAMES[int(k)] for k in low.tables.kind[:, :, 1:].ravel() if k != IDLE}
    assert packed, "nothing was packed"
    if devices == 2 and name != "zb-v":
        assert packed - {"W"}, f"only {packed} packed"
    assert_matches(result, loss_fn, params, batch)


#: Four uneven stages and an exchange costing a third of an F, under which the planner lays
#: four devices' ticks out around their exchanges (``ticks.segment_ticks``).
SEGMENT_COSTS = schedules.Costs(
    (1.0, 1.2, 1.0, 1.1), (0.1, 1.0, 1.0, 0.9), (1.5, 0.6, 0.5, 0.7), 0.3
)


@pytest.mark.parametrize("name, micro", [("1f1b", 4), ("zb-h1", 8), ("zb-h2", 8), ("dag-zb", 4)])
def test_segmented_ticks_on_four_devices_still_equal_value_and_grad(name, micro):
    if name == "dag-zb":  # stage 0 sends over two shifts, stage 3 receives over two
        specs, edges, params, loss_fn = dag_model()
        schedule = schedules.build(name, 4, micro, edges=edges, placement=(0, 1, 2, 3))
    else:
        specs, edges, params, loss_fn = chain_mlp(4)
        schedule = schedules.build(name, 4, micro)
    batch = make_batch(micro)
    graph, programs = handmade(specs, edges, params, [b[:MICRO] for b in batch])
    low, result = run_lowered(graph, programs, schedule, params, batch, SEGMENT_COSTS)
    # The loop runs the segments ...
    segmented = ticks.segment_ticks(low.schedule, SEGMENT_COSTS)
    expected = ticks.tick_tables(low.schedule, positions=segmented)
    np.testing.assert_array_equal(low.tables.kind, expected.kind)
    # ... where they beat every packing of the fixed ticks.
    packed = min(
        ticks.barrier_time(low.schedule, positions, SEGMENT_COSTS)
        for positions in ticks.packings(low.schedule, SEGMENT_COSTS)
    )
    assert ticks.barrier_time(low.schedule, segmented, SEGMENT_COSTS) < packed * (1 - 1e-9)
    assert_matches(result, loss_fn, params, batch)


@pytest.mark.parametrize("name", ["1f1b", "zb-v"])
def test_tied_leaf_gradient_sums_both_stages_on_one_or_two_devices(name):
    devices, micro = 2, 4
    stages = 2 * devices if name == "zb-v" else devices
    specs, edges, params, loss_fn = chain_mlp(stages, tied=True)
    batch = make_batch(micro)
    graph, programs = handmade(specs, edges, params, [b[:MICRO] for b in batch])
    assert graph.tied_params == (0,)
    schedule = schedules.build(name, stages, micro, num_devices=devices)
    _, result = run_lowered(graph, programs, schedule, params, batch)
    assert_matches(result, loss_fn, params, batch)


def dag_model():
    """Returns a 4-stage diamond: stage 0 fans out to stages 1 and 2, which fan in to stage 3."""
    specs = [
        # One value per out-edge: the fan-out sends the same activation twice.
        StageSpec(lambda p, b, x: [jnp.tanh(b[0] @ p[0])] * 2, (0,), (0,), (), (0, 1)),
        StageSpec(lambda p, b, x: [jnp.tanh(x[0] @ p[0])], (1,), (), (0,), (2,)),
        StageSpec(lambda p, b, x: [jnp.sin(x[0] @ p[0])], (2,), (), (1,), (3,)),
        StageSpec(
            lambda p, b, x: [jnp.mean(((x[0] * x[1]) @ p[0] - b[0]) ** 2)], (3,), (1,), (2, 3), ()
        ),
    ]
    edges = ((0, 1), (0, 2), (1, 3), (2, 3))
    keys = jax.random.split(jax.random.key(3), 4)
    params = [jax.random.normal(k, (WIDTH, WIDTH)) / WIDTH**0.5 for k in keys]

    def loss_fn(params, batch):
        h = jnp.tanh(batch[0] @ params[0])
        a, b = jnp.tanh(h @ params[1]), jnp.sin(h @ params[2])
        return jnp.mean(((a * b) @ params[3] - batch[1]) ** 2)

    return specs, edges, params, loss_fn


def dag_schedule(placement, num_microbatches, split_backward):
    """Returns a GPipe-style order of the diamond on the devices of ``placement``."""
    actions = [[] for _ in range(max(placement) + 1)]
    m = num_microbatches
    for s in (0, 1, 2, 3):
        actions[placement[s]] += [Action("F", s, i) for i in range(m)]
    for s in (3, 2, 1, 0):
        for i in reversed(range(m)):
            if split_backward:
                actions[placement[s]] += [Action("B", s, i), Action("W", s, i)]
            else:
                actions[placement[s]].append(Action("BW", s, i))
    return Schedule("dag", 4, m, placement, actions, edges=((0, 1), (0, 2), (1, 3), (2, 3)))


@pytest.mark.parametrize("placement, split_backward", [((0, 1, 2, 3), False), ((0, 1, 1, 0), True)])
def test_fan_out_and_fan_in_edges_route_activations_and_cotangents(placement, split_backward):
    specs, edges, params, loss_fn = dag_model()
    batch = make_batch(2)
    graph, programs = handmade(specs, edges, params, [b[:MICRO] for b in batch])
    schedule = dag_schedule(placement, 2, split_backward)
    _, result = run_lowered(graph, programs, schedule, params, batch)
    assert_matches(result, loss_fn, params, batch)


def packed_diamond():
    """Returns (lowering, result, check) of the diamond with stages 1 and 2 on device 1, its
    ticks planned by costs under which B and W pack after short actions; ``check()`` asserts
    the result equals value_and_grad."""
    specs, edges, params, loss_fn = dag_model()
    batch = make_batch(3)
    graph, programs = handmade(specs, edges, params, [b[:MICRO] for b in batch])
    schedule = dag_schedule((0, 1, 1, 0), 3, split_backward=True)
    costs = schedules.Costs((1.0, 2.0, 1.0, 1.5), (0.1, 1.0, 2.0, 1.0), (1.0, 1.0, 0.5, 1.0))
    low, result = run_lowered(graph, programs, schedule, params, batch, costs)
    return low, result, lambda: assert_matches(result, loss_fn, params, batch)


def backward_input_stages(tables, tick: int, device: int) -> list[int]:
    """Returns the stages whose B ``device`` runs in ``tick``, lane by lane."""
    return [
        int(tables.stage[tick, device, lane])
        for lane in range(tables.num_lanes)
        if KIND_NAMES.get(int(tables.kind[tick, device, lane])) == "B"
    ]


def test_packed_ticks_route_a_diamonds_messages_and_equal_value_and_grad():
    # Stages 1 and 2 share device 1 and both send cotangents to stage 0 over the same shift:
    # packing puts B and W after short actions. Under these costs the packings that keep a
    # tick's senders on distinct shifts win (``choose_ticks`` tries them first), so both Bs
    # never share a tick; the next test makes them.
    low, _, check = packed_diamond()
    tables = low.tables
    packed = {KIND_NAMES[int(k)] for k in tables.kind[:, :, 1:].ravel() if k != IDLE}
    assert "B" in packed
    for t in range(tables.num_ticks):
        backward_stages = backward_input_stages(tables, t, 1)
        assert len(backward_stages) <= 1, (t, backward_stages)
    check()


def test_messages_of_two_lanes_share_a_ticks_exchange_and_equal_value_and_grad(monkeypatch):
    # The diamond again, packed letting a tick's senders share its exchange: device 1 runs
    # both Bs (stages 1 and 2) in one tick, and their cotangents travel to stage 0 together.
    def shared(schedule, costs, segments=True):
        return ticks.pack_ticks(schedule, costs, 2.0, 2, ticks.ANY_KIND, share_exchanges=True)

    monkeypatch.setattr(ticks, "choose_ticks", shared)
    low, _, check = packed_diamond()
    tables = low.tables
    both = [
        t for t in range(tables.num_ticks) if set(backward_input_stages(tables, t, 1)) == {1, 2}
    ]
    assert both, "no tick runs both Bs"
    k = tables.shifts.index(1)  # device 1 -> device 0 (of 2)
    assert all(tables.payload_blocks[t, k] == 2 for t in both)
    check()


def test_lowered_scan_inputs_read_back_as_the_schedule_action_for_action():
    stages, micro = 8, 8
    specs, edges, params, _ = chain_mlp(stages)
    batch = make_batch(micro)
    graph, programs = handmade(specs, edges, params, [b[:MICRO] for b in batch])
    schedule = schedules.build("zb-v", stages, micro, num_devices=4)
    low = lower(graph, programs, schedule, mesh_of(4), "pp")
    branch, microbatch = _tick_inputs(low)[:2]
    decoded = []
    for d in range(schedule.num_devices):
        program = []
        for t in range(branch.shape[0]):
            for lane in range(branch.shape[2]):
                if branch[t, d, lane]:
                    kind, stage = branch_keys(low.tables, lane)[branch[t, d, lane]]
                    program.append(Action(KIND_NAMES[kind], stage, int(microbatch[t, d, lane])))
        decoded.append(tuple(program))
    assert tuple(decoded) == schedule.actions


def test_branches_are_named_by_kind_and_stage_in_the_compiled_program():
    specs, edges, params, _ = chain_mlp(2)
    batch = make_batch(2)
    graph, programs = handmade(specs, edges, params, [b[:MICRO] for b in batch])
    schedule = schedules.build("zb-h1", 2, 2)
    low = lower(graph, programs, schedule, mesh_of(2), "pp")

    def step(params, batch):
        micro = [b.reshape(2, MICRO, WIDTH) for b in batch]
        return low.step(stage_leaves(low.layout, params), micro)

    text = jax.jit(step).lower(params, batch).as_text(debug_info=True)
    for scope in ("F s0", "B s1", "W s0"):
        assert scope in text


def test_one_ppermute_per_device_shift_and_none_for_local_edges():
    stages, micro = 8, 4
    specs, edges, params, _ = chain_mlp(stages)
    batch = make_batch(micro)
    graph, programs = handmade(specs, edges, params, [b[:MICRO] for b in batch])
    schedule = schedules.build("zb-v", stages, micro, num_devices=4)
    low = lower(graph, programs, schedule, mesh_of(4), "pp")

    def step(params, batch):
        stacked = [b.reshape(micro, MICRO, WIDTH) for b in batch]
        return low.step(stage_leaves(low.layout, params), stacked)

    text = jax.jit(step).lower(params, batch).as_text()
    # V placement: shifts +1 and -1 cross devices, the turn of the V is a local copy.
    assert low.tables.shifts == (0, 1, 3)
    assert text.count("collective_permute") == 2
