"""A CANDLE-Uno-style drug-response regressor in Flax linen: MLP towers over wide features.

One MLP tower per feature input (``batch["x0"]``, ``batch["x1"]``, ... with widths
``feature_dims``, e.g. gene expression, drug descriptors, drug fingerprints; each tower
``tower_depth`` Dense + relu layers of ``tower_width``), the tower outputs concatenated, a dense
head (``head_depth`` Dense + relu layers of ``head_width``, then Dense(1)) predicting a scalar
response, and a mean squared error loss.

With ``branch_boundaries=True`` (rules in ``models.two_tower``) every tower is its own stage,
cut after every ``layers_per_stage`` layers, and the head a last stage:
``len(feature_dims) * ceil(tower_depth / layers_per_stage) + 1`` stages (towers of unequal
depth via ``tower_depths``: the sum of each tower's stages, + 1).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from models.mlp import num_params
from models.two_tower import (
    branch_stage_count,
    branch_stage_owners,
    check_head_stage,
    check_layers_per_stage,
    mark_after_layer,
    mark_branch_input,
    mark_fusion,
)

Params = Any
Batch = dict[str, jax.Array]
LossFn = Callable[..., jax.Array]


@dataclass(frozen=True)
class CandleUnoConfig:
    """Sizes of the Uno-style model; tiny defaults (feature widths 64/48/32, 2-layer towers)."""

    feature_dims: tuple[int, ...] = (64, 48, 32)  # gene expression, descriptors, fingerprints
    tower_width: int = 32
    tower_depth: int = 2
    tower_depths: tuple[int, ...] = ()  # per-tower depths (len = towers), overrides tower_depth
    head_width: int = 32
    head_depth: int = 2
    branch_boundaries: bool = False
    layers_per_stage: int | None = None
    head_stage: bool = True  # False: the head joins the last tower's last stage
    data_seed: int = 0  # picks the fixed teacher the responses follow

    def __post_init__(self) -> None:
        object.__setattr__(self, "feature_dims", tuple(self.feature_dims))
        object.__setattr__(self, "tower_depths", tuple(self.tower_depths))
        if not self.feature_dims:
            raise ValueError("feature_dims=() gives no towers; give at least one feature width")
        if self.tower_depths and len(self.tower_depths) != len(self.feature_dims):
            raise ValueError(
                f"tower_depths={self.tower_depths} needs one depth per feature input "
                f"(feature_dims={self.feature_dims}), or () for tower_depth everywhere"
            )
        sizes = self.feature_dims + self.depths + (self.tower_width, self.head_width)
        if min(sizes) < 1 or self.head_depth < 0:
            raise ValueError(
                f"feature_dims={self.feature_dims}, tower depths={self.depths}, tower_width="
                f"{self.tower_width}, head_width={self.head_width} must be at least 1 "
                f"(head_depth={self.head_depth} at least 0)"
            )
        check_layers_per_stage(self.layers_per_stage, self.branch_boundaries)
        check_head_stage(
            self.head_stage, self.branch_boundaries, self.depths[0], self.layers_per_stage
        )

    @property
    def depths(self) -> tuple[int, ...]:
        return self.tower_depths or (self.tower_depth,) * len(self.feature_dims)


class Tower(nn.Module):
    """``depth`` x (Dense(tower_width) + relu); markers between its stages."""

    cfg: CandleUnoConfig
    branch: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.cfg
        depth = cfg.depths[self.branch]
        for i in range(depth):
            x = nn.relu(nn.Dense(cfg.tower_width, name=f"dense_{i}")(x))
            x = mark_after_layer(
                x, i, depth, cfg.layers_per_stage, cfg.branch_boundaries, self.branch
            )
        return x


class Head(nn.Module):
    """``head_depth`` x (Dense(head_width) + relu), then Dense(1): one response per example."""

    cfg: CandleUnoConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        for i in range(self.cfg.head_depth):
            x = nn.relu(nn.Dense(self.cfg.head_width, name=f"dense_{i}")(x))
        return nn.Dense(1, name="out")(x)[:, 0]


class CandleUno(nn.Module):
    """Returns the predicted response [B] from the feature inputs."""

    cfg: CandleUnoConfig

    @nn.compact
    def __call__(self, inputs: tuple[jax.Array, ...]) -> jax.Array:
        cfg = self.cfg
        marked = cfg.branch_boundaries
        towers = [
            Tower(cfg, i, name=f"tower_{i}")(mark_branch_input(x, i, marked))
            for i, x in enumerate(inputs)
        ]
        towers[0] = mark_fusion(towers[0], marked and cfg.head_stage)
        return Head(cfg, name="head")(jnp.concatenate(towers, axis=-1))


def _inputs(cfg: CandleUnoConfig, batch: Batch) -> tuple[jax.Array, ...]:
    return tuple(batch[f"x{i}"] for i in range(len(cfg.feature_dims)))


def weights_config(cfg: CandleUnoConfig) -> CandleUnoConfig:
    """Returns ``cfg`` without the fields that do not change the weights (markers)."""
    return dataclasses.replace(cfg, branch_boundaries=False, layers_per_stage=None, head_stage=True)


@functools.partial(jax.jit, static_argnums=1)
def _init_params(key: jax.Array, cfg: CandleUnoConfig) -> Params:
    inputs = tuple(jnp.zeros((1, d), jnp.float32) for d in cfg.feature_dims)
    return CandleUno(cfg).init(key, inputs)["params"]


def init_params(key: jax.Array, cfg: CandleUnoConfig) -> Params:
    """Returns {"tower_0", ..., "head"} parameters as a nested dict of float32 arrays."""
    return _init_params(key, weights_config(cfg))


@functools.partial(jax.jit, static_argnums=(1, 2))
def make_batch(key: jax.Array, cfg: CandleUnoConfig, batch_size: int) -> Batch:
    """Returns {"x0", ...: f32 [B, feature_dims[i]], "y": f32 [B] responses}.

    The response is a fixed random teacher (seeded by ``cfg.data_seed``):
    ``sum_i tanh(x_i A_i) v_i``, scaled to about unit variance, so every input matters.
    """
    teacher = jax.random.split(jax.random.key(cfg.data_seed), 2 * len(cfg.feature_dims))
    keys = jax.random.split(key, len(cfg.feature_dims))
    batch: Batch = {}
    y = jnp.zeros((batch_size,), jnp.float32)
    for i, dim in enumerate(cfg.feature_dims):
        a = jax.random.normal(teacher[2 * i], (dim, cfg.tower_width)) / math.sqrt(dim)
        v = jax.random.normal(teacher[2 * i + 1], (cfg.tower_width,)) / math.sqrt(cfg.tower_width)
        x = jax.random.normal(keys[i], (batch_size, dim), jnp.float32)
        y = y + jnp.tanh(x @ a) @ v
        batch[f"x{i}"] = x
    batch["y"] = y / math.sqrt(len(cfg.feature_dims))
    return batch


def make_loss_fn(cfg: CandleUnoConfig) -> LossFn:
    """Returns loss_fn(params, batch, key=None) -> mean squared error (float32 scalar).

    The model has no dropout; ``key`` is accepted and ignored so every model shares one signature.
    """
    model = CandleUno(cfg)

    def loss_fn(params: Params, batch: Batch, key: jax.Array | None = None) -> jax.Array:
        del key
        prediction = model.apply({"params": params}, _inputs(cfg, batch))
        return jnp.mean((prediction - batch["y"]) ** 2)

    return loss_fn


def num_marker_stages(cfg: CandleUnoConfig) -> int:
    """Returns the stages a partition at the markers gives: 1 without markers.

    With ``branch_boundaries``: ``sum_i ceil(depth_i / layers_per_stage)`` tower stages (one per
    tower when ``layers_per_stage`` is None) + 1 head stage (0 with ``head_stage=False``).
    """
    if not cfg.branch_boundaries:
        return 1
    return branch_stage_count(cfg.depths, cfg.layers_per_stage, cfg.head_stage)


def stage_owners(cfg: CandleUnoConfig) -> tuple[tuple[str, ...], ...]:
    """Returns, per marker stage, the top-level params keys it may read (towers, then head)."""
    towers = tuple((f"tower_{i}",) for i in range(len(cfg.feature_dims)))
    if not cfg.branch_boundaries:
        return (tuple(k for (k,) in towers) + ("head",),)
    return branch_stage_owners(towers, cfg.depths, cfg.layers_per_stage, ("head",), cfg.head_stage)


def describe(cfg: CandleUnoConfig) -> str:
    """Returns a one-line summary of the config, its parameter count and marker stages."""
    count = num_params(jax.eval_shape(lambda key: init_params(key, cfg), jax.random.key(0)))
    return (
        f"CANDLE-Uno-style regressor (Flax linen): towers of depth {cfg.depths} x "
        f"Dense({cfg.tower_width}) over features {cfg.feature_dims}, head {cfg.head_depth} x "
        f"Dense({cfg.head_width}) -> 1, MSE loss; {count:,} params; "
        f"{num_marker_stages(cfg)} marker stage(s)"
    )
