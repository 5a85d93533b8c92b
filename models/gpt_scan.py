"""The GPT of ``models.gpt`` with its blocks run by one ``nn.scan`` over stacked parameters.

The traced program holds ONE ``scan`` of length ``num_layers`` whose body is a block; every block
parameter is stacked along a leading axis of size ``num_layers`` (``params["blocks"]["block"]``).
This is the model for zbjax's auto-partitioner, which splits the scan's iterations across stages.
``zbjax.stage_boundary`` markers cannot go inside a scan body (every iteration runs the same
body, so a marker there would cut every layer), hence ``cfg.stage_boundaries`` must be empty
here; use ``models.gpt`` for marker-cut pipelines.

Config, data, attention and loss are those of ``models.gpt``; with the block parameters of
``models.gpt`` stacked into ``params["blocks"]["block"]``, both compute the same loss.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

from models.gpt import (
    Batch,
    Block,
    Embedding,
    GPTConfig,
    LossFn,
    Params,
    check_dropout_key,
    cross_entropy,
    describe_gpt,
    make_batch,
    weights_config,
)
from zbjax.errors import PartitionError

__all__ = ["GPTConfig", "init_params", "make_batch", "make_loss_fn", "describe", "GPT"]


class _ScanBody(nn.Module):
    """One scan iteration: (residual stream, unused) -> (next residual stream, None)."""

    cfg: GPTConfig
    deterministic: bool = True

    @nn.compact
    def __call__(self, h: jax.Array, _: None) -> tuple[jax.Array, None]:
        return Block(self.cfg, self.deterministic, name="block")(h), None


class GPT(nn.Module):
    """GPT decoder returning next-token logits [B, T, vocab]; blocks in one nn.scan."""

    cfg: GPTConfig
    deterministic: bool = True

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        embed = Embedding(self.cfg, name="embed")
        blocks = nn.scan(
            _ScanBody,
            variable_axes={"params": 0},
            split_rngs={"params": True, "dropout": True},
            length=self.cfg.num_layers,
        )(self.cfg, self.deterministic, name="blocks")
        h, _ = blocks(embed(tokens), None)
        h = nn.LayerNorm(dtype=self.cfg.dtype, name="ln_f")(h)
        return embed.attend(h)


@functools.partial(jax.jit, static_argnums=1)
def _init_params(key: jax.Array, cfg: GPTConfig) -> Params:
    tokens = jnp.zeros((1, cfg.seq_len), jnp.int32)
    return GPT(cfg).init(key, tokens)["params"]


def _check_no_markers(cfg: GPTConfig) -> None:
    if cfg.stage_boundaries:
        raise PartitionError(
            f"gpt_scan runs all {cfg.num_layers} blocks in one nn.scan, so it cannot place "
            f"stage_boundaries={cfg.stage_boundaries} between blocks; leave stage_boundaries "
            f"empty and let the auto-partitioner split the scan, or use models.gpt for markers"
        )


def init_params(key: jax.Array, cfg: GPTConfig) -> Params:
    """Returns the parameters; block leaves are stacked with a leading [num_layers] axis."""
    _check_no_markers(cfg)
    return _init_params(key, weights_config(cfg))


def make_loss_fn(cfg: GPTConfig) -> LossFn:
    """Returns loss_fn(params, batch, key=None) -> mean next-token cross-entropy (float32)."""
    _check_no_markers(cfg)
    model = GPT(cfg, deterministic=cfg.dropout_rate == 0.0)

    def loss_fn(params: Params, batch: Batch, key: jax.Array | None = None) -> jax.Array:
        check_dropout_key(cfg, key)
        rngs = {"dropout": key} if cfg.dropout_rate > 0.0 else None
        logits = model.apply({"params": params}, batch["tokens"], rngs=rngs)
        return cross_entropy(logits.astype(jnp.float32), batch["targets"])

    return loss_fn


def describe(cfg: GPTConfig) -> str:
    """Returns a one-line summary of the scanned GPT built from ``cfg``."""
    return describe_gpt(cfg, "Flax linen, blocks in one nn.scan", init_params)
