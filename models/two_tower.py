"""Two MLP towers of unequal depth in Flax linen, plus the branch-marker helpers of branch models.

A user tower (``user_depth`` Dense + tanh layers over ``batch["user"]``) and an item tower
(``item_depth`` layers over ``batch["item"]``) each end in a ``embed_dim`` projection; the two
embeddings are combined by a scaled dot product (``combine="dot"``) or by concatenation and a
small MLP (``combine="concat"``), and the loss is the mean logistic loss on a 0/1 label.

Branch markers (shared by ``multimodal``, ``dlrm`` and ``candle_uno``). With
``branch_boundaries=True`` the model is cut so that every branch is its own stage, or its own
``ceil(depth / layers_per_stage)`` stages, and one last stage holds the fusion, head and loss.
``zbjax.partition`` starts stage k + 1 at the k-th marker and puts every other equation in the
latest stage of its inputs, or, if it reads only params and batch leaves, in the earliest stage
that reads it. So:

- branch 0 has NO marker on its input: it reads only params and batch leaves and lands in
  stage 0; every other branch gets a marker on its raw batch input, which starts its first
  stage without an edge from stage 0;
- a marker after every ``layers_per_stage`` layers of a branch (not after its last) starts the
  branch's next stage;
- one marker on branch 0's output (``"fusion"``) starts the head stage. The other branches'
  outputs are already staged and travel on direct edges to it; marking them too would either
  pull branch 0 into another branch's stage or make stages that only forward values.

Stages in order: branch 0's, branch 1's, ..., head; the graph is branches (parallel) -> head,
with ``num_marker_stages(cfg) = sum_b ceil(depth_b / layers_per_stage) + 1`` stages
(``branch_stage_count``). Branches are traced in index order, which is what makes this order.
With ``head_stage=False`` the fusion marker is left out and the head joins the last branch's
last stage (one stage fewer, e.g. 4 branches x 2 stages on exactly 8 devices); that needs
branch 0 to span at least two stages, or branch 0 would be computed in that stage too.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import flax.linen as nn
import jax
import jax.numpy as jnp

import zbjax
from models.mlp import num_params

Params = Any
Batch = dict[str, jax.Array]
LossFn = Callable[..., jax.Array]
T = TypeVar("T")

COMBINES = ("dot", "concat")


# ----------------------------------------------------------------------------- branch helpers


def check_layers_per_stage(
    layers_per_stage: int | None, branch_boundaries: bool, option: str = "layers_per_stage"
) -> None:
    """Returns None when ``layers_per_stage`` is None or a positive int used with markers."""
    if layers_per_stage is None:
        return
    if not isinstance(layers_per_stage, int) or layers_per_stage < 1:
        raise ValueError(
            f"{option}={layers_per_stage!r} must be a positive int (layers per pipeline stage), "
            f"or None for one stage per branch"
        )
    if not branch_boundaries:
        raise ValueError(
            f"{option}={layers_per_stage} only takes effect with branch_boundaries=True; "
            f"set branch_boundaries=True, or leave {option}=None"
        )


def check_head_stage(
    head_stage: bool, branch_boundaries: bool, depth_0: int, layers_per_stage: int | None
) -> None:
    """Returns None when the head may share the last branch stage (or has its own stage)."""
    if head_stage or not branch_boundaries:
        return
    if branch_segments(depth_0, layers_per_stage) < 2:
        raise ValueError(
            f"head_stage=False needs branch 0 cut into at least 2 stages, but its {depth_0} "
            f"layer(s) with layers_per_stage={layers_per_stage} make 1: without the fusion marker "
            f"branch 0 would run inside the head's stage. Set layers_per_stage below {depth_0} "
            f"(and depth above 1), or keep head_stage=True"
        )


def branch_segments(depth: int, layers_per_stage: int | None) -> int:
    """Returns how many stages a branch of ``depth`` layers is cut into (at least 1)."""
    if layers_per_stage is None or depth <= 0:
        return 1
    return math.ceil(depth / layers_per_stage)


def branch_stage_count(
    depths: Sequence[int], layers_per_stage: int | None, head_stage: bool = True
) -> int:
    """Returns the stages that branch markers make: every branch's segments, plus the head's."""
    return sum(branch_segments(d, layers_per_stage) for d in depths) + int(head_stage)


def branch_stage_owners(
    branch_keys: Sequence[Sequence[str]],
    depths: Sequence[int],
    layers_per_stage: int | None,
    head_keys: Sequence[str],
    head_stage: bool = True,
) -> tuple[tuple[str, ...], ...]:
    """Returns, per marker stage in order, the top-level params keys that stage may read."""
    owners: list[tuple[str, ...]] = []
    for keys, depth in zip(branch_keys, depths, strict=True):
        owners.extend([tuple(keys)] * branch_segments(depth, layers_per_stage))
    if head_stage:
        owners.append(tuple(head_keys))
    else:
        owners[-1] = owners[-1] + tuple(head_keys)
    return tuple(owners)


def mark_branch_input(x: T, branch: int, enabled: bool) -> T:
    """Returns ``x``, behind a marker that starts the branch's first stage for branches > 0.

    ``x`` should be raw batch leaves: a marker on values computed from them would put that
    computation in stage 0 and add an edge from stage 0.
    """
    if not enabled or branch == 0:
        return x
    return zbjax.stage_boundary(x, name=f"branch {branch}")


def mark_after_layer(
    h: T, layer: int, depth: int, layers_per_stage: int | None, enabled: bool, branch: int
) -> T:
    """Returns ``h``, behind a marker when layer ``layer`` ends a stage inside its branch."""
    if not enabled or layers_per_stage is None:
        return h
    if (layer + 1) % layers_per_stage or layer + 1 >= depth:
        return h
    stage = (layer + 1) // layers_per_stage
    return zbjax.stage_boundary(h, name=f"branch {branch}.{stage}")


def mark_fusion(branch_0_output: T, enabled: bool) -> T:
    """Returns branch 0's output, behind the marker that starts the fusion/head stage."""
    if not enabled:
        return branch_0_output
    return zbjax.stage_boundary(branch_0_output, name="fusion")


def logistic_loss(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Returns the mean of -log sigmoid(logit) for label 1 and -log sigmoid(-logit) for 0."""
    return jnp.mean(jax.nn.softplus(logits) - labels * logits)


# ----------------------------------------------------------------------------- the model


@dataclass(frozen=True)
class TwoTowerConfig:
    """Sizes of the two towers; unequal depths by default (user 1 layer, item 3)."""

    user_dim: int = 16
    item_dim: int = 24
    width: int = 32
    embed_dim: int = 16
    user_depth: int = 1
    item_depth: int = 3
    combine: str = "dot"
    head_width: int = 32  # hidden width of the concat head
    branch_boundaries: bool = False
    layers_per_stage: int | None = None
    head_stage: bool = True  # False: the combine joins the item tower's last stage
    data_seed: int = 0  # picks the fixed teacher towers the labels follow

    def __post_init__(self) -> None:
        if self.combine not in COMBINES:
            raise ValueError(f"combine={self.combine!r} is not one of {COMBINES}")
        sizes = (self.user_dim, self.item_dim, self.width, self.embed_dim, self.head_width)
        if min(sizes) < 1 or min(self.user_depth, self.item_depth) < 1:
            raise ValueError(
                f"dims, widths and depths (user_depth={self.user_depth}, "
                f"item_depth={self.item_depth}) must all be at least 1"
            )
        check_layers_per_stage(self.layers_per_stage, self.branch_boundaries)
        check_head_stage(
            self.head_stage, self.branch_boundaries, self.user_depth, self.layers_per_stage
        )

    @property
    def depths(self) -> tuple[int, int]:
        return (self.user_depth, self.item_depth)


class Tower(nn.Module):
    """``depth`` x (Dense(width) + tanh), then Dense(embed_dim); markers between its stages."""

    cfg: TwoTowerConfig
    depth: int
    branch: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.cfg
        for i in range(self.depth):
            x = jnp.tanh(nn.Dense(cfg.width, name=f"dense_{i}")(x))
            x = mark_after_layer(
                x, i, self.depth, cfg.layers_per_stage, cfg.branch_boundaries, self.branch
            )
        return nn.Dense(cfg.embed_dim, name="out")(x)


class TwoTower(nn.Module):
    """Returns one logit per example from the user and item towers."""

    cfg: TwoTowerConfig

    @nn.compact
    def __call__(self, user: jax.Array, item: jax.Array) -> jax.Array:
        cfg = self.cfg
        marked = cfg.branch_boundaries
        u = Tower(cfg, cfg.user_depth, 0, name="tower_0")(user)
        v = Tower(cfg, cfg.item_depth, 1, name="tower_1")(mark_branch_input(item, 1, marked))
        u = mark_fusion(u, marked and cfg.head_stage)
        if cfg.combine == "dot":
            scale = self.param("scale", nn.initializers.constant(1.0 / cfg.embed_dim), ())
            bias = self.param("bias", nn.initializers.zeros, ())
            return scale * jnp.sum(u * v, axis=-1) + bias
        h = jnp.tanh(nn.Dense(cfg.head_width, name="head_hidden")(jnp.concatenate([u, v], -1)))
        return nn.Dense(1, name="head_out")(h)[:, 0]


def weights_config(cfg: TwoTowerConfig) -> TwoTowerConfig:
    """Returns ``cfg`` without the fields that do not change the weights (markers)."""
    return dataclasses.replace(cfg, branch_boundaries=False, layers_per_stage=None, head_stage=True)


@functools.partial(jax.jit, static_argnums=1)
def _init_params(key: jax.Array, cfg: TwoTowerConfig) -> Params:
    user = jnp.zeros((1, cfg.user_dim), jnp.float32)
    item = jnp.zeros((1, cfg.item_dim), jnp.float32)
    return TwoTower(cfg).init(key, user, item)["params"]


def init_params(key: jax.Array, cfg: TwoTowerConfig) -> Params:
    """Returns the towers' and head's parameters as a nested dict of float32 arrays."""
    return _init_params(key, weights_config(cfg))


@functools.partial(jax.jit, static_argnums=(1, 2))
def make_batch(key: jax.Array, cfg: TwoTowerConfig, batch_size: int) -> Batch:
    """Returns {"user": f32 [B, user_dim], "item": f32 [B, item_dim], "y": f32 [B] 0/1 labels}.

    The label says whether two fixed random one-layer teacher towers (seeded by
    ``cfg.data_seed``) give the pair a positive dot product.
    """
    k_user, k_item = jax.random.split(jax.random.key(cfg.data_seed))
    w_user = jax.random.normal(k_user, (cfg.user_dim, cfg.embed_dim)) / math.sqrt(cfg.user_dim)
    w_item = jax.random.normal(k_item, (cfg.item_dim, cfg.embed_dim)) / math.sqrt(cfg.item_dim)
    key_user, key_item = jax.random.split(key)
    user = jax.random.normal(key_user, (batch_size, cfg.user_dim), jnp.float32)
    item = jax.random.normal(key_item, (batch_size, cfg.item_dim), jnp.float32)
    score = jnp.sum(jnp.tanh(user @ w_user) * jnp.tanh(item @ w_item), axis=-1)
    return {"user": user, "item": item, "y": (score > 0).astype(jnp.float32)}


def make_loss_fn(cfg: TwoTowerConfig) -> LossFn:
    """Returns loss_fn(params, batch, key=None) -> mean logistic loss (float32 scalar).

    The model has no dropout; ``key`` is accepted and ignored so every model shares one signature.
    """
    model = TwoTower(cfg)

    def loss_fn(params: Params, batch: Batch, key: jax.Array | None = None) -> jax.Array:
        del key
        logits = model.apply({"params": params}, batch["user"], batch["item"])
        return logistic_loss(logits, batch["y"])

    return loss_fn


def num_marker_stages(cfg: TwoTowerConfig) -> int:
    """Returns the stages a partition at the markers gives: 1 without markers.

    With ``branch_boundaries``: ``ceil(user_depth / lps) + ceil(item_depth / lps) + 1`` (each
    tower one stage when ``layers_per_stage`` is None), the last stage the combine and loss;
    one fewer with ``head_stage=False``.
    """
    if not cfg.branch_boundaries:
        return 1
    return branch_stage_count(cfg.depths, cfg.layers_per_stage, cfg.head_stage)


def stage_owners(cfg: TwoTowerConfig) -> tuple[tuple[str, ...], ...]:
    """Returns, per marker stage, the top-level params keys it may read (towers, then head)."""
    head = ("scale", "bias") if cfg.combine == "dot" else ("head_hidden", "head_out")
    if not cfg.branch_boundaries:
        return (("tower_0", "tower_1", *head),)
    towers = (("tower_0",), ("tower_1",))
    return branch_stage_owners(towers, cfg.depths, cfg.layers_per_stage, head, cfg.head_stage)


def describe(cfg: TwoTowerConfig) -> str:
    """Returns a one-line summary of the two-tower config, its parameter count and stages."""
    count = num_params(jax.eval_shape(lambda key: init_params(key, cfg), jax.random.key(0)))
    return (
        f"Two-tower (Flax linen): user {cfg.user_depth} x Dense({cfg.width}) over "
        f"{cfg.user_dim}, item {cfg.item_depth} x Dense({cfg.width}) over {cfg.item_dim}, "
        f"embed {cfg.embed_dim}, combine {cfg.combine}, logistic loss; {count:,} params; "
        f"{num_marker_stages(cfg)} marker stage(s)"
    )
