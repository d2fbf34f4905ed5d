"""A GPT in flax NNX with Megatron-style tensor parallelism expressed as sharding specs.

Shapes (B batch, T seq, D d_model, H heads, G kv heads, R = H/G, K head dim, F d_ff,
V vocab, L layers), with the tp split Megatron uses (column-parallel QKV/FC1,
row-parallel proj/FC2):
  tok_emb[V, D]  pos_emb[T, D] (pos=learned only)  head[D, V] (untied only)
  attn/qkv/kernel[D, R + 2, G_tp, K]   per kv group: its R query heads, then key, value
                                       (Megatron's grouped layout; [D, 3, H_tp, K] without GQA)
  attn/proj/kernel[H_tp, K, D]         query head h = g * R + r
  mlp/fc1/kernel[D, F_tp]              swiglu: [D, 2, F_tp] (gate, up)
  mlp/fc2/kernel[F_tp, D]
With `scan_layers` every block param gains a leading [L] dim and loses the layer index
from its name (`blocks/mlp/fc1/kernel[L, D, F_tp]`). The forward derives head counts
from the kernel shapes, so the same code runs on global arrays under jit (XLA
partitions it) and on tp-local shards inside `shard_map` (then `tp_axis` names the
axis the row-parallel outputs are summed over, Megatron's `g` operator).
"""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import PartitionSpec as P

from jzero.config import MlpKind, ModelConfig, NormKind, PosKind

# Megatron's tensor-parallel layout, by param path suffix; everything else is replicated over tp.
# Specs are right-aligned on the param's shape (the tp dim counted from the end), so the
# extra dims of the options (the [L] layer stack, swiglu's [2] gate/up pair) are never split.
TP_RULES = (
    (r"attn/qkv/kernel$", P(None, None, "tp", None)),
    (r"attn/proj/kernel$", P("tp", None, None)),
    (r"mlp/fc1/kernel$", P(None, "tp")),
    (r"mlp/fc1/bias$", P("tp")),
    (r"mlp/fc2/kernel$", P("tp", None)),
)


def tp_spec(name: str, ndim: int | None = None) -> P:
    """The tensor-parallel PartitionSpec of the param at path `name` with `ndim` dims.

    The rule's spec covers the trailing dims; leading dims beyond it get None.
    """
    for pattern, spec in TP_RULES:
        if re.search(pattern, name):
            pad = 0 if ndim is None else ndim - len(spec)
            return P(*([None] * pad), *spec)
    return P()


def _normal(rngs: nnx.Rngs, shape, std: float, dtype) -> nnx.Param:
    return nnx.Param((std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype))


def _zeros(shape, dtype) -> nnx.Param:
    return nnx.Param(jnp.zeros(shape, dtype))


class LayerNorm(nnx.Module):
    def __init__(self, d: int, dtype, bias: bool = True):
        self.scale = nnx.Param(jnp.ones((d,), dtype))
        self.bias = _zeros((d,), dtype) if bias else None

    def __call__(self, x):  # [B, T, D], statistics in fp32
        xf = x.astype(jnp.float32)
        mean = xf.mean(-1, keepdims=True)
        var = jnp.square(xf - mean).mean(-1, keepdims=True)
        y = (xf - mean) * jax.lax.rsqrt(var + 1e-5) * self.scale[...].astype(jnp.float32)
        if self.bias is not None:
            y = y + self.bias[...].astype(jnp.float32)
        return y.astype(x.dtype)


class RMSNorm(nnx.Module):
    def __init__(self, d: int, dtype):
        self.scale = nnx.Param(jnp.ones((d,), dtype))

    def __call__(self, x):  # [B, T, D], statistics in fp32
        xf = x.astype(jnp.float32)
        y = xf * jax.lax.rsqrt(jnp.square(xf).mean(-1, keepdims=True) + 1e-5)
        return (y * self.scale[...].astype(jnp.float32)).astype(x.dtype)


def _norm(cfg: ModelConfig, dtype) -> nnx.Module:
    if cfg.norm == NormKind.RMSNORM:
        return RMSNorm(cfg.d_model, dtype)
    return LayerNorm(cfg.d_model, dtype, cfg.bias)


def _linear(rngs: nnx.Rngs, shape, std: float, dtype, bias_shape) -> nnx.Dict:
    """kernel[shape] (normal, std) and, if `bias_shape` is not None, bias[bias_shape] = 0."""
    kernel = _normal(rngs, shape, std, dtype)
    if bias_shape is None:
        return nnx.Dict(kernel=kernel)
    return nnx.Dict(kernel=kernel, bias=_zeros(bias_shape, dtype))


def _add_bias(y, layer: nnx.Dict):
    return y + layer["bias"][...] if "bias" in layer else y


def rope(x, theta: float = 10000.0):
    """Rotary position embedding (LLaMA's rotate-half form) of x[..., T, G, K], in fp32."""
    t, k = x.shape[-3], x.shape[-1]
    freq = theta ** (-jnp.arange(0, k, 2, dtype=jnp.float32) / k)  # [K/2]
    angle = jnp.arange(t, dtype=jnp.float32)[:, None, None] * freq  # [T, 1, K/2]
    cos, sin = jnp.cos(angle), jnp.sin(angle)
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def _reduce_tp(x, tp_axis: str | None):
    return x if tp_axis is None else jax.lax.psum(x, tp_axis)


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, dtype, out_std: float):
        d, h = cfg.d_model, cfg.n_heads
        g = cfg.n_kv_heads or h
        # No QKV bias: the key bias cannot change the output (softmax is shift-invariant), so
        # its true gradient is 0 and Adam would turn rounding noise into full-size steps.
        self.qkv = nnx.Dict(kernel=_normal(rngs, (d, h // g + 2, g, d // h), 0.02, dtype))
        self.proj = _linear(rngs, (h, d // h, d), out_std, dtype, (d,) if cfg.bias else None)
        self.rope = cfg.pos == PosKind.ROPE

    def __call__(self, x, tp_axis=None):  # x [B, T, D]
        qkv = jnp.einsum("btd,dsgk->sbtgk", x, self.qkv["kernel"][...])
        q, k, v = qkv[:-2], qkv[-2], qkv[-1]  # q [R, B, T, G, K]; k, v [B, T, G, K]
        if self.rope:
            q, k = rope(q), rope(k)
        scores = jnp.einsum("rbtgk,bsgk->bgrts", q, k).astype(jnp.float32) / math.sqrt(q.shape[-1])
        t = x.shape[1]
        causal = jnp.tril(jnp.ones((t, t), bool))
        probs = jax.nn.softmax(jnp.where(causal, scores, -1e30), axis=-1).astype(x.dtype)
        out = jnp.einsum("bgrts,bsgk->btgrk", probs, v)
        out = out.reshape(*out.shape[:2], -1, out.shape[-1])  # [B, T, H, K], h = g * R + r
        y = _reduce_tp(jnp.einsum("bthk,hkd->btd", out, self.proj["kernel"][...]), tp_axis)
        return _add_bias(y, self.proj)


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, dtype, out_std: float):
        d, f = cfg.d_model, cfg.d_ff
        self.swiglu = cfg.mlp == MlpKind.SWIGLU
        fc1 = (d, 2, f) if self.swiglu else (d, f)
        self.fc1 = _linear(rngs, fc1, 0.02, dtype, fc1[1:] if cfg.bias else None)
        self.fc2 = _linear(rngs, (f, d), out_std, dtype, (d,) if cfg.bias else None)

    def __call__(self, x, tp_axis=None):  # x [B, T, D]
        if self.swiglu:
            gate, up = _add_bias(jnp.einsum("btd,dsf->sbtf", x, self.fc1["kernel"][...]), self.fc1)
            h = jax.nn.silu(gate) * up  # [B, T, F_tp]
        else:
            h = jax.nn.gelu(_add_bias(x @ self.fc1["kernel"][...], self.fc1))  # [B, T, F_tp]
        return _add_bias(_reduce_tp(h @ self.fc2["kernel"][...], tp_axis), self.fc2)


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, dtype):
        out_std = 0.02 / math.sqrt(2 * cfg.n_layers)  # GPT-2: scale residual projections
        self.ln1 = _norm(cfg, dtype)
        self.attn = Attention(cfg, rngs, dtype, out_std)
        self.ln2 = _norm(cfg, dtype)
        self.mlp = MLP(cfg, rngs, dtype, out_std)

    def __call__(self, x, tp_axis=None):
        x = x + self.attn(self.ln1(x), tp_axis)
        return x + self.mlp(self.ln2(x), tp_axis)


def _stack(blocks: list[Block]) -> Block:
    """One Block whose params are the blocks' params stacked on a leading [L] dim."""
    graphdef = nnx.graphdef(blocks[0])
    states = [nnx.split(b)[1] for b in blocks]
    return nnx.merge(graphdef, jax.tree.map(lambda *xs: jnp.stack(xs), *states))


class GPT(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, dtype=jnp.float32):
        self.tok_emb = _normal(rngs, (cfg.vocab_size, cfg.d_model), 0.02, dtype)
        learned = cfg.pos == PosKind.LEARNED
        self.pos_emb = _normal(rngs, (cfg.seq_len, cfg.d_model), 0.01, dtype) if learned else None
        # Built one by one either way, so scan_layers stacks exactly the params of the loop.
        blocks = [Block(cfg, rngs, dtype) for _ in range(cfg.n_layers)]
        self.blocks = _stack(blocks) if cfg.scan_layers else nnx.List(blocks)
        self.ln_f = _norm(cfg, dtype)
        self.head = None if cfg.tie_embeddings else _normal(rngs, (cfg.d_model, cfg.vocab_size), 0.02, dtype)
        self.scan_layers, self.remat = cfg.scan_layers, cfg.remat

    def _run_blocks(self, x, tp_axis):
        if not (self.scan_layers or self.remat):
            for block in self.blocks:
                x = block(x, tp_axis)
            return x

        def layer(graphdef, state, x):  # one block from its params; x [B, T, D]
            return nnx.merge(graphdef, state)(x, tp_axis)

        if self.remat:  # Megatron's full recompute: keep only each block's input for backward
            layer = jax.checkpoint(layer, static_argnums=0)
        if self.scan_layers:
            graphdef, states = nnx.split(self.blocks)
            return jax.lax.scan(lambda x, s: (layer(graphdef, s, x), None), x, states)[0]
        for block in self.blocks:
            x = layer(*nnx.split(block), x)
        return x

    def __call__(self, tokens, tp_axis=None):
        """tokens [B, T] int -> logits [B, T, V] fp32."""
        x = self.tok_emb[...][tokens]
        if self.pos_emb is not None:
            x = x + self.pos_emb[...][: tokens.shape[1]]
        x = self._run_blocks(x, tp_axis)
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
            lambda path, x: tp_spec(jax.tree_util.keystr(path, simple=True, separator="/"), x.ndim), params
        )

    def layer_ndims(self, params) -> dict:
        """Per param, its dims per layer: with `scan_layers` the stacked [L] dim does not count
        (a stacked norm scale [L, D] is a 1-D param of each layer, for weight decay)."""

        def ndim(path, x):
            stacked = self.cfg.scan_layers and jax.tree_util.keystr(path[:1], simple=True) == "blocks"
            return x.ndim - stacked

        return jax.tree_util.tree_map_with_path(ndim, params)

    def loss(self, params, tokens, tp_axis=None):
        logits = nnx.merge(self.graphdef, params)(tokens[:, :-1], tp_axis)
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
