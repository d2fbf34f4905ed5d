"""A GPT in flax NNX with Megatron-style tensor parallelism expressed as sharding specs.

Shapes (B batch, T seq, D d_model, H heads, K head dim, F d_ff, V vocab), with the
tp split Megatron uses (column-parallel QKV/FC1, row-parallel proj/FC2):
  tok_emb[V, D]  pos_emb[T, D]  head[D, V] (untied only)
  attn/qkv/kernel[D, 3, H_tp, K]  attn/proj/kernel[H_tp, K, D]
  mlp/fc1/kernel[D, F_tp]         mlp/fc2/kernel[F_tp, D]
The forward derives head counts from the kernel shapes, so the same code runs on
global arrays under jit (XLA partitions it) and on tp-local shards inside
`shard_map` (then `tp_axis` names the axis the row-parallel outputs are summed over,
Megatron's `g` operator).
"""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import PartitionSpec as P

from jzero.config import ModelConfig

# Megatron's tensor-parallel layout, by param path suffix; everything else is replicated over tp.
TP_RULES = (
    (r"attn/qkv/kernel$", P(None, None, "tp", None)),
    (r"attn/proj/kernel$", P("tp", None, None)),
    (r"mlp/fc1/kernel$", P(None, "tp")),
    (r"mlp/fc1/bias$", P("tp")),
    (r"mlp/fc2/kernel$", P("tp", None)),
)


def tp_spec(name: str) -> P:
    """The tensor-parallel PartitionSpec of the param at path `name`."""
    for pattern, spec in TP_RULES:
        if re.search(pattern, name):
            return spec
    return P()


def _normal(rngs: nnx.Rngs, shape, std: float, dtype) -> nnx.Param:
    return nnx.Param((std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype))


def _zeros(shape, dtype) -> nnx.Param:
    return nnx.Param(jnp.zeros(shape, dtype))


class LayerNorm(nnx.Module):
    def __init__(self, d: int, dtype):
        self.scale = nnx.Param(jnp.ones((d,), dtype))
        self.bias = _zeros((d,), dtype)

    def __call__(self, x):  # [B, T, D], statistics in fp32
        xf = x.astype(jnp.float32)
        mean = xf.mean(-1, keepdims=True)
        var = jnp.square(xf - mean).mean(-1, keepdims=True)
        y = (xf - mean) * jax.lax.rsqrt(var + 1e-5)
        return (y * self.scale[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)).astype(x.dtype)


def _reduce_tp(x, tp_axis: str | None):
    return x if tp_axis is None else jax.lax.psum(x, tp_axis)


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, dtype, out_std: float):
        d, h = cfg.d_model, cfg.n_heads
        # No QKV bias: the key bias cannot change the output (softmax is shift-invariant), so
        # its true gradient is 0 and Adam would turn rounding noise into full-size steps.
        self.qkv = nnx.Dict(kernel=_normal(rngs, (d, 3, h, d // h), 0.02, dtype))
        self.proj = nnx.Dict(kernel=_normal(rngs, (h, d // h, d), out_std, dtype), bias=_zeros((d,), dtype))

    def __call__(self, x, tp_axis=None):  # x [B, T, D]
        qkv = jnp.einsum("btd,dshk->sbthk", x, self.qkv["kernel"][...])
        q, k, v = qkv  # [B, T, H, K] each
        scores = jnp.einsum("bthk,bshk->bhts", q, k).astype(jnp.float32) / math.sqrt(q.shape[-1])
        t = x.shape[1]
        causal = jnp.tril(jnp.ones((t, t), bool))
        probs = jax.nn.softmax(jnp.where(causal, scores, -1e30), axis=-1).astype(x.dtype)
        out = jnp.einsum("bhts,bshk->bthk", probs, v)
        y = _reduce_tp(jnp.einsum("bthk,hkd->btd", out, self.proj["kernel"][...]), tp_axis)
        return y + self.proj["bias"][...]


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, dtype, out_std: float):
        self.fc1 = nnx.Dict(kernel=_normal(rngs, (cfg.d_model, cfg.d_ff), 0.02, dtype), bias=_zeros((cfg.d_ff,), dtype))
        self.fc2 = nnx.Dict(kernel=_normal(rngs, (cfg.d_ff, cfg.d_model), out_std, dtype), bias=_zeros((cfg.d_model,), dtype))

    def __call__(self, x, tp_axis=None):  # x [B, T, D]
        h = jax.nn.gelu(x @ self.fc1["kernel"][...] + self.fc1["bias"][...])  # [B, T, F_tp]
        return _reduce_tp(h @ self.fc2["kernel"][...], tp_axis) + self.fc2["bias"][...]


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, dtype):
        out_std = 0.02 / math.sqrt(2 * cfg.n_layers)  # GPT-2: scale residual projections
        self.ln1 = LayerNorm(cfg.d_model, dtype)
        self.attn = Attention(cfg, rngs, dtype, out_std)
        self.ln2 = LayerNorm(cfg.d_model, dtype)
        self.mlp = MLP(cfg, rngs, dtype, out_std)

    def __call__(self, x, tp_axis=None):
        x = x + self.attn(self.ln1(x), tp_axis)
        return x + self.mlp(self.ln2(x), tp_axis)


class GPT(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, dtype=jnp.float32):
        self.tok_emb = _normal(rngs, (cfg.vocab_size, cfg.d_model), 0.02, dtype)
        self.pos_emb = _normal(rngs, (cfg.seq_len, cfg.d_model), 0.01, dtype)
        self.blocks = nnx.List([Block(cfg, rngs, dtype) for _ in range(cfg.n_layers)])
        self.ln_f = LayerNorm(cfg.d_model, dtype)
        self.head = None if cfg.tie_embeddings else _normal(rngs, (cfg.d_model, cfg.vocab_size), 0.02, dtype)

    def __call__(self, tokens, tp_axis=None):
        """tokens [B, T] int -> logits [B, T, V] fp32."""
        x = self.tok_emb[...][tokens] + self.pos_emb[...][: tokens.shape[1]]
        for block in self.blocks:
            x = block(x, tp_axis)
        x = self.ln_f(x)
        head = self.tok_emb[...].T if self.head is None else self.head[...]
        return jnp.einsum("btd,dv->btv", x, head, preferred_element_type=jnp.float32)


class GPTModel:
    """The functional face of `GPT`: params are a plain nested dict of arrays.

    init() -> params; loss(params, tokens) -> mean next-token cross-entropy, where
    tokens are [B, T + 1] int32 (inputs are tokens[:, :-1], targets tokens[:, 1:]).
    """

    def __init__(self, cfg: ModelConfig, param_dtype=jnp.float32, seed: int = 0):
        self.cfg, self.dtype, self.seed = cfg, jnp.dtype(param_dtype), seed
        self.graphdef = nnx.graphdef(nnx.eval_shape(lambda: GPT(cfg, nnx.Rngs(seed), self.dtype)))

    def init(self):
        """Params (nested dict) from `seed`; call under jit with out_shardings to shard at birth."""
        return nnx.split(GPT(self.cfg, nnx.Rngs(self.seed), self.dtype), nnx.Param)[1].to_pure_dict()

    def abstract_params(self):
        return jax.eval_shape(self.init)

    def tp_specs(self, params) -> dict:
        """PartitionSpec per param, same structure as params."""
        return jax.tree_util.tree_map_with_path(
            lambda path, _: tp_spec(jax.tree_util.keystr(path, simple=True, separator="/")), params
        )

    def loss(self, params, tokens, tp_axis=None):
        logits = nnx.merge(self.graphdef, params)(tokens[:, :-1], tp_axis)
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
