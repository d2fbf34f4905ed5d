"""GPT's layers in flax NNX: norms, rotary embeddings, attention, the MLP, the MoE MLP, the block.

Shapes and the tp split of their params: `jzero.train.model`'s docstring. Each layer's forward
derives its head and expert counts from its kernels' shapes, so it runs on global arrays under jit
and on tp-local (and ep-local) shards inside shard_map, where `tp_axis` names the axis its
row-parallel output is summed over (Megatron's `g` operator) and `ep_axis` the one tokens travel
over to their experts (`moe.py`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from jzero.config import MlpKind, ModelConfig, NormKind, PosKind
from jzero.train import moe


def normal(rngs: nnx.Rngs, shape, std: float, dtype) -> nnx.Param:
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


def norm(cfg: ModelConfig, dtype) -> nnx.Module:
    if cfg.norm == NormKind.RMSNORM:
        return RMSNorm(cfg.d_model, dtype)
    return LayerNorm(cfg.d_model, dtype, cfg.bias)


def _linear(rngs: nnx.Rngs, shape, std: float, dtype, bias_shape) -> nnx.Dict:
    """kernel[shape] (normal, std) and, if `bias_shape` is not None, bias[bias_shape] = 0."""
    kernel = normal(rngs, shape, std, dtype)
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
        self.qkv = nnx.Dict(kernel=normal(rngs, (d, h // g + 2, g, d // h), 0.02, dtype))
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


class MoE(nnx.Module):
    """E MLPs (the dense MLP's shapes on a leading [E] dim) behind a top-k router (`moe.py`)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, dtype, out_std: float):
        d, f, e = cfg.d_model, cfg.d_ff, cfg.moe.num_experts
        self.swiglu = cfg.mlp == MlpKind.SWIGLU
        self.top_k, self.capacity_factor = cfg.moe.top_k, cfg.moe.capacity_factor
        fc1 = (e, d, 2, f) if self.swiglu else (e, d, f)
        self.router = nnx.Dict(kernel=normal(rngs, (d, e), 0.02, dtype))
        self.experts = nnx.Dict(
            fc1=_linear(rngs, fc1, 0.02, dtype, (e, *fc1[2:]) if cfg.bias else None),
            fc2=_linear(rngs, (e, f, d), out_std, dtype, (e, d) if cfg.bias else None),
        )

    def _experts(self, x, tp_axis):  # x [E_ep, S, D] slots of the local experts
        fc1, fc2 = self.experts["fc1"], self.experts["fc2"]
        if self.swiglu:
            h = jnp.einsum("esd,edgf->gesf", x, fc1["kernel"][...])
            if "bias" in fc1:
                h = h + jnp.moveaxis(fc1["bias"][...], 1, 0)[:, :, None]
            h = jax.nn.silu(h[0]) * h[1]  # [E_ep, S, F_tp]
        else:
            h = jnp.einsum("esd,edf->esf", x, fc1["kernel"][...])
            h = jax.nn.gelu(h + fc1["bias"][...][:, None] if "bias" in fc1 else h)
        y = _reduce_tp(jnp.einsum("esf,efd->esd", h, fc2["kernel"][...]), tp_axis)
        return y + fc2["bias"][...][:, None] if "bias" in fc2 else y

    def __call__(self, x, tp_axis=None, ep_axis=None):
        """x [B, T, D] -> (y [B, T, D], [aux_loss, dropped_frac])."""
        b, t, d = x.shape
        tokens = x.reshape(b * t, d)
        e = self.router["kernel"].shape[-1]
        cap = moe.capacity(b * t, e, self.top_k, self.capacity_factor)
        routing = moe.route(tokens, self.router["kernel"][...], self.top_k, cap)
        slots = moe.to_experts(moe.dispatch(tokens, routing, e, cap), ep_axis)
        y = moe.combine(moe.from_experts(self._experts(slots, tp_axis), ep_axis), routing, b * t)
        return y.reshape(b, t, d), jnp.stack([routing.aux_loss, routing.dropped_frac])


def is_moe_block(cfg: ModelConfig, i: int) -> bool:
    """Block i's MLP is MoE: blocks every-1, 2*every-1, ... (all of them with every=1)."""
    return cfg.moe.num_experts > 0 and i % cfg.moe.every == cfg.moe.every - 1


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, dtype, is_moe: bool = False):
        out_std = 0.02 / math.sqrt(2 * cfg.n_layers)  # GPT-2: scale residual projections
        self.ln1 = norm(cfg, dtype)
        self.attn = Attention(cfg, rngs, dtype, out_std)
        self.ln2 = norm(cfg, dtype)
        self.mlp = (MoE if is_moe else MLP)(cfg, rngs, dtype, out_std)

    def __call__(self, x, tp_axis=None, ep_axis=None):
        """x [B, T, D] -> (x, [aux_loss, dropped_frac]) (zeros for a dense block)."""
        x = x + self.attn(self.ln1(x), tp_axis)
        if isinstance(self.mlp, MoE):
            y, stats = self.mlp(self.ln2(x), tp_axis, ep_axis)
            return x + y, stats
        return x + self.mlp(self.ln2(x), tp_axis), jnp.zeros((2,), jnp.float32)
