"""Microbatches: splitting a batch, per-microbatch PRNG keys, and the unpipelined reference.

The public contract for randomness (dropout): a pipelined step given ``key`` runs microbatch
``i`` with ``jax.random.fold_in(key, i)``. ``reference_value_and_grad`` computes exactly what a
pipelined run must return: the mean over microbatches of ``jax.value_and_grad(loss_fn)``. For a
loss that is a mean over its batch and uses no key, that equals the full-batch value and grad.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from zbjax._jax_compat import CUSTOM_VJP_PRIMITIVES, holds_primitive
from zbjax.errors import PipelineError
from zbjax.params import wide_dtype
from zbjax.schedules.ir import count


def split_microbatches(batch: Any, num_microbatches: int) -> Any:
    """Returns ``batch`` with every leaf reshaped to ``[num_microbatches, B // m, ...]``.

    Microbatch ``i`` is the contiguous block of rows ``i * B/m : (i + 1) * B/m`` of every leaf.
    Raises ``PipelineError`` naming the leaf when its leading axis is missing or not divisible.
    """
    num_microbatches = count("num_microbatches", num_microbatches, PipelineError)
    leaves_with_paths, treedef = jax.tree_util.tree_flatten_with_path(batch)
    out = []
    for path, leaf in leaves_with_paths:
        name = jax.tree_util.keystr(path) or "<batch>"
        if isinstance(leaf, str | bytes):
            raise PipelineError(
                f"batch leaf {name} is a {type(leaf).__name__} ({leaf!r:.40}), not an array; "
                "take it out of the batch (close over it in loss_fn), or make it an array"
            )
        shape = tuple(jnp.shape(leaf))
        if not shape:
            raise PipelineError(
                f"batch leaf {name} is a scalar (shape ()), so it cannot be split into "
                f"{num_microbatches} microbatches; give every batch leaf a leading batch axis, "
                "or pass per-step constants through params or a closure instead"
            )
        if shape[0] % num_microbatches:
            raise PipelineError(
                f"batch leaf {name} has shape {shape}: its leading axis {shape[0]} is not "
                f"divisible by num_microbatches={num_microbatches}; use a batch size that is a "
                f"multiple of {num_microbatches} or a num_microbatches that divides {shape[0]}"
            )
        out.append(_split_rows(leaf, (num_microbatches, shape[0] // num_microbatches) + shape[1:]))
    return jax.tree_util.tree_unflatten(treedef, out)


def _split_rows(leaf: Any, shape: tuple[int, ...]) -> Any:
    """Returns ``leaf`` reshaped to ``shape`` = ``[m, rows, ...]``. A leaf whose type names
    explicit mesh axes (a batch put on a ``jax.make_mesh`` mesh with ``P("dp")``) keeps them on
    its rows, or drops them first where a microbatch's rows do not divide over them: JAX does
    not choose the sharding of such a reshape itself."""
    sharding = getattr(jax.typeof(leaf), "sharding", None)
    spec = tuple(getattr(sharding, "spec", ()))
    if not any(entry is not None for entry in spec):
        return jnp.reshape(leaf, shape)
    mesh = sharding.mesh
    spec += (None,) * (len(shape) - 1 - len(spec))
    rows, rest = spec[0], spec[1:]
    names = () if rows is None else (rows,) if isinstance(rows, str) else tuple(rows)
    if shape[1] % math.prod(mesh.shape[name] for name in names):
        leaf = jax.sharding.reshard(leaf, NamedSharding(mesh, PartitionSpec(None, *rest)))
        rows = None
    return jax.lax.reshape(
        leaf, shape, out_sharding=NamedSharding(mesh, PartitionSpec(None, rows, *rest))
    )


@functools.cache
def _raw_key_aval() -> jax.ShapeDtypeStruct:
    """The aval of ``jax.random.PRNGKey(0)`` for the default PRNG implementation (traced once:
    the key is checked on every call)."""
    return jax.eval_shape(jax.random.PRNGKey, 0)


def check_key(aval: Any) -> None:
    """Raises PipelineError unless ``aval`` is one PRNG key: a typed key of shape () or a raw
    uint32 key of the default implementation's shape (``jax.random.PRNGKey``)."""
    if not isinstance(aval, jax.ShapeDtypeStruct):  # a pytree of keys
        ok = False
    elif jax.dtypes.issubdtype(aval.dtype, jax.dtypes.prng_key):
        ok = aval.shape == ()
    else:
        raw = _raw_key_aval()
        ok = aval.dtype == raw.dtype and aval.shape == raw.shape
    if not ok:
        shaped = isinstance(aval, jax.ShapeDtypeStruct)
        got = f"{aval.dtype}{list(aval.shape)}" if shaped else repr(aval)
        raise PipelineError(
            f"key is {got}; pass one PRNG key, jax.random.key(seed) or "
            "jax.random.PRNGKey(seed) (microbatch i gets jax.random.fold_in(key, i)); for "
            "several random streams, split the key inside loss_fn"
        )


def microbatch_keys(key: jax.Array, num_microbatches: int) -> jax.Array:
    """Returns the stacked keys ``[fold_in(key, i) for i in range(num_microbatches)]``.

    This is the public contract for randomness: microbatch ``i`` always uses
    ``jax.random.fold_in(key, i)``, whatever the schedule. Works for typed keys
    (``jax.random.key``; result shape ``[m]``) and raw uint32 keys (``jax.random.PRNGKey``;
    result shape ``[m, 2]``).
    """
    num_microbatches = count("num_microbatches", num_microbatches, PipelineError)
    try:
        aval = jax.eval_shape(lambda k: k, key)
    except TypeError:  # not an array at all (a string)
        aval = key
    check_key(aval)
    return jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(num_microbatches))


def _zero_if_float0(grad: Any, param: Any) -> Any:
    """``grad``, or zeros of ``param``'s dtype where JAX gives an integer leaf a float0 one."""
    if jnp.result_type(grad) == jax.dtypes.float0:
        return jnp.zeros(jnp.shape(param), jnp.result_type(param))
    return grad


def reference_value_and_grad(
    loss_fn: Callable[..., Any],
    params: Any,
    batch: Any,
    num_microbatches: int,
    key: jax.Array | None = None,
    *,
    has_aux: bool = False,
    data_parallel: int = 1,
) -> tuple[Any, Any]:
    """Returns (loss, grads): the mean over microbatches of ``jax.value_and_grad(loss_fn)``.

    Microbatch ``i`` is called as ``loss_fn(params, microbatch_i)``, or with
    ``key=...`` as ``loss_fn(params, microbatch_i, jax.random.fold_in(key, i))``. This is what a
    pipelined run must match; for a mean loss without a key it equals the full-batch result.
    With ``has_aux``, ``loss_fn`` returns ``(loss, aux)`` and this returns ``((loss, aux),
    grads)``, aux the mean of its per-microbatch values, but for leaves of per-example rows
    (``aux_rows``), which come back joined in the batch's row order.

    ``data_parallel`` = S computes what a pipeline with S data-parallel shards computes: each
    microbatch's rows split into S equal blocks, block ``s`` called (with a key) as
    ``loss_fn(params, block_s, jax.random.fold_in(key_i, s))``, the mean over all blocks.
    """
    num_microbatches = count("num_microbatches", num_microbatches, PipelineError)
    data_parallel = count("data_parallel", data_parallel, PipelineError)
    if not isinstance(has_aux, bool):
        raise PipelineError(f"has_aux={has_aux!r}; pass True or False")
    microbatches = split_microbatches(batch, num_microbatches)
    rows = {jnp.shape(leaf)[1] for leaf in jax.tree.leaves(microbatches)}
    if any(r % data_parallel for r in rows):
        raise PipelineError(
            f"data_parallel={data_parallel} must be at least 1 and divide every microbatch's "
            f"rows ({sorted(rows)} per microbatch); use a batch size that is a multiple of "
            f"{num_microbatches * max(data_parallel, 1)}"
        )

    def checked(*args: Any) -> Any:
        out = loss_fn(*args)
        if has_aux:
            check_aux_pair(out)
            check_loss_leaf(out[0], "the loss in loss_fn's (loss, aux) is")
        else:
            check_loss_leaf(out, "loss_fn returns")
        return out

    # Each backward is seeded as the pipeline seeds it (``backward_seed``), the gradients then
    # scaled in float32 where 16-bit; exactly 1 / (m * data_parallel) where loss_fn holds a
    # custom_vjp (decided on the first block's trace, below).
    seed = grad_scale = None

    def value_and_grad(params, *args):
        nonlocal seed, grad_scale
        if seed is None:
            traced = jax.make_jaxpr(lambda p: checked(p, *args))(params)
            custom = holds_primitive(traced, CUSTOM_VJP_PRIMITIVES)
            seed, grad_scale = backward_seed(num_microbatches, data_parallel, custom)
        out = jax.vjp(lambda p: checked(p, *args), params, has_aux=has_aux)
        loss, pullback = out[0], out[1]
        dtype = jnp.result_type(loss)
        if jnp.shape(loss) != () or not jnp.issubdtype(dtype, jnp.floating):
            raise PipelineError(
                f"loss_fn returned a {dtype}{list(jnp.shape(loss))} loss; return one real "
                "floating-point scalar (e.g. the mean loss over the batch)"
            )
        (grads,) = pullback(jnp.asarray(seed, dtype))
        # Integer (and bool) leaves get zero gradients of their own dtype, as the pipeline's.
        grads = jax.tree.map(_zero_if_float0, grads, params)
        return ((loss, out[2]) if has_aux else loss), grads

    keys = None if key is None else microbatch_keys(key, num_microbatches)
    value_sum = None
    grad_sum = None
    joined = None  # with has_aux: per aux leaf, whether it holds per-example rows
    row_parts: list[list[Any]] = []  # their values, block by block in the batch's row order
    for i in range(num_microbatches):
        microbatch = jax.tree.map(lambda leaf, i=i: leaf[i], microbatches)
        blocks = split_microbatches(microbatch, data_parallel)
        for s in range(data_parallel):
            block = jax.tree.map(lambda x, s=s: x[s], blocks)
            if keys is None:
                extra = ()
            else:  # one shard keeps key_i itself, as a pipeline without data axes does
                extra = (keys[i] if data_parallel == 1 else jax.random.fold_in(keys[i], s),)
            value, grads = value_and_grad(params, block, *extra)
            if has_aux:
                if joined is None:
                    joined = whole_batch_aux_rows(
                        loss_fn,
                        params,
                        batch,
                        key,
                        [jnp.shape(leaf) for leaf in jax.tree.leaves(value[1])],
                        num_microbatches * data_parallel,
                    )
                    row_parts = [[] for _ in joined]
                # Averaged leaves must be floating; joined rows may be integers or bools.
                check_aux_leaves(
                    (jax.tree_util.keystr(path), jnp.result_type(leaf), jnp.shape(leaf))
                    for (path, leaf), rows_of in zip(
                        jax.tree_util.tree_leaves_with_path(value[1]), joined, strict=True
                    )
                    if not rows_of
                )
                leaves, treedef = jax.tree.flatten(value[1])
                for j, leaf in enumerate(leaves):
                    if joined[j]:  # joined at the end, not summed
                        row_parts[j].append(leaf)
                        leaves[j] = jnp.zeros((), jnp.result_type(leaf))
                value = (value[0], jax.tree.unflatten(treedef, leaves))
            dtypes = jax.tree.map(jnp.result_type, (value, grads))
            # Summed in float32 where 16-bit: a float16 sum of m terms overflows where their
            # mean does not.
            value, grads = jax.tree.map(_wide, (value, grads))
            value_sum = value if value_sum is None else jax.tree.map(jnp.add, value_sum, value)
            grad_sum = grads if grad_sum is None else jax.tree.map(jnp.add, grad_sum, grads)

    def mean_of(total: Any, dtype: Any, scale: float) -> Any:
        return (total * jnp.asarray(scale, jnp.result_type(total))).astype(dtype)

    shards = num_microbatches * data_parallel
    mean = jax.tree.map(functools.partial(mean_of, scale=1.0 / shards), value_sum, dtypes[0])
    if has_aux and any(joined):
        leaves, treedef = jax.tree.flatten(mean[1])
        for j, parts in enumerate(row_parts):
            if joined[j]:
                leaves[j] = jnp.concatenate(parts, axis=0)
        mean = (mean[0], jax.tree.unflatten(treedef, leaves))
    grads = jax.tree.map(
        functools.partial(mean_of, scale=grad_scale / data_parallel), grad_sum, dtypes[1]
    )
    return mean, grads


def whole_batch_aux_rows(
    loss_fn: Callable[..., Any],
    params: Any,
    batch: Any,
    key: Any,
    parts: Sequence[tuple[int, ...]],
    shards: int,
    where: str = "",
) -> tuple[bool, ...]:
    """Returns ``aux_rows`` of ``loss_fn``'s aux for the whole ``batch`` (values or avals,
    traced with ``jax.eval_shape``) against ``parts``, each leaf's shape for one of ``shards``
    parts; all False when ``loss_fn`` does not take the whole batch (a loss written for its
    microbatch's shape, which runs on microbatches only: its aux leaves are means), with a
    warning where an aux leaf is an array, which might have held a row per example."""
    extra = () if key is None else (key,)
    try:
        whole = jax.eval_shape(lambda p, b, *k: loss_fn(p, b, *k)[1], params, batch, *extra)
    except Exception as error:  # noqa: BLE001
        if any(len(shape) for shape in parts):
            from zbjax.partition import caller_stacklevel  # partition imports this module

            reason = (str(error).strip().splitlines() or [""])[0][:200]
            warnings.warn(
                f"zbjax: loss_fn fails on the whole batch ({type(error).__name__}"
                f": {reason}), so which aux leaves hold a row per example cannot be told from "
                "their shapes: every aux leaf comes back as the mean of its microbatches' "
                "values, per-example ones (predictions, a per-row loss) too. Let loss_fn take "
                "any batch size (no batch size written into a reshape) to get them joined",
                stacklevel=caller_stacklevel(),
            )
        return (False,) * len(parts)
    return aux_rows(
        (
            (jax.tree_util.keystr(path), leaf.shape)
            for path, leaf in jax.tree_util.tree_leaves_with_path(whole)
        ),
        parts,
        shards,
        where,
    )


def backward_seed(
    num_microbatches: int, data_parallel: int = 1, custom_vjp: bool = False
) -> tuple[float, float]:
    """Returns (seed, scale): each microbatch's backward (on each of ``data_parallel``
    shards) is seeded with ``seed`` and its gradients scaled by ``scale`` before the shards'
    sums are averaged. The pipeline and ``reference_value_and_grad`` both use it.

    By default the seed is the power of two 2^-k nearest below 1/m (exact in every float
    dtype, where 1/3 rounded to bfloat16 is 0.3340: every gradient 0.2 % off; and as small as
    the whole batch's cotangents, where 1 overflowed a loss-scaled float16 model) and
    ``scale`` = 2^k / m the rest, which is exact for a backward linear in its seed. With
    ``custom_vjp`` (the loss holds a ``jax.custom_vjp`` function, whose bwd rule may not be
    linear: a clip of its cotangent) the seed is what ``jax.value_and_grad`` of the whole
    batch's mean gives each part, 1 / (m * data_parallel), and ``scale`` = data_parallel
    undoes the shards' averaging (helper H1: a clipping rule saw cotangents 3/2 too large at
    m = 3)."""
    if custom_vjp:
        return 1.0 / (num_microbatches * data_parallel), float(data_parallel)
    power = num_microbatches.bit_length() - 1
    return 2.0**-power, 2.0**power / num_microbatches


def check_loss_leaf(out: Any, what: str, error: type[Exception] = PipelineError) -> None:
    """Raises ``error`` when the loss is a container (a list or tuple of one loss, a (loss,
    aux) pair without has_aux), which jax.value_and_grad refuses too: it needs one scalar."""
    if not jax.tree_util.treedef_is_leaf(jax.tree_util.tree_structure(out)) or out is None:
        raise error(
            f"{what} a {type(out).__name__}, not one floating-point scalar; return the loss "
            "alone as a float scalar (e.g. the mean loss over the batch), or return (loss, "
            "aux) with metrics in aux and pass has_aux=True"
        )


def check_aux_pair(out: Any, error: type[Exception] = PipelineError) -> None:
    """Raises ``error`` unless ``out``, what a ``has_aux=True`` loss returned, is a pair
    (loss, aux), as ``jax.value_and_grad(..., has_aux=True)`` needs."""
    if isinstance(out, tuple | list) and len(out) == 2:
        return
    if hasattr(out, "dtype") and hasattr(out, "shape"):
        got = f"a {out.dtype}{list(out.shape)} array"
    else:
        got = f"a {type(out).__name__}" + (
            f" of {len(out)}" if isinstance(out, tuple | list) else ""
        )
    raise error(
        f"with has_aux=True, loss_fn must return a pair (loss, aux); got {got}; "
        "return (loss, aux), or pass has_aux=False"
    )


def check_aux_leaves(
    leaves: Iterable[tuple[str, Any, tuple[int, ...]]], error: type[Exception] = PipelineError
) -> None:
    """Raises ``error`` naming the first aux leaf, given as (key path, dtype, shape), that is
    neither floating nor complex: the leaves given come back as their means over the
    microbatches, which are not of an integer or bool dtype (a count's mean truncated to 0, a
    flag's to an OR). (Leaves of per-example rows, joined instead, are not given.)"""
    for path, dtype, shape in leaves:
        if not jnp.issubdtype(dtype, jnp.inexact):
            raise error(
                f"aux leaf {path or '(the aux itself)'} is {dtype}{list(shape)}; an aux leaf "
                "comes back as its mean over the microbatches, as the loss does, or joined "
                "where it holds per-example rows (its first axis the batch's rows: any dtype), "
                "and a mean must be floating (or complex): return floating values (e.g. "
                "jnp.mean(correct.astype(jnp.float32)))"
            )


def aux_rows(
    whole: Iterable[tuple[str, tuple[int, ...]]],
    parts: Iterable[tuple[int, ...]],
    shards: int,
    where: str = "",
) -> tuple[bool, ...]:
    """Returns, per aux leaf, whether it holds per-example rows: its shape for the whole
    batch (``whole``: key path and shape) has ``shards`` times the leading axis of its shape
    for one part (``parts``: one data-parallel shard of one microbatch, ``shards`` of them in
    all) and the same other axes. Such a leaf is returned as its parts joined along that axis,
    in the batch's row order; a leaf of the same shape for both, as their mean. Raises
    PipelineError naming a leaf that is neither (``where`` says what a part is)."""
    rows = []
    for (path, full), part in zip(whole, parts, strict=True):
        full, part = tuple(full), tuple(part)
        if full == part:
            rows.append(False)
            continue
        if part and full == (part[0] * shards, *part[1:]):
            rows.append(True)
            continue
        raise PipelineError(
            f"aux leaf {path or '(the aux itself)'} has shape {list(full)} for the whole batch "
            f"but {list(part)} for one microbatch{where}: neither the same (a metric, returned "
            f"as its mean over the microbatches) nor per-example rows ({shards} times the "
            "rows along its first axis, returned joined); reduce it over the rows inside "
            "loss_fn (e.g. jnp.mean(x, axis=0)), or put the examples on its first axis"
        )
    return tuple(rows)


def _wide(x: Any) -> Any:
    """``x`` in float32 if it is a 16-bit float array, else unchanged."""
    dtype = jnp.result_type(x)
    wide = wide_dtype(dtype)
    return jnp.asarray(x, wide) if wide != dtype else x
