"""F/B/W split: B then W equals the fused backward and jax.vjp, with no recomputed matmul."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import Primitive, jaxpr_as_fun
from jax.sharding import PartitionSpec as P

from zbjax._jax_compat import (
    eval_closed_jaxpr,
    inline_calls,
    scan_counts,
    vmap_independent_scans,
)
from zbjax.cost_model import jaxpr_cost, matmul_flops
from zbjax.errors import PartitionError
from zbjax.split import forwarded_residuals, split, split_stage
from zbjax.stages import Stage, StageGraph

RTOL, ATOL = 1e-5, 1e-6
D, H, S, B = 16, 32, 8, 2  # width, hidden, sequence, batch rows


def _inexact(x):
    return jnp.issubdtype(x.dtype, jnp.inexact)


def make_stage(fn, params, batch, inputs, input_differentiable=None, index=0):
    """Returns a Stage whose jaxpr is ``fn(*params, *batch, *inputs) -> tuple of outputs``."""
    closed = jax.make_jaxpr(fn)(*params, *batch, *inputs)
    if input_differentiable is None:
        input_differentiable = tuple(_inexact(x) for x in inputs)
    return Stage(
        index=index,
        name=fn.__name__,
        jaxpr=closed,
        param_leaves=tuple(range(len(params))),
        batch_leaves=tuple(range(len(batch))),
        in_edges=(0,) if inputs else (),
        out_edges=(),
        input_differentiable=tuple(input_differentiable),
        output_differentiable=tuple(_inexact(a) for a in closed.out_avals),
        cost=jaxpr_cost(closed),
    )


def _normal(key, shape, scale=0.3):
    return scale * jax.random.normal(jax.random.key(key), shape, jnp.float32)


def _close(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype
        np.testing.assert_allclose(g, w, rtol=RTOL, atol=ATOL)


def _run(closed):
    return jaxpr_as_fun(closed)


def run_and_check(fn, params, batch, inputs, input_differentiable=None, seed=None):
    """Checks (a)-(d) of the split contract for one stage; returns its StageProgram."""
    stage = make_stage(fn, params, batch, inputs, input_differentiable)
    program = split_stage(stage)
    args = [*params, *batch, *inputs]
    want_outs = list(fn(*args))
    n_out = len(want_outs)

    # (a) F returns the stage outputs, then the residuals.
    forward = _run(program.forward)(*args)
    _close(forward[:n_out], want_outs)
    residuals = forward[n_out:]
    assert [(r.shape, r.dtype) for r in residuals] == [
        (a.shape, a.dtype) for a in program.residual_avals
    ]

    # (b) B then W equals the fused BW and jax.vjp of the stage function.
    diff_out = [k for k, flag in enumerate(stage.output_differentiable) if flag]
    cts = [
        jnp.asarray(seed, want_outs[k].dtype)
        if seed is not None
        else _normal(100 + k, want_outs[k].shape, 1.0)
        for k in diff_out
    ]
    fused = _run(program.backward)(*residuals, *cts)
    b_outs = _run(program.backward_input)(*residuals, *cts)
    n_in = sum(stage.input_differentiable)
    input_cts, stash = b_outs[:n_in], b_outs[n_in:]
    assert [(s.shape, s.dtype) for s in stash] == [(a.shape, a.dtype) for a in program.stash_avals]
    param_cts = _run(program.backward_weight)(*stash)
    assert len(param_cts) == len(params)
    _close(list(input_cts) + list(param_cts), fused)

    diff_params = [k for k, p in enumerate(params) if _inexact(p)]
    diff_inputs = [k for k, flag in enumerate(stage.input_differentiable) if flag]

    def reference(dp, di):
        full_params, full_inputs = list(params), list(inputs)
        for k, v in zip(diff_params, dp, strict=True):
            full_params[k] = v
        for k, v in zip(diff_inputs, di, strict=True):
            full_inputs[k] = v
        outs = fn(*full_params, *batch, *full_inputs)
        return [outs[k] for k in diff_out]

    _, vjp = jax.vjp(reference, [params[k] for k in diff_params], [inputs[k] for k in diff_inputs])
    ref_params, ref_inputs = vjp(cts)
    _close(input_cts, ref_inputs)
    _close([param_cts[k] for k in diff_params], ref_params)
    for k, p in enumerate(params):
        if k not in diff_params:
            np.testing.assert_array_equal(param_cts[k], jnp.zeros_like(p))

    # (c) No recomputation: B and W split BW's matmuls, F does the stage's forward matmuls.
    assert program.flops_backward_input + program.flops_backward_weight == program.flops_backward
    assert matmul_flops(program.backward_input) + matmul_flops(program.backward_weight) == (
        matmul_flops(program.backward)
    )
    assert program.flops_forward == matmul_flops(stage.jaxpr)

    # (d) W reads nothing but the stash (its inputs are exactly the stash B returns).
    assert len(program.backward_weight.jaxpr.invars) == len(program.stash_avals)
    assert len(program.backward_input.jaxpr.outvars) == n_in + len(program.stash_avals)
    return program


# ---------------------------------------------------------------------------------------------
# Stage functions
# ---------------------------------------------------------------------------------------------


def mlp(w1, b1, w2, x):
    return (jnp.tanh(x @ w1 + b1) @ w2,)


def _mlp_args():
    return [_normal(1, (D, H)), _normal(2, (H,)), _normal(3, (H, D))], [_normal(4, (4, D))]


def _layer_norm(x, scale, bias):
    mean = jnp.mean(x, -1, keepdims=True)
    var = jnp.mean((x - mean) ** 2, -1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + 1e-5) * scale + bias


def block(scale, bias, wq, wk, wv, wo, w1, w2, x):
    h = _layer_norm(x, scale, bias)
    q = jnp.einsum("bsd,de->bse", h, wq)
    k = jnp.einsum("bsd,de->bse", h, wk)
    v = jnp.einsum("bsd,de->bse", h, wv)
    logits = jnp.einsum("bqe,bke->bqk", q, k) / jnp.sqrt(D)
    mask = jnp.tril(jnp.ones((S, S), bool))
    attn = jax.nn.softmax(jnp.where(mask, logits, -1e9), axis=-1)
    x = x + jnp.einsum("bqk,bke,ed->bqd", attn, v, wo)
    h = _layer_norm(x, scale, bias)
    return (x + jax.nn.gelu(h @ w1) @ w2,)


def _block_args():
    params = [1.0 + _normal(10, (D,)), _normal(11, (D,))]
    params += [_normal(12 + i, (D, D)) for i in range(4)]
    params += [_normal(16, (D, H)), _normal(17, (H, D))]
    return params, [_normal(18, (B, S, D))]


def embed(table, pos, tokens):
    # First stage: no incoming activation; the int tokens also pass through to the next stage.
    return (table[tokens] + pos, tokens)


def scanned_layers(ws, bs, x):
    def layer(h, wb):
        w, b = wb
        return jnp.tanh(h @ w + b), None

    return (jax.lax.scan(layer, x, (ws, bs))[0],)


def loss_head(w, labels, h):
    logits = h @ w
    logp = jax.nn.log_softmax(logits)
    return (-jnp.mean(jnp.take_along_axis(logp, labels[:, None], axis=1)),)


# ---------------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------------


def test_mlp_stage_b_then_w_equals_vjp_and_splits_matmuls_evenly():
    params, inputs = _mlp_args()
    program = run_and_check(mlp, params, [], inputs)
    # B does dx for both layers and W does dW for both: one forward's worth of matmuls each.
    assert program.flops_backward_input == program.flops_forward
    assert program.flops_backward_weight == program.flops_forward
    assert program.flops_forward == 2 * 4 * D * H * 2
    # W needs the matmul inputs and the cotangents entering each matmul.
    assert program.stash_bytes == sum(
        jnp.zeros(a.shape, a.dtype).nbytes for a in program.stash_avals
    )
    assert program.cost_backward_weight > 0 and program.cost_backward_input > 0


def test_bias_gradient_is_summed_in_b_and_w_keeps_only_the_matmuls():
    # b1's gradient is a sum over the batch of the cotangent B has just computed: B sums it
    # while the value is in cache and stashes the small result, so W reads the cotangent once,
    # for its matmul only.
    params, _ = _mlp_args()
    program = run_and_check(mlp, params, [], [_normal(4, (64, D))])
    w_kinds = {e.primitive.name for e in program.backward_weight.jaxpr.eqns}
    assert "reduce_sum" not in w_kinds and "dot_general" in w_kinds
    assert any(e.primitive.name == "reduce_sum" for e in program.backward_input.jaxpr.eqns)
    assert (H,) in [a.shape for a in program.stash_avals]


def test_a_sum_over_a_value_w_also_multiplies_stays_in_w():
    # Without an input cotangent, B computes nothing; the bias gradient's operand (the
    # cotangent through tanh) is also W's matmul operand, so moving the sum to B would compute
    # that product twice: the sum stays in W, and B stays empty.
    def dense_tanh(w, b, x):
        return (jnp.tanh(x @ w + b),)

    params = [_normal(90, (D, H)), _normal(91, (H,))]
    program = run_and_check(dense_tanh, params, [], [_normal(92, (64, D))], [False])
    assert not program.backward_input.jaxpr.eqns
    w_kinds = {e.primitive.name for e in program.backward_weight.jaxpr.eqns}
    assert {"reduce_sum", "dot_general", "mul"} <= w_kinds


def test_transformer_block_with_layer_norm_softmax_and_einsum():
    params, inputs = _block_args()
    program = run_and_check(block, params, [], inputs)
    # Every projection's weight gradient is W work, not B work.
    assert program.flops_backward_weight >= 2 * B * S * (4 * D * D + 2 * D * H)
    # JAX contracts a projection's weight gradient over (batch, seq) at once; the split merges
    # the two into one dimension, so XLA need not transpose the cotangent first. Only dots
    # whose contracting dimensions are not adjacent in an operand keep several.
    for closed in (program.forward, program.backward, program.backward_weight):
        for eqn in closed.jaxpr.eqns:
            if eqn.primitive.name == "dot_general":
                (lhs, rhs), _ = eqn.params["dimension_numbers"]
                pairs = sorted(zip(lhs, rhs, strict=True))
                adjacent = all(b == a + 1 for a, b in itertools.pairwise(sorted(lhs))) and all(
                    p[1] + 1 == q[1] for p, q in itertools.pairwise(pairs)
                )
                assert len(lhs) == 1 or not adjacent, eqn
    weight_dots = [
        e for e in program.backward_weight.jaxpr.eqns if e.primitive.name == "dot_general"
    ]
    assert len(weight_dots) >= 6  # wq, wk, wv, wo, w1, w2


def test_first_stage_embedding_lookup_has_no_input_cotangent_and_all_backward_is_w():
    table, pos = _normal(20, (50, D)), _normal(21, (S, D))
    tokens = jax.random.randint(jax.random.key(22), (B, S), 0, 50)
    program = run_and_check(embed, [table, pos], [tokens], [])
    assert program.stage.output_differentiable == (True, False)
    assert len(program.backward_input.jaxpr.outvars) == len(program.stash_avals)
    assert not program.backward_input.jaxpr.eqns  # nothing to compute before W


def test_scan_over_stacked_weights_splits_the_backward_scan():
    ws, bs = _normal(30, (3, D, D)), _normal(31, (3, D))
    program = run_and_check(scanned_layers, [ws, bs], [], [_normal(32, (4, D))])
    # B keeps the reverse scan; W has no carry, so its per-layer work is one batched
    # computation over the stacked stash (vmapped), not a loop.
    assert any(e.primitive.name == "scan" for e in program.backward_input.jaxpr.eqns)
    w_eqns = program.backward_weight.jaxpr.eqns
    assert not [e for e in w_eqns if e.primitive.name == "scan"]
    batched = [
        e
        for e in w_eqns
        if e.primitive.name == "dot_general" and e.params["dimension_numbers"][1][0]
    ]
    assert batched, "W's weight gradients should be dots batched over the layers"
    assert program.flops_backward_weight == program.flops_forward
    assert program.flops_backward_input == program.flops_forward
    # A stage's 3 layers are few: its programs run their scans unrolled, not as loops.
    for closed in (program.forward, program.backward, program.backward_input):
        scans = [e for e in closed.jaxpr.eqns if e.primitive.name == "scan"]
        assert scans and all(e.params["unroll"] == e.params["length"] == 3 for e in scans)
    looped = split_stage(program.stage, unroll_scans=0)
    scans = [e for e in looped.backward.jaxpr.eqns if e.primitive.name == "scan"]
    assert scans and all(e.params["unroll"] == 1 for e in scans)


def test_bias_sums_inside_a_split_scan_run_in_the_b_scan():
    # The per-layer bias gradient (a sum over rows of the cotangent the B scan computes) runs
    # in the B scan's body and comes out stacked; W keeps only the weight-gradient matmuls.
    ws, bs = _normal(33, (3, D, D)), _normal(34, (3, D))
    program = run_and_check(scanned_layers, [ws, bs], [], [_normal(35, (64, D))])
    assert not [e for e in program.backward_weight.jaxpr.eqns if e.primitive.name == "reduce_sum"]
    (b_scan,) = [e for e in program.backward_input.jaxpr.eqns if e.primitive.name == "scan"]
    body = b_scan.params["jaxpr"].jaxpr.eqns
    assert any(e.primitive.name == "reduce_sum" for e in body)
    assert (3, D) in [a.shape for a in program.stash_avals]  # the stacked bias gradients


def test_a_w_scan_whose_body_has_no_batching_rule_stays_a_scan():
    # vmap_independent_scans batches a carry-less scan only when every primitive in its body
    # can be batched; otherwise the scan is kept as it is.
    no_rule = Primitive("zbjax_test_no_batching_rule")
    no_rule.def_impl(lambda x: 2.0 * x)
    no_rule.def_abstract_eval(lambda x: x)

    def scans(xs, ys):
        def body(_, x):
            return None, (no_rule.bind(x[0]), x[1] * 3.0)

        return jax.lax.scan(body, None, (xs, ys))[1]

    def plain(xs, ys):
        return jax.lax.scan(lambda _, x: (None, x[0] * x[1]), None, (xs, ys))[1]

    args = (jnp.ones((3, 2)), jnp.ones((3, 2)))
    kept = vmap_independent_scans(jax.make_jaxpr(scans)(*args))
    assert [e.primitive.name for e in kept.jaxpr.eqns] == ["scan"]
    batched = vmap_independent_scans(jax.make_jaxpr(plain)(*args))
    assert "scan" not in [e.primitive.name for e in batched.jaxpr.eqns]
    _close(jaxpr_as_fun(batched)(*args), [plain(*args)])


def test_loss_stage_with_seed_cotangent_and_int_labels_from_the_batch():
    labels = jax.random.randint(jax.random.key(40), (4,), 0, 10)
    program = run_and_check(
        loss_head, [_normal(41, (D, 10))], [labels], [_normal(42, (4, D))], seed=0.25
    )
    assert program.stage.jaxpr.out_avals[0].shape == ()


def test_stage_without_params_has_an_empty_w_and_passes_an_input_through():
    def no_params(x, y):
        return (jnp.sin(x) * y, x)

    program = run_and_check(no_params, [], [], [_normal(50, (4, D)), _normal(51, (4, D))])
    assert not program.backward_weight.jaxpr.outvars
    assert program.stash_avals == ()
    assert program.flops_backward_weight == 0


def test_param_read_twice_residual_of_params_only_constant_outputs_and_int_param():
    def tricky(w, n, x):
        gram = w @ w.T  # a residual that depends on parameters only
        y = x @ gram + x @ w * n.astype(jnp.float32)
        return (y, jnp.ones(3), jnp.float32(2.0), x)

    w, n = _normal(60, (D, D)), jnp.array(3, jnp.int32)
    program = run_and_check(tricky, [w, n], [], [_normal(61, (4, D))])
    assert program.backward_weight.out_avals[1].dtype == jnp.int32


def test_jitted_and_checkpointed_layers_are_inlined_so_w_gets_their_weight_gradients():
    @jax.jit
    def dense(w, x):
        return jnp.tanh(x @ w)

    def layers(w1, w2, x):
        return (jax.checkpoint(dense)(w2, dense(w1, x)),)

    program = run_and_check(
        layers, [_normal(70, (D, D)), _normal(71, (D, D))], [], [_normal(72, (4, D))]
    )
    # The forward of the checkpointed layer is recomputed inside BW (the user asked for remat),
    # but both weight gradients still land in W.
    assert program.flops_backward_weight == 2 * (2 * 4 * D * D)


def test_input_not_flagged_differentiable_gets_no_cotangent():
    params, inputs = _mlp_args()
    program = run_and_check(mlp, params, [], inputs, input_differentiable=(False,))
    assert len(program.backward_input.jaxpr.outvars) == len(program.stash_avals)
    # Without dx, BW computes the cotangent entering the second layer's matmul and both weight
    # gradients; the first layer's dx is never computed.
    assert program.flops_backward == 3 * 2 * 4 * D * H


def test_residuals_are_deduplicated_and_read_by_the_backward():
    params, inputs = _mlp_args()
    program = split_stage(make_stage(mlp, params, [], inputs))
    n_out = len(program.stage.jaxpr.out_avals)
    outvars = program.forward.jaxpr.outvars[n_out:]
    assert len(set(outvars)) == len(outvars)
    read = {v for e in program.backward.jaxpr.eqns for v in e.invars}
    assert all(v in read for v in program.backward.jaxpr.invars[: len(outvars)])
    # x, w1 and w2 are residuals that merely forward a stage input.
    assert sorted(i for i in forwarded_residuals(program) if i is not None) == [0, 2, 3]


def test_parameter_casts_and_slices_are_recomputed_in_the_backward_not_stored():
    def layers(ws, x):
        # Mixed precision on stacked weights: each layer's weight is a slice of the stack,
        # cast to bfloat16, both computed from the parameter alone.
        for k in range(2):
            x = jnp.tanh(x.astype(jnp.bfloat16) @ ws[k].astype(jnp.bfloat16))
        return (x.astype(jnp.float32),)

    ws, x = _normal(80, (2, D, D)), _normal(81, (4, D))
    stage = make_stage(layers, [ws], [], [x])
    program = split_stage(stage)
    # F stores no copy of a weight: the only residual of a weight's shape is the stack itself,
    # which merely forwards the parameter, and B and W cast their slices again.
    n_out = len(stage.jaxpr.out_avals)
    residuals = program.forward.jaxpr.outvars[n_out:]
    pairs = list(zip(residuals, forwarded_residuals(program), strict=True))
    assert [v.aval.shape for v, f in pairs if f == 0] == [ws.shape]
    stored = [v.aval for v, f in pairs if f is None]
    assert stored and all(a.shape[-2:] != (D, D) for a in stored)
    assert program.activation_bytes == sum(a.size * a.dtype.itemsize for a in stored)
    casts = [e for e in program.backward.jaxpr.eqns if e.primitive.name == "convert_element_type"]
    assert any(e.invars[0].aval.shape == (D, D) for e in casts)
    # Values and gradients are still those of jax.vjp (with bfloat16's precision).
    _check_against_vjp(program, layers, ws, x, _normal(82, (4, D), 1.0), 2e-2)


def _check_against_vjp(program, layers, ws, x, ct, tol):
    """Checks the fused and the split backward of a one-output stage ``layers(ws, x)``."""
    n_out = len(program.stage.jaxpr.out_avals)
    forward = _run(program.forward)(ws, x)
    fused = _run(program.backward)(*forward[n_out:], ct)
    b_outs = _run(program.backward_input)(*forward[n_out:], ct)
    split_outs = [b_outs[0], *_run(program.backward_weight)(*b_outs[1:])]
    _, vjp = jax.vjp(lambda w, v: layers(w, v)[0], ws, x)
    want_dws, want_dx = vjp(ct)
    for got in (fused, split_outs):
        np.testing.assert_allclose(got[0], want_dx, rtol=tol, atol=tol)
        np.testing.assert_allclose(got[1], want_dws, rtol=tol, atol=tol)


def _masked_attention(w, x):
    # A causal mask from iotas (jnp.tril of ones), broadcast over the batch by jnp.where:
    # the where's backward reads the broadcast mask.
    scores = jnp.einsum("bqd,bkd->bqk", x @ w, x)
    causal = jnp.tril(jnp.ones((D, D), dtype=bool))
    return jax.nn.softmax(jnp.where(causal, scores, -1e9), axis=-1) @ x


def _two_masked_layers_loop(ws, x):
    for k in range(2):
        x = _masked_attention(ws[k], x)
    return (x,)


def _two_masked_layers_scan(ws, x):
    # jax.vjp hoists the body's mask out of the scan, as a call F computes it in.
    return (jax.lax.scan(lambda x, w: (_masked_attention(w, x), None), x, ws)[0],)


@pytest.mark.parametrize(
    "layers, masks", [(_two_masked_layers_loop, 2), (_two_masked_layers_scan, 1)]
)
def test_a_mask_computed_from_no_input_is_recomputed_in_the_backward_not_stored(layers, masks):
    ws, x = _normal(90, (2, D, D)), _normal(91, (2, D, D))
    stage = make_stage(layers, [ws], [], [x])
    # Flat, as the partitioner makes every stage (jnp.tril and jnp.where are jit calls).
    stage = Stage(**{**stage.__dict__, "jaxpr": inline_calls(stage.jaxpr)})
    n_out = len(stage.jaxpr.out_avals)

    def stored_masks(program):
        residuals = program.forward.jaxpr.outvars[n_out:]
        return [v.aval.shape for v in residuals if v.aval.dtype == jnp.bool_]

    # Stored per microbatch when asked to, which is what jax.vjp leaves; computed again in the
    # backward otherwise, from iotas, with less stored.
    storing = split_stage(stage, recompute_constants=False)
    assert stored_masks(storing) == [(2, D, D)] * masks
    program = split_stage(stage)
    assert stored_masks(program) == []
    assert program.activation_bytes == storing.activation_bytes - masks * 2 * D * D
    assert any(e.primitive.name == "iota" for e in program.backward.jaxpr.eqns)
    assert matmul_flops(program.backward) == matmul_flops(storing.backward)
    _check_against_vjp(program, layers, ws, x, _normal(92, (2, D, D), 1.0), 1e-5)


def test_split_graph_returns_one_program_per_stage_in_order():
    params, inputs = _mlp_args()
    stages = (
        make_stage(mlp, params, [], inputs, index=0),
        make_stage(mlp, params, [], inputs, index=1),
    )
    graph = StageGraph(stages, (), 1, None, None, (), ())
    programs = split(graph)
    assert [p.stage.index for p in programs] == [0, 1]
    assert programs[0].flops_backward == programs[1].flops_backward


def test_flag_on_an_integer_input_is_a_partition_error():
    tokens = jnp.zeros((4,), jnp.int32)
    stage = make_stage(lambda t: (t.astype(jnp.float32),), [], [], [tokens])
    bad = Stage(**{**stage.__dict__, "input_differentiable": (True,)})
    with pytest.raises(PartitionError, match="int32"):
        split_stage(bad)


def branchy(w1, w2, x):
    y = jax.lax.cond(jnp.sum(x) > 0, lambda: jnp.tanh(x @ w1), lambda: jnp.sin(x @ w2) @ w1)
    z = jax.lax.fori_loop(0, 3, lambda i, h: jnp.tanh(h @ w2), y)
    count = lambda c: (c[0] + 1, c[1] * 2.0)  # noqa: E731
    n = jax.lax.while_loop(lambda c: c[0] < 3, count, (0, jnp.float32(1.0)))[1]
    return (z * n,)


def test_cond_fori_and_while_stage_splits_correctly():
    # The shard_map test below runs the other branch of the cond.
    program = run_and_check(
        branchy, [_normal(86, (D, D)), _normal(87, (D, D))], [], [_normal(88, (4, D))]
    )
    # A backward cond computing both kinds of cotangent goes to B whole (not split).
    assert any(e.primitive.name == "cond" for e in program.backward_input.jaxpr.eqns)


@pytest.mark.parametrize("stage_fn", [scanned_layers, branchy])
def test_stage_programs_run_inside_shard_map_with_eval_closed_jaxpr(stage_fn):
    # Inside shard_map, values vary over the pipeline axis; a loop or branch body typed at
    # trace time does not, which jaxpr_as_fun cannot reconcile but eval_closed_jaxpr can.
    params = [_normal(80, (D, D)), _normal(81, (D, D))]
    if stage_fn is scanned_layers:
        params = [_normal(80, (3, D, D)), _normal(81, (3, D))]
    xs = jnp.stack([_normal(82, (4, D)), -_normal(83, (4, D))])
    program = split_stage(make_stage(stage_fn, params, [], [xs[0]]))

    def step(p0, p1, x, ct):
        outs = eval_closed_jaxpr(program.forward, p0, p1, x)
        b_outs = eval_closed_jaxpr(program.backward_input, *outs[1:], ct)
        w_outs = eval_closed_jaxpr(program.backward_weight, *b_outs[1:])
        return [outs[0], b_outs[0], *w_outs]

    cts = jnp.stack([_normal(84, (4, D), 1.0), _normal(85, (4, D), 1.0)])
    mesh = jax.make_mesh(
        (2,), ("pp",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:2]
    )
    per_device = jax.shard_map(
        lambda p0, p1, x, ct: [o[None] for o in step(p0, p1, x[0], ct[0])],
        mesh=mesh,
        in_specs=(P(), P(), P("pp"), P("pp")),
        out_specs=P("pp"),
    )
    got = jax.jit(per_device)(*params, xs, cts)
    for d in range(2):
        _close([g[d] for g in got], step(*params, xs[d], cts[d]))


def test_reverse_scan_with_a_shared_weight_accumulates_its_gradient_in_the_w_scan_carry():
    def shared_and_stacked(w, ws, x):
        def layer(carry, wi):
            h, total = carry
            h = jnp.tanh(h @ w + h @ wi)
            return (h, total + jnp.sum(h)), 2.0 * h

        (h, total), ys = jax.lax.scan(layer, (x, jnp.float32(0.0)), ws, reverse=True)
        return (h, total, ys)

    params = [_normal(90, (D, D)), _normal(91, (3, D, D))]
    program = run_and_check(shared_and_stacked, params, [], [_normal(92, (4, D))])
    (w_scan,) = [e for e in program.backward_weight.jaxpr.eqns if e.primitive.name == "scan"]
    assert scan_counts(w_scan.params)[1] == 1  # the shared weight's running cotangent
    assert program.flops_backward_input == program.flops_forward


def test_stages_with_nothing_to_differentiate_have_empty_b_and_zero_w():
    def ints_only(tokens):
        return (tokens * 2,)

    program = run_and_check(ints_only, [], [jnp.arange(4)], [])
    assert not program.backward_input.jaxpr.outvars and program.residual_avals == ()

    def argmax_only(w, x):
        return (jnp.argmax(x @ w, -1),)

    program = run_and_check(argmax_only, [_normal(95, (D, D))], [], [_normal(96, (4, D))])
    assert program.residual_avals == () and program.flops_backward == 0


def _through_f_bw_b_w(program, args, cts):
    """Runs F, then BW and B-then-W from F's residuals: (outputs, BW's, B's input cts, W's)."""
    num_out = len(program.stage.jaxpr.out_avals)
    outs = jaxpr_as_fun(program.forward)(*args)
    residuals = outs[num_out:]
    fused = jaxpr_as_fun(program.backward)(*residuals, *cts)
    b = jaxpr_as_fun(program.backward_input)(*residuals, *cts)
    num_in_cts = sum(program.stage.input_differentiable)
    w = jaxpr_as_fun(program.backward_weight)(*b[num_in_cts:])
    return outs[:num_out], fused, b[:num_in_cts], w


def test_alike_stages_are_split_once_and_take_their_params_in_their_own_order():
    from models import gpt
    from zbjax.partition import partition
    from zbjax.split import alike

    # Blocks 4-7 and 8-11 of a 16-block GPT are one program, but the second stage holds its
    # params in leaf order: block_10, block_11, block_8, block_9.
    cfg = gpt.GPTConfig(
        vocab_size=16, seq_len=8, d_model=16, num_heads=2, num_layers=16,
        stage_boundaries=(3, 7, 11),
    )  # fmt: skip
    params = jax.eval_shape(lambda k: gpt.init_params(k, cfg), jax.random.key(0))  # shapes do
    batch = jax.eval_shape(lambda k: gpt.make_batch(k, cfg, 2), jax.random.key(1))
    graph = partition(gpt.make_loss_fn(cfg), params, batch)
    stages = graph.stages
    assert len(stages) == 4
    assert alike(stages[1], stages[2]) and not alike(stages[0], stages[1])
    assert not alike(stages[1], stages[3])
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(params)]
    first_leaf = [paths[s.param_leaves[0]] for s in stages[1:3]]
    assert "block_4" in first_leaf[0] and "block_10" in first_leaf[1]

    programs = split(graph)
    assert [p.stage for p in programs] == list(stages)
    shared = programs[2]
    assert shared.forward.jaxpr.eqns[0] is programs[1].forward.jaxpr.eqns[0]
    assert shared.backward_weight.jaxpr.eqns[0] is programs[1].backward_weight.jaxpr.eqns[0]
    assert programs[3].forward.jaxpr.eqns[0] is not programs[1].forward.jaxpr.eqns[0]

    # The shared programs compute what stage 2's own split computes, params in its order.
    own = split_stage(stages[2])
    keys = iter(jax.random.split(jax.random.key(2), 64))
    args = [jax.random.normal(next(keys), a.shape, a.dtype) for a in stages[2].jaxpr.in_avals]
    cts = [jax.random.normal(next(keys), a.shape, a.dtype) for a in stages[2].jaxpr.out_avals]
    run = jax.jit(_through_f_bw_b_w, static_argnums=0)
    got, want = run(shared, args, cts), run(own, args, cts)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, w, rtol=RTOL, atol=ATOL)
