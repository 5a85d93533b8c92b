"""The GPT of ``models.gpt`` written in Flax NNX, with pure-dict parameters.

``init_params`` builds the ``nnx.Module``, splits it (``nnx.split``) and returns the parameter
state as a plain nested dict of arrays (``nnx.to_pure_dict``), so ``jax.value_and_grad`` and
zbjax differentiate it directly. ``make_loss_fn`` keeps the graph definition in its closure and
merges it with the params on each call. Block parameters sit under ``params["blocks"][i]``; the
head is tied to ``params["embed"]["token"]["embedding"]``.

Config, data, attention and loss are those of ``models.gpt``: with the same weights, the two
compute the same loss.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

import zbjax
from models.gpt import (
    INIT_STD,
    Batch,
    GPTConfig,
    LossFn,
    Params,
    balanced_boundaries,
    causal_attention,
    check_dropout_key,
    cross_entropy,
    describe_gpt,
    make_batch,
    weights_config,
)

__all__ = [
    "GPTConfig",
    "init_params",
    "make_batch",
    "make_loss_fn",
    "balanced_boundaries",
    "describe",
    "GPT",
    "graphdef",
    "split_model",
    "merge_params",
]

_init = nnx.initializers.normal(INIT_STD)


def _linear(d_in: int, d_out: int, dtype: str, rngs: nnx.Rngs) -> nnx.Linear:
    return nnx.Linear(d_in, d_out, kernel_init=_init, dtype=dtype, rngs=rngs)


class Block(nnx.Module):
    """Pre-LN transformer block: x + attn(ln(x)), then + mlp(ln(x))."""

    def __init__(self, cfg: GPTConfig, rngs: nnx.Rngs) -> None:
        d = cfg.d_model
        self.num_heads = cfg.num_heads
        dtype = cfg.dtype
        self.ln_1 = nnx.LayerNorm(d, dtype=dtype, rngs=rngs)
        self.qkv = _linear(d, 3 * d, dtype, rngs)
        self.attn_proj = _linear(d, d, dtype, rngs)
        self.ln_2 = nnx.LayerNorm(d, dtype=dtype, rngs=rngs)
        self.mlp_fc = _linear(d, cfg.mlp_dim, dtype, rngs)
        self.mlp_proj = _linear(cfg.mlp_dim, d, dtype, rngs)
        # No dropout module at rate 0 keeps the traced program free of dropout equations; the
        # module holds no RNG state: the key arrives with each call.
        self.dropout = nnx.Dropout(cfg.dropout_rate) if cfg.dropout_rate > 0.0 else None

    def __call__(self, x: jax.Array, rngs: nnx.Rngs | None) -> jax.Array:
        h = self.attn_proj(causal_attention(self.qkv(self.ln_1(x)), self.num_heads))
        x = x + self._dropout(h, rngs)
        h = self.mlp_proj(nnx.gelu(self.mlp_fc(self.ln_2(x))))
        return x + self._dropout(h, rngs)

    def _dropout(self, h: jax.Array, rngs: nnx.Rngs | None) -> jax.Array:
        if self.dropout is None:
            return h
        return self.dropout(h, deterministic=False, rngs=rngs)


class Embedding(nnx.Module):
    """Token + learned position embedding; also the tied LM head (``attend``)."""

    def __init__(self, cfg: GPTConfig, rngs: nnx.Rngs) -> None:
        self.dtype = cfg.dtype
        self.token = nnx.Embed(
            cfg.vocab_size, cfg.d_model, embedding_init=_init, dtype=cfg.dtype, rngs=rngs
        )
        self.position = nnx.Param(_init(rngs.params(), (cfg.seq_len, cfg.d_model)))

    def __call__(self, tokens: jax.Array) -> jax.Array:
        position = self.position[None, : tokens.shape[1]].astype(self.dtype)
        return self.token(tokens) + position

    def attend(self, h: jax.Array) -> jax.Array:
        return self.token.attend(h)  # h @ embedding.T: the head has no weight of its own


class GPT(nnx.Module):
    """GPT decoder returning next-token logits [B, T, vocab]; blocks in a Python loop."""

    def __init__(self, cfg: GPTConfig, rngs: nnx.Rngs) -> None:
        self.stage_boundaries = cfg.stage_boundaries
        self.embed = Embedding(cfg, rngs)
        self.blocks = nnx.List([Block(cfg, rngs) for _ in range(cfg.num_layers)])
        self.ln_f = nnx.LayerNorm(cfg.d_model, dtype=cfg.dtype, rngs=rngs)

    def __call__(self, tokens: jax.Array, rngs: nnx.Rngs | None = None) -> jax.Array:
        h = self.embed(tokens)
        for i, block in enumerate(self.blocks):
            h = block(h, rngs)
            if i in self.stage_boundaries:
                h = zbjax.stage_boundary(h)
        return self.embed.attend(self.ln_f(h))


def split_model(model: GPT) -> tuple[nnx.GraphDef, Params]:
    """Returns (graphdef, params as a pure nested dict of arrays) of an NNX GPT."""
    graphdef, state = nnx.split(model)
    return graphdef, nnx.to_pure_dict(state)


def graphdef(cfg: GPTConfig) -> nnx.GraphDef:
    """Returns the graph definition of the NNX GPT for ``cfg`` (built abstractly, no weights)."""
    return nnx.split(nnx.eval_shape(lambda: GPT(cfg, nnx.Rngs(0))))[0]


def merge_params(cfg: GPTConfig, params: Params) -> GPT:
    """Returns the NNX GPT module holding ``params`` (a pure dict from ``init_params``)."""
    return nnx.merge(graphdef(cfg), params)


@functools.partial(jax.jit, static_argnums=1)
def _init_params(key: jax.Array, cfg: GPTConfig) -> Params:
    return split_model(GPT(cfg, nnx.Rngs(params=key)))[1]


def init_params(key: jax.Array, cfg: GPTConfig) -> Params:
    """Returns the NNX GPT's parameters as a pure nested dict of float32 arrays."""
    return _init_params(key, weights_config(cfg))


def make_loss_fn(cfg: GPTConfig) -> LossFn:
    """Returns loss_fn(params, batch, key=None) -> mean next-token cross-entropy (float32)."""
    model_graph = graphdef(cfg)

    def loss_fn(params: Params, batch: Batch, key: jax.Array | None = None) -> jax.Array:
        check_dropout_key(cfg, key)
        model = nnx.merge(model_graph, params)
        rngs = nnx.Rngs(dropout=key) if cfg.dropout_rate > 0.0 else None
        logits = model(batch["tokens"], rngs).astype(jnp.float32)
        return cross_entropy(logits, batch["targets"])

    return loss_fn


def describe(cfg: GPTConfig) -> str:
    """Returns a one-line summary of the NNX GPT built from ``cfg``."""
    return describe_gpt(cfg, "Flax NNX, blocks in a Python loop", init_params)
