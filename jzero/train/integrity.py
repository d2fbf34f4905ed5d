"""Fingerprints of checkpointed arrays, computed on the devices where the arrays live.

orbax's zarr3 arrays carry a crc32c of each shard file's index only (`index_codecs`), not of the
array bytes, so data overwritten on disk loads silently. jzero therefore stores one 32-bit
fingerprint per array in each step's metadata and checks it after every restore.

The fingerprint depends on the global array's values and shape only:
    sum over elements i of mix(bits(x[i]) ^ mix(i + 1))   in uint32 arithmetic, which wraps.
Integer addition is associative and commutative, so the sum is the same for every sharding, mesh
and process count (a checkpoint restored onto another mesh checks against the saver's numbers),
and XLA computes it shard by shard with one scalar all-reduce: no array is gathered.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


def _mix(h: jax.Array) -> jax.Array:
    """MurmurHash3's 32-bit finaliser: every input bit flips each output bit with probability ~1/2."""
    h = h ^ (h >> 16)
    h = h * np.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * np.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def _bits(x: jax.Array) -> jax.Array:
    """The element bits of `x` as uint32 (bf16/fp16 and 8-bit types zero-extended)."""
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    unsigned = {4: jnp.uint32, 2: jnp.uint16, 1: jnp.uint8}.get(x.dtype.itemsize)
    if unsigned is None:
        raise TypeError(f"no fingerprint for dtype {x.dtype}")
    return lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)


def _linear_index(shape: tuple[int, ...]) -> jax.Array:
    """Each element's row-major position (mod 2**32), built in `shape` so it shards like the array."""
    index, stride = jnp.zeros(shape, jnp.uint32), 1
    for dim in reversed(range(len(shape))):
        index = index + lax.broadcasted_iota(jnp.uint32, shape, dim) * np.uint32(stride % 2**32)
        stride *= shape[dim]
    return index


def fingerprint(x: jax.Array) -> jax.Array:
    """The array's fingerprint: a replicated uint32 scalar."""
    return jnp.sum(_mix(_bits(x) ^ _mix(_linear_index(x.shape) + np.uint32(1))), dtype=jnp.uint32)


@jax.jit
def fingerprints(tree):
    """`fingerprint` of every leaf of `tree` (one jitted program; the leaves keep their shardings)."""
    return jax.tree.map(fingerprint, tree)


def mismatched(saved: dict[str, int], arrays: dict[str, jax.Array]) -> list[str]:
    """Names of the `arrays` (by name) whose fingerprint differs from the one `saved` with them, sorted."""
    sums = jax.device_get(fingerprints(arrays))
    return sorted(n for n, f in saved.items() if int(sums[n]) != f)
