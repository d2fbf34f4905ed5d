"""GPT's layers in flax NNX: norms, rotary embeddings, attention, the MLP, the MoE MLP, the block.

Shapes and the tp split of their params: `jzero.train.model`'s docstring. Each layer's forward
derives its head and expert counts from its kernels' shapes, so it runs on global arrays under jit
and on tp-local (and ep-local) shards inside shard_map, where `tp_axis` names the axis its
row-parallel output is summed over (Megatron's `g` operator) and `ep_axis` the one tokens travel
over to their experts (`moe.py`).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from jzero.config import MlpKind, ModelConfig, NormKind, PosKind, ScoreFunction
from jzero.mesh import TP_AXIS
from jzero.train import moe


class Keys:
    """The keys `nnx.Rngs(seed).params()` gives, in the same order and bits (`fold_in(key(seed), i)` for
    the i-th), counted by a Python int: nnx counts in an array, which under `jax.eval_shape` is a
    tracer, and each of its updates then reads the tracer's sharding, whose error message walks the
    whole trace so far: `jzero.run.build_run` of LLaMA-3-405B took 9.8 s so, 1.6 s with this."""

    def __init__(self, seed: int):
        self.key, self.count = jax.random.key(seed), 0

    def params(self) -> jax.Array:
        self.count += 1
        return jax.random.fold_in(self.key, self.count - 1)


def normal(rngs: nnx.Rngs | Keys, shape, std: float, dtype) -> nnx.Param:
    return nnx.Param((std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype))


def _zeros(shape, dtype) -> nnx.Param:
    return nnx.Param(jnp.zeros(shape, dtype))


def _recomputed(f):
    """`f`, whose backward recomputes its values from its inputs instead of keeping them (`jax.checkpoint`).

    For the elementwise parts of a block (norms, activations): in a layer scan XLA:GPU copies every value the
    backward keeps into an `[L, ...]` stack and out again, and a norm keeps its fp32 intermediates. Keeping
    only the inputs, LLaMA-3.2-1B's scanned bf16 step moves 45 GB less to and from HBM and holds 11 GiB less
    temp (docs/precision.md). Without a CSE barrier: unscanned, XLA may merge the recompute with the forward's
    values (the 1B unrolled moves the same bytes either way)."""
    return jax.checkpoint(f, prevent_cse=False)


def _layer_norm(x, scale, bias):  # [B, T, D], statistics in fp32
    xf = x.astype(jnp.float32)
    mean = xf.mean(-1, keepdims=True)
    var = jnp.square(xf - mean).mean(-1, keepdims=True)
    y = (xf - mean) * jax.lax.rsqrt(var + 1e-5) * scale.astype(jnp.float32)
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return y.astype(x.dtype)


def _rms_norm(x, scale):  # [B, T, D], statistics in fp32
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.square(xf).mean(-1, keepdims=True) + 1e-5)
    return (y * scale.astype(jnp.float32)).astype(x.dtype)


def _swiglu(gate, up):
    return jax.nn.silu(gate) * up


class LayerNorm(nnx.Module):
    def __init__(self, d: int, dtype, bias: bool = True):
        self.scale = nnx.Param(jnp.ones((d,), dtype))
        self.bias = _zeros((d,), dtype) if bias else None

    def __call__(self, x):  # [B, T, D], statistics in fp32
        return _recomputed(_layer_norm)(x, self.scale[...], None if self.bias is None else self.bias[...])


class RMSNorm(nnx.Module):
    def __init__(self, d: int, dtype):
        self.scale = nnx.Param(jnp.ones((d,), dtype))

    def __call__(self, x):  # [B, T, D], statistics in fp32
        return _recomputed(_rms_norm)(x, self.scale[...])


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


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def project(eq: str, x, w):
    """`jnp.einsum(eq, x, w)` of an activation x and a weight w whose backward makes w's grad in w's own dim order
    (for "btd,dsf->btsf": einsum("btd,btsf->dsf")); x's grad is autodiff's. Autodiff's transpose makes the weight
    grad of a projection with two output dims ([s, f]) in the output's order ([s, f, d]) and transposes it after,
    which XLA:GPU runs in the layer loop's backward as a pass over the fp32 grad before its reduction: 3.5% of
    LLaMA-2-7B's ZeRO-3 step at an H100's roofline (experiments/bench/README.md, "Roofline, deviceless")."""
    return jnp.einsum(eq, x, w)


def _project_fwd(eq, x, w):
    return jnp.einsum(eq, x, w), (x, w)


def _project_bwd(eq, res, g):
    x, w = res
    xs, rest = eq.split(",")
    ws, ys = rest.split("->")
    (dx,) = jax.linear_transpose(lambda x: jnp.einsum(eq, x, w), x)(g)  # autodiff's, without a forward to drop
    return dx, jnp.einsum(f"{xs},{ys}->{ws}", x, g)


project.defvjp(_project_fwd, _project_bwd)


def _add_bias(y, layer: nnx.Dict):
    return y + layer["bias"][...] if "bias" in layer else y


def rope(x, theta: float = 10000.0):
    """Rotary position embedding (LLaMA's rotate-half form) of x[B, T, ..., K], in fp32."""
    t, k = x.shape[1], x.shape[-1]
    freq = theta ** (-jnp.arange(0, k, 2, dtype=jnp.float32) / k)  # [K/2]
    angle = jnp.arange(t, dtype=jnp.float32).reshape(t, *[1] * (x.ndim - 3), 1) * freq  # [T, 1.., K/2]
    cos, sin = jnp.cos(angle), jnp.sin(angle)
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def causal_attention(q, k, v, kernel: str):
    """softmax(q k^T / sqrt(K)) v, causal: q [B, T, R, G, K], k and v [B, T, G, K] -> [B, T, H, K], query head
    h = g * R + r attending kv head g.

    kernel "xla": written out, the [B, G, R, T, T] scores in fp32. kernel "cudnn": cuDNN's fused kernel
    through `jax.nn.dot_product_attention` (q as [B, T, H, K], its GQA grouping). It partitions itself
    under jit, but not inside a shard_map that leaves some mesh axes to the partitioner (the spec path's
    data-parallel ranks; JAX 0.10 fails to compile it): there it runs in a nested shard_map over those
    axes, its heads split over tp as the QKV kernel's are. (XLA's form through `jax.nn.dot_product_attention`,
    q moved to [B, T, H, K] first, held 3 GiB more at LLaMA-2-7B ZeRO-1's peak on 8 H100s: 23.60 against
    20.54 GiB of temporaries, measured 2026-11-27.)"""
    if kernel == "xla":
        scores = jnp.einsum("btrgk,bsgk->bgrts", q, k).astype(jnp.float32) / math.sqrt(q.shape[-1])
        t = k.shape[1]
        # `where`, not an added mask (the same bits): the added one keeps no [B, H, T, T] residual but
        # XLA then leaves a ZeRO-3 backward gather exposed (docs/overlap.md, "Measured", memory).
        causal = jnp.tril(jnp.ones((t, t), bool))
        probs = jax.nn.softmax(jnp.where(causal, scores, -1e30), axis=-1).astype(v.dtype)
        out = jnp.einsum("bgrts,bsgk->btgrk", probs, v)
        return out.reshape(*out.shape[:2], -1, out.shape[-1])  # [B, T, H, K], h = g * R + r

    def attend(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=kernel)

    q = jnp.swapaxes(q, 2, 3).reshape(*k.shape[:2], -1, k.shape[-1])  # [B, T, G, R, K] -> [B, T, H, K]
    mesh = jax.sharding.get_abstract_mesh()
    auto = () if mesh.empty else tuple(a for a in mesh.axis_names if a not in mesh.manual_axes)
    if not mesh.manual_axes or not auto:
        return attend(q, k, v)
    heads = P(None, None, TP_AXIS if TP_AXIS in auto else None, None)
    return jax.shard_map(attend, mesh=mesh, in_specs=heads, out_specs=heads, axis_names=set(auto), check_vma=False)(
        q, k, v
    )


def _reduce_tp(x, tp_axis: str | None):
    return x if tp_axis is None else jax.lax.psum(x, tp_axis)


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, dtype, out_std: float):
        d, h = cfg.d_model, cfg.n_heads
        g = cfg.n_kv_heads or h
        # A QKV bias only with model.qkv_bias (Megatron's): its key part cannot change the output (softmax is
        # shift-invariant), so its true gradient is 0 and Adam turns rounding noise into full-size steps.
        qkv = (d, h // g + 2, g, d // h)  # bias: [R + 2, G_tp, K]
        self.qkv = _linear(rngs, qkv, 0.02, dtype, qkv[1:] if cfg.qkv_bias else None)
        self.proj = _linear(rngs, (h, d // h, d), out_std, dtype, (d,) if cfg.bias else None)
        self.rope = cfg.pos == PosKind.ROPE
        self.attention = cfg.attention

    def __call__(self, x, tp_axis=None):  # x [B, T, D]
        # Token-major, as the matmul writes it: [R + 2, B, T, ...] cost a transpose of the output and of its grad
        # (experiments/bench/README.md, "Roofline, deviceless"); q, k, v are strided slices fusions read in place.
        qkv = _add_bias(project("btd,dsgk->btsgk", x, self.qkv["kernel"][...]), self.qkv)  # bias [R + 2, G_tp, K]
        q, k, v = qkv[:, :, :-2], qkv[:, :, -2], qkv[:, :, -1]  # q [B, T, R, G, K]; k, v [B, T, G, K]
        if self.rope:
            q, k = rope(q), rope(k)
        kernel = self.attention.kernel(jnp.dtype(q.dtype).name, q.shape[-1], jax.default_backend())
        out = causal_attention(q, k, v, kernel)
        y = _reduce_tp(jnp.einsum("bthk,hkd->btd", out, self.proj["kernel"][...]), tp_axis)
        return _add_bias(y, self.proj)


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, dtype, out_std: float):
        d, f = cfg.d_model, cfg.d_ff
        self.swiglu, self.exact = cfg.mlp == MlpKind.SWIGLU, cfg.mlp == MlpKind.GELU_EXACT
        fc1 = (d, 2, f) if self.swiglu else (d, f)
        self.fc1 = _linear(rngs, fc1, 0.02, dtype, fc1[1:] if cfg.bias else None)
        self.fc2 = _linear(rngs, (f, d), out_std, dtype, (d,) if cfg.bias else None)

    def __call__(self, x, tp_axis=None):  # x [B, T, D]
        if self.swiglu:
            # token-major, as the QKV projection (Attention.__call__)
            h = _add_bias(project("btd,dsf->btsf", x, self.fc1["kernel"][...]), self.fc1)  # bias [2, F_tp]
            gate, up = h[..., 0, :], h[..., 1, :]
            h = _recomputed(_swiglu)(gate, up)  # [B, T, F_tp]
        else:
            h = _add_bias(x @ self.fc1["kernel"][...], self.fc1)  # [B, T, F_tp]
            # gelu: tanh; gelu_exact: erf (Megatron's)
            h = _recomputed(functools.partial(jax.nn.gelu, approximate=not self.exact))(h)
        return _add_bias(_reduce_tp(h @ self.fc2["kernel"][...], tp_axis), self.fc2)


class MoE(nnx.Module):
    """E MLPs (the dense MLP's shapes on a leading [E] dim) behind a top-k router (`moe.py`).

    With `capacity_factor` the experts run fixed slots [E_ep, ep * C, D] (tokens over capacity are
    dropped by `drop_policy`); without (dropless) they run the routed copies only, sorted by expert,
    as grouped matmuls."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, dtype, out_std: float):
        d, f, e = cfg.d_model, cfg.d_ff, cfg.moe.num_experts
        self.swiglu, self.exact = cfg.mlp == MlpKind.SWIGLU, cfg.mlp == MlpKind.GELU_EXACT
        self.options = cfg.moe
        fc1 = (e, d, 2, f) if self.swiglu else (e, d, f)
        self.router = nnx.Dict(kernel=normal(rngs, (d, e), 0.02, dtype))
        self.experts = nnx.Dict(
            fc1=_linear(rngs, fc1, 0.02, dtype, (e, *fc1[2:]) if cfg.bias else None),
            fc2=_linear(rngs, (e, f, d), out_std, dtype, (e, d) if cfg.bias else None),
        )

    def _activate(self, h, b1):  # fc1's output h[..., (2,) F_tp] plus its bias b1 -> [..., F_tp]
        if self.swiglu:
            h = h if b1 is None else h + b1
            return _recomputed(_swiglu)(h[..., 0, :], h[..., 1, :])
        return _recomputed(functools.partial(jax.nn.gelu, approximate=not self.exact))(h if b1 is None else h + b1)

    def _experts(self, x, tp_axis):  # x [E_ep, S, D] slots of the local experts
        fc1, fc2 = self.experts["fc1"], self.experts["fc2"]
        eq = "esd,edgf->esgf" if self.swiglu else "esd,edf->esf"
        b1 = fc1["bias"][...][:, None] if "bias" in fc1 else None
        h = self._activate(jnp.einsum(eq, x, fc1["kernel"][...]), b1)  # [E_ep, S, F_tp]
        y = _reduce_tp(jnp.einsum("esf,efd->esd", h, fc2["kernel"][...]), tp_axis)
        return y + fc2["bias"][...][:, None] if "bias" in fc2 else y

    def _grouped_experts(self, x, group_sizes, tp_axis):
        """x [R, D] rows in consecutive groups, `group_sizes[E_ep]` rows for each local expert ->
        [R, D]; rows after the last group give 0 (bias aside)."""
        fc1, fc2 = self.experts["fc1"], self.experts["fc2"]
        w1 = fc1["kernel"][...]
        h = moe.grouped_matmul(x, w1.reshape(*w1.shape[:2], -1), group_sizes)
        # The local expert of each row (the last one past the groups: those rows are never read back).
        row_expert = jnp.minimum(moe.row_groups(group_sizes, x.shape[0]), group_sizes.shape[0] - 1)
        b1 = fc1["bias"][...][row_expert] if "bias" in fc1 else None
        h = self._activate(h.reshape(x.shape[0], *w1.shape[2:]), b1)  # [R, F_tp]
        y = _reduce_tp(moe.grouped_matmul(h, fc2["kernel"][...], group_sizes), tp_axis)
        return y + fc2["bias"][...][row_expert] if "bias" in fc2 else y

    def _dropless(self, tokens, expert, tp_axis, ep_axis):
        """The routed copies [k*N, D] (choice-major) through their experts, routed rows only."""
        n, e, k = tokens.shape[0], self.options.num_experts, self.options.top_k
        order, counts = moe.sort_by_expert(expert, e)
        rows = tokens[order % n]  # [k*N, D] sorted by expert
        if ep_axis is None or jax.lax.axis_size(ep_axis) == 1:
            y = self._grouped_experts(rows, counts, tp_axis)
        else:
            ex = moe.plan_exchange(counts, n, k, ep_axis)
            ep = jax.lax.axis_size(ep_axis)
            buf = moe.exchange(rows, ex, ep * ex.chunk, ep_axis)  # room for the worst case, filled by the routed
            if e // ep == 1:  # one local expert: the source-major buffer is its one group
                y = self._grouped_experts(buf, ex.recv_counts.sum(axis=0), tp_axis)
            else:
                at = moe.expert_major(ex, buf.shape[0])
                y = self._grouped_experts(buf[at], ex.recv_counts.sum(axis=0), tp_axis)
                y = jnp.zeros_like(y).at[at].set(y)
            y = moe.exchange_back(y, ex, k * n, ep_axis)
        return jnp.zeros_like(y).at[order].set(y)  # back to choice-major

    def __call__(self, x, tp_axis=None, ep_axis=None, dp_axes=(), bias=None):
        """x [B, T, D] -> (y [B, T, D], [aux_loss, dropped_frac, z_loss], tokens_per_expert [E]).

        dp_axes: the axes the step's data-parallel ranks are spread over (the global
        load-balancing loss sums its expert counts over them). bias: the expert bias [E] fp32
        (replicated; None: none), added to the sigmoid scores to choose the top-k only.
        tokens_per_expert: the copies each expert runs (after dropping), no gradient."""
        o = self.options
        b, t, d = x.shape
        n, e = b * t, o.num_experts
        tokens = x.reshape(n, d)
        dtype = None if o.router_dtype is None else o.router_dtype.value
        logits = moe.router_logits(tokens, self.router["kernel"][...], dtype)
        probs, expert, weight = moe.choose(logits, o.top_k, o.score_function, bias)
        # The loss counts the unbiased top-k (Megatron's `compute_routing_scores_for_aux_loss`).
        aux_expert = expert if o.score_function == ScoreFunction.SOFTMAX else moe.top_experts(probs, o.top_k)
        aux = moe.load_balancing_loss(probs, aux_expert, o.top_k, o.aux_loss_kind, t, dp_axes)
        z = moe.z_loss(logits) if o.z_loss_coef > 0 else jnp.zeros((), jnp.float32)
        cap = moe.capacity(n, e, o.top_k, o.capacity_factor)
        if cap is None:
            y = moe.weighted_sum(self._dropless(tokens, expert, tp_axis, ep_axis), weight, n).astype(x.dtype)
            dropped, kept = jnp.zeros((), jnp.float32), None
        else:
            position = moe.queue_position(expert, weight, n, e, o.drop_policy)
            slot = moe.slots(expert, position, e, cap)
            kept = position < cap
            slots = moe.to_experts(moe.dispatch(tokens, slot, e, cap), ep_axis)
            y = moe.from_experts(self._experts(slots, tp_axis), ep_axis)
            y = moe.combine(y, slot, jnp.where(kept, weight, 0), n)
            # A count, not a mean of floats: exactly 0 when nothing is dropped.
            dropped = jnp.sum(~kept).astype(jnp.float32) / kept.size
        return y.reshape(b, t, d), jnp.stack([aux, dropped, z]), moe.tokens_per_expert(expert, kept, e)


N_STATS = 3  # a block's [aux_loss, dropped_frac, z_loss]


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

    def __call__(self, x, tp_axis=None, ep_axis=None, dp_axes=(), bias=None):
        """x [B, T, D] -> (x, [aux_loss, dropped_frac, z_loss], tokens_per_expert [E]) (zeros and None
        for a dense block); bias: a MoE block's expert bias [E], or None."""
        x = x + self.attn(self.ln1(x), tp_axis)
        if isinstance(self.mlp, MoE):
            y, stats, counts = self.mlp(self.ln2(x), tp_axis, ep_axis, dp_axes, bias)
            return x + y, stats, counts
        return x + self.mlp(self.ln2(x), tp_axis), jnp.zeros((N_STATS,), jnp.float32), None
