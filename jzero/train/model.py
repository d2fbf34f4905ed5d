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
  MoE blocks (`model.moe`, E experts split over ep, `moe.py` for the routing):
  mlp/router/kernel[D, E]               dense, replicated over tp
  mlp/experts/fc1/kernel[E_ep, D, F_tp] swiglu: [E_ep, D, 2, F_tp]
  mlp/experts/fc2/kernel[E_ep, F_tp, D]
With `scan_layers` every block param gains a leading [L] dim and loses the layer index
from its name (`blocks/mlp/fc1/kernel[L, D, F_tp]`). The forward derives head counts
from the kernel shapes, so the same code runs on global arrays under jit (XLA
partitions it) and on tp-local shards inside `shard_map` (then `tp_axis` names the
axis the row-parallel outputs are summed over, Megatron's `g` operator, and `ep_axis`
the axis tokens travel over to their experts; without it every expert is local).
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
from jzero.mesh import EP_AXIS
from jzero.train import moe
from jzero.zero import units

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


EXPERT_PATTERN = r"/experts/"  # expert weights: [E, *dense MLP shape], E split over ep


def tp_spec(name: str, ndim: int | None = None, stacked: bool = False) -> P:
    """The model-parallel PartitionSpec of the param at path `name` with `ndim` dims.

    The tp rule's spec covers the trailing dims; leading dims beyond it get None. An
    expert weight's expert dim (the first, or the second when `stacked` on [L]) is split
    over ep and its other dims follow the dense MLP's rule.
    """
    expert = re.search(EXPERT_PATTERN, name) is not None
    spec = P()
    for pattern, rule in TP_RULES:
        if re.search(pattern, name.replace("/experts/", "/")):
            pad = 0 if ndim is None else ndim - len(rule)
            spec = P(*([None] * pad), *rule)
            break
    if expert:
        dims = list(spec) + [None] * ((ndim or 0) - len(spec))
        dims[int(stacked)] = EP_AXIS
        spec = P(*dims)
    return spec


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
            gate, up = jnp.einsum("btd,dsf->sbtf", x, self.fc1["kernel"][...])
            if "bias" in self.fc1:  # [2, F_tp]: one bias for the gate, one for up
                gate, up = gate + self.fc1["bias"][0], up + self.fc1["bias"][1]
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
        self.router = nnx.Dict(kernel=_normal(rngs, (d, e), 0.02, dtype))
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
        self.ln1 = _norm(cfg, dtype)
        self.attn = Attention(cfg, rngs, dtype, out_std)
        self.ln2 = _norm(cfg, dtype)
        self.mlp = (MoE if is_moe else MLP)(cfg, rngs, dtype, out_std)

    def __call__(self, x, tp_axis=None, ep_axis=None):
        """x [B, T, D] -> (x, [aux_loss, dropped_frac]) (zeros for a dense block)."""
        x = x + self.attn(self.ln1(x), tp_axis)
        if isinstance(self.mlp, MoE):
            y, stats = self.mlp(self.ln2(x), tp_axis, ep_axis)
            return x + y, stats
        return x + self.mlp(self.ln2(x), tp_axis), jnp.zeros((2,), jnp.float32)


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
        blocks = [Block(cfg, rngs, dtype, is_moe_block(cfg, i)) for i in range(cfg.n_layers)]
        self.blocks = _stack(blocks) if cfg.scan_layers else nnx.List(blocks)
        self.ln_f = _norm(cfg, dtype)
        self.head = None if cfg.tie_embeddings else _normal(rngs, (cfg.d_model, cfg.vocab_size), 0.02, dtype)
        self.scan_layers, self.remat = cfg.scan_layers, cfg.remat

    def _run_blocks(self, x, tp_axis, ep_axis):
        """x [B, T, D] -> (x, [aux_loss, dropped_frac] summed over the blocks).

        Each block is one FSDP unit (`units.unit`): under ZeRO-3 its params are gathered just
        before it runs and its grads reduce-scattered right after its backward."""

        def layer(graphdef, state, x):  # one block from its params; x [B, T, D]
            # remat: Megatron's full recompute, keeping only each block's input for backward
            block = lambda state, x: nnx.merge(graphdef, state)(x, tp_axis, ep_axis)  # noqa: E731
            return units.unit(block, state, x, remat=self.remat)
        if self.scan_layers:
            graphdef, states = nnx.split(self.blocks)
            x, stats = jax.lax.scan(lambda x, s: layer(graphdef, s, x), x, states)
            return x, stats.sum(axis=0)
        stats = jnp.zeros((2,), jnp.float32)
        for block in self.blocks:
            x, s = layer(*nnx.split(block), x)
            stats = stats + s
        return x, stats

    def __call__(self, tokens, tp_axis=None, ep_axis=None):
        """tokens [B, T] int -> (logits [B, T, V] fp32, [aux_loss, dropped_frac] summed over MoE blocks)."""
        x = self.tok_emb[...][tokens]
        if self.pos_emb is not None:
            x = x + self.pos_emb[...][: tokens.shape[1]]
        x, stats = self._run_blocks(x, tp_axis, ep_axis)
        x = self.ln_f(x)
        head = self.tok_emb[...].T if self.head is None else self.head[...]
        return jnp.einsum("btd,dv->btv", x, head, preferred_element_type=jnp.float32), stats


class GPTModel:
    """The functional face of `GPT`: params are a plain nested dict of arrays.

    init() -> params; loss(params, tokens) -> mean next-token cross-entropy (plus the MoE
    blocks' load-balancing loss), where tokens are [B, T + 1] int32 (inputs are
    tokens[:, :-1], targets tokens[:, 1:]). With MoE the tokens of one call are one routing
    group: a single device reproduces a data-parallel run by calling it per rank and
    microbatch (`tests/helpers.py`).
    """

    def __init__(self, cfg: ModelConfig, param_dtype=jnp.float32, seed: int = 0):
        self.cfg, self.dtype, self.seed = cfg, jnp.dtype(param_dtype), seed
        self.graphdef = nnx.graphdef(nnx.eval_shape(lambda: GPT(cfg, nnx.Rngs(seed), self.dtype)))

    @property
    def n_moe_blocks(self) -> int:
        return sum(is_moe_block(self.cfg, i) for i in range(self.cfg.n_layers))

    def init(self):
        """Params (nested dict) from `seed`; call under jit with out_shardings to shard at birth."""
        return nnx.split(GPT(self.cfg, nnx.Rngs(self.seed), self.dtype), nnx.Param)[1].to_pure_dict()

    def abstract_params(self):
        return jax.eval_shape(self.init)

    def _stacked(self, path) -> bool:
        return self.cfg.scan_layers and jax.tree_util.keystr(path[:1], simple=True) == "blocks"

    def tp_specs(self, params) -> dict:
        """Model-parallel PartitionSpec per param (tp, and ep on expert dims), same structure as params."""
        return jax.tree_util.tree_map_with_path(
            lambda path, x: tp_spec(_name(path), x.ndim, self._stacked(path)), params
        )

    def units(self, params) -> dict:
        """Per param, its FSDP unit (`jzero.zero.build.build_zero`'s `units`): each block is one
        unit, whose params have 1 leading stacked-layer dim with `scan_layers` (else 0); the
        embeddings, final norm and head are in none."""
        return jax.tree_util.tree_map_with_path(
            lambda path, _: int(self._stacked(path)) if _name(path).startswith("blocks/") else None, params
        )

    def is_expert(self, params) -> dict:
        """Per param, whether it is an expert weight (data-parallel over the expert-DP domain)."""
        return jax.tree_util.tree_map_with_path(
            lambda path, _: re.search(EXPERT_PATTERN, _name(path)) is not None, params
        )

    def layer_ndims(self, params) -> dict:
        """Per param, its dims per layer and expert: with `scan_layers` the stacked [L] dim does not
        count (a stacked norm scale [L, D] is a 1-D param of each layer, for weight decay), nor
        does an expert weight's [E] dim."""

        def ndim(path, x):
            return x.ndim - self._stacked(path) - (re.search(EXPERT_PATTERN, _name(path)) is not None)

        return jax.tree_util.tree_map_with_path(ndim, params)

    def loss_and_metrics(self, params, tokens, tp_axis=None, ep_axis=None):
        """(loss, metrics): metrics is {} for a dense model, else the MoE blocks' mean
        `aux_loss` (before its coefficient) and `dropped_frac`."""
        logits, stats = nnx.merge(self.graphdef, params)(tokens[:, :-1], tp_axis, ep_axis)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
        n = self.n_moe_blocks
        if n == 0:
            return loss, {}
        loss = loss + self.cfg.moe.aux_loss_coef * stats[0]
        return loss, {"aux_loss": stats[0] / n, "dropped_frac": stats[1] / n}

    def loss(self, params, tokens, tp_axis=None, ep_axis=None):
        return self.loss_and_metrics(params, tokens, tp_axis, ep_axis)[0]


def _name(path) -> str:
    return jax.tree_util.keystr(path, simple=True, separator="/")
