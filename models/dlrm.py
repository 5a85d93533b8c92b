"""A DLRM-style click model in Flax linen: bottom MLP, embedding tables, dot interaction, top MLP.

The bottom MLP (``bottom_depth`` Dense + relu layers, then Dense(embed_dim)) reads the dense
features ``batch["dense"]``. Each of the ``num_tables`` embedding tables ``table_t`` looks up the
categorical ids ``batch["sparse_t"]``: int32 [B] (one id per example), or int32 [B, bag_size]
multi-hot bags whose embeddings are summed. The bottom output and the K embeddings interact by
all pairwise dot products (the strict lower triangle of Z Z^T, Z = [bottom, e_1, ..., e_K]);
the bottom output and the dots are concatenated, and a top MLP gives one logit per example.
The loss is the mean logistic loss on a 0/1 label.

Branches: the bottom MLP is branch 0 and each of ``num_table_groups`` contiguous groups of
tables is one more branch (``num_table_groups=None``: one table per group). With
``branch_boundaries=True`` (rules in ``models.two_tower``) every branch is its own stage, the
bottom MLP cut after every ``layers_per_stage`` layers, and the interaction and top MLP form a
last stage: ``ceil(bottom_depth / layers_per_stage) + num_table_groups + 1`` stages, e.g.
bottom_depth 4, layers_per_stage 1 and 3 tables give 4 + 3 + 1 = 8.
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
import numpy as np

from models.mlp import num_params
from models.two_tower import (
    branch_stage_count,
    branch_stage_owners,
    check_head_stage,
    check_layers_per_stage,
    logistic_loss,
    mark_after_layer,
    mark_branch_input,
    mark_fusion,
)

Params = Any
Batch = dict[str, jax.Array]
LossFn = Callable[..., jax.Array]


@dataclass(frozen=True)
class DLRMConfig:
    """Sizes of the DLRM; tiny defaults (3 tables of 32 rows, 16-d embeddings)."""

    dense_dim: int = 8
    bottom_width: int = 32
    bottom_depth: int = 2
    embed_dim: int = 16
    num_tables: int = 3
    vocab_size: int = 32  # rows per table
    bag_size: int = 1  # 1: one id per example and table; >1: multi-hot bags, sum pooling
    num_table_groups: int | None = None  # tables per branch: None = one table per branch
    top_width: int = 32
    top_depth: int = 2
    branch_boundaries: bool = False
    layers_per_stage: int | None = None  # cuts the bottom MLP (tables are one stage per group)
    head_stage: bool = True  # False: interaction + top MLP join the last table group's stage
    data_seed: int = 0  # picks the fixed teacher the labels follow

    def __post_init__(self) -> None:
        sizes = (self.dense_dim, self.bottom_width, self.bottom_depth, self.embed_dim)
        sizes += (self.num_tables, self.vocab_size, self.bag_size, self.top_width, self.top_depth)
        if min(sizes) < 1:
            raise ValueError(f"every size of {self} must be at least 1")
        if self.num_table_groups is not None and not 1 <= self.num_table_groups <= self.num_tables:
            raise ValueError(
                f"num_table_groups={self.num_table_groups} must be between 1 and num_tables="
                f"{self.num_tables} (or None for one table per group)"
            )
        check_layers_per_stage(self.layers_per_stage, self.branch_boundaries)
        # Without a head stage the head joins the last table group; the check is on the
        # bottom MLP, branch 0, which must span two stages to stay out of the head's stage.
        check_head_stage(
            self.head_stage, self.branch_boundaries, self.bottom_depth, self.layers_per_stage
        )

    @property
    def table_groups(self) -> tuple[tuple[int, ...], ...]:
        """Returns the table indices of each branch group (contiguous, sizes differing by <= 1)."""
        count = self.num_tables if self.num_table_groups is None else self.num_table_groups
        return tuple(
            tuple(int(t) for t in g) for g in np.array_split(range(self.num_tables), count)
        )


class BottomMLP(nn.Module):
    """``bottom_depth`` x (Dense + relu), then Dense(embed_dim); markers between its stages."""

    cfg: DLRMConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.cfg
        for i in range(cfg.bottom_depth):
            x = nn.relu(nn.Dense(cfg.bottom_width, name=f"dense_{i}")(x))
            x = mark_after_layer(
                x, i, cfg.bottom_depth, cfg.layers_per_stage, cfg.branch_boundaries, 0
            )
        return nn.Dense(cfg.embed_dim, name="out")(x)


class TopMLP(nn.Module):
    """``top_depth`` x (Dense + relu), then Dense(1): one logit per example."""

    cfg: DLRMConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        for i in range(self.cfg.top_depth):
            x = nn.relu(nn.Dense(self.cfg.top_width, name=f"dense_{i}")(x))
        return nn.Dense(1, name="out")(x)[:, 0]


def pairwise_dots(z: jax.Array) -> jax.Array:
    """Returns the dot products of all pairs of rows of z [B, n, d]: [B, n (n - 1) / 2]."""
    gram = jnp.einsum("bid,bjd->bij", z, z)
    rows, cols = np.tril_indices(z.shape[1], k=-1)
    return gram[:, rows, cols]


class DLRM(nn.Module):
    """Returns one click logit per example from dense features and sparse ids."""

    cfg: DLRMConfig

    @nn.compact
    def __call__(self, dense: jax.Array, sparse: tuple[jax.Array, ...]) -> jax.Array:
        cfg = self.cfg
        marked = cfg.branch_boundaries
        bottom = BottomMLP(cfg, name="bottom")(dense)
        init = nn.initializers.normal(1.0 / math.sqrt(cfg.embed_dim))
        embedded: list[jax.Array] = []
        for g, tables in enumerate(cfg.table_groups):
            ids = mark_branch_input(tuple(sparse[t] for t in tables), g + 1, marked)
            for t, table_ids in zip(tables, ids, strict=True):
                table = nn.Embed(
                    cfg.vocab_size, cfg.embed_dim, embedding_init=init, name=f"table_{t}"
                )
                rows = table(table_ids)
                embedded.append(rows if rows.ndim == 2 else jnp.sum(rows, axis=1))  # bag: sum
        bottom = mark_fusion(bottom, marked and cfg.head_stage)
        dots = pairwise_dots(jnp.stack([bottom, *embedded], axis=1))
        return TopMLP(cfg, name="top")(jnp.concatenate([bottom, dots], axis=-1))


def _sparse(cfg: DLRMConfig, batch: Batch) -> tuple[jax.Array, ...]:
    return tuple(batch[f"sparse_{t}"] for t in range(cfg.num_tables))


def weights_config(cfg: DLRMConfig) -> DLRMConfig:
    """Returns ``cfg`` without the fields that do not change the weights (markers, groups)."""
    return dataclasses.replace(
        cfg, branch_boundaries=False, layers_per_stage=None, head_stage=True, num_table_groups=None
    )


def _ids_shape(cfg: DLRMConfig, batch_size: int) -> tuple[int, ...]:
    return (batch_size,) if cfg.bag_size == 1 else (batch_size, cfg.bag_size)


@functools.partial(jax.jit, static_argnums=1)
def _init_params(key: jax.Array, cfg: DLRMConfig) -> Params:
    dense = jnp.zeros((1, cfg.dense_dim), jnp.float32)
    sparse = tuple(jnp.zeros(_ids_shape(cfg, 1), jnp.int32) for _ in range(cfg.num_tables))
    return DLRM(cfg).init(key, dense, sparse)["params"]


def init_params(key: jax.Array, cfg: DLRMConfig) -> Params:
    """Returns {"bottom", "table_0", ..., "top"} parameters as a nested dict of float32 arrays."""
    return _init_params(key, weights_config(cfg))


@functools.partial(jax.jit, static_argnums=(1, 2))
def make_batch(key: jax.Array, cfg: DLRMConfig, batch_size: int) -> Batch:
    """Returns {"dense": f32 [B, dense_dim], "sparse_t": int32 [B] or [B, bag], "y": f32 [B]}.

    The 0/1 label says whether a fixed random teacher (seeded by ``cfg.data_seed``) scores the
    example above zero: ``tanh(dense W) u`` plus, per table, a fixed score per row summed
    over the example's ids.
    """
    teacher = jax.random.split(jax.random.key(cfg.data_seed), cfg.num_tables + 2)
    w = jax.random.normal(teacher[0], (cfg.dense_dim, cfg.bottom_width)) / math.sqrt(cfg.dense_dim)
    u = jax.random.normal(teacher[1], (cfg.bottom_width,)) / math.sqrt(cfg.bottom_width)
    keys = jax.random.split(key, cfg.num_tables + 1)
    dense = jax.random.normal(keys[0], (batch_size, cfg.dense_dim), jnp.float32)
    score = jnp.tanh(dense @ w) @ u
    batch: Batch = {"dense": dense}
    for t in range(cfg.num_tables):
        ids = jax.random.randint(keys[t + 1], _ids_shape(cfg, batch_size), 0, cfg.vocab_size)
        row_score = jax.random.normal(teacher[t + 2], (cfg.vocab_size,)) / math.sqrt(cfg.bag_size)
        picked = row_score[ids]
        score = score + (picked if cfg.bag_size == 1 else jnp.sum(picked, axis=1))
        batch[f"sparse_{t}"] = ids.astype(jnp.int32)
    batch["y"] = (score > 0).astype(jnp.float32)
    return batch


def make_loss_fn(cfg: DLRMConfig) -> LossFn:
    """Returns loss_fn(params, batch, key=None) -> mean logistic loss (float32 scalar).

    The model has no dropout; ``key`` is accepted and ignored so every model shares one signature.
    """
    model = DLRM(cfg)

    def loss_fn(params: Params, batch: Batch, key: jax.Array | None = None) -> jax.Array:
        del key
        logits = model.apply({"params": params}, batch["dense"], _sparse(cfg, batch))
        return logistic_loss(logits, batch["y"])

    return loss_fn


def num_marker_stages(cfg: DLRMConfig) -> int:
    """Returns the stages a partition at the markers gives: 1 without markers.

    With ``branch_boundaries``: ``ceil(bottom_depth / layers_per_stage)`` bottom stages (1 when
    ``layers_per_stage`` is None), one per table group, and the interaction/top stage (left
    out with ``head_stage=False``).
    """
    if not cfg.branch_boundaries:
        return 1
    depths = (cfg.bottom_depth,) + (0,) * len(cfg.table_groups)
    return branch_stage_count(depths, cfg.layers_per_stage, cfg.head_stage)


def stage_owners(cfg: DLRMConfig) -> tuple[tuple[str, ...], ...]:
    """Returns, per marker stage, the top-level params keys it may read."""
    groups = tuple(tuple(f"table_{t}" for t in tables) for tables in cfg.table_groups)
    if not cfg.branch_boundaries:
        return (("bottom", *(k for g in groups for k in g), "top"),)
    depths = (cfg.bottom_depth,) + (0,) * len(groups)
    return branch_stage_owners(
        (("bottom",), *groups), depths, cfg.layers_per_stage, ("top",), cfg.head_stage
    )


def describe(cfg: DLRMConfig) -> str:
    """Returns a one-line summary of the DLRM config, its parameter count and marker stages."""
    count = num_params(jax.eval_shape(lambda key: init_params(key, cfg), jax.random.key(0)))
    bags = "one id" if cfg.bag_size == 1 else f"bags of {cfg.bag_size} ids, summed"
    return (
        f"DLRM (Flax linen): bottom {cfg.bottom_depth} x Dense({cfg.bottom_width}) over "
        f"{cfg.dense_dim} dense features, {cfg.num_tables} tables of {cfg.vocab_size} x "
        f"{cfg.embed_dim} ({bags}) in {len(cfg.table_groups)} group(s), dot interaction, top "
        f"{cfg.top_depth} x Dense({cfg.top_width}), logistic loss; {count:,} params; "
        f"{num_marker_stages(cfg)} marker stage(s)"
    )
