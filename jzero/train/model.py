"""A GPT in flax NNX with Megatron-style tensor parallelism expressed as sharding specs; its
layers are in `layers.py`, `GPTModel` is its `jzero.model.Model`.

Shapes (B batch, T seq, D d_model, H heads, G kv heads, R = H/G, K head dim, F d_ff,
V vocab, L layers), with the tp split Megatron uses (column-parallel QKV/FC1,
row-parallel proj/FC2):
  tok_emb[V, D]  pos_emb[T, D] (pos=learned only)  head[D, V] (untied only)
  attn/qkv/kernel[D, R + 2, G_tp, K]   per kv group: its R query heads, then key, value
                                       (Megatron's grouped layout; [D, 3, H_tp, K] without GQA)
  attn/qkv/bias[R + 2, G_tp, K]        with model.qkv_bias (Megatron's --add-bias-linear)
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

import re

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from jzero.config import ModelConfig, PosKind, RematKind
from jzero.mesh import EP_AXIS
from jzero.model import TokenExchange
from jzero.train import moe
from jzero.train.layers import N_STATS, Block, Keys, MoE, is_moe_block, norm, normal
from jzero.zero.common import units
from jzero.zero.common.muon import MatrixView

# Megatron's tensor-parallel layout, by param path suffix; everything else is replicated over tp.
# Specs are right-aligned on the param's shape (the tp dim counted from the end), so the
# extra dims of the options (the [L] layer stack, swiglu's [2] gate/up pair) are never split.
TP_RULES = (
    (r"attn/qkv/kernel$", P(None, None, "tp", None)),
    (r"attn/qkv/bias$", P(None, "tp", None)),
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


def _stack(blocks: list[Block]) -> Block:
    """One Block whose params are the blocks' params stacked on a leading [L] dim."""
    graphdef = nnx.graphdef(blocks[0])
    states = [nnx.split(b)[1] for b in blocks]
    return nnx.merge(graphdef, jax.tree.map(lambda *xs: jnp.stack(xs), *states))


def param_count(cfg: ModelConfig) -> int:
    """The GPT's parameter count from its config alone, in milliseconds at any depth (the model's own
    build traces every block): the shapes of one dense and one MoE block, times how many there are."""

    def numel(make) -> int:
        state = nnx.state(nnx.eval_shape(make), nnx.Param)
        return sum(x.size for x in jax.tree.leaves(state))

    def block(is_moe: bool) -> int:
        return numel(lambda: Block(cfg, Keys(0), jnp.float32, is_moe))

    n_moe = sum(is_moe_block(cfg, i) for i in range(cfg.n_layers))
    total = n_moe * block(True) if n_moe else 0
    total += (cfg.n_layers - n_moe) * block(False) if cfg.n_layers > n_moe else 0
    total += cfg.vocab_size * cfg.d_model * (1 if cfg.tie_embeddings else 2)
    total += cfg.seq_len * cfg.d_model if cfg.pos == PosKind.LEARNED else 0
    return total + numel(lambda: norm(cfg, jnp.float32))


class GPT(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: Keys, dtype=jnp.float32):
        self.tok_emb = normal(rngs, (cfg.vocab_size, cfg.d_model), 0.02, dtype)
        learned = cfg.pos == PosKind.LEARNED
        self.pos_emb = normal(rngs, (cfg.seq_len, cfg.d_model), 0.01, dtype) if learned else None
        # Built one by one either way, so scan_layers stacks exactly the params of the loop.
        blocks = [Block(cfg, rngs, dtype, is_moe_block(cfg, i)) for i in range(cfg.n_layers)]
        self.blocks = _stack(blocks) if cfg.scan_layers else nnx.List(blocks)
        self.ln_f = norm(cfg, dtype)
        self.head = None if cfg.tie_embeddings else normal(rngs, (cfg.d_model, cfg.vocab_size), 0.02, dtype)
        remat = RematKind(cfg.remat)  # a ModelConfig built in Python may hold a bool
        self.scan_layers, self.remat = cfg.scan_layers, remat != RematKind.NONE
        selective = remat == RematKind.SELECTIVE
        self.remat_policy = jax.checkpoint_policies.dots_with_no_batch_dims_saveable if selective else None

    def _run_blocks(self, x, tp_axis, ep_axis, dp_axes, bias):
        """x [B, T, D] -> (x, [aux_loss, dropped_frac, z_loss] summed over the blocks, tokens per expert
        [n_moe, E] or None for a dense model); bias: the MoE blocks' expert bias [n_moe, E], or None.

        Each block is one FSDP unit (`units.unit`): under ZeRO-3 its params are gathered just
        before it runs and its grads reduce-scattered right after its backward."""

        def layer(graphdef, state, x, b, in_scan=False):  # one block; x [B, T, D], b its bias [E] or None
            # remat: Megatron's full recompute, keeping only each block's input for backward (selective: and
            # its matmul outputs); in the scan without jax.checkpoint's CSE barrier, so XLA can prefetch the
            # next layer's gathers
            block = lambda state, x, b: nnx.merge(graphdef, state)(x, tp_axis, ep_axis, dp_axes, b)  # noqa: E731
            return units.unit(block, state, x, b, remat=self.remat, policy=self.remat_policy, prevent_cse=not in_scan)

        if self.scan_layers:  # every block is MoE, or none (model.moe.every=1)
            graphdef, states = nnx.split(self.blocks)

            def body(x, xs):
                x, s, c = layer(graphdef, xs[0], x, xs[1], in_scan=True)
                return x, (s, c)

            x, (stats, counts) = jax.lax.scan(body, x, (states, bias))
            return x, stats.sum(axis=0), counts
        stats, counts = jnp.zeros((N_STATS,), jnp.float32), []
        for block in self.blocks:
            b = bias[len(counts)] if bias is not None and isinstance(block.mlp, MoE) else None
            x, s, c = layer(*nnx.split(block), x, b)
            stats = stats + s
            counts += [] if c is None else [c]
        return x, stats, jnp.stack(counts) if counts else None

    def __call__(self, tokens, tp_axis=None, ep_axis=None, dp_axes=(), bias=None):
        """tokens [B, T] int -> (logits [B, T, V] fp32, [aux_loss, dropped_frac, z_loss] summed over MoE
        blocks, tokens per expert [n_moe, E] or None); bias: the expert bias [n_moe, E] fp32, or None."""
        x, head, stats, counts = self.features(tokens, tp_axis, ep_axis, dp_axes, bias)
        return head_logits(x, head), stats, counts

    def features(self, tokens, tp_axis=None, ep_axis=None, dp_axes=(), bias=None):
        """`__call__` up to the logits: (the final norm's output [B, T, D], the head [D, V], stats, counts)."""
        x = embedding_lookup(self.tok_emb[...], tokens)
        if self.pos_emb is not None:
            x = x + self.pos_emb[...][: tokens.shape[1]]
        x, stats, counts = self._run_blocks(x, tp_axis, ep_axis, dp_axes, bias)
        head = self.tok_emb[...].T if self.head is None else self.head[...]
        return self.ln_f(x), head, stats, counts


@jax.custom_vjp
def embedding_lookup(table, ids):
    """table[ids], whose backward sums each id's grads in fp32 and casts the [V, D] grad to the table's dtype
    once, as PyTorch's embedding backward accumulates: the plain lookup's transpose scatter-adds in the
    table's dtype, and in bf16 a frequent token's many grads lose most of their sum (2.6e-2 of the largest
    against the other grads' 4e-3, `tests/train/test_model_options.py`)."""
    return table[ids]


def _lookup_fwd(table, ids):
    return table[ids], (table, ids)


def _lookup_bwd(res, g):
    table, ids = res
    grad = jnp.zeros(table.shape, jnp.float32).at[ids].add(g.astype(jnp.float32))
    return grad.astype(table.dtype), None


embedding_lookup.defvjp(_lookup_fwd, _lookup_bwd)


_HEAD = "...d,dv->...v"  # x [..., D] through head [D, V]


@jax.custom_vjp
def head_logits(x, head):
    """x [..., D] through head [D, V] -> fp32 logits [..., V] (the matmul accumulates in fp32).

    Its backward runs both matmuls on the logits' grad cast to the compute dtype, as Megatron's output
    layer's backward does under --bf16 (its logits, and so their grad, are bf16). The plain einsum's
    transpose keeps the fp32 grad and runs both in fp32, at half bf16's rate at best on an H100 (TF32):
    13% of LLaMA-3.2-1B's step flops (docs/precision.md). With fp32 params, the plain einsum's program."""
    return jnp.einsum(_HEAD, x, head, preferred_element_type=jnp.float32)


def _head_fwd(x, head):
    return head_logits(x, head), (x, head)


def _head_bwd(res, g):
    x, head = res
    _, vjp = jax.vjp(lambda x, head: jnp.einsum(_HEAD, x, head), x, head)
    return vjp(g.astype(jnp.result_type(x, head)))


head_logits.defvjp(_head_fwd, _head_bwd)


@jax.custom_vjp
def cross_entropy(logits, labels):
    """Per token, logsumexp(logits) - logits[label]: fp32 logits [..., V], int labels [...] -> [...]
    (`optax.softmax_cross_entropy_with_integer_labels` to fp32 rounding).

    The logsumexp is one pass over the logits (`_logsumexp`), where `jax.nn.logsumexp` takes two (the max,
    then the sum). Its backward is one elementwise pass over the logits, (softmax - one_hot) x grad, with
    the one-hot a comparison against an iota; autodiff's scatter-adds the labels' -1 into a zeroed [..., V]
    array and adds it in a pass of its own (docs/precision.md)."""
    return _ce_fwd(logits, labels)[0]


def _logsumexp(logits):
    """logsumexp over the last axis in one pass: a reduction of (running max, sum of exp(x - max)) pairs."""

    def combine(a, b):
        (ma, sa), (mb, sb) = a, b
        hi, lo = jnp.maximum(ma, mb), jnp.minimum(ma, mb)
        s_hi, s_lo = jnp.where(ma >= mb, sa, sb), jnp.where(ma >= mb, sb, sa)
        return hi, s_hi + s_lo * jnp.exp(jnp.where(lo == hi, 0.0, lo - hi))  # both -inf (the inits): 0, not nan

    init = (jnp.asarray(-jnp.inf, logits.dtype), jnp.zeros((), logits.dtype))
    m, s = jax.lax.reduce((logits, jnp.ones_like(logits)), init, combine, (logits.ndim - 1,))
    return m + jnp.log(s)


def _ce_fwd(logits, labels):
    lse = _logsumexp(logits)
    label_logits = jnp.take_along_axis(logits, labels[..., None], axis=-1)[..., 0]
    return lse - label_logits, (logits, labels, lse)


def _ce_bwd(res, g):
    logits, labels, lse = res
    vocab = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)  # int32: a narrower label dtype wraps
    one_hot = labels[..., None].astype(jnp.int32) == vocab
    return (jnp.exp(logits - lse[..., None]) - one_hot) * g[..., None], None


cross_entropy.defvjp(_ce_fwd, _ce_bwd)


def chunked_cross_entropy(x, head, labels, chunk: int):
    """The mean next-token cross-entropy of x [N, D] through head [D, V] against labels [N], `chunk` tokens at a
    time: each chunk's fp32 logits [chunk, V] are made, reduced and dropped, and made again for its backward
    (`jax.checkpoint` in a `lax.map`), so the [N, V] logits never exist at once. N is padded to whole chunks with
    masked-out rows."""
    n = x.shape[0]
    chunk = min(chunk, n)  # a chunk above the tokens: one chunk of them all, not one padded to its size
    chunks = -(-n // chunk)
    pad = chunks * chunk - n
    xs = jnp.pad(x, ((0, pad), (0, 0))).reshape(chunks, chunk, -1)
    ls = jnp.pad(labels, (0, pad)).reshape(chunks, chunk)
    keep = (jnp.arange(chunks * chunk) < n).reshape(chunks, chunk)

    @jax.checkpoint
    def one(part):  # no carry: a zero to start from would be typed DP-invariant inside a ZeRO step's shard_map
        xc, lc, kc = part
        return jnp.sum(cross_entropy(head_logits(xc, head), lc) * kc)

    return jnp.sum(jax.lax.map(one, (xs, ls, keep))) / n


class GPTModel:
    """The functional face of `GPT`: params are a plain nested dict of arrays.

    init() -> params; loss(params, tokens) -> mean next-token cross-entropy (plus the MoE
    blocks' load-balancing and z losses), where tokens are [B, T + 1] int32 (inputs are
    tokens[:, :-1], targets tokens[:, 1:]). With MoE the tokens of one call are one routing
    group: a single device reproduces a data-parallel run by calling it per rank and
    microbatch (`tests/helpers/__init__.py`).

    dp_axes: the axes the loss's data-parallel ranks are spread over when it runs (the mesh's
    `BATCH_AXES` inside the ZeRO step's shard_map; a vmap axis for a single-device reference);
    `model.moe.aux_loss_kind: global` sums its expert counts over them. () = each call's
    tokens are the whole batch.
    """

    param_count = staticmethod(param_count)  # from the config alone (`jzero.model.param_count`)

    def __init__(self, cfg: ModelConfig, param_dtype=jnp.float32, seed: int = 0, dp_axes: tuple[str, ...] = ()):
        self.cfg, self.dtype, self.seed, self.dp_axes = cfg, jnp.dtype(param_dtype), seed, tuple(dp_axes)
        self.graphdef = nnx.graphdef(nnx.eval_shape(lambda: GPT(cfg, Keys(seed), self.dtype)))

    @property
    def n_moe_blocks(self) -> int:
        return sum(is_moe_block(self.cfg, i) for i in range(self.cfg.n_layers))

    def init(self):
        """Params (nested dict) from `seed`; call under jit with out_shardings to shard at birth."""
        return nnx.split(GPT(self.cfg, Keys(self.seed), self.dtype), nnx.Param)[1].to_pure_dict()

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

    def muon_matrices(self, params) -> dict:
        """Per param, the matrix (or matrices) Megatron's Muon orthogonalises in each layer and expert
        (`groups.muon`'s `matrices`), or None (AdamW): the fused qkv [D, R + 2, G, K] split into q, k and v
        (Megatron's default `--muon-split-qkv`), the attention output [H, K, D] as [H*K, D] (Megatron's
        `linear_proj`), fc1 [D, (2,) F] as one matrix (swiglu's gate and up, as Megatron's `linear_fc1`),
        and every other param that is 2-D per layer as itself; the embeddings and head are AdamW by name."""
        ndims = self.layer_ndims(params)

        def view(path, x, ndim):
            name, per = _name(path), x.shape[x.ndim - ndim :]
            if name.endswith("attn/qkv/kernel"):
                return MatrixView(1, 1, (per[1] - 2, 1, 1))
            if name.endswith("attn/proj/kernel"):
                return MatrixView(2)
            if name.endswith("fc1/kernel"):
                return MatrixView(1)
            return MatrixView() if ndim == 2 else None

        return jax.tree_util.tree_map_with_path(view, params, ndims)

    def loss_and_metrics(self, params, tokens, tp_axis=None, ep_axis=None):
        """(loss, metrics): metrics is {} for a dense model, else the MoE blocks' means, before their
        coefficients, of the load-balancing loss (named by its kind, `moe.AUX_METRIC`), of
        `dropped_frac` and, with `z_loss_coef` > 0, of `z_loss`. With `expert_bias`, the loss at the
        initial (zero) bias; training runs `loss_with_state`."""
        return self.loss_with_state(params, tokens, self.init_state(), tp_axis, ep_axis)[:2]

    def loss(self, params, tokens, tp_axis=None, ep_axis=None):
        return self.loss_and_metrics(params, tokens, tp_axis, ep_axis)[0]

    # The model state (`jzero.model.model_state`): with `model.moe.expert_bias`, each MoE block's bias.

    def init_state(self) -> dict | None:
        """{"expert_bias": [n_moe, E] fp32 zeros} with `model.moe.expert_bias` (Megatron's buffer, one
        row per MoE block in block order), else None: no state."""
        o = self.cfg.moe
        if not (o.expert_bias and self.n_moe_blocks):
            return None
        return {"expert_bias": jnp.zeros((self.n_moe_blocks, o.num_experts), jnp.float32)}

    def loss_with_state(self, params, tokens, model_state, tp_axis=None, ep_axis=None):
        """(loss, metrics, stats): `loss_and_metrics`'s, routing with the state's expert bias (None: no
        bias); stats {"tokens_per_expert": [n_moe, E] fp32}, the copies each MoE block's experts ran
        (after dropping), {} without expert bias."""
        bias = None if model_state is None else model_state["expert_bias"]
        gpt = nnx.merge(self.graphdef, params)
        if self.cfg.loss_chunk is None:
            logits, stats, counts = gpt(tokens[:, :-1], tp_axis, ep_axis, self.dp_axes, bias)
            loss = cross_entropy(logits, tokens[:, 1:]).mean()
        else:
            x, head, stats, counts = gpt.features(tokens[:, :-1], tp_axis, ep_axis, self.dp_axes, bias)
            labels = tokens[:, 1:].reshape(-1)
            loss = chunked_cross_entropy(x.reshape(-1, x.shape[-1]), head, labels, self.cfg.loss_chunk)
        n, o = self.n_moe_blocks, self.cfg.moe
        if n == 0:
            return loss, {}, {}
        loss = loss + o.aux_loss_coef * stats[0] + o.z_loss_coef * stats[2]
        metrics = {moe.AUX_METRIC[o.aux_loss_kind]: stats[0] / n, "dropped_frac": stats[1] / n}
        metrics |= {"z_loss": stats[2] / n} if o.z_loss_coef > 0 else {}
        return loss, metrics, {} if bias is None else {"tokens_per_expert": counts}

    def update_state(self, model_state, stats):
        """Once per step, the tokens per expert summed over the step's ranks and micro-batches ->
        (the new state, metrics): Megatron's bias update (`moe.updated_expert_bias`); metrics
        `load_max_violation`, the MoE blocks' mean of (max_e - mean) / mean tokens per expert (the
        MaxVio of Loss-Free Balancing, 0 when balanced), and `expert_bias_min` / `expert_bias_max`
        over every block's new bias."""
        counts = stats["tokens_per_expert"]
        bias = moe.updated_expert_bias(model_state["expert_bias"], counts, self.cfg.moe.bias_update_rate)
        mean = counts.mean(axis=-1)
        violation = jnp.mean((counts.max(axis=-1) - mean) / jnp.maximum(mean, 1.0))
        metrics = {"load_max_violation": violation, "expert_bias_min": bias.min(), "expert_bias_max": bias.max()}
        return {"expert_bias": bias}, metrics

    # What the inspect tools ask a model (`jzero.model`): the estimates only the model can give.

    @property
    def remat(self) -> bool:
        """Each block recomputes its forward, or part of it, for its backward (`model.remat`: full, selective)."""
        return RematKind(self.cfg.remat) != RematKind.NONE

    def token_exchange(self, tokens: int) -> TokenExchange | None:
        """The all-to-alls of one rank's micro-batch of `tokens` (None for a dense model): each MoE block
        sends the tokens' expert slots [E, C, D] (`moe.dispatch`, C the capacity of `tokens`), or dropless
        its routed copies [k N, D] by a ragged all-to-all, to the experts' ep ranks and gets the outputs
        back, 2 all-to-alls forward, their 2 transposes backward, and 2 more where remat recomputes the
        forward."""
        m = self.cfg.moe
        if self.n_moe_blocks == 0:
            return None
        cap = moe.capacity(tokens, m.num_experts, m.top_k, m.capacity_factor)
        rows = m.top_k * tokens if cap is None else m.num_experts * cap  # dropless: the routed copies
        slot_bytes = rows * self.cfg.d_model * self.dtype.itemsize
        return TokenExchange(slot_bytes, self.n_moe_blocks * (6 if self.remat else 4), dropless=cap is None)

    def activation_bytes(self, rows: int, tp: int) -> int:
        """A floor, never an estimate, so that no config that fits is refused: the residual stream's
        [rows, T, D] input of each block (kept even with remat; not split over tp) and the fp32 logits
        [rows, T, V] the loss reads in backward. XLA's temporaries, attention and the MLP come on top."""
        c = self.cfg
        return rows * c.seq_len * (c.n_layers * c.d_model * self.dtype.itemsize + c.vocab_size * 4)

    def attention_elements(self, rows: int, tp: int) -> int:
        """Elements of one [rows, H/tp, T, T] attention-score buffer (scores, probabilities, their grads)."""
        t = self.cfg.seq_len
        return rows * max(self.cfg.n_heads // tp, 1) * t * t


def _name(path) -> str:
    return jax.tree_util.keystr(path, simple=True, separator="/")
