"""How a global batch maps onto data-parallel ranks and microbatches (every layout).

A batch leaf is `[B, ...]` with B split over the dense DP domain, rank-major: rank r
holds rows `[r*B/n, (r+1)*B/n)`, and its microbatch m is the m-th contiguous block of those.
Each rank's grad of one micro-batch is scaled by `grad_scale` before it is reduced.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jzero.errors import ConfigError
from jzero.mesh import BATCH_AXES, axes_size

PyTree = Any


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Batch leaves `[B, ...]`: B split over the dense DP domain."""
    return NamedSharding(mesh, P(BATCH_AXES))


def grad_scale(mesh: Mesh, microbatches: int) -> float:
    """Megatron's gradient_scaling_factor, 1 / (dense DP size x micro-batches), dense and expert grads alike:
    the reduced sum of the scaled grads is the mean over the global batch."""
    return 1.0 / (axes_size(mesh, BATCH_AXES) * microbatches)


def split_batch(batch: PyTree, n_dp: int, microbatches: int) -> PyTree:
    """`[B, ...]` -> `[microbatches, n_dp, B / (n_dp * microbatches), ...]`.

    With n_dp = 1 (inside shard_map, on one rank's rows) it splits the rank's microbatches. Raises
    ConfigError (at trace time) where n_dp x microbatches does not divide B.
    """

    def split(x):
        b, rest = divmod(x.shape[0], n_dp * microbatches)
        if rest or not b:
            parts = f"{n_dp} DP ranks x {microbatches} micro-batches" if n_dp > 1 else f"{microbatches} micro-batches"
            rows = f"the batch's {x.shape[0]} rows" if n_dp > 1 else f"a DP rank's {x.shape[0]} batch rows"
            raise ConfigError(f"{rows} do not split into {parts}: give the step a multiple of DP size x micro-batches")
        return jnp.swapaxes(x.reshape(n_dp, microbatches, b, *x.shape[1:]), 0, 1)

    return jax.tree.map(split, batch)
