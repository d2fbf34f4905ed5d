"""Token routing for a mixture-of-experts layer: top-k softmax router, capacity, dispatch, combine.

One rank routes its own N tokens (Switch/GShard, Megatron's `topk` router with
`moe_router_pre_softmax`): probabilities p[N, E] = softmax(x @ router), each token goes to
its top_k experts with weight p. Expert e takes at most C tokens (`capacity`), first
choices before second choices and, within a choice, in token order; the rest are dropped
(their weight is 0). Dispatch puts token copies in slots `[E, C, D]`; with expert
parallelism `exchange` sends each expert's slots to the ep rank that holds it
(all-to-all over ep) and brings the outputs back the same way.

A single device running the same tokens through `route` routes them identically: the
routing of a rank depends only on its own tokens.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp


class Routing(NamedTuple):
    """Where each of the top_k * N token copies goes (choice-major: copy c * N + n is token n's
    c-th choice).

    slot: [k*N] int32, expert * C + position, or E * C when dropped.
    weight: [k*N] float32, the router probability, 0 when dropped.
    aux_loss: Switch's load-balancing loss E / (k N^2) * sum_e P_e count_e (Megatron's
      `switch_load_balancing_loss_func`), before its coefficient.
    dropped_frac: fraction of the k*N copies over capacity.
    """

    slot: jax.Array
    weight: jax.Array
    aux_loss: jax.Array
    dropped_frac: jax.Array


def capacity(n_tokens: int, num_experts: int, top_k: int, capacity_factor: float | None) -> int:
    """Slots per expert: ceil(factor * top_k * N / E), at most N (dropless: N, no copy is ever dropped)."""
    if capacity_factor is None:
        return n_tokens
    return min(n_tokens, math.ceil(capacity_factor * top_k * n_tokens / num_experts))


def route(x: jax.Array, router: jax.Array, top_k: int, cap: int) -> Routing:
    """Routes tokens x[N, D] with the router kernel [D, E], in fp32."""
    n, e = x.shape[0], router.shape[-1]
    probs = jax.nn.softmax(jnp.dot(x.astype(jnp.float32), router.astype(jnp.float32)), axis=-1)  # [N, E]
    weight, expert = jax.lax.top_k(probs, top_k)  # [N, k]
    expert, weight = expert.T.reshape(-1), weight.T.reshape(-1)  # choice-major [k*N]
    chosen = jax.nn.one_hot(expert, e, dtype=jnp.int32)  # [k*N, E]
    position = jnp.sum((jnp.cumsum(chosen, axis=0) - 1) * chosen, axis=-1)  # place in its expert's queue
    keep = position < cap
    slot = jnp.where(keep, expert * cap + position, e * cap)
    counts = jnp.sum(chosen, axis=0).astype(jnp.float32)  # copies per expert, before dropping
    aux = e / (top_k * n * n) * jnp.sum(jnp.sum(probs, axis=0) * counts)
    dropped = 1.0 - jnp.mean(keep.astype(jnp.float32))
    return Routing(slot, jnp.where(keep, weight, 0.0), aux, dropped)


def dispatch(x: jax.Array, r: Routing, num_experts: int, cap: int) -> jax.Array:
    """x[N, D] -> expert slots [E, C, D] (empty slots are zero)."""
    copies = jnp.tile(x, (r.slot.shape[0] // x.shape[0], 1))  # [k*N, D], choice-major
    slots = jnp.zeros((num_experts * cap + 1, x.shape[-1]), x.dtype).at[r.slot].add(copies)
    return slots[:-1].reshape(num_experts, cap, x.shape[-1])  # the last row took the dropped copies


def combine(y: jax.Array, r: Routing, n_tokens: int) -> jax.Array:
    """Expert outputs y[E, C, D] -> per token the weighted sum over its choices, [N, D]."""
    rows = jnp.concatenate([y.reshape(-1, y.shape[-1]), jnp.zeros((1, y.shape[-1]), y.dtype)])
    picked = rows[r.slot] * r.weight[:, None].astype(y.dtype)  # [k*N, D]
    return picked.reshape(-1, n_tokens, y.shape[-1]).sum(axis=0)


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
