"""An MLP chain in Flax linen (Dense + activation per layer), plus the chain helpers all models use.

``depth`` hidden layers of width ``width`` in a Python loop, then a Dense output layer; the loss
is a mean squared error (``task="regression"``) or a mean cross-entropy
(``task="classification"``). ``cfg.stage_boundaries`` places ``zbjax.stage_boundary`` markers on
the activations after the named hidden layers. Data come from a fixed random teacher network, so
the task is learnable.

``balanced_cuts`` and ``check_boundaries`` live here, in the simplest chain, and are shared by the
GPT modules.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

import zbjax
from zbjax.errors import PartitionError

Params = Any
Batch = dict[str, jax.Array]
LossFn = Callable[..., jax.Array]

ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "tanh": jnp.tanh,
    "relu": jax.nn.relu,
    "gelu": jax.nn.gelu,
}
TASKS = ("regression", "classification")


# ----------------------------------------------------------------------------- chain helpers


def balanced_cuts(unit_costs: Sequence[float], num_stages: int) -> tuple[int, ...]:
    """Returns the unit indices after which to cut a chain so the costliest stage is cheapest.

    ``unit_costs`` are the forward costs of a chain of units (e.g. embedding+block 0, block 1, ...,
    head); a cut after unit ``j`` starts a new stage at unit ``j + 1``. Exact dynamic programme
    over contiguous splits; ties go to the earliest cuts.
    """
    n = len(unit_costs)
    if not 1 <= num_stages <= n:
        raise PartitionError(
            f"cannot cut a chain of {n} layers into num_stages={num_stages} stages; "
            f"ask for between 1 and {n} stages, or build the model with more layers"
        )
    prefix = [0.0]
    for cost in unit_costs:
        prefix.append(prefix[-1] + float(cost))
    # best[k][i]: (max stage cost, cuts) splitting units [0, i) into k non-empty stages.
    best: list[dict[int, tuple[float, tuple[int, ...]]]] = [{} for _ in range(num_stages + 1)]
    best[0][0] = (0.0, ())
    for k in range(1, num_stages + 1):
        for i in range(k, n - (num_stages - k) + 1):
            candidates = []
            for j in range(k - 1, i):
                if j not in best[k - 1]:
                    continue
                worst, cuts = best[k - 1][j]
                new_cuts = cuts + ((j - 1,) if k > 1 else ())
                candidates.append((max(worst, prefix[i] - prefix[j]), new_cuts))
            best[k][i] = min(candidates)
    return best[num_stages][n][1]


def check_boundaries(boundaries: Sequence[int], num_layers: int, what: str) -> None:
    """Returns None when ``boundaries`` are strictly increasing indices in [0, num_layers)."""
    bad = [b for b in boundaries if not isinstance(b, int) or not 0 <= b < num_layers]
    increasing = all(a < b for a, b in zip(boundaries, boundaries[1:], strict=False))
    if bad or not increasing:
        raise PartitionError(
            f"stage_boundaries={tuple(boundaries)} must be strictly increasing {what} indices in "
            f"[0, {num_layers - 1}] (a boundary after {what} i cuts between {what}s i and i+1); "
            f"use balanced_boundaries(cfg, num_stages) to choose them"
        )


def num_params(params: Params) -> int:
    """Returns the number of scalars in a params pytree."""
    return sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(params))


# ----------------------------------------------------------------------------- the MLP


@dataclass(frozen=True)
class MLPConfig:
    """Sizes of the MLP; ``out_dim`` is the regression output size or the number of classes."""

    in_dim: int = 16
    width: int = 32
    depth: int = 4
    out_dim: int = 8
    task: str = "regression"
    activation: str = "tanh"
    stage_boundaries: tuple[int, ...] = ()
    data_seed: int = 0  # picks the fixed teacher network the data follow

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"task={self.task!r} is not one of {TASKS}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation={self.activation!r} is not one of {tuple(ACTIVATIONS)}")
        if min(self.in_dim, self.width, self.depth, self.out_dim) < 1:
            raise ValueError(
                f"in_dim={self.in_dim}, width={self.width}, depth={self.depth} and "
                f"out_dim={self.out_dim} must all be at least 1"
            )
        object.__setattr__(self, "stage_boundaries", tuple(self.stage_boundaries))
        check_boundaries(self.stage_boundaries, self.depth, "layer")


class MLP(nn.Module):
    """``depth`` x (Dense(width) + activation), then Dense(out_dim); markers after named layers."""

    cfg: MLPConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        activation = ACTIVATIONS[self.cfg.activation]
        for i in range(self.cfg.depth):
            x = activation(nn.Dense(self.cfg.width, name=f"dense_{i}")(x))
            if i in self.cfg.stage_boundaries:
                x = zbjax.stage_boundary(x)
        return nn.Dense(self.cfg.out_dim, name="out")(x)


# Jitted with the config static: one compiled program instead of one dispatch per op.
@functools.partial(jax.jit, static_argnums=1)
def _init_params(key: jax.Array, cfg: MLPConfig) -> Params:
    return MLP(cfg).init(key, jnp.zeros((1, cfg.in_dim), jnp.float32))["params"]


def init_params(key: jax.Array, cfg: MLPConfig) -> Params:
    """Returns the MLP's parameters as a nested dict of float32 arrays."""
    return _init_params(key, dataclasses.replace(cfg, stage_boundaries=()))


@functools.partial(jax.jit, static_argnums=(1, 2))
def make_batch(key: jax.Array, cfg: MLPConfig, batch_size: int) -> Batch:
    """Returns {"x": float32 [B, in_dim], "y": float32 [B, out_dim] or int32 [B] class labels}.

    Targets come from a fixed random two-layer teacher (seeded by ``cfg.data_seed``):
    ``tanh(x W1) W2``, or its argmax for classification.
    """
    k1, k2 = jax.random.split(jax.random.key(cfg.data_seed))
    w1 = jax.random.normal(k1, (cfg.in_dim, cfg.width)) / math.sqrt(cfg.in_dim)
    w2 = jax.random.normal(k2, (cfg.width, cfg.out_dim)) / math.sqrt(cfg.width)
    x = jax.random.normal(key, (batch_size, cfg.in_dim), jnp.float32)
    y = jnp.tanh(x @ w1) @ w2
    if cfg.task == "classification":
        return {"x": x, "y": jnp.argmax(y, axis=-1).astype(jnp.int32)}
    return {"x": x, "y": y.astype(jnp.float32)}


def make_loss_fn(cfg: MLPConfig) -> LossFn:
    """Returns loss_fn(params, batch, key=None) -> mean MSE or cross-entropy (float32 scalar).

    The MLP has no dropout; ``key`` is accepted and ignored so every model shares one signature.
    """
    model = MLP(cfg)

    def loss_fn(params: Params, batch: Batch, key: jax.Array | None = None) -> jax.Array:
        del key
        out = model.apply({"params": params}, batch["x"])
        if cfg.task == "classification":
            log_probs = jax.nn.log_softmax(out, axis=-1)
            return -jnp.mean(jnp.take_along_axis(log_probs, batch["y"][:, None], axis=-1))
        return jnp.mean((out - batch["y"]) ** 2)

    return loss_fn


def unit_costs(cfg: MLPConfig) -> list[float]:
    """Returns forward FLOPs per example of [layer 0, ..., layer depth-1, output layer]."""
    first = 2 * cfg.in_dim * cfg.width + 2 * cfg.width
    hidden = 2 * cfg.width * cfg.width + 2 * cfg.width
    out = 2 * cfg.width * cfg.out_dim + 4 * cfg.out_dim
    return [first] + [hidden] * (cfg.depth - 1) + [out]


def balanced_boundaries(cfg: MLPConfig, num_stages: int) -> tuple[int, ...]:
    """Returns the layer indices to cut after so that num_stages stages cost about the same.

    The output layer and the loss ride with the last stage; a boundary after the last hidden
    layer gives them a stage of their own.
    """
    return balanced_cuts(unit_costs(cfg), num_stages)


def describe(cfg: MLPConfig) -> str:
    """Returns a one-line summary of the MLP config, its parameter count and stage boundaries."""
    count = num_params(jax.eval_shape(lambda key: init_params(key, cfg), jax.random.key(0)))
    cuts = (
        f"stage boundaries after layers {cfg.stage_boundaries}"
        if cfg.stage_boundaries
        else "no stage boundaries"
    )
    return (
        f"MLP (Flax linen, {cfg.task}): {cfg.depth} x Dense({cfg.width}) + {cfg.activation}, "
        f"in_dim {cfg.in_dim}, out_dim {cfg.out_dim}; {count:,} params; {cuts}"
    )
