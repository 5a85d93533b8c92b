"""Graph pipelines end to end: branch models pipelined over a stage DAG equal jax.value_and_grad.

Combinations run (model x pp devices x schedule), chosen so that every model gets both DAG
schedules and every device count both schedules while each compile stays in the file's budget:

- 4 devices: multi-modal with 2 branches (markers, 4 stages), the unequal two-tower (markers,
  4 stages) and the multi-modal with 4 branches (GraphPipe partition of the unmarked model:
  3 branch stages fanning into a branch + head stage), each with dag-1f1b and dag-zb.
- 8 devices: DLRM (markers, 8 stages) with dag-1f1b and dag-zb; the 4-branch multi-modal with
  dag-zb (GraphPipe partition, 8 stages).

The 7 other combinations compile programs of the same kinds (same lowering, other sizes); an
8-stage transformer program takes 10-45 s to compile on a loaded 2-core machine, so they are
left out to keep the file within its time budget. A diamond A -> {B, C} -> D checks that a
fan-out's gradient is the sum over its paths and that a fan-in pairs the inputs of the same
microbatch.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import zbjax
from models import dlrm, multimodal, two_tower
from zbjax.errors import PipelineError, ScheduleError

BATCH_SIZE = 8
NUM_MICROBATCHES = 4

# name -> (model module, config); the marker configs make exactly as many stages as devices.
MODELS = {
    "multimodal-2": (
        multimodal,
        multimodal.MultiModalConfig(
            num_branches=2,
            layers_per_branch=2,
            branch_boundaries=True,
            layers_per_stage=1,
            head_stage=False,
        ),
    ),
    "multimodal-4-unmarked": (multimodal, multimodal.MultiModalConfig(num_branches=4)),
    "two-tower": (
        two_tower,
        two_tower.TwoTowerConfig(branch_boundaries=True, layers_per_stage=2),
    ),
    "dlrm": (dlrm, dlrm.DLRMConfig(bottom_depth=4, branch_boundaries=True, layers_per_stage=1)),
}


def _mesh(num_devices: int):
    return jax.make_mesh(
        (num_devices,),
        ("pp",),
        axis_types=(jax.sharding.AxisType.Auto,),
        devices=jax.devices()[:num_devices],
    )


class _References:
    """Per model, built once: (loss_fn, params, batch, jax.value_and_grad at that point)."""

    def __init__(self) -> None:
        self._cache: dict[str, tuple] = {}

    def __getitem__(self, name: str) -> tuple:
        if name not in self._cache:
            module, cfg = MODELS[name]
            loss_fn = module.make_loss_fn(cfg)
            params = module.init_params(jax.random.key(0), cfg)
            batch = module.make_batch(jax.random.key(1), cfg, BATCH_SIZE)
            reference = jax.jit(jax.value_and_grad(loss_fn))(params, batch)
            self._cache[name] = (loss_fn, params, batch, reference)
        return self._cache[name]


@pytest.fixture(scope="module")
def references() -> _References:
    return _References()


def _assert_equal_to_reference(pipelined, reference) -> None:
    loss, grads = pipelined
    ref_loss, ref_grads = reference
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    assert jax.tree.structure(grads) == jax.tree.structure(ref_grads)
    for path, g in jax.tree_util.tree_flatten_with_path(grads)[0]:
        want = np.asarray(_at(ref_grads, path))
        np.testing.assert_allclose(
            np.asarray(g), want, rtol=1e-5, atol=1e-7, err_msg=jax.tree_util.keystr(path)
        )


def _at(tree, path):
    for key in path:
        tree = tree[key.key if hasattr(key, "key") else key.idx]
    return tree


def _fan_in(pairs) -> dict[int, set[int]]:
    preds: dict[int, set[int]] = {}
    for a, b in pairs:
        preds.setdefault(b, set()).add(a)
    return {s: p for s, p in preds.items() if len(p) > 1}


# ----------------------------------------------------------------------------- branch models


@pytest.mark.parametrize(
    "name, num_devices, schedule",
    [
        ("multimodal-2", 4, "dag-1f1b"),
        ("multimodal-2", 4, "dag-zb"),
        ("two-tower", 4, "dag-1f1b"),
        ("two-tower", 4, "dag-zb"),
        ("dlrm", 8, "dag-1f1b"),
        ("dlrm", 8, "dag-zb"),
    ],
)
def test_branch_model_pipelined_over_its_marker_stage_dag_equals_value_and_grad(
    references, name, num_devices, schedule
):
    loss_fn, params, batch, reference = references[name]
    pipe = zbjax.pipeline(
        loss_fn, mesh=_mesh(num_devices), schedule=schedule, num_microbatches=NUM_MICROBATCHES
    )
    _assert_equal_to_reference(pipe.value_and_grad(params, batch), reference)
    # The markers made one stage per device, the stages form a DAG with a fan-in, and the
    # schedule was built by name on exactly that graph.
    graph, built = pipe.graph, pipe.schedule
    assert graph.num_stages == num_devices
    assert _fan_in(graph.edge_pairs), graph.edge_pairs
    assert built.name == schedule
    assert set(built.edges) == set(graph.edge_pairs)
    assert built.placement == tuple(range(num_devices))
    assert built.stage_names == tuple(stage.name for stage in graph.stages)
    assert pipe.partitioner_used == "markers"
    kinds = {action.kind for device in built.actions for action in device}
    assert kinds == ({"F", "BW"} if schedule == "dag-1f1b" else {"F", "B", "W"})


@pytest.mark.parametrize(
    "num_devices, schedule, partitioner",
    [(8, "dag-zb", "graph"), (4, "dag-1f1b", "graph"), (4, "dag-zb", "auto")],
)
def test_graph_partitioner_cuts_the_unmarked_four_branch_model_into_a_fan_in_dag(
    references, num_devices, schedule, partitioner
):
    """GraphPipe's partition pipelines equal to jax.value_and_grad; "auto" picks it for a DAG
    schedule by name when the model has no markers."""
    loss_fn, params, batch, reference = references["multimodal-4-unmarked"]
    pipe = zbjax.pipeline(
        loss_fn,
        mesh=_mesh(num_devices),
        schedule=schedule,
        num_microbatches=NUM_MICROBATCHES,
        partitioner=partitioner,
    )
    _assert_equal_to_reference(pipe.value_and_grad(params, batch), reference)
    graph = pipe.graph
    fan_in = _fan_in(graph.edge_pairs)
    # Branches run in parallel stages: several sources feed one fan-in stage (the fusion).
    sources = [s.index for s in graph.stages if not s.in_edges]
    assert len(sources) >= 2 and fan_in, graph.edge_pairs
    assert graph.loss_stage in fan_in
    assert sorted(set(pipe.schedule.placement)) == list(range(num_devices))
    assert set(pipe.schedule.edges) == set(graph.edge_pairs)
    assert pipe.partitioner_used == "graph"
    # A stage before the fusion reads the params of one branch only: branches are not mixed.
    paths = [p[0].key for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    for stage in graph.stages:
        if stage.index != graph.loss_stage:
            read = {paths[leaf] for leaf in stage.param_leaves}
            assert len(read) == 1 and read.pop().startswith("branch_"), stage.name


# ----------------------------------------------------------------------------- the diamond

WIDTH = 8


def _diamond_loss(params, batch, *, keep=("b", "c"), shift_c=False):
    """A -> {B, C} -> D. ``keep`` lets gradients into A along those paths only (for the test);
    ``shift_c`` pairs D's B input with the C input of the next example (a wrong fan-in)."""
    a = jnp.tanh(batch["x"] @ params["a"])
    into_b = zbjax.stage_boundary(a if "b" in keep else jax.lax.stop_gradient(a))
    b = jnp.tanh(into_b @ params["b"])
    into_c = zbjax.stage_boundary(a if "c" in keep else jax.lax.stop_gradient(a))
    c = jnp.sin(into_c @ params["c"])
    if shift_c:
        c = jnp.roll(c, 1, axis=0)
    d = jnp.tanh((zbjax.stage_boundary(b) * (1.0 + c)) @ params["d"])
    return jnp.mean((d[:, 0] - batch["y"]) ** 2)


@pytest.fixture(scope="module")
def diamond():
    """Returns (params, batch, the 4-device dag-zb pipe, its (loss, grads))."""
    keys = jax.random.split(jax.random.key(2), 6)
    params = {
        name: jax.random.normal(k, shape) / np.sqrt(WIDTH)
        for name, k, shape in zip(
            "abcd",
            keys[:4],
            [(WIDTH, WIDTH)] * 3 + [(WIDTH, 1)],
            strict=True,
        )
    }
    batch = {
        "x": jax.random.normal(keys[4], (BATCH_SIZE, WIDTH)),
        "y": jax.random.normal(keys[5], (BATCH_SIZE,)),
    }
    pipe = zbjax.pipeline(
        _diamond_loss, mesh=_mesh(4), schedule="dag-zb", num_microbatches=NUM_MICROBATCHES
    )
    return params, batch, pipe, pipe.value_and_grad(params, batch)


def test_diamond_markers_make_a_fan_out_and_a_fan_in(diamond):
    _, _, pipe, _ = diamond
    assert pipe.graph.edge_pairs == ((0, 1), (0, 2), (1, 3), (2, 3))
    assert [s.param_leaves for s in pipe.graph.stages] == [(0,), (1,), (2,), (3,)]


def test_diamond_pipelined_equals_value_and_grad(diamond):
    params, batch, _, pipelined = diamond
    _assert_equal_to_reference(pipelined, jax.value_and_grad(_diamond_loss)(params, batch))


def test_diamond_fan_out_gradient_is_the_sum_over_both_paths(diamond):
    params, batch, _, (_, grads) = diamond
    via_b = jax.grad(lambda p: _diamond_loss(p, batch, keep=("b",)))(params)["a"]
    via_c = jax.grad(lambda p: _diamond_loss(p, batch, keep=("c",)))(params)["a"]
    np.testing.assert_allclose(np.asarray(grads["a"]), via_b + via_c, rtol=1e-5, atol=1e-7)
    # Each path alone is a real part of it, so a pipeline that dropped one would fail above.
    for part in (via_b, via_c):
        assert float(jnp.abs(part).max()) > 1e-3
        assert float(jnp.abs(grads["a"] - part).max()) > 1e-3


def test_diamond_fan_in_pairs_both_inputs_of_the_same_microbatch(diamond):
    params, batch, _, (loss, _) = diamond
    # Mixing up which C input meets which B input, or dropping C, changes the loss clearly.
    shifted = _diamond_loss(params, batch, shift_c=True)
    dropped = _diamond_loss({**params, "c": jnp.zeros_like(params["c"])}, batch)
    for wrong in (shifted, dropped):
        assert abs(float(wrong) - float(loss)) > 1e-3 * abs(float(loss))


def test_diamond_with_several_stages_per_device_uses_the_given_placement(diamond):
    params, batch, _, (loss, grads) = diamond
    pipe = zbjax.pipeline(
        _diamond_loss,
        mesh=_mesh(2),
        schedule="dag-1f1b",
        num_microbatches=NUM_MICROBATCHES,
        placement=(0, 1, 0, 1),
    )
    _assert_equal_to_reference(pipe.value_and_grad(params, batch), (loss, grads))
    assert pipe.schedule.placement == (0, 1, 0, 1)


def test_report_shows_the_stage_graph_edges_branches_and_placement(diamond):
    _, _, pipe, _ = diamond
    report = pipe.report()
    assert "stage graph (markers partition): edges 0->1, 0->2, 1->3, 2->3" in report
    assert "sources (branches start): [0]; fan-in: 3 <- [1, 2]; fan-out: 0 -> [1, 2]" in report
    assert "placement (stage -> device): 0->0, 1->1, 2->2, 3->3" in report


# ----------------------------------------------------------------------------- errors


def test_more_marker_stages_than_devices_without_placement_says_what_to_pass():
    cfg = multimodal.MultiModalConfig(num_branches=4, branch_boundaries=True)
    params = jax.eval_shape(lambda k: multimodal.init_params(k, cfg), jax.random.key(0))
    batch = jax.eval_shape(lambda k: multimodal.make_batch(k, cfg, BATCH_SIZE), jax.random.key(1))
    pipe = zbjax.pipeline(
        multimodal.make_loss_fn(cfg), mesh=_mesh(4), schedule="dag-zb", num_microbatches=2
    )
    with pytest.raises(ScheduleError, match=r"5 stages but axis 'pp' has 4 devices.*placement="):
        pipe.lower(params, batch)


def test_bad_partitioner_options_raise_errors_that_name_the_fix(diamond):
    params, batch, _, _ = diamond
    mesh = _mesh(4)
    with pytest.raises(PipelineError, match="unknown partitioner 'metis'"):
        zbjax.pipeline(_diamond_loss, mesh=mesh, schedule="dag-zb", partitioner="metis")
    with pytest.raises(PipelineError, match="leave num_stages=None"):
        zbjax.pipeline(_diamond_loss, mesh=mesh, partitioner="graph", num_stages=4)
    with pytest.raises(PipelineError, match="only used by the DAG schedules"):
        zbjax.pipeline(_diamond_loss, mesh=mesh, schedule="1f1b", placement=(0, 1, 2, 3))
    marked = zbjax.pipeline(
        _diamond_loss, mesh=mesh, schedule="dag-zb", num_microbatches=2, partitioner="chain"
    )
    with pytest.raises(PipelineError, match="3 stage_boundary markers"):
        marked.lower(params, batch)
    unmarked = zbjax.pipeline(
        lambda p, b: jnp.mean((b["x"] @ p["a"]) ** 2),
        mesh=mesh,
        schedule="dag-zb",
        num_microbatches=2,
        partitioner="markers",
    )
    with pytest.raises(PipelineError, match="no zbjax.stage_boundary markers"):
        unmarked.lower(params, batch)
    misplaced = zbjax.pipeline(
        _diamond_loss,
        mesh=mesh,
        schedule="dag-zb",
        num_microbatches=2,
        placement=(0, 1, 2, 2),
    )
    with pytest.raises(ScheduleError, match=r"placement \(0, 1, 2, 2\) does not put"):
        misplaced.lower(params, batch)
    too_wide = zbjax.pipeline(_diamond_loss, mesh=_mesh(8), schedule="dag-1f1b", num_microbatches=2)
    with pytest.raises(ScheduleError, match="4 stages, fewer than the 8 devices"):
        too_wide.lower(params, batch)
    # GraphPipe cuts a marked model at its markers alone: the fix offered for too few marked
    # stages says to remove them, and partitioner='graph' says why it makes no more stages
    # (it blamed a scan or checkpoint the model does not have; helper HA, session 43).
    with pytest.raises(ScheduleError, match="remove the markers and use partitioner='graph'"):
        too_wide.lower(params, batch)
    graph = zbjax.pipeline(
        _diamond_loss, mesh=_mesh(8), schedule="dag-1f1b", num_microbatches=2, partitioner="graph"
    )
    with pytest.raises(
        ScheduleError,
        match=r"cuts a marked loss_fn only at its markers .* of the pieces its 3 "
        r"stage_boundary markers make, GraphPipe formed 5 stages for the 8 devices",
    ):
        graph.lower(params, batch)


def _scan_stack(params, batch):
    """Eight tanh layers in one lax.scan, then a head: no branches to run side by side."""
    h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), batch["x"], params["stack"])
    return jnp.mean((h @ params["head"] - batch["y"]) ** 2)


def _scan_stack_case():
    rng = np.random.default_rng(3)
    params = {
        "stack": jnp.asarray(rng.normal(size=(8, WIDTH, WIDTH)) * 0.3, jnp.float32),
        "head": jnp.asarray(rng.normal(size=(WIDTH, 1)) * 0.3, jnp.float32),
    }
    batch = {
        "x": jnp.asarray(rng.normal(size=(BATCH_SIZE, WIDTH)), jnp.float32),
        "y": jnp.asarray(rng.normal(size=(BATCH_SIZE, 1)), jnp.float32),
    }
    return params, batch


def test_dag_schedule_of_a_scanned_model_takes_the_chain_cut_that_splits_the_scan():
    """GraphPipe keeps a scan whole: on the scanned stack it found too few stages for 4 devices
    (refused) or one stage holding most of the model. The default partitioner takes the chain
    cut, which splits the scan's iterations, when GraphPipe's plan is that uneven and the
    chain's step is predicted shorter; partitioner='graph' names that fix."""
    params, batch = _scan_stack_case()
    pipe = zbjax.pipeline(_scan_stack, mesh=_mesh(4), schedule="dag-1f1b", num_microbatches=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the trial cut's warnings are not given
        loss, grads = pipe.value_and_grad(params, batch)
    assert pipe.partitioner_used == "chain"
    assert [len(s.param_leaves) for s in pipe.graph.stages] == [1, 1, 1, 2]
    costs = [s.cost for s in pipe.graph.stages]
    assert max(costs) < 0.4 * sum(costs)
    expected = jax.value_and_grad(_scan_stack)(params, batch)
    np.testing.assert_allclose(loss, expected[0], rtol=1e-5)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(expected[1]), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
    for devices in (4, 8):
        graph = zbjax.pipeline(
            _scan_stack,
            mesh=_mesh(devices),
            schedule="dag-1f1b",
            num_microbatches=4,
            partitioner="graph",
        )
        # One stage runs the whole scan: warned, naming the fix; on 8 devices GraphPipe's
        # pieces are too few, which is refused, naming it too.
        with pytest.warns(UserWarning, match="GraphPipe keeps a lax.scan .* 96% .*'chain'"):
            if devices == 4:
                graph.lower(params, batch)
            else:
                with pytest.raises(ScheduleError, match="partitioner='chain' \\(which splits"):
                    graph.lower(params, batch)


def test_graph_partition_warns_of_a_checkpoint_region_holding_most_of_the_model():
    """Two towers inside one jax.checkpoint: GraphPipe (and the chain cut) keep the region
    whole; as for the chain cut, a warning names it, once."""

    def towers(params, batch):
        def both(h):
            a = jnp.tanh(jnp.tanh(h @ params["a1"]) @ params["a2"])
            b = jnp.tanh(jnp.tanh(h @ params["b1"]) @ params["b2"])
            return a + b

        h = jax.checkpoint(both)(batch["x"])
        return jnp.mean((jnp.tanh(h @ params["c"]) @ params["d"] - batch["y"]) ** 2)

    rng = np.random.default_rng(4)
    params = {
        k: jnp.asarray(rng.normal(size=(WIDTH, 1 if k == "d" else WIDTH)) * 0.3, jnp.float32)
        for k in ("a1", "a2", "b1", "b2", "c", "d")
    }
    batch = {
        "x": jnp.asarray(rng.normal(size=(BATCH_SIZE, WIDTH)), jnp.float32),
        "y": jnp.asarray(rng.normal(size=(BATCH_SIZE, 1)), jnp.float32),
    }
    pipe = zbjax.pipeline(towers, mesh=_mesh(4), schedule="dag-1f1b", num_microbatches=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pipe.lower(params, batch)
    texts = [str(w.message) for w in caught]
    assert len(texts) == 1, texts
    assert "keeps a jax.checkpoint (nn.remat) region" in texts[0]
    assert "test_dag_pipeline.py" in texts[0]


# ----------------------------------------------------------------------------- partition(assign=)


def _diamond_avals():
    params = {
        k: jax.ShapeDtypeStruct((WIDTH, 1 if k == "d" else WIDTH), jnp.float32) for k in "abcd"
    }
    batch = {
        "x": jax.ShapeDtypeStruct((2, WIDTH), jnp.float32),
        "y": jax.ShapeDtypeStruct((2,), jnp.float32),
    }
    return params, batch


def test_assign_hook_receives_the_flat_program_and_its_stages_build_the_graph():
    params, batch = _diamond_avals()
    seen = []

    def count_markers(program, num_params):
        # Stage of an equation = markers up to and including it: the marker rule, by hand.
        seen.append(num_params)
        marks = np.cumsum([e.primitive.name == "stage_boundary" for e in program.jaxpr.eqns])
        return [int(k) for k in marks]

    assigned = zbjax.partition(_diamond_loss, params, batch, assign=count_markers)
    marked = zbjax.partition(_diamond_loss, params, batch)
    assert seen == [4]
    assert assigned.edge_pairs == marked.edge_pairs == ((0, 1), (0, 2), (1, 3), (2, 3))
    assert [s.param_leaves for s in assigned.stages] == [s.param_leaves for s in marked.stages]


def test_assign_hook_results_that_are_not_a_topological_stage_numbering_are_refused():
    params, batch = _diamond_avals()

    def assign(make):
        return lambda program, _: make(len(program.jaxpr.eqns))

    cases = [
        (lambda n: [0] * (n - 1), "one stage per equation"),
        (lambda n: [0] * (n - 1) + [2], "no gaps"),
        (lambda n: list(reversed(range(n))), "may only flow to its own or a later stage"),
    ]
    for make, message in cases:
        with pytest.raises(zbjax.PartitionError, match=message):
            zbjax.partition(_diamond_loss, params, batch, assign=assign(make))
