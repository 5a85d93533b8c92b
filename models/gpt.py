"""GPT-style decoder in Flax linen, blocks in a Python loop, LM head tied to the token embedding.

Token + learned position embedding, ``num_layers`` pre-LayerNorm blocks (causal self-attention,
then a 4x MLP), final LayerNorm, logits ``h @ embedding.T`` and a mean next-token cross-entropy.
Blocks are unrolled in Python, so a traced program is a flat list of blocks that an
auto-partitioner can cut anywhere; ``cfg.stage_boundaries`` places ``zbjax.stage_boundary``
markers on the residual stream after the named blocks.

The pieces that do not depend on linen (config, attention and loss math, data, cost model) are
shared with ``gpt_nnx`` and ``gpt_scan``.
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

import zbjax
from models.mlp import balanced_cuts, check_boundaries, num_params

Params = Any
Batch = dict[str, jax.Array]
LossFn = Callable[..., jax.Array]

INIT_STD = 0.02


@dataclass(frozen=True)
class GPTConfig:
    """Sizes of the GPT; defaults are tiny so that grads compile in about a second on CPU."""

    vocab_size: int = 64
    seq_len: int = 16
    d_model: int = 32
    num_heads: int = 2
    num_layers: int = 4
    mlp_ratio: int = 4
    stage_boundaries: tuple[int, ...] = ()
    dropout_rate: float = 0.0
    data_noise: float = 0.1  # fraction of tokens in make_batch replaced by uniform noise
    data_seed: int = 0  # picks the fixed successor table the data follow
    # Compute dtype (flax's ``dtype``): "bfloat16" runs the layers in bfloat16 on float32
    # parameters, as mixed-precision training does; the loss is computed in float32.
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.d_model % self.num_heads:
            raise ValueError(
                f"d_model={self.d_model} is not divisible by num_heads={self.num_heads}; "
                f"choose num_heads dividing d_model"
            )
        if not 0.0 <= self.dropout_rate < 1.0:
            raise ValueError(f"dropout_rate={self.dropout_rate} must be in [0, 1)")
        if not 0.0 <= self.data_noise <= 1.0:
            raise ValueError(f"data_noise={self.data_noise} must be in [0, 1]")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype={self.dtype!r}; choose 'float32', 'bfloat16' or 'float16'")
        object.__setattr__(self, "stage_boundaries", tuple(self.stage_boundaries))
        check_boundaries(self.stage_boundaries, self.num_layers, "block")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads

    @property
    def mlp_dim(self) -> int:
        return self.mlp_ratio * self.d_model


# ----------------------------------------------------------------------------- shared math


def causal_attention(qkv: jax.Array, num_heads: int) -> jax.Array:
    """Returns softmax(q k^T / sqrt(d)) v with a causal mask, heads merged: [B, T, D].

    ``qkv``'s features are laid out head by head, ``[heads, 3, head_dim]`` (Megatron's
    layout), so that a contiguous split of them over a tensor axis gives each device whole
    heads, each with its q, k and v."""
    batch, length, three_d = qkv.shape
    d_model = three_d // 3
    head_dim = d_model // num_heads
    q, k, v = jnp.split(qkv.reshape(batch, length, num_heads, 3, head_dim), 3, axis=3)
    q, k, v = (t[:, :, :, 0] for t in (q, k, v))  # [B, T, H, hd]
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(head_dim)
    causal = jnp.tril(jnp.ones((length, length), dtype=bool))
    scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
    # In float32 whatever the compute dtype, as mixed-precision attention does.
    weights = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(qkv.dtype)
    out = jnp.einsum("bhqk,bkhd->bqhd", weights, v)
    return out.reshape(batch, length, d_model)


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Returns the mean over all positions of -log softmax(logits)[target]."""
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    picked = jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]
    return -jnp.mean(picked)


def check_dropout_key(cfg: GPTConfig, key: jax.Array | None) -> None:
    """Returns None when a dropout key is given exactly when the config needs one."""
    if cfg.dropout_rate > 0.0 and key is None:
        raise ValueError(
            f"dropout_rate={cfg.dropout_rate} needs a PRNG key: call loss_fn(params, batch, key), "
            f"or evaluate with dataclasses.replace(cfg, dropout_rate=0.0)"
        )


@functools.partial(jax.jit, static_argnums=(1, 2))
def make_batch(key: jax.Array, cfg: GPTConfig, batch_size: int) -> Batch:
    """Returns {"tokens", "targets"}: int32 [batch_size, seq_len], targets = tokens shifted by one.

    Each sequence starts at a random token and follows a fixed random successor table (a
    permutation drawn from ``cfg.data_seed``); a fraction ``cfg.data_noise`` of positions is
    replaced by uniform noise. The model can learn the table, so training loss goes down.
    """
    successor = jax.random.permutation(jax.random.key(cfg.data_seed), cfg.vocab_size)
    start_key, noise_key, flip_key = jax.random.split(key, 3)
    start = jax.random.randint(start_key, (batch_size,), 0, cfg.vocab_size)
    noise = jax.random.randint(noise_key, (cfg.seq_len, batch_size), 0, cfg.vocab_size)
    flip = jax.random.bernoulli(flip_key, cfg.data_noise, (cfg.seq_len, batch_size))

    def step(token, inputs):
        noise_token, use_noise = inputs
        nxt = jnp.where(use_noise, noise_token, successor[token])
        return nxt, nxt

    _, rest = jax.lax.scan(step, start, (noise, flip))
    sequence = jnp.concatenate([start[None], rest], axis=0).T.astype(jnp.int32)
    return {"tokens": sequence[:, :-1], "targets": sequence[:, 1:]}


def unit_costs(cfg: GPTConfig) -> list[float]:
    """Returns forward FLOPs per token of [embedding + block 0, block 1, ..., block N-1, head]."""
    d, t, v = cfg.d_model, cfg.seq_len, cfg.vocab_size
    block = 2 * (3 * d * d + d * d + 2 * d * cfg.mlp_dim) + 2 * 2 * t * d + 20 * d
    embedding = 2 * d
    head = 2 * d * v + 5 * v + 10 * d
    return [embedding + block] + [block] * (cfg.num_layers - 1) + [head]


def balanced_boundaries(cfg: GPTConfig, num_stages: int) -> tuple[int, ...]:
    """Returns the block indices to cut after so that num_stages stages cost about the same.

    The embedding rides with block 0 and the final LayerNorm + head with the last stage; a
    boundary after the last block gives the head a stage of its own.
    """
    return balanced_cuts(unit_costs(cfg), num_stages)


# ----------------------------------------------------------------------------- linen model


def _dense(features: int, name: str, dtype: str) -> nn.Dense:
    return nn.Dense(features, kernel_init=nn.initializers.normal(INIT_STD), dtype=dtype, name=name)


class Block(nn.Module):
    """Pre-LN transformer block: x + attn(ln(x)), then + mlp(ln(x))."""

    cfg: GPTConfig
    deterministic: bool = True

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.cfg
        h = nn.LayerNorm(dtype=cfg.dtype, name="ln_1")(x)
        h = _dense(3 * cfg.d_model, "qkv", cfg.dtype)(h)
        h = _dense(cfg.d_model, "attn_proj", cfg.dtype)(causal_attention(h, cfg.num_heads))
        x = x + self._dropout(h)
        h = nn.LayerNorm(dtype=cfg.dtype, name="ln_2")(x)
        h = nn.gelu(_dense(cfg.mlp_dim, "mlp_fc", cfg.dtype)(h))
        h = _dense(cfg.d_model, "mlp_proj", cfg.dtype)(h)
        return x + self._dropout(h)

    def _dropout(self, h: jax.Array) -> jax.Array:
        if self.cfg.dropout_rate == 0.0:  # keep the traced program free of dropout equations
            return h
        return nn.Dropout(self.cfg.dropout_rate, deterministic=self.deterministic)(h)


class Embedding(nn.Module):
    """Token + learned position embedding; also the tied LM head (``attend``)."""

    cfg: GPTConfig

    def setup(self) -> None:
        init = nn.initializers.normal(INIT_STD)
        self.token = nn.Embed(
            self.cfg.vocab_size, self.cfg.d_model, embedding_init=init, dtype=self.cfg.dtype
        )
        self.position = self.param("position", init, (self.cfg.seq_len, self.cfg.d_model))

    def __call__(self, tokens: jax.Array) -> jax.Array:
        position = self.position[None, : tokens.shape[1]].astype(self.cfg.dtype)
        return self.token(tokens) + position

    def attend(self, h: jax.Array) -> jax.Array:
        return self.token.attend(h)  # h @ embedding.T: the head has no weight of its own


class GPT(nn.Module):
    """GPT decoder returning next-token logits [B, T, vocab]."""

    cfg: GPTConfig
    deterministic: bool = True

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        embed = Embedding(self.cfg, name="embed")
        h = embed(tokens)
        for i in range(self.cfg.num_layers):
            h = Block(self.cfg, self.deterministic, name=f"block_{i}")(h)
            if i in self.cfg.stage_boundaries:
                h = zbjax.stage_boundary(h)
        h = nn.LayerNorm(dtype=self.cfg.dtype, name="ln_f")(h)
        return embed.attend(h)


def weights_config(cfg: GPTConfig) -> GPTConfig:
    """Returns ``cfg`` without the fields that do not change the weights (markers, dropout,
    compute dtype: parameters are float32 whatever it is)."""
    return dataclasses.replace(cfg, stage_boundaries=(), dropout_rate=0.0, dtype="float32")


# Jitted with the config static: one compiled program per weight shape instead of one dispatch
# per initializer op (about twice as fast on CPU), and reused for every further key.
@functools.partial(jax.jit, static_argnums=1)
def _init_params(key: jax.Array, cfg: GPTConfig) -> Params:
    tokens = jnp.zeros((1, cfg.seq_len), jnp.int32)
    return GPT(cfg).init(key, tokens)["params"]


def init_params(key: jax.Array, cfg: GPTConfig) -> Params:
    """Returns the GPT's parameters as a nested dict of float32 arrays."""
    return _init_params(key, weights_config(cfg))


# Megatron-style tensor parallelism: each attention block's qkv projection column-parallel
# (its features are head by head, so each device gets whole heads) and its output projection
# row-parallel; the same for each MLP; the token embedding split over the vocabulary.
_TENSOR_SPLIT = {
    ("qkv", "kernel"): 1,
    ("qkv", "bias"): 0,
    ("attn_proj", "kernel"): 0,
    ("mlp_fc", "kernel"): 1,
    ("mlp_fc", "bias"): 0,
    ("mlp_proj", "kernel"): 0,
    ("token", "embedding"): 0,
}


def tensor_parallel_specs(
    params: Params, axis: str = "tp", size: int | None = None, num_heads: int | None = None
) -> Any:
    """Returns a ``PartitionSpec`` per GPT param (this module's, ``gpt_nnx``'s pure dict or
    ``gpt_scan``'s stacked layers) splitting attention and the MLPs Megatron-style and the
    token embedding over the vocabulary along mesh ``axis``, for
    ``zbjax.pipeline(param_specs=...)``: None for a replicated one. With ``size`` (the axis's),
    a param whose dimension it does not divide (a vocabulary of 61 characters, say) stays
    replicated, and so does attention when ``num_heads`` is given and ``size`` does not divide
    it (a split through a head is correct, but XLA gathers the heads it cuts)."""
    whole_heads = size is None or num_heads is None or num_heads % size == 0

    def spec(path: tuple, leaf: Any) -> Any:
        names = tuple(str(getattr(k, "key", getattr(k, "name", k))) for k in path)
        dim = _TENSOR_SPLIT.get(names[-2:])
        if dim is None or (names[-2] in ("qkv", "attn_proj") and not whole_heads):
            return None
        # gpt_scan stacks the layers' params along a leading axis: shift the split past it.
        base = 1 if names[-1] == "bias" else 2
        dim += jnp.ndim(leaf) - base
        if size is not None and jnp.shape(leaf)[dim] % size:
            return None
        return jax.sharding.PartitionSpec(*([None] * dim), axis)

    return jax.tree_util.tree_map_with_path(spec, params)


def make_loss_fn(cfg: GPTConfig) -> LossFn:
    """Returns loss_fn(params, batch, key=None) -> mean next-token cross-entropy (float32)."""
    model = GPT(cfg, deterministic=cfg.dropout_rate == 0.0)

    def loss_fn(params: Params, batch: Batch, key: jax.Array | None = None) -> jax.Array:
        check_dropout_key(cfg, key)
        rngs = {"dropout": key} if cfg.dropout_rate > 0.0 else None
        logits = model.apply({"params": params}, batch["tokens"], rngs=rngs)
        return cross_entropy(logits.astype(jnp.float32), batch["targets"])

    return loss_fn


def describe_gpt(
    cfg: GPTConfig, flavour: str, init: Callable[[jax.Array, GPTConfig], Params]
) -> str:
    """Returns a one-line summary of a GPT config, its parameter count and stage boundaries."""
    count = num_params(jax.eval_shape(lambda key: init(key, cfg), jax.random.key(0)))
    fields = dataclasses.asdict(cfg)
    sizes = ", ".join(
        f"{name} {fields[name]}"
        for name in ("vocab_size", "seq_len", "d_model", "num_heads", "num_layers", "dropout_rate")
    )
    cuts = (
        f"stage boundaries after blocks {cfg.stage_boundaries}"
        if cfg.stage_boundaries
        else "no stage boundaries"
    )
    return f"GPT ({flavour}; tied head): {sizes}; {count:,} params; {cuts}"


def describe(cfg: GPTConfig) -> str:
    """Returns a one-line summary of the linen GPT built from ``cfg``."""
    return describe_gpt(cfg, "Flax linen, blocks in a Python loop", init_params)
