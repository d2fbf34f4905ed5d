"""The DP collectives of every layout, and the HSDP rule they follow, written once.

A grad is reduced over its DP domain, `inner` axes (dp, and ep for a dense param) then the `outer`
replica axes (dp_outer under HSDP):

  no split dim (DDP without HSDP, or a tensor no dim of which divides the DP size): one psum over both;
  else a psum_scatter over `inner` on the split dim, then across `outer` a psum_scatter (HSDP
  `outer_strategy: optim`, the state split there too) or a psum (`no_shard`); DDP under HSDP
  all-gathers the reduced shard back over `inner` (`regather`): a hierarchical all-reduce, of whose
  bytes only 1/d_inner cross dp_outer.

Rank r of the domain keeps its shard `[r*S/d, (r+1)*S/d)`, inner rank major. `gather` is the inverse:
across `outer` first (where the state is split there), then `inner`. The spec path calls these on one
param (`units.Hook`), the flat path on one bucket (`flat/collectives.py`), both inside a shard_map
manual over the axes they name; dtypes are the caller's (the reduce dtype's grads, the param dtype's or
a quantized gather's values, `flat/quantize.py`).
"""

from __future__ import annotations

import jax


def reduce(
    g: jax.Array, dim: int | None, inner: tuple[str, ...], outer: tuple[str, ...], *, outer_scatter: bool,
    regather: bool = False,
) -> jax.Array:  # fmt: skip
    """`g` summed over `inner` + `outer` as the module docstring says; `dim`: the split dim (an index into
    `g`'s dims), None: one psum. Returns this rank's shard of the sum (whole where nothing splits it)."""
    if dim is None:
        return jax.lax.psum(g, inner + outer)
    g = jax.lax.psum_scatter(g, inner, scatter_dimension=dim, tiled=True)
    if regather:
        # typed invariant over `inner` (jax 0.10-0.12: public `to=`; 0.12 made `all_gather_invariant` private)
        return jax.lax.all_gather(jax.lax.psum(g, outer), inner, axis=dim, tiled=True, to="invarying")
    if outer and outer_scatter:
        return jax.lax.psum_scatter(g, outer, scatter_dimension=dim, tiled=True)
    return jax.lax.psum(g, outer) if outer else g


def gather(x: jax.Array, dim: int, inner: tuple[str, ...], outer: tuple[str, ...] = ()) -> jax.Array:
    """The inverse of `reduce`'s layout: this rank's shard -> the whole tensor on `dim`, all-gathered across
    `outer` first (pass it where the reduction scattered there), then over `inner`."""
    if outer:
        x = jax.lax.all_gather(x, outer, axis=dim, tiled=True)
    return jax.lax.all_gather(x, inner, axis=dim, tiled=True) if inner else x
