"""A multi-modal transformer classifier in Flax linen: N transformer branches, fused by an MLP.

Branch i reads its own modality ``batch["x{i}"]`` (float features [B, seq_len, in_dim]),
projects it to ``d_model``, adds a learned position embedding, runs ``layers_per_branch``
pre-LayerNorm blocks (``models.gpt.Block``: causal self-attention + 4x MLP), a final LayerNorm
and a mean over positions. The N pooled vectors are concatenated and a fusion MLP
(Dense + gelu, Dense) gives class logits; the loss is the mean cross-entropy.

``branch_boundaries=True`` cuts every branch into its own stage(s) and the fusion MLP into a
last stage (rules in ``models.two_tower``); ``layers_per_stage`` cuts each branch after every
that many blocks. Stages: ``num_branches * ceil(layers_per_branch / layers_per_stage) + 1``, e.g.
4 branches x 2 blocks with ``layers_per_stage=1`` give 4 x 2 + 1 = 9 stages, and 4 branches x 1
block give 4 + 1 = 5; ``head_stage=False`` puts the head in the last branch stage, so 4 x 2
blocks with ``layers_per_stage=1`` fill exactly 8 stages. Branches are equal by default;
``in_dims`` gives each its own input width.
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

from models.gpt import INIT_STD, Block, GPTConfig, cross_entropy
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
class MultiModalConfig:
    """Sizes of the multi-modal transformer; tiny defaults, equal branches."""

    num_branches: int = 2
    in_dim: int = 8  # input feature width of every branch, unless in_dims is given
    in_dims: tuple[int, ...] = ()  # per-branch input widths (len num_branches), overrides in_dim
    seq_len: int = 8
    d_model: int = 16
    num_heads: int = 2
    layers_per_branch: int = 1
    mlp_ratio: int = 4
    fusion_width: int = 32
    num_classes: int = 4
    branch_boundaries: bool = False
    layers_per_stage: int | None = None
    head_stage: bool = True  # False: the fusion head joins the last branch's last stage
    data_seed: int = 0  # picks the fixed teacher the labels follow

    def __post_init__(self) -> None:
        object.__setattr__(self, "in_dims", tuple(self.in_dims))
        if self.in_dims and len(self.in_dims) != self.num_branches:
            raise ValueError(
                f"in_dims={self.in_dims} has {len(self.in_dims)} entries but num_branches="
                f"{self.num_branches}; give one input width per branch, or leave in_dims=()"
            )
        sizes = (self.num_branches, self.in_dim, self.seq_len, self.layers_per_branch)
        if min(sizes + self.in_dims + (self.fusion_width, self.num_classes)) < 1:
            raise ValueError(
                f"num_branches={self.num_branches}, in_dim(s)={self.branch_in_dims}, "
                f"seq_len={self.seq_len}, layers_per_branch={self.layers_per_branch}, "
                f"fusion_width={self.fusion_width}, num_classes={self.num_classes} must all be "
                f"at least 1"
            )
        check_layers_per_stage(self.layers_per_stage, self.branch_boundaries)
        check_head_stage(
            self.head_stage, self.branch_boundaries, self.layers_per_branch, self.layers_per_stage
        )
        if self.d_model % self.num_heads:
            raise ValueError(
                f"d_model={self.d_model} is not divisible by num_heads={self.num_heads}; "
                f"choose num_heads dividing d_model"
            )

    @property
    def branch_in_dims(self) -> tuple[int, ...]:
        return self.in_dims or (self.in_dim,) * self.num_branches

    @property
    def block_config(self) -> GPTConfig:
        """Returns the GPT config whose ``Block`` each branch uses (no markers, no dropout)."""
        return GPTConfig(
            seq_len=self.seq_len,
            d_model=self.d_model,
            num_heads=self.num_heads,
            num_layers=self.layers_per_branch,
            mlp_ratio=self.mlp_ratio,
        )


class Branch(nn.Module):
    """One modality: projection + position embedding, blocks, LayerNorm, mean over positions."""

    cfg: MultiModalConfig
    branch: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.cfg
        init = nn.initializers.normal(INIT_STD)
        position = self.param("position", init, (cfg.seq_len, cfg.d_model))
        h = nn.Dense(cfg.d_model, name="proj")(x) + position[None, : x.shape[1]]
        for i in range(cfg.layers_per_branch):
            h = Block(cfg.block_config, name=f"block_{i}")(h)
            h = mark_after_layer(
                h,
                i,
                cfg.layers_per_branch,
                cfg.layers_per_stage,
                cfg.branch_boundaries,
                self.branch,
            )
        return jnp.mean(nn.LayerNorm(name="ln_f")(h), axis=1)  # pool before the edge: [B, d]


class MultiModal(nn.Module):
    """Returns class logits [B, num_classes] from the N modalities."""

    cfg: MultiModalConfig

    @nn.compact
    def __call__(self, inputs: tuple[jax.Array, ...]) -> jax.Array:
        cfg = self.cfg
        marked = cfg.branch_boundaries
        pooled = [
            Branch(cfg, i, name=f"branch_{i}")(mark_branch_input(x, i, marked))
            for i, x in enumerate(inputs)
        ]
        pooled[0] = mark_fusion(pooled[0], marked and cfg.head_stage)
        h = nn.gelu(nn.Dense(cfg.fusion_width, name="fusion_hidden")(jnp.concatenate(pooled, -1)))
        return nn.Dense(cfg.num_classes, name="fusion_out")(h)


def _inputs(cfg: MultiModalConfig, batch: Batch) -> tuple[jax.Array, ...]:
    return tuple(batch[f"x{i}"] for i in range(cfg.num_branches))


def weights_config(cfg: MultiModalConfig) -> MultiModalConfig:
    """Returns ``cfg`` without the fields that do not change the weights (markers)."""
    return dataclasses.replace(cfg, branch_boundaries=False, layers_per_stage=None, head_stage=True)


@functools.partial(jax.jit, static_argnums=1)
def _init_params(key: jax.Array, cfg: MultiModalConfig) -> Params:
    inputs = tuple(jnp.zeros((1, cfg.seq_len, d), jnp.float32) for d in cfg.branch_in_dims)
    return MultiModal(cfg).init(key, inputs)["params"]


def init_params(key: jax.Array, cfg: MultiModalConfig) -> Params:
    """Returns the branches' and fusion head's parameters as a nested dict of float32 arrays."""
    return _init_params(key, weights_config(cfg))


@functools.partial(jax.jit, static_argnums=(1, 2))
def make_batch(key: jax.Array, cfg: MultiModalConfig, batch_size: int) -> Batch:
    """Returns {"x0", ..., "x{N-1}": f32 [B, seq_len, in_dim_i], "y": int32 [B] class labels}.

    The label is the argmax of a fixed random teacher (seeded by ``cfg.data_seed``) that sums,
    over the modalities, ``mean_t tanh(x_i[t] A_i) V_i``: every modality matters.
    """
    teacher_keys = jax.random.split(jax.random.key(cfg.data_seed), 2 * cfg.num_branches)
    input_keys = jax.random.split(key, cfg.num_branches)
    batch: Batch = {}
    logits = jnp.zeros((batch_size, cfg.num_classes), jnp.float32)
    for i, in_dim in enumerate(cfg.branch_in_dims):
        a = jax.random.normal(teacher_keys[2 * i], (in_dim, cfg.d_model)) / math.sqrt(in_dim)
        v = jax.random.normal(teacher_keys[2 * i + 1], (cfg.d_model, cfg.num_classes))
        x = jax.random.normal(input_keys[i], (batch_size, cfg.seq_len, in_dim), jnp.float32)
        logits = logits + jnp.mean(jnp.tanh(x @ a), axis=1) @ v
        batch[f"x{i}"] = x
    batch["y"] = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return batch


def make_loss_fn(cfg: MultiModalConfig) -> LossFn:
    """Returns loss_fn(params, batch, key=None) -> mean cross-entropy (float32 scalar).

    The model has no dropout; ``key`` is accepted and ignored so every model shares one signature.
    """
    model = MultiModal(cfg)

    def loss_fn(params: Params, batch: Batch, key: jax.Array | None = None) -> jax.Array:
        del key
        logits = model.apply({"params": params}, _inputs(cfg, batch))
        return cross_entropy(logits, batch["y"])

    return loss_fn


def num_marker_stages(cfg: MultiModalConfig) -> int:
    """Returns the stages a partition at the markers gives: 1 without markers.

    With ``branch_boundaries``: ``num_branches * ceil(layers_per_branch / layers_per_stage) + 1``
    (``layers_per_stage=None`` counts as one stage per branch); the last is the fusion head,
    or, with ``head_stage=False``, the head rides in the last branch's last stage (one fewer).
    """
    if not cfg.branch_boundaries:
        return 1
    depths = (cfg.layers_per_branch,) * cfg.num_branches
    return branch_stage_count(depths, cfg.layers_per_stage, cfg.head_stage)


def stage_owners(cfg: MultiModalConfig) -> tuple[tuple[str, ...], ...]:
    """Returns, per marker stage, the top-level params keys it may read (branches, then head)."""
    head = ("fusion_hidden", "fusion_out")
    branches = tuple((f"branch_{i}",) for i in range(cfg.num_branches))
    if not cfg.branch_boundaries:
        return (tuple(k for (k,) in branches) + head,)
    depths = (cfg.layers_per_branch,) * cfg.num_branches
    return branch_stage_owners(branches, depths, cfg.layers_per_stage, head, cfg.head_stage)


def describe(cfg: MultiModalConfig) -> str:
    """Returns a one-line summary of the config, its parameter count and marker stages."""
    count = num_params(jax.eval_shape(lambda key: init_params(key, cfg), jax.random.key(0)))
    return (
        f"Multi-modal transformer (Flax linen): {cfg.num_branches} branches x "
        f"{cfg.layers_per_branch} pre-LN blocks (d_model {cfg.d_model}, {cfg.num_heads} heads, "
        f"seq_len {cfg.seq_len}, in_dims {cfg.branch_in_dims}), mean-pooled, fusion MLP "
        f"{cfg.fusion_width} -> {cfg.num_classes} classes; {count:,} params; "
        f"{num_marker_stages(cfg)} marker stage(s)"
    )
