"""Token routing for a mixture-of-experts layer: router, capacity and drop policy, the router's
losses, and the two ways token copies reach their experts.

One rank routes its own N tokens (Megatron's `topk` router with `moe_router_pre_softmax`):
logits[N, E] = x @ router in the router dtype, p = softmax(logits) in fp32, and each token goes to
its top_k experts with weight p (no renormalisation). With sigmoid scores (DeepSeek-V3) s =
sigmoid(logits) instead, the top_k chosen by s + the expert bias (aux-loss-free balancing, when
there is one) and weighted by s without it, renormalized over the top_k. Copies are choice-major:
copy c * N + n is token n's c-th choice.

With a capacity C (`capacity`, Megatron's formula), expert e keeps at most C of the copies routed
to it, ranked by the drop policy (`queue_position`); the rest are dropped (weight 0, the token
keeps its residual path). Kept copies go to slots [E, C, D] (`dispatch`), `to_experts` /
`from_experts` move the slots over ep by all-to-all, and `combine` weights and sums each token's
choices.

Dropless (no capacity), the experts run the routed copies only: copies sorted by expert
(`sort_by_expert`), sent to the ep rank holding their expert by a ragged all-to-all that moves
only those rows (`Exchange`), multiplied by their expert's weights in a grouped matmul whose dots
cover the routed rows, not E x N (`grouped_matmul`).

A single device running the same tokens through these functions routes them identically: the
routing of a rank depends only on its own tokens (and, for the global load-balancing loss, on
the expert counts summed over the data-parallel axes it is given).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jzero.config import AuxLossKind, DropPolicy, ScoreFunction

# Rows per tile of `grouped_matmul` (`tile_rows`): the rows per group, within these bounds. On an
# H100 a loop turn costs about as much as a [128, 4096] x [4096, 14336] dot, so tiles of 1024
# rows run Mixtral's experts 2.5x faster than 128 (docs/moe.md); each group wastes at most one
# partial tile.
MIN_TILE, MAX_TILE = 128, 1024

AUX_METRIC = {  # metrics.jsonl's name of the load-balancing loss (Megatron's tracker names, less `load_`)
    AuxLossKind.MICRO_BATCH: "aux_loss",
    AuxLossKind.SEQUENCE: "seq_aux_loss",
    AuxLossKind.GLOBAL: "global_aux_loss",
}


# ---------------------------------------------------------------- router


def capacity(n_tokens: int, num_experts: int, top_k: int, capacity_factor: float | None) -> int | None:
    """Slots per expert, Megatron's `get_capacity(N * top_k, E, factor)`: ceil((N * top_k / E) * factor),
    at most N (no expert sees a token twice, so C = N drops nothing); None: dropless.

    The float expression is Megatron's, so both round alike (N=25, E=5, k=2, factor 1.1: 11, where
    ceil(factor * k * N / E) gives 12)."""
    if capacity_factor is None:
        return None
    return min(n_tokens, math.ceil((n_tokens * top_k / num_experts) * capacity_factor))


def router_logits(x: jax.Array, router: jax.Array, dtype=None) -> jax.Array:
    """x[N, D] @ router[D, E] -> logits[N, E] in `dtype` (Megatron's `moe_router_dtype`; None: x's)."""
    dtype = x.dtype if dtype is None else jnp.dtype(dtype)
    return jnp.dot(x.astype(dtype), router.astype(dtype), preferred_element_type=dtype)


def choose(
    logits: jax.Array,
    top_k: int,
    score_function: ScoreFunction = ScoreFunction.SOFTMAX,
    bias: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """logits[N, E] -> (probs[N, E] fp32, expert[k*N] int32, weight[k*N] in the logits' dtype), Megatron's
    `topk_routing_with_score_function` (ties: the lower expert).

    softmax (with `use_pre_softmax`): probs = softmax in fp32 whatever the logits' dtype; each token's
    top_k experts by probability, weighted by it. sigmoid: scores s = sigmoid(logits) in fp32; the
    top_k by s + `bias[E]` (fp32, the expert bias; None: 0), weighted by their s without the bias,
    divided by the top_k's sum (+1e-20) when top_k > 1. probs are then s normalized over every expert
    (Megatron's `compute_routing_scores_for_aux_loss`), what the load-balancing loss reads."""
    logits32 = logits.astype(jnp.float32)
    if score_function == ScoreFunction.SOFTMAX:
        probs = jax.nn.softmax(logits32, axis=-1)
        weight, expert = jax.lax.top_k(probs, top_k)  # [N, k]
    else:
        scores = jax.nn.sigmoid(logits32)
        _, expert = jax.lax.top_k(scores if bias is None else scores + bias.astype(jnp.float32), top_k)
        weight = jnp.take_along_axis(scores, expert, axis=-1)
        weight = weight / (weight.sum(axis=-1, keepdims=True) + 1e-20) if top_k > 1 else weight
        probs = scores / (scores.sum(axis=-1, keepdims=True) + 1e-20)
    return probs, expert.T.reshape(-1), weight.T.reshape(-1).astype(logits.dtype)


def top_experts(probs: jax.Array, top_k: int) -> jax.Array:
    """probs[N, E] -> each token's top_k experts by `probs`, [k*N] int32 choice-major: the routing the
    load-balancing loss counts (Megatron's: without the expert bias, before dropping)."""
    return jax.lax.top_k(probs, top_k)[1].T.reshape(-1)


def tokens_per_expert(expert: jax.Array, kept: jax.Array | None, num_experts: int) -> jax.Array:
    """[E] fp32: the copies each expert runs, `expert[k*N]` where `kept` (None: all), Megatron's
    `local_tokens_per_expert` (its routing map after dropping); no gradient."""
    ones = jnp.ones(expert.shape, jnp.float32) if kept is None else kept.astype(jnp.float32)
    return jax.lax.stop_gradient(jnp.zeros((num_experts,), jnp.float32).at[expert].add(ones))


def updated_expert_bias(bias: jax.Array, counts: jax.Array, rate: float) -> jax.Array:
    """Megatron's `get_updated_expert_bias`: bias[..., E] + rate * sign(mean_e(counts) - counts), counts
    [..., E] the tokens per expert summed over the step's ranks and micro-batches; an expert under the
    mean load gains `rate`, one over it loses `rate`, one at it keeps its bias."""
    counts = counts.astype(jnp.float32)
    mean = counts.sum(axis=-1, keepdims=True) / counts.shape[-1]
    return bias + jnp.sign(mean - counts) * rate


def queue_position(
    expert: jax.Array, weight: jax.Array, n_tokens: int, num_experts: int, policy: DropPolicy
) -> jax.Array:
    """Each copy's place in its expert's queue, [k*N] int32: with capacity C an expert keeps the copies
    at places 0..C-1.

    `probs`: by weight, highest first (Megatron's default: an expert keeps its C most probable copies,
    whichever choice they are); `position`: by token, earliest first (Megatron's `position`: the
    end of the rank's batch drops); `choice_then_position`: first choices before second choices,
    then by token (GShard's rule). Equal weights keep token order.
    """
    copy = jnp.arange(expert.shape[0], dtype=jnp.int32)
    token = copy % n_tokens
    if policy == DropPolicy.PROBS:
        keys = (expert, -weight.astype(jnp.float32), token)
    elif policy == DropPolicy.POSITION:
        keys = (expert, token)
    else:
        keys = (expert, copy)  # copies are choice-major: the choice, then the token
    *_, order = jax.lax.sort((*keys, copy), num_keys=len(keys))
    counts = jnp.bincount(expert, length=num_experts)
    first = jnp.cumsum(counts) - counts  # where each expert's queue starts in the sorted order
    return jnp.zeros_like(copy).at[order].set(copy - first[expert[order]])


# ---------------------------------------------------------------- losses


def switch_loss(probs_sum: jax.Array, counts: jax.Array, n_probs, n_counts, top_k: int) -> jax.Array:
    """Switch's load-balancing loss E / (k * n_probs * n_counts) * sum_e probs_sum_e * counts_e: 1 when
    balanced. probs_sum[E] sums the probabilities of n_probs tokens, counts[E] the copies per expert
    of n_counts tokens (Megatron's `switch_load_balancing_loss_func` takes one T for both)."""
    e = probs_sum.shape[-1]
    return e / (top_k * n_probs * n_counts) * jnp.sum(probs_sum * counts, axis=-1)


def load_balancing_loss(
    probs: jax.Array, expert: jax.Array, top_k: int, kind: AuxLossKind, seq_len: int, dp_axes: tuple[str, ...] = ()
) -> jax.Array:
    """The load-balancing loss of one rank's routing group (before its coefficient).

    probs[N, E]: fp32 probabilities; expert[k*N]: the chosen experts, before any drop. Kinds:
    micro_batch: Switch's over the N tokens. sequence: Switch's per sequence of `seq_len` tokens,
    averaged over sequences. global: the expert counts summed over `dp_axes` (the mesh or vmap
    axes the step's ranks are spread over; () = these tokens are the whole batch), so the mean of
    this value over the ranks is Switch's loss of every rank's tokens together, whatever the
    split: E / (k N T) * sum_e P_e C_e with P this rank's probability sums, C the summed counts
    and T = N x ranks. (Megatron's global_aux_loss divides by T^2 on each rank instead, then
    averages its grads over DP: its gradient is 1/DP of this one's; docs/moe.md.)
    """
    n, e = probs.shape
    counts = jnp.zeros((e,), jnp.float32).at[expert].add(1.0)  # copies per expert, before dropping
    if kind == AuxLossKind.SEQUENCE:
        b = n // seq_len
        seq_counts = jnp.zeros((b, e), jnp.float32).at[jnp.tile(jnp.arange(n) // seq_len, top_k), expert].add(1.0)
        return jnp.mean(switch_loss(probs.reshape(b, seq_len, e).sum(axis=1), seq_counts, seq_len, seq_len, top_k))
    if kind == AuxLossKind.GLOBAL and dp_axes:
        # Counts are piecewise constant in the params: no gradient flows through the psum.
        counts = jax.lax.psum(jax.lax.stop_gradient(counts), dp_axes)
        return switch_loss(probs.sum(axis=0), counts, n, n * jax.lax.psum(1, dp_axes), top_k)
    return switch_loss(probs.sum(axis=0), counts, n, n, top_k)


def z_loss(logits: jax.Array) -> jax.Array:
    """ST-MoE's router z-loss, mean over tokens of logsumexp(logits)^2 (Megatron's `z_loss_func`), in fp32."""
    return jnp.mean(jnp.square(jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1)))


# ---------------------------------------------------------------- capacity: slots [E, C, D]


def slots(expert: jax.Array, position: jax.Array, num_experts: int, cap: int) -> jax.Array:
    """[k*N] slot of each copy in the flattened [E, C]: expert * C + position, or E * C when dropped."""
    return jnp.where(position < cap, expert * cap + position, num_experts * cap)


def dispatch(x: jax.Array, slot: jax.Array, num_experts: int, cap: int) -> jax.Array:
    """x[N, D] -> expert slots [E, C, D] (empty slots are zero)."""
    copies = jnp.tile(x, (slot.shape[0] // x.shape[0], 1))  # [k*N, D], choice-major
    out = jnp.zeros((num_experts * cap + 1, x.shape[-1]), x.dtype).at[slot].add(copies)
    return out[:-1].reshape(num_experts, cap, x.shape[-1])  # the last row took the dropped copies


def combine(y: jax.Array, slot: jax.Array, weight: jax.Array, n_tokens: int) -> jax.Array:
    """Expert outputs y[E, C, D] -> per token the weighted sum over its choices, [N, D] in y's dtype,
    computed in the wider of y's and the weights' dtypes (Megatron's router dtype weights the outputs)."""
    rows = jnp.concatenate([y.reshape(-1, y.shape[-1]), jnp.zeros((1, y.shape[-1]), y.dtype)])
    return weighted_sum(rows[slot], weight, n_tokens).astype(y.dtype)


def weighted_sum(copies: jax.Array, weight: jax.Array, n_tokens: int) -> jax.Array:
    """copies[k*N, D] (choice-major) x weight[k*N] summed per token -> [N, D] in the wider dtype."""
    dtype = jnp.promote_types(copies.dtype, weight.dtype)
    picked = copies.astype(dtype) * weight[:, None].astype(dtype)
    return picked.reshape(-1, n_tokens, copies.shape[-1]).sum(axis=0)


def to_experts(slots: jax.Array, ep_axis: str | None) -> jax.Array:
    """[E, C, D] slots of this rank's tokens -> [E_local, ep * C, D]: the slots of this rank's
    experts from every ep rank (all-to-all over `ep_axis`; E_local = E / ep)."""
    if ep_axis is None:
        return slots
    ep = jax.lax.axis_size(ep_axis)
    got = jax.lax.all_to_all(slots, ep_axis, split_axis=0, concat_axis=0, tiled=True)  # [ep * E_l, C, D], source-major
    e_l, c = slots.shape[0] // ep, slots.shape[1]
    return got.reshape(ep, e_l, c, -1).transpose(1, 0, 2, 3).reshape(e_l, ep * c, -1)


def from_experts(y: jax.Array, ep_axis: str | None) -> jax.Array:
    """Inverse of `to_experts`: [E_local, ep * C, D] outputs -> [E, C, D] for this rank's tokens."""
    if ep_axis is None:
        return y
    ep = jax.lax.axis_size(ep_axis)
    e_l, c = y.shape[0], y.shape[1] // ep
    y = y.reshape(e_l, ep, c, -1).transpose(1, 0, 2, 3).reshape(ep * e_l, c, -1)
    return jax.lax.all_to_all(y, ep_axis, split_axis=0, concat_axis=0, tiled=True)


# ---------------------------------------------------------------- dropless: routed rows only


def sort_by_expert(expert: jax.Array, num_experts: int) -> tuple[jax.Array, jax.Array]:
    """expert[k*N] -> (order[k*N]: copy indices sorted by expert, token order kept; counts[E] int32)."""
    order = jnp.argsort(expert, stable=True).astype(jnp.int32)
    return order, jnp.bincount(expert, length=num_experts).astype(jnp.int32)


def _exclusive_cumsum(x: jax.Array) -> jax.Array:
    return jnp.cumsum(x) - x


class Exchange(NamedTuple):
    """Where this rank's expert-sorted copies go over ep, and what it receives (all [ep] int32 but
    `recv_counts`). Rank j holds experts j * E_l .. (j + 1) * E_l - 1.

    send_offsets, send_sizes: this rank's rows for rank j, in its sorted copies.
    recv_offsets, recv_sizes: rank i's rows for this rank, in the receive buffer (source-major).
    dest_offsets: where rank j puts this rank's rows in its buffer (j's recv_offsets[this rank]).
    source_offsets: where rank i's rows for this rank were in i's sorted copies.
    recv_counts[ep, E_l]: rank i's rows per local expert (the buffer's groups, source-major).
    chunk: static bound on one source's rows for one destination: N x min(k, E_l).
    """

    send_offsets: jax.Array
    send_sizes: jax.Array
    recv_offsets: jax.Array
    recv_sizes: jax.Array
    dest_offsets: jax.Array
    source_offsets: jax.Array
    recv_counts: jax.Array
    chunk: int


def plan_exchange(counts: jax.Array, n_tokens: int, top_k: int, ep_axis: str) -> Exchange:
    """The exchange of this rank's copies, sorted by expert with `counts[E]` per expert (a few
    [ep]-sized all-to-alls of counts and offsets)."""
    ep = jax.lax.axis_size(ep_axis)
    e_l = counts.shape[0] // ep
    per_dest = counts.reshape(ep, e_l)
    send_sizes = per_dest.sum(axis=1)
    send_offsets = _exclusive_cumsum(send_sizes)
    recv_counts = jax.lax.all_to_all(per_dest, ep_axis, 0, 0, tiled=True)  # [ep (source), E_l]
    recv_sizes = recv_counts.sum(axis=1)
    recv_offsets = _exclusive_cumsum(recv_sizes)
    dest_offsets = jax.lax.all_to_all(recv_offsets, ep_axis, 0, 0, tiled=True)
    source_offsets = jax.lax.all_to_all(send_offsets, ep_axis, 0, 0, tiled=True)
    chunk = n_tokens * min(top_k, e_l)
    return Exchange(
        send_offsets, send_sizes, recv_offsets, recv_sizes, dest_offsets, source_offsets, recv_counts, chunk
    )


def exchange(rows: jax.Array, ex: Exchange, buffer_rows: int, ep_axis: str) -> jax.Array:
    """This rank's sorted copies rows[k*N, D] -> the receive buffer [buffer_rows, D]: rank i's rows for
    this rank's experts at recv_offsets[i], zero after the last."""
    out = jnp.zeros_like(rows, shape=(buffer_rows, rows.shape[-1]))
    return ragged_all_to_all(
        rows, out, ex.send_offsets, ex.send_sizes, ex.dest_offsets, ex.recv_sizes, axis_name=ep_axis, chunk=ex.chunk
    )


def exchange_back(y: jax.Array, ex: Exchange, n_copies: int, ep_axis: str) -> jax.Array:
    """Inverse of `exchange`: the buffer's outputs y[buffer_rows, D] -> [k*N, D] in this rank's sorted order."""
    out = jnp.zeros_like(y, shape=(n_copies, y.shape[-1]))
    return ragged_all_to_all(
        y, out, ex.recv_offsets, ex.recv_sizes, ex.source_offsets, ex.send_sizes, axis_name=ep_axis, chunk=ex.chunk
    )


def expert_major(ex: Exchange, rows: int) -> jax.Array:
    """[rows]: for each row of the buffer ordered by local expert, then source (the grouped matmul's
    groups), its row in the exchange's source-major buffer (a permutation; rows past the received
    ones stay put). With one local expert the two orders are the same."""
    counts = ex.recv_counts  # [ep, E_l]
    n = counts.size
    source_major = ex.recv_offsets[:, None] + jnp.cumsum(counts, axis=1) - counts  # where (source, expert) starts
    sizes = counts.T.reshape(-1)  # (expert, source) groups
    group = row_groups(sizes, rows)
    g = jnp.minimum(group, n - 1)
    r = jnp.arange(rows, dtype=jnp.int32)
    return jnp.where(group < n, source_major.T.reshape(-1)[g] + r - (jnp.cumsum(sizes) - sizes)[g], r)


def ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name, chunk):
    """`jax.lax.ragged_all_to_all` with one slice per rank of `axis_name`: moves only the rows sent.

    XLA:CPU has no ragged all-to-all, so on CPU the same result comes from a dense all-to-all of
    [ranks, chunk] padded slices (`chunk` bounds one slice's rows; more bytes, the same values); the
    platform the program is lowered for picks the branch (a deviceless GPU compile gets the ragged one).
    """
    ragged = functools.partial(jax.lax.ragged_all_to_all, axis_name=axis_name)
    dense = functools.partial(_dense_ragged_all_to_all, axis_name=axis_name, chunk=chunk)
    args = (operand, output, input_offsets, send_sizes, output_offsets, recv_sizes)
    return jax.lax.platform_dependent(*args, cpu=dense, default=ragged)


def _dense_ragged_all_to_all(
    operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name, chunk
):
    """`ragged_all_to_all`'s result from a dense all_to_all of each destination's slice padded to `chunk` rows."""
    r = jnp.arange(chunk, dtype=jnp.int32)
    rows = input_offsets[:, None] + r  # [ranks, chunk]
    sent = jnp.where((r < send_sizes[:, None])[..., None], operand[jnp.minimum(rows, operand.shape[0] - 1)], 0)
    got = jax.lax.all_to_all(sent, axis_name, 0, 0, tiled=True)  # [ranks (source), chunk, ...]
    at = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)[:, None] + r
    at = jnp.where(r < recv_sizes[:, None], at, output.shape[0])  # past the end: not written
    return output.at[at.reshape(-1)].set(got.reshape(-1, *got.shape[2:]), mode="drop")


# ---------------------------------------------------------------- grouped matmul


def tile_rows(rows: int, groups: int) -> int:
    """`grouped_matmul`'s tile: the rows per group rounded down to a power of two, within
    [MIN_TILE, MAX_TILE] (and no more than the rows, rounded up to 8)."""
    per_group = max(rows // max(groups, 1), 1)
    tile = min(MAX_TILE, max(MIN_TILE, 1 << (per_group.bit_length() - 1)))
    return min(tile, -(-rows // 8) * 8)


def row_groups(group_sizes: jax.Array, rows: int) -> jax.Array:
    """[rows] the group of each row of consecutive groups of `group_sizes[G]` rows (G past the last)."""
    ends = jnp.cumsum(group_sizes)
    return jnp.cumsum(jnp.zeros((rows + 1,), jnp.int32).at[ends].add(1, mode="drop"))[:rows]


def grouped_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """y[R, F]: x[r] @ w[g] for each row r of group g; rows after the last group are 0.

    x[R, D]: rows in G consecutive groups of `group_sizes[G]` rows (some may be empty); w[G, D, F].
    The rows run in tiles (`tile_rows`): one [tile, D] x [D, F] dot per (tile, group) pair that
    shares rows, and a loop over the pairs the group sizes need, so the dots cover the routed rows
    plus at most one partial tile per group, however many rows the buffer has room for (not every
    row times every group, which is what `jax.lax.ragged_dot` costs on XLA:CPU and XLA:GPU: they
    expand it into a dense dot per group; docs/moe.md). The weight grad sums each group's tiles in
    fp32. The loops' trip counts are the data's: XLA does not know them (`jzero hlo` counts each
    loop body once).
    """
    tile = tile_rows(x.shape[0], w.shape[0])
    pad = -x.shape[0] % tile
    # One manual-axis type for both operands (inside shard_map), so the custom VJP's cotangents have
    # their primal's: adding a zero scalar of the other casts to varying, whose transpose is the psum.
    xs = jnp.pad(x, ((0, pad), (0, 0))) + jnp.zeros_like(w, shape=(), dtype=x.dtype)
    ws = w + jnp.zeros_like(x, shape=(), dtype=w.dtype)
    return _gmm(tile, xs, ws, group_sizes.astype(jnp.int32))[: x.shape[0]]


class _Tiles(NamedTuple):
    starts: jax.Array  # [G] first row of each group
    ends: jax.Array  # [G] one past its last row
    first: jax.Array  # [G] first tile a group touches
    count: jax.Array  # [G] tiles it touches
    visits: jax.Array  # [G] (tile, group) pairs through group g


def _tiles(group_sizes: jax.Array, tile: int) -> _Tiles:
    ends = jnp.cumsum(group_sizes)
    starts = ends - group_sizes
    first = starts // tile
    count = jnp.where(group_sizes > 0, (ends - 1) // tile - first + 1, 0)
    return _Tiles(starts, ends, first, count, jnp.cumsum(count))


def _tile(p: _Tiles, g, i, tile: int, n_tiles: int):
    """Group g's i-th tile -> (its first row, [tile] mask of its rows in group g)."""
    t = jnp.minimum(p.first[g] + i, n_tiles - 1)
    row = t * tile + jnp.arange(tile)
    return t * tile, (row >= p.starts[g]) & (row < p.ends[g])


def _visit(p: _Tiles, v, tile: int, n_tiles: int):
    """The v-th (tile, group) pair -> (group, first row of the tile, mask of the group's rows)."""
    g = jnp.sum(p.visits <= v)  # searchsorted(side="right"), which fails on shard_map's varying values in jax 0.10
    g = jnp.minimum(g, p.visits.shape[0] - 1)
    return (g, *_tile(p, g, v - (p.visits[g] - p.count[g]), tile, n_tiles))


def _rows_times(x, w, p: _Tiles, tile: int, transpose: bool):
    """The flat loop over (tile, group) pairs: y[r] = x[r] @ w[g] (w[g].T with `transpose`)."""
    n_tiles = x.shape[0] // tile

    def body(v, y):
        g, start, mask = _visit(p, v, tile, n_tiles)
        w_g = jax.lax.dynamic_index_in_dim(w, g, keepdims=False)
        y_t = jnp.dot(jax.lax.dynamic_slice_in_dim(x, start, tile), w_g.T if transpose else w_g,
                      preferred_element_type=jnp.float32)  # fmt: skip
        old = jax.lax.dynamic_slice_in_dim(y, start, tile)
        return jax.lax.dynamic_update_slice_in_dim(y, jnp.where(mask[:, None], y_t.astype(y.dtype), old), start, 0)

    out = w.shape[1] if transpose else w.shape[2]
    return jax.lax.fori_loop(0, p.visits[-1], body, jnp.zeros_like(x, shape=(x.shape[0], out)))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _gmm(tile, x, w, group_sizes):
    return _rows_times(x, w, _tiles(group_sizes, tile), tile, transpose=False)


def _gmm_fwd(tile, x, w, group_sizes):
    return _gmm(tile, x, w, group_sizes), (x, w, group_sizes)


def _gmm_bwd(tile, res, dy):
    x, w, group_sizes = res
    p = _tiles(group_sizes, tile)
    n_tiles = x.shape[0] // tile
    dx = _rows_times(dy, w, p, tile, transpose=True)

    def group(g, dw):  # dw[g] = sum over g's tiles of x_t^T dy_t, masked to g's rows, in fp32
        def add_tile(i, acc):
            start, mask = _tile(p, g, i, tile, n_tiles)
            dy_t = jnp.where(mask[:, None], jax.lax.dynamic_slice_in_dim(dy, start, tile), 0)
            x_t = jax.lax.dynamic_slice_in_dim(x, start, tile)
            return acc + jax.lax.dot_general(x_t, dy_t, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)

        acc = jax.lax.fori_loop(0, p.count[g], add_tile, jnp.zeros_like(dy, shape=w.shape[1:], dtype=jnp.float32))
        return jax.lax.dynamic_update_index_in_dim(dw, acc.astype(dw.dtype), g, 0)

    dw = jax.lax.fori_loop(0, w.shape[0], group, jnp.zeros_like(w))
    return dx, dw, None


_gmm.defvjp(_gmm_fwd, _gmm_bwd)
