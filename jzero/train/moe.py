"""Token routing for a mixture-of-experts layer: router, capacity and drop policy, the router's
losses, and the two ways token copies reach their experts.

One rank routes its own N tokens (Megatron's `topk` router with `moe_router_pre_softmax`):
logits[N, E] = x @ router in the router dtype, p = softmax(logits) in fp32, and each token goes to
its top_k experts with weight p (no renormalisation). Copies are choice-major: copy c * N + n is
token n's c-th choice.

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

from jzero.config import AuxLossKind, DropPolicy

# Rows per tile of `grouped_matmul`: one [TILE, D] x [D, F] dot per tile a group's rows touch. Big
# enough for a GPU GEMM to run near its peak, small enough that the tiles groups share (at most one
# extra per group) stay a small share of the routed rows at real sizes.
TILE = 128

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


def choose(logits: jax.Array, top_k: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """logits[N, E] -> (probs[N, E] fp32, expert[k*N] int32, weight[k*N] in the logits' dtype).

    Softmax in fp32 whatever the logits' dtype; each token's top_k experts by probability (ties:
    the lower expert), weighted by their probability cast to the logits' dtype (Megatron's
    `topk_routing_with_score_function` with `use_pre_softmax`)."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weight, expert = jax.lax.top_k(probs, top_k)  # [N, k]
    return probs, expert.T.reshape(-1), weight.T.reshape(-1).astype(logits.dtype)


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
    return jnp.argsort(expert, stable=True).astype(jnp.int32), jnp.bincount(expert, length=num_experts).astype(
        jnp.int32
    )


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


def grouped_matmul(
    x: jax.Array, w: jax.Array, group_sizes: jax.Array, group_weight: jax.Array, visits: int | None = None
) -> jax.Array:
    """y[R, F] = x[r] @ w[group_weight[g]] for each row r of group g; rows after the last group are 0.

    x[R, D]: rows in consecutive groups of `group_sizes[G]` rows; w[W, D, F]; group_weight[G]: each
    group's weight index. The rows run in tiles of `TILE`: one dot per (tile, group) pair that
    shares rows, so the dots cover the routed rows plus at most one partial tile per group, not
    every row times every expert (as `jax.lax.ragged_dot` does on XLA:CPU and XLA:GPU, which expand
    it into a dense dot per group; docs/moe.md). `visits`: a static bound on those pairs (the loop
    then has a known trip count, its extra turns write nothing); None: run exactly the pairs the
    group sizes need (a loop whose trip count the data sets).
    """
    tile = min(TILE, -(-x.shape[0] // 8) * 8)
    pad = -x.shape[0] % tile
    # One manual-axis type for both operands (inside shard_map), so the custom VJP's cotangents have
    # their primal's: adding a zero scalar of the other casts to varying, whose transpose is the psum.
    xs = jnp.pad(x, ((0, pad), (0, 0))) + jnp.zeros_like(w, shape=(), dtype=x.dtype)
    ws = w + jnp.zeros_like(x, shape=(), dtype=w.dtype)
    y = _gmm(tile, visits, xs, ws, group_sizes.astype(jnp.int32), group_weight.astype(jnp.int32))
    return y[: x.shape[0]]


def row_groups(group_sizes: jax.Array, rows: int) -> jax.Array:
    """[rows] the group of each row of consecutive groups of `group_sizes[G]` rows (G past the last)."""
    ends = jnp.cumsum(group_sizes)
    return jnp.cumsum(jnp.zeros((rows + 1,), jnp.int32).at[ends].add(1, mode="drop"))[:rows]


def max_visits(rows: int, groups: int) -> int:
    """The most (tile, group) pairs `grouped_matmul` runs on `rows` rows in `groups` groups."""
    tile = min(TILE, -(-rows // 8) * 8)
    return -(-rows // tile) + groups - 1


class _Visits(NamedTuple):
    starts: jax.Array  # [G] first row of each group
    ends: jax.Array  # [G] one past its last row
    first: jax.Array  # [G] first tile a group touches
    ends_v: jax.Array  # [G] cumulative (tile, group) pairs through group g


def _plan_visits(group_sizes: jax.Array, tile: int) -> _Visits:
    ends = jnp.cumsum(group_sizes)
    starts = ends - group_sizes
    first = starts // tile
    n = jnp.where(group_sizes > 0, (ends - 1) // tile - first + 1, 0)
    return _Visits(starts, ends, first, jnp.cumsum(n))


def _visit(v, p: _Visits, tile: int, n_tiles: int):
    """Visit v -> (group, first row of its tile, [tile] mask of the tile's rows in that group)."""
    g = jnp.sum(p.ends_v <= v)  # searchsorted(side="right"), which fails on shard_map's varying values in jax 0.10
    gc = jnp.minimum(g, p.ends_v.shape[0] - 1)
    before = jnp.where(gc > 0, p.ends_v[jnp.maximum(gc - 1, 0)], 0)  # pairs of the groups before gc
    t = jnp.clip(p.first[gc] + v - before, 0, n_tiles - 1)
    row = t * tile + jnp.arange(tile)
    mask = (g < p.ends_v.shape[0]) & (row >= p.starts[gc]) & (row < p.ends[gc])
    return gc, t * tile, mask


def _tile_dot(a, b):
    return jnp.dot(a, b, preferred_element_type=jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _gmm(tile, visits, x, w, group_sizes, group_weight):
    return _gmm_fwd(tile, visits, x, w, group_sizes, group_weight)[0]


def _loop(visits, p: _Visits, body, init):
    bound = p.ends_v[-1] if visits is None else visits
    return jax.lax.fori_loop(0, bound, body, init)


def _gmm_fwd(tile, visits, x, w, group_sizes, group_weight):
    p = _plan_visits(group_sizes, tile)
    n_tiles = x.shape[0] // tile

    def body(v, y):
        g, start, mask = _visit(v, p, tile, n_tiles)
        w_g = jax.lax.dynamic_index_in_dim(w, group_weight[g], keepdims=False)
        y_t = _tile_dot(jax.lax.dynamic_slice_in_dim(x, start, tile), w_g).astype(y.dtype)
        old = jax.lax.dynamic_slice_in_dim(y, start, tile)
        return jax.lax.dynamic_update_slice_in_dim(y, jnp.where(mask[:, None], y_t, old), start, 0)

    y = _loop(visits, p, body, jnp.zeros_like(x, shape=(x.shape[0], w.shape[-1])))
    return y, (x, w, group_sizes, group_weight)


def _gmm_bwd(tile, visits, res, dy):
    x, w, group_sizes, group_weight = res
    p = _plan_visits(group_sizes, tile)
    n_tiles = x.shape[0] // tile

    def body(v, carry):
        dx, dw = carry
        g, start, mask = _visit(v, p, tile, n_tiles)
        i = group_weight[g]
        dy_t = jnp.where(mask[:, None], jax.lax.dynamic_slice_in_dim(dy, start, tile), 0)
        dx_t = _tile_dot(dy_t, jax.lax.dynamic_index_in_dim(w, i, keepdims=False).T).astype(dx.dtype)
        old = jax.lax.dynamic_slice_in_dim(dx, start, tile)
        dx = jax.lax.dynamic_update_slice_in_dim(dx, jnp.where(mask[:, None], dx_t, old), start, 0)
        dw_i = jax.lax.dynamic_index_in_dim(dw, i, keepdims=True)
        dw_t = _tile_dot(jax.lax.dynamic_slice_in_dim(x, start, tile).T, dy_t)  # masked rows of dy are 0
        return dx, jax.lax.dynamic_update_index_in_dim(dw, dw_i + dw_t[None], i, 0)

    dx, dw = _loop(visits, p, body, (jnp.zeros_like(x), jnp.zeros_like(w, dtype=jnp.float32)))
    return dx, dw.astype(w.dtype), None, None


_gmm.defvjp(_gmm_fwd, _gmm_bwd)
