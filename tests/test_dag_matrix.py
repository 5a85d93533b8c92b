"""The full graph-pipeline grid: 4 branch models x {4, 8} devices x {dag-1f1b, dag-zb}.

Every configuration makes one stage per device with a fan-in (checked below).
"""

import functools

import jax
import numpy as np
import pytest

import zbjax
from models import dlrm, multimodal, two_tower

MM = multimodal.MultiModalConfig
# (model, devices) -> (module, config, partitioner): markers where the model's options give
# one stage per device, else GraphPipe on the unmarked model.
CASES = {
    ("multimodal-2", 4): (
        multimodal,
        MM(
            num_branches=2,
            layers_per_branch=2,
            branch_boundaries=True,
            layers_per_stage=1,
            head_stage=False,
        ),
        "markers",
    ),
    ("multimodal-2", 8): (
        multimodal,
        MM(
            num_branches=2,
            layers_per_branch=4,
            branch_boundaries=True,
            layers_per_stage=1,
            head_stage=False,
        ),
        "markers",
    ),
    ("multimodal-4", 4): (multimodal, MM(num_branches=4), "graph"),
    ("multimodal-4", 8): (
        multimodal,
        MM(
            num_branches=4,
            layers_per_branch=2,
            branch_boundaries=True,
            layers_per_stage=1,
            head_stage=False,
        ),
        "markers",
    ),
    ("two-tower", 4): (
        two_tower,
        two_tower.TwoTowerConfig(branch_boundaries=True, layers_per_stage=2),
        "markers",
    ),
    ("two-tower", 8): (
        two_tower,
        two_tower.TwoTowerConfig(
            user_depth=2, item_depth=5, branch_boundaries=True, layers_per_stage=1
        ),
        "markers",
    ),
    ("dlrm", 4): (
        dlrm,
        dlrm.DLRMConfig(bottom_depth=1, num_tables=2, branch_boundaries=True, layers_per_stage=1),
        "markers",
    ),
    ("dlrm", 8): (
        dlrm,
        dlrm.DLRMConfig(bottom_depth=4, branch_boundaries=True, layers_per_stage=1),
        "markers",
    ),
}


@functools.cache
def setup(model, devices):
    module, cfg, partitioner = CASES[(model, devices)]
    loss_fn = module.make_loss_fn(cfg)
    params = module.init_params(jax.random.key(0), cfg)
    batch = module.make_batch(jax.random.key(1), cfg, 8)
    return loss_fn, params, batch, partitioner, jax.jit(jax.value_and_grad(loss_fn))(params, batch)


@pytest.mark.parametrize("schedule", ["dag-1f1b", "dag-zb"])
@pytest.mark.parametrize("model, devices", list(CASES), ids=[f"{m}-{d}" for m, d in CASES])
def test_branch_model_on_a_stage_dag_equals_value_and_grad(model, devices, schedule):
    loss_fn, params, batch, partitioner, (ref_loss, ref_grads) = setup(model, devices)
    mesh = jax.make_mesh((devices,), ("pp",), devices=jax.devices()[:devices])
    pipe = zbjax.pipeline(
        loss_fn, mesh=mesh, schedule=schedule, num_microbatches=4, partitioner=partitioner
    )
    loss, grads = pipe.value_and_grad(params, batch)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-7)
    preds = {}
    for a, b in pipe.graph.edge_pairs:
        preds.setdefault(b, set()).add(a)
    assert any(len(p) > 1 for p in preds.values()), pipe.graph.edge_pairs  # a real fan-in
    assert pipe.schedule.num_devices == devices
