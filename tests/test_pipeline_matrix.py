"""The full acceptance grid: every schedule x every reference model x p in {2, 4} x m in {p, 2p}.

112 compiled pipelines, about 5 minutes of the suite on 2 cores; test_pipeline.py covers
p = 8, data parallelism, keys, layouts, memory and errors.
"""

import functools

import jax
import numpy as np
import pytest

import zbjax
from models import gpt, gpt_nnx, gpt_scan, mlp

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zb-v", "zb-auto")
MODELS = ("mlp", "gpt", "gpt_nnx", "gpt_scan")
SHAPES = ((2, 2), (2, 4), (4, 4), (4, 8))
TWO_STAGES_PER_DEVICE = ("interleaved-1f1b", "zb-v")
GPT_SIZES = dict(vocab_size=32, seq_len=8, d_model=16, num_heads=2)


@functools.cache
def setup(model, num_stages):
    """Returns (loss_fn, params, batch, jax.value_and_grad(loss_fn)(params, batch))."""
    if model == "mlp":
        cfg = mlp.MLPConfig(in_dim=8, width=16, depth=max(4, num_stages), out_dim=4)
        module = mlp
    else:
        module = {"gpt": gpt, "gpt_nnx": gpt_nnx, "gpt_scan": gpt_scan}[model]
        # One block per stage; the embedding and tied head share the end stages.
        cfg = module.GPTConfig(num_layers=num_stages, **GPT_SIZES)
    params = module.init_params(jax.random.key(0), cfg)
    make_batch = mlp.make_batch if module is mlp else gpt.make_batch
    batch = make_batch(jax.random.key(1), cfg, 16)
    loss_fn = module.make_loss_fn(cfg)
    return loss_fn, params, batch, jax.jit(jax.value_and_grad(loss_fn))(params, batch)


@pytest.mark.parametrize("p, m", SHAPES, ids=[f"p{p}-m{m}" for p, m in SHAPES])
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("name", SCHEDULES)
def test_pipelined_equals_value_and_grad(name, model, p, m):
    stages = 2 * p if name in TWO_STAGES_PER_DEVICE else p
    loss_fn, params, batch, (ref_loss, ref_grads) = setup(model, stages)
    mesh = jax.make_mesh((p,), ("pp",), devices=jax.devices()[:p])
    pipe = zbjax.pipeline(loss_fn, mesh=mesh, schedule=name, num_microbatches=m, num_stages=stages)
    loss, grads = pipe.value_and_grad(params, batch)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    assert jax.tree.structure(grads) == jax.tree.structure(ref_grads)
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6)
